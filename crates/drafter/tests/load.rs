//! Loading: refusals (unknown architecture, missing or leftover tensors, bad config fields,
//! unimplemented head types, a target the drafter does not fit), DFlash checkpoints
//! (`markov_rank` 0, no confidence head), and quantized checkpoints (the load smoke the
//! quantizer will run, gathered-then-dequantized `embed_tokens` / `markov_w1`, logits close
//! to the bf16 drafter's).
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use drafter::{Drafter, Error};
use mlx_core::io::{load_safetensors, save_safetensors};
use mlx_core::quant::QuantSpec;
use mlx_core::{Array, Dtype};
use models::{LoadOptions, ModelConfig};
use serde_json::Value;
use test_support::dspark::{quantize_drafter_for_tests, write_tiny_dspark, write_tiny_target};

fn golden(variant: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/deepspec").join(variant)
}

fn f32_load() -> LoadOptions {
    LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() }
}

/// Copies the golden checkpoint `variant` into `dst`, letting `edit` change the config and
/// the tensors.
fn variant_of(
    variant: &str,
    dst: &Path,
    edit_config: impl FnOnce(&mut Value),
    edit_tensors: impl FnOnce(&mut BTreeMap<String, Array>),
) {
    let src = golden(variant);
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit_config(&mut cfg);
    std::fs::write(dst.join("config.json"), serde_json::to_string(&cfg).unwrap()).unwrap();
    let mut tensors = load_safetensors(src.join("model.safetensors")).unwrap().tensors;
    edit_tensors(&mut tensors);
    save_safetensors(dst.join("model.safetensors"), tensors.iter().map(|(k, v)| (k.as_str(), v)), []).unwrap();
}

fn load_err(dir: &Path) -> Error {
    match Drafter::load(dir, &f32_load()) {
        Err(e) => e,
        Ok(_) => panic!("{} must be refused", dir.display()),
    }
}

#[test]
fn unknown_architecture_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    variant_of("qwen3", dir.path(), |c| c["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]), |_| {});
    let e = load_err(dir.path());
    let msg = e.to_string();
    assert!(matches!(e, Error::Unsupported { .. }), "{msg}");
    assert!(
        msg.contains("Qwen3ForCausalLM") && msg.contains("Qwen3DSparkModel") && msg.contains("config.json"),
        "{msg}"
    );
}

#[test]
fn missing_tensor_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    variant_of(
        "gemma4/k_eq_v",
        dir.path(),
        |_| {},
        |t| {
            t.remove("layers.1.layer_scalar");
        },
    );
    let msg = load_err(dir.path()).to_string();
    assert!(msg.contains("layers.1.layer_scalar") && msg.contains("missing"), "{msg}");

    // Gemma4 without k_eq_v needs v_proj.
    let dir = tempfile::tempdir().unwrap();
    variant_of(
        "gemma4/v_proj",
        dir.path(),
        |_| {},
        |t| {
            t.remove("layers.0.self_attn.v_proj.weight");
        },
    );
    let msg = load_err(dir.path()).to_string();
    assert!(msg.contains("layers.0.self_attn.v_proj.weight"), "{msg}");
}

#[test]
fn misshapen_and_leftover_tensors_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    variant_of(
        "qwen3",
        dir.path(),
        |_| {},
        |t| {
            t.insert("fc.weight".into(), Array::zeros(&[64, 128], Dtype::Bfloat16).unwrap());
        },
    );
    let msg = load_err(dir.path()).to_string();
    assert!(msg.contains("fc.weight") && msg.contains("[64, 192]") && msg.contains("[64, 128]"), "{msg}");

    let dir = tempfile::tempdir().unwrap();
    variant_of(
        "qwen3",
        dir.path(),
        |_| {},
        |t| {
            t.insert("model.embed_tokens.weight".into(), Array::zeros(&[2, 2], Dtype::Bfloat16).unwrap());
        },
    );
    let e = load_err(dir.path());
    assert!(matches!(&e, Error::Unused { names, .. } if names == &["model.embed_tokens.weight"]), "{e}");
}

#[test]
fn bad_config_fields_are_refused() {
    type Edit = fn(&mut Value);
    let cases: [(&str, Edit, &str); 6] = [
        ("mask outside vocab", |c| c["mask_token_id"] = 320.into(), "mask_token_id"),
        ("taps not increasing", |c| c["target_layer_ids"] = serde_json::json!([2, 0, 4]), "target_layer_ids"),
        ("tap beyond target", |c| c["target_layer_ids"] = serde_json::json!([0, 2, 6]), "target_layer_ids"),
        ("gated head", |c| c["markov_head_type"] = "gated".into(), "markov_head_type `gated`"),
        ("no block size", |c| c.as_object_mut().unwrap().remove("block_size").map(|_| ()).unwrap(), "block_size"),
        ("gelu qwen", |c| c["hidden_act"] = "gelu".into(), "activation `gelu`"),
    ];
    for (what, edit, needle) in cases {
        let dir = tempfile::tempdir().unwrap();
        variant_of("qwen3", dir.path(), edit, |_| {});
        let msg = load_err(dir.path()).to_string();
        assert!(msg.contains(needle), "{what}: {msg}");
    }
    let dir = tempfile::tempdir().unwrap();
    variant_of("gemma4/k_eq_v", dir.path(), |c| c["hidden_size_per_layer_input"] = 8.into(), |_| {});
    let msg = load_err(dir.path()).to_string();
    assert!(msg.contains("hidden_size_per_layer_input 8"), "{msg}");
}

#[test]
fn target_that_does_not_fit_is_refused_naming_both_sides() {
    let d = Drafter::load(&golden("qwen3"), &f32_load()).unwrap();
    let parity = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity/qwen3");
    let mut target = ModelConfig::from_dir(&parity).unwrap();
    let check = |t: &ModelConfig| d.check_target(t, "tiny-qwen3").map_err(|e| e.to_string());
    let msg = check(&target).unwrap_err();
    assert!(
        msg.contains("num_target_layers 6") && msg.contains("num_hidden_layers 2") && msg.contains("tiny-qwen3"),
        "{msg}"
    );
    target.num_hidden_layers = 6;
    let msg = check(&target).unwrap_err();
    assert!(msg.contains("vocab_size 320") && msg.contains("vocab_size 256"), "{msg}");
    target.vocab_size = 320;
    target.hidden_size = 128;
    let msg = check(&target).unwrap_err();
    assert!(msg.contains("hidden_size 64") && msg.contains("hidden_size 128"), "{msg}");
    target.hidden_size = 64;
    check(&target).unwrap();
}

/// A DFlash checkpoint: same class, `markov_rank` 0, no Markov or confidence tensors. Its
/// drafts are the argmax of `U`, which the golden's `U` (computed before the Markov head)
/// pins down.
#[test]
fn dflash_checkpoint_drafts_argmax_of_base_logits() {
    let dir = tempfile::tempdir().unwrap();
    variant_of(
        "qwen3",
        dir.path(),
        |c| {
            c["markov_rank"] = 0.into();
            c["enable_confidence_head"] = false.into();
            let o = c.as_object_mut().unwrap();
            o.remove("markov_head_type");
            o.remove("confidence_head_with_markov");
        },
        |t| t.retain(|k, _| !k.starts_with("markov_head.") && !k.starts_with("confidence_head.")),
    );
    let d = Drafter::load(dir.path(), &f32_load()).unwrap();
    let g = load_safetensors(golden("qwen3").join("cases.safetensors")).unwrap();
    let mut ctx = d.new_context();
    d.ingest(&mut ctx, g.get("A.ctx_feats").unwrap()).unwrap();
    let anchor = g.get("A.anchor").unwrap().astype(Dtype::Int64).unwrap().to_vec::<i64>().unwrap()[0] as u32;
    let p = d.propose(&mut ctx, anchor, 0.5).unwrap();
    assert!(p.confidence.is_none());
    assert_eq!(p.drafts.len(), 7, "no confidence head: the threshold does not apply");
    let u = g.get("A.U").unwrap();
    let want = u.argmax(-1, false).unwrap().astype(Dtype::Uint32).unwrap().to_vec::<u32>().unwrap();
    assert_eq!(p.drafts, want);
    let diff = p.base_logits.reshape(&[7, -1]).unwrap().subtract(u).unwrap().abs().unwrap().max(&[], false).unwrap();
    assert!(diff.item().unwrap() < 1e-4);

    // Sampled: slot k is drawn from U_k with the key of step `step + k`.
    let sampler = models::Sampler { temp: 1.0, top_k: 5, seed: 3, ..models::Sampler::default() };
    let mut ctx = d.new_context();
    d.ingest(&mut ctx, g.get("A.ctx_feats").unwrap()).unwrap();
    let s = d.propose_sampled(&mut ctx, anchor, 0.0, &sampler, 9).unwrap();
    for (k, &t) in s.drafts.iter().enumerate() {
        let row = s.base_logits.slice_axis(1, k as i32, k as i32 + 1).unwrap();
        assert_eq!(t, sampler.sample(&row, 9 + k).unwrap(), "slot {k}");
    }
}

/// A tiny 3-layer target and its DSpark drafter under `root`; returns the drafter's directory.
fn tiny_dspark(root: &Path) -> PathBuf {
    let (t, d) = (root.join("target"), root.join("dspark"));
    std::fs::create_dir_all(&t).unwrap();
    std::fs::create_dir_all(&d).unwrap();
    write_tiny_target(&t, 3, 0.3).unwrap();
    write_tiny_dspark(&d, &t, 3).unwrap();
    d
}

/// `rows` standard-normal context features `[1, rows, feature_width]` from `seed`.
fn random_feats(dr: &Drafter, rows: i32, seed: u64) -> Array {
    let width = dr.config().feature_width() as i32;
    mlx_core::random::normal(&[1, rows, width], Dtype::Float32, 0.0, 1.0, &mlx_core::random::Key::new(seed)).unwrap()
}

/// Sampled drafting ([`Drafter::propose_sampled`]) draws Markov slot `k` from `z_k` with the
/// request sampler's key of step `step + k`, so a target sampling that step with the same
/// distribution draws the same token; a greedy sampler gives [`Drafter::propose`]'s drafts,
/// and different seeds give different blocks.
#[test]
fn sampled_markov_drafts_use_the_step_keys() {
    let dir = tempfile::tempdir().unwrap();
    let d = tiny_dspark(dir.path());
    let dr = Drafter::load(&d, &f32_load()).unwrap();
    let feats = random_feats(&dr, 6, 2);
    let run = |sampler: &models::Sampler, step: usize| {
        let mut ctx = dr.new_context();
        dr.ingest(&mut ctx, &feats).unwrap();
        dr.propose_sampled(&mut ctx, 42, 0.0, sampler, step).unwrap()
    };
    let greedy = run(&models::Sampler::default(), 4);
    let mut ctx = dr.new_context();
    dr.ingest(&mut ctx, &feats).unwrap();
    assert_eq!(greedy.all_drafts, dr.propose(&mut ctx, 42, 0.0).unwrap().all_drafts);
    let mut blocks = std::collections::BTreeSet::new();
    for seed in 0..6 {
        let sampler = models::Sampler { temp: 1.5, top_p: 0.9, seed, ..models::Sampler::default() };
        let p = run(&sampler, 4);
        for (k, &t) in p.all_drafts.iter().enumerate() {
            let z = p.logits.slice_axis(1, k as i32, k as i32 + 1).unwrap();
            assert_eq!(t, sampler.sample(&z, 4 + k).unwrap(), "seed {seed} slot {k}");
        }
        blocks.insert(p.all_drafts);
    }
    assert!(blocks.len() > 1, "every seed drew the same block: {blocks:?}");
}

/// The quantized drafter: every eligible module but the confidence head is quantized, the
/// load smoke (one quantized context projection on zeros) gives `[1, 1, H]`, and the
/// quantized drafter's logits stay close to the bf16 drafter's (8-bit closer than 4-bit).
#[test]
fn quantized_drafter_loads_and_tracks_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let d = tiny_dspark(dir.path());
    let bf16 = Drafter::load(&d, &f32_load()).unwrap();
    assert!(bf16.quantized_modules().is_empty());
    let feats = random_feats(&bf16, 9, 5);
    let run = |dr: &Drafter| {
        let mut ctx = dr.new_context();
        dr.ingest(&mut ctx, &feats).unwrap();
        dr.propose(&mut ctx, 42, 0.0).unwrap()
    };
    let reference = run(&bf16);
    let mut errors = Vec::new();
    for bits in [8, 4] {
        let q = dir.path().join(format!("q{bits}"));
        std::fs::create_dir_all(&q).unwrap();
        let bases = quantize_drafter_for_tests(&d, &q, QuantSpec::new(64, bits).unwrap()).unwrap();
        let dr = Drafter::load(&q, &f32_load()).unwrap();
        assert_eq!(dr.quantized_modules(), &bases[..]);
        for b in [
            "embed_tokens",
            "markov_head.markov_w1",
            "markov_head.markov_w2",
            "fc",
            "lm_head",
            "layers.1.mlp.down_proj",
        ] {
            assert!(bases.iter().any(|x| x == b), "{b} not quantized: {bases:?}");
        }
        assert!(!bases.iter().any(|b| b.starts_with("confidence_head")));
        let cfg: Value = serde_json::from_str(&std::fs::read_to_string(q.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["quantization"]["confidence_head.proj"], Value::Bool(false));
        // The load smoke.
        let smoke = drafter::quant::load_smoke(&q).unwrap();
        assert_eq!(smoke.projection_shape, vec![1, 1, dr.hidden_size() as i32]);
        assert_eq!(smoke.quantized_modules, bases);
        let p = run(&dr);
        // Compare the logits of the slots whose previous drafts agree.
        let same = 1 + p.all_drafts.iter().zip(&reference.all_drafts).take(6).take_while(|(a, b)| a == b).count();
        let rows = |a: &Array| a.reshape(&[7, -1]).unwrap().slice_axis(0, 0, same as i32).unwrap();
        let err = rows(&p.logits).subtract(&rows(&reference.logits)).unwrap().abs().unwrap().max(&[], false).unwrap();
        errors.push(err.item().unwrap());
    }
    eprintln!("max |z - z_bf16|: 8-bit {:.4}, 4-bit {:.4}", errors[0], errors[1]);
    assert!(errors[0] < errors[1] && errors[0] < 0.25 && errors[1] < 2.5, "{errors:?}");
}

/// Legacy exports nest `mask_token_id` and `target_layer_ids` in `dflash_config`.
#[test]
fn legacy_dflash_config_fields_are_read() {
    let dir = tempfile::tempdir().unwrap();
    variant_of(
        "qwen3",
        dir.path(),
        |c| {
            let o = c.as_object_mut().unwrap();
            let mask = o.remove("mask_token_id").unwrap();
            let taps = o.remove("target_layer_ids").unwrap();
            o.insert("dflash_config".into(), serde_json::json!({"mask_token_id": mask, "target_layer_ids": taps}));
        },
        |_| {},
    );
    let d = Drafter::load(dir.path(), &f32_load()).unwrap();
    assert_eq!(d.config().mask_token_id, 300);
    assert_eq!(d.target_layer_ids(), &[0, 2, 4]);
}

#[test]
fn policy_keeps_only_the_confidence_head_dense() {
    use drafter::quant::quantize_predicate;
    assert!(!quantize_predicate("confidence_head.proj"));
    for b in
        ["embed_tokens", "fc", "lm_head", "markov_head.markov_w1", "markov_head.markov_w2", "layers.3.self_attn.q_proj"]
    {
        assert!(quantize_predicate(b), "{b}");
    }
}

#[test]
fn wrong_target_layer_and_hidden_sizes_are_named_as_config_fields() {
    let dir = tempfile::tempdir().unwrap();
    variant_of("qwen3", dir.path(), |c| c["target_layer_ids"] = serde_json::json!([0, 2]), |_| {});
    let msg = load_err(dir.path()).to_string();
    assert!(msg.contains("target_layer_ids") && !msg.contains("group_size must be"), "{msg}");
    let dir = tempfile::tempdir().unwrap();
    variant_of("qwen3", dir.path(), |c| c["hidden_size"] = serde_json::json!(56), |_| {});
    let msg = load_err(dir.path()).to_string();
    assert!(msg.contains("from config.json's sizes") && !msg.contains("group_size must be"), "{msg}");
}
