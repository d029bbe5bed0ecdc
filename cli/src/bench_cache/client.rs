//! One streamed, greedy request to the gateway as a tenant (its API key),
//! timed: TTFT to the first text, the whole text, and the usage the last
//! event carries (prompt tokens and the prefix cache's cached tokens).
//!
//! TTFT starts just before the connection is opened (one connection per
//! request, as `kvmesh bench` does) and ends when the first event with
//! text is read.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use kvmesh_client::http::{self, Request};
use serde_json::Value;

/// What one request measured.
#[derive(Clone, Debug)]
pub(crate) struct Answer {
    /// Seconds to the first text.
    pub(crate) ttft: f64,
    /// The generated text.
    pub(crate) text: String,
    /// `usage.prompt_tokens`.
    pub(crate) prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub(crate) cached_tokens: u64,
}

/// Which endpoint, and the body's prompt part.
pub(crate) enum Prompt<'a> {
    /// `/v1/completions` with this text.
    Text(&'a str),
    /// `/v1/chat/completions` with these messages.
    Chat(&'a Value),
}

/// Sends `prompt` streamed as the tenant of `key`, greedy, at most
/// `max_tokens` tokens; fails on any error status or event, a stream
/// without usage, or `timeout`.
pub(crate) async fn send(
    addr: &str,
    key: &str,
    prompt: Prompt<'_>,
    max_tokens: usize,
    timeout: Duration,
) -> Result<Answer> {
    let (path, mut body) = match prompt {
        Prompt::Text(t) => ("/v1/completions", serde_json::json!({"prompt": t})),
        Prompt::Chat(m) => ("/v1/chat/completions", serde_json::json!({"messages": m})),
    };
    body["max_tokens"] = max_tokens.into();
    body["temperature"] = 0.into();
    body["stream"] = true.into();
    let req = Request::post_json(path, &body).bearer(key);
    tokio::time::timeout(timeout, stream(addr, &req))
        .await
        .map_err(|_| anyhow!("no answer in {} s", timeout.as_secs()))?
}

async fn stream(addr: &str, req: &Request) -> Result<Answer> {
    let sent = Instant::now();
    let resp = http::send(addr, req).await.context("connecting")?;
    if resp.status != 200 {
        let status = resp.status;
        let body = resp.read_all().await.map(|r| r.text()).unwrap_or_default();
        bail!("http {status}: {body}");
    }
    let mut sse = resp.events();
    let (mut ttft, mut text, mut usage) = (None, String::new(), None);
    while let Some(data) = sse.next().await.context("reading the stream")? {
        if data == "[DONE]" {
            let (prompt_tokens, cached_tokens) =
                usage.ok_or_else(|| anyhow!("the stream carried no usage"))?;
            return Ok(Answer {
                // A stream of special tokens only has no text: its end.
                ttft: ttft.unwrap_or_else(|| sent.elapsed().as_secs_f64()),
                text,
                prompt_tokens,
                cached_tokens,
            });
        }
        let v: Value = serde_json::from_str(&data).context("an SSE event that is not JSON")?;
        if let Some(e) = v.get("error") {
            bail!("error event: {e}");
        }
        let c = &v["choices"][0];
        let piece = c["text"]
            .as_str()
            .or_else(|| c["delta"]["content"].as_str())
            .unwrap_or_default();
        if !piece.is_empty() {
            ttft.get_or_insert_with(|| sent.elapsed().as_secs_f64());
            text.push_str(piece);
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            let n = |k: &str, x: &Value| x.as_u64().ok_or_else(|| anyhow!("usage without {k}"));
            usage = Some((
                n("prompt_tokens", &u["prompt_tokens"])?,
                n(
                    "cached_tokens",
                    &u["prompt_tokens_details"]["cached_tokens"],
                )?,
            ));
        }
    }
    bail!("the stream ended without [DONE]")
}
