//! Where a JSON value ends, found one character at a time: brackets
//! counted outside strings, escapes inside them. It does not validate (a
//! closed value is handed to serde_json, which does); it only says when a
//! value could have closed, in constant memory.

/// A scanner inside one JSON container (object or array).
#[derive(Clone, Debug, Default)]
pub(super) struct Scan {
    /// Containers open.
    depth: usize,
    in_string: bool,
    escaped: bool,
}

/// What one character did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// Opened a container; the depth now.
    Opened(usize),
    /// Closed a container; the depth now (0: the outermost closed).
    Closed(usize),
    /// Anything else.
    Other,
}

impl Scan {
    /// Feeds `c`.
    pub(super) fn feed(&mut self, c: char) -> Step {
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if c == '\\' {
                self.escaped = true;
            } else if c == '"' {
                self.in_string = false;
            }
            return Step::Other;
        }
        match c {
            '"' => {
                self.in_string = true;
                Step::Other
            }
            '{' | '[' => {
                self.depth += 1;
                Step::Opened(self.depth)
            }
            // A closer with nothing open is left to serde_json to refuse.
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                Step::Closed(self.depth)
            }
            _ => Step::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn closes_at(s: &str) -> Option<usize> {
        let mut scan = Scan::default();
        s.char_indices()
            .find(|&(_, c)| scan.feed(c) == Step::Closed(0))
            .map(|(i, _)| i)
    }

    #[test]
    fn brackets_inside_strings_and_escapes_do_not_count() {
        assert_eq!(closes_at(r#"{"a": "}"}"#), Some(9));
        assert_eq!(closes_at(r#"{"a": "\"}"}"#), Some(11));
        assert_eq!(closes_at(r#"{"a": "\\"}"#), Some(10));
        assert_eq!(closes_at(r#"{"a": [1, {"b": 2}]} tail"#), Some(19));
        assert_eq!(closes_at(r#"{"a": [1, {"b": 2}]"#), None);
        let mut scan = Scan::default();
        assert_eq!(scan.feed('['), Step::Opened(1));
        assert_eq!(scan.feed('{'), Step::Opened(2));
        assert_eq!(scan.feed('}'), Step::Closed(1));
        assert_eq!(scan.feed(']'), Step::Closed(0));
    }
}
