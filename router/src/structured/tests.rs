use serde_json::{json, Value};

use super::*;
use crate::http::validate;

fn router() -> Router {
    crate::openapi::tests::router(false)
}

/// The grammar the nodes would get for a chat body with `extra` fields.
fn grammar(r: &Router, extra: Value) -> Result<String, (&'static str, String)> {
    let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().expect("fields") {
        body[k] = v.clone();
    }
    match validate(r, true, body.to_string().as_bytes()) {
        Ok(v) => Ok(v.prompts[0].settings().sampling.grammar.clone()),
        Err(Rejection::Invalid { param, message }) => Err((param, message)),
        Err(other) => panic!("not a field refusal: {other:?}"),
    }
}

#[test]
fn each_spelling_is_one_constraint_and_text_is_none() {
    let r = router();
    let schema =
        json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let expect = |c: Constraint| c.grammar().expect("wire");
    let cases = [
        (json!({}), String::new()),
        (json!({"response_format": {"type": "text"}}), String::new()),
        (json!({"response_format": null}), String::new()),
        (
            json!({"response_format": {"type": "json_object"}}),
            expect(Constraint::JsonObject),
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema":
                {"name": "thing-1", "description": "d", "schema": schema, "strict": true}}}),
            expect(Constraint::JsonSchema(schema.clone())),
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}),
            expect(Constraint::JsonSchema(Value::Bool(true))),
        ),
        (
            json!({"structured_outputs": {"json": schema}}),
            expect(Constraint::JsonSchema(schema.clone())),
        ),
        (
            json!({"structured_outputs": {"json": schema.to_string()}}),
            expect(Constraint::JsonSchema(schema.clone())),
        ),
        (
            json!({"structured_outputs": {"json_object": true, "regex": null}}),
            expect(Constraint::JsonObject),
        ),
        (
            json!({"structured_outputs": {"regex": "[a-z]{3}"}}),
            expect(Constraint::Regex("[a-z]{3}".into())),
        ),
        (
            json!({"structured_outputs": {"choice": ["yes", "no"]}}),
            expect(Constraint::Choice(vec!["yes".into(), "no".into()])),
        ),
        (
            json!({"structured_outputs": {"grammar": "start: \"a\"+"}}),
            expect(Constraint::Lark("start: \"a\"+".into())),
        ),
        (
            json!({"response_format": {"type": "text"}, "structured_outputs": {"regex": "x"}}),
            expect(Constraint::Regex("x".into())),
        ),
    ];
    for (fields, want) in cases {
        assert_eq!(grammar(&r, fields.clone()), Ok(want), "{fields}");
    }
    // Completions bodies take them too.
    let body = json!({"prompt": "hi", "structured_outputs": {"choice": ["a"]}});
    let v = validate(&r, false, body.to_string().as_bytes()).expect("valid");
    assert!(!v.prompts[0].settings().sampling.grammar.is_empty());
}

#[test]
fn refusals_name_the_field_and_carry_the_library_message() {
    let r = router();
    let refused = |fields: Value| grammar(&r, fields.clone()).expect_err(&fields.to_string());
    let so = "structured_outputs";
    let rf = "response_format";
    for (fields, param, says) in [
        (json!({"response_format": "json"}), rf, "must be an object"),
        (
            json!({"response_format": {"type": "xml"}}),
            rf,
            "text, json_object or json_schema",
        ),
        (
            json!({"response_format": {"type": "json_object", "extra": 1}}),
            rf,
            "`extra`",
        ),
        (
            json!({"response_format": {"type": "json_schema"}}),
            rf,
            "needs json_schema",
        ),
        (
            json!({"response_format": {"type": "json_object", "json_schema": {}}}),
            rf,
            "only for type json_schema",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}}),
            rf,
            "name",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}}),
            rf,
            "strict",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}}),
            rf,
            "llguidance",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "frobnicate"}}}}),
            rf,
            "frobnicate",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 7}}}),
            rf,
            "object",
        ),
        (
            json!({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}),
            so,
            "cannot be combined",
        ),
        (json!({"structured_outputs": {}}), so, "exactly one"),
        (
            json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}),
            so,
            "exactly one",
        ),
        (
            json!({"structured_outputs": {"guided_json": {}}}),
            so,
            "`guided_json`",
        ),
        (
            json!({"structured_outputs": {"regex": "(a"}}),
            so,
            "llguidance",
        ),
        (
            json!({"structured_outputs": {"regex": 3}}),
            so,
            "must be a string",
        ),
        (
            json!({"structured_outputs": {"grammar": "rule: \"a\""}}),
            so,
            "llguidance",
        ),
        (
            json!({"structured_outputs": {"choice": []}}),
            so,
            "at least one",
        ),
        (
            json!({"structured_outputs": {"choice": [1]}}),
            so,
            "list of strings",
        ),
        (
            json!({"structured_outputs": {"json": "{oops"}}),
            so,
            "not JSON",
        ),
        (
            json!({"structured_outputs": {"json_object": false}}),
            so,
            "must be true",
        ),
        (
            json!({"structured_outputs": {"regex": "a"}, "ignore_eos": true}),
            "ignore_eos",
            "cannot be combined",
        ),
    ] {
        let (p, message) = refused(fields.clone());
        assert_eq!(p, param, "{fields}: {message}");
        assert!(message.contains(says), "{fields}: {message}");
    }
}

#[test]
fn the_grpc_message_is_the_same_constraint() {
    use kvmesh_proto::v1::structured_output::Kind;
    use kvmesh_proto::v1::{Choices, StructuredOutput};
    let of = |k: Kind| {
        from_grpc(Some(StructuredOutput { kind: Some(k) })).map(|s| s.map(|s| s.constraint))
    };
    assert_eq!(from_grpc(None), Ok(None));
    assert_eq!(from_grpc(Some(StructuredOutput { kind: None })), Ok(None));
    assert_eq!(
        of(Kind::JsonSchema("{\"type\":\"string\"}".into())),
        Ok(Some(Constraint::JsonSchema(json!({"type": "string"}))))
    );
    assert_eq!(of(Kind::JsonObject(true)), Ok(Some(Constraint::JsonObject)));
    assert_eq!(
        of(Kind::Choice(Choices {
            options: vec!["a".into()]
        })),
        Ok(Some(Constraint::Choice(vec!["a".into()])))
    );
    for bad in [Kind::JsonSchema("{".into()), Kind::JsonObject(false)] {
        assert!(matches!(
            of(bad),
            Err(Rejection::Invalid {
                param: "structured_output",
                ..
            })
        ));
    }
}
