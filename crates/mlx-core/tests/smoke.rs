use mlx_core::*;
#[test]
fn smoke() {
    let a = Array::from_slice(&[1f32, 2., 3., 4., 5., 6.], &[2, 3]).unwrap();
    let b = Array::from_slice(&[7f32, 8., 9., 10., 11., 12.], &[3, 2]).unwrap();
    assert_eq!(a.matmul(&b).unwrap().to_vec::<f32>().unwrap(), vec![58., 64., 139., 154.]);
    println!("{}", blas_info());
    let e = a.matmul(&a).unwrap_err();
    println!("{e}");
}
