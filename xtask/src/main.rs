//! `cargo xtask <command>`: project automation that needs more than one cargo call.
//!
//! - `test`: every test of the workspace (unit, integration, doc, and the benches run once
//!   in test mode), including the backend-gated integration tests, which skip themselves
//!   when their backend (Metal, CUDA) is absent.
//! - `bench`: the criterion benchmarks, then the side-by-side ratios (OpenBLAS vs reference
//!   BLAS, 4-bit vs f32 matvec) read from criterion's estimates.
//! - `goldens`: regenerates the committed goldens with the pinned Python MLX in a venv.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run every test of the workspace.
    Test {
        /// Extra arguments passed to `cargo test` (e.g. a test name filter after `--`).
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Run the criterion benchmarks and print the side-by-side ratios.
    Bench {
        /// Only print the ratios of the last run (do not run the benchmarks).
        #[arg(long)]
        report_only: bool,
    },
    /// Regenerate fixtures/quantize and fixtures/gguf goldens with Python MLX 0.32.4.
    Goldens,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Cmd::Test { args } => test(&args),
        Cmd::Bench { report_only } => bench(report_only),
        Cmd::Goldens => goldens(),
    }
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
        bail!("{c:?} failed: {status}");
    }
    Ok(())
}

fn test(extra: &[String]) -> Result<()> {
    let mut c = cargo();
    c.args(["test", "--workspace", "--all-targets"]).args(extra);
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
