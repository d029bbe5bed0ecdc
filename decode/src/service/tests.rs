use kvmesh_kvwire::WriterId;
use kvmesh_kvxfer::handshake::ReserveError;
use kvmesh_model::structured::{StructuredError, Vocabulary};
use kvmesh_proto::internal::v1::Sampling;

use super::request::*;
use super::*;

fn generate(writer_id: Vec<u8>, sampling: Option<Sampling>) -> GenerateRequest {
    GenerateRequest {
        prompt_ids: vec![1, 2, 3],
        max_new_tokens: 4,
        writer_id,
        sampling,
        stop_token_ids: vec![2],
        cache_namespace: Vec::new(),
    }
}

/// The check of a request without a grammar builds no vocabulary.
fn no_grammar<'v>() -> Result<&'v Vocabulary, StructuredError> {
    Err(StructuredError::Unavailable(
        "not built in this test".into(),
    ))
}

fn writer() -> Vec<u8> {
    WriterId::mint().expect("rng").to_bytes().to_vec()
}

#[test]
fn a_generate_request_is_checked_before_anything_is_reserved() {
    let c = check(&generate(writer(), None), no_grammar).expect("valid");
    assert_eq!(c.max_new, 4);
    // Unset top_p is the whole distribution, not zero mass.
    assert_eq!(c.params.top_p, 1.0);
    for bad in [vec![], vec![7; 15], vec![0; 16]] {
        let e = check(&generate(bad.clone(), None), no_grammar)
            .err()
            .expect("refused");
        assert!(e.contains("writer_id"), "{bad:?}: {e}");
    }
    let hot = Sampling {
        temperature: -1.0,
        top_p: 1.0,
        seed: 1,
        ..Sampling::default()
    };
    assert!(check(&generate(writer(), Some(hot)), no_grammar).is_err());
    let biased = Sampling {
        logit_bias: [(3, 250.0)].into_iter().collect(),
        ..Sampling::default()
    };
    let e = check(&generate(writer(), Some(biased)), no_grammar)
        .err()
        .expect("refused");
    assert!(e.contains("logit_bias"), "{e}");
}

#[test]
fn every_reserve_refusal_has_its_typed_kind() {
    let writer = WriterId::mint().expect("rng");
    let cases = [
        (ReserveError::EmptyPrompt, RefuseKind::EmptyPrompt),
        (
            ReserveError::TooLong {
                prompt_tokens: 3,
                max_new_tokens: 9,
                requested: 12,
                max_seq_tokens: 8,
            },
            RefuseKind::TooLong,
        ),
        (
            ReserveError::OverCapacity {
                requested: 99,
                capacity: 64,
            },
            RefuseKind::OverCapacity,
        ),
        (
            ReserveError::Exhausted {
                needed_pages: 2,
                free_pages: 1,
            },
            RefuseKind::Exhausted,
        ),
        (
            ReserveError::WriterNotConnected { writer },
            RefuseKind::WriterNotConnected,
        ),
        (
            ReserveError::Transport("no lane".into()),
            RefuseKind::Internal,
        ),
    ];
    for (e, want) in cases {
        assert_eq!(refuse_kind(&e), want, "{e}");
        let ev = refused(refuse_kind(&e), e.to_string());
        let Some(decode_event::Event::Refused(r)) = ev.event else {
            panic!("not a refusal: {ev:?}")
        };
        assert_eq!(r.kind(), want);
        assert_eq!(r.message, e.to_string());
    }
}
