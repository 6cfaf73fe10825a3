//! Criterion benchmark of one DSpark draft call (`Drafter::propose`: the block pass, base
//! logits, the 7-step greedy Markov walk and the confidence head) on a mid-size random
//! drafter (H 512, 5 layers, 8/2 heads of 64, I 1536, V 16384, r 256, 5 taps, 128 context
//! rows), f32 dense against the same checkpoint quantized to 8 and 4 bits (group 64) side by
//! side: the speed half of the drafter quantization A/B, without a target.
//!
//! Run: `cargo bench -p drafter --bench propose`.
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use drafter::Drafter;
use mlx_core::Dtype;
use mlx_core::quant::QuantSpec;
use mlx_core::random::{Key, normal};
use models::LoadOptions;
use test_support::dspark::{DrafterDims, quantize_drafter_for_tests, write_random_dspark};

fn propose(c: &mut Criterion) {
    let dims = DrafterDims {
        architecture: drafter::Architecture::Qwen3,
        k_eq_v: false,
        hidden: 512,
        intermediate: 1536,
        heads: 8,
        kv_heads: 2,
        head_dim: 64,
        layers: 5,
        vocab: 16384,
        markov_rank: 256,
        tap_layers: vec![1, 9, 17, 25, 33],
        num_target_layers: 36,
        block_size: 7,
    };
    let dir = tempfile::tempdir().unwrap();
    let dense = dir.path().join("bf16");
    std::fs::create_dir_all(&dense).unwrap();
    write_random_dspark(&dense, &dims, 1).unwrap();
    let mut arms = vec![("f32_dense".to_string(), dense.clone())];
    for bits in [8, 4] {
        let q = dir.path().join(format!("q{bits}"));
        std::fs::create_dir_all(&q).unwrap();
        quantize_drafter_for_tests(&dense, &q, QuantSpec::new(64, bits).unwrap()).unwrap();
        arms.push((format!("q{bits}_g64"), q));
    }
    let width = (dims.tap_layers.len() * dims.hidden) as i32;
    let feats = normal(&[1, 128, width], Dtype::Float32, 0.0, 1.0, &Key::new(2)).unwrap();
    let mut g = c.benchmark_group("dspark_propose_h512_v16k");
    g.measurement_time(Duration::from_secs(4)).sample_size(20);
    for (name, path) in &arms {
        let d = Drafter::load(path, &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() }).unwrap();
        let mut ctx = d.new_context();
        d.ingest(&mut ctx, &feats).unwrap();
        mlx_core::eval(&ctx.state().iter().collect::<Vec<_>>()).unwrap();
        g.bench_function(name.as_str(), |b| b.iter(|| d.propose(&mut ctx, 7, 0.0).unwrap().drafts));
    }
    g.finish();
}

criterion_group!(benches, propose);
criterion_main!(benches);
