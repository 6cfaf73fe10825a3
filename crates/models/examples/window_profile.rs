//! Splits the cost of a verify window into its quantized products and the rest:
//! `cargo run --release -p models --example window_profile -- DIR [T,T,.. [PROMPT_LEN]]`. Times
//! (median of 15, ms) one forward of T tokens over a cache of PROMPT_LEN (100) tokens of the model in DIR, and, as one
//! graph, the products of a SmolLM2-135M-shaped layer stack on random weights (30 layers of
//! 4-bit g32 q/k/v, o, gate/up and down, and an 8-bit 49152 x 576 head), for T in 1, 2, 4,
//! 8, 11, 16 by default. "rest" is the difference: norms, RoPE, attention, cache writes,
//! residual adds and per-node dispatch (meaningful for SmolLM2 4-bit directories). `MLX_SPEC_QMM_ISA`
//! caps both (e.g. `avx2+fma`).
//! With `WINDOW_PROFILE_LOOP=N`: one prefill, then N forwards of each T rolled back (for `perf`).
use std::time::Instant;

use mlx_core::quant::{QuantSpec, QuantizedMatrix, quantize};
use mlx_core::{Array, Dtype, cpu_quant, eval, random};
use models::generate::{ids, prefill};
use models::{LoadOptions, load_model};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let dir = std::env::args().nth(1).expect("model directory");
    let model =
        load_model(std::path::Path::new(&dir), &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() })
            .unwrap();
    let prompt_len: u32 = std::env::args().nth(3).and_then(|s| s.parse().ok()).unwrap_or(100);
    let prompt: Vec<u32> = (0..prompt_len).map(|i| 100 + i * 7).collect();
    let ts: Vec<usize> = match std::env::args().nth(2) {
        Some(a) => a.split(',').map(|t| t.parse().unwrap()).collect(),
        None => vec![1, 2, 4, 8, 11, 16],
    };
    // One forward of `toks` on `cache`, ms.
    let time_forward = |toks: &[u32], cache: &mut models::ModelCache| {
        let t0 = Instant::now();
        let logits = model.forward(&ids(toks).unwrap(), cache).unwrap();
        eval(&[&logits]).unwrap();
        t0.elapsed().as_secs_f64() * 1e3
    };
    if let Ok(n) = std::env::var("WINDOW_PROFILE_LOOP") {
        // For `perf`: one prefill, then n forwards of each T rolled back, nothing else.
        let n: usize = n.parse().unwrap_or_else(|_| panic!("WINDOW_PROFILE_LOOP={n}: expected a count"));
        let (mut cache, _) = prefill(&model, &prompt).unwrap();
        for t in ts {
            let toks: Vec<u32> = (0..t as u32).map(|i| 300 + i).collect();
            let fwd = (0..n)
                .map(|_| {
                    let ms = time_forward(&toks, &mut cache);
                    cache.trim(t);
                    ms
                })
                .collect();
            println!("T={t:2}: forward {:6.2} ms (after one prefill, rolled back)", median(fwd));
        }
        return;
    }
    let (h, inter, kv, layers, vocab) = (576, 1536, 192, 30, 49152);
    let key = random::Key::new(1);
    let mat = |n: i32, k: i32, bits: i32| -> QuantizedMatrix {
        let w = random::normal(&[n, k], Dtype::Float32, 0.0, 1.0, &key).unwrap();
        quantize(&w, QuantSpec::new(32, bits).unwrap()).unwrap()
    };
    let (q, kk, v, o, g, u, d) = (
        mat(h, h, 4),
        mat(kv, h, 4),
        mat(kv, h, 4),
        mat(h, h, 4),
        mat(inter, h, 4),
        mat(inter, h, 4),
        mat(h, inter, 4),
    );
    let head = mat(vocab, h, 8);
    eval(&[&q.weight, &kk.weight, &v.weight, &o.weight, &g.weight, &u.weight, &d.weight, &head.weight]).unwrap();
    let policy = mlx_core::KernelPolicy::all_on().with_isa(mlx_core::Settings::global().max_isa.value);
    for t in ts {
        let mut fwd = Vec::new();
        let mut prods = Vec::new();
        for _ in 0..15 {
            let (mut cache, _) = prefill(&model, &prompt).unwrap();
            let toks: Vec<u32> = (0..t as u32).map(|i| 300 + i).collect();
            fwd.push(time_forward(&toks, &mut cache));

            let xh = random::normal(&[1, t as i32, h], Dtype::Float32, 0.0, 1.0, &key).unwrap();
            let xi = random::normal(&[1, t as i32, inter], Dtype::Float32, 0.0, 1.0, &key).unwrap();
            eval(&[&xh, &xi]).unwrap();
            let t0 = Instant::now();
            let mut outs: Vec<Array> = Vec::new();
            for _ in 0..layers {
                outs.extend(cpu_quant::quantized_matmuls_t(&xh, &[&q, &kk, &v], &policy).unwrap());
                outs.push(
                    cpu_quant::quantized_matmul_t(&xh, &o.weight, &o.scales, &o.biases, o.spec, &policy).unwrap(),
                );
                outs.push(cpu_quant::swiglu_t(&xh, &g, &u, &policy).unwrap());
                outs.push(
                    cpu_quant::quantized_matmul_t(&xi, &d.weight, &d.scales, &d.biases, d.spec, &policy).unwrap(),
                );
            }
            outs.push(
                cpu_quant::quantized_matmul_t(&xh, &head.weight, &head.scales, &head.biases, head.spec, &policy)
                    .unwrap(),
            );
            let refs: Vec<&Array> = outs.iter().collect();
            eval(&refs).unwrap();
            prods.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let (f, p) = (median(fwd), median(prods));
        println!("T={t:2}: forward {f:6.2} ms, products {p:6.2} ms, rest {:6.2} ms", f - p);
    }
}
