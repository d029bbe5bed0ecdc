//! The one stop and budget rule of kvmesh: what happens after a token is
//! sampled. The reference engine ([`super::Engine::generate`]), the
//! continuous-batching scheduler and the decode node's batcher all apply
//! it, so greedy output through the mesh equals `kvmesh generate`'s token
//! for token and every path ends for the same reason.

use super::FinishReason;

/// Counts a request's generated tokens against its budget and knows its
/// stop token ids.
///
/// The rule: a stop token ends generation without being emitted; any other
/// token is emitted and counts against `max_new_tokens`; the token that
/// spends the budget is emitted and ends generation with
/// [`FinishReason::Length`]. Stop strings (text, not ids) are the
/// detokenizer's business (`kvmesh_tokenizer::TextOut`).
#[derive(Clone, Debug)]
pub struct Stopping {
    stop_ids: Vec<u32>,
    max_new_tokens: usize,
    generated: usize,
}

impl Stopping {
    /// A request that may generate `max_new_tokens` tokens and stops at
    /// any of `stop_ids` (empty: no stop token, as with `ignore_eos`).
    pub fn new(stop_ids: Vec<u32>, max_new_tokens: usize) -> Self {
        Self {
            stop_ids,
            max_new_tokens,
            generated: 0,
        }
    }

    /// Whether the budget is spent before any token (`max_new_tokens` 0):
    /// the request ends with [`FinishReason::Length`] and nothing runs.
    pub fn spent(&self) -> bool {
        self.generated >= self.max_new_tokens
    }

    /// The verdict on sampled token `tok`: `None`, emit it and go on;
    /// `Some(Length)`, emit it, then end; `Some(Stop)`, end without
    /// emitting it.
    pub fn after(&mut self, tok: u32) -> Option<FinishReason> {
        if self.stop_ids.contains(&tok) {
            return Some(FinishReason::Stop);
        }
        self.generated += 1;
        self.spent().then_some(FinishReason::Length)
    }

    /// Tokens emitted so far.
    pub fn generated(&self) -> usize {
        self.generated
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_token_ends_without_counting_and_the_budget_ends_on_its_last_token() {
        let mut s = Stopping::new(vec![2, 7], 3);
        assert!(!s.spent());
        assert_eq!(s.after(5), None);
        assert_eq!(s.after(6), None);
        assert_eq!(s.generated(), 2);
        assert_eq!(s.after(7), Some(FinishReason::Stop));
        assert_eq!(s.generated(), 2, "a stop token is not emitted");
        let mut s = Stopping::new(vec![2], 3);
        assert_eq!((s.after(1), s.after(1)), (None, None));
        assert_eq!(s.after(1), Some(FinishReason::Length));
        assert_eq!(s.generated(), 3);
    }

    #[test]
    fn no_stop_ids_run_to_the_budget_and_a_zero_budget_is_spent_at_once() {
        let mut s = Stopping::new(Vec::new(), 2);
        assert_eq!(s.after(2), None);
        assert_eq!(s.after(2), Some(FinishReason::Length));
        assert!(Stopping::new(vec![1], 0).spent());
    }
}
