//! One request of the load, over kvmesh-client's client (one connection per
//! request).

use super::*;

// ---------------------------------------------------------------------------
// One request.

/// What one request is.
#[derive(Clone, Copy, Debug)]
pub(super) struct Plan {
    pub(super) prompt: usize,
    pub(super) stream: bool,
    pub(super) fault: Option<usize>,
    /// Drop the connection after this many SSE events.
    pub(super) disconnect_after: Option<usize>,
}

/// How a request ended, as the client saw it.
#[derive(Debug)]
pub(super) enum Ending {
    /// A whole answer: its text and finish reason.
    Completed { text: String, finish: String },
    /// A non-200 status before any output.
    Http {
        status: u16,
        kind: String,
        message: String,
    },
    /// An error event in the SSE stream.
    SseError { kind: String, message: String },
    /// The client dropped the connection, as planned.
    Disconnected,
    /// No clear ending: connection failed or cut, stream ended without
    /// `[DONE]`, unparsable output, or no answer in time.
    Broken(String),
}

/// `type/code` of an OpenAI-style error body, and its message.
pub(super) fn error_kind(v: &Value) -> (String, String) {
    let e = &v["error"];
    let s = |k: &str| e[k].as_str().unwrap_or("?").to_owned();
    (format!("{}/{}", s("type"), s("code")), s("message"))
}

/// The text of choice 0: a completion's `text`, a chat message's
/// `content`, or a chat delta's `content`.
pub(super) fn choice_text(c: &Value) -> &str {
    c["text"]
        .as_str()
        .or_else(|| c["message"]["content"].as_str())
        .or_else(|| c["delta"]["content"].as_str())
        .unwrap_or_default()
}

pub(super) async fn one_request(addr: &str, r: &Reference, plan: Plan) -> Ending {
    let (path, mut body) = if r.chat {
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": r.text}]}),
        )
    } else {
        ("/v1/completions", json!({"prompt": r.text}))
    };
    body["max_tokens"] = json!(r.max_tokens);
    body["temperature"] = json!(0);
    body["stream"] = json!(plan.stream);
    let mut req = http::Request::post_json(path, &body);
    if let Some(i) = plan.fault {
        req = req.fault(FAULTS[i].spec);
    }
    let resp = match http::send(addr, &req).await {
        Ok(x) => x,
        Err(e) => return Ending::Broken(e.to_string()),
    };
    let status = resp.status;
    if status != 200 {
        let body = resp.read_all().await.map(|r| r.text()).unwrap_or_default();
        let (kind, message) = match serde_json::from_str::<Value>(&body) {
            Ok(v) => error_kind(&v),
            Err(_) => ("unparsed body".into(), body),
        };
        return Ending::Http {
            status,
            kind,
            message,
        };
    }
    if !plan.stream {
        let reply = match resp.read_all().await {
            Ok(r) => r,
            Err(e) => return Ending::Broken(e.to_string()),
        };
        let Ok(v) = reply.json() else {
            return Ending::Broken("200 with a body that is not JSON".into());
        };
        let c = &v["choices"][0];
        let Some(finish) = c["finish_reason"].as_str() else {
            return Ending::Broken("200 without a finish_reason".into());
        };
        return Ending::Completed {
            text: choice_text(c).to_owned(),
            finish: finish.to_owned(),
        };
    }
    if plan.disconnect_after == Some(0) {
        // Dropping the response closes its connection.
        drop(resp);
        return Ending::Disconnected;
    }
    let mut sse = resp.events();
    let mut events = 0usize;
    let mut text = String::new();
    let mut finish: Option<String> = None;
    loop {
        let event = match sse.next().await {
            Ok(Some(event)) => event,
            Ok(None) => return Ending::Broken("the stream ended without [DONE]".into()),
            Err(e) => return Ending::Broken(e.to_string()),
        };
        if event == "[DONE]" {
            return match finish {
                Some(finish) => Ending::Completed { text, finish },
                None => Ending::Broken("[DONE] without a finish_reason".into()),
            };
        }
        let Ok(v) = serde_json::from_str::<Value>(&event) else {
            return Ending::Broken("an SSE event that is not JSON".into());
        };
        if v.get("error").is_some() {
            let (kind, message) = error_kind(&v);
            return Ending::SseError { kind, message };
        }
        let c = &v["choices"][0];
        text.push_str(choice_text(c));
        if let Some(f) = c["finish_reason"].as_str() {
            finish = Some(f.to_owned());
        }
        events += 1;
        if finish.is_none() && plan.disconnect_after.is_some_and(|k| events >= k) {
            drop(sse);
            return Ending::Disconnected;
        }
    }
}
