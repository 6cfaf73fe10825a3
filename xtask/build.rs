//! Puts libmlx's directory in the rpath of xtask (it links `models` for `cargo xtask fixtures`),
//! so it runs without LD_LIBRARY_PATH.
fn main() {
    let libdir = std::env::var("DEP_MLX_LIBDIR").expect("mlx-sys exports DEP_MLX_LIBDIR");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
}
