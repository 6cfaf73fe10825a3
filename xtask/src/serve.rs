//! The `mlx-spec serve` commands: `serve-test` (the Python suite through real HTTP, run by
//! `cargo xtask test`), `soak` and `bench serve`. Each makes its venv under `target/` from
//! pinned versions (PyPI, through pip) and runs a script of `tests/openai` or `xtask/scripts`.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Arguments of `cargo xtask serve-test`.
#[derive(clap::Args)]
pub struct TestArgs {
    /// Requests of the soak slice (`test_soak_slice`; 0 skips it).
    #[arg(long, default_value_t = 300)]
    soak_requests: usize,
    /// Extra arguments for pytest (e.g. `-k stop -x`).
    #[arg(trailing_var_arg = true)]
    pytest_args: Vec<String>,
}

impl Default for TestArgs {
    fn default() -> Self {
        TestArgs { soak_requests: 300, pytest_args: Vec::new() }
    }
}

/// Arguments of `cargo xtask soak`.
#[derive(clap::Args)]
pub struct SoakArgs {
    /// Short requests to send.
    #[arg(long, default_value_t = 10_000)]
    requests: usize,
    /// Concurrent clients, each on one keep-alive connection.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Run the debug build (what the CI slice runs) instead of the release build.
    #[arg(long)]
    debug: bool,
    /// Extra `mlx-spec serve` flags.
    #[arg(trailing_var_arg = true)]
    serve_args: Vec<String>,
}

/// Arguments of `cargo xtask bench serve`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Model directory for both servers (default: the default model, SmolLM2-135M-Instruct 4-bit).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Requests per client per arm and concurrency.
    #[arg(long, default_value_t = 4)]
    requests: usize,
    /// Tokens per request.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Concurrent clients to measure at.
    #[arg(long, default_values_t = vec![1, 2, 4, 8])]
    clients: Vec<usize>,
    /// Rounds: every arm once per round, in alternating order.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Skip the mlx_lm.server arms (no venv with mlx-lm needed).
    #[arg(long)]
    no_mlx_lm: bool,
    /// Where the JSON and the markdown table go (default: docs/measurements/<UTC date>).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Pinned versions of the benchmark's baseline: Python MLX as the goldens pin it, mlx-lm, httpx.
const BENCH_REQUIREMENTS: &str = "mlx[cpu]==0.32.4\nmlx-lm==0.32.2\nhttpx==0.28.1\n";

/// `target/<name>` with `requirements` installed (pip, PyPI); reinstalled when they changed.
/// Returns its python.
fn venv(root: &Path, name: &str, requirements: &str) -> Result<PathBuf> {
    let dir = root.join("target").join(name);
    let py = dir.join("bin/python");
    let stamp = dir.join("requirements.installed");
    if py.exists() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == requirements) {
        return Ok(py);
    }
    if !py.exists() {
        let mut c = Command::new("python3");
        c.args(["-m", "venv"]).arg(&dir);
        super::run(c).context("python3 -m venv (on Debian: apt-get install python3-venv)")?;
    }
    let req = dir.join("requirements.txt");
    std::fs::write(&req, requirements)?;
    let mut c = Command::new(&py);
    c.args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r"]).arg(&req);
    super::run(c)?;
    std::fs::write(&stamp, requirements)?;
    Ok(py)
}

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

/// Builds `mlx-spec` (debug or release) and returns the binary.
fn build(root: &Path, cargo: fn() -> Command, release: bool) -> Result<PathBuf> {
    let mut c = cargo();
    c.args(["build", "--quiet", "-p", "mlx-spec"]);
    if release {
        c.arg("--release");
    }
    super::run(c)?;
    let bin = target_dir(root).join(if release { "release" } else { "debug" }).join("mlx-spec");
    if !bin.is_file() {
        bail!("{}: not built", bin.display());
    }
    Ok(bin)
}

/// The suite's venv and environment: python, and a command running `script_args` with it.
fn suite(root: &Path, cargo: fn() -> Command, release: bool) -> Result<Command> {
    let requirements = std::fs::read_to_string(root.join("tests/openai/requirements.txt"))?;
    let py = venv(root, "serve-venv", &requirements)?;
    let bin = build(root, cargo, release)?;
    let model = models::default_model::ensure_default_model(&mut |_| {}).context("the default model")?;
    let (tiny_target, tiny_dspark) = tiny_pair(root)?;
    let mut c = Command::new(py);
    c.current_dir(root.join("tests/openai"))
        .env("MLX_SPEC_BIN", bin)
        .env("MLX_SPEC_MODEL_DIR", model)
        .env("MLX_SPEC_TINY_TARGET", tiny_target)
        .env("MLX_SPEC_TINY_DSPARK", tiny_dspark)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONUNBUFFERED", "1");
    Ok(c)
}

/// The tiny Qwen3 target (with its byte-level tokenizer) and its DSpark drafter
/// ([`test_support::dspark::write_tiny_pair`]) in `target/serve-fixtures/{target,dspark}`,
/// for the suite's DSpark tests. The pair is deterministic and cheap, so every run writes it
/// afresh beside the old one and renames it into place (a change to the generator cannot
/// leave stale fixtures; a partial directory is replaced). Returns (target, drafter).
fn tiny_pair(root: &Path) -> Result<(PathBuf, PathBuf)> {
    let dir = target_dir(root).join("serve-fixtures");
    let fresh = target_dir(root).join("serve-fixtures.new");
    for d in [&fresh, &dir] {
        if d.exists() {
            std::fs::remove_dir_all(d)?;
        }
    }
    test_support::dspark::write_tiny_pair(&fresh).context("writing the tiny target + DSpark pair")?;
    std::fs::rename(&fresh, &dir)?;
    Ok((dir.join("target"), dir.join("dspark")))
}

/// `cargo xtask serve-test`: pytest on tests/openai against the debug build.
pub fn test(root: &Path, cargo: fn() -> Command, a: &TestArgs) -> Result<()> {
    let mut c = suite(root, cargo, false)?;
    c.env("MLX_SPEC_SOAK_REQUESTS", a.soak_requests.to_string());
    c.args(["-m", "pytest", "-v"]);
    if a.soak_requests == 0 {
        c.args(["--deselect", "test_server.py::test_soak_slice"]);
    }
    c.args(&a.pytest_args);
    super::run(c)
}

/// `cargo xtask soak`: tests/openai/soak.py, its report in target/soak/report.json.
pub fn soak(root: &Path, cargo: fn() -> Command, a: &SoakArgs) -> Result<()> {
    let out = target_dir(root).join("soak");
    std::fs::create_dir_all(&out)?;
    let mut c = suite(root, cargo, !a.debug)?;
    c.arg("soak.py")
        .args(["--requests", &a.requests.to_string(), "--clients", &a.clients.to_string(), "--out"])
        .arg(out.join("report.json"));
    if !a.serve_args.is_empty() {
        c.arg("--").args(&a.serve_args);
    }
    super::run(c)
}

/// `cargo xtask bench serve`: xtask/scripts/bench_serve.py, ours (release) vs mlx_lm.server.
pub fn bench(root: &Path, cargo: fn() -> Command, a: &BenchArgs) -> Result<()> {
    let bin = build(root, cargo, true)?;
    let model = match &a.model {
        Some(m) => super::absolute(m)?,
        None => models::default_model::ensure_default_model(&mut |_| {}).context("the default model")?,
    };
    let py = if a.no_mlx_lm {
        venv(root, "serve-venv", &std::fs::read_to_string(root.join("tests/openai/requirements.txt"))?)?
    } else {
        venv(root, "bench-serve-venv", BENCH_REQUIREMENTS)?
    };
    let out = match &a.out {
        Some(o) => super::absolute(o)?,
        None => root.join("docs/measurements").join(utc_date()?),
    };
    std::fs::create_dir_all(&out)?;
    let (_, openblas) = super::blas_in_use(&bin)?;
    let mut c = Command::new(&py);
    // Python MLX binds the wheel's reference BLAS; give it the same OpenBLAS as ours.
    if let Some(lib) = openblas.as_ref() {
        c.env("MLX_LM_LD_PRELOAD", lib);
    }
    c.arg(root.join("xtask/scripts/bench_serve.py"))
        .arg("--bin")
        .arg(&bin)
        .arg("--model")
        .arg(&model)
        .args(["--requests", &a.requests.to_string(), "--max-tokens", &a.max_tokens.to_string()])
        .args(["--rounds", &a.rounds.to_string(), "--clients"])
        .args(a.clients.iter().map(ToString::to_string))
        .arg("--out")
        .arg(&out);
    if a.no_mlx_lm {
        c.arg("--no-mlx-lm");
    }
    c.env("PYTHONDONTWRITEBYTECODE", "1").env("PYTHONUNBUFFERED", "1");
    super::run(c)
}

fn utc_date() -> Result<String> {
    let out = Command::new("date").args(["-u", "+%Y-%m-%d"]).output().context("date")?;
    Ok(String::from_utf8(out.stdout)?.trim().to_string())
}
