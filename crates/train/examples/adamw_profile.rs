//! Wall time of one AdamW step (and of gradient clipping) over the parameters of a 2-layer
//! SmolLM2-135M DSpark drafter (hidden 576, MLP 1536, 5 taps, Markov rank 64, draft vocabulary
//! 3009; 12.7 M trainable values): `cargo run --release -p train --example adamw_profile`.
use std::time::Instant;

use mlx_core::{Array, Dtype, random};
use train::{AdamW, AdamWConfig, clip_grad_norm};

fn main() {
    let (h, i, v, r, k) = (576, 1536, 49152, 64, 3009);
    let mut shapes: Vec<(String, Vec<i32>)> =
        vec![("fc".into(), vec![h, 5 * h]), ("w1".into(), vec![v, r]), ("w2".into(), vec![k, r])];
    for l in 0..2 {
        for (n, s) in [("q", [h, h]), ("k", [192, h]), ("v", [192, h]), ("o", [h, h])] {
            shapes.push((format!("{l}.{n}"), s.to_vec()));
        }
        for (n, s) in [("gate", [i, h]), ("up", [i, h]), ("down", [h, i])] {
            shapes.push((format!("{l}.{n}"), s.to_vec()));
        }
    }
    let key = random::Key::new(3);
    let names: Vec<String> = shapes.iter().map(|(n, _)| n.clone()).collect();
    let params: Vec<Array> =
        shapes.iter().map(|(_, s)| random::normal(s, Dtype::Float32, 0.0, 0.02, &key).unwrap()).collect();
    let grads: Vec<Array> =
        shapes.iter().map(|(_, s)| random::normal(s, Dtype::Float32, 0.0, 1e-3, &key).unwrap()).collect();
    mlx_core::eval(&params.iter().chain(&grads).collect::<Vec<_>>()).unwrap();
    let total: i64 = shapes.iter().map(|(_, s)| s.iter().map(|&d| i64::from(d)).product::<i64>()).sum();
    let mut opt = AdamW::new(AdamWConfig::default(), &names, &params).unwrap();
    for round in 0..5 {
        let t0 = Instant::now();
        let (clipped, _) = clip_grad_norm(&grads, 1.0).unwrap();
        mlx_core::eval(&clipped.iter().collect::<Vec<_>>()).unwrap();
        let t1 = Instant::now();
        let out = opt.step(&clipped, 1e-3).unwrap();
        mlx_core::eval(&out.iter().collect::<Vec<_>>()).unwrap();
        let t2 = Instant::now();
        println!(
            "round {round}: {total} values, clip {:.1} ms, AdamW step {:.1} ms",
            (t1 - t0).as_secs_f64() * 1e3,
            (t2 - t1).as_secs_f64() * 1e3
        );
    }
}
