//! Finds an MLX installation (headers + `libmlx`), compiles the C++ shim against it and
//! tells dependents where the library lives.
//!
//! Resolution order (first hit wins):
//! 1. `$MLX_DIR`: a directory with `include/mlx/mlx.h` and `lib/libmlx.{so,dylib}` (the
//!    `mlx/` directory of an unpacked wheel, or a CMake install prefix).
//! 2. The `mlx` Python package of `$MLX_PYTHON` (default `python3`). `mlx` is a namespace
//!    package, so every entry of `mlx.__path__` is checked. Skipped when `$MLX_BACKEND` is
//!    set explicitly, so that an installed CPU wheel never shadows a requested CUDA build.
//! 3. The pinned wheel for `$MLX_BACKEND` (`cpu` = `mlx-cpu`, `cuda12` = `mlx-cuda-12`,
//!    `cuda13` = `mlx-cuda-13`, `metal` = `mlx`; default `cpu` on Linux, `metal` on macOS),
//!    fetched with `python3 -m pip download --no-deps --only-binary=:all:` into
//!    `$MLX_SPEC_CACHE` (default `$XDG_CACHE_HOME/mlx-spec` or `~/.cache/mlx-spec`) and
//!    unpacked there, keeping `mlx/` and `mlx_*.libs/` side by side (libmlx's RPATH
//!    points from one to the other).
//!
//! Everything follows the *target* (`CARGO_CFG_TARGET_OS`, `CARGO_CFG_TARGET_ARCH`), not the
//! machine running the build: when cross-compiling (`TARGET` differs from `HOST`, e.g.
//! `cargo build --target aarch64-unknown-linux-gnu` on x86_64), step 2 is skipped (the host's
//! Python has the host's MLX), and step 3 downloads the Linux wheel for the target's
//! architecture (`pip download --platform manylinux_2_NN_<arch>`) into its own cache directory,
//! `<cache>/<package>-<version>-<target triple>`. On Linux the architecture of the `libmlx.so`
//! found (ELF machine) must be the target's, whichever step found it.
//!
//! Metadata for dependents (`links = "mlx"`): `DEP_MLX_LIBDIR` (the directory to put in
//! an executable's rpath), `DEP_MLX_INCLUDE`, `DEP_MLX_ROOT`.
use std::{
    env, fs,
    io::Read,
    path::{Path, PathBuf},
    process::Command,
};

/// The MLX release this project is pinned to (headers and library must agree).
const MLX_VERSION: &str = "0.32.4";

fn main() {
    for var in ["MLX_DIR", "MLX_PYTHON", "MLX_BACKEND", "MLX_SPEC_CACHE", "XDG_CACHE_HOME"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    const SOURCES: [&str; 11] = [
        "src/shim.h",
        "src/shim.cc",
        "src/blas.cc",
        "src/qmm.cc",
        "src/attn.cc",
        "src/fast.cc",
        "src/layer.cc",
        "src/kernels.h",
        "src/pool.h",
        "src/simd.h",
        "src/lib.rs",
    ];
    // A digest of the C++ sources (FNV-1a 64): what a cache of measured kernel speeds (the
    // speculative policy's cost curves) keys on, so a new build re-measures.
    let mut digest: u64 = 0xcbf2_9ce4_8422_2325;
    for f in SOURCES {
        println!("cargo:rerun-if-changed={f}");
        for b in std::fs::read(f).unwrap_or_default() {
            digest = (digest ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    println!("cargo:rustc-env=MLX_SYS_SOURCES_DIGEST={digest:016x}");

    let target = Target::from_env();
    let root = find_mlx(&target);
    if let Err(msg) = target.check_arch(&root.join("lib/libmlx.so")) {
        fail(
            &msg,
            "set MLX_DIR to an MLX build for the target, or unset it and MLX_PYTHON to download the target's wheel",
        );
    }
    let inc = root.join("include");
    let lib = root.join("lib");
    let reference_blas = bundled_blas(&target, &root);

    let mut build = cxx_build::bridge("src/lib.rs");
    build
        .file("src/shim.cc")
        .file("src/qmm.cc")
        .file("src/attn.cc")
        .file("src/fast.cc")
        .file("src/layer.cc")
        .include(&inc)
        .std("c++20")
        .flag_if_supported("-Wno-unused-parameter")
        // fast.cc reproduces MLX's separately rounded products and sums (src/fast.cc), and
        // includes MLX's simd math header, whose exp type-puns an int vector as floats.
        .flag_if_supported("-ffp-contract=off")
        .flag_if_supported("-fno-strict-aliasing")
        .flag_if_supported("-Wno-deprecated-declarations")
        // GCC 12 flags the `_mm512_undefined_*()` inside its own AVX-512 intrinsics.
        .flag_if_supported("-Wno-maybe-uninitialized")
        .flag_if_supported("-Wno-uninitialized")
        // GCC for aarch64 notes an ABI change of GCC 10.1 at every std::pair<float, float> in
        // MLX's headers; nothing here is compiled with an older GCC.
        .flag_if_supported("-Wno-psabi")
        .opt_level(2);
    // The BLAS switch (src/blas.cc) only exists where libmlx calls a separate CBLAS
    // library, i.e. the Linux wheels; macOS uses Accelerate inside libmlx.
    if let Some(blas) = &reference_blas {
        build
            .file("src/blas.cc")
            .define("MLXSYS_BLAS_SWITCH", None)
            .define("MLXSYS_REFERENCE_BLAS", format!("\"{}\"", blas.display()).as_str());
    }
    // Link the shim whole: the BLAS switch's `cblas_sgemm` is referenced only by libmlx.so,
    // so without +whole-archive the linker would never pull its object out of the archive.
    build.cargo_metadata(false).compile("mlx_sys_shim");
    let out_dir = env::var("OUT_DIR").unwrap();
    println!("cargo:rustc-link-search=native={out_dir}");
    println!("cargo:rustc-link-lib=static:+whole-archive=mlx_sys_shim");
    let cxx_std = if target.os == "macos" { "c++" } else { "stdc++" };
    println!("cargo:rustc-link-lib=dylib={cxx_std}");

    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    // A cross linker does not follow libmlx's own RUNPATH to its dependencies (the wheel's
    // `mlx_*.libs/`), so name them for it; a native linker does this by itself.
    if target.cross {
        for dir in wheel_lib_dirs(&root) {
            println!("cargo:rustc-link-arg=-Wl,-rpath-link,{}", dir.display());
        }
    }
    if reference_blas.is_some() {
        println!("cargo:rustc-link-lib=dylib=dl");
    }
    // Only this package's own tests get this; dependents read DEP_MLX_LIBDIR.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    println!("cargo:libdir={}", lib.display());
    println!("cargo:include={}", inc.display());
    println!("cargo:root={}", root.display());
    println!("cargo:rustc-env=MLX_SYS_BLAS_SWITCH={}", if reference_blas.is_some() { "1" } else { "0" });
    println!("cargo:rustc-env=MLX_SYS_ROOT={}", root.display());
}

fn is_mlx_root(p: &Path) -> bool {
    p.join("include/mlx/mlx.h").is_file() && (p.join("lib/libmlx.so").exists() || p.join("lib/libmlx.dylib").exists())
}

/// What the build is for: the target's OS and architecture, and whether that differs from
/// the machine running the build.
struct Target {
    triple: String,
    os: String,
    arch: String,
    cross: bool,
}

impl Target {
    fn from_env() -> Self {
        let var = |k: &str| env::var(k).unwrap_or_default();
        let (triple, host) = (var("TARGET"), var("HOST"));
        Target {
            cross: !triple.is_empty() && triple != host,
            triple,
            os: var("CARGO_CFG_TARGET_OS"),
            arch: var("CARGO_CFG_TARGET_ARCH"),
        }
    }

    /// The ELF machine number of the target's architecture (`None` where this build script does
    /// not know it, or the target is not an ELF platform).
    fn elf_machine(&self) -> Option<u16> {
        if self.os != "linux" {
            return None;
        }
        match self.arch.as_str() {
            "x86_64" => Some(62),
            "aarch64" => Some(183),
            _ => None,
        }
    }

    /// Checks that the shared library `lib` is built for the target's architecture.
    fn check_arch(&self, lib: &Path) -> Result<(), String> {
        let Some(want) = self.elf_machine() else { return Ok(()) };
        let mut head = [0u8; 20];
        fs::File::open(lib)
            .and_then(|mut f| f.read_exact(&mut head))
            .map_err(|e| format!("cannot read the ELF header of {}: {e}", lib.display()))?;
        if &head[..4] != b"\x7fELF" {
            return Err(format!("{} is not an ELF file", lib.display()));
        }
        let got = u16::from_le_bytes([head[18], head[19]]);
        if got != want {
            return Err(format!(
                "{} is built for another architecture (ELF machine {got}) than the target {} ({}, ELF machine {want})",
                lib.display(),
                self.triple,
                self.arch
            ));
        }
        Ok(())
    }
}

fn find_mlx(target: &Target) -> PathBuf {
    if let Ok(dir) = env::var("MLX_DIR") {
        let p = PathBuf::from(&dir);
        if !is_mlx_root(&p) {
            fail(
                &format!("MLX_DIR={dir} has no include/mlx/mlx.h and lib/libmlx.so"),
                "expected the `mlx` directory of an unpacked mlx-cpu wheel or a CMake install prefix; \
                 unset MLX_DIR to let the build find or download MLX",
            );
        }
        return p;
    }
    if env::var_os("MLX_BACKEND").is_none() && !target.cross {
        let py = env::var("MLX_PYTHON").unwrap_or_else(|_| "python3".into());
        if let Some(p) = python_mlx(&py) {
            return p;
        }
    }
    download_wheel(target)
}

/// Asks `py` where its `mlx` namespace package lives; `None` when it has none.
fn python_mlx(py: &str) -> Option<PathBuf> {
    let out = Command::new(py).args(["-c", "import mlx\nfor p in mlx.__path__: print(p)"]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout).lines().map(|l| PathBuf::from(l.trim())).find(|p| is_mlx_root(p))
}

fn backend_package(target: &Target) -> &'static str {
    let default = if target.os == "macos" { "metal" } else { "cpu" };
    let backend = env::var("MLX_BACKEND").unwrap_or_else(|_| default.into());
    match backend.as_str() {
        "cpu" => "mlx-cpu",
        "cuda12" => "mlx-cuda-12",
        "cuda13" => "mlx-cuda-13",
        "metal" => "mlx",
        other => {
            fail(&format!("MLX_BACKEND={other} is not one of cpu, cuda12, cuda13, metal"), "unset it for the default")
        }
    }
}

fn cache_dir() -> PathBuf {
    if let Ok(d) = env::var("MLX_SPEC_CACHE") {
        return PathBuf::from(d);
    }
    if let Ok(d) = env::var("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("mlx-spec");
    }
    match env::var("HOME") {
        Ok(h) => PathBuf::from(h).join(".cache/mlx-spec"),
        Err(_) => PathBuf::from(env::var("OUT_DIR").unwrap()).join("mlx-spec-cache"),
    }
}

/// Removes a staging directory when the download fails part-way.
struct Staging(PathBuf);

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Downloads and unpacks the pinned wheel once; later builds reuse the unpacked copy.
fn download_wheel(target: &Target) -> PathBuf {
    let pkg = backend_package(target);
    let cache = cache_dir();
    // The host's own wheel keeps its old place; a cross target's gets a directory of its own.
    let dest = if target.cross {
        cache.join(format!("{pkg}-{MLX_VERSION}-{}", target.triple))
    } else {
        cache.join(format!("{pkg}-{MLX_VERSION}"))
    };
    let root = dest.join("mlx");
    if is_mlx_root(&root) {
        return root;
    }
    let cache_hint = "MLX_SPEC_CACHE chooses another cache directory";
    let py = env::var("MLX_PYTHON").unwrap_or_else(|_| "python3".into());
    let staging = Staging(cache.join(format!("{pkg}-{MLX_VERSION}.partial-{}", std::process::id())));
    let _ = fs::remove_dir_all(&staging.0);
    fs::create_dir_all(&staging.0)
        .unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", staging.0.display()), cache_hint));
    // stderr of a build script shows with `cargo build -vv`; a cargo:warning would be
    // replayed on every later build even though nothing is downloaded then.
    eprintln!("mlx-sys: downloading {pkg}=={MLX_VERSION} into {}", dest.display());
    let pip_hint = "set MLX_DIR to an unpacked MLX wheel, or make `python3 -m pip download` work";
    let mut pip = Command::new(&py);
    pip.args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]);
    if target.cross {
        pip.args(cross_platform_tags(target).iter().flat_map(|t| ["--platform", t.as_str()]));
    }
    run(pip.arg(format!("{pkg}=={MLX_VERSION}")).arg("-d").arg(&staging.0), pip_hint);
    let wheel = fs::read_dir(&staging.0)
        .ok()
        .and_then(|rd| rd.filter_map(Result::ok).map(|e| e.path()).find(|p| p.extension().is_some_and(|x| x == "whl")))
        .unwrap_or_else(|| fail(&format!("pip left no .whl in {}", staging.0.display()), pip_hint));
    run(Command::new(&py).args(["-m", "zipfile", "-e"]).arg(&wheel).arg(&staging.0), pip_hint);
    let _ = fs::remove_file(&wheel);
    if !is_mlx_root(&staging.0.join("mlx")) {
        fail(&format!("{} does not contain mlx/include/mlx/mlx.h and mlx/lib/libmlx.*", wheel.display()), pip_hint);
    }
    // A leftover incomplete copy (an interrupted older layout) is ours to replace.
    if dest.exists() && !is_mlx_root(&root) {
        fs::remove_dir_all(&dest).unwrap_or_else(|e| {
            fail(&format!("cannot remove the incomplete {}: {e}", dest.display()), "delete it by hand")
        });
    }
    // Atomic publish: a concurrent build may have won the race; either copy is fine.
    if let Err(e) = fs::rename(&staging.0, &dest)
        && !is_mlx_root(&root)
    {
        fail(&format!("cannot move the unpacked wheel to {}: {e}", dest.display()), cache_hint);
    }
    root
}

/// The `--platform` tags for `pip download` of a cross target's wheel: the manylinux tags of
/// its architecture (pip does not expand `manylinux_2_NN` to older ones by itself, and the
/// pinned wheels are `manylinux_2_35`).
fn cross_platform_tags(target: &Target) -> Vec<String> {
    if target.os != "linux" {
        fail(
            &format!("cannot download an MLX wheel for the cross target {}", target.triple),
            "only Linux cross targets have a pinned wheel; set MLX_DIR to an MLX build for the target",
        );
    }
    (17..=40).rev().map(|minor| format!("manylinux_2_{minor}_{}", target.arch)).collect()
}

/// `mlx_*.libs/` beside an unpacked wheel's `mlx/` (libmlx's bundled dependencies), then `mlx/lib`.
fn wheel_lib_dirs(root: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = root
        .parent()
        .and_then(|parent| fs::read_dir(parent).ok())
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().ends_with(".libs")))
        .collect();
    dirs.sort();
    dirs.push(root.join("lib"));
    dirs
}

/// The reference CBLAS that the Linux wheels ship beside libmlx (`mlx_cpu.libs/libblas-*.so*`).
fn bundled_blas(target: &Target, root: &Path) -> Option<PathBuf> {
    if target.os != "linux" {
        return None;
    }
    wheel_lib_dirs(root).iter().find_map(|d| {
        fs::read_dir(d).ok()?.filter_map(Result::ok).map(|e| e.path()).find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libblas") && n.to_string_lossy().contains(".so"))
        })
    })
}

fn run(cmd: &mut Command, hint: &str) {
    let out = cmd.output().unwrap_or_else(|e| fail(&format!("cannot run {cmd:?}: {e}"), hint));
    if !out.status.success() {
        let msg = format!(
            "{cmd:?} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        fail(&msg, hint);
    }
}

/// Stops the build with one message and a hint that fits the failure.
fn fail(msg: &str, hint: &str) -> ! {
    panic!("mlx-sys: {msg}\n({hint})")
}
