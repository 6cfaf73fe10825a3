//! The prompt cache: a least-recently-used set of finished requests' states, keyed by the token
//! ids they hold, bounded by an entry count and a byte budget.
//!
//! The payload is generic ([`Payload`]): the engine stores the target's KV cache and the
//! drafter's snapshot together; the tests store plain byte counts. A lookup finds the entry
//! sharing the longest prefix with a new prompt (at most `prompt.len() - 1` tokens, so at
//! least one prompt token is always prefilled and produces the first logits), among the
//! entries the caller accepts (the drafter must be able to resume from it, the cache must be
//! able to drop its extra positions).
//!
//! ```
//! use server::prompt_cache::{Payload, PromptCache};
//! struct Bytes(usize);
//! impl Payload for Bytes { fn nbytes(&self) -> usize { self.0 } }
//! let mut cache = PromptCache::new(4, 1000);
//! cache.insert(vec![1, 2, 3, 4], "suffix", Bytes(100));
//! let hit = cache.lookup(&[1, 2, 3, 9, 9], |_, _| true).unwrap();
//! assert_eq!(hit.reuse, 3);
//! ```

/// What an entry's payload weighs.
pub trait Payload {
    /// Bytes it holds (counted against the byte budget).
    fn nbytes(&self) -> usize;
}

/// One cached state.
#[derive(Debug)]
pub struct Entry<P> {
    /// The tokens the payload holds state for, in order.
    pub tokens: Vec<u32>,
    /// Which drafter made it (a drafter's snapshot is only meaningful to that drafter).
    pub kind: String,
    /// The state.
    pub payload: P,
    nbytes: usize,
    last_used: u64,
}

/// A lookup's result: the entry and how many of its leading tokens the new prompt reuses.
#[derive(Debug)]
pub struct Hit<'a, P> {
    /// The entry (still in the cache; copy or take what you need from it).
    pub entry: &'a mut Entry<P>,
    /// Tokens reused: `1..=min(entry.tokens.len(), prompt.len() - 1)`.
    pub reuse: usize,
}

/// The cache. Not thread-safe by design: the engine thread owns it.
#[derive(Debug)]
pub struct PromptCache<P> {
    entries: Vec<Entry<P>>,
    max_entries: usize,
    max_bytes: usize,
    bytes: usize,
    clock: u64,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<P: Payload> PromptCache<P> {
    /// An empty cache of at most `max_entries` entries and `max_bytes` bytes (either 0: the
    /// cache keeps nothing).
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        PromptCache { entries: Vec::new(), max_entries, max_bytes, bytes: 0, clock: 0 }
    }

    /// The entry sharing the longest prefix with `prompt` among those `usable(entry, reuse)`
    /// accepts (ties: the most recently used), marked as used; `None` when no entry shares a
    /// token (or `prompt` has fewer than 2 tokens).
    pub fn lookup(&mut self, prompt: &[u32], mut usable: impl FnMut(&Entry<P>, usize) -> bool) -> Option<Hit<'_, P>> {
        let cap = prompt.len().saturating_sub(1);
        let mut best: Option<(usize, usize)> = None;
        for (i, e) in self.entries.iter().enumerate() {
            let reuse = common_prefix(&e.tokens, prompt).min(cap);
            if reuse == 0 || !usable(e, reuse) {
                continue;
            }
            let better = match best {
                None => true,
                Some((b, r)) => reuse > r || (reuse == r && e.last_used > self.entries[b].last_used),
            };
            if better {
                best = Some((i, reuse));
            }
        }
        let (i, reuse) = best?;
        self.clock += 1;
        self.entries[i].last_used = self.clock;
        Some(Hit { entry: &mut self.entries[i], reuse })
    }

    /// Stores `payload` for `tokens`. Entries of the same `kind` whose tokens are a prefix of
    /// `tokens` are dropped (the new one covers them); then the least recently used entries
    /// go until the count and the byte budget hold. A payload larger than the whole budget is
    /// not stored.
    pub fn insert(&mut self, tokens: Vec<u32>, kind: &str, payload: P) {
        let nbytes = payload.nbytes();
        if self.max_entries == 0 || nbytes > self.max_bytes || tokens.is_empty() {
            return;
        }
        self.entries.retain(|e| {
            let covered = e.kind == kind && tokens.starts_with(&e.tokens);
            if covered {
                self.bytes -= e.nbytes;
            }
            !covered
        });
        self.clock += 1;
        self.bytes += nbytes;
        self.entries.push(Entry { tokens, kind: kind.to_string(), payload, nbytes, last_used: self.clock });
        while self.entries.len() > self.max_entries || self.bytes > self.max_bytes {
            let oldest = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used).expect("not empty");
            let e = self.entries.swap_remove(oldest);
            self.bytes -= e.nbytes;
        }
    }

    /// Bytes held (the sum of the entries' [`Payload::nbytes`]).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops every entry.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[derive(Debug)]
    struct B(usize);
    impl Payload for B {
        fn nbytes(&self) -> usize {
            self.0
        }
    }

    #[test]
    fn longest_prefix_wins_and_one_token_is_always_left() {
        let mut c = PromptCache::new(8, 1 << 20);
        c.insert(vec![1, 2], "suffix", B(1));
        c.insert(vec![1, 2, 3, 4, 5], "ngram", B(1));
        c.insert(vec![7, 8], "suffix", B(1));
        let hit = c.lookup(&[1, 2, 3, 4, 5], |_, _| true).unwrap();
        assert_eq!((hit.reuse, hit.entry.kind.as_str()), (4, "ngram"));
        // The caller may refuse an entry: the next best is used.
        let hit = c.lookup(&[1, 2, 3, 4, 5], |e, _| e.kind == "suffix").unwrap();
        assert_eq!(hit.reuse, 2);
        assert!(c.lookup(&[9, 9, 9], |_, _| true).is_none());
        assert!(c.lookup(&[1], |_, _| true).is_none());
    }

    #[test]
    fn an_extension_replaces_its_prefix_of_the_same_kind() {
        let mut c = PromptCache::new(8, 1 << 20);
        c.insert(vec![1, 2, 3], "suffix", B(10));
        c.insert(vec![1, 2, 3], "ngram", B(10));
        c.insert(vec![1, 2, 3, 4], "suffix", B(12));
        assert_eq!((c.len(), c.bytes()), (2, 22));
        c.insert(vec![1, 2, 3, 4], "suffix", B(5));
        assert_eq!((c.len(), c.bytes()), (2, 15));
    }

    #[test]
    fn least_recently_used_goes_first() {
        let mut c = PromptCache::new(2, 1 << 20);
        c.insert(vec![1, 1], "k", B(1));
        c.insert(vec![2, 2], "k", B(1));
        c.lookup(&[1, 1, 5], |_, _| true).unwrap();
        c.insert(vec![3, 3], "k", B(1));
        assert!(c.lookup(&[2, 2, 5], |_, _| true).is_none());
        assert!(c.lookup(&[1, 1, 5], |_, _| true).is_some());
        // Too big for the budget: not stored; a zero-entry cache stores nothing.
        let mut c = PromptCache::new(2, 10);
        c.insert(vec![1], "k", B(11));
        assert!(c.is_empty());
        let mut c = PromptCache::new(0, 10);
        c.insert(vec![1], "k", B(1));
        assert!(c.is_empty());
    }

    proptest! {
        #[test]
        fn the_budget_holds_under_any_stream_of_prompts(
            inserts in proptest::collection::vec((proptest::collection::vec(0u32..4, 1..8), 1usize..40), 1..60),
            max_entries in 1usize..6,
            max_bytes in 1usize..100,
        ) {
            let mut c = PromptCache::new(max_entries, max_bytes);
            for (tokens, n) in inserts {
                c.insert(tokens.clone(), "k", B(n));
                prop_assert!(c.len() <= max_entries);
                prop_assert!(c.bytes() <= max_bytes);
                prop_assert_eq!(c.bytes(), c.entries.iter().map(|e| e.nbytes).sum::<usize>());
                if n <= max_bytes {
                    // The newest entry is always kept, and found.
                    let mut probe = tokens.clone();
                    probe.push(99);
                    let hit = c.lookup(&probe, |_, _| true).unwrap();
                    prop_assert_eq!(hit.reuse, tokens.len());
                }
            }
        }
    }
}
