//! Splits a one-token decode step into graph building and evaluation (wall ms each), for
//! profiling the CPU backend: `cargo run --release -p models --example step_profile -- DIR`.
use std::time::Instant;

use mlx_core::{Dtype, eval};
use models::generate::{ids, prefill};
use models::{LoadOptions, load_model};

fn main() {
    let dir = std::env::args().nth(1).expect("model directory");
    let model =
        load_model(std::path::Path::new(&dir), &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() })
            .unwrap();
    let prompt_len: u32 = std::env::args().nth(3).and_then(|s| s.parse().ok()).unwrap_or(100);
    let prompt: Vec<u32> = (0..prompt_len).map(|i| 100 + i * 7).collect();
    let (mut cache, mut tok) = prefill(&model, &prompt).unwrap();
    let (mut build, mut run) = (Vec::new(), Vec::new());
    let steps: usize = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(60);
    for _ in 0..steps {
        let t0 = Instant::now();
        let logits = model.forward(&ids(&[tok]).unwrap(), &mut cache).unwrap();
        let next = logits.reshape(&[-1]).unwrap().argmax(0, false).unwrap();
        let t1 = Instant::now();
        eval(&[&next]).unwrap();
        let t2 = Instant::now();
        tok = next.to_vec::<u32>().unwrap()[0];
        build.push((t1 - t0).as_secs_f64() * 1e3);
        run.push((t2 - t1).as_secs_f64() * 1e3);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "build {:.2} ms, eval {:.2} ms (median of {steps} steps; {} fused layer nodes)",
        med(&mut build),
        med(&mut run),
        mlx_core::cpu_layer::calls()
    );
    let params = models::GenerateParams { max_tokens: steps, sampler: models::Sampler::default(), eos: vec![] };
    let stats = models::generate(&model, &prompt, &params, |_| true).unwrap();
    println!("pipelined generate: {:.2} tok/s ({:.2} ms/token)", stats.generation_tps, 1e3 / stats.generation_tps);
}
