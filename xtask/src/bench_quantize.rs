//! `cargo xtask bench-quantize`: time and peak RSS to quantize one model directory,
//! `mlx-spec quantize` vs `mlx_lm.convert -q` side by side (interleaved runs, same source,
//! same bits and group size). Each run is measured by a fresh Python process that starts
//! the command as its only child and reads `getrusage(RUSAGE_CHILDREN)` after it exits, so
//! both sides are measured the same way. Outputs go to a temporary directory and are removed.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Arguments of `cargo xtask bench-quantize`.
#[derive(clap::Args)]
pub struct Args {
    /// Python with `mlx[cpu]==0.32.4` and `mlx-lm` installed (the baseline; also runs the
    /// measuring wrapper).
    #[arg(long, default_value = "python3")]
    python: String,
    /// The dense source directory (default: Qwen2.5-Coder-1.5B-Instruct in the mlx-spec cache,
    /// else the 0.5B).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Runs per side (interleaved; all are reported, the median is compared).
    #[arg(long, default_value_t = 2)]
    runs: usize,
    /// Bits per weight.
    #[arg(long, default_value_t = 4)]
    q_bits: i32,
    /// Group size.
    #[arg(long, default_value_t = 64)]
    q_group_size: i32,
    /// Where the outputs are written (a temporary directory inside it; default: the system
    /// temp directory).
    #[arg(long)]
    work_dir: Option<PathBuf>,
}

/// Runs argv[1:] as a child and prints `{"seconds": wall, "max_rss_kb": peak RSS of the child}`
/// (Linux reports ru_maxrss in KiB).
const MEASURE: &str = r#"
import json, resource, subprocess, sys, time
t0 = time.perf_counter()
p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
dt = time.perf_counter() - t0
if p.returncode != 0:
    sys.exit(f"{sys.argv[1:]} failed ({p.returncode}):\n{p.stderr[-3000:]}")
print(json.dumps({"seconds": dt, "max_rss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"#;

fn measure(python: &str, argv: &[String]) -> Result<(f64, f64)> {
    let out = Command::new(python)
        .arg("-c")
        .arg(MEASURE)
        .args(argv)
        .output()
        .with_context(|| format!("cannot start {python}"))?;
    if !out.status.success() {
        bail!("{}", String::from_utf8_lossy(&out.stderr));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("the measuring wrapper's JSON")?;
    Ok((v["seconds"].as_f64().unwrap_or(f64::NAN), v["max_rss_kb"].as_f64().unwrap_or(f64::NAN) / 1024.0))
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok()?.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

/// The command.
pub fn run(a: Args, root: &Path, cargo: impl Fn() -> Command) -> Result<()> {
    let mut c = cargo();
    c.args(["build", "--release", "-p", "mlx-spec"]);
    let status = c.status().context("cargo build")?;
    if !status.success() {
        bail!("cargo build --release -p mlx-spec failed");
    }
    let bin = root.join("target/release/mlx-spec");
    let model = match a.model {
        Some(m) => m,
        None => {
            let models = mlx_core::Settings::global().cache_dir.value.join("models");
            let big = models.join("qwen2.5-coder-1.5b-instruct");
            if big.join("config.json").is_file() { big } else { models.join("qwen2.5-coder-0.5b-instruct") }
        }
    };
    if !model.join("config.json").is_file() {
        bail!("{}: not a model directory (pass --model, or run `cargo xtask fixtures`)", model.display());
    }
    let work = tempfile_dir(a.work_dir.as_deref())?;
    let (bits, gs) = (a.q_bits.to_string(), a.q_group_size.to_string());
    let src = model.to_string_lossy().to_string();
    println!(
        "source {} ({:.2} GB), {bits}-bit group {gs}, {} runs per side",
        model.display(),
        dir_bytes(&model) as f64 / 1e9,
        a.runs
    );
    let mut ours = (Vec::new(), Vec::new());
    let mut base = (Vec::new(), Vec::new());
    // One timed run of `argv ++ [--mlx-path out, --q-bits, --q-group-size]`; the output is
    // measured and removed.
    let timed = |label: &str, name: String, argv: Vec<String>| -> Result<(f64, f64)> {
        let out = work.join(name);
        let mut argv = argv;
        argv.extend(["--mlx-path".into(), out.to_string_lossy().into()]);
        argv.extend(["--q-bits".into(), bits.clone(), "--q-group-size".into(), gs.clone()]);
        let (t, rss) = measure(&a.python, &argv)?;
        let size = dir_bytes(&out);
        std::fs::remove_dir_all(&out).ok();
        println!("  {label}   {t:7.1} s  peak RSS {rss:7.0} MiB  output {:.2} GB", size as f64 / 1e9);
        Ok((t, rss))
    };
    for i in 0..a.runs {
        let argv = vec![bin.to_string_lossy().into(), "quantize".into(), "--hf-path".into(), src.clone()];
        let (t, rss) = timed(&format!("run {i}: mlx-spec quantize"), format!("ours-{i}"), argv)?;
        ours.0.push(t);
        ours.1.push(rss);
        let argv = ["-m", "mlx_lm", "convert", "-q", "--hf-path"].iter().map(|s| s.to_string());
        let argv = std::iter::once(a.python.clone()).chain(argv).chain([src.clone()]).collect();
        let (t, rss) = timed(&format!("run {i}: mlx_lm.convert -q"), format!("mlx-lm-{i}"), argv)?;
        base.0.push(t);
        base.1.push(rss);
    }
    std::fs::remove_dir_all(&work).ok();
    let (ot, orss, bt, brss) = (median(ours.0), median(ours.1), median(base.0), median(base.1));
    println!("{:<22} {:>10} {:>14}", "median", "seconds", "peak RSS MiB");
    println!("{:<22} {ot:>10.1} {orss:>14.0}", "mlx-spec quantize");
    println!("{:<22} {bt:>10.1} {brss:>14.0}", "mlx_lm.convert -q");
    println!("{:<22} {:>9.2}x {:>13.2}x", "mlx-lm / ours", bt / ot, brss / orss);
    Ok(())
}

fn tempfile_dir(base: Option<&Path>) -> Result<PathBuf> {
    let base = base.map(Path::to_path_buf).unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("mlx-spec-bench-quantize-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}
