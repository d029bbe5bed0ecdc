//! Chat templates: where a model keeps one, and rendering it the way
//! transformers does.
//!
//! transformers renders with Jinja2's sandbox, `trim_blocks=True`,
//! `lstrip_blocks=True`, Python string methods on values, a
//! `raise_exception(msg)` global, (since Llama 3.1) `strftime_now(fmt)`,
//! and its own `tojson` filter (Python's `json.dumps`). minijinja with
//! minijinja-contrib's Python compatibility covers the methods; the two
//! globals are defined here, the filter in `tojson`.

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::{Environment, ErrorKind, Value as JinjaValue};
use serde_json::Value;

use super::{invalid, ChatMessage, ChatOptions};

mod tojson;
use crate::error::{Result, TokenizerError};

/// `chat_template` of `tokenizer_config.json`: a string, or a list of
/// `{"name", "template"}` from which the one named `default` (else the
/// first) is used.
pub(super) fn template_from_config_value(path: &Path, v: &Value) -> Result<String> {
    let reason = "expected a string or a list of {\"name\", \"template\"} objects";
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(list) => {
            let named = |name: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
            };
            let chosen = named("default").or_else(|| list.first());
            match chosen
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
            {
                Some(s) => Ok(s.to_owned()),
                None => Err(invalid(path, "chat_template", v, reason)),
            }
        }
        other => Err(invalid(path, "chat_template", other, reason)),
    }
}

/// A template kept beside the tokenizer: `chat_template.jinja` (raw) or
/// `chat_template.json` (`{"chat_template": ...}`).
pub(super) fn template_from_side_files(dir: &Path) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    match std::fs::read_to_string(&jinja) {
        Ok(text) => return Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(TokenizerError::io(&jinja, e)),
    }
    let json = dir.join("chat_template.json");
    let text = match std::fs::read_to_string(&json) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(TokenizerError::io(&json, e)),
    };
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| TokenizerError::malformed(&json, format!("not valid JSON: {e}")))?;
    match value.get("chat_template") {
        Some(v) => template_from_config_value(&json, v).map(Some),
        None => Err(TokenizerError::MissingField {
            path: json,
            field: "chat_template".into(),
        }),
    }
}

/// Render `template` with transformers' variables: `messages`, `tools`
/// (when given), `add_generation_prompt`, `enable_thinking` (when set),
/// and `bos_token` / `eos_token` when the model names them (left undefined
/// otherwise, as transformers does).
pub(super) fn render(
    template: &str,
    messages: &[ChatMessage],
    tools: Option<&[Value]>,
    opts: ChatOptions,
    bos_token: Option<&str>,
    eos_token: Option<&str>,
) -> Result<String> {
    Compiled::new(template)?.render(messages, tools, opts, bos_token, eos_token)
}

/// A chat template compiled once, to render several conversations (the
/// conversation and its placeholder form in `chat_encode`). `strftime_now`
/// reads the clock once, when the template is compiled, so every rendering
/// of one `Compiled` sees the same date.
pub(super) struct Compiled<'source> {
    env: Environment<'source>,
}

impl<'source> Compiled<'source> {
    pub(super) fn new(template: &'source str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("raise_exception: {msg}"),
                ))
            },
        );
        env.add_filter("tojson", tojson::tojson);
        let now = unix_now();
        env.add_function("strftime_now", move |format: String| {
            strftime_utc(&format, now)
        });
        env.add_template("chat_template", template)
            .map_err(|e| TokenizerError::ChatTemplate {
                detail: format!("the template does not compile: {e}"),
            })?;
        Ok(Self { env })
    }

    /// The template's output for `messages` (and `tools`, for a template
    /// that reads them).
    pub(super) fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
        opts: ChatOptions,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<String> {
        let compiled =
            self.env
                .get_template("chat_template")
                .map_err(|e| TokenizerError::ChatTemplate {
                    detail: format!("the template does not compile: {e}"),
                })?;

        let mut ctx: BTreeMap<&str, JinjaValue> = BTreeMap::new();
        ctx.insert("messages", JinjaValue::from_serialize(messages));
        if let Some(tools) = tools {
            ctx.insert("tools", JinjaValue::from_serialize(tools));
        }
        ctx.insert(
            "add_generation_prompt",
            JinjaValue::from(opts.add_generation_prompt),
        );
        if let Some(on) = opts.enable_thinking {
            ctx.insert("enable_thinking", JinjaValue::from(on));
        }
        if let Some(t) = bos_token {
            ctx.insert("bos_token", JinjaValue::from(t));
        }
        if let Some(t) = eos_token {
            ctx.insert("eos_token", JinjaValue::from(t));
        }
        compiled
            .render(ctx)
            .map_err(|e| TokenizerError::ChatTemplate {
                detail: match e.detail() {
                    Some(d)
                        if e.kind() == ErrorKind::InvalidOperation
                            && d.starts_with("raise_exception: ") =>
                    {
                        format!(
                            "the template refused the conversation: {}",
                            &d["raise_exception: ".len()..]
                        )
                    }
                    _ => format!("rendering failed: {e}"),
                },
            })
    }
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Python's `strftime` for the directives chat templates use (`%d %b %Y`
/// in Llama 3.x), in UTC; an unknown directive is copied through.
pub(super) fn strftime_utc(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = WEEKDAYS[(days + 3).rem_euclid(7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01, by the
/// proleptic Gregorian calendar (Howard Hinnant's days-to-civil algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_matches_known_dates() {
        assert_eq!(strftime_utc("%d %b %Y", 0), "01 Jan 1970");
        // 2024-02-29T13:05:09Z, a Thursday.
        assert_eq!(
            strftime_utc("%Y-%m-%d %H:%M:%S %a %A %B %y %e %% %Q", 1_709_211_909),
            "2024-02-29 13:05:09 Thu Thursday February 24 29 % %Q"
        );
        assert_eq!(strftime_utc("%d %b %Y", 1_735_689_600), "01 Jan 2025");
        assert_eq!(strftime_utc("%d.%m.%Y", -86_400), "31.12.1969");
    }
}
