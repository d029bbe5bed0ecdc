//! The gateway's OpenAPI 3.1 document (`router/openapi.json`, served at
//! `GET /openapi.json`): every route, the request bodies exactly as
//! [`crate::http::validate`] accepts and refuses them, and every response
//! with its content type and body. The tests here hold it to the routes the
//! gateway registers ([`crate::http::endpoints`], the one list the gateway
//! is built from) and its request bounds to `validate`; the integration
//! test `schemathesis` fuzzes a running mesh against it.

/// The document, as served.
pub const DOCUMENT: &str = include_str!("../openapi.json");

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeSet;
    use std::path::PathBuf;

    use serde_json::{json, Value};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::DOCUMENT;
    use crate::auth::ApiKeys;
    use crate::http::{endpoints, validate, Access};
    use crate::nodes::Nodes;
    use crate::{Rejection, Router, RouterConfig};

    const METHODS: [&str; 8] = [
        "get", "put", "post", "delete", "options", "head", "patch", "trace",
    ];

    fn doc() -> Value {
        serde_json::from_str(DOCUMENT).expect("openapi.json is JSON")
    }

    /// A router with the tiny model's tokenizer and no nodes (so anything
    /// admitted gets 503), with API keys when `keys`.
    pub(crate) fn router(keys: bool) -> Router {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/tiny-llama");
        let tok = kvmesh_tokenizer::TextTokenizer::from_hf_dir(&dir).expect("tiny tokenizer");
        let api_keys = if keys {
            ApiKeys::new([("k-test".to_owned(), "tenant".to_owned())]).expect("keys")
        } else {
            ApiKeys::default()
        };
        let cfg = RouterConfig {
            model_id: "tiny-llama".into(),
            max_model_len: 256,
            api_keys,
            ..RouterConfig::default()
        };
        let secret = kvmesh_meshauth::MeshSecret::generate().expect("mesh secret");
        Router::new(
            cfg,
            tok,
            vec![2],
            Nodes::new(&[], secret).expect("no nodes"),
        )
    }

    /// `$ref`s followed until a schema.
    fn resolve<'a>(doc: &'a Value, mut v: &'a Value) -> &'a Value {
        while let Some(r) = v.get("$ref").and_then(Value::as_str) {
            let ptr = r.strip_prefix('#').expect("local $ref");
            v = doc
                .pointer(ptr)
                .unwrap_or_else(|| panic!("$ref {r} resolves"));
        }
        v
    }

    fn operations(doc: &Value) -> Vec<(String, String, &Value)> {
        let mut out = Vec::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("path item") {
                assert!(
                    METHODS.contains(&method.as_str()),
                    "{path}: unexpected key {method}"
                );
                out.push((path.clone(), method.clone(), op));
            }
        }
        out
    }

    #[test]
    fn the_document_describes_exactly_the_routes_the_gateway_registers() {
        let doc = doc();
        let documented: BTreeSet<(String, String)> = operations(&doc)
            .into_iter()
            .map(|(p, m, _)| (p, m))
            .collect();
        let registered: BTreeSet<(String, String)> = endpoints()
            .iter()
            .map(|e| (e.path.to_owned(), e.verb.as_str().to_owned()))
            .collect();
        assert_eq!(
            documented.difference(&registered).collect::<Vec<_>>(),
            Vec::<&(String, String)>::new(),
            "documented but not served"
        );
        assert_eq!(
            registered.difference(&documented).collect::<Vec<_>>(),
            Vec::<&(String, String)>::new(),
            "served but not documented"
        );
        for e in endpoints() {
            let op = &doc["paths"][e.path][e.verb.as_str()];
            let keyed = op
                .get("security")
                .and_then(Value::as_array)
                .is_some_and(|s| !s.is_empty());
            assert_eq!(
                keyed,
                e.access != Access::Open,
                "{} {}: security in the document vs the gateway",
                e.verb.as_str(),
                e.path
            );
            let responses = op["responses"].as_object().expect("responses");
            assert!(responses.contains_key("200"), "{}: no 200", e.path);
            if keyed {
                assert!(responses.contains_key("401"), "{}: no 401", e.path);
            }
        }
    }

    #[test]
    fn the_document_is_openapi_3_1_of_this_version_and_every_ref_resolves() {
        let doc = doc();
        assert_eq!(doc["openapi"], "3.1.0");
        assert_eq!(doc["info"]["version"], env!("CARGO_PKG_VERSION"));
        fn walk(doc: &Value, v: &Value, n: &mut usize) {
            match v {
                Value::Object(m) => {
                    if m.contains_key("$ref") {
                        resolve(doc, v);
                        *n += 1;
                    }
                    m.values().for_each(|c| walk(doc, c, n));
                }
                Value::Array(a) => a.iter().for_each(|c| walk(doc, c, n)),
                _ => {}
            }
        }
        let mut refs = 0;
        walk(&doc, &doc, &mut refs);
        assert!(refs > 20, "{refs} refs");
        let schemes = &doc["components"]["securitySchemes"]["bearerAuth"];
        assert_eq!(schemes["type"], "http");
        assert_eq!(schemes["scheme"], "bearer");
    }

    fn allows_null(doc: &Value, s: &Value) -> bool {
        let s = resolve(doc, s);
        match &s["type"] {
            Value::String(t) => t == "null",
            Value::Array(ts) => ts.iter().any(|t| t == "null"),
            _ => s["oneOf"]
                .as_array()
                .is_some_and(|b| b.iter().any(|b| allows_null(doc, b))),
        }
    }

    fn types(doc: &Value, s: &Value) -> Vec<String> {
        match &resolve(doc, s)["type"] {
            Value::String(t) => vec![t.clone()],
            Value::Array(ts) => ts
                .iter()
                .filter_map(|t| t.as_str().map(str::to_owned))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The request body's example with `field` set to the raw JSON text
    /// `value` (or removed when `None`).
    fn with_field(example: &Value, field: &str, value: Option<&str>) -> String {
        let mut base = example.clone();
        let obj = base.as_object_mut().expect("example object");
        obj.remove(field);
        let rest = serde_json::to_string(&base).expect("json");
        match value {
            None => rest,
            Some(v) => {
                let inner = rest
                    .strip_prefix('{')
                    .and_then(|r| r.strip_suffix('}'))
                    .expect("an object");
                let sep = if inner.is_empty() { "" } else { "," };
                format!("{{\"{field}\":{v}{sep}{inner}}}")
            }
        }
    }

    fn number_text(n: &Value, delta: i8, integer: bool) -> String {
        if integer {
            let b = n
                .as_u64()
                .map(i128::from)
                .or_else(|| n.as_i64().map(i128::from))
                .expect("integer bound");
            return (b + i128::from(delta)).to_string();
        }
        let b = n.as_f64().expect("number bound");
        let step = (b.abs() * 1e-9).max(1e-300);
        format!("{:e}", b + f64::from(delta) * step)
    }

    /// Every bound the document states for a request field, probed through
    /// `validate` at and just past the bound: the document may claim
    /// nothing the gateway does not enforce, and refuse nothing it accepts.
    fn probe(chat: bool, schema_name: &str, path: &str) {
        let doc = doc();
        let r = router(false);
        let example =
            &doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["example"];
        let check = |body: &str, accept: bool, what: &str| {
            let got = validate(&r, chat, body.as_bytes());
            match (&got, accept) {
                (Ok(_), true) | (Err(Rejection::Invalid { .. }), false) => {}
                _ => panic!(
                    "{path} {what}: document says {}, validate gave {:?} for {body}",
                    if accept { "accepted" } else { "refused" },
                    got.map(|_| ())
                ),
            }
        };
        check(&example.to_string(), true, "example");
        for bad in ["null", "[]", "\"x\"", "1", "{"] {
            check(bad, false, "not an object");
        }
        check(
            &with_field(example, "an_unknown_field", Some("{\"x\":1}")),
            false,
            "unknown field",
        );
        let schema = resolve(&doc, &doc["components"]["schemas"][schema_name]);
        let required: Vec<&str> = schema["required"]
            .as_array()
            .expect("required")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let mut probes = 0;
        for (field, prop) in schema["properties"].as_object().expect("properties") {
            let s = resolve(&doc, prop);
            let req = required.contains(&field.as_str());
            if req {
                check(
                    &with_field(example, field, None),
                    false,
                    &format!("{field} missing"),
                );
            }
            check(
                &with_field(example, field, Some("null")),
                allows_null(&doc, s) && !req,
                &format!("{field}: null"),
            );
            let ts = types(&doc, s);
            let integer = ts.iter().any(|t| t == "integer");
            if integer || ts.iter().any(|t| t == "number") {
                check(
                    &with_field(example, field, Some("\"1\"")),
                    false,
                    &format!("{field}: a string"),
                );
            }
            if ts.iter().any(|t| t == "string") {
                check(
                    &with_field(example, field, Some("7")),
                    false,
                    &format!("{field}: a number"),
                );
            }
            if ts.iter().any(|t| t == "boolean") {
                check(
                    &with_field(example, field, Some("true")),
                    true,
                    &format!("{field}: true"),
                );
                check(
                    &with_field(example, field, Some("1")),
                    false,
                    &format!("{field}: 1"),
                );
            }
            for (key, delta_in, delta_out) in [
                ("minimum", 0, -1),
                ("maximum", 0, 1),
                ("exclusiveMinimum", 1, 0),
                ("exclusiveMaximum", -1, 0),
            ] {
                if let Some(b) = s.get(key) {
                    let inside = number_text(b, delta_in, integer);
                    let outside = number_text(b, delta_out, integer);
                    check(
                        &with_field(example, field, Some(&inside)),
                        true,
                        &format!("{field}: {key} {b}, {inside}"),
                    );
                    check(
                        &with_field(example, field, Some(&outside)),
                        false,
                        &format!("{field}: {key} {b}, {outside}"),
                    );
                    probes += 1;
                }
            }
            let arrays: Vec<&Value> = std::iter::once(s)
                .chain(s["oneOf"].as_array().into_iter().flatten())
                .map(|b| resolve(&doc, b))
                .filter(|b| b["type"] == "array")
                .collect();
            let strings = std::iter::once(s)
                .chain(s["oneOf"].as_array().into_iter().flatten())
                .map(|b| resolve(&doc, b))
                .filter(|b| b["type"] == "string");
            for st in strings {
                if let Some(min) = st["minLength"].as_u64().filter(|&m| m > 0) {
                    let at = "x".repeat(usize::try_from(min).expect("small"));
                    let short = &at[1..];
                    check(
                        &with_field(example, field, Some(&json!(at).to_string())),
                        true,
                        &format!("{field}: minLength {min}"),
                    );
                    check(
                        &with_field(example, field, Some(&json!(short).to_string())),
                        false,
                        &format!("{field}: minLength {min}"),
                    );
                    probes += 1;
                }
            }
            for a in arrays {
                let items = resolve(&doc, &a["items"]);
                if let Some(min) = items["minLength"].as_u64().filter(|&m| m > 0) {
                    let short = "x".repeat(usize::try_from(min - 1).expect("small"));
                    let n = a["minItems"].as_u64().unwrap_or(0).max(1);
                    let v = vec![json!(short); usize::try_from(n).expect("small")];
                    check(
                        &with_field(example, field, Some(&Value::from(v).to_string())),
                        false,
                        &format!("{field}: items minLength {min}"),
                    );
                    probes += 1;
                }
                let item = match items["type"].as_str() {
                    Some("string") => json!("x"),
                    Some("integer") => json!(1),
                    Some("object") => json!({"role": "user", "content": "hi"}),
                    // A batch of token-id prompts.
                    Some("array") => json!([1]),
                    other => panic!("{field}: items of type {other:?}"),
                };
                let of = |n: u64| {
                    let v = vec![item.clone(); usize::try_from(n).expect("small")];
                    with_field(example, field, Some(&Value::from(v).to_string()))
                };
                if let Some(min) = a["minItems"].as_u64() {
                    check(&of(min), true, &format!("{field}: minItems {min}"));
                    if min > 0 {
                        check(&of(min - 1), false, &format!("{field}: minItems {min}"));
                    }
                    probes += 1;
                }
                if let Some(max) = a["maxItems"].as_u64() {
                    check(&of(max), true, &format!("{field}: maxItems {max}"));
                    check(&of(max + 1), false, &format!("{field}: maxItems {max}"));
                    probes += 1;
                }
            }
        }
        assert!(probes >= 8, "{path}: only {probes} bounds probed");
    }

    /// The keywords the document's response schemas use, checked the JSON
    /// Schema way; `Err` names the first violation.
    fn conforms(doc: &Value, s: &Value, v: &Value, at: &str) -> Result<(), String> {
        let s = resolve(doc, s);
        let fail = |what: String| Err(format!("{at}: {what} (value {v})"));
        let ty_ok = |t: &str| match t {
            "null" => v.is_null(),
            "string" => v.is_string(),
            "integer" => v.is_u64() || v.is_i64(),
            "number" => v.is_number(),
            "boolean" => v.is_boolean(),
            "object" => v.is_object(),
            "array" => v.is_array(),
            other => panic!("type {other}"),
        };
        match &s["type"] {
            Value::String(t) if !ty_ok(t) => return fail(format!("not of type {t}")),
            Value::Array(ts) if !ts.iter().filter_map(Value::as_str).any(ty_ok) => {
                return fail(format!("not of types {ts:?}"))
            }
            _ => {}
        }
        if let Some(c) = s.get("const") {
            if c != v {
                return fail(format!("not {c}"));
            }
        }
        if let Some(e) = s["enum"].as_array() {
            if !e.contains(v) {
                return fail(format!("not one of {e:?}"));
            }
        }
        if let (Some(min), Some(t)) = (s["minLength"].as_u64(), v.as_str()) {
            if (t.chars().count() as u64) < min {
                return fail(format!("shorter than {min}"));
            }
        }
        if let Some(branches) = s["oneOf"].as_array() {
            let ok = branches
                .iter()
                .filter(|b| conforms(doc, b, v, at).is_ok())
                .count();
            if ok != 1 {
                return fail(format!("{ok} oneOf branches match"));
            }
        }
        if let Some(obj) = v.as_object() {
            let props = s["properties"].as_object();
            for r in s["required"].as_array().into_iter().flatten() {
                let r = r.as_str().expect("required name");
                if !obj.contains_key(r) {
                    return fail(format!("{r} missing"));
                }
            }
            for (k, x) in obj {
                match props.and_then(|p| p.get(k)) {
                    Some(ps) => conforms(doc, ps, x, &format!("{at}.{k}"))?,
                    None if s["additionalProperties"] == false => {
                        return fail(format!("{k} is not allowed"))
                    }
                    None => {}
                }
            }
        }
        Ok(())
    }

    /// Every refusal and failure the router's error type turns into HTTP
    /// has its status documented on the generation routes, with a schema
    /// its body conforms to; every failure after dispatch, as an SSE
    /// event, conforms to the stream's error schema.
    #[test]
    fn every_error_the_router_returns_is_documented() {
        use crate::error::GatewayError;
        use axum::response::IntoResponse;
        let doc = doc();
        // Left out: a node's INVALID_ARGUMENT and a decode refusal of the
        // request's own (400, server_error). Past validation and admission
        // no node refuses a request as invalid, so the document keeps 400
        // for the gateway's own refusals, and a schemathesis run flags any
        // that reaches a node (as the empty prompt did). Also left out: the
        // fault-injection header's refusal and injected faults (testing
        // builds only).
        let kinds: Vec<GatewayError> = crate::error::tests::every_kind()
            .into_iter()
            .map(|k| k.0)
            .filter(|e| {
                let dispatch_400 = matches!(e, GatewayError::Dispatch(_))
                    && e.status() == axum::http::StatusCode::BAD_REQUEST;
                let testing = matches!(e.code(), "invalid_fault_spec" | "injected_fault");
                !dispatch_400 && !testing
            })
            .collect();
        assert!(kinds.len() >= 15, "{} kinds", kinds.len());
        let stream_error = &doc["components"]["schemas"]["StreamError"];
        for e in kinds
            .iter()
            .filter(|e| matches!(e, GatewayError::Dispatch(_)))
        {
            conforms(&doc, stream_error, &e.body(), "event")
                .unwrap_or_else(|err| panic!("SSE {e:?}: {err}"));
        }
        let mut responses: Vec<(String, axum::response::Response)> = kinds
            .into_iter()
            .map(|e| (format!("{e:?}"), e.into_response()))
            .collect();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let documented = &doc["paths"][path]["post"]["responses"];
            for (what, resp) in &mut responses {
                let status = resp.status().as_u16().to_string();
                let schema = &documented[&status]["content"]["application/json"]["schema"];
                assert!(
                    !schema.is_null(),
                    "{path}: {what} gives {status}, not documented as JSON"
                );
                let body = std::mem::take(resp.body_mut());
                let bytes = rt
                    .block_on(axum::body::to_bytes(body, 1 << 20))
                    .expect("body");
                let v: Value = serde_json::from_slice(&bytes).expect("JSON body");
                conforms(&doc, schema, &v, "body")
                    .unwrap_or_else(|e| panic!("{path}: {what} ({status}): {e}"));
                *resp.body_mut() = axum::body::Body::from(bytes);
            }
        }
    }

    #[test]
    fn completion_request_bounds_are_those_validate_enforces() {
        probe(false, "CompletionRequest", "/v1/completions");
    }

    #[test]
    fn chat_request_bounds_are_those_validate_enforces() {
        probe(true, "ChatCompletionRequest", "/v1/chat/completions");
    }

    async fn call(
        addr: &str,
        method: &str,
        path: &str,
        auth: bool,
        body: &str,
    ) -> (u16, String, String) {
        let s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let auth = if auth {
            "Authorization: Bearer k-test\r\n"
        } else {
            ""
        };
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        // Written on its own task: a refused body may be answered (and the
        // connection closed) before all of it is sent.
        let (mut rd, mut wr) = s.into_split();
        let writer = tokio::spawn(async move { wr.write_all(req.as_bytes()).await });
        let mut raw = Vec::new();
        let read = rd.read_to_end(&mut raw).await;
        assert!(read.is_ok() || !raw.is_empty(), "no response: {read:?}");
        let _ = writer.await;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .expect("status");
        let content_type = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-type")
                    .then(|| v.trim().to_owned())
            })
            .unwrap_or_default();
        (status, content_type, body.to_owned())
    }

    /// The real axum router on loopback: each documented route answers
    /// (keyed ones 401 without a key and past authentication with one), the
    /// document is served as it is committed, and an undocumented path is
    /// not served.
    #[tokio::test]
    async fn the_gateway_serves_the_documented_routes_and_the_document() {
        let r = router(true);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let app = r.http();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let doc = doc();
        for e in endpoints() {
            let method = e.verb.as_str().to_ascii_uppercase();
            let example = doc["paths"][e.path][e.verb.as_str()]["requestBody"]["content"]
                ["application/json"]["example"]
                .to_string();
            let body = if method == "POST" {
                example.as_str()
            } else {
                ""
            };
            let (anon, ct, text) = call(&addr, &method, e.path, false, body).await;
            let (keyed, _, _) = call(&addr, &method, e.path, true, body).await;
            let documented = doc["paths"][e.path][e.verb.as_str()]["responses"]
                .as_object()
                .expect("responses");
            for status in [anon, keyed] {
                assert!(
                    documented.contains_key(&status.to_string()),
                    "{method} {}: {status} is not documented",
                    e.path
                );
            }
            match e.access {
                Access::ApiKey => {
                    assert_eq!(anon, 401, "{method} {}", e.path);
                    assert_eq!(ct, "application/json");
                    let v: Value = serde_json::from_str(&text).expect("401 body");
                    assert_eq!(v["error"]["code"], "invalid_api_key");
                    assert_ne!(keyed, 401, "{method} {}", e.path);
                }
                // The test's key has the inference scope only.
                Access::Metrics => {
                    assert_eq!((anon, keyed), (401, 403), "{method} {}", e.path);
                }
                Access::Open => assert_eq!(anon, keyed, "{method} {}", e.path),
            }
        }
        // No nodes: the POSTs got past validation into admission.
        let (status, _, _) =
            call(&addr, "POST", "/v1/completions", true, r#"{"prompt":"hi"}"#).await;
        assert_eq!(status, 503);
        let (status, ct, body) = call(&addr, "GET", "/openapi.json", false, "").await;
        assert_eq!((status, ct.as_str()), (200, "application/json"));
        assert_eq!(body, DOCUMENT);
        let (status, _, _) = call(&addr, "GET", "/v1/undocumented", true, "").await;
        assert_eq!(status, 404);
        server.abort();
    }

    /// A body over the size limit is refused with the document's error
    /// shape, not axum's plain text.
    #[tokio::test]
    async fn an_oversized_body_gets_a_json_413() {
        let r = router(false);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let app = r.http();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let big = format!("{{\"prompt\":\"{}\"}}", "a".repeat(3 << 20));
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let (status, ct, body) = call(&addr, "POST", path, false, &big).await;
            assert_eq!((status, ct.as_str()), (413, "application/json"), "{path}");
            let v: Value = serde_json::from_str(&body).expect("413 body");
            assert_eq!(v["error"]["code"], "invalid_body");
            assert!(doc()["paths"][path]["post"]["responses"]
                .as_object()
                .expect("responses")
                .contains_key("413"));
        }
        server.abort();
    }
}
