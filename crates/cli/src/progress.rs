//! The progress bars the commands draw on stderr (import, quantize, prefill): one look.
//!
//! A bar is an [`indicatif`] bar on stderr, which draws nothing when stderr is not a
//! terminal, so piped and captured output carries none of it.
use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressFinish, ProgressStyle};

/// A bar of `len` steps (`0` when unknown yet: set it with [`ProgressBar::set_length`]) in the
/// CLI's style: `{spinner} {msg} [{bar:30}] {pos}/{len}`, the message cut or padded to
/// `msg_width` columns, then `tail` (an indicatif template fragment such as `"{elapsed}"`).
/// Nothing is drawn until its first update.
///
/// # Panics
/// On a `tail` that is not a valid indicatif template (a programming error).
pub(crate) fn styled_bar(len: u64, msg_width: usize, tail: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(&format!("{{spinner}} {{msg:{msg_width}!}} [{{bar:30}}] {{pos}}/{{len}} {tail}"))
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

/// Prompts longer than this many tokens (two prefill chunks) get a prefill bar.
pub(crate) const PREFILL_BAR_MIN_TOKENS: usize = 2 * models::generate::PREFILL_CHUNK;

/// The [`models::PrefillProgress`] callback for a prompt of `tokens` tokens: `None` unless
/// stderr is a terminal and the prompt is longer than [`PREFILL_BAR_MIN_TOKENS`]. Its bar
/// reads `prefill [=====>    ] 640/1280 tokens 12s, ETA 11s`; it appears at the first call
/// (so what runs before the prefill, such as the drafter's cost calibration, counts in
/// neither its elapsed time nor its ETA), is cleared by the call with `done == total`
/// (before the first generated token is printed), and clears itself when the callback is
/// dropped first (an error leaves no bar behind).
pub(crate) fn prefill_progress(tokens: usize) -> Option<impl FnMut(usize, usize)> {
    prefill_progress_on(tokens, std::io::stderr().is_terminal())
}

/// [`prefill_progress`] with the terminal test given (`terminal`: whether stderr is one).
fn prefill_progress_on(tokens: usize, terminal: bool) -> Option<impl FnMut(usize, usize)> {
    if !terminal || tokens <= PREFILL_BAR_MIN_TOKENS {
        return None;
    }
    let mut bar: Option<ProgressBar> = None;
    Some(move |done: usize, total: usize| {
        let bar = bar.get_or_insert_with(|| {
            styled_bar(total as u64, 7, "tokens {elapsed}, ETA {eta}")
                .with_finish(ProgressFinish::AndClear)
                .with_message("prefill")
        });
        bar.set_position(done as u64);
        if done >= total {
            bar.finish_and_clear();
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefill_bar_only_on_a_terminal_for_a_long_prompt() {
        assert!(prefill_progress_on(5000, false).is_none());
        assert!(prefill_progress_on(PREFILL_BAR_MIN_TOKENS, true).is_none());
        let mut cb = prefill_progress_on(PREFILL_BAR_MIN_TOKENS + 1, true).unwrap();
        for done in [0, 512, 1024, PREFILL_BAR_MIN_TOKENS + 1] {
            cb(done, PREFILL_BAR_MIN_TOKENS + 1);
        }
    }
}
