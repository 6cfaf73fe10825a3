//! The speculative decoding benchmark behind `cargo xtask bench spec` (run it through xtask,
//! which builds it in release mode and runs mlx-lm on the same prompts beside it).
//!
//! Loads one target (and up to two draft models, when given) once, then for each prompt of a
//! prompt set (the first `--num-prompts` input-grounded and free-form prompts) runs greedy
//! plain decoding, n-gram speculative decoding (γ 10, constant and heuristic schedules) and
//! two-model speculative decoding (γ 3; `--draft-b`, e.g. a 4-bit copy of the drafter, as a
//! second two-model arm), interleaved per prompt so machine noise hits every arm alike. With
//! `--temp` above 0 every arm samples (prompt `i` with seed `i`; exact match keeps the outputs
//! equal to plain decoding's), and each two-model arm gets a `-greedy-draft` twin whose draft
//! model picks the argmax instead of sampling with the request's keys, the drafting of
//! earlier versions: the acceptance gained by coupled drafting, side by side. Reports per prompt kind the
//! decode tokens/s of each arm (emitted tokens over decode time, prefill excluded), its
//! ratio to plain, tau and acceptance rate, and whether every output equaled plain's; with
//! `--json FILE` also the raw numbers.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use models::generate::generate;
use models::tokenizer::Tokenizer;
use models::{GenerateParams, LoadOptions, Sampler, Transformer, load_model};
use spec::ngram::{DraftSchedule, NgramProvider};
use spec::prompts::{PromptKind, load_prompts};
use spec::two_model::{DraftSampling, TwoModelProvider, check_tokenizers};
use spec::{DraftProvider, speculative_generate};

#[derive(Parser)]
struct Args {
    /// Target model directory.
    #[arg(long)]
    target: PathBuf,
    /// Draft model directory (the two-model arm is skipped without it).
    #[arg(long)]
    draft: Option<PathBuf>,
    /// A second draft model for a second two-model arm (`two-model-b`).
    #[arg(long)]
    draft_b: Option<PathBuf>,
    /// Prompt set (JSON lines, see `spec::prompts`).
    #[arg(long)]
    prompts: PathBuf,
    /// Prompts of each kind (grounded, free-form).
    #[arg(long, default_value_t = 4)]
    num_prompts: usize,
    /// Tokens to generate per prompt.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Drafts per round for the n-gram arm.
    #[arg(long, default_value_t = 10)]
    ngram_draft_tokens: usize,
    /// Drafts per round for the two-model arm.
    #[arg(long, default_value_t = 3)]
    num_draft_tokens: usize,
    /// Compute dtype of both models: float32, float16 or bfloat16.
    #[arg(long, default_value = "float32")]
    dtype: String,
    /// Sampling temperature of every arm (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    /// Nucleus sampling mass (0 or 1 = off).
    #[arg(long, default_value_t = 0.0)]
    top_p: f32,
    /// Top-k filter (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Min-p filter (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Write the per-prompt numbers as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Totals of one arm over the prompts of one kind.
#[derive(Default, Clone, serde::Serialize)]
struct Arm {
    tokens: usize,
    decode_s: f64,
    rounds: usize,
    accepted: usize,
    drafted: usize,
    mismatches: usize,
}

impl Arm {
    fn tps(&self) -> f64 {
        self.tokens as f64 / self.decode_s.max(1e-9)
    }
}

fn main() -> Result<()> {
    let a = Args::parse();
    let dtype = mlx_core::Dtype::from_name(&a.dtype).with_context(|| format!("--dtype {}", a.dtype))?;
    let load = LoadOptions { dtype: Some(dtype) };
    let target = load_model(&a.target, &load).with_context(|| format!("loading {}", a.target.display()))?;
    let tok = Tokenizer::from_dir(&a.target)?;
    let draft_model = |dir: &PathBuf, sampling: DraftSampling| -> Result<Box<dyn DraftProvider>> {
        let name = dir.display().to_string();
        check_tokenizers(&Tokenizer::from_dir(dir)?, &tok, &name, &a.target.display().to_string())?;
        Ok(Box::new(TwoModelProvider::new(load_model(dir, &load)?, name).with_sampling(sampling)))
    };
    // (name, provider, drafts per round); "plain" is slot 0.
    let mut providers: Vec<(&str, Box<dyn DraftProvider>, usize)> = vec![
        ("ngram", Box::new(NgramProvider::default()), a.ngram_draft_tokens),
        (
            "ngram-heur",
            Box::new(NgramProvider::default().with_schedule(DraftSchedule::Heuristic)),
            a.ngram_draft_tokens,
        ),
    ];
    let sampled = a.temp > 0.0;
    for (name, greedy_name, dir) in
        [("two-model", "two-model-greedy-draft", &a.draft), ("two-model-b", "two-model-b-greedy-draft", &a.draft_b)]
    {
        if let Some(dir) = dir {
            providers.push((name, draft_model(dir, DraftSampling::Request)?, a.num_draft_tokens));
            if sampled {
                providers.push((greedy_name, draft_model(dir, DraftSampling::Greedy)?, a.num_draft_tokens));
            }
        }
    }
    let all = load_prompts(&a.prompts)?;
    let sampler = Sampler { temp: a.temp, top_p: a.top_p, top_k: a.top_k, min_p: a.min_p, seed: 0 };
    let base = GenerateParams { max_tokens: a.max_tokens, sampler, eos: tok.eos_ids().to_vec() };

    let arms: Vec<&str> = std::iter::once("plain").chain(providers.iter().map(|p| p.0)).collect();
    let mut rows = Vec::new();
    let mut totals: Vec<(PromptKind, Vec<Arm>)> = Vec::new();
    for kind in [PromptKind::Grounded, PromptKind::Free] {
        let mut sums: Vec<Arm> = vec![Arm::default(); arms.len()];
        for (i, p) in all.iter().filter(|p| p.kind == kind).take(a.num_prompts).enumerate() {
            let ids = p.ids(&tok)?;
            let params = GenerateParams { sampler: Sampler { seed: i as u64, ..base.sampler.clone() }, ..base.clone() };
            let (want, secs) = plain(&target, &ids, &params)?;
            sums[0].tokens += want.len();
            sums[0].decode_s += secs;
            let mut row = serde_json::json!({"source": p.source, "prompt_tokens": ids.len(), "plain_tps": want.len() as f64 / secs});
            for (slot, (_, provider, n)) in providers.iter().enumerate().map(|(i, p)| (i + 1, p)) {
                let n = *n;
                let mut source = provider.open(&target, &params.sampler)?;
                let mut got = Vec::new();
                let stats = speculative_generate(&target, source.as_mut(), &ids, &params, n, |t| {
                    got.push(t);
                    true
                })?;
                let arm = &mut sums[slot];
                arm.tokens += stats.emitted;
                arm.decode_s += stats.decode_ms / 1e3;
                arm.rounds += stats.rounds;
                arm.accepted += stats.accepted;
                arm.drafted += stats.drafted;
                arm.mismatches += usize::from(got != want);
                row[format!("{}_tps", arms[slot])] = stats.tokens_per_s.into();
                row[format!("{}_tau", arms[slot])] = stats.tau.into();
            }
            eprintln!("{row}");
            rows.push(row);
        }
        totals.push((kind, sums));
    }

    let shown = |d: &Option<PathBuf>| d.as_ref().map_or("-".into(), |d| d.display().to_string());
    println!("\ntarget {} ({}), draft {}, draft-b {}", a.target.display(), a.dtype, shown(&a.draft), shown(&a.draft_b));
    println!("sampler: {:?}", base.sampler);
    println!(
        "{:<10} {:<12} {:>8} {:>7} {:>6} {:>7} {:>9}",
        "prompts", "arm", "tok/s", "x plain", "tau", "accept", "mismatch"
    );
    for (kind, sums) in &totals {
        for (i, arm) in sums.iter().enumerate() {
            if arm.tokens == 0 {
                continue;
            }
            let tau = if arm.rounds > 0 { (arm.accepted + arm.rounds) as f64 / arm.rounds as f64 } else { 1.0 };
            let rate = if arm.drafted > 0 { arm.accepted as f64 / arm.drafted as f64 } else { 0.0 };
            println!(
                "{:<10} {:<12} {:>8.2} {:>7.2} {:>6.2} {:>7.2} {:>9}",
                format!("{kind:?}").to_lowercase(),
                arms[i],
                arm.tps(),
                arm.tps() / sums[0].tps(),
                tau,
                rate,
                arm.mismatches
            );
        }
    }
    if let Some(path) = &a.json {
        let report = serde_json::json!({"prompts": rows, "totals": totals.iter().map(|(k, s)| serde_json::json!({"kind": k, "arms": s})).collect::<Vec<_>>()});
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if totals.iter().any(|(_, s)| s.iter().any(|a| a.mismatches > 0)) {
        bail!("a speculative output differed from plain decoding");
    }
    Ok(())
}

/// Greedy plain decoding; returns the tokens and the decode time in seconds (prefill excluded).
fn plain(target: &Transformer, ids: &[u32], params: &GenerateParams) -> Result<(Vec<u32>, f64)> {
    let mut out = Vec::new();
    let t0 = Instant::now();
    let stats = generate(target, ids, params, |t| {
        out.push(t);
        true
    })?;
    let decode_s = if stats.generation_tps > 0.0 {
        stats.generation_tokens as f64 / stats.generation_tps
    } else {
        t0.elapsed().as_secs_f64()
    };
    Ok((out, decode_s))
}
