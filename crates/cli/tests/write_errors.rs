//! A write that fails half way (here a file-size limit, `ulimit -f`, which fails `write` with
//! EFBIG as a full disk fails it with ENOSPC) during `quantize`, `import-gguf` or
//! `quantize-drafter`: the message names the file of the destination the user gave, not the
//! hidden staging directory it was being written in, and nothing is left behind.
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

use common::model_of;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(rel)
}

/// Runs `mlx-spec args` with files limited to `kib` KiB (SIGXFSZ ignored, so the write fails
/// instead of killing the process); returns (success, stderr).
fn mlx_spec_with_file_limit(kib: u32, args: &[&str]) -> (bool, String) {
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!("trap '' XFSZ; ulimit -f {kib}; exec \"$0\" \"$@\""))
        .env("RUST_BACKTRACE", "0")
        .arg(env!("CARGO_BIN_EXE_mlx-spec"))
        .args(args)
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The run failed naming `dst`'s weight file and the OS error, no staging name, and `parent`
/// is empty afterwards.
fn check(ok: bool, stderr: &str, dst: &Path, parent: &Path) {
    assert!(!ok, "the write should have failed: {stderr}");
    let weights = dst.join("model.safetensors").display().to_string();
    let shard = dst.join("model-00001-of-").display().to_string();
    assert!(stderr.contains(&weights) || stderr.contains(&shard), "names {weights}: {stderr}");
    // The OS's error (quantize writes with std), or MLX's short write (import-gguf saves
    // through MLX, whose message has no errno).
    assert!(stderr.contains("File too large") || stderr.contains("short write"), "the cause: {stderr}");
    // Said once: `caused by:` lines leave out what the line above already said.
    assert!(stderr.matches("File too large").count() <= 1, "the cause repeated: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    for staging in [".quantizing-", ".importing-"] {
        assert!(!stderr.contains(staging), "a staging path in the message: {stderr}");
    }
    let left: Vec<_> = std::fs::read_dir(parent).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn quantize_names_the_destination_when_a_write_fails() {
    let src = tempfile::tempdir().unwrap();
    model_of(src.path(), 2);
    let out = tempfile::tempdir().unwrap();
    let dst = out.path().join("q4");
    let (ok, stderr) = mlx_spec_with_file_limit(
        256,
        &["quantize", "--hf-path", src.path().to_str().unwrap(), "--mlx-path", dst.to_str().unwrap(), "-q"],
    );
    check(ok, &stderr, &dst, out.path());
}

#[test]
fn import_gguf_names_the_destination_when_a_write_fails() {
    let out = tempfile::tempdir().unwrap();
    let dst = out.path().join("tiny");
    let gguf = fixture("gguf_import/tiny_llama.gguf");
    let (ok, stderr) = mlx_spec_with_file_limit(64, &["import-gguf", gguf.to_str().unwrap(), dst.to_str().unwrap()]);
    check(ok, &stderr, &dst, out.path());
}

#[test]
fn quantize_drafter_names_the_destination_when_a_write_fails() {
    let src = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("deepspec/qwen3").join(f), src.path().join(f)).unwrap();
    }
    let out = tempfile::tempdir().unwrap();
    let dst = out.path().join("q8");
    let (ok, stderr) = mlx_spec_with_file_limit(
        4,
        &["quantize-drafter", "--src", src.path().to_str().unwrap(), "--out", dst.to_str().unwrap(), "--bits", "8"],
    );
    check(ok, &stderr, &dst, out.path());
}
