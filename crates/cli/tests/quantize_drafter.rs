//! `mlx-spec quantize-drafter` on DeepSpec's golden Qwen3 checkpoint: writes a quantized
//! drafter that passes the load smoke, and refuses a target model directory, pointing to
//! `mlx-spec quantize`, leaving nothing at the destination.
use std::path::PathBuf;
use std::process::Command;

fn golden_checkpoint() -> tempfile::TempDir {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/deepspec/qwen3");
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    dir
}

fn quantize_drafter(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mlx-spec")).arg("quantize-drafter").args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).to_string())
}

#[test]
fn quantizes_a_drafter_and_refuses_a_model() {
    let src = golden_checkpoint();
    let out = tempfile::tempdir().unwrap();
    let dst = out.path().join("q8");
    let (ok, stderr) =
        quantize_drafter(&["--src", src.path().to_str().unwrap(), "--out", dst.to_str().unwrap(), "--bits", "8"]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("load smoke") && stderr.contains("8-bit"), "{stderr}");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dst.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["quantization"]["bits"], 8);

    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity/llama");
    let refused = out.path().join("refused");
    let (ok, stderr) = quantize_drafter(&["--src", model.to_str().unwrap(), "--out", refused.to_str().unwrap()]);
    assert!(!ok && stderr.contains("mlx-spec quantize"), "{stderr}");
    assert!(!refused.exists());
    let (ok, stderr) = quantize_drafter(&["--src", src.path().to_str().unwrap(), "--out", dst.to_str().unwrap()]);
    assert!(!ok && stderr.contains("--force"), "{stderr}");
}
