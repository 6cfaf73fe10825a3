//! Backend-gated checks: each runs only where its backend is present (Metal on macOS, CUDA
//! with the mlx-cuda wheels and a GPU); the CPU checks run everywhere else.
use mlx_core::{Array, Backend, Dtype, backend, default_device, info};

#[test]
fn reported_backend_matches_the_default_device() {
    let dev = default_device();
    match backend() {
        Backend::Cpu => assert!(dev.contains("cpu"), "{dev}"),
        Backend::Metal | Backend::Cuda => assert!(dev.contains("gpu"), "{dev}"),
    }
    let i = info();
    assert_eq!(i.mlx_version, "0.32.4");
    assert!(!i.blas.is_empty());
}

#[test]
fn gpu_backend_computes_on_the_gpu() {
    if backend() == Backend::Cpu {
        eprintln!("skipped: no GPU backend in this build/machine");
        return;
    }
    // A matmul large enough to dispatch a GPU kernel, checked against the exact answer.
    let a = Array::ones(&[256, 256], Dtype::Float32).unwrap();
    let y = a.matmul(&a).unwrap().sum(&[], false).unwrap().item().unwrap();
    assert_eq!(y, 256.0 * 256.0 * 256.0);
}
