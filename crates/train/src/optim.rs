//! AdamW with f32 master weights, and gradient clipping by global norm.
use std::path::Path;

use mlx_core::{Array, Dtype, io};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// AdamW's hyper-parameters (`torch.optim.AdamW`'s names and defaults, except
/// `weight_decay`, which DeepSpec sets to 0 for drafters).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Decay rate of the first moment (0.9).
    pub beta1: f64,
    /// Decay rate of the second moment (0.999).
    pub beta2: f64,
    /// Added to the bias-corrected root second moment (1e-8).
    pub eps: f64,
    /// Decoupled weight decay per unit of learning rate (0.0).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }
}

impl AdamWConfig {
    fn check(&self) -> Result<()> {
        let bad = |setting, message: String| Err(Error::Config { setting, message });
        for (setting, beta) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return bad(setting, format!("expected a value in [0, 1), found {beta}"));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad("eps", format!("expected a positive value, found {}", self.eps));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("weight_decay", format!("expected a value >= 0, found {}", self.weight_decay));
        }
        Ok(())
    }
}

/// AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", Algorithm 2) over
/// named parameters, with f32 master weights: DeepSpec's `BF16Optimizer`
/// (`deepspec/utils/optim.py`) around `torch.optim.AdamW`, whose update it reproduces step
/// for step (`crates/train/tests/optim.rs` replays a trajectory of DeepSpec's code).
///
/// Per step `t` (from 1), learning rate `lr`, f32 gradient `g` (the model's gradient cast):
/// `p <- p (1 - lr wd)`, `m <- m + (1 - b1)(g - m)`, `v <- b2 v + (1 - b2) g^2`,
/// `p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`; the model's parameter is
/// then `p` cast to its dtype.
///
/// The state lives in host memory and the update runs as one pass over each parameter's
/// values, split over the cores: as a chain of MLX ops (one single-threaded pass and one
/// allocation per op) it took about half of a SmolLM2 drafter's training step.
#[derive(Debug)]
pub struct AdamW {
    config: AdamWConfig,
    names: Vec<String>,
    dtypes: Vec<Dtype>,
    shapes: Vec<Vec<i32>>,
    step: u64,
    master: Vec<Vec<f32>>,
    exp_avg: Vec<Vec<f32>>,
    exp_avg_sq: Vec<Vec<f32>>,
}

const FORMAT: &str = "mlx-spec-adamw-v1";

impl AdamW {
    /// An optimizer at step 0 for `params` (any float dtype), named by `names` (the
    /// checkpoint's tensor names); master weights are f32 copies, moments zeros.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad `config`; [`Error::Parameter`] when the counts differ, a
    /// name repeats, or a parameter is not floating point.
    pub fn new(config: AdamWConfig, names: &[String], params: &[Array]) -> Result<Self> {
        config.check()?;
        if names.len() != params.len() {
            return Err(Error::Parameter {
                name: format!("#{}", names.len().min(params.len())),
                message: format!("{} names for {} parameters", names.len(), params.len()),
            });
        }
        let mut seen = std::collections::HashSet::new();
        for (name, p) in names.iter().zip(params) {
            if !seen.insert(name) {
                return Err(Error::Parameter { name: name.clone(), message: "named twice".into() });
            }
            if !matches!(p.dtype(), Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16) {
                let message = format!("expected a floating-point parameter, found {}", p.dtype());
                return Err(Error::Parameter { name: name.clone(), message });
            }
        }
        let master = params.iter().map(host_f32).collect::<Result<Vec<_>>>()?;
        let zeros = || master.iter().map(|p| vec![0f32; p.len()]).collect::<Vec<_>>();
        Ok(Self {
            config,
            names: names.to_vec(),
            dtypes: params.iter().map(Array::dtype).collect(),
            shapes: params.iter().map(Array::shape).collect(),
            step: 0,
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
            master,
        })
    }

    /// Applies one update with learning rate `lr` and returns the new parameters in their
    /// original dtypes (evaluated). `grads` are in parameter order, each of its parameter's
    /// shape, any float dtype.
    ///
    /// # Errors
    /// [`Error::Parameter`] when a gradient's count or shape does not match; [`Error::Config`]
    /// for a negative or non-finite `lr`.
    pub fn step(&mut self, grads: &[Array], lr: f64) -> Result<Vec<Array>> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(Error::Config { setting: "lr", message: format!("expected a value >= 0, found {lr}") });
        }
        self.check_like(grads, "gradient")?;
        let grads = grads.iter().map(host_f32).collect::<Result<Vec<_>>>()?;
        self.step += 1;
        let c = self.config;
        let t = self.step as f64;
        let step_size = lr / (1.0 - c.beta1.powf(t));
        let bias_correction2_sqrt = (1.0 - c.beta2.powf(t)).sqrt();
        let k = Coefficients {
            decay: (1.0 - lr * c.weight_decay) as f32,
            b1c: (1.0 - c.beta1) as f32,
            b2: c.beta2 as f32,
            b2c: (1.0 - c.beta2) as f32,
            neg_step: -step_size as f32,
            bc2: bias_correction2_sqrt as f32,
            eps: c.eps as f32,
        };
        // Each parameter's values in one contiguous share per core.
        let threads = std::thread::available_parallelism().map_or(1, usize::from);
        let mut shares: Vec<Vec<Share<'_>>> = (0..threads).map(|_| Vec::new()).collect();
        for (((p, m), v), g) in self.master.iter_mut().zip(&mut self.exp_avg).zip(&mut self.exp_avg_sq).zip(&grads) {
            let len = p.len().div_ceil(threads).max(1);
            for (t, (((p, m), v), g)) in
                p.chunks_mut(len).zip(m.chunks_mut(len)).zip(v.chunks_mut(len)).zip(g.chunks(len)).enumerate()
            {
                shares[t].push((p, m, v, g));
            }
        }
        std::thread::scope(|scope| {
            for share in shares {
                scope.spawn(move || share.into_iter().for_each(|(p, m, v, g)| k.update(p, m, v, g)));
            }
        });
        self.params()
    }

    /// Optimizer steps taken (0 before the first [`AdamW::step`]).
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// The f32 master weights, in parameter order.
    ///
    /// # Errors
    /// [`Error::Mlx`] when an array cannot be made.
    pub fn master_weights(&self) -> Result<Vec<Array>> {
        self.master.iter().zip(&self.shapes).map(|(p, s)| Ok(Array::from_slice(p, s)?)).collect()
    }

    /// The parameters as the model holds them (master weights cast to each parameter's
    /// dtype): what a checkpoint of the model stores after a resume.
    ///
    /// # Errors
    /// [`Error::Mlx`] when a cast fails.
    pub fn params(&self) -> Result<Vec<Array>> {
        let out = self
            .master_weights()?
            .into_iter()
            .zip(&self.dtypes)
            .map(|(p, &d)| p.astype(d))
            .collect::<mlx_core::Result<Vec<_>>>()?;
        mlx_core::eval(&out.iter().collect::<Vec<_>>())?;
        Ok(out)
    }

    /// Writes the whole state (master weights, moments, step, hyper-parameters, parameter
    /// dtypes) to `path` as safetensors, written beside it and renamed into place.
    ///
    /// # Errors
    /// [`Error::Mlx`] when the file cannot be written (the path is named).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut tensors = Vec::with_capacity(3 * self.names.len());
        for (i, name) in self.names.iter().enumerate() {
            for (kind, values) in
                [("master", &self.master[i]), ("exp_avg", &self.exp_avg[i]), ("exp_avg_sq", &self.exp_avg_sq[i])]
            {
                tensors.push((format!("{kind}.{name}"), Array::from_slice(values, &self.shapes[i])?));
            }
        }
        let header = Header {
            format: FORMAT.into(),
            step: self.step,
            config: self.config,
            names: self.names.clone(),
            dtypes: self.dtypes.iter().map(|d| d.to_string()).collect(),
        };
        let header = serde_json::to_string(&header).expect("the header serializes");
        io::save_safetensors(path, tensors.iter().map(|(k, a)| (k.as_str(), a)), [("adamw", header.as_str())])?;
        Ok(())
    }

    /// Reads a state written by [`AdamW::save`] for the parameters `names` (the same names, in
    /// any order of the file, and shapes equal to `params`' shapes).
    ///
    /// # Errors
    /// [`Error::State`] naming `path` when the file is not an AdamW state of this format, a
    /// tensor is missing or mis-shaped, or it belongs to other parameters (the differing
    /// names are listed); [`Error::Mlx`] when it cannot be read.
    pub fn load(path: &Path, names: &[String], params: &[Array]) -> Result<Self> {
        let file = io::load_safetensors(path)?;
        let bad = |message: String| Error::State { path: path.into(), message };
        let header =
            file.metadata.get("adamw").ok_or_else(|| bad("no `adamw` metadata: not an optimizer state".into()))?;
        let header: Header = serde_json::from_str(header).map_err(|e| bad(format!("`adamw` metadata: {e}")))?;
        if header.format != FORMAT {
            return Err(bad(format!("format `{}`, expected `{FORMAT}`", header.format)));
        }
        if header.names != names {
            let missing: Vec<_> = names.iter().filter(|n| !header.names.contains(n)).collect();
            let extra: Vec<_> = header.names.iter().filter(|n| !names.contains(n)).collect();
            return Err(bad(format!(
                "saved for other parameters (missing here: {missing:?}; not in the model: {extra:?}; or another order)"
            )));
        }
        let mut opt = Self::new(header.config, names, params)?;
        opt.step = header.step;
        for (i, name) in names.iter().enumerate() {
            let want = params[i].shape();
            let get = |kind: &str| -> Result<Vec<f32>> {
                let a = file.get(&format!("{kind}.{name}"))?;
                if a.shape() != want || a.dtype() != Dtype::Float32 {
                    let message =
                        format!("`{kind}.{name}`: expected float32 {want:?}, found {} {:?}", a.dtype(), a.shape());
                    return Err(bad(message));
                }
                Ok(a.to_vec::<f32>()?)
            };
            (opt.master[i], opt.exp_avg[i], opt.exp_avg_sq[i]) = (get("master")?, get("exp_avg")?, get("exp_avg_sq")?);
        }
        Ok(opt)
    }

    fn check_like(&self, arrays: &[Array], what: &str) -> Result<()> {
        if arrays.len() != self.master.len() {
            return Err(Error::Parameter {
                name: format!("#{}", arrays.len().min(self.master.len())),
                message: format!("{} {what}s for {} parameters", arrays.len(), self.master.len()),
            });
        }
        for ((a, shape), name) in arrays.iter().zip(&self.shapes).zip(&self.names) {
            if a.shape() != *shape {
                let message = format!("{what} of shape {:?}, expected {shape:?}", a.shape());
                return Err(Error::Parameter { name: name.clone(), message });
            }
        }
        Ok(())
    }
}

/// One core's share of a parameter: master values, first and second moments, gradient.
type Share<'a> = (&'a mut [f32], &'a mut [f32], &'a mut [f32], &'a [f32]);

/// A step's scalars, f32 as the update computes in f32.
#[derive(Clone, Copy)]
struct Coefficients {
    decay: f32,
    b1c: f32,
    b2: f32,
    b2c: f32,
    neg_step: f32,
    bc2: f32,
    eps: f32,
}

impl Coefficients {
    /// The update of [`AdamW::step`], element by element, as `torch.optim.AdamW` orders its
    /// f32 operations (`lerp` for the first moment; no fused multiply-adds).
    fn update(&self, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
        for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
            let decayed = *p * self.decay;
            *m += (g - *m) * self.b1c;
            *v = *v * self.b2 + g * g * self.b2c;
            let denom = v.sqrt() / self.bc2 + self.eps;
            *p = decayed + *m / denom * self.neg_step;
        }
    }
}

/// `a`'s values as host f32.
fn host_f32(a: &Array) -> Result<Vec<f32>> {
    Ok(a.astype(Dtype::Float32)?.to_vec::<f32>()?)
}

#[derive(Serialize, Deserialize)]
struct Header {
    format: String,
    step: u64,
    config: AdamWConfig,
    names: Vec<String>,
    dtypes: Vec<String>,
}

/// Scales `grads` together so that their global L2 norm is at most `max_norm`, and returns
/// them with the norm before clipping: FSDP's `clip_grad_norm_` (the norm of each gradient and
/// of those norms in f32, `coef = min(1, max_norm / (norm + 1e-6))`, each gradient multiplied
/// by `coef` cast to its dtype), as DeepSpec's trainer calls it with `max_grad_norm` 1.0.
///
/// # Errors
/// [`Error::Config`] for a non-positive `max_norm`; [`Error::Mlx`] when an op fails.
pub fn clip_grad_norm(grads: &[Array], max_norm: f64) -> Result<(Vec<Array>, f64)> {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return Err(Error::Config { setting: "max_grad_norm", message: format!("expected > 0, found {max_norm}") });
    }
    let norms = grads
        .iter()
        .map(|g| g.astype(Dtype::Float32)?.square()?.sum(&[], false)?.sqrt())
        .collect::<mlx_core::Result<Vec<_>>>()?;
    let total = mlx_core::stack(&norms.iter().collect::<Vec<_>>(), 0)?.square()?.sum(&[], false)?.sqrt()?;
    let coef =
        Array::scalar(max_norm as f32).divide(&total.add(&Array::scalar(1e-6))?)?.minimum(&Array::scalar(1.0))?;
    let clipped = grads.iter().map(|g| g.multiply(&coef.astype(g.dtype())?)).collect::<mlx_core::Result<Vec<_>>>()?;
    mlx_core::eval(&clipped.iter().chain([&total]).collect::<Vec<_>>())?;
    Ok((clipped, total.item()?))
}
