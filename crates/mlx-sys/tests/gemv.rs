//! The BLAS switch's matrix-vector rewrite (`src/blas.cc`, `route_gemv`): `cblas_sgemm` calls
//! with `M = 1` or `N = 1` are answered by one `cblas_sgemv`. Every order / transpose /
//! leading-dimension combination is checked against a naive f64 product, for each provider
//! this machine has, with the rewrite on and off.
#![allow(unsafe_code)] // calls the C symbol the shim defines; mlx-sys is the FFI crate

use mlx_sys::ffi;
use proptest::prelude::*;

unsafe extern "C" {
    fn cblas_sgemm(
        order: i32,
        ta: i32,
        tb: i32,
        m: i32,
        n: i32,
        k: i32,
        alpha: f32,
        a: *const f32,
        lda: i32,
        b: *const f32,
        ldb: i32,
        beta: f32,
        c: *mut f32,
        ldc: i32,
    );
}

const ROW: i32 = 101;
const COL: i32 = 102;
const NO: i32 = 111;
const TR: i32 = 112;

#[derive(Debug, Clone)]
struct Case {
    order: i32,
    ta: i32,
    tb: i32,
    m: usize,
    n: usize,
    k: usize,
    pad: [usize; 3],
    alpha: f32,
    beta: f32,
    seed: u64,
}

/// Element (r, c) of a matrix stored with leading dimension `ld` in `order`.
fn at(v: &[f32], order: i32, ld: usize, r: usize, c: usize) -> f32 {
    if order == ROW { v[r * ld + c] } else { v[c * ld + r] }
}

fn fill(len: usize, seed: &mut u64) -> Vec<f32> {
    (0..len)
        .map(|_| {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Runs the case through the switch and checks every element of C (padding included).
fn check(c: &Case) -> Result<(), TestCaseError> {
    let (m, n, k) = (c.m, c.n, c.k);
    // stored shapes (rows, cols) of A, B in their own order
    let (ar, ac) = if c.ta == NO { (m, k) } else { (k, m) };
    let (br, bc) = if c.tb == NO { (k, n) } else { (n, k) };
    let dims = |r: usize, cc: usize| if c.order == ROW { (r, cc) } else { (cc, r) }; // (outer, inner)
    let (a_out, a_in) = dims(ar, ac);
    let (b_out, b_in) = dims(br, bc);
    let (c_out, c_in) = dims(m, n);
    let (lda, ldb, ldc) = (a_in + c.pad[0], b_in + c.pad[1], c_in + c.pad[2]);
    let mut seed = c.seed;
    let a = fill(a_out * lda, &mut seed);
    let b = fill(b_out * ldb, &mut seed);
    let c0 = fill(c_out * ldc, &mut seed);
    let mut want = c0.clone();
    let mut bound = vec![0f64; want.len()];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0f64;
            let mut mag = 0f64;
            for p in 0..k {
                let x = if c.ta == NO { at(&a, c.order, lda, i, p) } else { at(&a, c.order, lda, p, i) } as f64;
                let y = if c.tb == NO { at(&b, c.order, ldb, p, j) } else { at(&b, c.order, ldb, j, p) } as f64;
                s += x * y;
                mag += (x * y).abs();
            }
            let idx = if c.order == ROW { i * ldc + j } else { j * ldc + i };
            let old = c0[idx] as f64;
            want[idx] = (c.alpha as f64 * s + c.beta as f64 * old) as f32;
            bound[idx] = c.alpha.abs() as f64 * mag + (c.beta as f64 * old).abs();
        }
    }
    let mut got = c0.clone();
    // SAFETY: every buffer is sized for its dimensions and leading dimension above.
    unsafe {
        cblas_sgemm(
            c.order,
            c.ta,
            c.tb,
            m as i32,
            n as i32,
            k as i32,
            c.alpha,
            a.as_ptr(),
            lda as i32,
            b.as_ptr(),
            ldb as i32,
            c.beta,
            got.as_mut_ptr(),
            ldc as i32,
        );
    }
    for (idx, ((g, w), bd)) in got.iter().zip(&want).zip(&bound).enumerate() {
        let tol = 1e-5 * bd + 1e-6;
        prop_assert!(((*g as f64) - (*w as f64)).abs() <= tol, "{c:?}: C[{idx}] = {g}, want {w} (tol {tol})");
    }
    Ok(())
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(ROW), Just(COL)],
        prop_oneof![Just(NO), Just(TR)],
        prop_oneof![Just(NO), Just(TR)],
        0usize..3, // which dimension is 1: M, N, both
        1usize..200,
        1usize..160,
        prop::array::uniform3(0usize..4),
        prop_oneof![Just(1.0f32), -2.0f32..2.0],
        prop_oneof![Just(0.0f32), Just(1.0f32), -2.0f32..2.0],
        any::<u64>(),
    )
        .prop_map(|(order, ta, tb, which, other, k, pad, alpha, beta, seed)| {
            let (m, n) = match which {
                0 => (1, other),
                1 => (other, 1),
                _ => (1, 1),
            };
            Case { order, ta, tb, m, n, k, pad, alpha, beta, seed }
        })
}

/// The tests switch the process-wide provider and routing: one at a time.
static SWITCH: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn providers() -> Vec<&'static str> {
    ["reference", "openblas"].into_iter().filter(|p| ffi::blas_select(p)).collect()
}

#[test]
fn matrix_vector_products_match_a_naive_product() {
    if !mlx_sys::HAS_BLAS_SWITCH {
        return;
    }
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let provs = providers();
    assert!(provs.contains(&"reference"), "the wheel's reference BLAS must load");
    for p in provs {
        for routing in [true, false] {
            assert!(ffi::blas_select(p));
            ffi::blas_set_gemv_routing(routing);
            let before = ffi::blas_gemv_calls();
            let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
                cases: 200,
                ..Default::default()
            });
            runner.run(&case(), |c| check(&c)).unwrap_or_else(|e| panic!("{p}, routing {routing}: {e}"));
            let routed = ffi::blas_gemv_calls() - before;
            if routing {
                assert!(routed >= 200, "{p}: only {routed} of the matrix-vector calls went to sgemv");
            } else {
                assert_eq!(routed, 0, "{p}: routing off but {routed} calls went to sgemv");
            }
        }
    }
    ffi::blas_set_gemv_routing(true);
}

#[test]
fn other_shapes_and_empty_k_stay_sgemm() {
    if !mlx_sys::HAS_BLAS_SWITCH {
        return;
    }
    let _one = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    let cases = [
        // a real matrix product
        Case { order: ROW, ta: NO, tb: TR, m: 3, n: 5, k: 7, pad: [0; 3], alpha: 1.0, beta: 0.0, seed: 1 },
        // K = 0: C = beta * C, which an empty sgemv would skip
        Case { order: ROW, ta: NO, tb: NO, m: 1, n: 5, k: 0, pad: [1; 3], alpha: 1.0, beta: 0.5, seed: 2 },
        Case { order: COL, ta: TR, tb: NO, m: 4, n: 1, k: 0, pad: [0; 3], alpha: 1.0, beta: -1.0, seed: 3 },
    ];
    for p in providers() {
        assert!(ffi::blas_select(p));
        ffi::blas_set_gemv_routing(true);
        let before = ffi::blas_gemv_calls();
        for c in &cases {
            // lda/ldb must be at least 1 even for an empty K
            let mut c = c.clone();
            c.pad = c.pad.map(|x| x.max(1));
            check(&c).unwrap();
        }
        assert_eq!(ffi::blas_gemv_calls(), before, "{p}: a non-vector shape went to sgemv");
    }
}
