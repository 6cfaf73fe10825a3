//! Wall time of a DSpark draft call and its parts, on a checkpoint with random context
//! features: `cargo run --release -p drafter --example propose_profile -- DRAFTER_DIR [CONTEXT_ROWS]`
//! (f32, the default kernels, as `generate` loads a drafter for an f32 target). Prints the
//! median over 100 calls of the block forward alone (evaluated), with the LM head, of a whole
//! greedy `propose` (block, LM head, Markov walk, confidence head), and of ingesting one row.
use std::time::Instant;

use drafter::Drafter;
use mlx_core::{Dtype, random};
use models::LoadOptions;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let dir = std::env::args().nth(1).expect("a drafter directory");
    let rows: i32 = std::env::args().nth(2).map_or(200, |r| r.parse().expect("a row count"));
    let load = LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() };
    let d = Drafter::load(std::path::Path::new(&dir), &load).unwrap();
    let width = d.config().feature_width() as i32;
    let key = random::Key::new(1);
    let mut ctx = d.new_context();
    d.ingest(&mut ctx, &random::normal(&[1, rows, width], Dtype::Float32, 0.0, 1.0, &key).unwrap()).unwrap();
    mlx_core::eval(&ctx.state().iter().collect::<Vec<_>>()).unwrap();
    let first = Instant::now();
    d.propose(&mut ctx, 17, 0.0).unwrap();
    let first = first.elapsed().as_secs_f64() * 1e3;
    let time = |f: &mut dyn FnMut()| {
        let mut v = Vec::new();
        for _ in 0..100 {
            let t = Instant::now();
            f();
            v.push(t.elapsed().as_secs_f64() * 1e3);
        }
        median(v)
    };
    let block = time(&mut || {
        let b = d.forward_block(&mut ctx, 17).unwrap();
        b.hidden.eval().unwrap();
    });
    let head = time(&mut || {
        let b = d.forward_block(&mut ctx, 17).unwrap();
        d.base_logits(&b.hidden).unwrap().eval().unwrap();
    });
    let propose = time(&mut || {
        d.propose(&mut ctx, 17, 0.0).unwrap();
    });
    let one = random::normal(&[1, 1, width], Dtype::Float32, 0.0, 1.0, &key).unwrap();
    let ingest = time(&mut || {
        d.ingest(&mut ctx, &one).unwrap();
        mlx_core::eval(&ctx.state().iter().collect::<Vec<_>>()).unwrap();
    });
    let many = random::normal(&[1, 17, width], Dtype::Float32, 0.0, 1.0, &key).unwrap();
    let ingest17 = time(&mut || {
        d.ingest(&mut ctx, &many).unwrap();
        mlx_core::eval(&ctx.state().iter().collect::<Vec<_>>()).unwrap();
    });
    println!(
        "{dir}: {rows} context rows; first propose {first:.1} ms; block forward {block:.3} ms, with the LM head {head:.3}, propose {propose:.3} ms \
         (walk and confidence head {:.3}), ingest one row {ingest:.3} ms, 17 rows {ingest17:.3} ms",
        propose - head
    );
}
