//! KV caches. A decoder layer's cache stores its keys and values `[B, H_kv, T, D]` and the
//! number of positions written (`offset`). Speculative decoding appends a verify window and
//! then rolls back the rejected part with [`LayerCache::trim`], which must be exact.
use mlx_core::{Array, Dtype, concatenate};

mod rotating;
pub use rotating::RotatingKvCache;

use crate::Result;

/// The interface a decoder layer needs from its cache. A sliding-window (rotating) cache
/// implements it too, reporting through [`LayerCache::can_trim`] when a rollback is no
/// longer exact.
pub trait LayerCache {
    /// Positions written so far (the absolute position of the next token).
    fn offset(&self) -> usize;
    /// Appends `keys`/`values` `[B, H_kv, L, D]` and returns everything the new queries may
    /// attend to, `[B, H_kv, offset + L, D]` for a full cache.
    ///
    /// # Errors
    /// [`crate::Error::Mlx`] on mismatched shapes.
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)>;
    /// Whether the last `n` positions can be removed exactly.
    fn can_trim(&self, n: usize) -> bool;
    /// Removes the last `min(n, offset)` positions and returns how many it removed.
    fn trim(&mut self, n: usize) -> usize;
    /// The exact-rollback reach: the most positions that can always be dropped exactly
    /// ([`LayerCache::can_trim`] true, [`LayerCache::trim`] exact) right after a write that
    /// added at least that many, at any offset. `None` (the default) means no bound beyond
    /// `can_trim`, as for a full cache; `Some(0)` means the cache cannot roll back at all.
    ///
    /// A speculative executor drafts at most this many tokens per verify window, so that the
    /// rejected ones can always be dropped. It is a promise about exactness, not a check:
    /// `can_trim` and the count `trim` returns stay authoritative.
    fn rollback_reach(&self) -> Option<usize> {
        None
    }
    /// The arrays holding the state (to evaluate after a prefill).
    fn state(&self) -> Vec<Array>;
    /// The attention mask the queries of the last [`LayerCache::update_and_fetch`] need over
    /// the keys it returned: `None` means the causal mask aligned to the end (query `i` of
    /// `L` sees keys `0 ..= T - L + i`; no mask for `L = 1`), which is right for a full
    /// cache. A rotating cache returns a bool `[L, T]` array (true = attend) whenever its
    /// keys are not in that order or some fall outside a query's window.
    ///
    /// # Errors
    /// [`crate::Error::Mlx`] when the mask cannot be built.
    fn attention_mask(&self) -> Result<Option<Array>> {
        Ok(None)
    }
    /// A copy of this cache for a prompt cache: the copy shares the arrays (MLX arrays are
    /// values: a later write to either copy allocates anew instead of changing the other).
    /// `None` (the default) for a cache that cannot be copied; such a request is not kept.
    fn snapshot(&self) -> Option<Box<dyn LayerCache>> {
        None
    }
    /// This cache as a [`KvCache`], for a layer that writes its keys and values itself
    /// ([`KvCache::write_with`]); `None` (the default) for other kinds.
    fn as_full(&mut self) -> Option<&mut KvCache> {
        None
    }
}

/// mlx-lm's `KVCache`: a buffer grown in steps of [`KvCache::STEP`] positions; writes go
/// in place with `slice_update`, and `trim` only moves `offset` back (stale rows past
/// `offset` are overwritten by the next write and never read).
#[derive(Debug, Default, Clone)]
pub struct KvCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: usize,
    /// Shared by the copies of this cache ([`LayerCache::snapshot`]) that share its buffers:
    /// [`KvCache::write_with`] writes in place only while no copy holds them.
    buffers: std::sync::Arc<()>,
}

/// The shape `[B, H_kv, L, D]` and dtype of a write's keys or values.
type Rows = (Vec<i32>, Dtype);

impl KvCache {
    /// Growth step in positions (mlx-lm's `KVCache.step`).
    pub const STEP: usize = 256;

    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `l` positions through `write`, for a layer that writes its keys and values
    /// into the buffers itself (`mlx_core::cpu_layer::layer`): `write(keys, values, offset,
    /// in_place)` gets the whole buffers `[B, H_kv, C, D]` (`C >= offset + l`, grown as
    /// [`LayerCache::update_and_fetch`] grows them, for rows shaped `[B, H_kv, l, D]` like
    /// `key_rows` and `value_rows` with their dtypes) and returns its result and the buffers
    /// after the write, which the cache keeps. `in_place` is true when no copy of this cache
    /// ([`LayerCache::snapshot`]) shares the buffers, so `write` may change them in place;
    /// the cache never hands them out otherwise except as inputs of nodes built before
    /// (which run first on the stream). `None` (nothing changed) when the buffers hold
    /// another dtype than the rows'.
    ///
    /// # Errors
    /// Those of `write` (the cache is then unchanged) and of growing the buffers.
    pub fn write_with<T>(
        &mut self,
        key_rows: &[i32],
        value_rows: &[i32],
        dtype: Dtype,
        write: impl FnOnce(&Array, &Array, usize, bool) -> Result<(T, Array, Array)>,
    ) -> Result<Option<T>> {
        if self.keys.as_ref().is_some_and(|k| k.dtype() != dtype) {
            return Ok(None);
        }
        let l = key_rows[2] as usize;
        let prev = self.offset;
        if self.keys.is_none() || prev + l > self.capacity() {
            self.grow((key_rows.to_vec(), dtype), (value_rows.to_vec(), dtype), l, prev + l)?;
        }
        let (k, v) = (self.keys.take().expect("grown"), self.values.take().expect("grown"));
        let exclusive = std::sync::Arc::strong_count(&self.buffers) == 1;
        match write(&k, &v, prev, exclusive) {
            Ok((out, k, v)) => {
                self.keys = Some(k);
                self.values = Some(v);
                self.offset = prev + l;
                if !exclusive {
                    // Written into copies: the buffers are this cache's alone from now on.
                    self.buffers = std::sync::Arc::default();
                }
                Ok(Some(out))
            }
            Err(e) => {
                self.keys = Some(k);
                self.values = Some(v);
                Err(e)
            }
        }
    }

    fn capacity(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.shape()[2] as usize)
    }

    /// Grows the buffers by whole [`KvCache::STEP`]s covering `rows` new positions of keys
    /// and values shaped like `keys`, `values` `[B, H_kv, rows, D]` (`shape[2]` unused).
    fn grow(&mut self, keys: Rows, values: Rows, rows: usize, needed: usize) -> Result<()> {
        let steps = (Self::STEP + rows - 1) / Self::STEP;
        let extra = (steps * Self::STEP) as i32;
        let zeros = |(s, d): Rows| Array::zeros(&[s[0], s[1], extra, s[3]], d);
        let (nk, nv) = (zeros(keys)?, zeros(values)?);
        let off = self.offset as i32;
        let (k, v) = match (self.keys.take(), self.values.take()) {
            (Some(k), Some(v)) => {
                let (k, v) = if self.offset < k.shape()[2] as usize {
                    (k.slice_axis(2, 0, off)?, v.slice_axis(2, 0, off)?)
                } else {
                    (k, v)
                };
                (concatenate(&[&k, &nk], 2)?, concatenate(&[&v, &nv], 2)?)
            }
            _ => (nk, nv),
        };
        debug_assert!(k.shape()[2] as usize >= needed);
        self.keys = Some(k);
        self.values = Some(v);
        // New buffers: no copy of this cache holds them.
        self.buffers = std::sync::Arc::default();
        Ok(())
    }
}

impl LayerCache for KvCache {
    fn offset(&self) -> usize {
        self.offset
    }

    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let l = keys.shape()[2] as usize;
        let prev = self.offset;
        if self.keys.is_none() || prev + l > self.capacity() {
            self.grow((keys.shape(), keys.dtype()), (values.shape(), values.dtype()), l, prev + l)?;
        }
        let (k, v) = (self.keys.take().expect("grown"), self.values.take().expect("grown"));
        let ks = k.shape();
        let vs = v.shape();
        let (lo, hi) = (prev as i32, (prev + l) as i32);
        let k = k.slice_update(keys, &[0, 0, lo, 0], &[ks[0], ks[1], hi, ks[3]], &[1, 1, 1, 1])?;
        let v = v.slice_update(values, &[0, 0, lo, 0], &[vs[0], vs[1], hi, vs[3]], &[1, 1, 1, 1])?;
        self.offset = prev + l;
        let out = (k.slice_axis(2, 0, hi)?, v.slice_axis(2, 0, hi)?);
        self.keys = Some(k);
        self.values = Some(v);
        Ok(out)
    }

    fn can_trim(&self, _n: usize) -> bool {
        true
    }

    fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.offset);
        self.offset -= n;
        n
    }

    fn state(&self) -> Vec<Array> {
        self.keys.iter().chain(self.values.iter()).cloned().collect()
    }

    fn snapshot(&self) -> Option<Box<dyn LayerCache>> {
        Some(Box::new(self.clone()))
    }

    fn as_full(&mut self) -> Option<&mut KvCache> {
        Some(self)
    }
}

/// The caches of all decoder layers of one request.
pub struct ModelCache {
    /// One cache per decoder layer.
    pub layers: Vec<Box<dyn LayerCache>>,
}

impl ModelCache {
    /// Full (non-rotating) caches for `n` layers.
    pub fn full(n: usize) -> Self {
        ModelCache { layers: (0..n).map(|_| Box::new(KvCache::new()) as Box<dyn LayerCache>).collect() }
    }

    /// Positions written (all layers agree).
    pub fn offset(&self) -> usize {
        self.layers.first().map_or(0, |c| c.offset())
    }

    /// Whether every layer can drop its last `n` positions exactly.
    pub fn can_trim(&self, n: usize) -> bool {
        self.layers.iter().all(|c| c.can_trim(n))
    }

    /// Drops the last `n` positions of every layer; returns the count removed (the minimum
    /// over layers, which equals `min(n, offset)` for consistent caches). Callers compare it
    /// with `n`: a smaller value means the rollback was not exact.
    pub fn trim(&mut self, n: usize) -> usize {
        self.layers.iter_mut().map(|c| c.trim(n)).min().unwrap_or(0)
    }

    /// The exact-rollback reach of the whole cache: the smallest
    /// [`LayerCache::rollback_reach`] of its layers, `None` when no layer has a bound (full
    /// caches). A verify window may add `k + 1` positions and drop any `k <= reach` of them
    /// exactly.
    pub fn rollback_reach(&self) -> Option<usize> {
        self.layers.iter().filter_map(|c| c.rollback_reach()).min()
    }

    /// The arrays holding every layer's state.
    pub fn state(&self) -> Vec<Array> {
        self.layers.iter().flat_map(|c| c.state()).collect()
    }

    /// A copy holding exactly the first `len` positions (`len <= offset`), sharing the
    /// arrays ([`LayerCache::snapshot`]): what a prompt cache hands a request whose prompt
    /// starts with this cache's first `len` tokens. `None` when a layer cannot be copied or
    /// cannot drop the positions past `len` exactly (a rotating window that has already
    /// overwritten them).
    pub fn prefix(&self, len: usize) -> Option<ModelCache> {
        let drop = self.offset().checked_sub(len)?;
        let layers = self.layers.iter().map(|c| c.snapshot()).collect::<Option<Vec<_>>>()?;
        let mut copy = ModelCache { layers };
        (drop == 0 || (copy.can_trim(drop) && copy.trim(drop) == drop)).then_some(copy)
    }

    /// Bytes of the arrays the layers hold (their allocated capacity, which can exceed the
    /// written positions): the size a prompt cache charges for this cache.
    pub fn nbytes(&self) -> usize {
        self.state().iter().map(Array::nbytes).sum()
    }
}
