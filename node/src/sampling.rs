//! The nodes' reading of the internal `Sampling` message: kvmesh-model's
//! [`SamplingParams`], checked again (a node trusts no caller's ranges),
//! and the drawn token's logprobs back into the message. Prefill (the
//! first token) and decode (the rest) read it the same way, so one seed
//! and one set of settings give one sampler's tokens.

use kvmesh_model::sampling::{Logprobs as ModelLogprobs, SamplingParams};
use kvmesh_model::structured::{StructuredError, Vocabulary};

use kvmesh_proto::internal::v1::{Logprobs, Sampling};

/// `s` as sampler settings (zero values meaning the defaults), or what is
/// out of range. A grammar is compiled over `vocabulary` (asked for only
/// when there is one: a node builds it on its first constrained request).
pub fn params<'v>(
    s: &Sampling,
    vocabulary: impl FnOnce() -> Result<&'v Vocabulary, StructuredError>,
) -> Result<SamplingParams, String> {
    let mut logit_bias: Vec<(u32, f32)> = s.logit_bias.iter().map(|(&k, &v)| (k, v)).collect();
    logit_bias.sort_unstable_by_key(|e| e.0);
    let p = SamplingParams {
        temperature: s.temperature,
        top_p: if s.top_p > 0.0 { s.top_p } else { 1.0 },
        top_k: (s.top_k > 0).then_some(s.top_k as usize),
        min_p: s.min_p,
        seed: Some(s.seed),
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        repetition_penalty: if s.repetition_penalty == 0.0 {
            1.0
        } else {
            s.repetition_penalty
        },
        logit_bias,
        min_tokens: s.min_tokens as usize,
        logprobs: s.logprobs.map(|n| n as usize),
        grammar: match s.grammar.as_str() {
            "" => None,
            g => Some(
                vocabulary()
                    .and_then(|v| v.compile(g))
                    .map_err(|e| format!("grammar: {e}"))?,
            ),
        },
    };
    p.validate()?;
    Ok(p)
}

/// A drawn token's logprobs as the message carries them.
pub fn logprobs(l: ModelLogprobs) -> Logprobs {
    let (top_ids, top_logprobs) = l.top.into_iter().unzip();
    Logprobs {
        logprob: l.logprob,
        top_ids,
        top_logprobs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node that was never asked for a grammar.
    fn none<'v>() -> Result<&'v Vocabulary, StructuredError> {
        panic!("no grammar, so no vocabulary is built")
    }

    #[test]
    fn zero_values_are_the_defaults_and_ranges_are_checked_again() {
        let p = params(
            &Sampling {
                seed: 9,
                ..Sampling::default()
            },
            none,
        )
        .expect("the defaults");
        assert_eq!(
            p,
            SamplingParams {
                temperature: 0.0,
                seed: Some(9),
                ..SamplingParams::default()
            }
        );
        let bias = params(
            &Sampling {
                temperature: 1.0,
                logit_bias: [(5, 2.0), (1, -3.0)].into_iter().collect(),
                logprobs: Some(4),
                top_k: 3,
                ..Sampling::default()
            },
            none,
        )
        .expect("valid");
        assert_eq!(bias.logit_bias, [(1, -3.0), (5, 2.0)]);
        assert_eq!((bias.logprobs, bias.top_k), (Some(4), Some(3)));
        let hot = params(
            &Sampling {
                frequency_penalty: 3.0,
                ..Sampling::default()
            },
            none,
        );
        assert!(hot.expect_err("out of range").contains("frequency_penalty"));
        let lp = logprobs(ModelLogprobs {
            logprob: -0.5,
            top: vec![(3, -0.5), (8, -1.5)],
        });
        assert_eq!(
            (lp.top_ids, lp.top_logprobs),
            (vec![3, 8], vec![-0.5, -1.5])
        );
    }

    #[test]
    fn a_grammar_is_compiled_over_the_node_s_vocabulary_or_refused() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../model/tests/data/tiny-llama");
        let tok = kvmesh_model::TextTokenizer::from_hf_dir(&dir).expect("tiny tokenizer");
        let vocab = Vocabulary::new(&tok, 512, &[2]).expect("vocabulary");
        let wire = kvmesh_model::structured::Constraint::Regex("[ab]+".into())
            .grammar()
            .expect("wire");
        let with = |g: &str| Sampling {
            grammar: g.into(),
            ..Sampling::default()
        };
        let p = params(&with(&wire), || Ok(&vocab)).expect("compiles");
        assert_eq!(p.grammar.as_ref().map(|g| g.text()), Some(wire.as_str()));
        let bad = params(&with("{\"grammars\": 3}"), || Ok(&vocab));
        assert!(bad.expect_err("refused").starts_with("grammar: "));
        let unavailable = params(&with(&wire), || {
            Err(StructuredError::Unavailable("no trie".into()))
        });
        assert!(unavailable.expect_err("refused").contains("no trie"));
    }
}
