//! `cargo xtask cross-test aarch64`: the workspace cross-built for 64-bit ARM Linux, and a
//! chosen set of its tests run under qemu user-mode emulation against the target's MLX wheel.
//!
//! Steps, each timed:
//! 1. `cargo build --workspace --all-targets --target aarch64-unknown-linux-gnu` (every library,
//!    binary, test, bench and example compiles and links for the target; mlx-sys's build script
//!    downloads the `mlx-cpu` aarch64 wheel into its own cache directory);
//! 2. `cargo test --target … --lib` of [`LIB_PACKAGES`] under `qemu-aarch64 -L
//!    /usr/aarch64-linux-gnu` (the sysroot of Debian's cross toolchain);
//! 3. the integration tests in [`KERNEL_TESTS`]: mlx-sys's CPU kernels (quantized and dense
//!    matmul, attention, RMS norm and RoPE, the BLAS switch's matrix-vector rewrite) against
//!    MLX's own results, on the portable C++ path that non-x86 targets compile.
//!
//! Real-weight tests (they download models) and the benches are built in step 1 but not run.
//! Needs (Debian): `g++-aarch64-linux-gnu`, `qemu-user`, and `rustup target add
//! aarch64-unknown-linux-gnu`; `.ci/run` installs them. On an aarch64 machine the tests run
//! natively, without qemu.
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::Result;

/// Packages whose unit tests (`--lib`) run on the target.
pub const LIB_PACKAGES: &[&str] = &["mlx-core", "models", "spec", "drafter"];

/// Integration tests (package, test target) that compare the CPU kernels of mlx-sys with MLX's
/// own results; they run on the target too.
pub const KERNEL_TESTS: &[(&str, &str)] = &[
    ("mlx-core", "cpu_quant"),
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
    let mut c = cargo();
    c.args(["build", "--workspace", "--all-targets", "--target", triple]);
    super::run(c)?;
    steps.push((format!("cargo build --workspace --all-targets --target {triple}"), t0.elapsed().as_secs_f64()));

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
        c.args(["test", "--target", triple, "--lib"]);
        for p in LIB_PACKAGES {
            c.args(["-p", p]);
        }
        super::run(with_runner(c))?;
        steps.push((format!("unit tests (--lib) of {}", LIB_PACKAGES.join(", ")), t.elapsed().as_secs_f64()));

        let mut packages: Vec<&str> = KERNEL_TESTS.iter().map(|(p, _)| *p).collect();
        packages.dedup();
        for package in packages {
            let t = Instant::now();
            let mut c = cargo();
            c.args(["test", "--target", triple, "-p", package]);
            let names: Vec<&str> = KERNEL_TESTS.iter().filter(|(p, _)| *p == package).map(|(_, t)| *t).collect();
            for name in &names {
                c.args(["--test", name]);
            }
            super::run(with_runner(c))?;
            steps.push((format!("kernel tests of {package}: {}", names.join(", ")), t.elapsed().as_secs_f64()));
        }
        let how = runner.as_deref().unwrap_or("natively");
        eprintln!("cross-test {triple}: tests ran {how}");
    }
    for (what, secs) in &steps {
        eprintln!("cross-test {triple}: {secs:7.1}s  {what}");
    }
    eprintln!("cross-test {triple}: {:7.1}s  in all", t0.elapsed().as_secs_f64());
    Ok(())
}
