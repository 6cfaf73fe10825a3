//! Throughput of the CPU quantized-matmul kernel on SmolLM2-135M's shapes (random weights,
//! group size 32): best-of-N wall time per product (one evaluated graph node, so ~20 us of
//! dispatch is included) and the multiply-adds per second it implies, for T activation rows:
//! `cargo run --release -p models --example qmm_profile -- [T,T,..] [NxKxBITSgGS,..]`
//! (default T = 1,8,11,16; shapes SmolLM2's, e.g. `8960x1536x4g64` for Qwen2.5-1.5B's MLP).
//! Bits 32 (`1536x576x32g32`) is a dense f32 matrix: the kernel's dense products
//! (`cpu_quant::dense_matmuls_t`) and MLX's matmul (BLAS `sgemm`) alternate, each line `f32`
//! and `blas`. `MLX_SPEC_PRECISION` and `MLX_SPEC_QMM_ISA` apply (e.g. `MLX_SPEC_QMM_ISA=avx2+fma`).
use std::time::Instant;

use mlx_core::quant::{QuantSpec, quantize};
use mlx_core::{Dtype, cpu_quant, eval, random};

fn main() {
    let ts: Vec<i32> =
        std::env::args().nth(1).unwrap_or("1,8,11,16".into()).split(',').map(|t| t.parse().unwrap()).collect();
    let key = random::Key::new(1);
    let settings = mlx_core::Settings::global();
    let policy =
        mlx_core::KernelPolicy::all_on().with_precision(settings.precision.value).with_isa(settings.max_isa.value);
    let shapes: Vec<(i32, i32, i32, i32)> = match std::env::args().nth(2) {
        Some(list) => list
            .split(',')
            .map(|s| {
                let (nkb, gs) = s.split_once('g').expect("NxKxBITSgGS");
                let v: Vec<i32> = nkb.split('x').map(|x| x.parse().expect("a number")).collect();
                (v[0], v[1], v[2], gs.parse().expect("a group size"))
            })
            .collect(),
        None => vec![(1536, 576, 4, 32), (576, 1536, 4, 32), (576, 576, 4, 32), (49152, 576, 8, 32)],
    };
    for (n, k, bits, gs) in shapes {
        let w = random::normal(&[n, k], Dtype::Float32, 0.0, 1.0, &key).unwrap();
        if bits == 32 {
            dense(&w, &ts, &key, &policy);
            continue;
        }
        let q = quantize(&w, QuantSpec::new(gs, bits).unwrap()).unwrap();
        eval(&[&q.weight, &q.scales, &q.biases]).unwrap();
        for &t in &ts {
            let x = random::normal(&[1, t, k], Dtype::Float32, 0.0, 1.0, &key).unwrap();
            eval(&[&x]).unwrap();
            let reps = if n > 10000 { 40 } else { 300 };
            let mut best = f64::MAX;
            for _ in 0..reps {
                let t0 = Instant::now();
                cpu_quant::quantized_matmul_t(&x, &q.weight, &q.scales, &q.biases, q.spec, &policy)
                    .unwrap()
                    .eval()
                    .unwrap();
                best = best.min(t0.elapsed().as_secs_f64());
            }
            let macs = (n as f64) * (k as f64) * (t as f64);
            println!("q{bits} {t:2}x{k}x{n}: {:8.1} us  {:6.1} GMAC/s", best * 1e6, macs / best / 1e9);
        }
    }
}

/// Dense `w [N, K]`: the kernel's product and BLAS's (MLX's matmul with `w^T`), alternated
/// within each repetition, best of N each.
fn dense(w: &mlx_core::Array, ts: &[i32], key: &random::Key, policy: &mlx_core::KernelPolicy) {
    let (n, k) = (w.shape()[0], w.shape()[1]);
    let wt = w.transpose(&[1, 0]).unwrap();
    eval(&[w, &wt]).unwrap();
    for &t in ts {
        let x = random::normal(&[t, k], Dtype::Float32, 0.0, 1.0, key).unwrap();
        eval(&[&x]).unwrap();
        let reps = if t > 64 { 20 } else { 200 };
        let mut best = [f64::MAX; 2];
        for _ in 0..reps {
            for (arm, b) in best.iter_mut().enumerate() {
                let t0 = Instant::now();
                let y = if arm == 0 {
                    cpu_quant::dense_matmuls_t(&x, &[w], policy).unwrap().remove(0)
                } else {
                    x.matmul(&wt).unwrap()
                };
                y.eval().unwrap();
                *b = b.min(t0.elapsed().as_secs_f64());
            }
        }
        let macs = (n as f64) * (k as f64) * (t as f64);
        for (name, b) in ["f32 ", "blas"].iter().zip(best) {
            println!("{name} {t:2}x{k}x{n}: {:8.1} us  {:6.1} GMAC/s", b * 1e6, macs / b / 1e9);
        }
    }
}
