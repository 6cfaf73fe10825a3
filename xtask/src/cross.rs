//! `cargo xtask cross-test aarch64`: the workspace cross-built for 64-bit ARM Linux, and a
//! chosen set of its tests run under qemu user-mode emulation against the target's MLX wheel.
//!
//! Steps, each timed:
//! 1. `cargo check --workspace --all-targets --target aarch64-unknown-linux-gnu` (every library,
//!    binary, test, bench and example compiles for the target; mlx-sys's build script
//!    downloads the `mlx-cpu` aarch64 wheel into its own cache directory and cross-compiles
//!    the bridge), then `cargo build --workspace --bins` (the `mlx-spec` binary links against
//!    the target's libmlx);
//! 2. `cargo test --workspace --target … --lib` under `qemu-aarch64 -L /usr/aarch64-linux-gnu`
//!    (the sysroot of Debian's cross toolchain): the unit tests of [`LIB_PACKAGES`], the only
//!    members that have any (the step fails if another member gains some, so that the list
//!    stays true);
//! 3. `cargo test --workspace --target … --test …` of the integration tests in [`KERNEL_TESTS`]:
//!    mlx-sys's CPU kernels (quantized and dense matmul, attention, RMS norm and RoPE, the BLAS
//!    switch's matrix-vector rewrite) against MLX's own results, on the portable C++ path that
//!    non-x86 targets compile.
//!
//! Steps 2 and 3 select `--workspace`, as step 1 does, so that dependencies resolve to the
//! same features and nothing is compiled again (`-p` of a few members would rebuild most of
//! the dependency tree with fewer features).
//!
//! Real-weight tests (they download models) and the benches are checked in step 1 but not
//! built or run.
//! Needs (Debian): `g++-aarch64-linux-gnu`, `qemu-user`, and `rustup target add
//! aarch64-unknown-linux-gnu`; `.ci/run` installs them. On an aarch64 machine the tests run
//! natively, without qemu.
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::Result;

/// Step 1a: every target of the workspace (libraries, binaries, tests, benches, examples)
/// compiles for the target: `cargo check` runs the build scripts (mlx-sys's C++ bridge and
/// kernels are compiled with the cross compiler) and type-checks every crate, without
/// generating and linking the ~80 test, bench and example executables, most of which never
/// run here.
const BUILD_ALL: &[&str] = &["check", "--workspace", "--all-targets"];

/// Step 1b: the binaries (`mlx-spec`) are built and linked against the target's libmlx; the
/// test executables of steps 2 and 3 are built and linked by `cargo test` itself.
const BUILD_BINS: &[&str] = &["build", "--workspace", "--bins"];

/// Packages whose unit tests (`--lib`) run on the target.
pub const LIB_PACKAGES: &[&str] = &["mlx-core", "models", "spec", "drafter", "train", "server", "test-support"];

/// Integration tests (package, test target) that compare the CPU kernels of mlx-sys with MLX's
/// own results; they run on the target too.
pub const KERNEL_TESTS: &[(&str, &str)] = &[
    ("mlx-core", "cpu_quant"),
    ("mlx-core", "cpu_quant_precision"),
    ("mlx-core", "cpu_dense"),
    ("mlx-core", "cpu_attention"),
    ("mlx-core", "cpu_fast"),
    ("mlx-sys", "gemv"),
];

/// Architectures `cross-test` knows.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Arch {
    /// 64-bit ARM Linux (`aarch64-unknown-linux-gnu`): Linux ARM servers, and Apple Silicon's
    /// instruction set.
    Aarch64,
}

impl Arch {
    fn triple(self) -> &'static str {
        match self {
            Arch::Aarch64 => "aarch64-unknown-linux-gnu",
        }
    }

    /// `std::env::consts::ARCH` of a machine that runs the target's binaries natively.
    fn native_arch(self) -> &'static str {
        match self {
            Arch::Aarch64 => "aarch64",
        }
    }

    /// The C/C++ cross compiler (the linker in `.cargo/config.toml`, and the `cc` crate's
    /// default for the triple).
    fn cross_gcc(self) -> &'static str {
        match self {
            Arch::Aarch64 => "aarch64-linux-gnu-gcc",
        }
    }

    /// The qemu user-mode emulator and the sysroot it loads the target's libc from.
    fn qemu(self) -> (&'static str, &'static str) {
        match self {
            Arch::Aarch64 => ("qemu-aarch64", "/usr/aarch64-linux-gnu"),
        }
    }

    /// Cargo's runner variable for the triple.
    fn runner_var(self) -> String {
        format!("CARGO_TARGET_{}_RUNNER", self.triple().to_uppercase().replace('-', "_"))
    }
}

/// Arguments of `cargo xtask cross-test`.
#[derive(clap::Args)]
pub struct Args {
    /// The target architecture.
    #[arg(value_enum)]
    arch: Arch,
    /// Only the cross build (step 1), no tests.
    #[arg(long)]
    build_only: bool,
}

/// What stops a cross test before cargo runs.
#[derive(Debug, thiserror::Error)]
pub enum CrossError {
    /// A tool the cross build or the emulation needs is not on PATH.
    #[error("`{tool}` not found on PATH: {hint}")]
    MissingTool {
        /// The program looked for.
        tool: &'static str,
        /// How to install it.
        hint: &'static str,
    },
    /// The emulator's sysroot (the target's libc and libstdc++) is missing.
    #[error("{0}: no sysroot for the emulator (Debian: apt-get install g++-aarch64-linux-gnu)")]
    MissingSysroot(&'static str),
    /// A workspace member outside [`LIB_PACKAGES`] has unit tests, which `--workspace --lib`
    /// would run too.
    #[error("unit tests in {0}: add them to LIB_PACKAGES in xtask/src/cross.rs (and the README) or exclude them")]
    UnlistedUnitTests(String),
}

/// Workspace members with a library target (what `--lib` runs) whose library sources
/// contain a `#[test]` (a plain text search of the directory of the library's root file),
/// from `cargo metadata`. The unit tests of a binary-only member (the CLI) are not run by
/// `--lib`.
fn members_with_unit_tests(cargo: fn() -> Command) -> Result<Vec<String>> {
    let out = cargo().args(["metadata", "--no-deps", "--format-version", "1"]).output()?;
    if !out.status.success() {
        anyhow::bail!("cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let mut found = Vec::new();
    for package in meta["packages"].as_array().into_iter().flatten() {
        let libs = package["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|t| t["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "lib" || k == "rlib")));
        for lib in libs {
            let Some(dir) = lib["src_path"].as_str().and_then(|p| Path::new(p).parent()) else { continue };
            if has_test_attr(dir)? {
                found.push(package["name"].as_str().unwrap_or_default().to_string());
            }
        }
    }
    found.sort();
    found.dedup();
    Ok(found)
}

fn has_test_attr(dir: &Path) -> Result<bool> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            if has_test_attr(&path)? {
                return Ok(true);
            }
        } else if path.extension().is_some_and(|e| e == "rs") && std::fs::read_to_string(&path)?.contains("#[test]") {
            return Ok(true);
        }
    }
    Ok(false)
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

/// Runs the cross build and, unless `--build-only`, the tests under emulation.
pub fn run(args: Args, cargo: fn() -> Command) -> Result<()> {
    let arch = args.arch;
    let triple = arch.triple();
    let native = std::env::consts::ARCH == arch.native_arch();
    if !native && !on_path(arch.cross_gcc()) {
        return Err(CrossError::MissingTool {
            tool: arch.cross_gcc(),
            hint: "apt-get install g++-aarch64-linux-gnu (and rustup target add aarch64-unknown-linux-gnu)",
        }
        .into());
    }
    let mut steps: Vec<(String, f64)> = Vec::new();
    let t0 = Instant::now();
    for what in [BUILD_ALL, BUILD_BINS] {
        let t = Instant::now();
        let mut c = cargo();
        c.args(what).args(["--target", triple]);
        super::run(c)?;
        steps.push((format!("cargo {} --target {triple}", what.join(" ")), t.elapsed().as_secs_f64()));
    }

    if !args.build_only {
        let runner_var = arch.runner_var();
        // A runner the caller set wins (e.g. another emulator or a remote machine).
        let runner = match std::env::var(&runner_var) {
            Ok(r) if !r.trim().is_empty() => Some(r),
            _ if native => None,
            _ => {
                let (qemu, sysroot) = arch.qemu();
                if !on_path(qemu) {
                    return Err(CrossError::MissingTool { tool: qemu, hint: "apt-get install qemu-user" }.into());
                }
                if !Path::new(sysroot).join("lib").is_dir() {
                    return Err(CrossError::MissingSysroot(sysroot).into());
                }
                Some(format!("{qemu} -L {sysroot}"))
            }
        };
        let with_runner = |mut c: Command| {
            if let Some(r) = &runner {
                c.env(&runner_var, r);
            }
            c
        };

        let t = Instant::now();
        let mut c = cargo();
        c.args(["test", "--workspace", "--target", triple, "--lib"]);
        let others = members_with_unit_tests(cargo)?
            .into_iter()
            .filter(|m| !LIB_PACKAGES.contains(&m.as_str()))
            .collect::<Vec<_>>();
        if !others.is_empty() {
            return Err(CrossError::UnlistedUnitTests(others.join(", ")).into());
        }
        super::run(with_runner(c))?;
        steps.push((format!("unit tests (--lib) of {}", LIB_PACKAGES.join(", ")), t.elapsed().as_secs_f64()));

        let t = Instant::now();
        let mut c = cargo();
        c.args(["test", "--workspace", "--target", triple]);
        for (_, name) in KERNEL_TESTS {
            c.args(["--test", name]);
        }
        super::run(with_runner(c))?;
        let names: Vec<String> = KERNEL_TESTS.iter().map(|(p, t)| format!("{p}/{t}")).collect();
        steps.push((format!("kernel tests {}", names.join(", ")), t.elapsed().as_secs_f64()));
        let how = runner.as_deref().unwrap_or("natively");
        eprintln!("cross-test {triple}: tests ran {how}");
    }
    for (what, secs) in &steps {
        eprintln!("cross-test {triple}: {secs:7.1}s  {what}");
    }
    eprintln!("cross-test {triple}: {:7.1}s  in all", t0.elapsed().as_secs_f64());
    Ok(())
}
