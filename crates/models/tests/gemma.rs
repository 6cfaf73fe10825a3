//! Gemma 3 / Gemma 4 parity with mlx-lm on tiny random models made by mlx-lm's own classes
//! (`fixtures/gemma/make_goldens.py`), each with a sliding window of 8 positions: logits of a
//! full-prompt forward, of a chunked (cached) forward, of multi-token blocks written into a
//! wrapped rotating cache, and 40 greedy tokens (the window wraps five times).
use std::path::PathBuf;

use mlx_core::{Array, Dtype, io::load_safetensors};
use models::generate::{generate, ids};
use models::{Family, GenerateParams, LoadOptions, Sampler, load_model};

const STEP_BLOCKS: [usize; 7] = [3, 1, 4, 2, 5, 1, 3];

fn case_dir(name: &str) -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gemma").join(name)
}

fn max_diff(a: &Array, b: &Array) -> f32 {
    assert_eq!(a.shape(), b.shape());
    let (a, b) = (a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn int_ids(a: &Array) -> Vec<u32> {
    a.to_vec::<i32>().unwrap().iter().map(|&t| t as u32).collect()
}

/// Logits are of scale ~1.5. The tolerance covers another summation order: dense products of
/// short inputs run on mlx-spec's CPU kernel (`mlx_core::cpu_quant::dense_matmuls_t`), mlx-lm's
/// on BLAS; measured max |diff| 1.24e-5 (`gemma4_plain`), 5.4e-6 with `MLX_SPEC_DENSE=mlx`.
fn check(name: &str, family: Family, rollback: usize) {
    const TOL: f32 = 2e-5;
    let dir = case_dir(name);
    let model = load_model(&dir, &LoadOptions::default()).unwrap();
    assert_eq!(model.family, family);
    let g = load_safetensors(dir.join("goldens.safetensors")).unwrap();
    for i in 0..2 {
        let prompt = int_ids(g.get(&format!("prompt_{i}")).unwrap());
        let n = prompt.len();
        let mut cache = model.make_cache_with_rollback(rollback);
        let logits = model.forward(&ids(&prompt).unwrap(), &mut cache).unwrap();
        let d = max_diff(&logits, g.get(&format!("logits_{i}")).unwrap());
        eprintln!("{name} prompt {i}: full-forward logits differ by {d:.2e}");
        assert!(d <= TOL, "{name} prompt {i}: full-forward logits differ by {d}");
        assert_eq!(cache.offset(), n);

        let mut cache = model.make_cache_with_rollback(rollback);
        model.forward(&ids(&prompt[..n - 3]).unwrap(), &mut cache).unwrap();
        let chunked = model.forward(&ids(&prompt[n - 3..]).unwrap(), &mut cache).unwrap();
        let d = max_diff(&chunked, g.get(&format!("chunked_{i}")).unwrap());
        assert!(d <= TOL, "{name} prompt {i}: cached-forward logits differ by {d}");

        let mut cache = model.make_cache_with_rollback(rollback);
        model.forward(&ids(&prompt[..5]).unwrap(), &mut cache).unwrap();
        let (mut pos, mut parts, mut b) = (5, Vec::new(), 0);
        while pos < n {
            let len = STEP_BLOCKS[b % STEP_BLOCKS.len()].min(n - pos);
            parts.push(model.forward(&ids(&prompt[pos..pos + len]).unwrap(), &mut cache).unwrap());
            pos += len;
            b += 1;
        }
        let stepped = mlx_core::concatenate(&parts.iter().collect::<Vec<_>>(), 1).unwrap();
        let d = max_diff(&stepped, g.get(&format!("stepped_{i}")).unwrap());
        assert!(d <= TOL, "{name} prompt {i}: block-by-block logits differ by {d} (rollback {rollback})");

        let want = int_ids(g.get(&format!("greedy_{i}")).unwrap());
        let params = GenerateParams { max_tokens: want.len(), sampler: Sampler::default(), eos: vec![] };
        let mut got = Vec::new();
        generate(&model, &prompt, &params, |t| {
            got.push(t);
            true
        })
        .unwrap();
        assert_eq!(got, want, "{name} prompt {i}: greedy tokens differ");
    }
}

#[test]
fn gemma3_sliding_and_global_layers() {
    check("gemma3", Family::Gemma3, 32);
}

#[test]
fn gemma3_small_rollback_reach_takes_the_concat_path() {
    // Blocks of up to 5 tokens exceed a reach of 2: those writes go through the temporal
    // concatenation path of the rotating cache instead of the ring.
    check("gemma3", Family::Gemma3, 2);
}

#[test]
fn gemma3_untied_head_linear_rope_scaling() {
    check("gemma3_untied", Family::Gemma3, 4);
}

#[test]
fn gemma4_k_eq_v_kv_sharing_per_layer_inputs_softcap() {
    check("gemma4", Family::Gemma4, 32);
    check("gemma4", Family::Gemma4, 1);
}

#[test]
fn gemma4_default_schedule_untied() {
    check("gemma4_plain", Family::Gemma4, 3);
}

#[test]
fn gemma4_kv_shared_layers_keep_no_cache() {
    let model = load_model(&case_dir("gemma4"), &LoadOptions::default()).unwrap();
    assert_eq!(model.num_layers(), 6);
    assert_eq!(model.make_cache().layers.len(), 4);
}

#[test]
fn gemma4_taps_come_from_the_same_graph_as_the_logits() {
    // The DSpark drafters read target hidden states: the taps of a gemma4 forward.
    let model = load_model(&case_dir("gemma4"), &LoadOptions::default()).unwrap();
    let g = load_safetensors(case_dir("gemma4").join("goldens.safetensors")).unwrap();
    let prompt = int_ids(g.get("prompt_1").unwrap());
    let out = model.forward_with_taps(&ids(&prompt).unwrap(), &mut model.make_cache(), &[0, 5, 2]).unwrap();
    assert_eq!(out.taps.len(), 3);
    for t in &out.taps {
        assert_eq!(t.shape(), vec![1, prompt.len() as i32, 64]);
    }
    let d = max_diff(&out.logits, g.get("logits_1").unwrap());
    assert!(d <= 2e-5, "logits with taps differ by {d}");
    assert!(model.forward_with_taps(&ids(&prompt).unwrap(), &mut model.make_cache(), &[6]).is_err());
}
