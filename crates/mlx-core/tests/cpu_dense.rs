//! The CPU kernel for dense float32 weights (`mlx_core::cpu_quant::dense_*`, kernel in
//! mlx-sys `src/qmm.cc` with bits = 32) against MLX's own matmul and an f64 product, over
//! random shapes, activation rows `T` (1..=40, past the register and tiled paths), batch axes,
//! strided inputs and every instruction-set path; windows against one-row calls bit for bit.
//!
//! Tolerance per output element: `|Δ| <= 1e-5 * Σ_k |x_k w_k| + 1e-6`, as for the quantized
//! kernel (float32 rounding of a K-term dot product in another summation order).
use mlx_core::cpu_quant::{self, dense_matmuls_t, dense_swiglu_t};
use mlx_core::random::{Key, normal, uniform};
use mlx_core::settings::Isa;
use mlx_core::{Array, Dtype, KernelPolicy};
use proptest::prelude::*;

fn weights(ns: &[i32], k: i32, seed: u64) -> Vec<Array> {
    ns.iter()
        .enumerate()
        .map(|(j, &n)| normal(&[n, k], Dtype::Float32, 0.0, 0.5, &Key::new(seed + j as u64)).unwrap())
        .collect()
}

fn bits_of(a: &Array) -> Vec<u32> {
    a.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// Runs `body` once per instruction set, with a policy capped at it.
fn each_isa(
    cases: u32,
    mut body: impl FnMut(&mut proptest::test_runner::TestRunner, &KernelPolicy) -> Result<(), String>,
) {
    for isa in Isa::ALL {
        let policy = KernelPolicy::all_on().with_isa(isa);
        let mut runner =
            proptest::test_runner::TestRunner::new(proptest::test_runner::Config { cases, ..Default::default() });
        body(&mut runner, &policy).unwrap_or_else(|e| panic!("isa {isa}: {e}"));
    }
}

#[test]
fn dense_kernel_matches_mlx_matmul() {
    each_isa(16, |runner, p| {
        let strategy = (1..300i32, 1..24i32, 1..=40i32, any::<bool>(), any::<u64>());
        runner
            .run(&strategy, |(n, blocks, t, strided, seed)| {
                let k = 32 * blocks;
                let w = &weights(&[n], k, seed)[0];
                let x = if strided {
                    uniform(-1.0, 1.0, &[2, k, t], Dtype::Float32, &Key::new(seed ^ 7))
                        .unwrap()
                        .swapaxes(-1, -2)
                        .unwrap()
                } else {
                    uniform(-1.0, 1.0, &[2, t, k], Dtype::Float32, &Key::new(seed ^ 7)).unwrap()
                };
                let ours = dense_matmuls_t(&x, &[w], p).unwrap().remove(0);
                prop_assert_eq!(ours.shape(), vec![2, t, n]);
                let mlx = x.matmul(&w.t().unwrap()).unwrap().to_vec::<f32>().unwrap();
                let (xd, wd) = (x.astype(Dtype::Float64).unwrap(), w.astype(Dtype::Float64).unwrap().t().unwrap());
                let exact = xd.matmul(&wd).unwrap().to_vec::<f64>().unwrap();
                let mag = xd.abs().unwrap().matmul(&wd.abs().unwrap()).unwrap().to_vec::<f64>().unwrap();
                for (i, (o, (m, (e, g)))) in
                    ours.to_vec::<f32>().unwrap().iter().zip(mlx.iter().zip(exact.iter().zip(&mag))).enumerate()
                {
                    let tol = 1e-5 * g + 1e-6;
                    prop_assert!(
                        (*o as f64 - e).abs() <= tol,
                        "element {}: ours {} vs exact {} (tol {})",
                        i,
                        o,
                        e,
                        tol
                    );
                    prop_assert!((*o as f64 - *m as f64).abs() <= 2.0 * tol, "element {}: ours {} vs MLX {}", i, o, m);
                }
                Ok(())
            })
            .map_err(|e| e.to_string())
    });
}

/// Up to `DENSE_MAX_ROWS` rows (a prompt GEMM's chunk, more rows, has its own bits: the
/// matmul test above checks it against MLX, `dense_prompt_chunk_rows_equal_in_longer_chunks`
/// its rows).
#[test]
fn dense_rows_do_not_depend_on_the_window_size() {
    each_isa(16, |runner, p| {
        let strategy =
            (1..300i32, 1..24i32, prop_oneof![2..=16i32, Just(cpu_quant::DENSE_MAX_ROWS as i32)], any::<u64>());
        runner
            .run(&strategy, |(n, blocks, t, seed)| {
                let k = 32 * blocks;
                let w = &weights(&[n], k, seed)[0];
                let x = uniform(-1.0, 1.0, &[t, k], Dtype::Float32, &Key::new(seed ^ 3)).unwrap();
                let all = dense_matmuls_t(&x, &[w], p).unwrap().remove(0);
                for r in 0..t {
                    let one = dense_matmuls_t(&x.slice_axis(0, r, r + 1).unwrap(), &[w], p).unwrap().remove(0);
                    let row = all.slice_axis(0, r, r + 1).unwrap();
                    prop_assert_eq!(bits_of(&one), bits_of(&row), "n {} k {} t {}: row {}", n, k, t, r);
                }
                Ok(())
            })
            .map_err(|e| e.to_string())
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// One node for several weights gives exactly the separate products; the fused SwiGLU
    /// equals MLX's ops on those products and is window independent.
    #[test]
    fn several_products_and_swiglu(
        ns in prop::collection::vec(1..200i32, 2..4),
        blocks in 1..6i32,
        t in 1..=12i32,
        seed in any::<u64>(),
    ) {
        let p = &KernelPolicy::all_on();
        let k = 32 * blocks;
        let ws = weights(&ns, k, seed);
        let x = uniform(-1.0, 1.0, &[t, k], Dtype::Float32, &Key::new(seed ^ 11)).unwrap();
        let all = dense_matmuls_t(&x, &ws.iter().collect::<Vec<_>>(), p).unwrap();
        prop_assert_eq!(all.len(), ws.len());
        for (w, got) in ws.iter().zip(&all) {
            prop_assert_eq!(bits_of(got), bits_of(&dense_matmuls_t(&x, &[w], p).unwrap()[0]));
        }
        let up = weights(&[ns[0]], k, seed ^ 99).remove(0);
        let fused = dense_swiglu_t(&x, &ws[0], &up, p).unwrap();
        let g = &all[0];
        let u = dense_matmuls_t(&x, &[&up], p).unwrap().remove(0);
        let want = g.multiply(&g.sigmoid().unwrap()).unwrap().multiply(&u).unwrap().to_vec::<f32>().unwrap();
        for (i, (a, b)) in fused.to_vec::<f32>().unwrap().iter().zip(&want).enumerate() {
            prop_assert!((a - b).abs() <= 1e-5 * b.abs() + 1e-6, "element {}: fused {} vs MLX ops {}", i, a, b);
        }
        for r in 0..t {
            let one = dense_swiglu_t(&x.slice_axis(0, r, r + 1).unwrap(), &ws[0], &up, p).unwrap();
            prop_assert_eq!(bits_of(&one), bits_of(&fused.slice_axis(0, r, r + 1).unwrap()), "row {} of {}", r, t);
        }
    }
}

#[test]
fn bad_inputs_are_errors_naming_the_problem() {
    let p = &KernelPolicy::all_on();
    let x = Array::ones(&[1, 64], Dtype::Float32).unwrap();
    let w = Array::ones(&[8, 64], Dtype::Float32).unwrap();
    let err = |r: mlx_core::Result<Vec<Array>>| r.unwrap_err().to_string();
    let e = err(dense_matmuls_t(&x, &[&w.astype(Dtype::Float16).unwrap()], p));
    assert!(e.contains("cpu_dense_matmuls") && e.contains("float32"), "{e}");
    let e = err(dense_matmuls_t(
        &Array::ones(&[1, 48], Dtype::Float32).unwrap(),
        &[&Array::ones(&[8, 48], Dtype::Float32).unwrap()],
        p,
    ));
    assert!(e.contains("multiple of 32"), "{e}");
    let e = err(dense_matmuls_t(&Array::ones(&[1, 32], Dtype::Float32).unwrap(), &[&w], p));
    assert!(e.contains("must end in K = 64"), "{e}");
    let e = err(dense_matmuls_t(&x.astype(Dtype::Bfloat16).unwrap(), &[&w], p));
    assert!(e.contains("x must be float32"), "{e}");
    assert!(dense_matmuls_t(&x, &[], p).is_err());
    let e = dense_swiglu_t(&x, &w, &Array::ones(&[16, 64], Dtype::Float32).unwrap(), p).unwrap_err().to_string();
    assert!(e.contains("cpu_dense_swiglu") && e.contains("same number of rows"), "{e}");
}

/// Whether the kernel's prompt GEMM serves prompt chunks under `p` (AVX-512F in use).
fn prompt_gemm(p: &KernelPolicy) -> bool {
    p.isa() == "avx512f"
}

#[test]
fn dense_applies_to_float32_inputs_short_or_on_the_prompt_gemm() {
    let p = &KernelPolicy::all_on();
    let w = Array::ones(&[8, 64], Dtype::Float32).unwrap();
    let x = |rows: i32, k: i32, d: Dtype| Array::ones(&[1, rows, k], d).unwrap();
    let max = cpu_quant::DENSE_MAX_ROWS as i32;
    assert!(cpu_quant::dense_applies(&w, &x(1, 64, Dtype::Float32), p));
    assert!(cpu_quant::dense_applies(&w, &x(max, 64, Dtype::Float32), p));
    let long = cpu_quant::dense_applies(&w, &x(max + 1, 64, Dtype::Float32), p);
    assert_eq!(long, prompt_gemm(p), "prefill: the prompt GEMM on AVX-512, else BLAS");
    let avx2 = &KernelPolicy::all_on().with_isa(Isa::Avx2Fma);
    assert!(!cpu_quant::dense_applies(&w, &x(max + 1, 64, Dtype::Float32), avx2), "without AVX-512: BLAS");
    assert!(!cpu_quant::dense_applies(&w, &x(1, 64, Dtype::Bfloat16), p));
    assert!(!cpu_quant::dense_applies(&w.astype(Dtype::Float16).unwrap(), &x(1, 64, Dtype::Float32), p));
    let w48 = Array::ones(&[8, 48], Dtype::Float32).unwrap();
    assert!(!cpu_quant::dense_applies(&w48, &x(1, 48, Dtype::Float32), p), "K must be a multiple of 32");
    let off = &KernelPolicy { dense: false, ..KernelPolicy::all_on() };
    assert!(!cpu_quant::dense_applies(&w, &x(1, 64, Dtype::Float32), off));
}

#[test]
fn auto_takes_the_kernel_for_short_inputs_and_the_gemm_or_blas_for_long_ones() {
    let w = &weights(&[40], 64, 5)[0];
    for rows in [1, cpu_quant::DENSE_MAX_ROWS as i32 + 8] {
        let x = uniform(-1.0, 1.0, &[rows, 64], Dtype::Float32, &Key::new(6)).unwrap();
        let p = &KernelPolicy::all_on();
        let got = cpu_quant::dense_matmul_t_auto(&x, w, p).unwrap();
        let want = if cpu_quant::dense_applies(w, &x, p) {
            dense_matmuls_t(&x, &[w], p).unwrap().remove(0)
        } else {
            x.matmul(&w.t().unwrap()).unwrap()
        };
        assert_eq!(bits_of(&got), bits_of(&want), "{rows} rows");
        let kernel = p.calls().dense > 0;
        let want_kernel = rows as usize <= cpu_quant::DENSE_MAX_ROWS || prompt_gemm(p);
        assert_eq!(kernel, want_kernel, "{rows} rows: kernel used = {kernel}");
    }
}

/// A dense prompt chunk (more than `DENSE_MAX_ROWS` rows, the GEMM on AVX-512): its rows have
/// the same bits in any longer chunk (they do not depend on the chunk's length or tiles).
#[test]
fn dense_prompt_chunk_rows_equal_in_longer_chunks() {
    let p = &KernelPolicy::all_on();
    let max = cpu_quant::DENSE_MAX_ROWS as i32;
    for (n, k) in [(70, 96), (33, 544)] {
        let w = &weights(&[n], k, 8)[0];
        let x = uniform(-1.0, 1.0, &[max + 30, k], Dtype::Float32, &Key::new(9)).unwrap();
        let product = |rows: i32| bits_of(&dense_matmuls_t(&x.slice_axis(0, 0, rows).unwrap(), &[w], p).unwrap()[0]);
        let (short, long) = (product(max + 1), product(max + 30));
        assert_eq!(&short[..], &long[..short.len()], "n {n} k {k}");
    }
}
