use serde_json::json;

use super::*;

fn param(e: Rejection) -> (&'static str, String) {
    match e {
        Rejection::Invalid { param, message } => (param, message),
        other => panic!("not a field refusal: {other:?}"),
    }
}

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "d",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, "strict": true}})
}

#[test]
fn a_body_reads_into_tools() {
    let t = from_body(Some(json!([weather()])), None, None)
        .expect("valid")
        .expect("some");
    assert_eq!((t.choice.clone(), t.parallel), (Choice::Auto, true));
    assert_eq!(t.mode(), Mode::Auto { parallel: true });
    assert_eq!(t.rendered()[0]["function"]["name"], "get_weather");
    assert_eq!(t.constraint(), None);
    let named = from_body(
        Some(json!([weather()])),
        Some(json!({"type": "function", "function": {"name": "get_weather"}})),
        Some(false),
    )
    .expect("valid")
    .expect("some");
    assert_eq!(
        named.constraint(),
        Some(Constraint::JsonSchema(
            weather()["function"]["parameters"].clone()
        ))
    );
    let required = from_body(
        Some(json!([weather()])),
        Some(json!("required")),
        Some(false),
    )
    .expect("valid")
    .expect("some");
    let Some(Constraint::JsonSchema(s)) = required.constraint() else {
        panic!("a schema")
    };
    assert_eq!(
        (s["minItems"].clone(), s["maxItems"].clone()),
        (json!(1), json!(1))
    );
    assert_eq!(
        s["items"]["anyOf"][0]["properties"]["name"]["enum"],
        json!(["get_weather"])
    );
    // No parameters: an empty object schema.
    let bare = from_body(
        Some(json!([{"type": "function", "function": {"name": "f"}}])),
        Some(json!("none")),
        None,
    )
    .expect("valid")
    .expect("some");
    assert_eq!(
        bare.defs[0].parameters,
        json!({"type": "object", "properties": {}})
    );
    assert_eq!(bare.mode(), Mode::Text);
    assert_eq!(
        from_body(None, Some(json!("none")), None).expect("valid"),
        None
    );
}

#[test]
fn bad_tools_are_refused_by_name() {
    let f = |function: Value| json!([{"type": "function", "function": function}]);
    /// tools, tool_choice, parallel_tool_calls; the refused field and a
    /// word of its message.
    type Case = (
        Option<Value>,
        Option<Value>,
        Option<bool>,
        &'static str,
        &'static str,
    );
    let cases: Vec<Case> = vec![
        (Some(json!({})), None, None, "tools", "list"),
        (Some(json!([])), None, None, "tools", "empty"),
        (Some(json!([1])), None, None, "tools", "object"),
        (
            Some(json!([{"type": "code", "function": {"name": "f"}}])),
            None,
            None,
            "tools",
            "type",
        ),
        (
            Some(json!([{"type": "function", "function": {"name": "f"}, "x": 1}])),
            None,
            None,
            "tools",
            "`x`",
        ),
        (
            Some(f(json!({"name": "f", "y": 1}))),
            None,
            None,
            "tools",
            "`y`",
        ),
        (Some(f(json!({"name": "a b"}))), None, None, "tools", "name"),
        (Some(f(json!({"name": ""}))), None, None, "tools", "name"),
        (
            Some(f(json!({"name": "f", "parameters": []}))),
            None,
            None,
            "tools",
            "parameters",
        ),
        (
            Some(f(json!({"name": "f", "parameters": {"type": "string"}}))),
            None,
            None,
            "tools",
            "parameters",
        ),
        (
            Some(f(json!({"name": "f", "strict": "yes"}))),
            None,
            None,
            "tools",
            "strict",
        ),
        (
            Some(f(json!({"name": "f", "description": 1}))),
            None,
            None,
            "tools",
            "description",
        ),
        (
            Some(json!([weather(), weather()])),
            None,
            None,
            "tools",
            "twice",
        ),
        (
            Some(json!([weather()])),
            Some(json!("sometimes")),
            None,
            "tool_choice",
            "required",
        ),
        (
            Some(json!([weather()])),
            Some(json!({"type": "function", "function": {"name": "nope"}})),
            None,
            "tool_choice",
            "not in tools",
        ),
        (
            Some(json!([weather()])),
            Some(json!({"type": "function"})),
            None,
            "tool_choice",
            "function",
        ),
        (
            None,
            Some(json!("auto")),
            None,
            "tool_choice",
            "needs tools",
        ),
        (None, None, Some(true), "parallel_tool_calls", "only"),
    ];
    for (tools, choice, parallel, want, says) in cases {
        let what = format!("{tools:?} {choice:?}");
        let (p, m) = param(from_body(tools, choice, parallel).expect_err(&what));
        assert_eq!(p, want, "{what}: {m}");
        assert!(m.contains(says), "{what}: {m}");
    }
    let many: Vec<Value> = (0..=MAX_TOOLS)
        .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
        .collect();
    assert_eq!(
        param(from_body(Some(Value::Array(many)), None, None).expect_err("many")).0,
        "tools"
    );
}

#[test]
fn grpc_tools_follow_the_same_rules() {
    use kvmesh_proto::v1::{tool_choice::Kind, Tool as T, ToolChoice, ToolChoiceMode};
    let t = |name: &str, parameters: &str| T {
        name: name.into(),
        description: String::new(),
        parameters: parameters.into(),
        strict: None,
    };
    let ok = from_grpc(
        vec![t("f", "{\"type\":\"object\"}")],
        Some(ToolChoice {
            kind: Some(Kind::Mode(ToolChoiceMode::Required as i32)),
        }),
        None,
    )
    .expect("valid")
    .expect("some");
    assert_eq!(ok.mode(), Mode::Required);
    assert_eq!(from_grpc(vec![], None, None).expect("valid"), None);
    for (tools, choice, want) in [
        (vec![t("f", "{")], None, "tools"),
        (vec![t("f", ""), t("f", "")], None, "tools"),
        (
            vec![t("f", "")],
            Some(Kind::Function("g".into())),
            "tool_choice",
        ),
        (vec![t("f", "")], Some(Kind::Mode(99)), "tool_choice"),
        (
            vec![],
            Some(Kind::Mode(ToolChoiceMode::Required as i32)),
            "tool_choice",
        ),
    ] {
        let choice = choice.map(|k| ToolChoice { kind: Some(k) });
        assert_eq!(
            param(from_grpc(tools, choice, None).expect_err(want)).0,
            want
        );
    }
}
