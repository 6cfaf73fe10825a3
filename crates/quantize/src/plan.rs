//! Which tensors are quantized: the shape-eligibility rule, and the grouping of a source
//! directory's tensors into modules (dense or already quantized) and pass-through tensors.
use std::collections::BTreeMap;
use std::path::Path;

use mlx_core::quant::QuantSpec;
use safetensors::Dtype as StDtype;

use crate::config::SourceQuantization;
use crate::st::{TensorRef, mlx_dtype};
use crate::{Error, Result};

/// The verdict of the shape rule on one tensor (see [`eligibility`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eligibility {
    /// `<base>.weight`, exactly 2-D, last dimension divisible by the group size: quantized
    /// (unless the predicate says otherwise).
    Eligible,
    /// The name does not end in `.weight` (biases, norms' other parameters, buffers).
    NotWeight,
    /// A `.weight` that is not 2-D (1-D norm scales, 3-D+ stacked experts or convolutions).
    NotMatrix {
        /// Its number of dimensions.
        ndim: usize,
    },
    /// A 2-D `.weight` whose last dimension is not a multiple of the group size.
    NotDivisible {
        /// Its last dimension.
        last: usize,
        /// The group size.
        group_size: usize,
    },
}

impl Eligibility {
    /// Whether the tensor is quantized by the rule.
    pub fn is_eligible(self) -> bool {
        self == Eligibility::Eligible
    }
}

/// The shape-eligibility rule (mlx-bun's `isQuantizable`, the seed of this quantizer): a
/// tensor named `<base>.weight` that is exactly 2-D (`[out, in]`) with `in % group_size == 0`
/// is quantized; everything else passes through unchanged. Embeddings (`[vocab, hidden]`) and
/// an untied `lm_head` are eligible like any linear layer. The first dimension is never
/// checked. `shape` is the logical (unpacked) shape.
pub fn eligibility(name: &str, shape: &[usize], group_size: usize) -> Eligibility {
    if !name.ends_with(".weight") || name.len() == ".weight".len() {
        return Eligibility::NotWeight;
    }
    if shape.len() != 2 {
        return Eligibility::NotMatrix { ndim: shape.len() };
    }
    let last = shape[1];
    if group_size == 0 || !last.is_multiple_of(group_size) {
        return Eligibility::NotDivisible { last, group_size };
    }
    Eligibility::Eligible
}

/// A borrowed predicate `(base, shape) -> keep quantizing?`.
pub(crate) type PredicateRef<'a> = Option<&'a dyn Fn(&str, &[usize]) -> bool>;

/// Where a module's weight comes from.
#[derive(Debug, Clone)]
pub(crate) enum Source {
    /// A float `<base>.weight`.
    Dense(TensorRef),
    /// An MLX affine triple, dequantized with the source's own spec before anything else.
    Quantized { weight: TensorRef, scales: TensorRef, biases: TensorRef, spec: QuantSpec },
}

/// What happens to a module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Quantized with the requested spec.
    Quantize,
    /// Eligible, but the predicate kept it in full precision (`"<base>": false` in the config).
    FullPrecision,
    /// Not eligible by shape: written unchanged (dequantized when the source was quantized).
    Ineligible,
    /// Not a module at all: a tensor copied byte for byte.
    PassThrough,
}

/// One unit of work: a module (one `.weight`, perhaps with `.scales`/`.biases`) or a
/// pass-through tensor.
#[derive(Debug, Clone)]
pub(crate) enum Item {
    Pass(TensorRef),
    Module { base: String, source: Box<Source>, shape: Vec<usize>, action: Action },
}

impl Item {
    /// The name shown in progress events: the module base or the tensor name.
    pub(crate) fn label(&self) -> &str {
        match self {
            Item::Pass(t) => &t.name,
            Item::Module { base, .. } => base,
        }
    }

    pub(crate) fn action(&self) -> Action {
        match self {
            Item::Pass(_) => Action::PassThrough,
            Item::Module { action, .. } => *action,
        }
    }

    /// `(file, offset)` of its first source tensor, the processing order (sequential reads).
    pub(crate) fn source_position(&self) -> (usize, u64) {
        match self {
            Item::Pass(t) => (t.file, t.start),
            Item::Module { source, .. } => match source.as_ref() {
                Source::Dense(t) => (t.file, t.start),
                Source::Quantized { weight, .. } => (weight.file, weight.start),
            },
        }
    }
}

fn tensor_err(paths: &[std::path::PathBuf], t: &TensorRef, message: String) -> Error {
    Error::Tensor { path: paths[t.file].clone(), tensor: t.name.clone(), message }
}

/// Dtypes a weight must have to be quantized.
pub(crate) const FLOAT_DTYPES: [StDtype; 3] = [StDtype::F32, StDtype::F16, StDtype::BF16];

/// Groups the tensors of a source directory into items and decides each module's action.
///
/// `predicate(base, shape)` is consulted only for eligible modules. `quant` is the source's
/// own quantization block (for already quantized modules).
pub(crate) fn plan(
    tensors: &BTreeMap<String, TensorRef>,
    paths: &[std::path::PathBuf],
    config_path: &Path,
    quant: &SourceQuantization,
    spec: QuantSpec,
    predicate: PredicateRef<'_>,
) -> Result<Vec<Item>> {
    let mut items = Vec::new();
    let mut consumed: std::collections::BTreeSet<&str> = std::collections::BTreeSet::new();
    // Already-quantized modules: `<base>.scales` beside `<base>.weight` and `<base>.biases`.
    for (name, scales) in tensors {
        let Some(base) = name.strip_suffix(".scales") else { continue };
        let wname = format!("{base}.weight");
        let bname = format!("{base}.biases");
        let Some(weight) = tensors.get(&wname) else {
            return Err(tensor_err(paths, scales, format!("has no `{wname}` beside it")));
        };
        let Some(biases) = tensors.get(&bname) else {
            return Err(tensor_err(
                paths,
                scales,
                format!("has no `{bname}` beside it (only MLX affine quantization, with biases, is supported)"),
            ));
        };
        let Some(qspec) = quant.spec_for(base) else {
            return Err(tensor_err(
                paths,
                weight,
                format!(
                    "is quantized (it has `.scales`) but {} has no quantization entry for `{base}`",
                    config_path.display()
                ),
            ));
        };
        if weight.dtype != StDtype::U32 {
            return Err(tensor_err(paths, weight, format!("quantized weight must be U32, found {:?}", weight.dtype)));
        }
        for t in [scales, biases] {
            if !FLOAT_DTYPES.contains(&t.dtype) {
                return Err(tensor_err(paths, t, format!("expected F32, F16 or BF16, found {:?}", t.dtype)));
            }
        }
        let ws = &weight.shape;
        let ss = &scales.shape;
        let logical_last = ws.last().copied().unwrap_or(0) * 32 / qspec.bits as usize;
        let fits = ws.len() >= 2
            && ss.len() == ws.len()
            && ws[..ws.len() - 1] == ss[..ss.len() - 1]
            && (ws[ws.len() - 1] * 32).is_multiple_of(qspec.bits as usize)
            && logical_last == ss[ss.len() - 1] * qspec.group_size as usize
            && biases.shape == *ss;
        if !fits {
            return Err(tensor_err(
                paths,
                weight,
                format!(
                    "packed shape {ws:?} with scales {ss:?} and biases {:?} does not fit bits {} group size {} from {}",
                    biases.shape,
                    qspec.bits,
                    qspec.group_size,
                    config_path.display()
                ),
            ));
        }
        let mut shape = ws.clone();
        *shape.last_mut().expect("ndim >= 2") = logical_last;
        consumed.extend([name.as_str(), weight.name.as_str(), biases.name.as_str()]);
        let source =
            Source::Quantized { weight: weight.clone(), scales: scales.clone(), biases: biases.clone(), spec: qspec };
        items.push(module(base, source, shape, spec, predicate));
    }
    for (name, t) in tensors {
        if consumed.contains(name.as_str()) {
            continue;
        }
        let el = eligibility(name, &t.shape, spec.group_size as usize);
        if mlx_dtype(t.dtype).is_none() {
            return Err(tensor_err(paths, t, format!("dtype {:?} is not supported (MLX has no such type)", t.dtype)));
        }
        if el.is_eligible() {
            if !FLOAT_DTYPES.contains(&t.dtype) {
                return Err(tensor_err(
                    paths,
                    t,
                    format!(
                        "dtype {:?} is not supported for quantization (expected F32, F16 or BF16; shape {:?})",
                        t.dtype, t.shape
                    ),
                ));
            }
            let base = name.strip_suffix(".weight").expect("eligible names end in .weight");
            items.push(module(base, Source::Dense(t.clone()), t.shape.clone(), spec, predicate));
        } else {
            items.push(Item::Pass(t.clone()));
        }
    }
    items.sort_by_key(Item::source_position);
    Ok(items)
}

fn module(base: &str, source: Source, shape: Vec<usize>, spec: QuantSpec, predicate: PredicateRef<'_>) -> Item {
    let action = if !eligibility(&format!("{base}.weight"), &shape, spec.group_size as usize).is_eligible() {
        Action::Ineligible
    } else if predicate.is_none_or(|p| p(base, &shape)) {
        Action::Quantize
    } else {
        Action::FullPrecision
    };
    Item::Module { base: base.into(), source: Box::new(source), shape, action }
}
