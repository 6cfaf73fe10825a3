//! Throughput of the CPU quantized-matmul kernel on SmolLM2-135M's shapes (random weights,
//! group size 32): best-of-N wall time per product (one evaluated graph node, so ~20 us of
//! dispatch is included) and the multiply-adds per second it implies, for T activation rows:
//! `cargo run --release -p models --example qmm_profile -- [T,T,..]` (default 1,8,11,16).
use std::time::Instant;

use mlx_core::quant::{QuantSpec, quantize};
use mlx_core::{Dtype, cpu_quant, eval, random};

fn main() {
    let ts: Vec<i32> =
        std::env::args().nth(1).unwrap_or("1,8,11,16".into()).split(',').map(|t| t.parse().unwrap()).collect();
    let key = random::Key::new(1);
    let policy = mlx_core::KernelPolicy::all_on();
    for (n, k, bits) in [(1536, 576, 4), (576, 1536, 4), (576, 576, 4), (49152, 576, 8)] {
        let w = random::normal(&[n, k], Dtype::Float32, 0.0, 1.0, &key).unwrap();
        let q = quantize(&w, QuantSpec::new(32, bits).unwrap()).unwrap();
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
