//! The gateway's request parsing and validation (JSON, fields, chat
//! templates, tokenization) on arbitrary bodies, as completions and as chat:
//! never a panic; a refusal is a typed 400/404 naming a field; what is
//! accepted is within the documented bounds.

#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use kvmesh_meshauth::MeshSecret;
use kvmesh_model::TextTokenizer;
use kvmesh_router::nodes::Nodes;
use kvmesh_router::{Rejection, Router, RouterConfig};
use libfuzzer_sys::fuzz_target;

fn router() -> &'static Router {
    static R: OnceLock<Router> = OnceLock::new();
    R.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/tiny-llama");
        let tok = TextTokenizer::from_hf_dir(&dir).expect("tiny tokenizer");
        let cfg = RouterConfig {
            model_id: "tiny-llama".into(),
            max_model_len: 256,
            ..RouterConfig::default()
        };
        Router::new(
            cfg,
            tok,
            vec![2],
            Nodes::new(&[], MeshSecret::insecure()).expect("no nodes"),
        )
    })
}

fuzz_target!(|data: &[u8]| {
    let (chat, body) = match data.split_first() {
        Some((b, rest)) => (b & 1 == 1, rest),
        None => return,
    };
    match kvmesh_router::http::validate(router(), chat, body) {
        Ok(batch) => {
            let choices = batch.prompts.len() * batch.n;
            assert!(choices >= 1 && choices <= kvmesh_router::choices::MAX_CHOICES);
            for v in &batch.prompts {
                let (ids, s) = (v.ids(), v.settings());
                assert!(s.max_tokens >= 1);
                // The sampling the nodes get: in the ranges kvmesh-model
                // checks again, so a node never refuses what the gateway took.
                let p = &s.sampling;
                assert!((0.0..=2.0).contains(&p.temperature));
                assert!(p.top_p > 0.0 && p.top_p <= 1.0);
                assert!((0.0..=1.0).contains(&p.min_p));
                assert!((-2.0..=2.0).contains(&p.presence_penalty));
                assert!((-2.0..=2.0).contains(&p.frequency_penalty));
                assert!(p.repetition_penalty > 0.0 && p.repetition_penalty.is_finite());
                assert!(p
                    .logit_bias
                    .iter()
                    .all(|(&id, b)| id < 512 && b.abs() <= 100.0));
                assert!(p.min_tokens as usize <= s.max_tokens);
                assert!(p.logprobs.is_none_or(|n| n <= 20));
                assert!(s.stop_token_ids.iter().all(|&t| t < 512) && s.stop_token_ids.len() <= 64);
                // A grammar the gateway took compiles on a node too.
                assert!(kvmesh_node::sampling::params(p, || router().vocabulary()).is_ok());
                assert!(s.stop.len() <= 4 && s.stop.iter().all(|x| !x.is_empty()));
                assert!(ids.iter().all(|&t| t < 512));
                // Prompt scores: 0-20 alternatives, as a node accepts.
                assert!(s.prompt_logprobs.is_none_or(|k| k <= 20));
                // A tool choice that constrains the output came with its
                // grammar (checked to compile above).
                if matches!(
                    v.reading().mode,
                    kvmesh_router::tools::Mode::Named(_) | kvmesh_router::tools::Mode::Required
                ) {
                    assert!(!p.grammar.is_empty());
                    // A constrained answer is all answer: no reasoning read.
                    assert!(v.reading().reasoning.is_none());
                }
                assert!(s.keep_special.iter().all(|&t| t < 512));
            }
        }
        Err(Rejection::Invalid { param, .. }) => assert!(!param.is_empty()),
        Err(Rejection::UnknownModel(_)) => {}
        Err(other) => panic!("validation never refuses with {other:?}"),
    }
});
