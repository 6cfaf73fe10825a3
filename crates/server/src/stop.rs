//! Stop strings over streamed text: text is released only once no stop string can still
//! start inside it, the stop text itself is never released, and the result does not depend on
//! how the text was cut into pieces (tokens, or a speculative round's several tokens).
//!
//! ```
//! use server::stop::StopMatcher;
//! let mut m = StopMatcher::new(vec!["\n\n".into()]);
//! assert_eq!(m.push("Hello\n").text, "Hello"); // "\n" may start "\n\n": held back
//! let out = m.push("\nWorld");
//! assert_eq!((out.text.as_str(), out.stopped), ("", true));
//! ```

/// What one [`StopMatcher::push`] releases.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Released {
    /// Text that can be sent (possibly empty).
    pub text: String,
    /// Whether a stop string matched: the text before it has been released, nothing after
    /// it ever will be, and the request should end.
    pub stopped: bool,
}

/// The stop-string matcher of one request.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released: a suffix that is a proper prefix of a stop string.
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored; no stops: every push releases all).
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), ..Default::default() }
    }

    /// Adds `text` (any cut of the stream, on `char` boundaries as Rust strings are) and
    /// returns what can now be released. After a stop matched, every push releases nothing.
    pub fn push(&mut self, text: &str) -> Released {
        if self.stopped {
            return Released { text: String::new(), stopped: true };
        }
        self.held.push_str(text);
        // Where a stop string might still start (it runs past the end of the text so far).
        let partial = self.held.len() - self.partial_suffix();
        match self.first_match() {
            // A complete match with no possible earlier one: the text ends there.
            Some(at) if at <= partial => {
                self.stopped = true;
                let mut text = std::mem::take(&mut self.held);
                text.truncate(at);
                Released { text, stopped: true }
            }
            // No match yet, or one that a longer stop starting earlier may still beat: release
            // what lies before any possible start.
            _ => {
                let rest = self.held.split_off(partial);
                Released { text: std::mem::replace(&mut self.held, rest), stopped: false }
            }
        }
    }

    /// The end of the stream: releases what is held, cut before the first complete stop
    /// string in it (one that an unfinished longer stop had held back).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        if let Some(at) = self.first_match() {
            self.stopped = true;
            self.held.truncate(at);
        }
        std::mem::take(&mut self.held)
    }

    /// The start of the earliest complete stop string in `held`.
    fn first_match(&self) -> Option<usize> {
        self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min()
    }

    /// Whether a stop string has matched.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The length in bytes of the longest suffix of `held` that is a proper prefix of a stop
    /// string (and starts on a `char` boundary).
    fn partial_suffix(&self) -> usize {
        let longest = self.stops.iter().map(|s| s.len() - 1).max().unwrap_or(0).min(self.held.len());
        let held = self.held.as_bytes();
        (1..=longest)
            .rev()
            .find(|&k| {
                let at = held.len() - k;
                self.held.is_char_boundary(at) && self.stops.iter().any(|s| s.as_bytes().starts_with(&held[at..]))
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// What the whole text gives: cut before the earliest stop string, and whether one occurs.
    fn reference(text: &str, stops: &[String]) -> (String, bool) {
        match stops.iter().filter(|s| !s.is_empty()).filter_map(|s| text.find(s.as_str())).min() {
            Some(at) => (text[..at].to_string(), true),
            None => (text.to_string(), false),
        }
    }

    fn run(pieces: &[String], stops: &[String]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.to_vec());
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, m.stopped())
    }

    /// Cuts `text` at the char indices `cuts` (sorted, deduplicated, clamped).
    fn cut(text: &str, cuts: &[usize]) -> Vec<String> {
        let chars: Vec<char> = text.chars().collect();
        let mut points: Vec<usize> = cuts.iter().map(|&c| c % (chars.len() + 1)).collect();
        points.sort_unstable();
        points.dedup();
        let mut pieces = Vec::new();
        let mut last = 0;
        for p in points.into_iter().chain([chars.len()]) {
            pieces.push(chars[last..p].iter().collect());
            last = p;
        }
        pieces
    }

    #[test]
    fn a_stop_spanning_pieces_is_cut_and_held_text_comes_back() {
        let stops = vec!["STOP".to_string()];
        assert_eq!(run(&["abST".into(), "OP tail".into()], &stops), ("ab".into(), true));
        assert_eq!(run(&["abST".into(), "Ox".into()], &stops), ("abSTOx".into(), false));
        let mut m = StopMatcher::new(stops);
        assert_eq!(m.push("xS").text, "x");
        assert_eq!(m.push("T").text, "");
        assert_eq!(m.push("a").text, "STa");
        assert!(!m.stopped());
        // The earliest stop wins, whichever is listed first.
        let stops = vec!["cd".to_string(), "b".to_string()];
        assert_eq!(run(&["abcd".into()], &stops), ("a".into(), true));
        // A complete stop does not end the text while a longer one that starts earlier may
        // still complete.
        let stops = vec!["\né\n".to_string(), "é".to_string()];
        assert_eq!(run(&["a\né".into(), "\n".into()], &stops), ("a".into(), true));
        assert_eq!(run(&["a\né".into(), "x".into()], &stops), ("a\n".into(), true));
        // Multi-byte characters are never split.
        let stops = vec!["é!".to_string()];
        assert_eq!(run(&["caféx".into(), "é".into(), "!".into()], &stops), ("caféx".into(), true));
    }

    proptest! {
        #[test]
        fn any_cut_gives_the_whole_text_result(
            text in "[abé\n]{0,40}",
            stops in proptest::collection::vec("[abé\n]{0,4}", 0..4),
            cuts in proptest::collection::vec(0usize..64, 0..12),
        ) {
            let pieces = cut(&text, &cuts);
            prop_assert_eq!(run(&pieces, &stops), reference(&text, &stops));
        }

        #[test]
        fn released_text_never_holds_a_possible_stop_start(
            text in "[ab]{0,30}",
            stop in "[ab]{1,4}",
        ) {
            // After every push, what is held is shorter than the stop: the hold-back is minimal.
            let mut m = StopMatcher::new(vec![stop.clone()]);
            for c in text.chars() {
                let r = m.push(&c.to_string());
                if r.stopped { break; }
                prop_assert!(m.held.len() < stop.len());
            }
        }
    }
}
