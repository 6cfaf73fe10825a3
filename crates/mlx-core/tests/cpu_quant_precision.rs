//! The quantized matmul kernel in its opt-in precisions (`src/qmm.cc`'s bf16 and int8
//! sections), each against an f64 reference computed here from the packed weights (the
//! kernel's arithmetic restated independently), over bits 4 and 8, group sizes 32/64/128,
//! windows and prompt blocks; window rows against one-row products bit for bit, and the vector
//! path (AVX512_BF16, AVX512_VNNI) against the portable one bit for bit (the portable code
//! restates Intel's definitions of `vdpbf16ps` and `vpdpbusd`, so this checks the CPU's
//! instructions against them where the CPU has them).
//!
//! - bf16: `w = fma(q, scale, bias)` in f32, both `w` and `x` rounded to bf16 to nearest even,
//!   the sum in f64. Tolerance `|Δ| <= 1e-5 * Σ_k |x_k w_k| + 1e-6` (float32 accumulation
//!   only); against the f32 product `2^-7 * Σ_k |x_k w_k| + 1e-6` (bf16 rounding of both
//!   operands, relative `2^-9` each).
//! - int8: x quantized per block of 32 as llama.cpp's Q8_0 (`d = amax / 127`, codes
//!   `round(x / d)` ties to even), `Σ_g scale_g Σ_{b∈g} d_b (q_b · xq_b) + Σ_g bias_g Σ_{i∈g} x_i`
//!   in f64. Same tolerance (float32 accumulation); against the f32 product
//!   `Σ_k |scale_k q_k| d_{b(k)} / 2 + 1e-5 * Σ_k |x_k w_k| + 1e-6` (each code rounds by at most
//!   half a step; the bias term uses x itself).
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

fn policy(isa: Isa, precision: Precision) -> KernelPolicy {
    KernelPolicy::all_on().with_isa(isa).with_precision(precision)
}

/// Row `x` quantized as the int8 precision does: (codes, each element's block scale `d`).
fn q8_0(x: &[f32]) -> (Vec<i32>, Vec<f32>) {
    let (mut codes, mut scales) = (Vec::new(), Vec::new());
    for block in x.chunks(32) {
        let d = block.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        for v in block {
            codes.push((v * id).round_ties_even().clamp(-127.0, 127.0) as i32);
            scales.push(d);
        }
    }
    (codes, scales)
}

/// The int8 precision's reference for weight row `r` of `q` and activation row `x`:
/// (value, the bound of its distance from the f32 product that comes from quantizing x).
fn int8_reference(q: &QuantizedMatrix, r: usize, k: usize, x: &[f32]) -> (f64, f64) {
    let (bits, gs) = (q.spec.bits as usize, q.spec.group_size as usize);
    let words = q.weight.to_vec::<u32>().unwrap();
    let (s, b) = (q.scales.to_vec::<f32>().unwrap(), q.biases.to_vec::<f32>().unwrap());
    let (per_word, mask) = (32 / bits, (1u32 << bits) - 1);
    let (codes, d) = q8_0(x);
    let (mut want, mut bound) = (0f64, 0f64);
    for i in 0..k {
        let qv = (words[r * k / per_word + i / per_word] >> ((i % per_word) * bits)) & mask;
        let g = r * (k / gs) + i / gs;
        want += s[g] as f64 * d[i] as f64 * (qv as f64 * codes[i] as f64) + b[g] as f64 * x[i] as f64;
        bound += (s[g] as f64 * qv as f64).abs() * d[i] as f64 / 2.0;
    }
    (want, bound)
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
        // Whole panels of 32 features (the kernels' repacked copy) as well as any count.
        prop_oneof![1..200i32, (1..8i32).prop_map(|panels| 32 * panels)],
        1..20i32,
        prop_oneof![1..=16i32, Just(33), Just(70)],
        any::<u64>(),
    )
}

fn check_against_reference(isa: Isa, precision: Precision, cases: u32) {
    let p = policy(isa, precision);
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
                let row = &xs[m * k..(m + 1) * k];
                let mag: f64 = (0..k).map(|i| (w[r * k + i] as f64 * row[i] as f64).abs()).sum();
                let (want, from_f32) = match precision {
                    Precision::Bf16 => {
                        let want = (0..k).map(|i| bf16(w[r * k + i]) as f64 * bf16(row[i]) as f64).sum();
                        (want, mag / 128.0)
                    }
                    Precision::Int8 => int8_reference(&q, r, k, row),
                    Precision::F32 => unreachable!("the f32 path has its own tests (cpu_quant.rs)"),
                };
                let got = ours[m * nu + r] as f64;
                let tol = 1e-5 * mag + 1e-6;
                prop_assert!((got - want).abs() <= tol, "bits {bits} gs {gs} k {k} [{m},{r}]: {got} vs {want}");
                let f = f32_out[m * nu + r] as f64;
                let tol = from_f32 + 1e-5 * mag + 1e-6;
                prop_assert!((got - f).abs() <= tol, "bits {bits} gs {gs} k {k} [{m},{r}]: {got} vs f32 {f}");
            }
        }
        Ok(())
    });
    result.unwrap_or_else(|e| panic!("isa {isa} ({}): {e}", p.isa()));
}

#[test]
fn best_bf16_kernel_matches_a_bf16_reference() {
    check_against_reference(Isa::Avx512f, Precision::Bf16, 48);
}

#[test]
fn portable_bf16_kernel_matches_a_bf16_reference() {
    check_against_reference(Isa::Portable, Precision::Bf16, 16);
}

#[test]
fn best_int8_kernel_matches_an_int8_reference() {
    check_against_reference(Isa::Avx512f, Precision::Int8, 48);
}

#[test]
fn portable_int8_kernel_matches_an_int8_reference() {
    check_against_reference(Isa::Portable, Precision::Int8, 16);
}

#[test]
fn bf16_rows_do_not_depend_on_the_window_size_or_the_instruction_set() {
    rows_do_not_depend_on_the_window_size_or_the_instruction_set(Precision::Bf16);
}

#[test]
fn int8_rows_do_not_depend_on_the_window_size_or_the_instruction_set() {
    rows_do_not_depend_on_the_window_size_or_the_instruction_set(Precision::Int8);
}

/// Window rows equal one-row products bit for bit, and the best path equals the portable
/// one bit for bit.
fn rows_do_not_depend_on_the_window_size_or_the_instruction_set(precision: Precision) {
    let (best, portable) = (policy(Isa::Avx512f, precision), policy(Isa::Portable, precision));
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
fn precisions_are_named_and_reported() {
    assert_eq!(Precision::parse("bf16"), Some(Precision::Bf16));
    assert_eq!(Precision::parse(" F32 "), Some(Precision::F32));
    assert_eq!(Precision::parse("INT8"), Some(Precision::Int8));
    assert_eq!(Precision::parse("int4"), None);
    assert_eq!(Precision::default(), Precision::F32);
    for (precision, instructions) in [(Precision::Bf16, "avx512f+avx512bf16"), (Precision::Int8, "avx512f+avx512vnni")]
    {
        let portable = format!("portable ({precision})");
        assert_eq!(policy(Isa::Portable, precision).isa(), portable);
        let best = policy(Isa::Avx512f, precision).isa();
        // int8 without VNNI: AVX2's 16-bit multiply-adds (same bits).
        let avx2 = format!("avx2+fma ({precision})");
        assert!(
            best == portable
                || best == format!("{instructions} ({precision})")
                || (precision == Precision::Int8 && best == avx2),
            "{best}"
        );
        assert_eq!(policy(Isa::Avx512f, precision).precision_in_hardware(), best != portable);
        assert!(!policy(Isa::Portable, precision).precision_in_hardware());
        assert_ne!(policy(Isa::Avx512f, precision).key(), KernelPolicy::all_on().key());
    }
    assert!(KernelPolicy::all_on().with_isa(Isa::Portable).precision_in_hardware());
}

#[test]
fn bf16_several_products_and_swiglu() {
    several_products_and_swiglu(Precision::Bf16);
}

#[test]
fn int8_several_products_and_swiglu() {
    several_products_and_swiglu(Precision::Int8);
}

/// One node for several products (q/k/v) gives, in this precision too, exactly the separate
/// products, and the SwiGLU node's rows do not depend on the window size.
fn several_products_and_swiglu(precision: Precision) {
    use mlx_core::cpu_quant::{quantized_matmuls_t, swiglu_t};
    let p = policy(Isa::Avx512f, precision);
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

#[test]
fn bf16_long_rows_in_blocks_keep_their_bits() {
    long_rows_in_blocks_keep_their_bits(Precision::Bf16);
}

#[test]
fn int8_long_rows_in_blocks_keep_their_bits() {
    long_rows_in_blocks_keep_their_bits(Precision::Int8);
}

/// Long rows (a 1.5B model's MLP, K = 8960) go in blocks of scale groups with the
/// accumulators carried between blocks; odd numbers of size-32 groups end a block mid-pair
/// parity (and, in int8, a row in a half chunk). Rows still equal one-row products and the
/// portable path bit for bit.
fn long_rows_in_blocks_keep_their_bits(precision: Precision) {
    let (best, portable) = (policy(Isa::Avx512f, precision), policy(Isa::Portable, precision));
    let shapes = [(4, 64, 8960, 11), (4, 32, 4128, 16), (8, 128, 5120, 9), (4, 32, 4128, 33)];
    // 40 features: MLX's rows; 64: the repacked copy (whole panels of 32).
    for ((bits, gs, k, t), n) in shapes.into_iter().flat_map(|s| [(s, 40), (s, 64)]) {
        let (q, x, spec) = case(bits, gs, n, k / gs, t, 11);
        let run = |x: &Array, p: &KernelPolicy| {
            let out = quantized_matmul_t(x, &q.weight, &q.scales, &q.biases, spec, p).unwrap();
            out.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let all = run(&x, &best);
        assert_eq!(all, run(&x, &portable), "bits {bits} gs {gs} k {k} n {n} t {t}: vs portable");
        for r in [0, t / 2, t - 1] {
            let one = run(&x.slice_axis(0, r, r + 1).unwrap(), &best);
            assert_eq!(&all[(r * n) as usize..((r + 1) * n) as usize], &one[..], "k {k} n {n} t {t} row {r}");
        }
    }
}
