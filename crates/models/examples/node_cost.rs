//! Cost of a graph node on the CPU stream: chains of cheap ops, and of one-row quantized
//! products (SmolLM2's 576 x 576), evaluated at once, per node.
use std::time::Instant;

use mlx_core::quant::{QuantSpec, quantize};
use mlx_core::{Array, Dtype, KernelPolicy, cpu_quant, eval, random};

fn best_per_node(nodes: usize, build: &dyn Fn() -> Array) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..20 {
        let t0 = Instant::now();
        let y = build();
        eval(&[&y]).unwrap();
        best = best.min(t0.elapsed().as_secs_f64());
    }
    best * 1e6 / nodes as f64
}

fn main() {
    let x = Array::ones(&[1, 1, 576], Dtype::Float32).unwrap();
    eval(&[&x]).unwrap();
    let views = best_per_node(900, &|| {
        (0..300).fold(x.clone(), |y, _| {
            y.reshape(&[1, 1, 9, 64]).unwrap().transpose(&[0, 2, 1, 3]).unwrap().reshape(&[1, 1, 576]).unwrap()
        })
    });
    let adds = best_per_node(600, &|| (0..600).fold(x.clone(), |y, _| y.add(&x).unwrap()));
    let key = random::Key::new(1);
    let w = random::normal(&[576, 576], Dtype::Float32, 0.0, 0.05, &key).unwrap();
    let q = quantize(&w, QuantSpec::new(32, 4).unwrap()).unwrap();
    eval(&[&q.weight, &q.scales, &q.biases]).unwrap();
    for threads in [1, 2] {
        let p = KernelPolicy { threads: Some(threads), ..KernelPolicy::all_on() };
        let qmm = best_per_node(120, &|| {
            (0..120).fold(x.clone(), |y, _| {
                cpu_quant::quantized_matmul_t(&y, &q.weight, &q.scales, &q.biases, q.spec, &p).unwrap()
            })
        });
        println!("q4 576x576, one row, {threads} thread(s): {qmm:.2} us per node");
    }
    println!("views (reshape, transpose): {views:.2} us per node; adds of 576 floats: {adds:.2} us per node");
}
