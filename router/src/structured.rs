//! Structured output at the gateway: OpenAI's `response_format` and vLLM's
//! `structured_outputs` read into one [`Constraint`] (the gRPC API builds
//! one from its own message), and the constraint compiled once here over
//! the model's vocabulary, so that a grammar or schema llguidance refuses
//! is a 400 naming the field, before anything is admitted. What the nodes
//! get is the compiled grammar's wire form (`Sampling.grammar`); each
//! compiles it again over its own model.
//!
//! Every key of either object is known or refused by name, as the body's
//! own fields are.

use kvmesh_structured::{Constraint, StructuredError};
use serde_json::{Map, Value};

use crate::error::Rejection;
use crate::validate::invalid;
use crate::Router;

/// A request's constraint and the field it came from (a refusal's
/// `param`).
#[derive(Clone, Debug, PartialEq)]
pub struct Structured {
    /// What the output must match.
    pub constraint: Constraint,
    /// `response_format`, `structured_outputs` or `structured_output`
    /// (gRPC).
    pub param: &'static str,
}

/// Characters a `json_schema.name` may have at most (OpenAI's).
const MAX_NAME: usize = 64;

/// The constraint of a body's `response_format` and `structured_outputs`
/// (at most one of them may constrain).
pub(crate) fn from_body(
    response_format: Option<Value>,
    structured_outputs: Option<Value>,
) -> Result<Option<Structured>, Rejection> {
    let rf = response_format.map(self::response_format).transpose()?;
    let so = structured_outputs
        .map(self::structured_outputs)
        .transpose()?;
    match (rf.flatten(), so) {
        (Some(_), Some(_)) => Err(invalid(
            "structured_outputs",
            "structured_outputs and a response_format other than text cannot be combined: send one",
        )),
        (Some(c), None) => Ok(Some(Structured {
            constraint: c,
            param: "response_format",
        })),
        (None, Some(c)) => Ok(Some(Structured {
            constraint: c,
            param: "structured_outputs",
        })),
        (None, None) => Ok(None),
    }
}

/// The constraint of the gRPC API's `structured_output` (a message with
/// no kind set is no constraint).
pub(crate) fn from_grpc(
    s: Option<kvmesh_proto::v1::StructuredOutput>,
) -> Result<Option<Structured>, Rejection> {
    use kvmesh_proto::v1::structured_output::Kind;
    const P: &str = "structured_output";
    let constraint = match s.and_then(|s| s.kind) {
        None => return Ok(None),
        Some(Kind::JsonSchema(text)) => {
            Constraint::JsonSchema(serde_json::from_str(&text).map_err(|e| {
                invalid(P, format!("structured_output.json_schema is not JSON: {e}"))
            })?)
        }
        Some(Kind::JsonObject(true)) => Constraint::JsonObject,
        Some(Kind::JsonObject(false)) => {
            return Err(invalid(
                P,
                "structured_output.json_object must be true when set",
            ))
        }
        Some(Kind::Regex(rx)) => Constraint::Regex(rx),
        Some(Kind::Choice(c)) => Constraint::Choice(c.options),
        Some(Kind::Grammar(g)) => Constraint::Lark(g),
    };
    Ok(Some(Structured {
        constraint,
        param: P,
    }))
}

/// `v` as an object whose keys are all in `known`, else the refusal of
/// `param` naming what is wrong.
fn object(
    param: &'static str,
    what: &str,
    v: Value,
    known: &[&str],
) -> Result<Map<String, Value>, Rejection> {
    let Value::Object(m) = v else {
        return Err(invalid(param, format!("{what} must be an object")));
    };
    if let Some(k) = m.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(invalid(
            param,
            format!(
                "{what}: unsupported field `{}` (known: {})",
                k.chars().take(64).collect::<String>(),
                known.join(", ")
            ),
        ));
    }
    Ok(m)
}

/// OpenAI's `response_format`: `{"type": "text"}` (no constraint),
/// `{"type": "json_object"}`, or `{"type": "json_schema", "json_schema":
/// {"name", "description", "schema", "strict"}}`. `strict` is accepted
/// either way: the schema is always enforced.
fn response_format(v: Value) -> Result<Option<Constraint>, Rejection> {
    const P: &str = "response_format";
    let mut m = object(P, P, v, &["type", "json_schema"])?;
    let kind = m.get("type").and_then(Value::as_str).unwrap_or_default();
    if kind != "json_schema" && m.contains_key("json_schema") {
        return Err(invalid(
            P,
            "response_format.json_schema is only for type json_schema",
        ));
    }
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(Constraint::JsonObject)),
        "json_schema" => {
            let js = m.remove("json_schema").ok_or_else(|| {
                invalid(P, "response_format of type json_schema needs json_schema")
            })?;
            let js = object(
                P,
                "response_format.json_schema",
                js,
                &["name", "description", "schema", "strict"],
            )?;
            match js.get("name") {
                Some(Value::String(n))
                    if !n.is_empty()
                        && n.chars().count() <= MAX_NAME
                        && n
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') => {}
                _ => {
                    return Err(invalid(
                        P,
                        format!("response_format.json_schema.name must be 1 to {MAX_NAME} of a-z, A-Z, 0-9, _ and -"),
                    ))
                }
            }
            if !matches!(js.get("description"), None | Some(Value::String(_))) {
                return Err(invalid(
                    P,
                    "response_format.json_schema.description must be a string",
                ));
            }
            if !matches!(js.get("strict"), None | Some(Value::Bool(_) | Value::Null)) {
                return Err(invalid(
                    P,
                    "response_format.json_schema.strict must be true or false",
                ));
            }
            // No schema: any JSON value (OpenAI's schema is optional).
            let schema = match js.get("schema") {
                None | Some(Value::Null) => Value::Bool(true),
                Some(s) => s.clone(),
            };
            Ok(Some(Constraint::JsonSchema(schema)))
        }
        _ => Err(invalid(
            P,
            "response_format.type must be text, json_object or json_schema",
        )),
    }
}

/// vLLM's `structured_outputs`: exactly one of `json` (a schema, as an
/// object or as JSON text), `json_object` (true), `regex`, `choice` (a
/// list of strings), `grammar` (Lark, llguidance's dialect).
fn structured_outputs(v: Value) -> Result<Constraint, Rejection> {
    const P: &str = "structured_outputs";
    let m = object(
        P,
        P,
        v,
        &["json", "json_object", "regex", "choice", "grammar"],
    )?;
    let set: Vec<(&String, &Value)> = m.iter().filter(|(_, v)| !v.is_null()).collect();
    let [(key, v)] = set.as_slice() else {
        return Err(invalid(
            P,
            "structured_outputs needs exactly one of json, json_object, regex, choice, grammar",
        ));
    };
    let string = |v: &Value| match v {
        Value::String(s) => Ok(s.clone()),
        _ => Err(invalid(
            P,
            format!("structured_outputs.{key} must be a string"),
        )),
    };
    match key.as_str() {
        "json" => match v {
            Value::String(text) => serde_json::from_str(text)
                .map(Constraint::JsonSchema)
                .map_err(|e| invalid(P, format!("structured_outputs.json is not JSON: {e}"))),
            v => Ok(Constraint::JsonSchema((*v).clone())),
        },
        "json_object" => match v {
            Value::Bool(true) => Ok(Constraint::JsonObject),
            _ => Err(invalid(P, "structured_outputs.json_object must be true")),
        },
        "regex" => string(v).map(Constraint::Regex),
        "grammar" => string(v).map(Constraint::Lark),
        _ => match v {
            Value::Array(a) if a.iter().all(Value::is_string) => Ok(Constraint::Choice(
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect(),
            )),
            _ => Err(invalid(
                P,
                "structured_outputs.choice must be a list of strings",
            )),
        },
    }
}

/// The grammar the nodes get for `s`, compiled here first: llguidance's
/// refusal is a 400 naming `s.param` with the library's message.
pub(crate) fn compile(r: &Router, s: &Structured) -> Result<String, Rejection> {
    let refused = |e: StructuredError| match e {
        StructuredError::Refused(m) => invalid(
            s.param,
            format!(
                "{}: refused by the grammar compiler (llguidance): {m}",
                s.param
            ),
        ),
        unavailable => invalid(s.param, unavailable.to_string()),
    };
    // A constraint with no grammar (an empty choice, a schema that is not
    // an object) is refused before the library sees it.
    let wire = s
        .constraint
        .grammar()
        .map_err(|e| invalid(s.param, format!("{}: {e}", s.param)))?;
    r.vocabulary()
        .and_then(|v| v.compile(&wire))
        .map_err(refused)?;
    Ok(wire)
}

#[cfg(test)]
mod tests;
