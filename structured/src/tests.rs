use std::path::PathBuf;

use kvmesh_tokenizer::TextTokenizer;
use serde_json::{json, Value};

use super::*;

/// The tiny test model's byte-level BPE (512 tokens; 2 is `<|im_end|>`).
fn tiny() -> (TextTokenizer, Vocabulary) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/tiny-llama");
    let tok = TextTokenizer::from_hf_dir(&dir).expect("tiny tokenizer");
    // More logits than tokens, as padded embeddings have.
    let vocab = Vocabulary::new(&tok, 520, &[2, 0]).expect("a byte-level vocabulary");
    (tok, vocab)
}

/// A deterministic stand-in for a model: each step draws uniformly among
/// the tokens the mask left (xorshift, seeded), until end-of-sequence.
fn walk(vocab: &Vocabulary, g: &Grammar, seed: u64, limit: usize) -> Option<Vec<u32>> {
    let mut m = g.matcher();
    let mut state = seed | 1;
    let mut out = Vec::new();
    for _ in 0..limit {
        let mut row = vec![0.0f32; 520];
        m.mask(&mut row);
        let allowed: Vec<u32> = (0..row.len() as u32)
            .filter(|&i| row[i as usize].is_finite())
            .collect();
        assert!(!allowed.is_empty(), "a mask always leaves a token");
        assert!(allowed.iter().all(|&i| i < 512), "no id without a token");
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let t = allowed[(state % allowed.len() as u64) as usize];
        if vocab.eos().contains(&t) {
            assert!(m.is_complete() || m.error().is_none());
            return Some(out);
        }
        m.advance(t);
        assert_eq!(m.error(), None);
        out.push(t);
    }
    None
}

fn text(tok: &TextTokenizer, ids: &[u32]) -> String {
    tok.decode(ids, false).expect("decodes")
}

#[test]
fn walks_under_varied_schemas_always_parse_and_validate() {
    let (tok, vocab) = tiny();
    let schemas = [
        json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
               "required": ["name"], "additionalProperties": false}),
        json!({"type": "object",
               "properties": {
                   "color": {"enum": ["red", "green", "blue"]},
                   "n": {"type": "integer", "minimum": -5, "maximum": 40},
                   "ok": {"type": "boolean"}},
               "required": ["color", "n", "ok"], "additionalProperties": false}),
        json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
               "minItems": 2, "maxItems": 4}),
        json!({"type": "object",
               "properties": {
                   "inner": {"type": "object",
                             "properties": {"tags": {"type": "array", "maxItems": 3,
                                                     "items": {"type": "string", "minLength": 1, "maxLength": 3}}},
                             "required": ["tags"], "additionalProperties": false},
                   "kind": {"const": "x"}},
               "required": ["inner", "kind"], "additionalProperties": false}),
        json!({"$defs": {"leaf": {"type": "string", "pattern": "^[a-c]{2,4}$"}},
               "type": "object",
               "properties": {"a": {"$ref": "#/$defs/leaf"}, "b": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/leaf"}]}},
               "required": ["a", "b"], "additionalProperties": false}),
        json!({"enum": [1, "two", [3], {"four": 4}, null]}),
    ];
    for schema in schemas {
        let validator = jsonschema::validator_for(&schema).expect("a valid schema");
        let wire = Constraint::JsonSchema(schema.clone())
            .grammar()
            .expect("wire");
        let g = vocab.compile(&wire).expect("llguidance compiles it");
        for seed in 1..=12u64 {
            let ids = walk(&vocab, &g, seed * 7919, 300)
                .unwrap_or_else(|| panic!("a bounded schema ends: {schema}"));
            let out = text(&tok, &ids);
            let v: Value = serde_json::from_str(&out)
                .unwrap_or_else(|e| panic!("{e}: {out:?} under {schema}"));
            assert!(validator.is_valid(&v), "{out} is not valid under {schema}");
            assert!(!out.contains(' ') || out.contains('"'), "compact: {out}");
        }
    }
}

#[test]
fn regex_choice_and_lark_constrain_the_text() {
    let (tok, vocab) = tiny();
    let rx = Constraint::Regex("[0-9]{3}-[a-z]{2}".into())
        .grammar()
        .expect("wire");
    let choice = Constraint::Choice(vec!["yes".into(), "no \"quoted\"".into(), "maybe".into()])
        .grammar()
        .expect("wire");
    let lark = Constraint::Lark("start: \"(\" num (\",\" num)* \")\"\nnum: /[1-9]/".into())
        .grammar()
        .expect("wire");
    let (rx, choice, lark) = (
        vocab.compile(&rx).expect("regex"),
        vocab.compile(&choice).expect("choice"),
        vocab.compile(&lark).expect("lark"),
    );
    for seed in 1..=10u64 {
        let s = text(&tok, &walk(&vocab, &rx, seed, 50).expect("ends"));
        let b = s.as_bytes();
        assert!(
            s.len() == 6
                && b[..3].iter().all(u8::is_ascii_digit)
                && b[3] == b'-'
                && b[4..].iter().all(u8::is_ascii_lowercase),
            "{s:?}"
        );
        let s = text(&tok, &walk(&vocab, &choice, seed, 50).expect("ends"));
        assert!(
            ["yes", "no \"quoted\"", "maybe"].contains(&s.as_str()),
            "{s:?}"
        );
        if let Some(ids) = walk(&vocab, &lark, seed, 60) {
            let s = text(&tok, &ids);
            let inner = s
                .strip_prefix('(')
                .and_then(|s| s.strip_suffix(')'))
                .unwrap_or_else(|| panic!("{s:?}"));
            assert!(
                inner
                    .split(',')
                    .all(|n| n.len() == 1 && (b'1'..=b'9').contains(&n.as_bytes()[0])),
                "{s:?}"
            );
        }
    }
}

#[test]
fn json_object_is_an_object() {
    let (tok, vocab) = tiny();
    let g = vocab
        .compile(&Constraint::JsonObject.grammar().expect("wire"))
        .expect("compiles");
    let mut ended = 0;
    for seed in 1..=20u64 {
        if let Some(ids) = walk(&vocab, &g, seed, 200) {
            let out = text(&tok, &ids);
            // Syntax only: a JSON number may be past f64's range (say
            // 7E97595), which JSON allows and serde_json's `Value` refuses.
            serde_json::from_str::<serde::de::IgnoredAny>(&out)
                .unwrap_or_else(|e| panic!("{e}: {out:?}"));
            assert!(out.starts_with('{') && out.ends_with('}'), "{out}");
            ended += 1;
        }
    }
    // Uniform draws close what they open often enough.
    assert!(ended >= 5, "only {ended} of 20 walks ended");
}

#[test]
fn refusals_carry_the_library_message() {
    let (_, vocab) = tiny();
    let refused = |c: Constraint| match c.grammar().and_then(|w| vocab.compile(&w)) {
        Err(StructuredError::Refused(m)) => m,
        other => panic!("not refused: {other:?}"),
    };
    // Contradictory bounds, an unknown type, an invalid regex, a Lark
    // grammar without `start`, no options, not a schema, our own options.
    let m = refused(Constraint::JsonSchema(
        json!({"type": "integer", "minimum": 5, "maximum": 1}),
    ));
    assert!(m.to_lowercase().contains("unsatisfiable"), "{m}");
    let m = refused(Constraint::JsonSchema(json!({"type": "frobnicate"})));
    assert!(m.contains("frobnicate"), "{m}");
    refused(Constraint::Regex("(unclosed".into()));
    refused(Constraint::Lark("foo: \"a\"".into()));
    refused(Constraint::Choice(Vec::new()));
    refused(Constraint::JsonSchema(json!("string")));
    refused(Constraint::JsonSchema(
        json!({"type": "object", "x-guidance": {"lenient": true}}),
    ));
    // The wire form is checked too (the nodes take it from the router).
    assert!(matches!(
        vocab.compile("{not json"),
        Err(StructuredError::Refused(_))
    ));
    let long = refused(Constraint::Lark(format!("start: {}", "x ".repeat(2000))));
    assert!(long.len() <= MAX_MESSAGE + 3, "{}", long.len());
}

#[test]
fn a_complete_grammar_allows_only_the_end_and_grammars_compare_by_text() {
    let (tok, vocab) = tiny();
    let wire = Constraint::Choice(vec!["ok".into()])
        .grammar()
        .expect("wire");
    let g = vocab.compile(&wire).expect("compiles");
    assert_eq!(g, vocab.compile(&wire).expect("again"));
    assert_eq!(g.text(), wire);
    let mut m = g.matcher();
    for t in tok.encode_raw("ok").expect("encodes") {
        let mut row = vec![0.0f32; 520];
        assert_eq!(m.mask(&mut row), Allowed::Tokens);
        assert!(row[t as usize].is_finite());
        m.advance(t);
    }
    let mut row = vec![0.0f32; 520];
    assert_eq!(m.mask(&mut row), Allowed::EndOnly);
    let finite: Vec<usize> = (0..520).filter(|&i| row[i].is_finite()).collect();
    assert_eq!(finite, [0, 2]);
    // A token the grammar refuses fails the matcher: the end only, after.
    let mut bad = g.matcher();
    bad.advance(tok.encode_raw("z").expect("encodes")[0]);
    assert!(bad.error().is_some());
    let mut row = vec![1.0f32; 520];
    assert_eq!(bad.mask(&mut row), Allowed::EndOnly);
    assert_eq!(row.iter().filter(|l| l.is_finite()).count(), 2);
}

#[test]
fn a_tokenizer_the_library_cannot_read_has_no_structured_output() {
    let (tok, _) = tiny();
    assert!(matches!(
        Vocabulary::new(&tok, 100, &[2]),
        Err(StructuredError::Unavailable(_))
    ));
    assert!(matches!(
        Vocabulary::new(&tok, 512, &[]),
        Err(StructuredError::Unavailable(_))
    ));
}
