//! Throughput of the CPU quantized-matmul kernel on SmolLM2-135M's shapes (random weights,
//! group size 32): best-of-N wall time per product (one evaluated graph node, so ~20 us of
//! dispatch is included) and the multiply-adds per second it implies, for T activation rows:
//! `cargo run --release -p models --example qmm_profile -- [T,T,..] [NxKxBITSgGS,..]`
//! (default T = 1,8,11,16; shapes SmolLM2's, e.g. `8960x1536x4g64` for Qwen2.5-1.5B's MLP).
use std::time::Instant;

use mlx_core::quant::{QuantSpec, quantize};
use mlx_core::{Dtype, cpu_quant, eval, random};

fn main() {
    let ts: Vec<i32> =
        std::env::args().nth(1).unwrap_or("1,8,11,16".into()).split(',').map(|t| t.parse().unwrap()).collect();
    let key = random::Key::new(1);
    let policy = mlx_core::KernelPolicy::all_on().with_precision(mlx_core::Settings::global().precision.value);
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
