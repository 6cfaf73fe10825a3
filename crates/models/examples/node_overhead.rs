use mlx_core::{Array, Dtype, eval, random};
use std::time::Instant;
fn main() {
    let key = random::Key::new(1);
    let x = random::normal(&[1, 1, 576], Dtype::Float32, 0.0, 1.0, &key).unwrap();
    let r = random::normal(&[1, 1, 576], Dtype::Float32, 0.0, 1.0, &key).unwrap();
    eval(&[&x, &r]).unwrap();
    for n in [100usize, 480, 1000] {
        let mut ts = vec![];
        for _ in 0..30 {
            let t0 = Instant::now();
            let mut h = x.clone();
            for _ in 0..n {
                h = h.add(&r).unwrap();
            }
            eval(&[&h]).unwrap();
            ts.push(t0.elapsed().as_secs_f64() * 1e6 / n as f64);
        }
        ts.sort_by(f64::total_cmp);
        println!("{n} adds: {:.2} us/node", ts[ts.len() / 2]);
    }
}
