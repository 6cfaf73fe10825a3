//! Helpers shared by the quantize crate's integration tests.
#![allow(dead_code)]
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlx_core::Array;
use mlx_core::io::{load_safetensors, save_safetensors};
use sha2::{Digest, Sha256};

/// The workspace's fixtures directory.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// Writes `config` and `tensors` (one `model.safetensors`) into a new directory `dir`.
pub fn write_model(dir: &Path, config: &serde_json::Value, tensors: &[(&str, Array)]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(config).unwrap()).unwrap();
    save_safetensors(dir.join("model.safetensors"), tensors.iter().map(|(n, a)| (*n, a)), [("format", "mlx")]).unwrap();
}

/// Every tensor of a model directory's weight files, evaluated.
pub fn load_all(dir: &Path) -> BTreeMap<String, Array> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            out.extend(load_safetensors(&p).unwrap().tensors);
        }
    }
    out
}

/// `name -> "DTYPE [d0,d1] SHA256[:16]"` over the raw bytes of every tensor in the directory's
/// `model*.safetensors` files, read from the files' headers as
/// `fixtures/quantize-model/make_goldens.py` does.
pub fn digests(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if !(name.starts_with("model") && name.ends_with(".safetensors")) {
            continue;
        }
        let data = std::fs::read(&p).unwrap();
        let n = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
        let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&data[8..8 + n]).unwrap();
        for (k, v) in header {
            if k == "__metadata__" {
                continue;
            }
            let off = v["data_offsets"].as_array().unwrap();
            let (s, e) = (off[0].as_u64().unwrap() as usize, off[1].as_u64().unwrap() as usize);
            let bytes = &data[8 + n + s..8 + n + e];
            let shape: Vec<String> =
                v["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap().to_string()).collect();
            let digest = hex(&Sha256::digest(bytes))[..16].to_string();
            out.insert(k, format!("{} [{}] {digest}", v["dtype"].as_str().unwrap(), shape.join(",")));
        }
    }
    out
}

/// sha256 of the lines `NAME DTYPE SHAPE DIGEST` (sorted by name, newline-joined), the
/// script's `combined`.
pub fn combined(d: &BTreeMap<String, String>) -> String {
    let text: Vec<String> = d.iter().map(|(k, v)| format!("{k} {v}")).collect();
    hex(&Sha256::digest(text.join("\n").as_bytes()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Asserts two digest maps are equal, naming the differing tensors.
pub fn assert_same_tensors(ours: &BTreeMap<String, String>, want: &BTreeMap<String, String>, what: &str) {
    let mut diff: Vec<String> = Vec::new();
    for k in ours.keys().chain(want.keys()) {
        if ours.get(k) != want.get(k) && !diff.contains(k) {
            diff.push(format!("{k}: ours {:?}, mlx-lm {:?}", ours.get(k), want.get(k)));
        }
    }
    assert!(diff.is_empty(), "{what}: {} tensors differ from mlx-lm's:\n{}", diff.len(), diff.join("\n"));
}

/// The entries of `parent` (names), to check that nothing was left behind.
pub fn entries(parent: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(parent).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}
