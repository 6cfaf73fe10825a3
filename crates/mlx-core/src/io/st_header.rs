//! The safetensors header, read and checked without the data: every tensor's byte range is
//! checked against its shape and dtype (64-bit arithmetic), the data section and the other
//! tensors (no overlap) before anything trusts the file. [`super::load_safetensors`] runs it
//! before handing a file to MLX (whose reader takes the header's word), and the quantizer
//! streams tensors by the ranges it returns. The header JSON entries are parsed by the
//! `safetensors` crate's [`TensorInfo`]; the format is <https://github.com/huggingface/safetensors>
//! ("Format").
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use safetensors::Dtype as StDtype;
use safetensors::tensor::TensorInfo;
use serde_json::Value;

use crate::{Error, Result};

/// Bytes of the little-endian `u64` header length that starts every safetensors file.
pub const PREFIX: u64 = 8;
/// The largest header accepted (the `safetensors` crate's own limit), bytes.
pub const MAX_HEADER: u64 = 100_000_000;

/// One tensor of a safetensors file: where its bytes lie, not the bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// The tensor name.
    pub name: String,
    /// Element type as the header gives it.
    pub dtype: StDtype,
    /// Shape as the header gives it (each dimension a full 64-bit value).
    pub shape: Vec<usize>,
    /// Absolute byte offset of the data in the file.
    pub start: u64,
    /// Data length in bytes (`numel * bits / 8`, rounded up).
    pub len: u64,
}

fn bad(path: &Path, message: impl Into<String>) -> Error {
    Error::File { path: path.into(), message: message.into() }
}

/// Reads and checks the header of the open file `f` (positioned at its start) at `path`:
/// the tensors sorted by their start offset.
///
/// # Errors
/// [`Error::File`] naming `path`: shorter than the 8-byte length, a header length past the
/// end or above [`MAX_HEADER`], a header that is not a JSON object of tensor entries, a
/// tensor whose `data_offsets` do not hold exactly `shape` x dtype bytes (the product is
/// computed in 64 bits, so a dimension of 2^32 + 576 is not read as 576), that ends past
/// the file, or that overlaps another; read failures with the OS reason.
pub fn read_header(path: &Path, f: &mut File) -> Result<Vec<TensorEntry>> {
    let io = |e: std::io::Error| bad(path, format!("cannot read the safetensors header: {e}"));
    let size = f.metadata().map_err(io)?.len();
    if size < PREFIX {
        return Err(bad(
            path,
            format!(
                "the file is {size} byte{}, too short to hold the {PREFIX}-byte safetensors header length",
                if size == 1 { "" } else { "s" }
            ),
        ));
    }
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(io)?;
    let n = u64::from_le_bytes(len);
    if n > size - PREFIX {
        return Err(bad(
            path,
            format!(
                "truncated header: it declares {n} header bytes but the file has only {} after the length",
                size - PREFIX
            ),
        ));
    }
    if n > MAX_HEADER {
        return Err(bad(path, format!("header of {n} bytes is larger than the {MAX_HEADER}-byte limit")));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(io)?;
    let entries: BTreeMap<String, Value> = serde_json::from_slice(&header)
        .map_err(|e| bad(path, format!("the header is not a safetensors JSON object: {e}")))?;
    let data_start = PREFIX + n;
    let data_len = size - data_start;
    let mut out = Vec::with_capacity(entries.len());
    for (name, v) in entries {
        if name == "__metadata__" {
            continue;
        }
        let info: TensorInfo = serde_json::from_value(v)
            .map_err(|e| bad(path, format!("tensor `{name}`: malformed header entry: {e}")))?;
        let (s, e) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
        let numel = info.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64));
        let expected = numel.and_then(|n| n.checked_mul(info.dtype.bitsize() as u64)).map(|b| b.div_ceil(8));
        if e < s || Some(e - s) != expected {
            return Err(bad(
                path,
                format!(
                    "tensor `{name}`: data_offsets [{s}, {e}] hold {} bytes, but shape {:?} of {:?} needs {}",
                    e.saturating_sub(s),
                    info.shape,
                    info.dtype,
                    expected.map_or("more than 2^64".to_string(), |b| b.to_string())
                ),
            ));
        }
        if e > data_len {
            return Err(bad(
                path,
                format!(
                    "tensor `{name}` ends at data byte {e}, past the end of the file (the data section has {data_len} bytes): truncated file?"
                ),
            ));
        }
        out.push(TensorEntry { name, dtype: info.dtype, shape: info.shape, start: data_start + s, len: e - s });
    }
    out.sort_by_key(|t| t.start);
    for w in out.windows(2) {
        if w[1].start < w[0].start + w[0].len {
            return Err(bad(path, format!("tensors `{}` and `{}` overlap", w[0].name, w[1].name)));
        }
    }
    Ok(out)
}
