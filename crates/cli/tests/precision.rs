//! The opt-in bf16 and int8 precisions end to end on SmolLM2-135M-Instruct 4-bit (fetched into
//! the cache on first use): their fidelity against f32 (`mlx-spec perplexity
//! --reference-precision f32` on the committed prompt set: bf16 within 0.5% of f32's
//! perplexity with top-1 agreement at least 97%; int8, which measured +1.0-1.1% on this 135M
//! model (+0.4% on Qwen2.5-Coder-1.5B; `docs/measurements/2026-12-03-int8/`), within 2% with
//! at least 92%), speculation in each equal to its plain
//! decoding (window rows equal one-token rows in those precisions too), and clear errors for
//! bad flags and data. On a CPU without AVX512_BF16 / AVX512_VNNI they run portable code with
//! the same bits, 10-100x slower: the tests then score one sequence and generate fewer tokens.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn smollm2() -> PathBuf {
    models::default_model::ensure_default_model(&mut |_| {}).expect("SmolLM2 fixture")
}

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(rel)
}

fn mlx_spec(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mlx-spec"))
        .args(args)
        .env_remove("MLX_SPEC_LOG")
        .env_remove("MLX_SPEC_PRECISION")
        .output()
        .expect("run mlx-spec")
}

/// Whether `precision` runs on its instructions here (`mlx-spec info --json` names the kernel).
fn in_hardware(precision: &str) -> bool {
    let out = Command::new(env!("CARGO_BIN_EXE_mlx-spec"))
        .args(["info", "--json"])
        .env("MLX_SPEC_PRECISION", precision)
        .output()
        .expect("run mlx-spec info");
    let v: Value = serde_json::from_slice(&out.stdout).expect("info --json");
    v["qmm_isa"].as_str().is_some_and(|isa| !isa.starts_with("portable"))
}

fn ok_stdout(args: &[&str]) -> String {
    let out = mlx_spec(args);
    assert!(out.status.success(), "mlx-spec {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn bf16_perplexity_is_within_half_a_percent_of_f32() {
    perplexity_is_close_to_f32("bf16", 0.005, 0.97, 1e-3);
}

#[test]
fn int8_perplexity_is_within_half_a_percent_of_f32() {
    // +0.24% here with q/k/v, o and down in f32 (`Precision::of`); every product in int8 lay at
    // +0.6% to +1.1% on the MT-Bench, HumanEval and GSM8K sets. At mlx-lm's sequence length
    // (512, `perplexity`'s default, the documented measurement's): in 256-token sequences int8
    // sits at the bound itself (+0.46% to +0.51% on those sets, +0.32% to +0.80% after the f32
    // panels took MLX's per-group dot, KL unchanged at 4-6e-3: the rounding reshuffled,
    // `docs/measurements/2026-12-07-zen4/`).
    perplexity_is_close_to_f32("int8", 0.005, 0.95, 0.01);
}

/// `precision`'s perplexity within `within` (relative) of f32's, top-1 agreement at least
/// `agreement`, mean KL divergence below `kl`.
fn perplexity_is_close_to_f32(precision: &str, within: f64, agreement: f64, kl: f64) {
    let model = smollm2();
    let data = fixture("fixtures/prompts/spec-equality.jsonl");
    let hardware = in_hardware(precision);
    let mut args = vec![
        "perplexity",
        "--model",
        model.to_str().unwrap(),
        "--data-path",
        data.to_str().unwrap(),
        "--sequence-length",
        "512",
        "--precision",
        precision,
        "--reference-precision",
        "f32",
        "--json",
    ];
    if !hardware {
        args.extend(["--num-samples", "1"]);
    }
    let v: Value = serde_json::from_str(ok_stdout(&args).trim()).unwrap();
    let (ratio, agree) = (v["perplexity_ratio"].as_f64().unwrap(), v["top1_agreement"].as_f64().unwrap());
    assert!(v["positions"].as_u64().unwrap() >= if hardware { 2000 } else { 255 }, "{v}");
    assert!((1.0 - within..=1.0 + within).contains(&ratio), "perplexity ratio {precision} / f32 {ratio}: {v}");
    assert!(agree >= agreement, "top-1 agreement {agree}: {v}");
    assert!(v["mean_kl_divergence"].as_f64().unwrap() < kl, "{v}");
    assert!(v["perplexity"].as_f64().unwrap() > 1.0, "{v}");
}

#[test]
fn bf16_speculation_equals_bf16_plain_decoding() {
    speculation_equals_plain_decoding("bf16");
}

#[test]
fn int8_speculation_equals_int8_plain_decoding() {
    speculation_equals_plain_decoding("int8");
}

fn speculation_equals_plain_decoding(precision: &str) {
    let model = smollm2();
    let prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n";
    let tokens = if in_hardware(precision) { "40" } else { "6" };
    let run = |extra: &[&str]| {
        let mut args =
            vec!["generate", "--model", model.to_str().unwrap(), "-p", prompt, "--ignore-chat-template", "-m", tokens];
        args.extend_from_slice(extra);
        ok_stdout(&args)
    };
    let plain = run(&["--precision", precision, "--draft-kind", "none"]);
    for drafter in ["ngram", "suffix"] {
        assert_eq!(run(&["--precision", precision, "--draft-kind", drafter]), plain, "{precision} {drafter}");
    }
}

#[test]
fn bad_precision_and_data_are_named() {
    let model = smollm2();
    let m = model.to_str().unwrap();
    let out = mlx_spec(&["generate", "--model", m, "--precision", "int4", "-m", "1"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("--precision int4: expected f32, bf16 or int8"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"a\"}\n{\"other\": 1}\n").unwrap();
    let out = mlx_spec(&["perplexity", "--model", m, "--data-path", bad.to_str().unwrap()]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("line 2: expected a `text` or `prompt` string"), "{e}");
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "too short").unwrap();
    let out = mlx_spec(&["perplexity", "--model", m, "--data-path", short.to_str().unwrap()]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("fewer than one sequence of --sequence-length 512"), "{e}");
    let out =
        mlx_spec(&["perplexity", "--model", m, "--data-path", short.to_str().unwrap(), "--reference-precision", "fp8"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("--reference-precision fp8: expected f32, bf16 or int8"), "{e}");
    // bf16 without mlx-spec's quantized kernel does nothing: said, not silent.
    let out = Command::new(env!("CARGO_BIN_EXE_mlx-spec"))
        .args(["generate", "--model", m, "-p", "Hi", "-m", "1", "--precision", "bf16", "--draft-kind", "none"])
        .env("MLX_SPEC_QMM", "mlx")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && e.contains("bf16 precision needs mlx-spec's quantized matmul kernel"), "{e}");
}
