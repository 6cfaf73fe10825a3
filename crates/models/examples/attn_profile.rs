//! Cost of the fused CPU attention on SmolLM2-135M's shapes (9 query heads, 3 KV heads,
//! D = 64) for a verify window of T queries over a cache of L keys, 30 layers' worth as one
//! graph, each layer over its own keys and values (a long cache does not fit the caches, as in
//! a real step): `cargo run --release -p models --example attn_profile -- [L] [T,T,..] [HQ,HKV,D]`
//! (default 400 keys, T = 1,11, SmolLM2's heads 9,3,64; Qwen2.5-Coder-1.5B's are 12,2,128;
//! best of 20, ms).
use std::time::Instant;

use mlx_core::{Array, Dtype, cpu_attention, eval, random};

fn main() {
    let lk: i32 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(400);
    let key = random::Key::new(3);
    let ts: Vec<i32> =
        std::env::args().nth(2).unwrap_or("1,11".into()).split(',').map(|t| t.parse().unwrap()).collect();
    let heads: Vec<i32> =
        std::env::args().nth(3).unwrap_or("9,3,64".into()).split(',').map(|t| t.parse().unwrap()).collect();
    let (hq, hkv, d) = (heads[0], heads[1], heads[2]);
    for t in ts {
        let n = |s: &[i32]| random::normal(s, Dtype::Float32, 0.0, 1.0, &key).unwrap();
        let q = n(&[1, hq, t, d]);
        let kv: Vec<(Array, Array)> = (0..30).map(|_| (n(&[1, hkv, lk + t, d]), n(&[1, hkv, lk + t, d]))).collect();
        eval(&std::iter::once(&q).chain(kv.iter().flat_map(|(k, v)| [k, v])).collect::<Vec<_>>()).unwrap();
        let mut best = f64::MAX;
        for _ in 0..if t > 64 { 3 } else { 20 } {
            let t0 = Instant::now();
            let outs: Vec<Array> = kv
                .iter()
                .map(|(k, v)| cpu_attention::attention(&q, k, v, 1.0 / (d as f32).sqrt(), t > 1).unwrap())
                .collect();
            eval(&outs.iter().collect::<Vec<_>>()).unwrap();
            best = best.min(t0.elapsed().as_secs_f64());
        }
        println!("T={t:2}, {} keys: 30 layers {:.2} ms", lk + t, best * 1e3);
    }
}
