//! The quantized matmul kernel in bf16 precision (`Precision::Bf16`, `src/qmm.cc`'s bf16
//! section) against an f64 product of the bf16-rounded operands computed here from the packed
//! weights (the kernel's arithmetic restated independently: `w = fma(q, scale, bias)` in f32,
//! both `w` and `x` rounded to bf16 to nearest even, the sum in f64), over bits 4 and 8, group
//! sizes 32/64/128, windows and prompt blocks; window rows against one-row products bit for
//! bit, and the AVX512_BF16 path against the portable one bit for bit (the portable code
//! restates Intel's definition of `vdpbf16ps`, so this checks the CPU's instruction against
//! it where the CPU has one).
//!
//! Tolerance against the bf16 reference: `|Δ| <= 1e-5 * Σ_k |x_k w_k| + 1e-6` (float32
//! accumulation only); against the f32 product `2^-7 * Σ_k |x_k w_k| + 1e-6` (bf16 rounding of
//! both operands, relative `2^-9` each).
use mlx_core::cpu_quant::quantized_matmul_t;
use mlx_core::quant::{self, QuantSpec, QuantizedMatrix};
use mlx_core::random::{Key, normal, uniform};
use mlx_core::settings::Isa;
use mlx_core::{Array, Dtype, KernelPolicy, Precision};
use proptest::prelude::*;

/// VCVTNEPS2BF16 of one value, as f32 (round to nearest even; denormals to signed zero).
fn bf16(v: f32) -> f32 {
    let u = v.to_bits();
    if u & 0x7F80_0000 == 0 {
        return f32::from_bits(u & 0x8000_0000);
    }
    assert!(v.is_finite(), "test inputs are finite");
    f32::from_bits((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF_0000)
}

/// The f32 weights the kernel dequantizes, `fma(q, scale, bias)`, `[n, k]` row-major.
fn dequantized(q: &QuantizedMatrix, n: usize, k: usize) -> Vec<f32> {
    let (bits, gs) = (q.spec.bits as usize, q.spec.group_size as usize);
    let words = q.weight.to_vec::<u32>().unwrap();
    let (s, b) = (q.scales.to_vec::<f32>().unwrap(), q.biases.to_vec::<f32>().unwrap());
    let (per_word, mask) = (32 / bits, (1u32 << bits) - 1);
    let mut w = vec![0f32; n * k];
    for r in 0..n {
        for i in 0..k {
            let word = words[r * k / per_word + i / per_word];
            let qv = (word >> ((i % per_word) * bits)) & mask;
            let g = r * (k / gs) + i / gs;
            w[r * k + i] = (qv as f32).mul_add(s[g], b[g]);
        }
    }
    w
}

fn policy(isa: Isa) -> KernelPolicy {
    KernelPolicy::all_on().with_isa(isa).with_precision(Precision::Bf16)
}

fn case(bits: i32, gs: i32, n: i32, groups: i32, t: i32, seed: u64) -> (QuantizedMatrix, Array, QuantSpec) {
    let spec = QuantSpec::new(gs, bits).unwrap();
    let w = normal(&[n, gs * groups], Dtype::Float32, 0.0, 0.5, &Key::new(seed)).unwrap();
    let x = uniform(-1.0, 1.0, &[t, gs * groups], Dtype::Float32, &Key::new(seed ^ 7)).unwrap();
    (quant::quantize(&w, spec).unwrap(), x, spec)
}

fn strategy() -> impl Strategy<Value = (i32, i32, i32, i32, i32, u64)> {
    (
        prop_oneof![Just(4), Just(8)],
        prop_oneof![Just(32), Just(64), Just(128)],
        1..200i32,
        1..20i32,
        prop_oneof![1..=16i32, Just(33), Just(70)],
        any::<u64>(),
    )
}

fn check_against_reference(isa: Isa, cases: u32) {
    let p = policy(isa);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig { cases, ..ProptestConfig::default() });
    let result = runner.run(&strategy(), |(bits, gs, n, groups, t, seed)| {
        let (q, x, spec) = case(bits, gs, n, groups, t, seed);
        let k = (gs * groups) as usize;
        let (nu, tu) = (n as usize, t as usize);
        let ours = quantized_matmul_t(&x, &q.weight, &q.scales, &q.biases, spec, &p).unwrap().to_vec::<f32>().unwrap();
        let f32_out = quantized_matmul_t(&x, &q.weight, &q.scales, &q.biases, spec, &KernelPolicy::all_on())
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let w = dequantized(&q, nu, k);
        let xs = x.to_vec::<f32>().unwrap();
        for m in 0..tu {
            for r in 0..nu {
                let (mut want, mut mag) = (0f64, 0f64);
                for i in 0..k {
                    let (wv, xv) = (w[r * k + i], xs[m * k + i]);
                    want += bf16(wv) as f64 * bf16(xv) as f64;
                    mag += (wv as f64 * xv as f64).abs();
                }
                let got = ours[m * nu + r] as f64;
                let tol = 1e-5 * mag + 1e-6;
                prop_assert!((got - want).abs() <= tol, "bits {bits} gs {gs} k {k} [{m},{r}]: {got} vs {want}");
                let f = f32_out[m * nu + r] as f64;
                let tol = mag / 128.0 + 1e-6;
                prop_assert!((got - f).abs() <= tol, "bits {bits} gs {gs} k {k} [{m},{r}]: {got} vs f32 {f}");
            }
        }
        Ok(())
    });
    result.unwrap_or_else(|e| panic!("isa {isa} ({}): {e}", p.isa()));
}

#[test]
fn best_bf16_kernel_matches_a_bf16_reference() {
    check_against_reference(Isa::Avx512f, 48);
}

#[test]
fn portable_bf16_kernel_matches_a_bf16_reference() {
    check_against_reference(Isa::Portable, 16);
}

/// Window rows equal one-row products bit for bit, and the best path equals the portable
/// one bit for bit.
#[test]
fn bf16_rows_do_not_depend_on_the_window_size_or_the_instruction_set() {
    let (best, portable) = (policy(Isa::Avx512f), policy(Isa::Portable));
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig { cases: 24, ..ProptestConfig::default() });
    let result = runner.run(&strategy(), |(bits, gs, n, groups, t, seed)| {
        let (q, x, spec) = case(bits, gs, n, groups, t, seed);
        let run = |x: &Array, p: &KernelPolicy| {
            let out = quantized_matmul_t(x, &q.weight, &q.scales, &q.biases, spec, p).unwrap();
            out.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let all = run(&x, &best);
        prop_assert_eq!(
            &all,
            &run(&x, &portable),
            "bits {} gs {} n {} t {}: {} vs portable",
            bits,
            gs,
            n,
            t,
            best.isa()
        );
        for r in 0..t {
            let one = run(&x.slice_axis(0, r, r + 1).unwrap(), &best);
            prop_assert_eq!(&all[(r * n) as usize..((r + 1) * n) as usize], &one[..], "row {} of {}", r, t);
        }
        Ok(())
    });
    result.unwrap();
}

#[test]
fn bf16_precision_is_named_and_reported() {
    assert_eq!(Precision::parse("bf16"), Some(Precision::Bf16));
    assert_eq!(Precision::parse(" F32 "), Some(Precision::F32));
    assert_eq!(Precision::parse("int8"), None);
    assert_eq!(Precision::default(), Precision::F32);
    assert_eq!(policy(Isa::Portable).isa(), "portable (bf16)");
    let best = policy(Isa::Avx512f).isa();
    assert!(best == "portable (bf16)" || best == "avx512f+avx512bf16 (bf16)", "{best}");
    assert_eq!(policy(Isa::Avx512f).bf16_in_hardware(), best.contains("avx512bf16"));
    assert!(!policy(Isa::Portable).bf16_in_hardware());
    assert_ne!(policy(Isa::Avx512f).key(), KernelPolicy::all_on().key());
}

/// One node for several products (q/k/v) gives, in bf16 precision too, exactly the separate
/// products, and the SwiGLU node's rows do not depend on the window size.
#[test]
fn bf16_several_products_and_swiglu() {
    use mlx_core::cpu_quant::{quantized_matmuls_t, swiglu_t};
    let p = policy(Isa::Avx512f);
    for (bits, gs, k, t) in [(4, 64, 576, 11), (8, 32, 160, 3), (4, 128, 384, 40)] {
        let (a, x, spec) = case(bits, gs, 96, k / gs, t, 5);
        let (b, _, _) = case(bits, gs, 96, k / gs, t, 6);
        let bits_of = |a: &Array| a.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let both = quantized_matmuls_t(&x, &[&a, &b], &p).unwrap();
        for (one, m) in both.iter().zip([&a, &b]) {
            let alone = quantized_matmul_t(&x, &m.weight, &m.scales, &m.biases, spec, &p).unwrap();
            assert_eq!(bits_of(one), bits_of(&alone), "bits {bits} gs {gs} t {t}");
        }
        let all = bits_of(&swiglu_t(&x, &a, &b, &p).unwrap());
        let last = bits_of(&swiglu_t(&x.slice_axis(0, t - 1, t).unwrap(), &a, &b, &p).unwrap());
        assert_eq!(&all[((t - 1) * 96) as usize..], &last[..], "swiglu bits {bits} gs {gs} t {t}");
    }
}

/// Long rows (a 1.5B model's MLP, K = 8960) go in blocks of scale groups with the
/// accumulators carried between blocks; odd numbers of size-32 groups end a block mid-pair
/// parity. Rows still equal one-row products and the portable path bit for bit.
#[test]
fn bf16_long_rows_in_blocks_keep_their_bits() {
    let (best, portable) = (policy(Isa::Avx512f), policy(Isa::Portable));
    for (bits, gs, k, t) in [(4, 64, 8960, 11), (4, 32, 4128, 16), (8, 128, 5120, 9), (4, 32, 4128, 33)] {
        let (q, x, spec) = case(bits, gs, 40, k / gs, t, 11);
        let run = |x: &Array, p: &KernelPolicy| {
            let out = quantized_matmul_t(x, &q.weight, &q.scales, &q.biases, spec, p).unwrap();
            out.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let all = run(&x, &best);
        assert_eq!(all, run(&x, &portable), "bits {bits} gs {gs} k {k} t {t}: vs portable");
        for r in [0, t / 2, t - 1] {
            let one = run(&x.slice_axis(0, r, r + 1).unwrap(), &best);
            assert_eq!(&all[(r * 40) as usize..((r + 1) * 40) as usize], &one[..], "k {k} t {t} row {r}");
        }
    }
}
