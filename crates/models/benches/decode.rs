//! Decode-speed benchmark on real weights: plain decode tokens/s, the verify-window cost
//! curve `t(T)` (one forward over `T` tokens with logits for all `T`, on a KV cache filled
//! with a ~400-token prompt, then rolled back), for `T` in 1, 2, 4, 8, 11, 16, and with a
//! ~2,000-token prompt (`long` in the prompts file) prefill tokens/s and decode tokens/s after
//! it (`generate`'s `prompt_tps` and `generation_tps`: prefill in chunks of 512), for the
//! `ours` variant.
//!
//! Besides wall time it records the CPU time of the process (all threads) per decode token
//! and per verify forward: on a shared machine that measures the work, which wall time does
//! not (run with `OPENBLAS_NUM_THREADS=1 MLX_SPEC_QMM_THREADS=1` to compare single-core work).
//! Each variant is a [`KernelPolicy`] the model is loaded with (plus the process-wide sgemv
//! rewrite of the BLAS switch); `MLX_SPEC_QMM_ISA` caps the instruction set of every variant
//! but `mlx-kernels` (e.g. `avx2+fma` to measure the AVX2 kernels on an AVX-512 CPU), as it
//! caps the CLI's, and the JSON's `qmm_isa` names the one in use.
//!
//! The variants run side by side in this one process:
//! - `ours`: the defaults (the CPU kernels of `mlx_core::cpu_quant` for quantized products
//!   and for dense float32 products of up to 32 rows, BLAS sgemv for other matrix-vector
//!   shapes, the fused attention of `mlx_core::cpu_attention`,
//!   the one-node RMS norm and RoPE of `mlx_core::cpu_fast`, pipelined decode);
//! - `mlx-kernels`: the same loop with MLX's own kernels (sgemm for every shape, MLX's
//!   `quantized_matmul`, attention, RMS norm and RoPE), i.e. what the pip wheel gives;
//! - `mlx-norm-rope` (only when asked for with `--variants`): `ours` with MLX's RMS norm and
//!   RoPE graphs, to measure what the one-node versions give;
//! - `bf16`, `int8` (only when asked for): `ours` in an opt-in precision of the quantized
//!   matmuls (`mlx_core::Precision::{Bf16, Int8}`);
//! - `unfused`, `split` (only when asked for): `ours` with each llama/qwen decoder layer op
//!   by op, or as two fused nodes around the KV cache's write instead of one
//!   (`mlx_core::LayerNodes`).
//!
//! `cargo xtask bench-decode` runs this together with mlx-lm on the same directories and
//! prints the table; alone: `cargo bench -p models --bench decode -- --models dir1:dir2`.
//! Arguments (after `--`): `--models` (model directories, `:`-separated; default the
//! imported SmolLM2), `--prompts` (default `fixtures/bench/prompts.json`), `--out` (JSON
//! lines, default `target/bench-decode/ours.jsonl`), `--tokens` (default 64), `--reps`
//! (default 5), `--variants` (default `ours,mlx-kernels`; e.g. `ours` alone for profiling).
//! Under `cargo test` (no `--bench` argument, which `cargo bench` adds) it runs a few-token
//! smoke pass on the default model when it is already imported.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use mlx_core::{Dtype, KernelPolicy, LayerNodes, cpu_quant, eval, set_gemv_routing};
use models::generate::{ids, prefill};
use models::tokenizer::{ChatMessage, Tokenizer};
use models::{GenerateParams, LoadOptions, Sampler, generate, load_model};

const WINDOWS: [usize; 6] = [1, 2, 4, 8, 11, 16];

/// The command line: `--bench` (from `cargo bench`) and `--name value` pairs.
struct Args {
    bench: bool,
    models: Option<String>,
    prompts: Option<PathBuf>,
    out: Option<PathBuf>,
    tokens: usize,
    reps: usize,
    variants: Vec<String>,
}

impl Args {
    fn parse(mut it: impl Iterator<Item = String>) -> Args {
        let mut a = Args {
            bench: false,
            models: None,
            prompts: None,
            out: None,
            tokens: 64,
            reps: 5,
            variants: vec!["ours".into(), "mlx-kernels".into()],
        };
        while let Some(arg) = it.next() {
            let mut value = || it.next().unwrap_or_else(|| panic!("{arg} needs a value"));
            let number = |v: String| v.parse::<usize>().unwrap_or_else(|_| panic!("{arg}: not a number: {v}"));
            match arg.as_str() {
                "--bench" => a.bench = true,
                "--models" => a.models = Some(value()),
                "--prompts" => a.prompts = Some(value().into()),
                "--out" => a.out = Some(value().into()),
                "--tokens" => a.tokens = number(value()),
                "--reps" => a.reps = number(value()),
                "--variants" => a.variants = value().split(',').map(str::to_string).collect(),
                // cargo's own harness flags and test-name filters: not ours
                _ => eprintln!("decode bench: ignoring argument {arg}"),
            }
        }
        a
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct Setup {
    tokens: usize,
    reps: usize,
    decode_prompt: String,
    verify_prompt: String,
    /// The long prompt (`None`: the prompts file has none; the long section is skipped).
    long_prompt: Option<String>,
}

/// Busy jiffies of the whole machine (`/proc/stat`) and of this process (`/proc/self/stat`).
fn jiffies() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let cpu: Vec<u64> =
        stat.lines().next().unwrap_or("").split_whitespace().skip(1).filter_map(|v| v.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait
    let busy = cpu.iter().enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, v)| v).sum();
    let me = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let f: Vec<&str> = me.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let own = f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    (busy, own)
}

/// Cores other processes kept busy since `start` (jiffies at 100 Hz), as the anchors measure
/// contention: (Δ machine busy − Δ own CPU) / wall.
fn others_cores(start: (u64, u64), t0: Instant) -> f64 {
    let (busy, own) = jiffies();
    let wall = t0.elapsed().as_secs_f64().max(1e-9);
    ((busy - start.0) as f64 - (own - start.1) as f64).max(0.0) / 100.0 / wall
}

/// CPU time of all this process's threads so far, ns (`/proc/self/task/*/schedstat`): the
/// work a step costs, which unlike wall time hardly moves when other processes share the cores.
fn process_cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0 };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// The kernels of a variant (and sets the process-wide sgemv rewrite of the BLAS switch).
fn set_variant(name: &str) -> KernelPolicy {
    let ours = name != "mlx-kernels";
    set_gemv_routing(ours);
    let on = || KernelPolicy::all_on().with_isa(mlx_core::Settings::global().max_isa.value);
    match name {
        "ours" => on(),
        "bf16" => on().with_precision(mlx_core::Precision::Bf16),
        "int8" => on().with_precision(mlx_core::Precision::Int8),
        "unfused" => KernelPolicy { layer: LayerNodes::Ops, ..on() },
        "split" => KernelPolicy { layer: LayerNodes::Split, ..on() },
        "mlx-norm-rope" => KernelPolicy { fast_norm_rope: false, ..on() },
        "mlx-kernels" => KernelPolicy::mlx(),
        other => panic!("--variants {other}: expected ours, bf16, int8, unfused, split, mlx-norm-rope or mlx-kernels"),
    }
}

/// Timings of the one-token forward t(1) per repetition (every other window gets one).
const T1_TIMINGS: usize = 5;

/// One model, one variant: decode tokens/s per rep and verify-window ms per rep and T.
fn run(dir: &Path, variant: &str, s: &Setup) -> serde_json::Value {
    let kernels = set_variant(variant);
    let (j0, t_start) = (jiffies(), Instant::now());
    let isa = kernels.isa();
    let model = load_model(dir, &LoadOptions { dtype: Some(Dtype::Float32), kernels }).expect("load model");
    let tok = Tokenizer::from_dir(dir).expect("tokenizer");
    let chat = |p: &str| {
        let text = tok.apply_chat_template(&[ChatMessage::user(p.to_string())], true).expect("chat template");
        tok.encode(&text, false).expect("encode")
    };
    let (decode_ids, verify_ids) = (chat(&s.decode_prompt), chat(&s.verify_prompt));
    let params = GenerateParams { max_tokens: s.tokens, sampler: Sampler::default(), eos: vec![] };
    // `reps` timed runs (after a warm-up) of `ids`: the stats and CPU ms per generated token.
    let timed = |ids: &[u32]| -> Vec<(models::GenerationStats, f64)> {
        (0..=s.reps)
            .map(|_| {
                let c0 = process_cpu_ns();
                let stats = generate(&model, ids, &params, |_| true).expect("generate");
                let cpu_ms = (process_cpu_ns() - c0) as f64 / 1e6 / stats.generation_tokens.max(1) as f64;
                (stats, cpu_ms)
            })
            .skip(1)
            .collect()
    };
    let runs = timed(&decode_ids);
    let decode_tps: Vec<f64> = runs.iter().map(|(st, _)| st.generation_tps).collect();
    let decode_cpu_ms: Vec<f64> = runs.iter().map(|(_, cpu)| *cpu).collect();
    // The long prompt on our kernels only (every precision): MLX's quantized kernels take minutes for it.
    let long_ids = s
        .long_prompt
        .as_deref()
        .filter(|_| matches!(variant, "ours" | "unfused" | "split" | "bf16" | "int8"))
        .map(chat)
        .unwrap_or_default();
    let long_runs = if long_ids.is_empty() { Vec::new() } else { timed(&long_ids) };
    let prefill_tps: Vec<f64> = long_runs.iter().map(|(st, _)| st.prompt_tps).collect();
    let long_decode_tps: Vec<f64> = long_runs.iter().map(|(st, _)| st.generation_tps).collect();
    let (mut cache, _) = prefill(&model, &verify_ids).expect("prefill");
    let window: Vec<u32> = verify_ids.iter().rev().take(16).copied().collect();
    let mut verify: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut verify_cpu: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    for rep in 0..=s.reps {
        for &t in &WINDOWS {
            // t(1) divides every ratio of the curve: it gets five timings a repetition, so that
            // one slow step does not move them all (a 51 ms outlier once made Qwen's t(11)/t(1)
            // read 3.47 instead of 4.8)
            for _ in 0..if t == 1 { T1_TIMINGS } else { 1 } {
                let x = ids(&window[..t]).unwrap();
                let (t0, c0) = (Instant::now(), process_cpu_ns());
                let logits = model.forward(&x, &mut cache).expect("forward");
                eval(&[&logits]).expect("eval");
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                let cpu_ms = (process_cpu_ns() - c0) as f64 / 1e6;
                assert_eq!(cache.trim(t), t, "exact rollback");
                if rep > 0 {
                    verify.entry(t).or_default().push(ms);
                    verify_cpu.entry(t).or_default().push(cpu_ms);
                }
            }
        }
    }
    let t1 = median(&verify[&1]);
    let curve: Vec<String> = WINDOWS.iter().map(|t| format!("{:.2}", median(&verify[t]) / t1)).collect();
    eprintln!(
        "{} / {variant}: decode {:.2} tok/s ({:.1} CPU ms/token), t(1) {t1:.1} ms, t(T)/t(1) for T={WINDOWS:?}: {} (other processes: {:.2} cores)",
        dir.display(),
        median(&decode_tps),
        median(&decode_cpu_ms),
        curve.join(" "),
        others_cores(j0, t_start)
    );
    serde_json::json!({
        "engine": "mlx-spec",
        "variant": variant,
        "model": dir.display().to_string(),
        "prompt_tokens": {"decode": decode_ids.len(), "verify": verify_ids.len(), "long": long_ids.len()},
        "decode_tps": decode_tps,
        "prefill_tps": prefill_tps,
        "long_decode_tps": long_decode_tps,
        "decode_cpu_ms_per_token": decode_cpu_ms,
        "verify_cpu_ms": verify_cpu.iter().map(|(t, v)| (t.to_string(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
        "verify_ms": verify.iter().map(|(t, v)| (t.to_string(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
        "others_cores": others_cores(j0, t_start),
        "qmm_isa": isa,
        "qmm_threads": cpu_quant::threads(),
        "blas": mlx_core::blas_info(),
    })
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let args = Args::parse(std::env::args().skip(1));
    let bench_mode = args.bench;
    let models: Vec<PathBuf> = match &args.models {
        Some(v) if !v.is_empty() => v.split(':').map(PathBuf::from).collect(),
        _ => vec![models::default_model::default_model_path()],
    };
    let prompts = args.prompts.clone().unwrap_or_else(|| root.join("fixtures/bench/prompts.json"));
    let p: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&prompts).expect("prompts file")).expect("prompts JSON");
    let mut setup = Setup {
        tokens: args.tokens,
        reps: args.reps,
        decode_prompt: p["decode"].as_str().expect("decode prompt").to_string(),
        verify_prompt: p["verify"].as_str().expect("verify prompt").to_string(),
        long_prompt: p["long"].as_str().map(str::to_string),
    };
    if !bench_mode {
        // `cargo test --all-targets`: a smoke pass only, on a model that is already there.
        let dir = &models[0];
        if !dir.join("config.json").is_file() {
            eprintln!("decode bench: {} not imported; skipped (run `cargo xtask fixtures`)", dir.display());
            return;
        }
        setup.tokens = 3;
        setup.reps = 1;
        setup.long_prompt = None;
        run(dir, "ours", &setup);
        return;
    }
    let out = args.out.clone().unwrap_or_else(|| root.join("target/bench-decode/ours.jsonl"));
    std::fs::create_dir_all(out.parent().expect("output has a parent")).expect("output directory");
    let mut lines = Vec::new();
    for dir in &models {
        for variant in &args.variants {
            lines.push(run(dir, variant, &setup).to_string());
        }
    }
    set_variant("ours");
    let tmp = out.with_extension("jsonl.partial");
    std::fs::write(&tmp, lines.join("\n") + "\n").expect("write results");
    std::fs::rename(&tmp, &out).expect("publish results");
    eprintln!("wrote {}", out.display());
}
