//! Batched forwards against solo forwards: the logits (and taps) of each request's window in
//! [`Transformer::forward_batch`] equal, bit for bit, those of the same window run alone on
//! the same cache, for quantized and dense weights (dense parts grouped under the
//! row-invariant kernel's row cap), every family of the tiny fixtures, and a second round on
//! the caches the batched forward extended.
use std::path::PathBuf;

use mlx_core::KernelPolicy;
use models::generate::ids;
use models::{BatchPart, LoadOptions, ModelCache, Transformer, load_model};

fn load(name: &str) -> Transformer {
    load_with(name, KernelPolicy::default())
}

fn load_with(name: &str, kernels: KernelPolicy) -> Transformer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity").join(name);
    load_model(&dir, &LoadOptions { kernels, ..LoadOptions::default() }).unwrap_or_else(|e| panic!("load {name}: {e}"))
}

fn bits(a: &mlx_core::Array) -> Vec<u32> {
    a.astype(mlx_core::Dtype::Float32).unwrap().to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// Prompts of different lengths, windows of different lengths (their sum above the dense
/// kernel's 32-row cap, so dense weights run in several groups).
const PROMPTS: [&[u32]; 4] = [&[3, 17, 42, 5, 99], &[7], &[64, 12, 88, 31, 2, 50, 9, 1, 4], &[200, 201]];
const WINDOWS: [[&[u32]; 4]; 2] = [
    [&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &[12], &[13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], &[24, 25, 26]],
    [&[30, 31], &[32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42], &[43], &[44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54]],
];

fn prefilled(model: &Transformer) -> Vec<ModelCache> {
    PROMPTS
        .iter()
        .map(|p| {
            let mut c = model.make_cache();
            model.forward(&ids(p).unwrap(), &mut c).unwrap();
            c
        })
        .collect()
}

fn check(name: &str) {
    check_model(name, &load(name));
}

fn check_model(name: &str, model: &Transformer) {
    let taps = [0, model.num_layers() - 1];
    let (mut solo, mut batched) = (prefilled(model), prefilled(model));
    for windows in WINDOWS {
        let mut parts: Vec<BatchPart<'_>> =
            batched.iter_mut().zip(windows).map(|(cache, w)| BatchPart { tokens: w.to_vec(), cache }).collect();
        let outs = model.forward_batch(&mut parts, &taps).unwrap();
        for (i, (cache, w)) in solo.iter_mut().zip(windows).enumerate() {
            let alone = model.forward_with_taps(&ids(w).unwrap(), cache, &taps).unwrap();
            assert_eq!(outs[i].logits.shape(), alone.logits.shape(), "{name} part {i}");
            assert!(
                bits(&outs[i].logits) == bits(&alone.logits),
                "{name}: part {i}'s logits differ from its solo forward"
            );
            for (t, (a, b)) in outs[i].taps.iter().zip(&alone.taps).enumerate() {
                assert!(bits(a) == bits(b), "{name}: part {i}'s tap {t} differs");
            }
        }
    }
    for (a, b) in solo.iter().zip(&batched) {
        assert_eq!(a.offset(), b.offset(), "{name}: cache offsets");
    }
}

#[test]
fn batched_rows_equal_solo_rows_bit_for_bit() {
    for name in ["llama_q4", "llama", "qwen2", "qwen3", "llama_untied_bias"] {
        check(name);
    }
}

/// With MLX's RoPE (the CPU node off) every request is roped on its own: the same bits.
#[test]
fn batched_rows_equal_solo_rows_on_mlx_rope() {
    let kernels = KernelPolicy { fast_norm_rope: false, ..KernelPolicy::default() };
    for name in ["llama_q4", "qwen3"] {
        check_model(name, &load_with(name, kernels.clone()));
    }
}

#[test]
fn the_row_cap_follows_the_weights() {
    // llama_q4 keeps a dense (unquantized) lm_head: one dense product caps the rows.
    assert_eq!(load("llama_q4").batch_row_cap(), mlx_core::cpu_quant::DENSE_MAX_ROWS);
    assert_eq!(load("llama").batch_row_cap(), mlx_core::cpu_quant::DENSE_MAX_ROWS);
}

#[test]
fn an_empty_part_is_refused() {
    let model = load("llama_q4");
    let mut cache = model.make_cache();
    let err = model.forward_batch(&mut [BatchPart { tokens: vec![], cache: &mut cache }], &[]).err().unwrap();
    assert!(err.to_string().contains("no tokens"), "{err}");
}
