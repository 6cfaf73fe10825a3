//! The fused CPU attention (`mlx_core::cpu_attention`, kernel in mlx-sys `src/attn.cc`)
//! against MLX's own `fast::scaled_dot_product_attention` over random shapes: batch, query
//! and KV heads (grouped-query attention), query rows 1 to 70 (decode steps, windows, prompt
//! chunks: tasks of rows that span heads and KV heads), key lengths (up to 1,170: several key
//! segments, windows across a segment's edge), head dims (multiples
//! of 8 take the AVX2 path, others the portable one), the causal mask or none, and strided
//! KV-cache views; plus the property speculative decoding relies on: a row of a window equals
//! the same query computed alone over the keys it sees, bit for bit.
//!
//! Tolerance: `|Δ| <= 1e-5` absolute (outputs are convex combinations of values in [-1, 1]).
use mlx_core::cpu_attention;
use mlx_core::fast::{AttentionMask, scaled_dot_product_attention};
use mlx_core::random::{Key, uniform};
use mlx_core::{Array, Dtype, KernelPolicy};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    b: i32,
    hkv: i32,
    group: i32,
    lq: i32,
    extra_keys: i32,
    d: i32,
    dv: i32,
    causal: bool,
    strided_kv: bool,
    seed: u64,
}

fn rand(shape: &[i32], seed: u64) -> Array {
    uniform(-1.0, 1.0, shape, Dtype::Float32, &Key::new(seed)).unwrap()
}

/// q, k, v of a case; with `strided_kv`, k and v are the first `Lk` positions of a buffer of
/// `Lk + 7` positions (as a KV cache hands them out).
fn inputs(c: &Case) -> (Array, Array, Array) {
    let lk = c.lq + c.extra_keys;
    let q = rand(&[c.b, c.hkv * c.group, c.lq, c.d], c.seed);
    let cap = if c.strided_kv { lk + 7 } else { lk };
    let k = rand(&[c.b, c.hkv, cap, c.d], c.seed ^ 1).slice_axis(2, 0, lk).unwrap();
    let v = rand(&[c.b, c.hkv, cap, c.dv], c.seed ^ 2).slice_axis(2, 0, lk).unwrap();
    (q, k, v)
}

fn mask(causal: bool) -> AttentionMask<'static> {
    if causal { AttentionMask::Causal } else { AttentionMask::None }
}

fn check(c: &Case) -> Result<(), TestCaseError> {
    let (q, k, v) = inputs(c);
    let scale = 1.0 / (c.d as f32).sqrt();
    let (on, off) = (KernelPolicy::all_on(), KernelPolicy::mlx());
    let ours = scaled_dot_product_attention(&q, &k, &v, scale, mask(c.causal), &on).unwrap();
    let o = ours.to_vec::<f32>().unwrap();
    prop_assert_eq!(on.calls().sdpa, 1, "the fused kernel");
    let mlx = scaled_dot_product_attention(&q, &k, &v, scale, mask(c.causal), &off).unwrap();
    let m = mlx.to_vec::<f32>().unwrap();
    prop_assert_eq!(off.calls().sdpa, 0, "MLX's attention");
    prop_assert_eq!(ours.shape(), mlx.shape());
    prop_assert_eq!(ours.shape(), vec![c.b, c.hkv * c.group, c.lq, c.dv]);
    for (i, (a, b)) in o.iter().zip(&m).enumerate() {
        prop_assert!((a - b).abs() <= 1e-5, "element {}: ours {} vs MLX {} ({:?})", i, a, b, c);
    }
    Ok(())
}

/// Row `i` of a causal window equals that query alone over keys `0 ..= Lk - Lq + i`.
fn check_rows_exact(c: &Case) -> Result<(), TestCaseError> {
    let (q, k, v) = inputs(c);
    let lk = c.lq + c.extra_keys;
    let scale = 0.125;
    let window = cpu_attention::attention(&q, &k, &v, scale, true).unwrap();
    for i in 0..c.lq {
        let seen = lk - c.lq + i + 1;
        let qi = q.slice_axis(2, i, i + 1).unwrap();
        let (ki, vi) = (k.slice_axis(2, 0, seen).unwrap(), v.slice_axis(2, 0, seen).unwrap());
        let alone = cpu_attention::attention(&qi, &ki, &vi, scale, true).unwrap().to_vec::<f32>().unwrap();
        let row = window.slice_axis(2, i, i + 1).unwrap().to_vec::<f32>().unwrap();
        prop_assert_eq!(alone, row, "row {} of {:?}", i, c);
    }
    Ok(())
}

fn case() -> impl Strategy<Value = Case> {
    (
        1..=2i32,
        1..=3i32,
        1..=4i32,
        prop::sample::select(vec![1, 2, 3, 5, 8, 11, 16, 33, 70]),
        // Short caches, and caches of several key segments (512 keys each) whose windows end
        // on either side of a segment's edge.
        prop_oneof![0..=90i32, 430..=600i32, 1000..=1100i32],
        prop::sample::select(vec![8, 12, 24, 64, 128]),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(b, hkv, group, lq, extra_keys, d, other_dv, causal, strided_kv, seed)| Case {
            b,
            hkv,
            group,
            lq,
            extra_keys,
            d,
            dv: if other_dv { 16 } else { d },
            causal,
            strided_kv,
            seed,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn fused_attention_matches_mlx(c in case()) {
        check(&c)?;
    }

    #[test]
    fn window_rows_equal_single_queries_bit_for_bit(c in case()) {
        check_rows_exact(&c)?;
    }
}

/// SmolLM2's and Qwen's decode shapes, fixed, on both instruction-set paths' head dims.
#[test]
fn decode_shapes_match_mlx() {
    for (hkv, group, d) in [(3, 3, 64), (2, 6, 128), (1, 4, 256), (2, 2, 20)] {
        for (lq, extra_keys) in [(1, 400), (11, 400), (1, 2166), (11, 2166)] {
            for causal in [false, true] {
                let c = Case { b: 1, hkv, group, lq, extra_keys, d, dv: d, causal, strided_kv: true, seed: 3 };
                check(&c).unwrap();
            }
        }
    }
}

/// The AVX-512 path's value tiles of 3 to 12 query rows and score passes over up to four
/// quads of rows (`Avx512Attn::values_tile`, `scores_quads` in `attn.cc`: a KV head's rows of
/// a window or prompt chunk in balanced tiles, with rows left over and rows that see one key
/// more than the tile): each row equals that query alone bit for bit, and MLX within tolerance.
#[test]
fn value_tiles_keep_single_query_bits() {
    for (hkv, group, d) in [(3, 3, 64), (2, 6, 128)] {
        for (lq, extra_keys) in [(4, 90), (11, 500), (33, 1050), (70, 20)] {
            let c = Case { b: 1, hkv, group, lq, extra_keys, d, dv: d, causal: true, strided_kv: true, seed: 5 };
            check_rows_exact(&c).unwrap();
            check(&c).unwrap();
        }
    }
}

/// `fast::scaled_dot_product_attention` takes the fused path for windows and prompt chunks
/// without an explicit mask, and MLX's path for explicit masks and other dtypes.
#[test]
fn dispatch_covers_unmasked_float32() {
    let run_with = |policy: KernelPolicy, lq: i32, m: AttentionMask<'_>, dtype: Dtype| {
        let q = rand(&[1, 4, lq, 64], 1).astype(dtype).unwrap();
        let k = rand(&[1, 2, 64, 64], 2).astype(dtype).unwrap();
        let v = rand(&[1, 2, 64, 64], 3).astype(dtype).unwrap();
        scaled_dot_product_attention(&q, &k, &v, 0.125, m, &policy).unwrap().eval().unwrap();
        policy.calls().sdpa
    };
    let run = |lq, m, dtype| run_with(KernelPolicy::all_on(), lq, m, dtype);
    assert_eq!(run(1, AttentionMask::None, Dtype::Float32), 1);
    assert_eq!(run(32, AttentionMask::Causal, Dtype::Float32), 1);
    assert_eq!(run(64, AttentionMask::Causal, Dtype::Float32), 1);
    let explicit = Array::ones(&[1, 64], Dtype::Bool).unwrap();
    assert_eq!(run(1, AttentionMask::Array(&explicit), Dtype::Float32), 0);
    assert_eq!(run(1, AttentionMask::None, Dtype::Float16), 0);
    let off = KernelPolicy { sdpa: false, ..KernelPolicy::all_on() };
    assert_eq!(run_with(off, 1, AttentionMask::None, Dtype::Float32), 0);
}

#[test]
fn mismatched_shapes_are_named() {
    let q = rand(&[1, 3, 1, 64], 1);
    let k = rand(&[1, 2, 10, 64], 2);
    let err = cpu_attention::attention(&q, &k, &k, 0.1, false).unwrap_err().to_string();
    assert!(err.contains("Hq % Hkv") && err.contains("(1,3,1,64)"), "{err}");
    let k = rand(&[1, 3, 10, 32], 2);
    assert!(cpu_attention::attention(&q, &k, &k, 0.1, false).is_err());
    let long_q = rand(&[1, 3, 12, 64], 1);
    let k = rand(&[1, 3, 10, 64], 2);
    let err = cpu_attention::attention(&long_q, &k, &k, 0.1, true).unwrap_err().to_string();
    assert!(err.contains("Lq <= Lk"), "{err}");
}
