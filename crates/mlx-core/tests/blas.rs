//! The BLAS switch: MLX's f32 matmuls go through it, to OpenBLAS when it is installed.
use mlx_core::{Array, Blas, Dtype, blas_info, blas_sgemm_calls, select_blas};

#[test]
fn f32_matmul_reaches_the_selected_blas() {
    if !mlx_sys::HAS_BLAS_SWITCH {
        return; // macOS: Accelerate inside libmlx
    }
    let a = Array::ones(&[64, 64], Dtype::Float32).unwrap();
    for blas in [Blas::Reference, Blas::OpenBlas] {
        if select_blas(blas).is_err() {
            assert_eq!(blas, Blas::OpenBlas, "the reference BLAS ships with the wheel");
            continue;
        }
        let info = blas_info();
        assert!(info.starts_with(if blas == Blas::OpenBlas { "openblas" } else { "reference" }), "{info}");
        let before = blas_sgemm_calls();
        let y = a.matmul(&a).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![64.0; 64 * 64]);
        assert!(blas_sgemm_calls() > before, "{blas:?}: matmul did not go through the switch");
    }
}
