//! The one-node CPU RMS norm and RoPE (`mlx_core::cpu_fast`, kernels in mlx-sys
//! `src/fast.cc`) against MLX's own `fast::rms_norm` / `fast::rope` (their reference graphs
//! on this backend), bit for bit, over random shapes: leading axes, rows, feature sizes,
//! with and without a norm weight; RoPE with a base or explicit frequencies, traditional or
//! not, `dims` below the feature size, offsets and position scales; contiguous and strided
//! (transposed) inputs. Plus what speculative decoding relies on: a row of a multi-row call
//! equals the same row computed alone, bit for bit.
//!
//! Why the same bits: RoPE uses MLX's own exp, sin and cos and rounds every product and sum
//! as the fallback's separate ops do; the norm sums its squares in the order of MLX's
//! reduction on this build (Linux x86-64 wheel: one lane) and multiplies by `1 / H` as
//! `mean` does.
use mlx_core::fast::{Rope, rms_norm};
use mlx_core::random::{Key, uniform};
use mlx_core::{Array, Dtype, KernelPolicy, cpu_fast};
use proptest::prelude::*;

fn rand(shape: &[i32], seed: u64) -> Array {
    uniform(-2.0, 2.0, shape, Dtype::Float32, &Key::new(seed)).unwrap()
}

/// `[b, h, l, d]`, either contiguous or the transpose of a contiguous `[b, l, h, d]` (the
/// layout of the attention heads rope is applied to).
fn input(b: i32, h: i32, l: i32, d: i32, strided: bool, seed: u64) -> Array {
    if strided { rand(&[b, l, h, d], seed).transpose(&[0, 2, 1, 3]).unwrap() } else { rand(&[b, h, l, d], seed) }
}

/// Ours and MLX's values of `f` (ours first: `f` under a policy with the kernels on, then
/// under one with them off), checking that ours was one kernel node.
fn both(f: impl Fn(&KernelPolicy) -> Array) -> (Vec<f32>, Vec<f32>) {
    let (on, off) = (KernelPolicy::all_on(), KernelPolicy::mlx());
    let ours = f(&on).to_vec::<f32>().unwrap();
    assert_eq!(on.calls().fast, 1, "the fused kernel ran once");
    let theirs = f(&off).to_vec::<f32>().unwrap();
    assert_eq!(off.calls().fast, 0, "the kernels off: MLX's ops");
    (ours, theirs)
}

/// Rows `[r0, r1)` of axis -2 of a `[b, h, l, d]` array, as values.
fn rows(a: &Array, r0: i32, r1: i32) -> Vec<f32> {
    a.slice_axis(2, r0, r1).unwrap().to_vec::<f32>().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn rms_norm_matches_mlx(
        b in 1..3i32, h in 1..4i32, l in 1..6i32, d in prop_oneof![Just(1), Just(7), Just(13), Just(64), Just(576)],
        weighted: bool, strided: bool, eps in prop_oneof![Just(1e-5f32), Just(1e-6f32)], seed: u64,
    ) {
        let on = KernelPolicy::all_on();
        let x = input(b, h, l, d, strided, seed);
        let w = rand(&[d], seed ^ 1);
        let w = weighted.then_some(&w);
        let (ours, theirs) = both(|p| rms_norm(&x, w, eps, p).unwrap());
        prop_assert_eq!(&ours, &theirs, "rms_norm: ours vs MLX");
        // Each row alone gives the same bits as within the call.
        let alone = rms_norm(&x.slice_axis(2, l - 1, l).unwrap(), w, eps, &on).unwrap();
        let all = rms_norm(&x, w, eps, &on).unwrap();
        prop_assert_eq!(rows(&all, l - 1, l), alone.to_vec::<f32>().unwrap());
    }

    #[test]
    fn rope_matches_mlx(
        b in 1..3i32, h in 1..4i32, l in 1..17i32, d in prop_oneof![Just(8), Just(64), Just(80)],
        part in prop_oneof![Just(1), Just(2)], traditional: bool, with_freqs: bool,
        base in prop_oneof![Just(10000f32), Just(1e5f32), Just(1e6f32)],
        scale in prop_oneof![Just(1f32), Just(0.25f32)], offset in 0..3000i32, strided: bool, seed: u64,
    ) {
        let on = KernelPolicy::all_on();
        let dims = d / part / 2 * 2;
        let freqs = with_freqs.then(|| {
            let f: Vec<f32> = (0..dims / 2).map(|i| base.powf(2.0 * i as f32 / dims as f32) * (1.0 + (i % 3) as f32)).collect();
            Array::from_slice(&f, &[dims / 2]).unwrap()
        });
        let rope = Rope { dims, traditional, base, scale, freqs };
        let x = input(b, h, l, d, strided, seed);
        let (ours, theirs) = both(|p| rope.apply(&x, offset, p).unwrap());
        prop_assert_eq!(&ours, &theirs, "rope: ours vs MLX");
        // A window's row l equals a one-row call at position offset + l.
        let all = rope.apply(&x, offset, &on).unwrap();
        for r in [0, l / 2, l - 1] {
            let alone = rope.apply(&x.slice_axis(2, r, r + 1).unwrap(), offset + r, &on).unwrap();
            prop_assert_eq!(rows(&all, r, r + 1), alone.to_vec::<f32>().unwrap(), "row {}", r);
        }
    }
}

#[test]
fn bad_inputs_are_errors_naming_the_problem() {
    let x = rand(&[1, 2, 3, 8], 1);
    let err = cpu_fast::rms_norm(&x, Some(&rand(&[4], 2)), 1e-5).unwrap_err().to_string();
    assert!(err.contains("weight must be float32 [8]") && err.contains("(4)"), "{err}");
    let err = cpu_fast::rms_norm(&x.astype(Dtype::Float16).unwrap(), None, 1e-5).unwrap_err().to_string();
    assert!(err.contains("float32"), "{err}");
    let odd = Rope { dims: 5, traditional: false, base: 1e4, scale: 1.0, freqs: None };
    let err = cpu_fast::rope(&odd, &x, 0).unwrap_err().to_string();
    assert!(err.contains("dims must be even") && err.contains("got 5"), "{err}");
    let wide = Rope { dims: 16, ..odd.clone() };
    assert!(cpu_fast::rope(&wide, &x, 0).unwrap_err().to_string().contains("(0, 8]"));
    let bad_freqs = Rope { dims: 8, freqs: Some(rand(&[3], 3)), ..odd };
    let err = cpu_fast::rope(&bad_freqs, &x, 0).unwrap_err().to_string();
    assert!(err.contains("freqs must be float32 [4]") && err.contains("(3)"), "{err}");
    let err = cpu_fast::rope(&Rope { dims: 8, freqs: None, ..bad_freqs }, &rand(&[8], 4), 0).unwrap_err().to_string();
    assert!(err.contains("at least 2-D"), "{err}");
}

#[test]
fn other_dtypes_keep_mlx_path() {
    let on = KernelPolicy::all_on();
    let x = rand(&[2, 3, 16], 5).astype(Dtype::Bfloat16).unwrap();
    let y = rms_norm(&x, None, 1e-5, &on).unwrap();
    assert_eq!(y.dtype(), Dtype::Bfloat16);
    y.eval().unwrap();
    let r = Rope { dims: 16, traditional: false, base: 1e4, scale: 1.0, freqs: None }.apply(&x, 3, &on).unwrap();
    r.eval().unwrap();
    assert_eq!(on.calls().fast, 0, "bf16 goes to MLX's own ops");
}
