//! `mlx_core::autograd` against PyTorch's autograd (a committed golden) and against finite
//! differences, plus its error paths.
use std::collections::HashMap;
use std::path::PathBuf;

use mlx_core::fast::{self, AttentionMask, Rope};
use mlx_core::{Array, Dtype, Error, KernelPolicy, autograd, io, random};

const NAMES: [&str; 11] = ["norm", "wq", "wk", "wv", "wo", "wg", "wu", "wd", "lm", "wc", "bc"];
const B: i32 = 2;
const L: i32 = 5;
const NH: i32 = 2;
const NKV: i32 = 1;
const HD: i32 = 4;

fn golden() -> io::Safetensors {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/autograd/golden.safetensors");
    io::load_safetensors(path).unwrap()
}

/// The data side of the golden function (constants for the gradient).
struct Data {
    x: Array,
    mask: Array,
    targets: Array,
    target_probs: Array,
    weights: Array,
}

/// `fixtures/autograd/make_golden.py`'s `forward`, from mlx-core ops, with MLX's own kernels
/// (the CPU kernels have no gradient rule). `detach` stops the gradient through the
/// confidence target c*, as DeepSpec (and the golden) does; without it the loss is the plain
/// function that finite differences see.
fn forward(p: &HashMap<&str, Array>, d: &Data, detach: bool) -> mlx_core::Result<Array> {
    let policy = KernelPolicy::mlx();
    let linear = |x: &Array, w: &str| x.matmul(&p[w].t()?);
    let heads = |x: Array, n: i32| x.reshape(&[B, L, n, HD])?.transpose(&[0, 2, 1, 3]);
    let rope = Rope { dims: HD, traditional: false, base: 10000.0, scale: 1.0, freqs: None };

    let h = fast::rms_norm(&d.x, Some(&p["norm"]), 1e-6, &policy)?;
    let q = rope.apply(&heads(linear(&h, "wq")?, NH)?, 0, &policy)?;
    let k = rope.apply(&heads(linear(&h, "wk")?, NKV)?, 0, &policy)?;
    let v = heads(linear(&h, "wv")?, NKV)?;
    let a = fast::scaled_dot_product_attention(&q, &k, &v, 0.5, AttentionMask::Array(&d.mask), &policy)?;
    let o = linear(&a.transpose(&[0, 2, 1, 3])?.reshape(&[B, L, NH * HD])?, "wo")?.add(&d.x)?;
    let gate = linear(&o, "wg")?;
    let m = o.add(&linear(&gate.multiply(&gate.sigmoid()?)?.multiply(&linear(&o, "wu")?)?, "wd")?)?;
    let logits = linear(&m, "lm")?;
    let conf = linear(&m, "wc")?.squeeze(&[-1])?.add(&p["bc"])?;

    let ce = logits
        .logsumexp(&[-1], false)?
        .subtract(&logits.take_along_axis(&d.targets.expand_dims(&[-1])?, -1)?.squeeze(&[-1])?)?;
    let tv = logits.softmax(&[-1], true)?.subtract(&d.target_probs)?.abs()?.sum(&[-1], false)?;
    let one = Array::scalar(1.0);
    let c_star = one.subtract(&tv.multiply(&Array::scalar(0.5))?)?.clip(Some(&Array::scalar(0.0)), Some(&one))?;
    let c_star = if detach { c_star.stop_gradient()? } else { c_star };
    // binary cross entropy with logits: max(z, 0) - z c + log(1 + e^-|z|)
    let bce = conf
        .maximum(&Array::scalar(0.0))?
        .subtract(&conf.multiply(&c_star)?)?
        .add(&conf.abs()?.negative()?.exp()?.log1p()?)?;
    let weighted = |t: &Array| t.multiply(&d.weights)?.sum(&[], false);
    let den = d.weights.sum(&[], false)?;
    let total = weighted(&ce)?
        .multiply(&Array::scalar(0.1))?
        .add(&weighted(&tv)?.multiply(&Array::scalar(0.9))?)?
        .add(&weighted(&bce)?)?;
    total.divide(&den)
}

fn data(g: &io::Safetensors) -> Data {
    Data {
        x: g.get("x").unwrap().clone(),
        mask: g.get("mask").unwrap().astype(Dtype::Bool).unwrap(),
        targets: g.get("targets").unwrap().clone(),
        target_probs: g.get("target_probs").unwrap().clone(),
        weights: g.get("weights").unwrap().clone(),
    }
}

/// The golden's data and parameters, and the loss's gradients at them (`detach`: as
/// [`forward`]).
fn golden_grads(g: &io::Safetensors, detach: bool) -> (Data, Vec<Array>, Array, Vec<Array>) {
    let d = data(g);
    let params: Vec<Array> = NAMES.iter().map(|n| g.get(&format!("param.{n}")).unwrap().clone()).collect();
    let (loss, grads) = autograd::value_and_grad(|p| forward(&params_map(p), &d, detach), &params).unwrap();
    (d, params, loss, grads)
}

fn params_map(values: &[Array]) -> HashMap<&'static str, Array> {
    NAMES.iter().copied().zip(values.iter().cloned()).collect()
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn value_and_grad_matches_pytorch_on_a_transformer_block_with_the_dspark_loss() {
    let g = golden();
    let (_, _, loss, grads) = golden_grads(&g, true);
    let want = g.get("loss").unwrap().to_vec::<f32>().unwrap()[0];
    let got = loss.item().unwrap() as f32;
    assert!((got - want).abs() <= 1e-5 * want.abs(), "loss {got} vs PyTorch {want}");
    assert_eq!(grads.len(), NAMES.len());
    for (name, grad) in NAMES.iter().zip(&grads) {
        let want = g.get(&format!("grad.{name}")).unwrap();
        assert_eq!(grad.shape(), want.shape(), "gradient of {name}");
        assert_eq!(grad.dtype(), Dtype::Float32);
        let diff = max_rel_diff(&grad.to_vec::<f32>().unwrap(), &want.to_vec::<f32>().unwrap());
        assert!(diff < 2e-5, "gradient of {name}: max |diff| {diff} of its largest entry");
    }
}

/// Central differences along a random direction `u` of every parameter at once:
/// (f(p + h u) - f(p - h u)) / 2h against Σ <grad_i, u_i>.
#[test]
fn gradients_match_central_differences() {
    let g = golden();
    let (d, params, _, grads) = golden_grads(&g, false);
    let key = random::Key::new(3);
    let keys = key.split(NAMES.len() as i32).unwrap();
    let dirs: Vec<Array> = params
        .iter()
        .zip(&keys)
        .map(|(p, k)| random::normal(&p.shape(), Dtype::Float32, 0.0, 1.0, k).unwrap())
        .collect();
    let shifted = |h: f32| -> f64 {
        let moved: Vec<Array> =
            params.iter().zip(&dirs).map(|(p, u)| p.add(&u.multiply(&Array::scalar(h)).unwrap()).unwrap()).collect();
        forward(&params_map(&moved), &d, false).unwrap().item().unwrap()
    };
    let h = 1e-3f32;
    let numeric = (shifted(h) - shifted(-h)) / (2.0 * f64::from(h));
    let analytic: f64 =
        grads.iter().zip(&dirs).map(|(g, u)| g.multiply(u).unwrap().sum(&[], false).unwrap().item().unwrap()).sum();
    assert!(
        (numeric - analytic).abs() <= 2e-3 * analytic.abs().max(1.0),
        "directional derivative: finite differences {numeric}, autograd {analytic}"
    );
}

#[test]
fn vjp_takes_one_cotangent_per_output_and_stop_gradient_blocks() {
    let x = Array::from_slice(&[1f32, 2., 3.], &[3]).unwrap();
    let y = Array::from_slice(&[0.5f32, -1., 2.], &[3]).unwrap();
    // f(x, y) = (x * y, x + stop_gradient(y)); cotangents (1, 1, 1) and (2, 2, 2).
    let (outs, grads) = autograd::vjp(
        |p| -> mlx_core::Result<Vec<Array>> { Ok(vec![p[0].multiply(&p[1])?, p[0].add(&p[1].stop_gradient()?)?]) },
        &[x, y],
        &[Array::ones(&[3], Dtype::Float32).unwrap(), Array::full(&[3], 2.0, Dtype::Float32).unwrap()],
    )
    .unwrap();
    assert_eq!(outs[0].to_vec::<f32>().unwrap(), vec![0.5, -2., 6.]);
    assert_eq!(outs[1].to_vec::<f32>().unwrap(), vec![1.5, 1., 5.]);
    assert_eq!(grads[0].to_vec::<f32>().unwrap(), vec![2.5, 1., 4.]); // y + 2
    assert_eq!(grads[1].to_vec::<f32>().unwrap(), vec![1., 2., 3.]); // x, nothing through stop_gradient
}

#[test]
fn bf16_loss_comes_back_as_f32_with_bf16_gradients() {
    let w = Array::from_slice(&[1f32, -2., 3.], &[3]).unwrap().astype(Dtype::Bfloat16).unwrap();
    let (loss, grads) = autograd::value_and_grad(|p| p[0].square()?.sum(&[], false), &[w]).unwrap();
    assert_eq!(loss.dtype(), Dtype::Float32);
    assert_eq!(loss.item().unwrap(), 14.0);
    assert_eq!(grads[0].dtype(), Dtype::Bfloat16);
    assert_eq!(grads[0].astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap(), vec![2., -4., 6.]);
}

#[test]
fn errors_are_typed_and_named() {
    let w = Array::from_slice(&[1f32, 2.], &[2]).unwrap();
    // The closure's own error comes back unchanged.
    let err = autograd::value_and_grad(|p| p[0].reshape(&[3]), std::slice::from_ref(&w)).unwrap_err();
    assert!(matches!(err, Error::Mlx { op: "reshape", .. }), "{err}");
    // A non-scalar loss is named with its shape.
    let err = autograd::value_and_grad(|p| p[0].square(), std::slice::from_ref(&w)).unwrap_err();
    assert!(matches!(err, Error::Invalid { op: "value_and_grad", .. }) && err.to_string().contains("[2]"), "{err}");
    // A panic inside the closure is an error, not an abort.
    let err = autograd::value_and_grad(|_| -> mlx_core::Result<Array> { panic!("boom") }, std::slice::from_ref(&w))
        .unwrap_err();
    assert!(err.to_string().contains("panicked"), "{err}");
    // A cotangent that does not match the output is MLX's error, under `vjp`.
    let err =
        autograd::vjp(|p| Ok(vec![p[0].clone()]), std::slice::from_ref(&w), &[Array::scalar(1.0), Array::scalar(1.0)])
            .unwrap_err();
    assert!(matches!(err, Error::Mlx { op: "vjp", .. }), "{err}");
}
