//! Integration tests for `mlx_core::random`: key determinism and splitting, and the
//! statistics of uniform, normal and categorical samples. Every test uses fixed seeds, so
//! the outcomes are deterministic; the statistical bounds are several standard errors wide.

use mlx_core::random::{self, Key};
use mlx_core::*;

fn f32s(a: &Array) -> Vec<f32> {
    a.to_vec::<f32>().unwrap()
}

fn mean_std(v: &[f32]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

#[test]
fn key_is_a_uint32_pair() {
    let k = Key::new(42);
    assert_eq!(k.as_array().dtype(), Dtype::Uint32);
    assert_eq!(k.as_array().shape(), vec![2]);
    assert_eq!(k.as_array().to_vec::<u32>().unwrap(), Key::new(42).as_array().to_vec::<u32>().unwrap());
    assert_ne!(k.as_array().to_vec::<u32>().unwrap(), Key::new(43).as_array().to_vec::<u32>().unwrap());
}

#[test]
fn same_seed_same_numbers_different_seed_different() {
    let draw = |seed: u64| f32s(&random::uniform(0.0, 1.0, &[256], Dtype::Float32, &Key::new(seed)).unwrap());
    let a = draw(7);
    assert_eq!(a, draw(7));
    let b = draw(8);
    let differing = a.iter().zip(&b).filter(|(x, y)| x != y).count();
    assert!(differing > 250, "only {differing} of 256 differ");
    // Reusing one key gives the same numbers again (keys are explicit, not stateful).
    let k = Key::new(99);
    let n1 = f32s(&random::normal(&[64], Dtype::Float32, 0.0, 1.0, &k).unwrap());
    let n2 = f32s(&random::normal(&[64], Dtype::Float32, 0.0, 1.0, &k).unwrap());
    assert_eq!(n1, n2);
    assert_ne!(n1, f32s(&random::normal(&[64], Dtype::Float32, 0.0, 1.0, &Key::new(100)).unwrap()));
    // Samples within one draw are not all equal.
    assert!(a.iter().any(|&x| x != a[0]));
}

#[test]
fn split_gives_distinct_keys() {
    let parent = Key::new(5);
    let keys = parent.split(4).unwrap();
    assert_eq!(keys.len(), 4);
    let mut raw: Vec<Vec<u32>> = keys
        .iter()
        .map(|k| {
            assert_eq!(k.as_array().shape(), vec![2]);
            assert_eq!(k.as_array().dtype(), Dtype::Uint32);
            k.as_array().to_vec::<u32>().unwrap()
        })
        .collect();
    raw.push(parent.as_array().to_vec::<u32>().unwrap());
    for i in 0..raw.len() {
        for j in i + 1..raw.len() {
            assert_ne!(raw[i], raw[j], "keys {i} and {j} are equal");
        }
    }
    // Splitting is deterministic.
    let again: Vec<Vec<u32>> =
        Key::new(5).split(4).unwrap().iter().map(|k| k.as_array().to_vec::<u32>().unwrap()).collect();
    assert_eq!(&raw[..4], &again[..]);
    // Draws from the child keys differ from each other.
    let d0 = f32s(&random::uniform(0.0, 1.0, &[32], Dtype::Float32, &keys[0]).unwrap());
    let d1 = f32s(&random::uniform(0.0, 1.0, &[32], Dtype::Float32, &keys[1]).unwrap());
    assert!(d0.iter().zip(&d1).filter(|(a, b)| a != b).count() > 30);
    // A split of 1 still gives a key different from the parent; a negative count is an error.
    assert_eq!(parent.split(1).unwrap().len(), 1);
    assert!(parent.split(-1).is_err());
}

#[test]
fn uniform_in_range_with_mean_near_half() {
    let u = random::uniform(0.0, 1.0, &[100, 100], Dtype::Float32, &Key::new(1)).unwrap();
    assert_eq!(u.shape(), vec![100, 100]);
    assert_eq!(u.dtype(), Dtype::Float32);
    let v = f32s(&u);
    assert!(v.iter().all(|&x| (0.0..1.0).contains(&x)));
    let (mean, std) = mean_std(&v);
    // Standard error of the mean: sqrt(1/12) / 100 = 0.0029.
    assert!((mean - 0.5).abs() < 0.015, "mean {mean}");
    assert!((std - (1.0f64 / 12.0).sqrt()).abs() < 0.01, "std {std}");
    // Both halves of the range are populated about equally.
    let low = v.iter().filter(|&&x| x < 0.5).count();
    assert!((4800..5200).contains(&low), "{low} of 10000 below 0.5");

    // A shifted range.
    let v = f32s(&random::uniform(-3.0, 5.0, &[10_000], Dtype::Float32, &Key::new(2)).unwrap());
    assert!(v.iter().all(|&x| (-3.0..5.0).contains(&x)));
    let (mean, _) = mean_std(&v);
    assert!((mean - 1.0).abs() < 0.12, "mean {mean}");
    let (lo, hi) = v.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    assert!(lo < -2.9 && hi > 4.9, "range [{lo}, {hi}]");

    // Other float dtypes; an integer dtype is an error.
    let h = random::uniform(0.0, 1.0, &[16], Dtype::Bfloat16, &Key::new(3)).unwrap();
    assert_eq!(h.dtype(), Dtype::Bfloat16);
    assert!(f32s(&h.astype(Dtype::Float32).unwrap()).iter().all(|&x| (0.0..=1.0).contains(&x)));
    assert!(random::uniform(0.0, 1.0, &[4], Dtype::Int32, &Key::new(3)).is_err());
}

#[test]
fn normal_mean_and_std() {
    let v = f32s(&random::normal(&[10_000], Dtype::Float32, 0.0, 1.0, &Key::new(11)).unwrap());
    let (mean, std) = mean_std(&v);
    // Standard errors: 0.01 for the mean, about 0.007 for the std.
    assert!(mean.abs() < 0.04, "mean {mean}");
    assert!((std - 1.0).abs() < 0.03, "std {std}");
    // About 68% within one standard deviation.
    let within = v.iter().filter(|&&x| x.abs() < 1.0).count() as f64 / 1e4;
    assert!((within - 0.6827).abs() < 0.02, "within one std: {within}");

    let n = random::normal(&[100, 100], Dtype::Float32, 3.0, 2.0, &Key::new(12)).unwrap();
    assert_eq!(n.shape(), vec![100, 100]);
    let (mean, std) = mean_std(&f32s(&n));
    assert!((mean - 3.0).abs() < 0.08, "mean {mean}");
    assert!((std - 2.0).abs() < 0.06, "std {std}");

    let h = random::normal(&[8], Dtype::Float16, -1.0, 0.5, &Key::new(13)).unwrap();
    assert_eq!(h.dtype(), Dtype::Float16);
}

#[test]
fn categorical_picks_a_dominant_logit() {
    // One huge entry (index 2) among 5: every draw picks it.
    let row = [0.0f32, 1.0, 100.0, -3.0, 2.0];
    let logits = Array::from_slice(&row, &[1, 5]).unwrap().broadcast_to(&[64, 5]).unwrap();
    for seed in 0..5 {
        let s = random::categorical(&logits, -1, &Key::new(seed)).unwrap();
        assert_eq!(s.dtype(), Dtype::Uint32);
        assert_eq!(s.shape(), vec![64]);
        assert_eq!(s.to_vec::<u32>().unwrap(), vec![2; 64]);
    }
    // Along axis 0 of the transposed logits: shape [64].
    let s = random::categorical(&logits.t().unwrap(), 0, &Key::new(9)).unwrap();
    assert_eq!(s.to_vec::<u32>().unwrap(), vec![2; 64]);
    // A 1-D logits vector gives a 0-d sample.
    let s = random::categorical(&Array::from_slice(&row, &[5]).unwrap(), 0, &Key::new(10)).unwrap();
    assert_eq!(s.ndim(), 0);
    assert_eq!(s.item().unwrap(), 2.0);
    // -inf logits are never drawn.
    let masked = Array::from_slice(&[f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY, 0.0], &[1, 4])
        .unwrap()
        .broadcast_to(&[200, 4])
        .unwrap();
    let s = random::categorical(&masked, 1, &Key::new(4)).unwrap().to_vec::<u32>().unwrap();
    assert!(s.iter().all(|&i| i == 1 || i == 3));
    assert!(s.contains(&1) && s.contains(&3));
}

#[test]
fn categorical_frequencies_match_softmax() {
    // Unnormalized logits; softmax gives p = [0.1, 0.2, 0.3, 0.4] after adding a constant.
    let p = [0.1f64, 0.2, 0.3, 0.4];
    let logits: Vec<f32> = p.iter().map(|&x| (x.ln() + 1.7) as f32).collect();
    let n = 5000;
    let l = Array::from_slice(&logits, &[1, 4]).unwrap().broadcast_to(&[n, 4]).unwrap();
    let s = random::categorical(&l, -1, &Key::new(2024)).unwrap().to_vec::<u32>().unwrap();
    assert_eq!(s.len(), n as usize);
    let mut counts = [0usize; 4];
    for &i in &s {
        counts[i as usize] += 1;
    }
    for (i, (&c, &pi)) in counts.iter().zip(&p).enumerate() {
        let f = c as f64 / n as f64;
        // Standard error at most sqrt(0.24 / 5000) = 0.007.
        assert!((f - pi).abs() < 0.03, "class {i}: frequency {f}, softmax {pi} (counts {counts:?})");
    }
    // Different keys give different sequences with the same statistics.
    let s2 = random::categorical(&l, -1, &Key::new(2025)).unwrap().to_vec::<u32>().unwrap();
    assert_ne!(s, s2);
}

#[test]
fn split_into_zero_keys_is_an_error() {
    let e = mlx_core::random::Key::new(0).split(0).unwrap_err();
    assert!(matches!(e, mlx_core::Error::Invalid { .. }), "{e}");
}
