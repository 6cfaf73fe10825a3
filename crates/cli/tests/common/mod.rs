//! What the interrupt and kill tests share: a synthetic model directory for `quantize`.
use std::path::Path;

use mlx_core::{Array, Dtype};

/// Writes a synthetic model directory of `n` eligible 8 MiB f32 matrices (`config.json` with
/// `model_type: synthetic`, one `model.safetensors`) into `dir`, creating it.
pub fn model_of(dir: &Path, n: usize) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), r#"{"model_type": "synthetic"}"#).unwrap();
    let values: Vec<f32> = (0..1024u64 * 2048).map(|i| ((i * 7919) % 2003) as f32 / 1001.0 - 1.0).collect();
    let m = Array::from_slice(&values, &[1024, 2048]).unwrap();
    assert_eq!(m.dtype(), Dtype::Float32);
    let names: Vec<String> = (0..n).map(|i| format!("layers.{i}.proj.weight")).collect();
    mlx_core::io::save_safetensors(dir.join("model.safetensors"), names.iter().map(|n| (n.as_str(), &m)), []).unwrap();
}
