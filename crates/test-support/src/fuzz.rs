//! proptest strategies for the parser fuzz tests (`tests/fuzz.rs` of `mlx-core`, `models`
//! and `drafter`): arbitrary JSON values, a valid JSON document with one field changed,
//! removed or added, and byte-level damage of a valid file. The tests run as many cases as
//! proptest's `PROPTEST_CASES` says (a bounded default in `cargo xtask test`, a million in
//! `cargo xtask fuzz`).
use proptest::prelude::*;
use serde_json::{Map, Value};

/// Any JSON value: scalars at the edges (negative, zero, huge, fractional, NaN-free floats,
/// empty and long strings) and arrays and objects of them, up to depth 3.
pub fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        prop_oneof![Just(0i64), Just(-1), Just(1), Just(i64::MAX), Just(i64::MIN), -4i64..4096, any::<i64>()]
            .prop_map(Value::from),
        prop_oneof![Just(u64::MAX), Just(1u64 << 32), Just((1u64 << 32) + 576)].prop_map(Value::from),
        prop_oneof![
            Just(0.5f64),
            Just(-0.0),
            Just(1e300),
            Just(-1e-300),
            any::<f64>().prop_filter("finite", |f| f.is_finite())
        ]
        .prop_map(Value::from),
        "[a-zA-Z0-9_ .\\-]{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// One edit of a JSON object.
#[derive(Debug, Clone)]
pub enum JsonEdit {
    /// Set key number `i` (modulo the key count) to the value.
    Set(usize, Value),
    /// Remove key number `i`.
    Remove(usize),
    /// Add (or overwrite) a key.
    Add(String, Value),
    /// Replace a nested value at key `i` with one of its array elements or object fields
    /// set to the value (one level down).
    Nested(usize, usize, Value),
}

/// 1 to 3 edits of an object.
pub fn json_edits() -> impl Strategy<Value = Vec<JsonEdit>> {
    let edit = prop_oneof![
        4 => (any::<usize>(), json_value()).prop_map(|(i, v)| JsonEdit::Set(i, v)),
        2 => any::<usize>().prop_map(JsonEdit::Remove),
        1 => ("[a-z_]{1,24}", json_value()).prop_map(|(k, v)| JsonEdit::Add(k, v)),
        2 => (any::<usize>(), any::<usize>(), json_value()).prop_map(|(i, j, v)| JsonEdit::Nested(i, j, v)),
    ];
    prop::collection::vec(edit, 1..4)
}

/// Applies `edits` to a copy of the object `base`.
pub fn apply_edits(base: &Map<String, Value>, edits: &[JsonEdit]) -> Map<String, Value> {
    let mut m = base.clone();
    for edit in edits {
        let keys: Vec<String> = m.keys().cloned().collect();
        let key = |i: usize| (!keys.is_empty()).then(|| keys[i % keys.len()].clone());
        match edit {
            JsonEdit::Set(i, v) => {
                if let Some(k) = key(*i) {
                    m.insert(k, v.clone());
                }
            }
            JsonEdit::Remove(i) => {
                if let Some(k) = key(*i) {
                    m.remove(&k);
                }
            }
            JsonEdit::Add(k, v) => {
                m.insert(k.clone(), v.clone());
            }
            JsonEdit::Nested(i, j, v) => match key(*i).and_then(|k| m.get_mut(&k)) {
                Some(Value::Array(a)) if !a.is_empty() => {
                    let n = a.len();
                    a[j % n] = v.clone();
                }
                Some(Value::Object(o)) if !o.is_empty() => {
                    let k = o.keys().nth(j % o.len()).cloned().expect("non-empty");
                    o.insert(k, v.clone());
                }
                _ => {}
            },
        }
    }
    m
}

/// One kind of byte-level damage.
#[derive(Debug, Clone)]
pub enum ByteEdit {
    /// XOR the byte at `i` (modulo the length) with a non-zero mask.
    Flip(usize, u8),
    /// Overwrite 8 bytes at `i` with a little-endian `u64` (length fields, offsets).
    Word(usize, u64),
    /// Cut the file at `i`.
    Truncate(usize),
    /// Insert bytes at `i`.
    Insert(usize, Vec<u8>),
}

/// 1 to 4 byte edits.
pub fn byte_edits() -> impl Strategy<Value = Vec<ByteEdit>> {
    let word = prop_oneof![Just(0u64), Just(u64::MAX), Just(1 << 32), Just(1 << 62), any::<u64>(), 0u64..1024];
    let edit = prop_oneof![
        4 => (any::<usize>(), 1u8..=255).prop_map(|(i, m)| ByteEdit::Flip(i, m)),
        2 => (any::<usize>(), word).prop_map(|(i, w)| ByteEdit::Word(i, w)),
        1 => any::<usize>().prop_map(ByteEdit::Truncate),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(i, b)| ByteEdit::Insert(i, b)),
    ];
    prop::collection::vec(edit, 1..5)
}

/// Applies `edits` to a copy of `base`.
pub fn apply_byte_edits(base: &[u8], edits: &[ByteEdit]) -> Vec<u8> {
    let mut b = base.to_vec();
    for edit in edits {
        let at = |i: usize, b: &Vec<u8>| if b.is_empty() { 0 } else { i % b.len() };
        match edit {
            ByteEdit::Flip(i, m) => {
                let i = at(*i, &b);
                if let Some(x) = b.get_mut(i) {
                    *x ^= m;
                }
            }
            ByteEdit::Word(i, w) => {
                let i = at(*i, &b);
                for (k, byte) in w.to_le_bytes().into_iter().enumerate() {
                    if let Some(x) = b.get_mut(i + k) {
                        *x = byte;
                    }
                }
            }
            ByteEdit::Truncate(i) => {
                let i = at(*i, &b);
                b.truncate(i);
            }
            ByteEdit::Insert(i, bytes) => {
                let i = at(*i, &b);
                b.splice(i..i, bytes.iter().copied());
            }
        }
    }
    b
}
