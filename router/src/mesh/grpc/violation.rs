//! A node that breaks the Generate stream's contract (granted or refused
//! first; after the grant one `prefilled`, then tokens and one `finished`;
//! logprobs and prompt scores when asked), as a typed value.

use thiserror::Error;

use crate::error::DispatchError;
use crate::nodes::Role;

/// What a node sent that the protocol does not allow. The request fails
/// as the node's failure ([`ProtocolViolation::into_dispatch`]): the
/// client sees a failed request, the logs see which rule was broken.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub(crate) enum ProtocolViolation {
    /// The stream's first event was neither a grant nor a refusal.
    #[error("Generate did not start with a grant")]
    NoGrant,
    /// A grant or a refusal after the grant.
    #[error("a grant or refusal after the grant")]
    GrantAfterGrant,
    /// An event with none of its kinds set.
    #[error("an event without a kind")]
    EmptyEvent,
    /// A token or the end before prefill's report, which the router
    /// needs first (the prompt's scores come before any text; the cached
    /// count goes into the end).
    #[error("a {0} before prefill's report")]
    BeforePrefilled(&'static str),
    /// Prefill's report twice.
    #[error("prefill's report twice")]
    PrefilledTwice,
    /// The stream ended with neither a finish nor an error.
    #[error("token stream ended without a finish")]
    EndedWithoutFinish,
    /// A token without the logprobs the request asked for; the first
    /// token's are prefill's (relayed by decode).
    #[error("a token without the logprobs the request asked for")]
    MissingLogprobs {
        /// The first token (prefill's).
        first: bool,
    },
    /// Prompt scores that do not cover the prompt (one for every token
    /// but the first).
    #[error("{scores} prompt scores for a prompt of {prompt} tokens")]
    PromptScores {
        /// Scores received.
        scores: usize,
        /// Prompt tokens.
        prompt: usize,
    },
}

impl ProtocolViolation {
    /// Whose contract it broke: prefill's for what prefill computed
    /// (the first token's logprobs, the prompt's scores: decode relays
    /// them as they came with the transfer), decode's for its stream.
    pub(crate) fn role(&self) -> Role {
        match self {
            Self::MissingLogprobs { first: true } | Self::PromptScores { .. } => Role::Prefill,
            _ => Role::Decode,
        }
    }

    /// The one mapping into [`DispatchError`]: the failure of `node` (of
    /// [`ProtocolViolation::role`]), counted as that role's
    /// (`prefill_failed`, `decode_failed`), with the rule in its status.
    pub(crate) fn into_dispatch(self, node: &str) -> DispatchError {
        DispatchError::Node {
            role: self.role(),
            node: node.to_owned(),
            status: tonic::Status::internal(self.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_violation_fails_the_node_whose_data_it_was() {
        let cases = [
            (ProtocolViolation::NoGrant, "decode_failed"),
            (ProtocolViolation::GrantAfterGrant, "decode_failed"),
            (ProtocolViolation::BeforePrefilled("token"), "decode_failed"),
            (ProtocolViolation::EndedWithoutFinish, "decode_failed"),
            (
                ProtocolViolation::MissingLogprobs { first: false },
                "decode_failed",
            ),
            (
                ProtocolViolation::MissingLogprobs { first: true },
                "prefill_failed",
            ),
            (
                ProtocolViolation::PromptScores {
                    scores: 2,
                    prompt: 5,
                },
                "prefill_failed",
            ),
        ];
        for (v, kind) in cases {
            let said = v.to_string();
            let e = v.into_dispatch("node-a");
            assert_eq!(e.kind(), kind, "{said}");
            match e {
                DispatchError::Node { node, status, .. } => {
                    assert_eq!(node, "node-a");
                    assert_eq!(status.code(), tonic::Code::Internal);
                    assert_eq!(status.message(), said);
                }
                other => panic!("{other:?}"),
            }
        }
    }
}
