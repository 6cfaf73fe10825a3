//! Prompt sets for equality tests, benchmarks and acceptance A/B runs: JSON lines
//! `{"kind": "grounded" | "free", "source": "...", "prompt": "..."}`, as written by
//! `fixtures/prompts/make_prompts.py` (32 prompts from DeepSpec's eval sets: 16
//! input-grounded, whose answers copy from the prompt, and 16 free-form).
use std::path::Path;

use models::tokenizer::{ChatMessage, Tokenizer};

use crate::error::Context;
use crate::{Error, Result};

/// Whether a prompt's answer copies from the prompt (where n-gram lookup shines) or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptKind {
    /// Edit this code, rename a variable, repeat or correct this text.
    Grounded,
    /// Open-ended writing, reasoning, math.
    Free,
}

/// One prompt of a set.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Prompt {
    /// Grounded or free-form.
    pub kind: PromptKind,
    /// Where it came from (`"humaneval:4"`: data set and 0-based line).
    pub source: String,
    /// The user message.
    pub prompt: String,
}

impl Prompt {
    /// The token ids of this prompt as a single user turn through `tok`'s chat template
    /// (with the generation prompt), or the raw text with BOS when the tokenizer has no
    /// template.
    ///
    /// # Errors
    /// [`Error::Model`] when the template or the tokenizer fails.
    pub fn ids(&self, tok: &Tokenizer) -> Result<Vec<u32>> {
        let what = || format!("encoding prompt {}", self.source);
        if tok.chat_template().is_none() {
            return tok.encode(&self.prompt, true).context(what);
        }
        let text = tok.apply_chat_template(&[ChatMessage::user(self.prompt.clone())], true).context(what)?;
        tok.encode(&text, false).context(what)
    }
}

/// The domain of a prompt `source`: the data set before `:` (`"gsm8k:17"` -> `"gsm8k"`; a
/// source without `:` is its own domain). Tau per domain is reported over these.
pub fn domain(source: &str) -> &str {
    source.split(':').next().unwrap_or(source)
}

/// A prompt set's training and held-out prompts, as indices into the set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// The first `num_train` prompts of the set that are not held out, in set order.
    pub train: Vec<usize>,
    /// The held-out prompts, in set order.
    pub held_out: Vec<usize>,
}

/// Splits `sources` (each prompt's [`Prompt::source`], in set order) into `num_train` training
/// prompts and `held_out` held-out ones. The held-out prompts are the last ones of each
/// [`domain`], taken one per domain in turn (domains in order of first appearance) until there
/// are `held_out`: every domain with prompts is represented once `held_out` reaches the number
/// of domains, and the held-out set depends only on the set and `held_out`, never on
/// `num_train`, so runs with any number of training prompts are evaluated on the same prompts
/// and never train on them (`--held-out 16` of the built-in 1,000-prompt set: 4 MT-Bench and
/// 3 each of GSM8K, MBPP, MATH-500 and HumanEval).
///
/// # Errors
/// [`Error::Invalid`] when the set has fewer than `num_train + held_out` prompts.
pub fn split(sources: &[&str], num_train: usize, held_out: usize) -> Result<Split> {
    if sources.len() < num_train + held_out {
        return Err(Error::Invalid(format!(
            "the prompt set has {} prompts; {num_train} training + {held_out} held-out prompts need more",
            sources.len()
        )));
    }
    // Each domain's prompts, last first, domains in order of first appearance.
    let mut domains: Vec<(&str, Vec<usize>)> = Vec::new();
    for (i, s) in sources.iter().enumerate() {
        let d = domain(s);
        match domains.iter_mut().find(|(name, _)| *name == d) {
            Some((_, idx)) => idx.push(i),
            None => domains.push((d, vec![i])),
        }
    }
    for (_, idx) in &mut domains {
        idx.reverse();
    }
    // Round r takes each domain's r-th prompt from the end.
    let rounds = domains.iter().map(|(_, idx)| idx.len()).max().unwrap_or(0);
    let mut held: Vec<usize> = (0..rounds)
        .flat_map(|r| domains.iter().filter_map(move |(_, idx)| idx.get(r).copied()))
        .take(held_out)
        .collect();
    held.sort_unstable();
    let train = (0..sources.len()).filter(|i| held.binary_search(i).is_err()).take(num_train).collect();
    Ok(Split { train, held_out: held })
}

/// Reads a prompt set (JSON lines; blank lines skipped).
///
/// # Errors
/// [`Error::Invalid`] naming the file (and line) when it cannot be read or a line is not a
/// [`Prompt`].
pub fn load_prompts(path: &Path) -> Result<Vec<Prompt>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| Error::Invalid(format!("{} line {}: {e}", path.display(), i + 1)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sources(n_per: &[(&str, usize)]) -> Vec<String> {
        // Round robin over the domains while each has prompts left, as the built-in set is made.
        let mut out = Vec::new();
        for k in 0.. {
            let before = out.len();
            for (d, n) in n_per {
                if k < *n {
                    out.push(format!("{d}:{k}"));
                }
            }
            if out.len() == before {
                return out;
            }
        }
        unreachable!()
    }

    #[test]
    fn held_out_covers_every_domain_and_ignores_the_training_count() {
        let s = sources(&[("mt-bench", 3), ("gsm8k", 10), ("mbpp", 10)]);
        let refs: Vec<&str> = s.iter().map(String::as_str).collect();
        let a = split(&refs, 5, 4).unwrap();
        let b = split(&refs, 19, 4).unwrap();
        assert_eq!(a.held_out, b.held_out);
        let doms: Vec<&str> = a.held_out.iter().map(|&i| domain(refs[i])).collect();
        for d in ["mt-bench", "gsm8k", "mbpp"] {
            assert!(doms.contains(&d), "{d} not held out: {doms:?}");
        }
        // mt-bench (first domain) gives two of the four, its last two prompts.
        assert_eq!(doms.iter().filter(|d| **d == "mt-bench").count(), 2);
        assert!(a.held_out.contains(&refs.iter().position(|s| *s == "mt-bench:2").unwrap()));
        // Training: the first prompts of the rest, in set order, none held out.
        assert_eq!(b.train.len(), 19);
        assert!(b.train.windows(2).all(|w| w[0] < w[1]));
        assert!(b.train.iter().all(|i| !b.held_out.contains(i)));
        assert_eq!(a.train, b.train[..5].to_vec());
    }

    #[test]
    fn too_small_a_set_is_an_error_and_zero_held_out_is_the_first_prompts() {
        let s = sources(&[("a", 3), ("b", 3)]);
        let refs: Vec<&str> = s.iter().map(String::as_str).collect();
        assert!(split(&refs, 5, 2).unwrap_err().to_string().contains("6 prompts"));
        let all = split(&refs, 6, 0).unwrap();
        assert_eq!(all.train, (0..6).collect::<Vec<_>>());
        assert!(all.held_out.is_empty());
        // More held out than one round: the domains take turns.
        let h = split(&refs, 0, 5).unwrap();
        assert_eq!(h.held_out.len(), 5);
    }
}
