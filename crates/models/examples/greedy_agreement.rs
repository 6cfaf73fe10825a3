//! mlx-spec's greedy decoding in each precision against reference answers (mlx-lm's, from
//! `xtask/scripts/mlx_lm_greedy_ids.py`):
//! `cargo run --release -p models --example greedy_agreement -- MODEL_DIR IDS_JSONL [f32,bf16,int8]`.
//!
//! Per precision of the quantized matmuls, over every answer token of IDS_JSONL
//! (`{"prompt": [ids], "answer": [ids]}` per line):
//! - teacher-forced: the share of answer positions where the model's argmax, given the prompt
//!   and the reference answer so far, is the reference token (one forward per sequence);
//! - free-running: greedy decoding of as many tokens as the reference answer (no EOS stop);
//!   the tokens before the first difference, in all and per sequence, and the sequences equal
//!   to the reference throughout.
//!
//! Prints one JSON line per precision.
use mlx_core::{Dtype, KernelPolicy, Precision};
use models::generate::ids;
use models::{GenerateParams, LoadOptions, Sampler, load_model};

struct Record {
    prompt: Vec<u32>,
    answer: Vec<u32>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (dir, path) = (std::path::Path::new(&args[1]), &args[2]);
    let precisions: Vec<Precision> = args
        .get(3)
        .map_or("f32,int8", String::as_str)
        .split(',')
        .map(|p| Precision::parse(p).unwrap_or_else(|| panic!("{p}: expected {}", Precision::EXPECTED)))
        .collect();
    let records: Vec<Record> = std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let list = |k: &str| -> Vec<u32> {
                v[k].as_array()
                    .unwrap_or_else(|| panic!("{path}: no {k} list"))
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect()
            };
            Record { prompt: list("prompt"), answer: list("answer") }
        })
        .filter(|r| !r.answer.is_empty())
        .collect();
    let total: usize = records.iter().map(|r| r.answer.len()).sum();
    for precision in precisions {
        let options =
            LoadOptions { dtype: Some(Dtype::Float32), kernels: KernelPolicy::default().with_precision(precision) };
        let model = load_model(dir, &options).unwrap();
        let (mut forced, mut prefix, mut whole, mut prefixes) = (0usize, 0usize, 0usize, Vec::new());
        for r in &records {
            let mut seq = r.prompt.clone();
            seq.extend(&r.answer[..r.answer.len() - 1]);
            let mut cache = model.make_cache();
            let logits = model.forward(&ids(&seq).unwrap(), &mut cache).unwrap();
            let top = logits.argmax(-1, false).unwrap().reshape(&[-1]).unwrap().to_vec::<u32>().unwrap();
            forced += top[r.prompt.len() - 1..].iter().zip(&r.answer).filter(|(a, b)| a == b).count();

            let params = GenerateParams { max_tokens: r.answer.len(), sampler: Sampler::default(), eos: vec![] };
            let mut got = Vec::with_capacity(r.answer.len());
            models::generate(&model, &r.prompt, &params, |t| {
                got.push(t);
                true
            })
            .unwrap();
            let same = got.iter().zip(&r.answer).take_while(|(a, b)| a == b).count();
            prefix += same;
            whole += usize::from(same == r.answer.len());
            prefixes.push(same);
        }
        println!(
            "{}",
            serde_json::json!({
                "precision": precision.name(),
                "sequences": records.len(),
                "answer_tokens": total,
                "teacher_forced_agreement": forced as f64 / total as f64,
                "teacher_forced_equal": forced,
                "free_running_tokens_before_first_difference": prefix,
                "free_running_share_before_first_difference": prefix as f64 / total as f64,
                "free_running_sequences_equal": whole,
                "free_running_prefix_per_sequence": prefixes,
            })
        );
    }
}
