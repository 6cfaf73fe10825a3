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

/// OpenBLAS 0.3.21 (Debian 12) does not know the cloud Xeons CI runs on and picks its generic
/// SSE3 "Prescott" kernels there (18.5 against 69-84 GFLOP/s on a 1024^3 sgemm); the switch
/// then loads it again with the family the CPU's features allow. On a CPU with AVX2 and FMA
/// the default OpenBLAS must run one of those families, unless the user named a core.
#[test]
fn openblas_runs_kernels_the_cpu_supports() {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
        let avx512 = std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512dq")
            && std::is_x86_feature_detected!("avx512vl");
        let info = blas_info();
        if !info.starts_with("openblas") || !info.contains("DYNAMIC_ARCH") || !avx2 {
            eprintln!("skipped: not a DYNAMIC_ARCH OpenBLAS or no AVX2 ({info})");
            return;
        }
        if std::env::var_os("OPENBLAS_CORETYPE").is_some() {
            eprintln!("skipped: OPENBLAS_CORETYPE names the core ({info})");
            return;
        }
        let generic = ["Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Atom", "Sandybridge"];
        // The running core is in OpenBLAS's config string; the switch's note after it may name
        // the core OpenBLAS detected.
        let config = info.split(" (kernels").next().unwrap_or(&info);
        let words: Vec<&str> = config.split(|c: char| !c.is_ascii_alphanumeric()).collect();
        assert!(!generic.iter().any(|g| words.contains(g)), "OpenBLAS runs generic kernels on an AVX2 CPU: {info}");
        if info.contains("chosen from the CPU's features") {
            let want = if avx512 { "SkylakeX" } else { "Haswell" };
            assert!(words.contains(&want), "expected {want}: {info}");
        }
    }
}
