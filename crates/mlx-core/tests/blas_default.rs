//! With libopenblas.so.0 installed (CI installs Debian's libopenblas0-pthread) and no
//! `MLX_SPEC_BLAS` override, OpenBLAS is the default BLAS. Its own binary, because the
//! default is chosen once per process and other tests switch it.
use mlx_core::{Array, Dtype, blas_info};

#[test]
fn openblas_is_the_default_when_installed() {
    let present = ["/usr/lib/x86_64-linux-gnu/libopenblas.so.0", "/lib/x86_64-linux-gnu/libopenblas.so.0"]
        .iter()
        .any(|p| std::path::Path::new(p).exists());
    if !mlx_sys::HAS_BLAS_SWITCH || !present || std::env::var_os("MLX_SPEC_BLAS").is_some() {
        eprintln!("skipped: no BLAS switch, no OpenBLAS, or MLX_SPEC_BLAS set");
        return;
    }
    let a = Array::ones(&[8, 8], Dtype::Float32).unwrap();
    a.matmul(&a).unwrap().eval().unwrap();
    let info = blas_info();
    assert!(info.starts_with("openblas") && info.contains("OpenBLAS"), "{info}");
}
