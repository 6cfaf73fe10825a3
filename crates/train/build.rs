//! Puts libmlx's directory in the rpath of this package's tests and benches, so they run
//! without LD_LIBRARY_PATH (a library's link args reach only its own executables).
fn main() {
    let libdir = std::env::var("DEP_MLX_LIBDIR").expect("mlx-sys exports DEP_MLX_LIBDIR");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
}
