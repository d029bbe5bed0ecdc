//! The Prometheus text exposition format, read: samples with their labels,
//! lookups by name and labels or by a selector, and a scrape of a
//! gateway's `/metrics`.
//!
//! A line is `name{label="value",...} value [timestamp]`; label values
//! escape `\\`, `\"` and `\n`; values may be `+Inf`, `-Inf` or `NaN`;
//! `#` lines (HELP, TYPE, comments) and blank lines carry no sample. A
//! histogram is its `_bucket{le=...}`, `_sum` and `_count` samples. A line
//! that does not parse is skipped: a scrape never fails on one bad line.

use std::collections::BTreeMap;

use crate::http::{self, Error};

/// One sample: metric name, labels, value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The metric name (with a histogram's `_bucket`, `_sum`, `_count`).
    pub name: String,
    /// Label names and (unescaped) values.
    pub labels: BTreeMap<String, String>,
    /// The value.
    pub value: f64,
}

impl Sample {
    /// The value of label `name`, if present.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.get(name).map(String::as_str)
    }

    /// Whether every pair of `labels` is among this sample's labels.
    pub fn has(&self, labels: &[(&str, &str)]) -> bool {
        labels.iter().all(|(k, v)| self.label(k) == Some(*v))
    }
}

/// Every sample of `text`, in order.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let (name, mut rest) = line.split_at(name_end);
    if name.is_empty() {
        return None;
    }
    let mut labels = BTreeMap::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, tail, closed) = parse_labels(after)?;
        if !closed {
            return None;
        }
        labels = parsed;
        rest = tail;
    }
    // The value, then an optional timestamp.
    let value = parse_value(rest.split_whitespace().next()?)?;
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// Labels after a `{`, up to and including the `}`: the labels, what
/// follows the `}`, and whether the `}` was there (a selector may leave
/// it off). `None` on malformed labels.
fn parse_labels(mut s: &str) -> Option<(BTreeMap<String, String>, &str, bool)> {
    let mut labels = BTreeMap::new();
    loop {
        s = s.trim_start_matches([' ', ',']);
        if let Some(tail) = s.strip_prefix('}') {
            return Some((labels, tail, true));
        }
        if s.is_empty() {
            return Some((labels, s, false));
        }
        let (key, tail) = s.split_once('=')?;
        let tail = tail.trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = tail.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        labels.insert(key.trim().to_owned(), value);
        s = &tail[end + 1..];
    }
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => v.parse().ok(),
    }
}

/// A parsed scrape: the samples and the text they came from.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    text: String,
    samples: Vec<Sample>,
}

impl Metrics {
    /// Parses `text`.
    pub fn parse(text: impl Into<String>) -> Self {
        let text = text.into();
        let samples = parse(&text);
        Self { text, samples }
    }

    /// The text as scraped.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Every sample, in order.
    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// The samples named `name`.
    pub fn named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// The value of the sample named `name` whose labels are exactly
    /// `labels`.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.named(name)
            .find(|s| s.labels.len() == labels.len() && s.has(labels))
            .map(|s| s.value)
    }

    /// The value of the first sample named `name` that has at least
    /// `labels` (any others too).
    pub fn first(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.named(name).find(|s| s.has(labels)).map(|s| s.value)
    }

    /// The sum over the samples named `name` that have at least `labels`.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.named(name)
            .filter(|s| s.has(labels))
            .map(|s| s.value)
            .sum()
    }

    /// The value a selector names, written as a sample line starts:
    /// `name` (the first sample of that name), `name{a="x",b="y"}` (the
    /// sample with exactly those labels), or `name{a="x"` with the brace
    /// left open (the first sample with at least those labels). `None`
    /// for no such sample or a selector that does not parse.
    pub fn get(&self, selector: &str) -> Option<f64> {
        let selector = selector.trim();
        let Some((name, labels)) = selector.split_once('{') else {
            return self.named(selector).next().map(|s| s.value);
        };
        let (labels, tail, closed) = parse_labels(labels)?;
        if !tail.trim().is_empty() {
            return None;
        }
        let pairs: Vec<(&str, &str)> = labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        if closed {
            self.value(name, &pairs)
        } else {
            self.first(name, &pairs)
        }
    }
}

/// Why a scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// The request failed.
    #[error("{0}")]
    Http(#[from] Error),
    /// The server answered, but not 200.
    #[error("/metrics answered {0}")]
    Status(u16),
}

/// `GET http://ADDR/metrics`, parsed.
pub async fn scrape(addr: &str) -> Result<Metrics, ScrapeError> {
    scrape_with(addr, None).await
}

/// [`scrape`] with an API key (`Authorization: Bearer KEY`): a gateway
/// with API keys serves `/metrics` only to a key with the metrics scope.
pub async fn scrape_with(addr: &str, key: Option<&str>) -> Result<Metrics, ScrapeError> {
    let mut req = http::Request::get("/metrics");
    if let Some(key) = key {
        req = req.bearer(key);
    }
    let reply = http::request(addr, &req).await?;
    if reply.status != 200 {
        return Err(ScrapeError::Status(reply.status));
    }
    Ok(Metrics::parse(reply.text()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Real exposition text: HELP and TYPE comments, a counter with
    /// labels, a label value with an escaped quote, backslash and newline,
    /// a histogram with `+Inf`, a timestamp, special values, and lines that
    /// do not parse.
    const TEXT: &str = r#"# HELP kvmesh_requests_total Requests by outcome.
# TYPE kvmesh_requests_total counter
kvmesh_requests_total{outcome="completed"} 12
kvmesh_requests_total{outcome="client_gone"} 1

kvmesh_node_kv_pages_total{node="decode-0"} 16
kvmesh_node_kv_pages_free{node="decode-0"} 14
kvmesh_node_reservations_total{node="decode-0",outcome="completed"} 3
kvmesh_node_reservations_total{node="decode-1",outcome="completed"} 4
kvmesh_weird{msg="say \"hi\", then \\ and\nbye",x="a,b}"} 2.5
# TYPE kvmesh_ttft_seconds histogram
kvmesh_ttft_seconds_bucket{le="0.1"} 3
kvmesh_ttft_seconds_bucket{le="+Inf"} 5
kvmesh_ttft_seconds_sum 0.75
kvmesh_ttft_seconds_count 5 1700000000000
kvmesh_up +Inf
kvmesh_down -Inf
kvmesh_nan NaN
kvmesh_sci 1.5e3
kvmesh_bad{unclosed="x" 3
kvmesh_novalue{a="b"}
{a="b"} 1
kvmesh_badvalue notanumber
"#;

    #[test]
    fn parses_samples_labels_and_special_values() {
        let m = Metrics::parse(TEXT);
        assert_eq!(
            m.value("kvmesh_requests_total", &[("outcome", "completed")]),
            Some(12.0)
        );
        assert_eq!(
            m.get("kvmesh_node_kv_pages_free{node=\"decode-0\"}"),
            Some(14.0)
        );
        let weird = m.named("kvmesh_weird").next().expect("the escaped sample");
        assert_eq!(weird.label("msg"), Some("say \"hi\", then \\ and\nbye"));
        assert_eq!(weird.label("x"), Some("a,b}"));
        assert_eq!(weird.value, 2.5);
        assert_eq!(
            m.value("kvmesh_ttft_seconds_bucket", &[("le", "+Inf")]),
            Some(5.0)
        );
        assert_eq!(m.get("kvmesh_ttft_seconds_sum"), Some(0.75));
        // The timestamp is not the value.
        assert_eq!(m.get("kvmesh_ttft_seconds_count"), Some(5.0));
        assert_eq!(m.get("kvmesh_up"), Some(f64::INFINITY));
        assert_eq!(m.get("kvmesh_down"), Some(f64::NEG_INFINITY));
        assert!(m.get("kvmesh_nan").is_some_and(f64::is_nan));
        assert_eq!(m.get("kvmesh_sci"), Some(1500.0));
        for bad in ["kvmesh_bad", "kvmesh_novalue", "kvmesh_badvalue"] {
            assert_eq!(m.get(bad), None, "{bad}");
        }
        // Comments, blank lines and the four bad lines carry no sample.
        assert_eq!(m.samples().len(), 15);
        assert!(m.text().starts_with("# HELP"));
    }

    #[test]
    fn selectors_are_exact_when_closed_and_open_when_not() {
        let m = Metrics::parse(TEXT);
        // Closed: exactly these labels.
        assert_eq!(
            m.get("kvmesh_node_reservations_total{node=\"decode-0\"}"),
            None
        );
        assert_eq!(
            m.get("kvmesh_node_reservations_total{outcome=\"completed\",node=\"decode-1\"}"),
            Some(4.0)
        );
        // Open: at least these labels, the first such sample.
        assert_eq!(
            m.get("kvmesh_node_reservations_total{node=\"decode-0\""),
            Some(3.0)
        );
        assert_eq!(
            m.get("kvmesh_node_reservations_total{outcome=\"completed\""),
            Some(3.0)
        );
        assert_eq!(m.get("kvmesh_node_reservations_total"), Some(3.0));
        assert_eq!(
            m.sum(
                "kvmesh_node_reservations_total",
                &[("outcome", "completed")]
            ),
            7.0
        );
        assert_eq!(m.get("kvmesh_missing{node=\"x\"}"), None);
        assert_eq!(
            m.get("kvmesh_requests_total{outcome=\"completed\"} trailing"),
            None
        );
        assert_eq!(m.get("kvmesh_requests_total{outcome=completed}"), None);
    }

    #[test]
    fn nothing_panics_on_truncated_lines() {
        for cut in 0..TEXT.len() {
            if TEXT.is_char_boundary(cut) {
                let _ = parse(&TEXT[..cut]);
                let _ = Metrics::parse(TEXT).get(&TEXT[..cut]);
            }
        }
    }
}
