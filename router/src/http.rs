//! The OpenAI-compatible HTTP gateway.
//!
//! Bodies are parsed here (not by an extractor) so every malformed request
//! gets the same OpenAI-style 400 body naming the field. A field the
//! gateway does not implement is refused with a 400 naming it, never
//! dropped: a client must not get an answer to a question it did not ask.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::handler::Handler;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{on, MethodFilter, MethodRouter};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tracing::Instrument;

use kvmesh_faults::FaultPlan;

use crate::auth::Tenant;
use crate::choices::{Choices, MAX_CHOICES};
use crate::error::{GatewayError, Rejection};
use crate::tools::parse::Reading;
use crate::validate::{self, invalid, Prompt, Valid};
use crate::Router;
use body::{Body, CHAT_FIELDS, COMMON_FIELDS, COMPLETION_FIELDS, MAX_USER};
use chat::chat_messages;
use gate::{authenticate, authorize_metrics};
use respond::Meta;

/// Interval of SSE keep-alive comments (see `stream`).
const SSE_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_millis(250);

/// Who may call a route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// `Authorization: Bearer KEY` when API keys are configured (401
    /// otherwise).
    ApiKey,
    /// Anyone (probes, the API description).
    Open,
    /// With API keys configured, a key with the `metrics` scope (401
    /// without a known key, 403 with one that lacks it); anyone without.
    Metrics,
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
    use Access::{ApiKey, Metrics, Open};
    use Verb::{Get, Post};
    vec![
        endpoint(Post, "/v1/completions", ApiKey, completions),
        endpoint(Post, "/v1/chat/completions", ApiKey, chat_completions),
        endpoint(Get, "/v1/models", ApiKey, models),
        endpoint(Post, "/tokenize", ApiKey, tokenize::tokenize),
        endpoint(Post, "/detokenize", ApiKey, tokenize::detokenize),
        endpoint(Get, "/version", Open, tokenize::version),
        endpoint(Get, "/health", Open, health),
        endpoint(Get, "/metrics", Metrics, metrics),
        endpoint(Get, "/openapi.json", Open, openapi),
    ]
}

/// The routes the gateway serves (method, path, access).
pub fn endpoints() -> Vec<Endpoint> {
    table().into_iter().map(|(e, _)| e).collect()
}

pub(crate) fn routes(router: Router) -> axum::Router {
    let (mut keyed, mut scraped, mut open) = (
        axum::Router::new(),
        axum::Router::new(),
        axum::Router::new(),
    );
    for (e, handler) in table() {
        match e.access {
            Access::ApiKey => keyed = keyed.route(e.path, handler),
            Access::Metrics => scraped = scraped.route(e.path, handler),
            Access::Open => open = open.route(e.path, handler),
        }
    }
    let keyed = keyed.route_layer(axum::middleware::from_fn_with_state(
        router.clone(),
        authenticate,
    ));
    let scraped = scraped.route_layer(axum::middleware::from_fn_with_state(
        router.clone(),
        authorize_metrics,
    ));
    keyed.merge(scraped).merge(open).with_state(router)
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// A completions `prompt`: text, a list of texts, token ids, or a list of
/// token-id lists.
#[derive(Deserialize)]
#[serde(untagged)]
enum PromptIn {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
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
pub fn validate(r: &Router, chat: bool, body: &[u8]) -> Result<Batch, Rejection> {
    let p = parse_body(chat, body)?;
    let prompts = p
        .requests
        .into_iter()
        .map(|req| validate::request(r, req))
        .collect::<Result<_, _>>()?;
    Ok(Batch { prompts, n: p.n })
}

/// How the response is shaped, beyond what the mesh generates.
#[derive(Clone, Copy, Debug, Default)]
struct Shape {
    /// Server-sent events.
    stream: bool,
    /// The streamed answer's last chunk carries usage (OpenAI's
    /// `stream_options.include_usage`; unset: yes).
    stream_usage: bool,
    /// Completions: the prompt's text opens the answer (`echo`).
    echo: bool,
    /// Completions with `echo` and `logprobs`: the prompt's tokens open
    /// each choice's logprobs, with this many alternatives.
    echo_logprobs: Option<usize>,
    /// vLLM's `prompt_logprobs`: the response carries the prompt's scores
    /// with this many alternatives.
    prompt_logprobs: Option<usize>,
}

impl Shape {
    /// Whether the prompt is scored (its event opens each prompt's
    /// stream).
    fn scores_prompt(&self) -> bool {
        self.echo_logprobs.is_some() || self.prompt_logprobs.is_some()
    }
}

/// A parsed body: the front-end-neutral request of each prompt (one, or
/// a completions batch), samples per prompt, and the response's shape.
struct Parsed {
    requests: Vec<validate::Request>,
    n: usize,
    shape: Shape,
}

/// A validated body: each prompt's [`Valid`] and the samples per prompt
/// (OpenAI's `n`); `prompts.len() * n` choices, at most
/// [`MAX_CHOICES`].
#[derive(Debug)]
pub struct Batch {
    /// One per prompt, in the body's order (at least one).
    pub prompts: Vec<Valid>,
    /// Samples per prompt, at least 1.
    pub n: usize,
}

/// A body as the front-end-neutral request, and its response's shape.
fn parse_body(chat: bool, bytes: &[u8]) -> Result<Parsed, Rejection> {
    let kind_fields = if chat { CHAT_FIELDS } else { COMPLETION_FIELDS };
    let b = Body::parse(bytes, &[COMMON_FIELDS, kind_fields])?;
    let mut sampling = validate::SamplingIn {
        temperature: b.get("temperature")?,
        top_p: b.get("top_p")?,
        top_k: b.get("top_k")?,
        min_p: b.get("min_p")?,
        presence_penalty: b.get("presence_penalty")?,
        frequency_penalty: b.get("frequency_penalty")?,
        repetition_penalty: b.get("repetition_penalty")?,
        logit_bias: logit_bias(b.get("logit_bias")?)?,
        min_tokens: b.get("min_tokens")?,
        seed: b.get("seed")?,
        ..validate::SamplingIn::default()
    };
    let tools = if chat {
        crate::tools::from_body(
            b.get("tools")?,
            b.get("tool_choice")?,
            b.get("parallel_tool_calls")?,
        )?
    } else {
        None
    };
    let (prompt, echo): (Vec<Prompt>, bool) = if chat {
        // top_logprobs implies logprobs, unless logprobs says false.
        let top: Option<u64> = b.get("top_logprobs")?;
        (sampling.logprobs_param, sampling.logprobs_max) = ("top_logprobs", 20);
        match (b.get::<bool>("logprobs")?, top) {
            (Some(false), Some(n)) if n > 0 => {
                return Err(invalid("top_logprobs", "top_logprobs needs logprobs: true"))
            }
            (Some(false), _) | (None, None) => {}
            (Some(true), top) | (None, top @ Some(_)) => {
                sampling.logprobs = Some(top.unwrap_or(0));
            }
        }
        (
            vec![Prompt::Chat(chat_messages(b.get("messages")?)?)],
            false,
        )
    } else {
        sampling.logprobs = b.get("logprobs")?;
        (sampling.logprobs_param, sampling.logprobs_max) = ("logprobs", 5);
        (
            completion_prompt(b.get("prompt")?)?,
            b.get("echo")?.unwrap_or(false),
        )
    };
    // `echo` with `logprobs`: the prompt's tokens open the logprobs, with
    // as many alternatives as the answer's (OpenAI's and vLLM's reading).
    let echo_logprobs = if echo { sampling.logprobs } else { None };
    let prompt_logprobs: Option<u64> = b.get("prompt_logprobs")?;
    let n = samples(&b, chat, prompt.len())?;
    let max_tokens: Option<u64> = b.get("max_tokens")?;
    let max_completion_tokens: Option<u64> = b.get("max_completion_tokens")?;
    // Each budget field is checked on its own, the ignored one too: a
    // request with `max_tokens: 0` is refused whatever else it says.
    if max_tokens == Some(0) && max_completion_tokens.is_some() {
        return Err(invalid("max_tokens", "max_tokens must be at least 1"));
    }
    let (max_tokens, max_tokens_param) = match (max_completion_tokens, max_tokens) {
        (Some(n), _) => (Some(n), "max_completion_tokens"),
        (None, n) => (n, "max_tokens"),
    };
    let stop = match b.get("stop")? {
        None => Vec::new(),
        Some(OneOrMany::One(s)) => vec![s],
        Some(OneOrMany::Many(v)) => v,
    };
    let stream = b.get("stream")?.unwrap_or(false);
    let options: Option<StreamOptions> = b.get("stream_options")?;
    if options.is_some() && !stream {
        return Err(invalid(
            "stream_options",
            "stream_options is only for streamed requests (stream: true)",
        ));
    }
    if let Some(user) = b.get::<String>("user")? {
        if user.chars().count() > MAX_USER {
            return Err(invalid(
                "user",
                format!("user must have at most {MAX_USER} characters"),
            ));
        }
        // OpenAI's end-user label, for the operator's logs only: never an
        // identity (the tenant is the API key's) nor an id.
        tracing::debug!(user = %user, "request from a labelled end user");
    }
    let request = validate::Request {
        model: b.get("model")?,
        max_tokens,
        max_tokens_param,
        sampling,
        stop,
        stop_token_ids: b.get("stop_token_ids")?.unwrap_or_default(),
        ignore_eos: b.get("ignore_eos")?.unwrap_or(false),
        cache_salt: b.get("cache_salt")?,
        structured: crate::structured::from_body(
            b.get("response_format")?,
            b.get("structured_outputs")?,
        )?,
        tools,
        // Prefill computes the most alternatives either use asks for.
        prompt_logprobs: prompt_logprobs.max(echo_logprobs),
        enable_thinking: if chat {
            body::enable_thinking(b.get("chat_template_kwargs")?)?
        } else {
            None
        },
        ..validate::Request::new(Prompt::Ids(Vec::new()))
    };
    let requests = prompt
        .into_iter()
        .map(|prompt| validate::Request {
            prompt,
            ..request.clone()
        })
        .collect();
    let shape = Shape {
        stream,
        stream_usage: options.and_then(|o| o.include_usage).unwrap_or(true),
        echo,
        // Validation bounds both (5 and 20) before the response is shaped.
        echo_logprobs: echo_logprobs.map(|k| usize::try_from(k).unwrap_or(usize::MAX)),
        prompt_logprobs: prompt_logprobs.map(|k| usize::try_from(k).unwrap_or(usize::MAX)),
    };
    Ok(Parsed { requests, n, shape })
}

/// `n` (completions' `best_of` may only be 1): samples per prompt, with at most [`MAX_CHOICES`] choices in all.
fn samples(b: &Body, chat: bool, prompts: usize) -> Result<usize, Rejection> {
    let n: u64 = b.get("n")?.unwrap_or(1);
    if n == 0 {
        return Err(invalid("n", "n must be at least 1"));
    }
    if !chat && b.get::<u64>("best_of")?.is_some_and(|best_of| best_of != 1) {
        return Err(invalid(
            "best_of",
            "best_of above 1 (drawing more samples than are returned, keeping the most likely) \
             is not supported; use n for several samples, each returned",
        ));
    }
    let choices = usize::try_from(n)
        .unwrap_or(usize::MAX)
        .saturating_mul(prompts);
    if choices > MAX_CHOICES {
        let param = if n > 1 { "n" } else { "prompt" };
        return Err(invalid(
            param,
            format!(
                "{prompts} prompt(s) times n = {n} is {choices} choices; at most {MAX_CHOICES}"
            ),
        ));
    }
    Ok(n as usize)
}

/// OpenAI's `logit_bias`: token ids (as JSON object keys) to biases.
fn logit_bias(v: Option<serde_json::Map<String, Value>>) -> Result<Vec<(u32, f64)>, Rejection> {
    v.unwrap_or_default()
        .into_iter()
        .map(|(k, v)| {
            let id = k.parse::<u32>().map_err(|_| {
                invalid(
                    "logit_bias",
                    "logit_bias keys must be token ids (decimal integers)",
                )
            })?;
            let b = v
                .as_f64()
                .ok_or_else(|| invalid("logit_bias", "logit_bias values must be numbers"))?;
            Ok((id, b))
        })
        .collect()
}

/// A completions `prompt`: one, or a batch (each its own choices).
fn completion_prompt(p: Option<PromptIn>) -> Result<Vec<Prompt>, Rejection> {
    let prompts = match p {
        None => return Err(invalid("prompt", "prompt is required")),
        Some(PromptIn::Text(t)) => vec![Prompt::Text(t)],
        Some(PromptIn::Texts(v)) => v.into_iter().map(Prompt::Text).collect(),
        Some(PromptIn::Ids(ids)) => vec![Prompt::Ids(ids)],
        Some(PromptIn::IdLists(v)) => v.into_iter().map(Prompt::Ids).collect(),
    };
    if prompts.is_empty() {
        return Err(invalid("prompt", "prompt must not be an empty list"));
    }
    if prompts.len() > MAX_CHOICES {
        return Err(invalid(
            "prompt",
            format!("at most {MAX_CHOICES} prompts in one request"),
        ));
    }
    Ok(prompts)
}

async fn completions(
    State(r): State<Router>,
    axum::Extension(tenant): axum::Extension<Tenant>,
    faults: Option<axum::Extension<FaultPlan>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let span = request_span(&headers, Kind::Completion);
    generate(r, tenant, faults, body, Kind::Completion, span).await
}

async fn chat_completions(
    State(r): State<Router>,
    axum::Extension(tenant): axum::Extension<Tenant>,
    faults: Option<axum::Extension<FaultPlan>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let span = request_span(&headers, Kind::Chat);
    generate(r, tenant, faults, body, Kind::Chat, span).await
}

/// The gateway's root span of a generation request: a child of the
/// client's `traceparent` when it sent a valid one, else a new trace.
fn request_span(headers: &HeaderMap, kind: Kind) -> tracing::Span {
    let route = match kind {
        Kind::Completion => "/v1/completions",
        Kind::Chat => "/v1/chat/completions",
    };
    let span = kvmesh_telemetry::span!("router.request", http.route = route);
    kvmesh_telemetry::propagate::continue_http(&span, headers);
    span
}

/// Both generation routes: the body, validated for `kind`, admitted, then
/// the mesh's events as one response or as SSE. Every refusal or failure
/// before the response starts is counted once ([`Router::fail`]) and
/// mapped by [`GatewayError`].
async fn generate(
    r: Router,
    tenant: Tenant,
    faults: Option<axum::Extension<FaultPlan>>,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
    span: tracing::Span,
) -> Response {
    let faults = faults.map(|f| f.0).unwrap_or_default();
    match start(&r, tenant, faults, body, kind)
        .instrument(span.clone())
        .await
    {
        Ok((choices, shape, id, echoes, reading)) => {
            kvmesh_telemetry::record(&span, "request.id", id.clone());
            kvmesh_telemetry::record(&span, "stream", shape.stream);
            let meta = Meta {
                span,
                kind,
                id,
                reading,
                model: r.config().model_id.clone(),
                created: unix_now(),
                shape,
                echoes,
                router: r.clone(),
            };
            if shape.stream {
                respond::stream(choices, meta).into_response()
            } else {
                match respond::whole(choices, &meta).await {
                    Ok(body) => Json(body).into_response(),
                    Err(e) => e.into_response(),
                }
            }
        }
        Err(e) => {
            kvmesh_telemetry::fail(&span, e.kind());
            r.fail(e).into_response()
        }
    }
}

/// Everything before the response starts: read, parse and validate the
/// body, mint the response id, admit every choice, start them on the mesh
/// ([`Choices::start`]). Also each prompt's echoed text, when the body
/// asked for it.
async fn start(
    r: &Router,
    tenant: Tenant,
    faults: FaultPlan,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Result<(Choices, Shape, String, Vec<String>, Reading), GatewayError> {
    let body = body?;
    // Parse, validate and tokenize: what a refused body never gets past.
    let span = kvmesh_telemetry::span!("router.validate");
    let (n, shape, echoes, prompts) = span
        .in_scope(|| {
            let Parsed { requests, n, shape } = parse_body(matches!(kind, Kind::Chat), &body)?;
            let mut echoes = Vec::new();
            let mut prompts = Vec::with_capacity(requests.len());
            for request in requests {
                if shape.echo {
                    echoes.push(match &request.prompt {
                        Prompt::Text(t) => t.clone(),
                        Prompt::Ids(ids) => r
                            .tokenizer()
                            .decode(ids, false)
                            .map_err(|e| invalid("prompt", e.to_string()))?,
                        Prompt::Chat(_) => String::new(),
                    });
                }
                prompts.push(validate::request(r, request)?);
            }
            Ok::<_, Rejection>((n, shape, echoes, prompts))
        })
        .inspect_err(|e| kvmesh_telemetry::fail(&span, e.reason()))?;
    if !span.is_disabled() {
        let tokens: usize = prompts.iter().map(|p| p.ids().len()).sum();
        kvmesh_telemetry::record(&span, "prompts", prompts.len() as i64);
        kvmesh_telemetry::record(&span, "prompt_tokens", tokens as i64);
        kvmesh_telemetry::record(&span, "n", n as i64);
    }
    drop(span);
    let id = match kind {
        Kind::Completion => request_id("cmpl"),
        Kind::Chat => request_id("chatcmpl"),
    }
    .ok_or(GatewayError::Internal("cannot mint a request id"))?;
    let reading = prompts
        .first()
        .map(|v| v.reading().clone())
        .unwrap_or_default();
    let choices = Choices::start(r, prompts, n, tenant, faults).await?;
    Ok((choices, shape, id, echoes, reading))
}

#[derive(Clone, Copy)]
enum Kind {
    Completion,
    Chat,
}

async fn models(State(r): State<Router>) -> Json<Value> {
    Json({
        let c = r.config();
        let mut model = json!({"id": c.model_id, "object": "model", "created": 0, "owned_by": "kvmesh", "max_model_len": c.max_model_len});
        let (architecture, quantization) = &c.model_description;
        if !architecture.is_empty() {
            model["architecture"] = json!(architecture);
            model["quantization"] = json!(quantization);
        }
        json!({"object": "list", "data": [model]})
    })
}

async fn health(State(r): State<Router>) -> Response {
    if r.is_draining() {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n").into_response();
    }
    // A membership source that cannot be reached does not stop the
    // router (it routes on its last view), so it is reported, not failed.
    let d = *r.mesh().discovery().borrow();
    let degraded = d.degraded_since().map(|since| {
        format!(
            "degraded: membership source {} unreachable for {} s, routing on the last view\n",
            d.source(),
            since.elapsed().as_secs()
        )
    });
    match (r.mesh().capacity(), degraded) {
        (Some(_), None) => (StatusCode::OK, "ok\n").into_response(),
        (Some(_), Some(d)) => (StatusCode::OK, format!("ok, {d}")).into_response(),
        (None, d) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "no healthy prefill or decode node\n{}",
                d.unwrap_or_default()
            ),
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
        r.metrics_text(),
    )
        .into_response()
}

mod body;
mod chat;
mod gate;
mod respond;
mod tokenize;

#[cfg(test)]
mod tests;
