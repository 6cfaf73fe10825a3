//! The strict load (mlx-lm's `strict=True`): a tensor the model does not take is an error
//! naming it, unless the family's ignore list (`Family::ignored_tensors`, mlx-lm's
//! `sanitize`) names it. Built on the tiny llama of `fixtures/parity/llama`.
use std::path::{Path, PathBuf};

use mlx_core::Array;
use mlx_core::io::{load_safetensors, save_safetensors};
use models::layers::LoadContext;
use models::loader::Loader;
use models::weights::Weights;
use models::{Error, Family, LoadOptions, load_model};

fn llama_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity/llama")
}

/// The tiny llama in a temp dir, its weights plus `extra` (one `model.safetensors`).
fn llama_with_extra(extra: &[(&str, &Array)]) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let src = llama_dir();
    std::fs::copy(src.join("config.json"), tmp.path().join("config.json")).unwrap();
    let st = load_safetensors(src.join("model.safetensors")).unwrap();
    let mut tensors: Vec<(&str, &Array)> = st.tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    tensors.extend_from_slice(extra);
    save_safetensors(tmp.path().join("model.safetensors"), tensors, [("format", "mlx")]).unwrap();
    tmp
}

#[test]
fn the_fixture_loads_unchanged() {
    let tmp = llama_with_extra(&[]);
    load_model(tmp.path(), &LoadOptions::default()).unwrap();
}

#[test]
fn an_unused_tensor_is_refused_naming_it() {
    let x = Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
    let tmp = llama_with_extra(&[("model.layers.0.mlp.extra_proj.weight", &x)]);
    let e = load_model(tmp.path(), &LoadOptions::default()).err().expect("the extra tensor is refused");
    assert!(matches!(&e, Error::Unused { names, .. } if names == &["model.layers.0.mlp.extra_proj.weight"]), "{e}");
    assert!(e.to_string().contains("model.layers.0.mlp.extra_proj.weight"), "{e}");
}

#[test]
fn a_tensor_on_the_family_ignore_list_loads() {
    let inv_freq = Array::from_slice(&[1.0f32; 8], &[8]).unwrap();
    let name = "model.layers.0.self_attn.rotary_emb.inv_freq";
    let tmp = llama_with_extra(&[(name, &inv_freq)]);
    assert!(Family::Llama.ignored_tensors().contains(&"rotary_emb.inv_freq"));
    let with = load_model(tmp.path(), &LoadOptions::default()).unwrap();
    let without = load_model(&llama_dir(), &LoadOptions::default()).unwrap();
    let ids = models::generate::ids(&[1, 2, 3]).unwrap();
    let (a, b) = (
        with.forward(&ids, &mut with.make_cache()).unwrap().to_vec::<f32>().unwrap(),
        without.forward(&ids, &mut without.make_cache()).unwrap().to_vec::<f32>().unwrap(),
    );
    assert_eq!(a, b);
}

#[test]
fn finish_refuses_what_its_list_does_not_name() {
    let x = Array::from_slice(&[1.0f32], &[1]).unwrap();
    let name = "model.layers.0.self_attn.rotary_emb.inv_freq";
    let tmp = llama_with_extra(&[(name, &x)]);
    let config = models::ModelConfig::from_dir(tmp.path()).unwrap();
    let ctx = LoadContext::default();
    let build = |ignore: &[&str]| -> models::Result<()> {
        let mut weights = Weights::load(tmp.path())?;
        let mut loader = Loader::new(&mut weights, &ctx);
        models::Transformer::build(config.clone(), &mut loader)?;
        loader.finish(ignore)
    };
    let e = build(&[]).expect_err("an empty ignore list refuses the extra tensor");
    assert!(e.to_string().contains(name), "{e}");
    build(&["rotary_emb.inv_freq"]).unwrap();
    build(&[name]).unwrap();
    // An entry matches whole name components only.
    assert!(build(&["emb.inv_freq"]).is_err());
}

#[test]
fn a_missing_or_misshapen_tensor_is_named() {
    let tmp = llama_with_extra(&[]);
    let st = load_safetensors(tmp.path().join("model.safetensors")).unwrap();
    let mut tensors: Vec<(&str, &Array)> =
        st.tensors.iter().filter(|(k, _)| *k != "model.norm.weight").map(|(k, v)| (k.as_str(), v)).collect();
    save_safetensors(tmp.path().join("model.safetensors"), tensors.clone(), []).unwrap();
    let e = load_model(tmp.path(), &LoadOptions::default()).err().unwrap();
    assert!(e.to_string().contains("model.norm.weight"), "{e}");
    let short = Array::from_slice(&[1.0f32; 3], &[3]).unwrap();
    tensors.push(("model.norm.weight", &short));
    save_safetensors(tmp.path().join("model.safetensors"), tensors, []).unwrap();
    let e = load_model(tmp.path(), &LoadOptions::default()).err().unwrap();
    assert!(e.to_string().contains("model.norm.weight") && e.to_string().contains("[3]"), "{e}");
}

#[test]
fn a_packed_width_that_is_not_whole_bits_is_refused() {
    let name = "model.layers.0.mlp.down_proj";
    let st = load_safetensors(llama_dir().join("model.safetensors")).unwrap();
    let w = &st.tensors[&format!("{name}.weight")]; // [64, 128]
    let q = mlx_core::quant::quantize(w, mlx_core::quant::QuantSpec::new(32, 4).unwrap()).unwrap();
    let write = |packed: &Array| {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::copy(llama_dir().join("config.json"), tmp.path().join("config.json")).unwrap();
        let (wn, sn, bn) = (format!("{name}.weight"), format!("{name}.scales"), format!("{name}.biases"));
        let mut tensors: Vec<(&str, &Array)> =
            st.tensors.iter().filter(|(k, _)| **k != wn).map(|(k, v)| (k.as_str(), v)).collect();
        tensors.extend([(wn.as_str(), packed), (sn.as_str(), &q.scales), (bn.as_str(), &q.biases)]);
        save_safetensors(tmp.path().join("model.safetensors"), tensors, []).unwrap();
        tmp
    };
    // the well-formed 4-bit matrix loads
    load_model(write(&q.weight).path(), &LoadOptions::default()).unwrap();
    // one packed word too many per row: 17 * 32 / 128 = 4.25 bits
    let wide = Array::from_slice(&[0u32; 64 * 17], &[64, 17]).unwrap();
    let e = load_model(write(&wide).path(), &LoadOptions::default()).err().expect("refused");
    assert!(e.to_string().contains(name) && e.to_string().contains("whole bits"), "{e}");
}

#[test]
fn a_tensor_stored_in_two_files_is_refused() {
    let tmp = llama_with_extra(&[]);
    let norm = Array::from_slice(&[1.0f32; 64], &[64]).unwrap();
    save_safetensors(tmp.path().join("model-extra.safetensors"), [("model.norm.weight", &norm)], []).unwrap();
    let e = load_model(tmp.path(), &LoadOptions::default()).err().expect("refused");
    assert!(e.to_string().contains("model.norm.weight") && e.to_string().contains("stored twice"), "{e}");
}

#[test]
fn a_wrong_size_in_config_json_is_named_as_such_for_quantized_weights() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity/llama_q4");
    let tmp = tempfile::tempdir().unwrap();
    for f in ["model.safetensors", "model.safetensors.index.json"] {
        std::fs::copy(src.join(f), tmp.path().join(f)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["intermediate_size"] = 96.into();
    std::fs::write(tmp.path().join("config.json"), config.to_string()).unwrap();
    let e = load_model(tmp.path(), &LoadOptions::default()).err().expect("refused").to_string();
    assert!(
        e.contains("the weights hold a [128, 64] matrix") && e.contains("config.json's sizes make it [96, 64]"),
        "{e}"
    );
    assert!(!e.contains("group_size must be"), "{e}");
}

#[test]
fn a_missing_scales_tensor_is_named_not_reported_as_a_dense_shape() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity/llama_q4");
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), tmp.path().join("config.json")).unwrap();
    let mut st = load_safetensors(src.join("model.safetensors")).unwrap();
    assert!(st.tensors.remove("model.layers.1.mlp.up_proj.scales").is_some());
    let tensors: Vec<(&str, &Array)> = st.tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    save_safetensors(tmp.path().join("model.safetensors"), tensors, [("format", "mlx")]).unwrap();
    let e = load_model(tmp.path(), &LoadOptions::default()).err().expect("refused").to_string();
    assert!(e.contains("`model.layers.1.mlp.up_proj.scales`") && e.contains("missing"), "{e}");
    assert!(!e.contains("expected shape"), "{e}");
}
