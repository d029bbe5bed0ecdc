//! The `tojson` filter as transformers defines it for chat templates:
//! Python's `json.dumps(x, ensure_ascii=False, indent=indent,
//! separators=separators, sort_keys=sort_keys)`.
//!
//! minijinja's own `tojson` writes compact JSON (`{"a":1}`) with `<`, `>`,
//! `&` and `'` escaped for HTML, so Qwen 2.5's tool definitions and tool
//! calls would render unlike transformers' (`{"a": 1}`, `<` as is), and
//! their ids would differ.
//!
//! Objects keep the order the client wrote their keys in, as Python's do
//! (serde_json and minijinja are built with `preserve_order` for this: a
//! tool's schema reordered is another prompt, and models answer it
//! differently); `sort_keys=true` sorts them at every level.

use minijinja::value::Kwargs;
use minijinja::{Error, ErrorKind, Value};
use serde::Serialize;
use serde_json::ser::Formatter;

/// `value | tojson`, `tojson(indent=2)`, `tojson(separators=[",", ":"])`.
pub(super) fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(" ".repeat(usize::try_from(v)?)),
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators = kwargs.get::<Option<Vec<String>>>("separators")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings (item, key)",
            ))
        }
        // Python drops the item separator's space when indenting.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let mut out = Vec::new();
    let formatter = PyFormatter {
        item: item.as_bytes(),
        key: key.as_bytes(),
        indent: indent.as_deref().map(str::as_bytes),
        level: 0,
        has_value: false,
    };
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    let written = if sort_keys {
        let mut v = serde_json::to_value(value).map_err(|e| {
            Error::new(
                ErrorKind::InvalidOperation,
                "tojson: cannot write the value as JSON",
            )
            .with_source(e)
        })?;
        sort_objects(&mut v);
        v.serialize(&mut ser)
    } else {
        value.serialize(&mut ser)
    };
    written.map_err(|e| {
        Error::new(
            ErrorKind::InvalidOperation,
            "tojson: cannot write the value as JSON",
        )
        .with_source(e)
    })?;
    let text = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, "tojson: not UTF-8").with_source(e))?;
    Ok(Value::from_safe_string(text))
}

/// Every object in `v` with its keys sorted (`sort_keys=True`).
fn sort_objects(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            m.sort_keys();
            m.values_mut().for_each(sort_objects);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(sort_objects),
        _ => {}
    }
}

/// Python's `json.dumps` layout: `item` between values, `key` between a
/// key and its value, and with `indent` each value on its own line.
struct PyFormatter<'a> {
    item: &'a [u8],
    key: &'a [u8],
    indent: Option<&'a [u8]>,
    level: usize,
    has_value: bool,
}

impl PyFormatter<'_> {
    fn open<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        bracket: &[u8],
    ) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(bracket)
    }

    fn close<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        bracket: &[u8],
    ) -> std::io::Result<()> {
        self.level -= 1;
        if let Some(indent) = self.indent.filter(|_| self.has_value) {
            w.write_all(b"\n")?;
            for _ in 0..self.level {
                w.write_all(indent)?;
            }
        }
        w.write_all(bracket)
    }

    fn value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            w.write_all(self.item)?;
        }
        if let Some(indent) = self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.level {
                w.write_all(indent)?;
            }
        }
        Ok(())
    }
}

impl Formatter for PyFormatter<'_> {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"[")
    }

    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }

    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.value(w, first)
    }

    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"{")
    }

    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.value(w, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(self.key)
    }

    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use minijinja::{context, Environment};

    fn render(template: &str, value: serde_json::Value) -> String {
        let mut env = Environment::new();
        env.add_filter("tojson", super::tojson);
        env.render_str(template, context! { v => value })
            .unwrap_or_else(|e| panic!("{template}: {e}"))
    }

    #[test]
    fn tojson_writes_as_python_json_dumps() {
        let v =
            serde_json::json!({"b": [1, 2.5, null, true], "a": "<tool_call> é \"q\"\n", "c": {}});
        // Python: json.dumps(v, ensure_ascii=False), keys in the order written.
        assert_eq!(
            render("{{ v | tojson }}", v.clone()),
            r#"{"b": [1, 2.5, null, true], "a": "<tool_call> é \"q\"\n", "c": {}}"#
        );
        assert_eq!(
            render(
                "{{ v | tojson(indent=2) }}",
                serde_json::json!({"a": [1, []], "b": {"c": 1}})
            ),
            "{\n  \"a\": [\n    1,\n    []\n  ],\n  \"b\": {\n    \"c\": 1\n  }\n}"
        );
        assert_eq!(
            render(
                "{{ v | tojson(separators=[',', ':']) }}",
                serde_json::json!({"a": [1, 2]})
            ),
            r#"{"a":[1,2]}"#
        );
        // Objects keep their order; sort_keys sorts them at every level.
        for (filter, want) in [
            ("tojson", r#"{"b": 1, "a": [{"d": 2, "c": 3}]}"#),
            (
                "tojson(sort_keys=true)",
                r#"{"a": [{"c": 3, "d": 2}], "b": 1}"#,
            ),
        ] {
            let template = format!(r#"{{{{ {{"b": 1, "a": [{{"d": 2, "c": 3}}]}} | {filter} }}}}"#);
            assert_eq!(render(&template, serde_json::Value::Null), want);
        }
    }
}
