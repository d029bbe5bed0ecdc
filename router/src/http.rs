//! The OpenAI-compatible HTTP gateway.
//!
//! Bodies are parsed here (not by an extractor) so every malformed request
//! gets the same OpenAI-style 400 body naming the field. Unknown fields are
//! ignored, as OpenAI clients send many.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::handler::Handler;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{on, MethodFilter, MethodRouter};
use axum::Json;
use kvmesh_tokenizer::ChatMessage;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use kvmesh_faults::FaultPlan;

use crate::auth::Tenant;
use crate::dispatch::{self, Event, Job};
use crate::error::Rejection;
use crate::validate::{self, invalid, Prompt, Valid};
use crate::Router;

/// Interval of SSE keep-alive comments (see `stream`).
const SSE_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_millis(250);

/// Who may call a route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// `Authorization: Bearer KEY` when API keys are configured (401
    /// otherwise).
    ApiKey,
    /// Anyone (probes, scrapers, the API description).
    Open,
}

/// An HTTP method the gateway serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    /// GET.
    Get,
    /// POST.
    Post,
}

impl Verb {
    /// The method's name as an OpenAPI path item spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Get => "get",
            Self::Post => "post",
        }
    }

    fn filter(self) -> MethodFilter {
        match self {
            Self::Get => MethodFilter::GET,
            Self::Post => MethodFilter::POST,
        }
    }
}

/// One route of the gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// The method.
    pub verb: Verb,
    /// The path.
    pub path: &'static str,
    /// Whether it needs an API key.
    pub access: Access,
}

fn endpoint<H, T>(
    verb: Verb,
    path: &'static str,
    access: Access,
    handler: H,
) -> (Endpoint, MethodRouter<Router>)
where
    H: Handler<T, Router>,
    T: 'static,
{
    (Endpoint { verb, path, access }, on(verb.filter(), handler))
}

/// Every route the gateway serves, with its handler: the one list that
/// [`routes`] registers and that the OpenAPI document is checked against
/// (`openapi` tests), so the two cannot drift apart.
fn table() -> Vec<(Endpoint, MethodRouter<Router>)> {
    use Access::{ApiKey, Open};
    use Verb::{Get, Post};
    vec![
        endpoint(Post, "/v1/completions", ApiKey, completions),
        endpoint(Post, "/v1/chat/completions", ApiKey, chat_completions),
        endpoint(Get, "/v1/models", ApiKey, models),
        endpoint(Get, "/health", Open, health),
        endpoint(Get, "/metrics", Open, metrics),
        endpoint(Get, "/openapi.json", Open, openapi),
    ]
}

/// The routes the gateway serves (method, path, access).
pub fn endpoints() -> Vec<Endpoint> {
    table().into_iter().map(|(e, _)| e).collect()
}

pub(crate) fn routes(router: Router) -> axum::Router {
    let (mut keyed, mut open) = (axum::Router::new(), axum::Router::new());
    for (e, handler) in table() {
        match e.access {
            Access::ApiKey => keyed = keyed.route(e.path, handler),
            Access::Open => open = open.route(e.path, handler),
        }
    }
    let keyed = keyed.route_layer(axum::middleware::from_fn_with_state(
        router.clone(),
        authenticate,
    ));
    keyed.merge(open).with_state(router)
}

/// 401 before the handler runs (the body is not even read) unless the
/// request carries a known key; the tenant then rides along as an
/// extension, the only place a handler gets it from.
async fn authenticate(
    State(r): State<Router>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let header = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match r.config().api_keys.check(header) {
        Ok(tenant) => {
            req.extensions_mut().insert(tenant);
            // Injected faults: only a testing build started with
            // --fault-injection honours the header.
            if r.config().fault_injection {
                let spec = req
                    .headers()
                    .get(kvmesh_faults::HEADER)
                    .map(|v| v.to_str().unwrap_or("\u{fffd}"));
                match FaultPlan::from_header(spec) {
                    Ok(plan) => {
                        req.extensions_mut().insert(plan);
                    }
                    Err(e) => {
                        let body = json!({"error": {"message": e.to_string(), "type": "invalid_request_error", "param": kvmesh_faults::HEADER, "code": "invalid_fault_spec"}});
                        return (StatusCode::BAD_REQUEST, Json(body)).into_response();
                    }
                }
            }
            next.run(req).await
        }
        Err(e) => {
            r.metrics.rejected("unauthenticated");
            let body = json!({"error": {"message": e.message(), "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}});
            (StatusCode::UNAUTHORIZED, Json(body)).into_response()
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct Common {
    model: Option<String>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    // f64, checked before narrowing: an f32 would round 2.0000001 into
    // range and 1e-50 to zero.
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<u64>,
    stop: Option<OneOrMany>,
    #[serde(default)]
    stream: bool,
    n: Option<u64>,
    /// vLLM's extension: end-of-sequence tokens do not end generation.
    #[serde(default)]
    ignore_eos: bool,
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: Option<OneOrMany>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Option<Vec<ChatIn>>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
struct ChatIn {
    role: String,
    content: Option<Value>,
}

fn parse<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, Rejection> {
    serde_json::from_slice(body).map_err(|e| invalid("body", format!("invalid JSON body: {e}")))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The response id: the mesh's 128 random bits (I8), never a client's
/// and never a weaker fallback; `None` if the OS RNG failed.
fn request_id(prefix: &str) -> Option<String> {
    kvmesh_kvwire::RequestId::mint()
        .ok()
        .map(|id| format!("{prefix}-{id}"))
}

/// A request body as the gateway accepts it: validated and tokenized
/// (through [`validate::request`], the one validation the gRPC API uses
/// too), or the typed refusal the client gets. Everything a client sends
/// passes through here first (fuzzed: `fuzz/`).
pub fn validate(r: &Router, chat: bool, body: &[u8]) -> Result<Valid, Rejection> {
    parse_body(chat, body).and_then(|(req, _)| validate::request(r, req))
}

/// A body as the front-end-neutral request, and whether to stream.
fn parse_body(chat: bool, body: &[u8]) -> Result<(validate::Request, bool), Rejection> {
    let (prompt, c) = if chat {
        let b: ChatBody = parse(body)?;
        (Prompt::Chat(chat_messages(b.messages)?), b.common)
    } else {
        let b: CompletionBody = parse(body)?;
        let prompt = match b.prompt {
            Some(OneOrMany::One(p)) => p,
            Some(OneOrMany::Many(mut v)) if v.len() == 1 => v.remove(0),
            Some(OneOrMany::Many(_)) => return Err(invalid("prompt", "one prompt per request")),
            None => return Err(invalid("prompt", "prompt is required")),
        };
        (Prompt::Text(prompt), b.common)
    };
    if c.n.is_some_and(|n| n != 1) {
        return Err(invalid("n", "only n=1 is supported"));
    }
    // Each budget field is checked on its own, the ignored one too: a
    // request with `max_tokens: 0` is refused whatever else it says.
    if c.max_tokens == Some(0) && c.max_completion_tokens.is_some() {
        return Err(invalid("max_tokens", "max_tokens must be at least 1"));
    }
    let (max_tokens, max_tokens_param) = match (c.max_completion_tokens, c.max_tokens) {
        (Some(n), _) => (Some(n), "max_completion_tokens"),
        (None, n) => (n, "max_tokens"),
    };
    let stop = match c.stop {
        None => Vec::new(),
        Some(OneOrMany::One(s)) => vec![s],
        Some(OneOrMany::Many(v)) => v,
    };
    let req = validate::Request {
        model: c.model,
        prompt,
        max_tokens,
        max_tokens_param,
        temperature: c.temperature,
        top_p: c.top_p,
        seed: c.seed,
        stop,
        ignore_eos: c.ignore_eos,
    };
    Ok((req, c.stream))
}

fn chat_messages(msgs: Option<Vec<ChatIn>>) -> Result<Vec<ChatMessage>, Rejection> {
    let msgs = msgs.ok_or_else(|| invalid("messages", "messages is required"))?;
    msgs.into_iter()
        .map(|m| {
            let content = match m.content {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s,
                // The array form: text parts concatenated.
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| {
                        match (
                            p.get("type").and_then(Value::as_str),
                            p.get("text").and_then(Value::as_str),
                        ) {
                            (Some("text"), Some(t)) => Ok(t.to_owned()),
                            _ => Err(invalid("messages", "only text content parts are supported")),
                        }
                    })
                    .collect::<Result<String, _>>()?,
                Some(_) => {
                    return Err(invalid(
                        "messages",
                        "content must be a string or text parts",
                    ))
                }
            };
            Ok(ChatMessage::new(m.role, content))
        })
        .collect()
}

/// The OpenAI-style error of a body that could not be read (over axum's
/// size limit: 413; a broken stream: 400), instead of axum's plain text.
fn body_refused(r: &Router, e: &BytesRejection) -> Response {
    r.metrics.rejected("invalid_request");
    let body = json!({"error": {"message": e.body_text(), "type": "invalid_request_error", "param": "body", "code": "invalid_body"}});
    (e.status(), Json(body)).into_response()
}

async fn completions(
    State(r): State<Router>,
    axum::Extension(tenant): axum::Extension<Tenant>,
    faults: Option<axum::Extension<FaultPlan>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(r, tenant, faults, body, Kind::Completion).await
}

async fn chat_completions(
    State(r): State<Router>,
    axum::Extension(tenant): axum::Extension<Tenant>,
    faults: Option<axum::Extension<FaultPlan>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(r, tenant, faults, body, Kind::Chat).await
}

/// Both generation routes: the body, validated for `kind`, then dispatch.
async fn generate(
    r: Router,
    tenant: Tenant,
    faults: Option<axum::Extension<FaultPlan>>,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(e) => return body_refused(&r, &e),
    };
    let faults = faults.map(|f| f.0).unwrap_or_default();
    let checked = parse_body(matches!(kind, Kind::Chat), &body)
        .and_then(|(req, stream)| Ok((validate::request(&r, req)?, stream)));
    match checked {
        Ok((valid, stream)) => respond(r, valid, stream, kind, tenant, faults).await,
        Err(e) => {
            r.refused(&e);
            e.into_response()
        }
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Completion,
    Chat,
}

async fn respond(
    r: Router,
    valid: Valid,
    stream_it: bool,
    kind: Kind,
    tenant: Tenant,
    faults: FaultPlan,
) -> Response {
    let (ids, s) = valid.into_parts();
    let prompt_tokens = ids.len();
    let (id, object) = match kind {
        Kind::Completion => (request_id("cmpl"), "text_completion"),
        Kind::Chat => (request_id("chatcmpl"), "chat.completion"),
    };
    let Some(id) = id else {
        let body = json!({"error": {"message": "cannot mint a request id", "type": "server_error", "param": null, "code": "internal"}});
        return (StatusCode::INTERNAL_SERVER_ERROR, Json(body)).into_response();
    };
    let permit = match r.admit(prompt_tokens, s.max_tokens).await {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let job = Job {
        prompt_ids: ids,
        max_tokens: s.max_tokens,
        temperature: s.temperature,
        top_p: s.top_p,
        seed: s.seed,
        stop: s.stop,
        ignore_eos: s.ignore_eos,
        tenant,
        faults,
    };
    let rx = match dispatch::start(&r, job, permit) {
        Ok(rx) => rx,
        Err(e) => {
            r.metrics.rejected(e.reason());
            return e.into_response();
        }
    };
    let model = r.config().model_id.clone();
    let created = unix_now();
    if stream_it {
        return stream(rx, kind, id, model, created, prompt_tokens).into_response();
    }
    let mut rx = rx;
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text(t) => text.push_str(&t),
            Event::Done {
                finish,
                completion_tokens,
            } => {
                let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
                let choice = match kind {
                    Kind::Completion => {
                        json!({"index": 0, "text": text, "finish_reason": finish.as_str(), "logprobs": null})
                    }
                    Kind::Chat => {
                        json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish.as_str(), "logprobs": null})
                    }
                };
                return Json(json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice], "usage": usage})).into_response();
            }
            Event::Error(e) => return e.into_response(),
        }
    }
    (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({"error": {"message": "generation ended without a result", "type": "server_error", "param": null, "code": "internal"}}))).into_response()
}

fn stream(
    rx: tokio::sync::mpsc::Receiver<Event>,
    kind: Kind,
    id: String,
    model: String,
    created: u64,
    prompt_tokens: usize,
) -> Sse<impl tokio_stream::Stream<Item = Result<SseEvent, Infallible>>> {
    let object = match kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion.chunk",
    };
    let chunk = move |delta: Value, finish: Value, usage: Option<Value>| {
        let choice = match kind {
            Kind::Completion => {
                json!({"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "finish_reason": finish, "logprobs": null})
            }
            Kind::Chat => {
                json!({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null})
            }
        };
        let mut v = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        SseEvent::default().data(v.to_string())
    };
    // Events to SSE frames on a task of their own: when the client goes
    // away (noticed by hyper on a write: an event or a keep-alive comment)
    // its receiver drops, this task drops `rx`, and dispatch sees the
    // request abandoned.
    let (tx, out) = tokio::sync::mpsc::channel::<SseEvent>(64);
    tokio::spawn(async move {
        let mut rx = rx;
        if let Kind::Chat = kind {
            if tx
                .send(chunk(
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                    None,
                ))
                .await
                .is_err()
            {
                return;
            }
        }
        loop {
            // Leave as soon as the client is gone, not at the next event:
            // dropping `rx` is what tells dispatch to abort.
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                () = tx.closed() => return,
            };
            let Some(ev) = ev else { return };
            let frames = match ev {
                Event::Text(t) => vec![chunk(json!({"content": t}), Value::Null, None)],
                Event::Done { finish, completion_tokens } => {
                    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
                    vec![chunk(json!({}), json!(finish.as_str()), Some(usage)), SseEvent::default().data("[DONE]")]
                }
                Event::Error(e) => vec![
                    SseEvent::default().data(json!({"error": {"message": e.to_string(), "type": "server_error", "param": null, "code": e.kind()}}).to_string()),
                    SseEvent::default().data("[DONE]"),
                ],
            };
            for f in frames {
                if tx.send(f).await.is_err() {
                    return;
                }
            }
        }
    });
    let all = ReceiverStream::new(out).map(Ok);
    // A comment every 250 ms while no event flows: writing is how a
    // closed connection shows (hyper does not watch the read side here),
    // so a client that leaves during a long prefill is noticed within
    // about two intervals and both nodes are told to abort.
    Sse::new(all).keep_alive(KeepAlive::new().interval(SSE_KEEP_ALIVE))
}

async fn models(State(r): State<Router>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": r.config().model_id, "object": "model", "created": 0, "owned_by": "kvmesh", "max_model_len": r.config().max_model_len}]}),
    )
}

async fn health(State(r): State<Router>) -> Response {
    if r.is_draining() {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n").into_response();
    }
    match r.nodes().capacity() {
        Some(_) => (StatusCode::OK, "ok\n").into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            "no healthy prefill or decode node\n",
        )
            .into_response(),
    }
}

async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        crate::openapi::DOCUMENT,
    )
        .into_response()
}

async fn metrics(State(r): State<Router>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        r.metrics.render(r.nodes()),
    )
        .into_response()
}
