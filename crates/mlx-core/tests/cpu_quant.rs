//! The fast CPU quantized matmul (`mlx_core::cpu_quant`, kernel in mlx-sys `src/qmm.cc`)
//! against MLX's own `quantized_matmul` and against an f64 product with MLX's dequantized
//! weights, over random shapes, bits (4, 8), group sizes (32, 64, 128), activation rows
//! `T` (1..=16 and more), batch axes, strided inputs, every instruction-set path (portable, AVX2, AVX-512) and one or
//! more threads.
//!
//! Tolerance per output element: `|Δ| <= 1e-5 * Σ_k |x_k w_k| + 1e-6` (float32 rounding
//! of a K-term dot product in another summation order).
use mlx_core::cpu_quant::{self, quantized_matmul_t};
use mlx_core::quant::{self, QuantSpec};
use mlx_core::random::{Key, normal, uniform};
use mlx_core::settings::Isa;
use mlx_core::{Array, Dtype, KernelPolicy};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    bits: i32,
    gs: i32,
    n: i32,
    groups: i32,
    batch: Vec<i32>,
    transposed_x: bool,
    seed: u64,
    /// How the matrix was stored before loading (see [`quantize_stored`]).
    stored: Stored,
}

/// The weight file's dtype a matrix is quantized in, and a magnitude: f16 and bf16 scales give
/// the repacked copy 16-bit groups (qmm.cc, `GroupFormat`); tiny f16 values reach f16's
/// subnormals, and large bf16 values (beyond f16's range) keep the groups in bf16.
#[derive(Debug, Clone, Copy)]
enum Stored {
    F32,
    F16,
    F16Tiny,
    Bf16Large,
    /// Scales below 2^-100 (f32).
    F32Minute,
}

/// `w` scaled and quantized as `stored` says, with its scales and biases then in f32, as
/// models load.
fn quantize_stored(w: &Array, spec: QuantSpec, stored: Stored) -> quant::QuantizedMatrix {
    let (dtype, factor) = match stored {
        Stored::F32 => (Dtype::Float32, 1.0),
        Stored::F16 => (Dtype::Float16, 1.0),
        Stored::F16Tiny => (Dtype::Float16, 1e-4),
        Stored::Bf16Large => (Dtype::Bfloat16, 1e6),
        Stored::F32Minute => (Dtype::Float32, 1e-33),
    };
    let q = quant::quantize(&w.multiply(&Array::scalar(factor)).unwrap().astype(dtype).unwrap(), spec).unwrap();
    quant::QuantizedMatrix {
        scales: q.scales.astype(Dtype::Float32).unwrap(),
        biases: q.biases.astype(Dtype::Float32).unwrap(),
        ..q
    }
}

fn stored_kinds() -> impl Strategy<Value = Stored> {
    prop_oneof![Just(Stored::F32), Just(Stored::F16), Just(Stored::F16Tiny), Just(Stored::Bf16Large)]
}

fn check(c: &Case, p: &KernelPolicy) -> Result<(), TestCaseError> {
    let k = c.gs * c.groups;
    let spec = QuantSpec::new(c.gs, c.bits).unwrap();
    let w = normal(&[c.n, k], Dtype::Float32, 0.0, 0.5, &Key::new(c.seed)).unwrap();
    let q = quantize_stored(&w, spec, c.stored);
    let x = if c.transposed_x {
        // a strided view: [.., K] obtained by swapping the last two axes of [.., K, T]
        let mut s = c.batch.clone();
        let t = s.pop().unwrap();
        s.extend([k, t]);
        uniform(-1.0, 1.0, &s, Dtype::Float32, &Key::new(c.seed ^ 7)).unwrap().swapaxes(-1, -2).unwrap()
    } else {
        let mut s = c.batch.clone();
        s.push(k);
        uniform(-1.0, 1.0, &s, Dtype::Float32, &Key::new(c.seed ^ 7)).unwrap()
    };
    let ours = quantized_matmul_t(&x, &q.weight, &q.scales, &q.biases, spec, p).unwrap();
    let mlx = q.matmul_t(&x).unwrap();
    let mut want_shape = c.batch.clone();
    want_shape.push(c.n);
    prop_assert_eq!(ours.shape(), want_shape.clone());
    prop_assert_eq!(ours.dtype(), Dtype::Float32);
    let (o, m) = (ours.to_vec::<f32>().unwrap(), mlx.to_vec::<f32>().unwrap());
    // f64 reference with MLX's dequantized weights, and the magnitude sum for the tolerance
    let wd = q.dequantize().unwrap().astype(Dtype::Float64).unwrap().t().unwrap();
    let xd = x.astype(Dtype::Float64).unwrap();
    let exact = xd.matmul(&wd).unwrap().to_vec::<f64>().unwrap();
    let mag = xd.abs().unwrap().matmul(&wd.abs().unwrap()).unwrap().to_vec::<f64>().unwrap();
    for (i, ((ov, mv), (ex, mg))) in o.iter().zip(&m).zip(exact.iter().zip(&mag)).enumerate() {
        let tol = 1e-5 * mg + 1e-6;
        let (ov, mv) = (*ov as f64, *mv as f64);
        prop_assert!((ov - ex).abs() <= tol, "{c:?} [{i}]: ours {ov}, exact {ex}, tol {tol}");
        prop_assert!((ov - mv).abs() <= 2.0 * tol, "{c:?} [{i}]: ours {ov}, mlx {mv}, tol {tol}");
    }
    Ok(())
}

fn cases(max_n: i32, max_groups: i32) -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(4), Just(8)],
        prop_oneof![Just(32), Just(64), Just(128)],
        // Whole panels of 32 features (the repacked path on AVX-512) as often as other counts.
        prop_oneof![1..max_n, (1..=(max_n + 31) / 32).prop_map(|p| 32 * p)],
        1..max_groups,
        prop_oneof![
            (1..=16i32).prop_map(|t| vec![t]),
            (1..=3i32, 1..=11i32).prop_map(|(b, t)| vec![b, t]),
            (17..=40i32).prop_map(|t| vec![1, t]),
        ],
        any::<bool>(),
        any::<u64>(),
        stored_kinds(),
    )
        .prop_map(|(bits, gs, n, groups, batch, transposed_x, seed, stored)| Case {
            bits,
            gs,
            n,
            groups,
            batch,
            transposed_x,
            seed,
            stored,
        })
}

fn run(isa: Isa, threads: usize, max_n: i32, max_groups: i32, n_cases: u32) {
    let policy = KernelPolicy::all_on().with_isa(isa).with_threads(threads);
    let mut runner =
        proptest::test_runner::TestRunner::new(proptest::test_runner::Config { cases: n_cases, ..Default::default() });
    let result = runner.run(&cases(max_n, max_groups), |c| check(&c, &policy));
    result.unwrap_or_else(|e| panic!("isa {isa} (in use: {}), threads {threads}: {e}", policy.isa()));
}

#[test]
fn best_kernel_one_thread_matches_mlx() {
    run(Isa::Avx512f, 1, 70, 7, 96);
}

#[test]
fn best_kernel_all_threads_matches_mlx() {
    // large enough products to be split over threads (N * K >= 32768)
    run(Isa::Avx512f, 2, 400, 9, 24);
}

#[test]
fn avx2_kernel_matches_mlx() {
    run(Isa::Avx2Fma, 2, 300, 7, 48);
}

#[test]
fn portable_kernel_matches_mlx() {
    run(Isa::Portable, 2, 300, 7, 48);
}

#[test]
fn isa_is_reported_and_can_be_capped() {
    let best = KernelPolicy::all_on().isa();
    assert!(Isa::ALL.iter().any(|i| i.name() == best), "{best}");
    assert_eq!(KernelPolicy::all_on().with_isa(Isa::Portable).isa(), "portable");
    assert_eq!(Isa::parse("sse9"), None);
    assert_eq!(Isa::parse("avx2"), Some(Isa::Avx2Fma));
}

#[test]
fn bad_inputs_are_errors_naming_the_problem() {
    let p = &KernelPolicy::all_on();
    let w = normal(&[8, 64], Dtype::Float32, 0.0, 1.0, &Key::new(1)).unwrap();
    let q = quant::quantize(&w, QuantSpec::new(32, 4).unwrap()).unwrap();
    let x = Array::ones(&[2, 64], Dtype::Float32).unwrap();
    // wrong K
    let bad = Array::ones(&[2, 32], Dtype::Float32).unwrap();
    let e = quantized_matmul_t(&bad, &q.weight, &q.scales, &q.biases, q.spec, p).unwrap_err().to_string();
    assert!(e.contains("must end in K = 64"), "{e}");
    // unsupported bits
    let q3 = quant::quantize(&w, QuantSpec::new(32, 3).unwrap()).unwrap();
    let e = quantized_matmul_t(&x, &q3.weight, &q3.scales, &q3.biases, q3.spec, p).unwrap_err().to_string();
    assert!(e.contains("bits must be 4 or 8"), "{e}");
    assert!(!cpu_quant::supports(&q3, Dtype::Float32));
    // f16 activations are not taken (the layer falls back to MLX's kernel)
    assert!(!cpu_quant::supports(&q, Dtype::Float16));
    let e = quantized_matmul_t(&x.astype(Dtype::Float16).unwrap(), &q.weight, &q.scales, &q.biases, q.spec, p)
        .unwrap_err()
        .to_string();
    assert!(e.contains("float32"), "{e}");
    // scales of another shape
    let e = quantized_matmul_t(&x, &q.weight, &q.scales.slice_axis(0, 0, 4).unwrap(), &q.biases, q.spec, p)
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs scales and biases (8,2)"), "{e}");
}

#[test]
fn auto_falls_back_to_mlx_for_other_dtypes() {
    let p = &KernelPolicy::all_on();
    let w = normal(&[16, 64], Dtype::Float32, 0.0, 1.0, &Key::new(3)).unwrap();
    let q = quant::quantize(&w, QuantSpec::new(64, 4).unwrap()).unwrap();
    let x = Array::ones(&[1, 64], Dtype::Float16).unwrap();
    let a = q.matmul_t_auto(&x, p).unwrap();
    let b = q.matmul_t(&x).unwrap();
    assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    assert_eq!(p.calls().qmm, 0, "f16 activations stay with MLX's kernel");
    let f32_x = Array::ones(&[1, 64], Dtype::Float32).unwrap();
    q.matmul_t_auto(&f32_x, p).unwrap();
    assert_eq!(p.calls().qmm, 1, "f32 activations take the kernel");
    q.matmul_t_auto(&f32_x, &KernelPolicy { qmm: false, ..p.clone() }).unwrap();
    assert_eq!(p.calls().qmm, 1, "a policy with the kernel off keeps MLX's");
}

/// A row of a T-row product equals the one-row product of that row bit for bit, on every
/// instruction-set path: verify windows see exactly the logits of one-token steps, and so do
/// prompt chunks (more than 32 rows: blocks of at most 32).
#[test]
fn rows_do_not_depend_on_the_window_size() {
    for isa in Isa::ALL {
        let p = &KernelPolicy::all_on().with_isa(isa);
        let mut runner =
            proptest::test_runner::TestRunner::new(proptest::test_runner::Config { cases: 24, ..Default::default() });
        let strategy = (
            prop_oneof![Just(4), Just(8)],
            prop_oneof![Just(32), Just(64), Just(128)],
            prop_oneof![1..300i32, (1..=10i32).prop_map(|p| 32 * p)], // whole panels or not
            1..24i32, // K up to 3072: several K-blocks of the tiled small-M path
            prop_oneof![2..=16i32, Just(33), Just(70)],
            any::<u64>(),
        );
        let result = runner.run(&strategy, |(bits, gs, n, groups, t, seed)| {
            let k = gs * groups;
            let spec = QuantSpec::new(gs, bits).unwrap();
            let w = normal(&[n, k], Dtype::Float32, 0.0, 0.5, &Key::new(seed)).unwrap();
            let q = quant::quantize(&w, spec).unwrap();
            let x = uniform(-1.0, 1.0, &[t, k], Dtype::Float32, &Key::new(seed ^ 3)).unwrap();
            let all =
                quantized_matmul_t(&x, &q.weight, &q.scales, &q.biases, spec, p).unwrap().to_vec::<f32>().unwrap();
            for r in 0..t {
                let xr = x.slice_axis(0, r, r + 1).unwrap();
                let one =
                    quantized_matmul_t(&xr, &q.weight, &q.scales, &q.biases, spec, p).unwrap().to_vec::<f32>().unwrap();
                let row = &all[(r * n) as usize..((r + 1) * n) as usize];
                let same = row.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits());
                prop_assert!(same, "bits {bits} gs {gs} n {n} k {k} t {t}: row {r} differs from its one-row product");
            }
            Ok(())
        });
        result.unwrap_or_else(|e| panic!("isa {isa}: {e}"));
    }
}

/// The repacked copy's arithmetic (qmm.cc, "Panel layout"; f32 precision), whatever the
/// number of rows and the instruction set, bit for bit against one scalar loop: 4 and 8 bits,
/// every group size, f32 and f16 groups, 1 to 11 rows. MLX's own quantized dot (`qdot` of its
/// Metal kernels) on AVX-512 (`panel_chains`) and AVX2 + FMA (`panel_chains_avx2`): per group
/// g one FMA chain over the group's columns from zero, `d = fma(x_k, q_k, d)` on the integer
/// codes, then `acc = fma(d, scale_g, acc)` and `acc = fma(bias_g, xsum_g, acc)`, with
/// `xsum_g` the group's sum of x in the int8 precision's order (`group_sum`). Activations
/// below 2^-102 in magnitude (`x_factor` 1e-33) take AVX2's 4-bit form without rescaled
/// activations (`shift_exact`); minute scales (`Stored::F32Minute`) are exact in both.
#[test]
fn repacked_products_are_one_fma_chain_per_output() {
    for isa in [Isa::Avx2Fma, Isa::Avx512f] {
        let p = &KernelPolicy::all_on().with_isa(isa);
        if p.isa() != isa.name() {
            eprintln!("{isa}: not on this CPU (in use: {})", p.isa());
            continue;
        }
        for (bits, gs, stored, t, x_factor) in [
            (4, 32, Stored::F16, 1, 1.0),
            (4, 64, Stored::F32, 3, 1.0),
            (8, 32, Stored::F16, 4, 1.0),
            (8, 128, Stored::F32, 11, 1.0),
            (4, 128, Stored::Bf16Large, 11, 1.0),
            (8, 64, Stored::F16Tiny, 2, 1.0),
            (4, 32, Stored::F32Minute, 1, 1.0),
            (4, 64, Stored::F32Minute, 4, 1.0),
            (4, 32, Stored::F32, 1, 1e-33),
            (4, 64, Stored::F16, 4, 1e-33),
            (4, 128, Stored::Bf16Large, 11, 1e-33),
        ] {
            let (n, k) = (64, 384);
            let spec = QuantSpec::new(gs, bits).unwrap();
            let (mats, x) = mats_and_x(spec, stored, &[n], k, t, 70 + bits as u64);
            let x = x.multiply(&Array::scalar(x_factor)).unwrap();
            let q = &mats[0];
            let ours =
                quantized_matmul_t(&x, &q.weight, &q.scales, &q.biases, spec, p).unwrap().to_vec::<f32>().unwrap();
            let (codes, s, b) = codes_and_groups(q, k as usize);
            let xs = x.to_vec::<f32>().unwrap();
            let (k, n, gs) = (k as usize, n as usize, gs as usize);
            for m in 0..t as usize {
                let xr = &xs[m * k..(m + 1) * k];
                for f in 0..n {
                    let mut acc = 0f32;
                    for g in 0..k / gs {
                        let mut d = 0f32;
                        for c in g * gs..(g + 1) * gs {
                            d = xr[c].mul_add(codes[f * k + c], d);
                        }
                        let (scale, bias) = (s[f * (k / gs) + g], b[f * (k / gs) + g]);
                        acc = d.mul_add(scale, acc);
                        acc = bias.mul_add(group_sum(&xr[g * gs..(g + 1) * gs]), acc);
                    }
                    assert_eq!(
                        ours[m * n + f].to_bits(),
                        acc.to_bits(),
                        "{isa}: bits {bits} gs {gs} {stored:?} t {t} x * {x_factor}: row {m} feature {f}: {} against \
                         the loop's {acc}",
                        ours[m * n + f]
                    );
                }
            }
        }
    }
}

/// qmm.cc's `group_sum`: element i into lane i % 16 in order, then the lanes reduced i + 8,
/// i + 4, i + 2, i + 1.
fn group_sum(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    for (i, v) in x.iter().enumerate() {
        lanes[i % 16] += v;
    }
    let s: Vec<f32> = (0..8).map(|i| lanes[i] + lanes[i + 8]).collect();
    let t: Vec<f32> = (0..4).map(|i| s[i] + s[i + 4]).collect();
    (t[0] + t[2]) + (t[1] + t[3])
}

/// The prompt GEMM's arithmetic (qmm.cc, `rows_gemm` and `rows_gemm_avx2`; products of more
/// than `WINDOW_MAX_ROWS` rows, `DENSE_MAX_ROWS` for dense weights): per output, per block of
/// 256 columns a sequential FMA chain from zero in the panel's row order (4 bits: each
/// 32-block's even columns, then its odd ones), `acc = fma(x_k, w_k, acc)` with `w = fma(q,
/// scale, bias)`, the blocks' sums added in order. Bit for bit against that loop on AVX2 + FMA
/// (4 and 8 bits with and without repacked panels, f32 and f16 groups, every group size, K
/// over several blocks and not a multiple of them, features filling no whole panel of 32) and,
/// for dense weights (more than `DENSE_MAX_ROWS` rows), on AVX-512 (dense chunks go to BLAS
/// on AVX2; AVX-512's quantized chunks may take AMX's tile products).
#[test]
fn prompt_chunks_are_block_fma_chains() {
    const BLOCK: usize = 256;
    // The column of a 32-block that panel row r holds (qmm.cc's `lane_source`).
    let source = |r: usize, permute4: bool| {
        if !permute4 {
            r
        } else if r < 16 {
            2 * r
        } else {
            2 * (r - 16) + 1
        }
    };
    let chains = |xs: &[f32], w: &dyn Fn(usize, usize) -> f32, t: usize, n: usize, k: usize, permute4: bool| {
        let mut out = vec![0f32; t * n];
        for m in 0..t {
            for f in 0..n {
                let mut sum = 0f32;
                for k0 in (0..k).step_by(BLOCK) {
                    let mut acc = 0f32;
                    for r in 0..BLOCK.min(k - k0) {
                        let c = k0 + r / 32 * 32 + source(r % 32, permute4);
                        acc = xs[m * k + c].mul_add(w(f, c), acc);
                    }
                    sum = if k0 == 0 { acc } else { sum + acc };
                }
                out[m * n + f] = sum;
            }
        }
        out
    };
    let compare = |ours: &[f32], expected: &[f32], what: &str| {
        for (i, (a, b)) in ours.iter().zip(expected).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{what}: element {i} is {a}, the block chains give {b}");
        }
    };
    let t = cpu_quant::WINDOW_MAX_ROWS as i32 + 7;
    let p = &KernelPolicy::all_on().with_isa(Isa::Avx2Fma);
    if p.isa() != Isa::Avx2Fma.name() || p.precision != mlx_core::Precision::F32 {
        eprintln!("skipped: the AVX2 prompt GEMM needs AVX2 + FMA and f32 precision (here {})", p.isa());
        return;
    }
    for (bits, gs, n, k, stored) in [
        (4, 64, 64, 640, Stored::F16),
        (4, 32, 72, 384, Stored::F32),
        (8, 128, 64, 640, Stored::F32),
        (8, 32, 40, 288, Stored::F16),
        (4, 128, 96, 512, Stored::F32Minute),
    ] {
        let spec = QuantSpec::new(gs, bits).unwrap();
        let (mats, x) = mats_and_x(spec, stored, &[n], k, t, 90 + bits as u64);
        let q = &mats[0];
        let ours = quantized_matmul_t(&x, &q.weight, &q.scales, &q.biases, spec, p).unwrap().to_vec::<f32>().unwrap();
        let (w, kk) = (dequantized_fma(q, k as usize), k as usize);
        let xs = x.to_vec::<f32>().unwrap();
        let expected = chains(&xs, &|f, c| w[f * kk + c], t as usize, n as usize, kk, bits == 4);
        compare(&ours, &expected, &format!("bits {bits} gs {gs} n {n} K {k} {stored:?}"));
    }
    let p = &KernelPolicy::all_on().with_isa(Isa::Avx512f);
    if p.isa() == Isa::Avx512f.name() {
        let (n, k, t) = (40, 544, cpu_quant::DENSE_MAX_ROWS as i32 + 3);
        let w = normal(&[n, k], Dtype::Float32, 0.0, 0.5, &Key::new(7)).unwrap();
        let x = uniform(-1.0, 1.0, &[t, k], Dtype::Float32, &Key::new(8)).unwrap();
        let ours = cpu_quant::dense_matmuls_t(&x, &[&w], p).unwrap().remove(0).to_vec::<f32>().unwrap();
        let (ws, xs) = (w.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
        let expected = chains(&xs, &|f, c| ws[f * k as usize + c], t as usize, n as usize, k as usize, false);
        compare(&ours, &expected, &format!("avx512f: dense n {n} K {k}"));
    }
}

/// The codes of `q` as floats `[n, k]` (row-major), its scales and biases `[n, k / gs]`.
fn codes_and_groups(q: &quant::QuantizedMatrix, k: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let bits = q.spec.bits as usize;
    let words = q.weight.to_vec::<u32>().unwrap();
    let per_word = 32 / bits;
    let codes = (0..words.len() * per_word)
        .map(|i| ((words[i / per_word] >> ((i % per_word) * bits)) & ((1u32 << bits) - 1)) as f32)
        .collect::<Vec<_>>();
    assert_eq!(codes.len() % k, 0);
    (codes, q.scales.to_vec::<f32>().unwrap(), q.biases.to_vec::<f32>().unwrap())
}

/// The weights `[n, k]` (row-major) of `q`, each `fma(code, scale, bias)` in f32 as the
/// kernels dequantize them (MLX's affine values, one rounding).
fn dequantized_fma(q: &quant::QuantizedMatrix, k: usize) -> Vec<f32> {
    let gs = q.spec.group_size as usize;
    let (codes, s, b) = codes_and_groups(q, k);
    let groups = k / gs;
    let group = |i: usize| i / k * groups + i % k / gs;
    codes.iter().enumerate().map(|(i, c)| c.mul_add(s[group(i)], b[group(i)])).collect()
}

/// Random matrices `[n, k]` quantized with `spec` as `stored` says, and `x [t, k]`.
fn mats_and_x(
    spec: QuantSpec,
    stored: Stored,
    ns: &[i32],
    k: i32,
    t: i32,
    seed: u64,
) -> (Vec<quant::QuantizedMatrix>, Array) {
    let mats = ns
        .iter()
        .enumerate()
        .map(|(j, &n)| {
            let w = normal(&[n, k], Dtype::Float32, 0.0, 0.5, &Key::new(seed + j as u64)).unwrap();
            quantize_stored(&w, spec, stored)
        })
        .collect();
    (mats, uniform(-1.0, 1.0, &[t, k], Dtype::Float32, &Key::new(seed ^ 11)).unwrap())
}

fn bits_of(a: &Array) -> Vec<u32> {
    a.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// One node for q/k/v gives exactly the three separate products.
    #[test]
    fn several_products_equal_separate_ones(
        bits in prop_oneof![Just(4), Just(8)],
        gs in prop_oneof![Just(32), Just(64), Just(128)],
        ns in prop::collection::vec(1..200i32, 1..4),
        groups in 1..6i32,
        t in 1..=16i32,
        seed in any::<u64>(),
    ) {
        let p = &KernelPolicy::all_on();
        let spec = QuantSpec::new(gs, bits).unwrap();
        let (mats, x) = mats_and_x(spec, Stored::F32, &ns, gs * groups, t, seed);
        let refs: Vec<_> = mats.iter().collect();
        let all = cpu_quant::quantized_matmuls_t(&x, &refs, p).unwrap();
        prop_assert_eq!(all.len(), mats.len());
        for (m, got) in mats.iter().zip(&all) {
            let one = quantized_matmul_t(&x, &m.weight, &m.scales, &m.biases, spec, p).unwrap();
            prop_assert_eq!(got.shape(), one.shape());
            prop_assert_eq!(bits_of(got), bits_of(&one));
        }
    }

    /// The fused SwiGLU against MLX's ops on the kernel's products (silu(g) * u), and a row of
    /// a T-row call against the one-row call of that row, bit for bit.
    #[test]
    fn swiglu_matches_mlx_ops_and_rows_are_window_independent(
        bits in prop_oneof![Just(4), Just(8)],
        gs in prop_oneof![Just(32), Just(64)],
        n in 1..300i32,
        groups in 1..5i32,
        t in 1..=12i32,
        seed in any::<u64>(),
    ) {
        let p = &KernelPolicy::all_on();
        let spec = QuantSpec::new(gs, bits).unwrap();
        let (mats, x) = mats_and_x(spec, Stored::F32, &[n, n], gs * groups, t, seed);
        let fused = cpu_quant::swiglu_t(&x, &mats[0], &mats[1], p).unwrap();
        prop_assert_eq!(fused.shape(), vec![t, n]);
        let g = quantized_matmul_t(&x, &mats[0].weight, &mats[0].scales, &mats[0].biases, spec, p).unwrap();
        let u = quantized_matmul_t(&x, &mats[1].weight, &mats[1].scales, &mats[1].biases, spec, p).unwrap();
        let want = g.multiply(&g.sigmoid().unwrap()).unwrap().multiply(&u).unwrap().to_vec::<f32>().unwrap();
        let got = fused.to_vec::<f32>().unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            prop_assert!((a - b).abs() <= 1e-5 * b.abs() + 1e-6, "element {}: fused {} vs MLX ops {}", i, a, b);
        }
        for r in 0..t {
            let one = cpu_quant::swiglu_t(&x.slice_axis(0, r, r + 1).unwrap(), &mats[0], &mats[1], p).unwrap();
            let row = fused.slice_axis(0, r, r + 1).unwrap();
            prop_assert_eq!(bits_of(&one), bits_of(&row), "row {} of {}", r, t);
        }
    }
}

#[test]
fn several_products_need_one_spec_and_swiglu_two_equal_matrices() {
    let p = &KernelPolicy::all_on();
    let x = Array::ones(&[1, 64], Dtype::Float32).unwrap();
    let (a, _) = mats_and_x(QuantSpec::new(32, 4).unwrap(), Stored::F32, &[8], 64, 1, 1);
    let (b, _) = mats_and_x(QuantSpec::new(64, 4).unwrap(), Stored::F32, &[8, 16], 64, 1, 2);
    let e = cpu_quant::quantized_matmuls_t(&x, &[&a[0], &b[0]], p).unwrap_err().to_string();
    assert!(e.contains("need one spec"), "{e}");
    assert!(cpu_quant::quantized_matmuls_t(&x, &[], p).is_err());
    let e = cpu_quant::swiglu_t(&x, &b[0], &b[1], p).unwrap_err().to_string();
    assert!(e.contains("same number of rows"), "{e}");
}

/// Long rows (K = 8960, a 1.5B model's MLP) in windows and prompt blocks: the scale groups go
/// in blocks whose activations stay in cache, the accumulators carried between blocks (40
/// features), or the whole row in one chain over the repacked panels (64 features, on
/// AVX-512); rows equal one-row products bit for bit on every instruction set.
#[test]
fn long_rows_in_blocks_keep_their_bits() {
    for isa in Isa::ALL {
        let p = &KernelPolicy::all_on().with_isa(isa);
        for (bits, gs, k, t) in [(4, 64, 8960, 11), (4, 32, 4128, 16), (8, 128, 5120, 33)] {
            for n in [40, 64] {
                let spec = QuantSpec::new(gs, bits).unwrap();
                let w = normal(&[n, k], Dtype::Float32, 0.0, 0.5, &Key::new(9)).unwrap();
                let q = quant::quantize(&w, spec).unwrap();
                let x = uniform(-1.0, 1.0, &[t, k], Dtype::Float32, &Key::new(10)).unwrap();
                let all = bits_of(&quantized_matmul_t(&x, &q.weight, &q.scales, &q.biases, spec, p).unwrap());
                for r in [0, t / 2, t - 1] {
                    let xr = x.slice_axis(0, r, r + 1).unwrap();
                    let one = bits_of(&quantized_matmul_t(&xr, &q.weight, &q.scales, &q.biases, spec, p).unwrap());
                    let row = &all[(r * n) as usize..((r + 1) * n) as usize];
                    assert_eq!(row, &one[..], "{isa} n {n} k {k} t {t} row {r}");
                }
            }
        }
    }
}

/// The repacked copy of a matrix (qmm.cc, "Panel layout", kept per weight buffer while that
/// buffer lives) never serves another matrix: matrices of one shape made and freed in turn
/// (MLX's allocator hands a freed buffer to the next array of its size), each product against
/// MLX's; and a matrix used again after others gives its first result bit for bit.
#[test]
fn repacked_weights_follow_their_buffer() {
    let p = &KernelPolicy::all_on();
    let spec = QuantSpec::new(32, 4).unwrap();
    let (n, k) = (64, 256);
    let x = uniform(-1.0, 1.0, &[3, k], Dtype::Float32, &Key::new(1)).unwrap();
    let product =
        |q: &quant::QuantizedMatrix| quantized_matmul_t(&x, &q.weight, &q.scales, &q.biases, spec, p).unwrap();
    let kept = quant::quantize(&normal(&[n, k], Dtype::Float32, 0.0, 0.5, &Key::new(2)).unwrap(), spec).unwrap();
    let first = bits_of(&product(&kept));
    for seed in 0..12u64 {
        let q =
            quant::quantize(&normal(&[n, k], Dtype::Float32, 0.0, 0.5, &Key::new(100 + seed)).unwrap(), spec).unwrap();
        let ours = product(&q).to_vec::<f32>().unwrap();
        let mlx =
            quant::quantized_matmul(&x, &q.weight, &q.scales, &q.biases, true, spec).unwrap().to_vec::<f32>().unwrap();
        for (i, (a, b)) in ours.iter().zip(&mlx).enumerate() {
            assert!((a - b).abs() <= 1e-3 * (1.0 + b.abs()), "matrix {seed}: element {i} is {a}, MLX gives {b}");
        }
    }
    assert_eq!(bits_of(&product(&kept)), first, "the kept matrix's product changed");
}

/// A prompt chunk packs the GEMM's weights from the matrix's repacked copy where it has one
/// (qmm.cc, `gemm_pack_panels`) and from MLX's rows where not (a strided view of the weights):
/// the same rows bit for bit, for 4 and 8 bits, group sizes 32 and 128, K over several of
/// the GEMM's 256-column blocks and not a multiple of them, the chunk the matrix's first
/// product (repacked by it) and after a window. Only where chunks take the GEMM (AVX-512 or AVX2, f32
/// precision): elsewhere they run the window kernels, whose repacked copy (one FMA chain per
/// output) and MLX's rows (partial sums) add in other orders, both checked against MLX by
/// `prompt_chunks_match_mlx`.
#[test]
fn prompt_chunks_from_the_repacked_copy_keep_their_bits() {
    let p = &KernelPolicy::all_on();
    if !matches!(p.isa().as_str(), "avx512f" | "avx2+fma") || p.precision != mlx_core::Precision::F32 {
        eprintln!("skipped: prompt chunks take the GEMM only on AVX-512 and AVX2 in f32 precision (here {})", p.isa());
        return;
    }
    let rows = cpu_quant::WINDOW_MAX_ROWS as i32 + 21;
    for (bits, gs, k, window_first, stored) in [
        (4, 32, 640, false, Stored::F32),
        (4, 128, 1152, true, Stored::F32),
        (8, 32, 640, true, Stored::F32),
        (8, 128, 384, false, Stored::F32),
        (4, 32, 640, true, Stored::F16),
        (8, 64, 384, false, Stored::F16Tiny),
        (4, 64, 640, false, Stored::Bf16Large),
        (8, 32, 384, true, Stored::Bf16Large),
    ] {
        let spec = QuantSpec::new(gs, bits).unwrap();
        let (mats, x) = mats_and_x(spec, stored, &[96], k, rows, 40 + bits as u64);
        let q = &mats[0];
        if window_first {
            let one = x.slice_axis(0, 0, 1).unwrap();
            quantized_matmul_t(&one, &q.weight, &q.scales, &q.biases, spec, p).unwrap().to_vec::<f32>().unwrap();
        }
        let owned = bits_of(&quantized_matmul_t(&x, &q.weight, &q.scales, &q.biases, spec, p).unwrap());
        // The weights as a strided view (every other column block of a doubled matrix): copied
        // per call, never repacked.
        let doubled = mlx_core::concatenate(&[&q.weight, &q.weight], 1).unwrap();
        let view = doubled.slice_axis(1, 0, q.weight.shape()[1]).unwrap();
        let from_rows = bits_of(&quantized_matmul_t(&x, &view, &q.scales, &q.biases, spec, p).unwrap());
        assert_eq!(
            owned, from_rows,
            "bits {bits}, group size {gs}, K {k}, stored {stored:?}: chunk rows differ with the repacked copy"
        );
    }
}

/// Prompt chunks of more than `WINDOW_MAX_ROWS` rows (the GEMM on AVX-512 and AVX2 in f32 precision,
/// the windows' blocks elsewhere) against MLX and the f64 reference, over features that fill
/// no whole panel of 32 (and fewer than 16), K over several of the GEMM's 256-column blocks
/// and not a multiple of them, bits 4 and 8, every group size, one and all threads.
#[test]
fn prompt_chunks_match_mlx() {
    let max = cpu_quant::WINDOW_MAX_ROWS as i32;
    for threads in [1, 2] {
        let policy = KernelPolicy::all_on().with_threads(threads);
        let strategy = (
            prop_oneof![Just(4), Just(8)],
            prop_oneof![Just(32), Just(64), Just(128)],
            prop_oneof![1..16i32, 16..80i32],
            1..14i32,
            max + 1..=max + 60,
            any::<u64>(),
            stored_kinds(),
        )
            .prop_map(|(bits, gs, n, groups, t, seed, stored)| Case {
                bits,
                gs,
                n,
                groups,
                batch: vec![1, t],
                transposed_x: false,
                seed,
                stored,
            });
        let mut runner =
            proptest::test_runner::TestRunner::new(proptest::test_runner::Config { cases: 12, ..Default::default() });
        let result = runner.run(&strategy, |c| check(&c, &policy));
        result.unwrap_or_else(|e| panic!("threads {threads} (isa {}): {e}", policy.isa()));
    }
}

/// The switch from windows to prompt chunks sits exactly at `WINDOW_MAX_ROWS` (the constant
/// mirrors `kWindowMaxRows` of qmm.cc): a product of that many rows gives each row its one-row
/// bits, one more row takes the GEMM (on AVX-512 and AVX2: other bits somewhere in a 1536 x 1536
/// product), and a chunk's row has the same bits in any longer chunk.
#[test]
fn rows_switch_to_the_prompt_gemm_past_the_window_limit() {
    let p = &KernelPolicy::all_on();
    let max = cpu_quant::WINDOW_MAX_ROWS as i32;
    let (n, k) = (1536, 1536);
    let spec = QuantSpec::new(64, 4).unwrap();
    let (mats, x) = mats_and_x(spec, Stored::F32, &[n], k, max + 40, 5);
    let q = &mats[0];
    let product = |rows: i32| {
        let xr = x.slice_axis(0, 0, rows).unwrap();
        bits_of(&quantized_matmul_t(&xr, &q.weight, &q.scales, &q.biases, spec, p).unwrap())
    };
    let one = bits_of(
        &quantized_matmul_t(&x.slice_axis(0, 0, 1).unwrap(), &q.weight, &q.scales, &q.biases, spec, p).unwrap(),
    );
    let (window, chunk, longer) = (product(max), product(max + 1), product(max + 40));
    assert_eq!(&window[..n as usize], &one[..], "a {max}-row product's first row differs from its one-row product");
    assert_eq!(&chunk[..], &longer[..chunk.len()], "a chunk's rows depend on the chunk's length");
    if matches!(p.isa().as_str(), "avx512f" | "avx2+fma") && p.precision == mlx_core::Precision::F32 {
        assert_ne!(&chunk[..n as usize], &one[..], "a {}-row product did not take the prompt GEMM", max + 1);
    } else {
        assert_eq!(&chunk[..n as usize], &one[..], "{}: rows must keep one-row bits", p.isa());
    }
}
