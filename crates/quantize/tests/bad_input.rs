//! Bad input: each case gives an error naming the file or tensor (expected vs found), and
//! leaves nothing at the destination nor any temporary directory beside it.
mod common;

use std::path::{Path, PathBuf};

use common::{entries, write_model};
use mlx_core::Array;
use quantize::{Error, QuantizeOptions, quantize_model_dir};
use serde_json::json;

/// A valid little source (one eligible weight, one norm) in `root/src`.
fn source(root: &Path) -> PathBuf {
    let src = root.join("src");
    let w = Array::from_slice(&vec![0.25f32; 8 * 64], &[8, 64]).unwrap();
    let n = Array::from_slice(&[1f32; 64], &[64]).unwrap();
    write_model(&src, &json!({"model_type": "llama"}), &[("m.weight", w), ("norm.weight", n)]);
    src
}

/// Runs the quantizer into `root/out` and checks that it fails and leaves nothing.
fn fails(root: &Path, src: &Path, options: &QuantizeOptions) -> Error {
    let before = entries(root);
    let dst = root.join("out");
    let err = quantize_model_dir(src, &dst, options, &mut |_| {}).expect_err("must fail");
    assert!(!dst.exists(), "{err}: the destination was created");
    assert_eq!(entries(root), before, "{err}: something was left beside the destination");
    err
}

/// A safetensors file with a hand-written header and `data` as its data section.
fn raw_safetensors(path: &Path, header: &serde_json::Value, data: &[u8]) {
    let h = header.to_string().into_bytes();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(h);
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn directory_without_config() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    std::fs::remove_file(src.join("config.json")).unwrap();
    let e = fails(tmp.path(), &src, &QuantizeOptions::default()).to_string();
    assert!(e.contains("config.json"), "{e}");
    let missing = tmp.path().join("nope");
    let e = fails(tmp.path(), &missing, &QuantizeOptions::default()).to_string();
    assert!(e.contains("nope") && e.contains("no such directory"), "{e}");
}

#[test]
fn truncated_header() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let file = src.join("model.safetensors");
    let full = std::fs::read(&file).unwrap();
    // the length prefix promises more header than the file holds
    std::fs::write(&file, &full[..40]).unwrap();
    let e = fails(tmp.path(), &src, &QuantizeOptions::default()).to_string();
    assert!(e.contains("model.safetensors") && e.contains("truncated header"), "{e}");
    // shorter than the length prefix itself
    std::fs::write(&file, &full[..5]).unwrap();
    let e = fails(tmp.path(), &src, &QuantizeOptions::default()).to_string();
    assert!(e.contains("model.safetensors") && e.contains("5 bytes"), "{e}");
    // a header that is not JSON
    raw_safetensors(&file, &json!("not an object"), &[]);
    let e = fails(tmp.path(), &src, &QuantizeOptions::default()).to_string();
    assert!(e.contains("model.safetensors") && e.contains("header"), "{e}");
}

#[test]
fn tensor_past_the_end_of_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let file = src.join("model.safetensors");
    let full = std::fs::read(&file).unwrap();
    std::fs::write(&file, &full[..full.len() - 16]).unwrap();
    let e = fails(tmp.path(), &src, &QuantizeOptions::default()).to_string();
    assert!(e.contains("model.safetensors") && e.contains("past the end"), "{e}");
    // names the tensor: the last one in the file
    assert!(e.contains("`m.weight`") || e.contains("`norm.weight`"), "{e}");
    // offsets that do not match shape and dtype
    raw_safetensors(
        &file,
        &json!({"m.weight": {"dtype": "F32", "shape": [8, 64], "data_offsets": [0, 100]}}),
        &[0u8; 100],
    );
    let e = fails(tmp.path(), &src, &QuantizeOptions::default()).to_string();
    assert!(e.contains("`m.weight`") && e.contains("2048"), "{e}");
}

#[test]
fn unsupported_dtype() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let file = src.join("model.safetensors");
    // a dtype MLX has no type for
    raw_safetensors(
        &file,
        &json!({"m.weight": {"dtype": "F8_E4M3", "shape": [8, 64], "data_offsets": [0, 512]}}),
        &[0u8; 512],
    );
    let e = fails(tmp.path(), &src, &QuantizeOptions::default()).to_string();
    assert!(e.contains("model.safetensors") && e.contains("`m.weight`") && e.contains("F8_E4M3"), "{e}");
    // an integer matrix that the shape rule would quantize
    raw_safetensors(
        &file,
        &json!({"m.weight": {"dtype": "I32", "shape": [8, 64], "data_offsets": [0, 2048]}}),
        &[0u8; 2048],
    );
    let e = fails(tmp.path(), &src, &QuantizeOptions::default()).to_string();
    assert!(e.contains("`m.weight`") && e.contains("I32") && e.contains("F32, F16 or BF16"), "{e}");
    // a dtype safetensors does not know
    raw_safetensors(
        &file,
        &json!({"m.weight": {"dtype": "Q4", "shape": [8, 64], "data_offsets": [0, 256]}}),
        &[0u8; 256],
    );
    let e = fails(tmp.path(), &src, &QuantizeOptions::default()).to_string();
    assert!(e.contains("`m.weight`") && e.contains("Q4"), "{e}");
}

#[test]
fn destination_exists() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let dst = tmp.path().join("out");
    std::fs::create_dir(&dst).unwrap();
    std::fs::write(dst.join("keep.txt"), "mine").unwrap();
    let err = quantize_model_dir(&src, &dst, &QuantizeOptions::default(), &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("out") && err.contains("already exists") && err.contains("--force"), "{err}");
    assert_eq!(entries(&dst), ["keep.txt"], "the existing destination is untouched");
    // even with force, the source itself is never the destination
    let options = QuantizeOptions { force: true, ..QuantizeOptions::default() };
    let err = quantize_model_dir(&src, &src, &options, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("is the source"), "{err}");
    // nor a directory that holds the source, nor one that is not a model output
    let err = quantize_model_dir(&src, tmp.path(), &options, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("holds the source"), "{err}");
    // nor a directory inside the source, with force or not (it would be written into it)
    for force in [false, true] {
        let options = QuantizeOptions { force, ..QuantizeOptions::default() };
        let err = quantize_model_dir(&src, &src.join("q4"), &options, &mut |_| {}).unwrap_err().to_string();
        assert!(err.contains("lies inside the source"), "{err}");
        // and the source itself is refused as such, not as "already exists"
        let err = quantize_model_dir(&src, &src, &options, &mut |_| {}).unwrap_err().to_string();
        assert!(err.contains("is the source"), "{err}");
    }
    assert!(!src.join("q4").exists());
    let err = quantize_model_dir(&src, &dst, &options, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("neither a model directory") && err.contains("out"), "{err}");
    assert_eq!(entries(&dst), ["keep.txt"]);
    // a failed forced run keeps the existing destination
    std::fs::remove_file(src.join("config.json")).unwrap();
    assert!(quantize_model_dir(&src, &dst, &options, &mut |_| {}).is_err());
    assert_eq!(entries(&dst), ["keep.txt"]);
    assert_eq!(entries(tmp.path()), ["out", "src"]);
}

#[test]
fn unwritable_destination() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let blocker = tmp.path().join("a-file");
    std::fs::write(&blocker, "").unwrap();
    let dst = blocker.join("sub").join("out");
    let err = quantize_model_dir(&src, &dst, &QuantizeOptions::default(), &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("a-file"), "{err}");
    assert_eq!(entries(tmp.path()), ["a-file", "src"]);
    // missing parents that were created for the output are removed again on failure
    std::fs::remove_file(src.join("model.safetensors")).unwrap();
    let dst = tmp.path().join("new").join("deeper").join("out");
    assert!(quantize_model_dir(&src, &dst, &QuantizeOptions::default(), &mut |_| {}).is_err());
    assert_eq!(entries(tmp.path()), ["a-file", "src"]);
}

#[test]
fn options_mlx_refuses() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    for (bits, group_size, mode, needle) in [
        (7, 64, "affine", "bits"),
        (1, 64, "affine", "bits"),
        (4, 16, "affine", "group_size"),
        (4, 100, "affine", "group_size"),
        (4, 32, "mxfp4", "mxfp4"),
    ] {
        let options = QuantizeOptions { bits, group_size, mode: mode.into(), ..QuantizeOptions::default() };
        let e = fails(tmp.path(), &src, &options).to_string();
        assert!(e.contains(needle), "bits {bits} group {group_size} {mode}: {e}");
    }
}

#[test]
fn inconsistent_quantized_source() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let dst = tmp.path().join("q");
    quantize_model_dir(&src, &dst, &QuantizeOptions::default(), &mut |_| {}).unwrap();
    // the config no longer says how `m` was quantized
    std::fs::write(dst.join("config.json"), json!({"model_type": "llama"}).to_string()).unwrap();
    let e = fails(tmp.path(), &dst, &QuantizeOptions::default()).to_string();
    assert!(e.contains("`m.weight`") && e.contains("no quantization entry"), "{e}");
    // the config disagrees with the tensor shapes
    let cfg = json!({"model_type": "llama", "quantization": {"group_size": 64, "bits": 8}});
    std::fs::write(dst.join("config.json"), cfg.to_string()).unwrap();
    let e = fails(tmp.path(), &dst, &QuantizeOptions::default()).to_string();
    assert!(e.contains("`m.weight`") && e.contains("bits 8"), "{e}");
}
