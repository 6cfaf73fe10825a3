//! `quantize_drafter_dir` on DeepSpec's golden Qwen3 and Gemma4 checkpoints
//! (`fixtures/deepspec`): every shape-eligible tensor except the confidence head is
//! quantized, `confidence_head.proj` is recorded as `false`, the output reloads and drafts;
//! and the refusals (a model that is not a drafter, an already quantized drafter, bits or
//! group sizes outside the policy, an existing destination) leave nothing behind.
use std::path::{Path, PathBuf};

use drafter::quant::quantize_drafter_dir;
use drafter::{Drafter, Error};
use mlx_core::{Array, Dtype};
use models::LoadOptions;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// A checkpoint directory holding only the golden's config.json and model.safetensors
/// (the goldens' cases.* files sit beside them).
fn checkpoint(golden: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join("deepspec").join(golden).join(f), dir.path().join(f)).unwrap();
    }
    dir
}

/// Names in `parent` other than `keep`: leftovers of a failed run.
fn leftovers(parent: &Path, keep: &[&str]) -> Vec<String> {
    std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| !keep.contains(&n.as_str()))
        .collect()
}

fn config(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

#[test]
fn quantizes_every_eligible_tensor_but_the_confidence_head() {
    let mut seen_false = false;
    for golden in ["qwen3", "gemma4/k_eq_v", "gemma4/v_proj"] {
        let src = checkpoint(golden);
        let out = tempfile::tempdir().unwrap();
        for (bits, group) in [(4, 32), (8, 64)] {
            let dst = out.path().join(format!("q{bits}g{group}"));
            let mut events = 0;
            let r = quantize_drafter_dir(src.path(), &dst, bits, group, false, &mut |_| events += 1)
                .unwrap_or_else(|e| panic!("{golden} q{bits}g{group}: {e}"));
            assert!(events > 2, "progress events reach the caller");
            assert_eq!(r.smoke.projection_shape.len(), 3);
            assert_eq!(r.quantize.out_dir, dst);
            let q = &config(&dst)["quantization"];
            assert_eq!((q["bits"].as_i64(), q["group_size"].as_i64()), (Some(bits as i64), Some(group as i64)));
            let mut confidence_false = false;
            let d = Drafter::load(&dst, &LoadOptions::default()).unwrap();
            let header = safetensors_names(&dst.join("model.safetensors"));
            for name in header.iter().filter(|n| n.ends_with(".weight")) {
                let base = name.trim_end_matches(".weight");
                let quantized = header.contains(&format!("{base}.scales"));
                let shape = tensor_shape(&src.path().join("model.safetensors"), name);
                let eligible = shape.len() == 2 && shape[1].is_multiple_of(group as usize);
                if base.starts_with("confidence_head") {
                    assert!(!quantized, "{golden}: {base} must stay dense");
                    // The policy is consulted (and records `false`) for shape-eligible modules.
                    if eligible {
                        assert_eq!(q[base], serde_json::Value::Bool(false), "{golden}: {base} recorded as false");
                        confidence_false = true;
                    }
                } else {
                    assert_eq!(quantized, eligible, "{golden} q{bits}g{group}: {name} {shape:?}");
                    if quantized {
                        assert!(d.quantized_modules().contains(&base.to_string()), "{base} loads quantized");
                    }
                }
            }
            assert_eq!(
                confidence_false,
                q.as_object().unwrap().values().any(|v| v == &serde_json::Value::Bool(false)),
                "{golden}: the only `false` entry is the confidence head"
            );
            seen_false |= confidence_false;
            // It drafts: one block from a zero context.
            let width = d.config().feature_width() as i32;
            let mut ctx = d.new_context();
            d.ingest(&mut ctx, &Array::zeros(&[1, 3, width], Dtype::Float32).unwrap()).unwrap();
            let p = d.propose(&mut ctx, 1, 0.0).unwrap();
            assert_eq!(p.drafts.len(), d.block_size(), "{golden}: a full block");
        }
        assert_eq!(leftovers(out.path(), &["q4g32", "q8g64"]), Vec::<String>::new());
    }
    assert!(seen_false, "some golden has a shape-eligible confidence head recorded as false");
}

fn header(path: &Path) -> serde_json::Map<String, serde_json::Value> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    h.remove("__metadata__");
    h
}

fn safetensors_names(path: &Path) -> Vec<String> {
    header(path).keys().cloned().collect()
}

fn tensor_shape(path: &Path, name: &str) -> Vec<usize> {
    header(path)[name]["shape"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect()
}

#[test]
fn refusals_leave_nothing_behind() {
    let src = checkpoint("qwen3");
    let out = tempfile::tempdir().unwrap();
    let dst = out.path().join("q");

    // Not a DeepSpec drafter: a target model directory.
    let model = fixtures().join("parity/qwen3");
    let e = quantize_drafter_dir(&model, &dst, 4, 64, false, &mut |_| {}).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }) && e.to_string().contains("mlx-spec quantize"), "{e}");
    // Bits and group sizes outside the policy.
    for (bits, group) in [(3, 64), (4, 128), (2, 32)] {
        let e = quantize_drafter_dir(src.path(), &dst, bits, group, false, &mut |_| {}).unwrap_err();
        assert!(matches!(e, Error::Invalid(_)), "bits {bits} group {group}: {e}");
    }
    assert!(leftovers(out.path(), &[]).is_empty(), "{:?}", leftovers(out.path(), &[]));

    // Already quantized.
    quantize_drafter_dir(src.path(), &dst, 4, 64, false, &mut |_| {}).unwrap();
    let again = out.path().join("again");
    let e = quantize_drafter_dir(&dst, &again, 8, 64, false, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("already quantized"), "{e}");
    // An existing destination, without and with --force.
    let e = quantize_drafter_dir(src.path(), &dst, 8, 64, false, &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("--force"), "{e}");
    assert_eq!(config(&dst)["quantization"]["bits"], 4, "the refused run kept the old output");
    quantize_drafter_dir(src.path(), &dst, 8, 64, true, &mut |_| {}).unwrap();
    assert_eq!(config(&dst)["quantization"]["bits"], 8);
    assert_eq!(leftovers(out.path(), &["q"]), Vec::<String>::new());
}

/// A checkpoint directory that also holds an unrelated `*.safetensors` (evaluation outputs)
/// quantizes from the drafter's own `model.safetensors` only (mlx-lm's discovery: the
/// index, else `model*.safetensors`): the stranger's tensors are neither copied into the
/// output nor refused by the load smoke, and both directories load.
#[test]
fn unrelated_safetensors_beside_the_checkpoint_are_ignored() {
    let src = checkpoint("qwen3");
    let stranger = Array::zeros(&[2, 3], Dtype::Float32).unwrap();
    mlx_core::io::save_safetensors(src.path().join("eval_outputs.safetensors"), [("eval.logits", &stranger)], [])
        .unwrap();
    Drafter::load(src.path(), &LoadOptions::default()).expect("the source loads beside the stranger");
    let out = tempfile::tempdir().unwrap();
    let dst = out.path().join("q");
    quantize_drafter_dir(src.path(), &dst, 4, 64, false, &mut |_| {}).unwrap();
    let names = safetensors_names(&dst.join("model.safetensors"));
    assert!(!names.iter().any(|n| n.starts_with("eval.")), "{names:?}");
    assert!(!dst.join("eval_outputs.safetensors").exists());
    Drafter::load(&dst, &LoadOptions::default()).unwrap();
    assert_eq!(leftovers(out.path(), &["q"]), Vec::<String>::new());
}
