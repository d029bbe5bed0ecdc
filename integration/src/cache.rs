//! The prefix cache through the gateway: one request's text and its
//! `usage.prompt_tokens_details.cached_tokens`, and the tenant-isolation
//! scenario of `design/prefix-cache.md` rule 8, shared by the test that
//! requires isolation and the test that plants the bug which breaks it
//! (so the scenario is shown to catch a leak, not only to pass).

use serde_json::json;

use crate::http;

/// One greedy completion as `tenant_key` (`None`: no API key), with an
/// optional `cache_salt`: its text and cached prompt tokens.
pub fn complete(
    addr: &str,
    tenant_key: Option<&str>,
    prompt: &str,
    salt: Option<&str>,
    max_tokens: usize,
) -> (String, u64) {
    let mut body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
    if let Some(s) = salt {
        body["cache_salt"] = json!(s);
    }
    let auth = tenant_key.map(|k| format!("Bearer {k}"));
    let r = http::request_with(
        addr,
        "POST",
        "/v1/completions",
        Some(&body.to_string()),
        auth.as_deref(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {v}"));
    (
        v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        cached,
    )
}

/// What each request of the isolation scenario found in the cache.
#[derive(Debug)]
pub struct Isolation {
    /// Tenant A's first request (a cold cache).
    pub a_first: u64,
    /// A's exact repeat: a hit.
    pub a_repeat: u64,
    /// Tenant B, the same prompt: must find nothing.
    pub b_same: u64,
    /// A again with a `cache_salt`: a namespace of its own, cold.
    pub a_salted: u64,
    /// The same salt again: a hit inside it.
    pub a_salted_repeat: u64,
    /// B with A's salt: still B's own namespace, cold.
    pub b_salted: u64,
    /// Every response's text, in order (greedy: all equal).
    pub texts: Vec<String>,
}

/// Tenant A (`key_a`) sends `prompt` twice, tenant B (`key_b`) once, then
/// the salted variants.
pub fn isolation(
    addr: &str,
    key_a: &str,
    key_b: &str,
    prompt: &str,
    max_tokens: usize,
) -> Isolation {
    let mut texts = Vec::new();
    let mut run = |key: &str, salt: Option<&str>| {
        let (t, cached) = complete(addr, Some(key), prompt, salt, max_tokens);
        texts.push(t);
        cached
    };
    let a_first = run(key_a, None);
    let a_repeat = run(key_a, None);
    let b_same = run(key_b, None);
    let a_salted = run(key_a, Some("conversation-7"));
    let a_salted_repeat = run(key_a, Some("conversation-7"));
    let b_salted = run(key_b, Some("conversation-7"));
    Isolation {
        a_first,
        a_repeat,
        b_same,
        a_salted,
        a_salted_repeat,
        b_salted,
        texts,
    }
}
