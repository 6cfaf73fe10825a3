//! Criterion benchmarks of the MLX CPU paths that decide decode speed:
//! - f32 matvec (`[1, 576] @ [576, 1536]`, a SmolLM2-135M MLP projection) and f32 sgemm
//!   (`512^3`) with the wheel's reference BLAS and with OpenBLAS, side by side in this one
//!   process through the BLAS switch;
//! - 4-bit (group 64) quantized matvec of the same matrix, against the f32 matvec;
//! - per-op overhead: one tiny elementwise op plus eval, and a chain of 16 tiny ops;
//! - the f32 matvec with the BLAS switch's sgemv rewrite on and off (OpenBLAS);
//! - 4-bit (group 32, the SmolLM2 GGUF's Q4_1) and 8-bit quantized matmul of a SmolLM2 MLP
//!   matrix and of the 49152 x 576 tied head for T = 1 and T = 11 activation rows: MLX's
//!   kernel vs the fast CPU kernel (`mlx_core::cpu_quant`).
//!
//! Run: `cargo xtask bench` (or `cargo bench -p mlx-core --bench ops`).
use criterion::{Criterion, criterion_group, criterion_main};
use mlx_core::cpu_quant;
use mlx_core::quant::{self, QuantSpec};
use mlx_core::random::{Key, normal};
use mlx_core::{Array, Blas, Dtype, KernelPolicy, select_blas, set_gemv_routing};
use std::time::Duration;

fn rand(shape: &[i32], seed: u64) -> Array {
    let a = normal(shape, Dtype::Float32, 0.0, 1.0, &Key::new(seed)).unwrap();
    a.eval().unwrap();
    a
}

fn blas_kinds() -> Vec<(Blas, &'static str)> {
    let mut v = vec![(Blas::Reference, "reference")];
    if select_blas(Blas::OpenBlas).is_ok() {
        v.push((Blas::OpenBlas, "openblas"));
    }
    v
}

fn matmul(c: &mut Criterion) {
    let x = rand(&[1, 576], 1);
    let w_t = rand(&[576, 1536], 2); // x @ W^T with W [1536, 576], stored transposed
    let a = rand(&[512, 512], 3);
    let b = rand(&[512, 512], 4);
    let mut g = c.benchmark_group("f32");
    g.measurement_time(Duration::from_secs(3)).sample_size(20);
    for (blas, name) in blas_kinds() {
        if select_blas(blas).is_err() {
            continue;
        }
        g.bench_function(format!("matvec_1x576x1536/{name}"), |bch| {
            bch.iter(|| x.matmul(&w_t).unwrap().eval().unwrap())
        });
        g.bench_function(format!("sgemm_512/{name}"), |bch| bch.iter(|| a.matmul(&b).unwrap().eval().unwrap()));
    }
    g.finish();
    let _ = select_blas(Blas::OpenBlas);
}

fn quantized(c: &mut Criterion) {
    let x = rand(&[1, 576], 1);
    let w = rand(&[1536, 576], 2);
    let w_t = w.t().unwrap().contiguous().unwrap();
    w_t.eval().unwrap();
    let q = quant::quantize(&w, QuantSpec::new(64, 4).unwrap()).unwrap();
    let mut g = c.benchmark_group("matvec_1x576x1536");
    g.measurement_time(Duration::from_secs(3)).sample_size(30);
    g.bench_function("f32_default_blas", |b| b.iter(|| x.matmul(&w_t).unwrap().eval().unwrap()));
    g.bench_function("q4_g64", |b| b.iter(|| q.matmul_t(&x).unwrap().eval().unwrap()));
    g.finish();
}

fn gemv_routing(c: &mut Criterion) {
    if select_blas(Blas::OpenBlas).is_err() {
        return;
    }
    let x = rand(&[1, 576], 1);
    let w = rand(&[1536, 576], 2); // x @ W^T: MLX passes W with a transpose flag
    let head = rand(&[49152, 576], 5);
    let mut g = c.benchmark_group("gemv");
    g.measurement_time(Duration::from_secs(3)).sample_size(20);
    for (on, name) in [(false, "sgemm"), (true, "sgemv")] {
        set_gemv_routing(on);
        g.bench_function(format!("1x576x1536/{name}"), |b| {
            b.iter(|| x.matmul(&w.t().unwrap()).unwrap().eval().unwrap())
        });
        g.bench_function(format!("1x576x49152/{name}"), |b| {
            b.iter(|| x.matmul(&head.t().unwrap()).unwrap().eval().unwrap())
        });
    }
    set_gemv_routing(true);
    g.finish();
}

fn quantized_kernels(c: &mut Criterion) {
    let mut g = c.benchmark_group("qmm");
    g.measurement_time(Duration::from_secs(3)).sample_size(20);
    for (n, k, bits) in [(1536, 576, 4), (49152, 576, 8)] {
        let w = rand(&[n, k], 2);
        let q = quant::quantize(&w, QuantSpec::new(32, bits).unwrap()).unwrap();
        for t in [1, 11] {
            let x = rand(&[1, t, k], 1);
            let id = format!("q{bits}g32_{t}x{k}x{n}");
            g.bench_function(format!("{id}/mlx"), |b| b.iter(|| q.matmul_t(&x).unwrap().eval().unwrap()));
            let policy = KernelPolicy::all_on();
            g.bench_function(format!("{id}/ours"), |b| {
                b.iter(|| {
                    cpu_quant::quantized_matmul_t(&x, &q.weight, &q.scales, &q.biases, q.spec, &policy)
                        .unwrap()
                        .eval()
                        .unwrap()
                })
            });
        }
    }
    g.finish();
}

fn overhead(c: &mut Criterion) {
    let a = Array::ones(&[4], Dtype::Float32).unwrap();
    let one = Array::scalar(1.0);
    a.eval().unwrap();
    let mut g = c.benchmark_group("overhead");
    g.measurement_time(Duration::from_secs(2));
    g.bench_function("one_add_eval", |b| b.iter(|| a.add(&one).unwrap().eval().unwrap()));
    g.bench_function("chain16_add_eval", |b| {
        b.iter(|| {
            let mut y = a.clone();
            for _ in 0..16 {
                y = y.add(&one).unwrap();
            }
            y.eval().unwrap()
        })
    });
    g.bench_function("build_only_16_ops", |b| {
        b.iter(|| {
            let mut y = a.clone();
            for _ in 0..16 {
                y = y.add(&one).unwrap();
            }
            y
        })
    });
    g.finish();
}

criterion_group!(benches, matmul, quantized, gemv_routing, quantized_kernels, overhead);
criterion_main!(benches);
