//! Tools (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`, as vLLM
//! serves them) for every front end: the HTTP body and the gRPC message
//! are read into one [`Tools`], checked here, and what it means for the
//! request is decided here too:
//!
//! - the definitions go to the chat template (`kvmesh_tokenizer`'s
//!   `encode_chat_tools`, which renders them the Hermes way for a template
//!   that does not read `tools`);
//! - `required` and a named function become a structured-output
//!   [`Constraint`] (vLLM's: the named function's parameters schema; for
//!   `required` an array of at least one `{name, parameters}` object, one
//!   `anyOf` branch per tool), so the output always parses into calls;
//! - `auto` parses calls out of the text in the served model's format
//!   ([`parsers`]: `hermes`, `llama3_json`, `mistral`, chosen by
//!   [`crate::parsing`]); `none` still shows the tools to the model
//!   (vLLM's default since 0.10) and parses nothing.
//!
//! Submodules: `parsers` (one module per format of calls in text),
//! `parse` (a choice's text to reasoning, content and calls, whole or
//! streamed).

use kvmesh_structured::Constraint;
use serde_json::{json, Map, Value};

use crate::error::Rejection;
use crate::validate::invalid;

pub mod parse;
pub mod parsers;

/// Tools a request may define at most (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// Characters a function name may have at most (OpenAI's).
const MAX_NAME: usize = 64;

/// One function tool.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    /// 1 to 64 of a-z, A-Z, 0-9, `_` and `-`; unique in a request.
    pub name: String,
    /// What it does, for the model.
    pub description: Option<String>,
    /// A JSON schema of an object (`{"type": "object", "properties": {}}`
    /// when none was given).
    pub parameters: Value,
    /// OpenAI's `strict`: accepted either way (a constrained choice always
    /// enforces the schema; `auto` never does, as in vLLM).
    pub strict: Option<bool>,
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Text only; the tools are still shown to the model.
    None,
    /// The model chooses; calls are parsed from its text.
    Auto,
    /// At least one call, enforced by the grammar.
    Required,
    /// One call of this function, enforced by the grammar.
    Named(String),
}

/// A request's tools, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    /// The definitions (at least one unless the choice is `none`).
    pub defs: Vec<Tool>,
    /// `tool_choice` (default `auto` with tools, `none` without).
    pub choice: Choice,
    /// `parallel_tool_calls` (default true); false keeps the first call.
    pub parallel: bool,
}

/// How a choice's text becomes the answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// Text as it is.
    #[default]
    Text,
    /// Calls parsed out of the text in the served model's format
    /// ([`parsers`]); `parallel`: keep every call, else the first.
    Auto { parallel: bool },
    /// The whole text is the arguments of one call of this function.
    Named(String),
    /// The whole text is a JSON array of `{name, parameters}`.
    Required,
}

impl Tools {
    /// The definitions as the chat template gets them (transformers'
    /// `{"type": "function", "function": {...}}`).
    pub fn rendered(&self) -> Vec<Value> {
        self.defs
            .iter()
            .map(|t| {
                let mut f = Map::new();
                f.insert("name".into(), t.name.clone().into());
                if let Some(d) = &t.description {
                    f.insert("description".into(), d.clone().into());
                }
                f.insert("parameters".into(), t.parameters.clone());
                json!({"type": "function", "function": f})
            })
            .collect()
    }

    /// What the output must match, for `required` and a named function.
    pub fn constraint(&self) -> Option<Constraint> {
        match &self.choice {
            Choice::None | Choice::Auto => None,
            Choice::Named(name) => self
                .defs
                .iter()
                .find(|t| &t.name == name)
                .map(|t| Constraint::JsonSchema(t.parameters.clone())),
            Choice::Required => {
                let branches: Vec<Value> = self
                    .defs
                    .iter()
                    .map(|t| {
                        json!({
                            "type": "object",
                            "properties": {
                                "name": {"type": "string", "enum": [t.name]},
                                "parameters": t.parameters,
                            },
                            "required": ["name", "parameters"],
                            // Else the grammar lets the model add keys of
                            // its own after the call, until the budget.
                            "additionalProperties": false,
                        })
                    })
                    .collect();
                let mut array =
                    json!({"type": "array", "minItems": 1, "items": {"anyOf": branches}});
                if !self.parallel {
                    array["maxItems"] = json!(1);
                }
                Some(Constraint::JsonSchema(array))
            }
        }
    }

    /// How the output is read.
    pub fn mode(&self) -> Mode {
        match &self.choice {
            Choice::None => Mode::Text,
            Choice::Auto => Mode::Auto {
                parallel: self.parallel,
            },
            Choice::Required => Mode::Required,
            Choice::Named(n) => Mode::Named(n.clone()),
        }
    }
}

/// The tools of an HTTP body: `tools`, `tool_choice`,
/// `parallel_tool_calls` (all absent: none).
pub(crate) fn from_body(
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel: Option<bool>,
) -> Result<Option<Tools>, Rejection> {
    let defs = match tools {
        None => None,
        Some(Value::Array(a)) => Some(
            a.into_iter()
                .enumerate()
                .map(|(i, t)| tool_in(i, t))
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Some(_) => return Err(invalid("tools", "tools must be a list of function tools")),
    };
    let choice = tool_choice.map(choice_in).transpose()?;
    assemble(defs, choice, parallel)
}

/// The tools of a gRPC request.
pub(crate) fn from_grpc(
    tools: Vec<kvmesh_proto::v1::Tool>,
    choice: Option<kvmesh_proto::v1::ToolChoice>,
    parallel: Option<bool>,
) -> Result<Option<Tools>, Rejection> {
    use kvmesh_proto::v1::tool_choice::Kind;
    use kvmesh_proto::v1::ToolChoiceMode;
    let defs = (!tools.is_empty())
        .then(|| {
            tools
                .into_iter()
                .enumerate()
                .map(|(i, t)| {
                    let parameters = if t.parameters.is_empty() {
                        None
                    } else {
                        Some(serde_json::from_str(&t.parameters).map_err(|e| {
                            invalid("tools", format!("tools[{i}].parameters is not JSON: {e}"))
                        })?)
                    };
                    checked(
                        i,
                        t.name,
                        (!t.description.is_empty()).then_some(t.description),
                        parameters,
                        t.strict,
                    )
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    let choice = match choice.and_then(|c| c.kind) {
        None => None,
        Some(Kind::Mode(m)) => match ToolChoiceMode::try_from(m) {
            Ok(ToolChoiceMode::Auto) => Some(Choice::Auto),
            Ok(ToolChoiceMode::None) => Some(Choice::None),
            Ok(ToolChoiceMode::Required) => Some(Choice::Required),
            Ok(ToolChoiceMode::Unspecified) => None,
            Err(_) => {
                return Err(invalid(
                    "tool_choice",
                    format!("tool_choice.mode {m} is not a ToolChoiceMode"),
                ))
            }
        },
        Some(Kind::Function(name)) => Some(Choice::Named(name)),
    };
    assemble(defs, choice, parallel)
}

/// The one set of cross-field rules of both front ends.
fn assemble(
    defs: Option<Vec<Tool>>,
    choice: Option<Choice>,
    parallel: Option<bool>,
) -> Result<Option<Tools>, Rejection> {
    let Some(defs) = defs else {
        return match (choice, parallel) {
            (None | Some(Choice::None), None) => Ok(None),
            (Some(c), _) if c != Choice::None => Err(invalid(
                "tool_choice",
                "tool_choice other than none needs tools",
            )),
            _ => Err(invalid(
                "parallel_tool_calls",
                "parallel_tool_calls is only allowed with tools",
            )),
        };
    };
    if defs.is_empty() {
        return Err(invalid("tools", "tools must not be an empty list"));
    }
    if defs.len() > MAX_TOOLS {
        return Err(invalid(
            "tools",
            format!("at most {MAX_TOOLS} tools in one request"),
        ));
    }
    for (i, t) in defs.iter().enumerate() {
        if defs[..i].iter().any(|u| u.name == t.name) {
            return Err(invalid(
                "tools",
                format!(
                    "tools[{i}]: the function name `{}` is defined twice",
                    t.name
                ),
            ));
        }
    }
    let choice = choice.unwrap_or(Choice::Auto);
    if let Choice::Named(name) = &choice {
        if !defs.iter().any(|t| &t.name == name) {
            return Err(invalid(
                "tool_choice",
                format!(
                    "tool_choice names the function `{}`, which is not in tools",
                    name.chars().take(64).collect::<String>()
                ),
            ));
        }
    }
    Ok(Some(Tools {
        defs,
        choice,
        parallel: parallel.unwrap_or(true),
    }))
}

/// `tools[i]` of a body: `{"type": "function", "function": {"name",
/// "description", "parameters", "strict"}}`.
fn tool_in(i: usize, t: Value) -> Result<Tool, Rejection> {
    let bad = |what: &str| invalid("tools", format!("tools[{i}]: {what}"));
    let Value::Object(mut t) = t else {
        return Err(bad("must be an object"));
    };
    if let Some(k) = t
        .keys()
        .find(|k| !["type", "function"].contains(&k.as_str()))
    {
        return Err(bad(&format!(
            "unsupported field `{}` (known: type, function)",
            k.chars().take(64).collect::<String>()
        )));
    }
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad("type must be function (the only tool type served)"));
    }
    let Some(Value::Object(mut f)) = t.remove("function") else {
        return Err(bad("function must be an object"));
    };
    const KNOWN: [&str; 4] = ["name", "description", "parameters", "strict"];
    if let Some(k) = f.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(bad(&format!(
            "function: unsupported field `{}` (known: {})",
            k.chars().take(64).collect::<String>(),
            KNOWN.join(", ")
        )));
    }
    let name = match f.remove("name") {
        Some(Value::String(n)) => n,
        _ => return Err(bad("function.name must be a string")),
    };
    let description = match f.remove("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d),
        Some(_) => return Err(bad("function.description must be a string")),
    };
    let strict = match f.remove("strict") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(b),
        Some(_) => return Err(bad("function.strict must be true or false")),
    };
    let parameters = match f.remove("parameters") {
        None | Some(Value::Null) => None,
        Some(p) => Some(p),
    };
    checked(i, name, description, parameters, strict)
}

/// A tool whose name and parameters are checked.
fn checked(
    i: usize,
    name: String,
    description: Option<String>,
    parameters: Option<Value>,
    strict: Option<bool>,
) -> Result<Tool, Rejection> {
    let bad = |what: String| invalid("tools", format!("tools[{i}]: {what}"));
    if name.is_empty()
        || name.chars().count() > MAX_NAME
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(bad(format!(
            "function.name must be 1 to {MAX_NAME} of a-z, A-Z, 0-9, _ and -"
        )));
    }
    let parameters =
        match parameters {
            None => json!({"type": "object", "properties": {}}),
            Some(Value::Object(p)) => {
                match p.get("type") {
                    None => {}
                    Some(Value::String(t)) if t == "object" => {}
                    Some(_) => return Err(bad(
                        "function.parameters must be the JSON schema of an object (type object)"
                            .into(),
                    )),
                }
                Value::Object(p)
            }
            Some(_) => {
                return Err(bad(
                    "function.parameters must be a JSON schema (an object)".into()
                ))
            }
        };
    Ok(Tool {
        name,
        description,
        parameters,
        strict,
    })
}

/// A body's `tool_choice`: `"none"`, `"auto"`, `"required"` or
/// `{"type": "function", "function": {"name"}}`.
fn choice_in(v: Value) -> Result<Choice, Rejection> {
    const WANT: &str = "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}";
    match v {
        Value::String(s) => match s.as_str() {
            "none" => Ok(Choice::None),
            "auto" => Ok(Choice::Auto),
            "required" => Ok(Choice::Required),
            _ => Err(invalid("tool_choice", WANT)),
        },
        Value::Object(m) => {
            let known = m.keys().all(|k| k == "type" || k == "function");
            let name = m
                .get("function")
                .and_then(Value::as_object)
                .filter(|f| f.keys().all(|k| k == "name"))
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (known, m.get("type").and_then(Value::as_str), name) {
                (true, Some("function"), Some(n)) => Ok(Choice::Named(n.to_owned())),
                _ => Err(invalid("tool_choice", WANT)),
            }
        }
        _ => Err(invalid("tool_choice", WANT)),
    }
}

/// A fresh call id, `call_` and 24 hex digits (96 random bits; the clock
/// if the OS RNG fails: an id names a call, it is not a secret).
pub fn call_id() -> String {
    let bytes = kvmesh_kvwire::ids::random_nonzero::<12>().unwrap_or_else(|_| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut b = [0u8; 12];
        b.copy_from_slice(&t.to_le_bytes()[..12]);
        b
    });
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("call_{hex}")
}

#[cfg(test)]
mod tests;
