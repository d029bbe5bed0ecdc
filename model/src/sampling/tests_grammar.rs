//! The sampler under a grammar (structured output), over the tiny test
//! model's vocabulary (512 byte-level BPE tokens; 2 is `<|im_end|>`).

use kvmesh_structured::{Constraint, Vocabulary};

use super::*;
use crate::TextTokenizer;

fn tiny() -> (TextTokenizer, Vocabulary) {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny-llama");
    let tok = TextTokenizer::from_hf_dir(&dir).expect("tiny tokenizer");
    let vocab = Vocabulary::new(&tok, 512, &[2]).expect("vocabulary");
    (tok, vocab)
}

fn under(vocab: &Vocabulary, c: Constraint, p: SamplingParams) -> SamplingParams {
    let wire = c.grammar().expect("wire");
    SamplingParams {
        grammar: Some(vocab.compile(&wire).expect("compiles")),
        ..p
    }
}

/// A model's rows, made up: a different row per step, the end token
/// likely enough to be drawn early without a grammar.
fn row(step: usize) -> Vec<f32> {
    (0..512)
        .map(|i| ((i * 31 + step * 17) as f32 * 0.13).sin() * 4.0)
        .collect()
}

/// Samples until the end token (or `limit` tokens): the tokens before it.
fn run(s: &mut Sampler, from: usize, limit: usize) -> (Vec<u32>, bool) {
    let mut out = Vec::new();
    for step in from..from + limit {
        let t = s.sample(&mut row(step)).token;
        if t == 2 {
            return (out, true);
        }
        out.push(t);
    }
    (out, false)
}

#[test]
fn only_what_the_grammar_allows_is_drawn_greedy_and_seeded() {
    let (tok, vocab) = tiny();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"k": {"enum": ["aa", "bb"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["k", "n"], "additionalProperties": false});
    for p in [
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 1.5,
            top_k: Some(50),
            presence_penalty: 1.0,
            seed: Some(11),
            ..SamplingParams::default()
        },
    ] {
        let mut s = Sampler::new(
            under(&vocab, Constraint::JsonSchema(schema.clone()), p),
            &[1],
            &[2],
        );
        let (ids, ended) = run(&mut s, 0, 60);
        assert!(ended && s.is_complete());
        let text = tok.decode(&ids, false).expect("decodes");
        let v: serde_json::Value = serde_json::from_str(&text).expect(&text);
        assert!(
            ["aa", "bb"].contains(&v["k"].as_str().unwrap_or_default()),
            "{v}"
        );
        assert!(v["n"].as_u64().is_some_and(|n| n <= 99), "{v}");
    }
}

#[test]
fn min_tokens_yields_to_a_complete_grammar_and_logprobs_see_the_mask() {
    let (tok, vocab) = tiny();
    let p = SamplingParams {
        min_tokens: 40,
        logprobs: Some(5),
        ..SamplingParams::greedy()
    };
    let mut s = Sampler::new(
        under(&vocab, Constraint::Choice(vec!["ok".into()]), p),
        &[1],
        &[2],
    );
    let mut ids = Vec::new();
    loop {
        let out = s.sample(&mut row(ids.len()));
        let lp = out.logprobs.expect("asked for");
        // Only allowed tokens are alternatives (a prefix of "ok" or the
        // end, never 5 of them), and they have all the mass.
        assert!(lp.top.len() < 5, "{lp:?}");
        let mass: f32 = lp.top.iter().map(|&(_, l)| l.exp()).sum();
        assert!((mass - 1.0).abs() < 1e-4, "{lp:?}");
        if out.token == 2 {
            break;
        }
        ids.push(out.token);
        assert!(ids.len() < 10, "the grammar ends: {ids:?}");
    }
    assert_eq!(tok.decode(&ids, false).expect("decodes"), "ok");
}

#[test]
fn a_resumed_sampler_continues_the_grammar_where_the_first_token_left_it() {
    let (_, vocab) = tiny();
    let p = under(
        &vocab,
        Constraint::Regex("(ab|ba){2,6}".into()),
        SamplingParams {
            temperature: 1.2,
            seed: Some(5),
            ..SamplingParams::default()
        },
    );
    let mut one = Sampler::new(p.clone(), &[1], &[2]);
    let (all, ended) = run(&mut one, 0, 40);
    assert!(ended && all.len() >= 2, "{all:?}");
    let mut first = Sampler::new(p.clone(), &[1], &[2]);
    assert_eq!(first.sample(&mut row(0)).token, all[0]);
    let mut rest = Sampler::new(p, &[1], &[2]);
    rest.resume(all[0]);
    assert_eq!(run(&mut rest, 1, 40), (all[1..].to_vec(), true));
}
