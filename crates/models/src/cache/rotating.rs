//! The sliding-window (rotating) KV cache with exact multi-token rollback.
//!
//! A sliding layer with window `W` lets the query at absolute position `q` attend to keys
//! at positions `q - W + 1 ..= q` (mlx-lm's `create_causal_mask(.., window_size=W)`:
//! `q < k + W`). mlx-lm's `RotatingKVCache` keeps `W` rows once the ring has wrapped, so a
//! trim after the wrap cannot bring back the rows the rejected tokens overwrote (its
//! `is_trimmable` turns false; `trim` then silently corrupts the window).
//!
//! This cache keeps `C = W - 1 + R` rows instead, `R` = [`RotatingKvCache::rollback`]:
//! position `p` lives in slot `p % C`, and the positions `[oldest, offset)` are valid.
//!
//! - A write of `L <= R` tokens goes into the ring in place (at most two `slice_update`s
//!   when it wraps); the slots it overwrites hold positions `< offset - W + 1`, which no new
//!   query sees. The whole ring (or its written prefix before the first wrap) is returned
//!   with a bool mask that keeps, for each query, exactly the valid positions of its window.
//! - A longer write (a prefill chunk) returns the stored window in temporal order followed
//!   by the new rows (as mlx-lm's `_update_concat`), then stores the last `min(L, C)` rows.
//! - `trim(n)` moves `offset` back; it is exact, and allowed, iff every position the next
//!   query's window needs is still stored: `max(0, offset - n - W + 1) >= oldest`. Rolling
//!   back `n <= min(R, L)` positions of a write of `L` tokens always is, so a verify window
//!   of `d + 1 <= R + 1` tokens can drop its `d` drafts or any suffix of them, at any
//!   offset, wrapped or not. (Two trims in a row may reach further back than the ring.)
//!
//! The memory cost over mlx-lm's cache is `R - 1` rows per sliding layer (`R = 32` by
//! default, 6% of Gemma 3's 512-row window); a snapshot of overwritten rows would save
//! those rows but copy `L` rows on every verify forward.
use mlx_core::{Array, Dtype, concatenate};

use super::LayerCache;
use crate::{Error, Result};

/// A sliding-window KV cache that rolls back multi-token windows exactly (see the module
/// docs). Keys and values are `[B, H_kv, T, D]`.
#[derive(Debug, Clone)]
pub struct RotatingKvCache {
    window: usize,
    rollback: usize,
    keys: Option<Array>,
    values: Option<Array>,
    offset: usize,
    oldest: usize,
    /// Absolute position of each key returned by the last update (`-1` = invalid slot),
    /// and the number of queries of that update.
    last_positions: Vec<i64>,
    last_queries: usize,
}

impl RotatingKvCache {
    /// The default rollback reach `R` of [`crate::Transformer::make_cache`]: verify windows
    /// of up to 33 tokens (32 drafts) roll back exactly.
    pub const DEFAULT_ROLLBACK: usize = 32;

    /// An empty cache for a window of `window >= 1` positions (each query sees itself and
    /// the `window - 1` before it) that can roll back up to `rollback >= 1` positions
    /// exactly after any write.
    ///
    /// # Panics
    /// When `window` or `rollback` is 0.
    pub fn new(window: usize, rollback: usize) -> Self {
        assert!(window >= 1 && rollback >= 1, "a rotating cache needs window >= 1 and rollback >= 1");
        Self {
            window,
            rollback,
            keys: None,
            values: None,
            offset: 0,
            oldest: 0,
            last_positions: Vec::new(),
            last_queries: 0,
        }
    }

    /// The attention window `W` in positions.
    pub fn window(&self) -> usize {
        self.window
    }

    /// The rollback reach `R`: the longest write that goes into the ring in place and the
    /// largest trim that is always exact after a write.
    pub fn rollback(&self) -> usize {
        self.rollback
    }

    /// Ring capacity `C = W - 1 + R` in rows.
    pub fn capacity(&self) -> usize {
        self.window - 1 + self.rollback
    }

    /// The oldest absolute position still stored (positions `[oldest, offset)` are valid).
    pub fn oldest(&self) -> usize {
        self.oldest
    }

    fn shape_err(&self, what: String) -> Error {
        Error::Unsupported(format!("rotating KV cache: {what}"))
    }

    /// Writes `rows [B, H, n, D]` (positions `first .. first + n`, `n <= C`) into the ring.
    fn write_ring(ring: Array, rows: &Array, first: usize, cap: usize) -> Result<Array> {
        let n = rows.shape()[2] as usize;
        debug_assert!(n <= cap);
        let s = ring.shape();
        let start = first % cap;
        let head = n.min(cap - start);
        let put = |ring: Array, part: Array, at: usize, len: usize| -> Result<Array> {
            let (lo, hi) = (at as i32, (at + len) as i32);
            Ok(ring.slice_update(&part, &[0, 0, lo, 0], &[s[0], s[1], hi, s[3]], &[1, 1, 1, 1])?)
        };
        let ring = if head == n {
            put(ring, rows.clone(), start, n)?
        } else {
            put(ring, rows.slice_axis(2, 0, head as i32)?, start, head)?
        };
        if head < n {
            return put(ring, rows.slice_axis(2, head as i32, n as i32)?, 0, n - head);
        }
        Ok(ring)
    }

    /// The stored rows of positions `[from, to)` in temporal order (`oldest <= from`).
    fn temporal(ring: &Array, from: usize, to: usize, cap: usize) -> Result<Option<Array>> {
        if from >= to {
            return Ok(None);
        }
        let (a, b) = (from % cap, (to - 1) % cap + 1);
        Ok(Some(if a < b {
            ring.slice_axis(2, a as i32, b as i32)?
        } else {
            concatenate(&[&ring.slice_axis(2, a as i32, cap as i32)?, &ring.slice_axis(2, 0, b as i32)?], 2)?
        }))
    }

    fn update(&mut self, new: &Array, which: Which) -> Result<Array> {
        let cap = self.capacity();
        let l = new.shape()[2] as usize;
        let ring = match which {
            Which::Keys => self.keys.take(),
            Which::Values => self.values.take(),
        };
        let s = new.shape();
        let ring = match ring {
            Some(r) => r,
            None => Array::zeros(&[s[0], s[1], cap as i32, s[3]], new.dtype())?,
        };
        let rs = ring.shape();
        if rs[0] != s[0] || rs[1] != s[1] || rs[3] != s[3] {
            let what = format!("rows {s:?} do not fit a cache of {rs:?}");
            self.put(which, ring);
            return Err(self.shape_err(what));
        }
        let ring = if ring.dtype() == new.dtype() { ring } else { ring.astype(new.dtype())? };
        let prev = self.offset;
        let (ring, fetched) = if l <= self.rollback {
            let ring = Self::write_ring(ring, new, prev, cap)?;
            let fetched = if prev + l <= cap { ring.slice_axis(2, 0, (prev + l) as i32)? } else { ring.clone() };
            (ring, fetched)
        } else {
            let from = self.oldest.max(prev.saturating_sub(self.window - 1));
            let fetched = match Self::temporal(&ring, from, prev, cap)? {
                Some(old) => concatenate(&[&old, new], 2)?,
                None => new.clone(),
            };
            let keep = l.min(cap);
            let tail = if keep == l { new.clone() } else { new.slice_axis(2, (l - keep) as i32, l as i32)? };
            (Self::write_ring(ring, &tail, prev + l - keep, cap)?, fetched)
        };
        self.put(which, ring);
        Ok(fetched)
    }

    fn put(&mut self, which: Which, ring: Array) {
        match which {
            Which::Keys => self.keys = Some(ring),
            Which::Values => self.values = Some(ring),
        }
    }

    /// Records which absolute position each returned key holds after a write of `l` rows
    /// at `prev`.
    fn record(&mut self, prev: usize, l: usize) {
        let cap = self.capacity();
        let end = prev + l;
        self.last_queries = l;
        self.last_positions.clear();
        if l <= self.rollback {
            let slots = end.min(cap);
            self.last_positions.extend((0..slots).map(|s| {
                // The candidate position in [end - cap, end) that lives in slot s.
                let base = end.saturating_sub(cap);
                let p = base + (s + cap - base % cap) % cap;
                if p >= self.oldest && p < end { p as i64 } else { -1 }
            }));
        } else {
            let from = self.oldest.max(prev.saturating_sub(self.window - 1));
            self.last_positions.extend((from..end).map(|p| p as i64));
        }
    }
}

#[derive(Clone, Copy)]
enum Which {
    Keys,
    Values,
}

impl LayerCache for RotatingKvCache {
    fn offset(&self) -> usize {
        self.offset
    }

    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let (ks, vs) = (keys.shape(), values.shape());
        if ks.len() != 4 || vs.len() != 4 || ks[..3] != vs[..3] {
            return Err(self.shape_err(format!("keys {ks:?} and values {vs:?} are not [B, H, L, D] alike")));
        }
        let l = ks[2] as usize;
        let prev = self.offset;
        let k = self.update(keys, Which::Keys)?;
        let v = self.update(values, Which::Values)?;
        self.offset = prev + l;
        self.record(prev, l);
        self.oldest = self.oldest.max(self.offset.saturating_sub(self.capacity()));
        Ok((k, v))
    }

    fn can_trim(&self, n: usize) -> bool {
        if n > self.offset {
            return false;
        }
        let after = self.offset - n;
        after.saturating_sub(self.window - 1) >= self.oldest
    }

    /// Removes the last `n` positions when that is exact ([`LayerCache::can_trim`]) and
    /// returns `n`; otherwise removes nothing and returns 0.
    fn trim(&mut self, n: usize) -> usize {
        if !self.can_trim(n) {
            return 0;
        }
        self.offset -= n;
        n
    }

    /// `Some(R)`, [`RotatingKvCache::rollback`]: after any write of `L` positions, the last
    /// `min(R, L)` can be dropped exactly.
    fn rollback_reach(&self) -> Option<usize> {
        Some(self.rollback)
    }

    fn state(&self) -> Vec<Array> {
        self.keys.iter().chain(self.values.iter()).cloned().collect()
    }

    fn snapshot(&self) -> Option<Box<dyn LayerCache>> {
        Some(Box::new(self.clone()))
    }

    fn attention_mask(&self) -> Result<Option<Array>> {
        let l = self.last_queries;
        let t = self.last_positions.len();
        if l == 0 {
            return Ok(None);
        }
        let first_query = (self.offset - l) as i64;
        let w = self.window as i64;
        let mut mask = vec![0u8; l * t];
        let mut causal = true;
        for i in 0..l {
            let q = first_query + i as i64;
            for (j, &p) in self.last_positions.iter().enumerate() {
                let see = p >= 0 && p <= q && p > q - w;
                mask[i * t + j] = see as u8;
                // The causal mask aligned to the end: query i sees keys 0 ..= t - l + i.
                causal &= see == (j + l <= t + i);
            }
        }
        if causal {
            return Ok(None);
        }
        Ok(Some(Array::from_bytes(&mask, &[l as i32, t as i32], Dtype::Bool)?))
    }
}
