//! GGML tensor types and their block codecs: dequantization to f32 (bit-compatible with
//! gguf-py's `gguf.quants.dequantize`, the reference implementation) and the exact
//! conversion of the block types that MLX's affine format can hold to MLX affine triples.
//!
//! A quantized GGML row is a sequence of blocks; each block covers `block_size`
//! consecutive elements of the row (32 for Q4_0..Q8_0, 256 for the K-quants) and takes
//! `type_size` bytes. All multi-byte fields are little-endian.
use half::{bf16, f16};

use crate::{Error, Result};

/// A GGML tensor type id (the `type` field of a GGUF tensor info). Unknown ids are kept so
/// that errors can name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GgmlType(pub u32);

/// `(id, name, elements per block, bytes per block)` of every GGML type gguf-py 0.19 knows.
const TYPES: [(u32, &str, usize, usize); 34] = [
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36),
    (41, "Q1_0", 128, 18),
];

impl GgmlType {
    /// 32-bit float.
    pub const F32: GgmlType = GgmlType(0);
    /// IEEE half.
    pub const F16: GgmlType = GgmlType(1);
    /// 4-bit, blocks of 32: `d` (f16), 16 bytes of nibbles; `w = d * (q - 8)`.
    pub const Q4_0: GgmlType = GgmlType(2);
    /// 4-bit, blocks of 32: `d`, `m` (f16), 16 bytes of nibbles; `w = d * q + m`.
    pub const Q4_1: GgmlType = GgmlType(3);
    /// 5-bit, blocks of 32: `d`, 4 bytes of high bits, 16 bytes of nibbles; `w = d * (q - 16)`.
    pub const Q5_0: GgmlType = GgmlType(6);
    /// 5-bit, blocks of 32: `d`, `m`, high bits, nibbles; `w = d * q + m`.
    pub const Q5_1: GgmlType = GgmlType(7);
    /// 8-bit, blocks of 32: `d` (f16), 32 int8; `w = d * q`.
    pub const Q8_0: GgmlType = GgmlType(8);
    /// K-quant, 2-bit, super-blocks of 256 in 16 sub-blocks of 16.
    pub const Q2_K: GgmlType = GgmlType(10);
    /// K-quant, 3-bit, super-blocks of 256 in 16 sub-blocks of 16.
    pub const Q3_K: GgmlType = GgmlType(11);
    /// K-quant, 4-bit, super-blocks of 256 in 8 sub-blocks of 32.
    pub const Q4_K: GgmlType = GgmlType(12);
    /// K-quant, 5-bit, super-blocks of 256 in 8 sub-blocks of 32.
    pub const Q5_K: GgmlType = GgmlType(13);
    /// K-quant, 6-bit, super-blocks of 256 in 16 sub-blocks of 16.
    pub const Q6_K: GgmlType = GgmlType(14);
    /// bfloat16.
    pub const BF16: GgmlType = GgmlType(30);
    /// 64-bit float.
    pub const F64: GgmlType = GgmlType(28);

    /// The types this module decodes: F32, F16, BF16, F64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    /// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
    pub const SUPPORTED: [GgmlType; 14] = [
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::F64,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q2_K,
        Self::Q3_K,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
    ];

    fn entry(self) -> Option<&'static (u32, &'static str, usize, usize)> {
        TYPES.iter().find(|t| t.0 == self.0)
    }

    /// The GGML name (`Q4_K`, `BF16`, ...), or `type <id>` for an id GGML does not define.
    pub fn name(self) -> String {
        self.entry().map_or_else(|| format!("type {}", self.0), |t| t.1.to_string())
    }

    /// Whether the id is a GGML type at all (known to gguf-py 0.19).
    pub fn is_known(self) -> bool {
        self.entry().is_some()
    }

    /// Whether [`dequantize`] decodes this type.
    pub fn is_supported(self) -> bool {
        Self::SUPPORTED.contains(&self)
    }

    /// `(elements per block, bytes per block)`; `None` for an unknown id.
    pub fn block(self) -> Option<(usize, usize)> {
        self.entry().map(|t| (t.2, t.3))
    }

    /// Whether the type is quantized (not a plain float type).
    pub fn is_quantized(self) -> bool {
        !matches!(self, Self::F32 | Self::F16 | Self::BF16 | Self::F64)
    }

    /// Bytes taken by `n` elements, `None` for an unknown id or when `n` is not a whole
    /// number of blocks (or overflows).
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let (bs, ts) = self.block()?;
        if !n.is_multiple_of(bs as u64) {
            return None;
        }
        (n / bs as u64).checked_mul(ts as u64)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn invalid(op: &'static str, message: String) -> Error {
    Error::Invalid { op, message }
}

/// Dequantizes `data` (whole blocks of `ty`, a multiple of the block size in elements)
/// to f32, element for element as gguf-py computes it (f32 arithmetic from f16 scales).
/// The result holds `data.len() / type_size * block_size` values in the tensor's row-major
/// order. F64 values are rounded to f32.
///
/// # Errors
/// [`Error::Invalid`] (op `gguf dequantize`) when the type is not one of
/// [`GgmlType::SUPPORTED`] or `data` is not a whole number of blocks.
pub fn dequantize(ty: GgmlType, data: &[u8]) -> Result<Vec<f32>> {
    const OP: &str = "gguf dequantize";
    let (bs, ts) =
        ty.block().filter(|_| ty.is_supported()).ok_or_else(|| invalid(OP, format!("unsupported tensor type {ty}")))?;
    if !data.len().is_multiple_of(ts) {
        return Err(invalid(OP, format!("{} bytes is not a whole number of {ty} blocks of {ts} bytes", data.len())));
    }
    let mut out = vec![0f32; data.len() / ts * bs];
    let blocks = data.chunks_exact(ts).zip(out.chunks_exact_mut(bs));
    match ty {
        GgmlType::F32 => blocks.for_each(|(b, o)| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => blocks.for_each(|(b, o)| o[0] = f16_at(b, 0)),
        GgmlType::BF16 => blocks.for_each(|(b, o)| o[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        GgmlType::F64 => blocks.for_each(|(b, o)| {
            o[0] = f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32;
        }),
        GgmlType::Q4_0 => blocks.for_each(|(b, o)| {
            let d = f16_at(b, 0);
            for i in 0..16 {
                o[i] = d * ((b[2 + i] & 0x0F) as i32 - 8) as f32;
                o[i + 16] = d * ((b[2 + i] >> 4) as i32 - 8) as f32;
            }
        }),
        GgmlType::Q4_1 => blocks.for_each(|(b, o)| {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            for i in 0..16 {
                o[i] = d * (b[4 + i] & 0x0F) as f32 + m;
                o[i + 16] = d * (b[4 + i] >> 4) as f32 + m;
            }
        }),
        GgmlType::Q5_0 => blocks.for_each(|(b, o)| {
            let d = f16_at(b, 0);
            let q = q5_values(&b[2..6], &b[6..22]);
            for i in 0..32 {
                o[i] = d * (q[i] as i32 - 16) as f32;
            }
        }),
        GgmlType::Q5_1 => blocks.for_each(|(b, o)| {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let q = q5_values(&b[4..8], &b[8..24]);
            for i in 0..32 {
                o[i] = d * q[i] as f32 + m;
            }
        }),
        GgmlType::Q8_0 => blocks.for_each(|(b, o)| {
            let d = f16_at(b, 0);
            for i in 0..32 {
                o[i] = (b[2 + i] as i8) as f32 * d;
            }
        }),
        GgmlType::Q2_K => blocks.for_each(|(b, o)| {
            let (scales, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
            for (e, o) in o.iter_mut().enumerate() {
                let s = scales[e / 16];
                let (dl, ml) = (d * (s & 0x0F) as f32, dmin * (s >> 4) as f32);
                let q = (qs[32 * (e / 128) + e % 32] >> (2 * ((e / 32) % 4))) & 3;
                *o = dl * q as f32 - ml;
            }
        }),
        GgmlType::Q3_K => blocks.for_each(|(b, o)| {
            let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
            let d = f16_at(b, 108);
            let mut dl = [0f32; 16];
            for (k, dl) in dl.iter_mut().enumerate() {
                let lo = (sc[k % 8] >> (4 * (k / 8))) & 0x0F;
                let hi = (sc[8 + k % 4] >> (2 * (k / 4))) & 0x03;
                *dl = d * ((lo | (hi << 4)) as i8 - 32) as f32;
            }
            for (e, o) in o.iter_mut().enumerate() {
                let ql = ((qs[32 * (e / 128) + e % 32] >> (2 * ((e / 32) % 4))) & 3) as i8;
                let qh = ((hmask[e % 32] >> (e / 32)) & 1) ^ 1;
                *o = dl[e / 16] * (ql - ((qh << 2) as i8)) as f32;
            }
        }),
        GgmlType::Q4_K => blocks.for_each(|(b, o)| {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (sc, m) = k_scale_min(&b[4..16]);
            let qs = &b[16..144];
            for (e, o) in o.iter_mut().enumerate() {
                let r = e / 32;
                let q = (qs[32 * (r / 2) + e % 32] >> (4 * (r % 2))) & 0x0F;
                *o = (d * sc[r] as f32) * q as f32 - dmin * m[r] as f32;
            }
        }),
        GgmlType::Q5_K => blocks.for_each(|(b, o)| {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (sc, m) = k_scale_min(&b[4..16]);
            let (qh, qs) = (&b[16..48], &b[48..176]);
            for (e, o) in o.iter_mut().enumerate() {
                let (r, i) = (e / 32, e % 32);
                let q = ((qs[32 * (r / 2) + i] >> (4 * (r % 2))) & 0x0F) | (((qh[i] >> r) & 1) << 4);
                *o = (d * sc[r] as f32) * q as f32 - dmin * m[r] as f32;
            }
        }),
        GgmlType::Q6_K => blocks.for_each(|(b, o)| {
            let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = f16_at(b, 208);
            for (e, o) in o.iter_mut().enumerate() {
                let q = q6_value(ql, qh, e);
                *o = (d * (scales[e / 16] as i8) as f32) * (q as i32 - 32) as f32;
            }
        }),
        _ => unreachable!("checked by is_supported"),
    }
    Ok(out)
}

/// The 32 five-bit values of a Q5_0/Q5_1 block: low nibbles (element `i` in byte `i`,
/// element `i + 16` in the high nibble of byte `i`) plus bit `i` of the u32 `qh`.
fn q5_values(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut q = [0u8; 32];
    for i in 0..16 {
        q[i] = (qs[i] & 0x0F) | ((((qh >> i) & 1) as u8) << 4);
        q[i + 16] = (qs[i] >> 4) | ((((qh >> (i + 16)) & 1) as u8) << 4);
    }
    q
}

/// The six-bit scales and mins of a Q4_K/Q5_K super-block (12 packed bytes).
fn k_scale_min(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 0x3F;
        m[j] = s[4 + j] & 0x3F;
        sc[j + 4] = (s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30);
        m[j + 4] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
    (sc, m)
}

/// Element `e` (0..256) of a Q6_K super-block, unsigned (0..64).
fn q6_value(ql: &[u8], qh: &[u8], e: usize) -> u8 {
    let (r, i) = (e / 32, e % 32);
    let (a, b) = (r / 4, (r % 4) / 2);
    let lo = (ql[64 * a + (r % 2) * 32 + i] >> (4 * b)) & 0x0F;
    let hi = (qh[32 * a + i] >> (2 * (r % 4))) & 0x03;
    lo | (hi << 4)
}

/// A matrix in MLX's affine layout (`mlx.core.quantize` with `mode="affine"`): row `r`
/// element `c` is `scales[r, c / group_size] * q + biases[r, c / group_size]`, with the
/// `bits`-bit values `q` packed as a little-endian bit stream into u32 words.
#[derive(Debug, Clone, PartialEq)]
pub struct Affine {
    /// Bits per element (4, 5 or 8 here).
    pub bits: u32,
    /// Elements per scale/bias group (32 here).
    pub group_size: u32,
    /// Packed values, `[rows, cols * bits / 32]` row-major.
    pub weight: Vec<u32>,
    /// Scales, `[rows, cols / group_size]` row-major, exact in f32.
    pub scales: Vec<f32>,
    /// Biases, `[rows, cols / group_size]` row-major, exact in f32.
    pub biases: Vec<f32>,
}

/// Whether [`to_affine`] converts `ty`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K (the
/// types with one scale and offset per 32 elements and a `2^bits`-level integer grid).
/// Q2_K, Q3_K and Q6_K have 16-element sub-blocks, which MLX's group sizes cannot hold.
pub fn affine_compatible(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q4_K
            | GgmlType::Q5_K
    )
}

/// Converts `data` (a `[rows, cols]` tensor of `ty`) to MLX's affine layout, group size
/// 32, without changing any value: Q4_0 -> 4 bits, `bias = -8 d`; Q4_1 -> 4 bits,
/// `bias = m`; Q5_0 -> 5 bits, `bias = -16 d`; Q5_1 -> 5 bits; Q8_0 -> 8 bits,
/// `q + 128`, `bias = -128 d`; Q4_K/Q5_K -> 4/5 bits, `scale = d * sc`,
/// `bias = -dmin * m` per 32-element sub-block (products of an f16 and a 6-bit integer,
/// exact in f32). For Q4_0/Q4_1/Q8_0 this is what MLX's own GGUF loader returns.
///
/// Returns `None` when the type is not [`affine_compatible`].
///
/// # Errors
/// [`Error::Invalid`] (op `gguf to_affine`) when `cols` is not a multiple of the block size
/// or `data` does not hold `rows * cols` elements of `ty`.
pub fn to_affine(ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> Result<Option<Affine>> {
    if !affine_compatible(ty) {
        return Ok(None);
    }
    let (bs, ts) = ty.block().expect("known type");
    let holds = rows.checked_mul(cols).map(|n| n / bs * ts);
    if !cols.is_multiple_of(bs) || holds != Some(data.len()) {
        return Err(invalid(
            "gguf to_affine",
            format!("{} bytes do not hold a [{rows}, {cols}] {ty} tensor", data.len()),
        ));
    }
    let bits: u32 = match ty {
        GgmlType::Q8_0 => 8,
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5_K => 5,
        _ => 4,
    };
    let groups = rows * cols / 32;
    let mut q = vec![0u8; rows * cols];
    let mut scales = vec![0f32; groups];
    let mut biases = vec![0f32; groups];
    let per_block = bs / 32;
    for (((b, q), s), z) in data
        .chunks_exact(ts)
        .zip(q.chunks_exact_mut(bs))
        .zip(scales.chunks_exact_mut(per_block))
        .zip(biases.chunks_exact_mut(per_block))
    {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let off = if ty == GgmlType::Q4_0 { 2 } else { 4 };
                for i in 0..16 {
                    q[i] = b[off + i] & 0x0F;
                    q[i + 16] = b[off + i] >> 4;
                }
                s[0] = f16_at(b, 0);
                z[0] = if ty == GgmlType::Q4_0 { -8.0 * s[0] } else { f16_at(b, 2) };
            }
            GgmlType::Q5_0 => {
                q.copy_from_slice(&q5_values(&b[2..6], &b[6..22]));
                s[0] = f16_at(b, 0);
                z[0] = -16.0 * s[0];
            }
            GgmlType::Q5_1 => {
                q.copy_from_slice(&q5_values(&b[4..8], &b[8..24]));
                s[0] = f16_at(b, 0);
                z[0] = f16_at(b, 2);
            }
            GgmlType::Q8_0 => {
                for i in 0..32 {
                    q[i] = (b[2 + i] as i8 as i16 + 128) as u8;
                }
                s[0] = f16_at(b, 0);
                z[0] = -128.0 * s[0];
            }
            GgmlType::Q4_K | GgmlType::Q5_K => {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let (sc, m) = k_scale_min(&b[4..16]);
                for r in 0..8 {
                    s[r] = d * sc[r] as f32;
                    z[r] = -(dmin * m[r] as f32);
                }
                for (e, q) in q.iter_mut().enumerate() {
                    let (r, i) = (e / 32, e % 32);
                    *q = if ty == GgmlType::Q4_K {
                        (b[16 + 32 * (r / 2) + i] >> (4 * (r % 2))) & 0x0F
                    } else {
                        ((b[48 + 32 * (r / 2) + i] >> (4 * (r % 2))) & 0x0F) | (((b[16 + i] >> r) & 1) << 4)
                    };
                }
            }
            _ => unreachable!("checked by affine_compatible"),
        }
    }
    Ok(Some(Affine { bits, group_size: 32, weight: pack_rows(&q, rows, cols, bits), scales, biases }))
}

/// Packs `bits`-bit values (row-major `[rows, cols]`, `cols * bits` a multiple of 32) into
/// MLX's layout: each row a little-endian bit stream of u32 words.
fn pack_rows(q: &[u8], rows: usize, cols: usize, bits: u32) -> Vec<u32> {
    let words_per_row = cols * bits as usize / 32;
    let mut out = vec![0u32; rows * words_per_row];
    if words_per_row == 0 {
        return out;
    }
    for (row_q, row_w) in q.chunks_exact(cols).zip(out.chunks_exact_mut(words_per_row)) {
        let mut bit = 0usize;
        for &v in row_q {
            let (w, o) = (bit / 32, bit % 32);
            row_w[w] |= (v as u32) << o;
            if o + bits as usize > 32 {
                row_w[w + 1] |= (v as u32) >> (32 - o);
            }
            bit += bits as usize;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_rows_is_an_lsb_first_bit_stream() {
        let q: Vec<u8> = (0..64u32).map(|i| ((i * 7 + 3) % 32) as u8).collect();
        let packed = pack_rows(&q, 2, 32, 5);
        assert_eq!(packed.len(), 10);
        // Each row is exactly 5 words, so the whole buffer is one bit stream.
        for (e, want) in q.iter().enumerate() {
            let bit = e * 5;
            let lo = packed[bit / 32] as u64;
            let hi = packed.get(bit / 32 + 1).copied().unwrap_or(0) as u64;
            assert_eq!(((lo | hi << 32) >> (bit % 32)) & 31, *want as u64, "element {e}");
        }
    }

    #[test]
    fn type_table() {
        assert_eq!(GgmlType::Q4_K.name(), "Q4_K");
        assert_eq!(GgmlType(99).name(), "type 99");
        assert_eq!(GgmlType::Q6_K.block(), Some((256, 210)));
        assert_eq!(GgmlType::Q8_0.bytes_for(64), Some(68));
        assert_eq!(GgmlType::Q8_0.bytes_for(48), None);
        assert!(GgmlType(20).is_known() && !GgmlType(20).is_supported());
    }

    #[test]
    fn q8_0_affine_matches_dequantize() {
        let mut block = vec![0u8; 34];
        block[..2].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        for i in 0..32 {
            block[2 + i] = (i as i8 - 16) as u8;
        }
        let a = to_affine(GgmlType::Q8_0, &block, 1, 32).unwrap().unwrap();
        let d = dequantize(GgmlType::Q8_0, &block).unwrap();
        for (c, want) in d.iter().enumerate() {
            let q = (a.weight[c / 4] >> (8 * (c % 4))) & 0xFF;
            assert_eq!(a.scales[0] * q as f32 + a.biases[0], *want);
        }
    }
}
