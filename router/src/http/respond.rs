//! A request's choices as the client gets them: one JSON body, or
//! server-sent events. Choice `i` carries `"index": i`; usage counts each
//! prompt once and every choice's completion tokens.

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use serde_json::{json, Value};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tracing::Instrument;

use super::{Kind, Shape, SSE_KEEP_ALIVE};
use crate::choices::Choices;
use crate::error::{DispatchError, GatewayError};
use crate::logprobs;
use crate::mesh::{Event, Finish};
use crate::tools::parse::{Answer, Out, Parser, Reading};
use crate::Router;

/// What every response of one request repeats.
pub(super) struct Meta {
    /// The request's root span, held until the answer has gone out.
    pub(super) span: tracing::Span,
    pub(super) kind: Kind,
    pub(super) id: String,
    pub(super) model: String,
    pub(super) created: u64,
    pub(super) shape: Shape,
    /// Each prompt's text that opens its choices' answers (`echo`), or
    /// nothing.
    pub(super) echoes: Vec<String>,
    /// For the tokens' text in logprobs.
    pub(super) router: Router,
    /// How each choice's text is read (reasoning and tool calls out of
    /// it, or not).
    pub(super) reading: Reading,
}

/// The finish reason a client sees: `tool_calls` when a choice that
/// stopped on its own made calls.
fn finish_reason(finish: Finish, calls: usize) -> &'static str {
    match finish {
        Finish::Stop if calls > 0 => "tool_calls",
        f => f.as_str(),
    }
}

/// The chat deltas of `pieces`, as OpenAI streams them: reasoning as
/// `reasoning_content` (vLLM's), content as `content`, calls as
/// `tool_calls`: a call's first delta has its index, id, type and name
/// (arguments empty), the next ones pieces of its arguments.
fn deltas(pieces: Vec<Out>) -> Vec<Value> {
    pieces
        .into_iter()
        .map(|p| match p {
            Out::Reasoning(t) => json!({"reasoning_content": t}),
            Out::Content(t) => json!({"content": t}),
            Out::Start { index, id, name } => {
                json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]})
            }
            Out::Args { index, fragment } => {
                json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
            }
        })
        .collect()
}

impl Meta {
    /// What opens choice `i`'s text (`n` samples per prompt).
    fn echo(&self, i: usize, n: usize) -> &str {
        self.echoes.get(i / n.max(1)).map_or("", String::as_str)
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }
}

/// OpenAI's usage object; `cached_tokens` are the prompt tokens the
/// prefix cache supplied.
fn usage(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

/// Usage over the choices as they finish: completion tokens of every
/// choice; cached tokens of each prompt's first sample (the prompt is
/// counted once, and its later samples find what the first computed).
#[derive(Default)]
struct Tally {
    completion_tokens: usize,
    cached_tokens: usize,
    left: usize,
}

impl Tally {
    fn done(&mut self, i: usize, n: usize, completion_tokens: usize, cached_tokens: usize) {
        self.completion_tokens += completion_tokens;
        if i.is_multiple_of(n.max(1)) {
            self.cached_tokens += cached_tokens;
        }
        self.left = self.left.saturating_sub(1);
    }

    fn usage(&self, c: &Choices) -> Value {
        usage(
            c.prompt_tokens(),
            self.completion_tokens,
            self.cached_tokens,
        )
    }
}

/// The unstreamed response: every choice's whole text, or the first
/// failure (its status and body; the other choices are dropped, which
/// aborts them).
pub(super) async fn whole(mut c: Choices, m: &Meta) -> Result<Value, GatewayError> {
    let (k, n) = (c.len(), c.n());
    let tokenizer = m.router.tokenizer();
    let mut texts: Vec<String> = (0..k).map(|i| m.echo(i, n).to_owned()).collect();
    let mut lps: Vec<logprobs::Logprobs<'_>> = texts
        .iter()
        .map(|t| logprobs::Logprobs::new(tokenizer, t.chars().count()))
        .collect();
    let mut choices: Vec<Option<Value>> = vec![None; k];
    // Each prompt's vLLM `prompt_logprobs`, from its sample 0's first
    // event (which precedes every event of its other samples).
    let mut prompt_lps: Vec<Value> = vec![Value::Null; k.div_ceil(n.max(1))];
    let mut tally = Tally {
        left: k,
        ..Tally::default()
    };
    let wants = c.wants_logprobs();
    while tally.left > 0 {
        let Some((i, ev)) = c.next().await else { break };
        match ev {
            Event::Prompt(tokens) => {
                let p = i / n.max(1);
                if let Some(k) = m.shape.echo_logprobs {
                    for l in lps.iter_mut().skip(p * n).take(n) {
                        l.prompt(&tokens, k);
                    }
                }
                if let Some(k) = m.shape.prompt_logprobs {
                    prompt_lps[p] = logprobs::vllm_prompt(tokenizer, &tokens, k);
                }
            }
            Event::Text { text, logprobs } => {
                texts[i].push_str(&text);
                lps[i].extend(&logprobs);
            }
            Event::Done {
                finish,
                completion_tokens,
                cached_tokens,
            } => {
                tally.done(i, n, completion_tokens, cached_tokens);
                let text = std::mem::take(&mut texts[i]);
                choices[i] = Some(match m.kind {
                    Kind::Completion => {
                        let mut v = json!({"index": i, "text": text, "finish_reason": finish.as_str(), "logprobs": wants.then(|| lps[i].completion())});
                        if m.shape.prompt_logprobs.is_some() {
                            v["prompt_logprobs"] = prompt_lps[i / n.max(1)].clone();
                        }
                        v
                    }
                    Kind::Chat if m.reading.is_plain() => {
                        json!({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish.as_str(), "logprobs": wants.then(|| lps[i].chat())})
                    }
                    Kind::Chat => {
                        let mut p = Parser::new(&m.reading);
                        let mut a = Answer::default();
                        a.absorb(p.push(&text));
                        a.absorb(p.finish());
                        let mut message = json!({"role": "assistant", "content": a.content()});
                        if m.reading.reasoning.is_some() {
                            message["reasoning_content"] = a.reasoning().into();
                        }
                        if !a.calls.is_empty() {
                            message["tool_calls"] = a
                                .calls
                                .iter()
                                .map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
                                .collect();
                        }
                        json!({"index": i, "message": message, "finish_reason": finish_reason(finish, a.calls.len()), "logprobs": wants.then(|| lps[i].chat())})
                    }
                });
            }
            Event::Error(e) => return Err(e.into()),
        }
    }
    if tally.left > 0 {
        // `next` ends only after every terminal event, counted above.
        return Err(DispatchError::Unfinished.into());
    }
    let mut body = json!({"id": m.id, "object": m.object(false), "created": m.created, "model": m.model, "choices": choices.into_iter().flatten().collect::<Vec<_>>(), "usage": tally.usage(&c)});
    // Chat (one prompt): vLLM puts the prompt's scores beside the choices.
    if let (Kind::Chat, Some(_)) = (m.kind, m.shape.prompt_logprobs) {
        body["prompt_logprobs"] = prompt_lps.swap_remove(0);
    }
    Ok(body)
}

/// One SSE chunk of choice `index`.
fn chunk(
    m: &Meta,
    index: usize,
    delta: Value,
    lp: Option<Value>,
    finish: Value,
    usage: Option<Value>,
) -> SseEvent {
    SseEvent::default().data(chunk_value(m, index, delta, lp, finish, usage).to_string())
}

/// A choice's opening chunk: a chat's role, an echoing completion's
/// prompt (with the prompt's tokens' logprobs when `echo` has
/// `logprobs`), and vLLM's `prompt_logprobs` when asked (`prompt`: the
/// prompt's scored tokens, when the request scored it). `None` when
/// there is nothing to open with.
fn opening(
    m: &Meta,
    i: usize,
    n: usize,
    prompt: Option<&[crate::mesh::PromptToken]>,
) -> Option<SseEvent> {
    let tokenizer = m.router.tokenizer();
    let (delta, lp) = match m.kind {
        Kind::Chat => (json!({"role": "assistant", "content": ""}), None),
        Kind::Completion => {
            let lp = match (prompt, m.shape.echo_logprobs) {
                (Some(t), Some(k)) => {
                    let mut l = logprobs::Logprobs::new(tokenizer, 0);
                    l.prompt(t, k);
                    Some(l.completion())
                }
                _ => None,
            };
            if m.echo(i, n).is_empty() && lp.is_none() && m.shape.prompt_logprobs.is_none() {
                return None;
            }
            (json!({"content": m.echo(i, n)}), lp)
        }
    };
    let mut v = chunk_value(m, i, delta, lp, Value::Null, None);
    if let (Some(t), Some(k)) = (prompt, m.shape.prompt_logprobs) {
        let pl = logprobs::vllm_prompt(tokenizer, t, k);
        match m.kind {
            Kind::Chat => v["prompt_logprobs"] = pl,
            Kind::Completion => v["choices"][0]["prompt_logprobs"] = pl,
        }
    }
    Some(SseEvent::default().data(v.to_string()))
}

/// [`chunk`]'s JSON.
fn chunk_value(
    m: &Meta,
    index: usize,
    delta: Value,
    lp: Option<Value>,
    finish: Value,
    usage: Option<Value>,
) -> Value {
    let lp = lp.unwrap_or(Value::Null);
    let choice = match m.kind {
        Kind::Completion => {
            json!({"index": index, "text": delta.get("content").cloned().unwrap_or(json!("")), "finish_reason": finish, "logprobs": lp})
        }
        Kind::Chat => {
            json!({"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp})
        }
    };
    let mut v = json!({"id": m.id, "object": m.object(true), "created": m.created, "model": m.model, "choices": [choice]});
    if let Some(u) = usage {
        v["usage"] = u;
    }
    v
}

/// The SSE response: per choice, an opening chunk (a chat's role, an
/// echoing completion's prompt; when the prompt is scored, sent when its
/// scores arrive, and carrying them), a chunk per text event and one with its
/// finish reason; the last choice's finish chunk carries usage (unless
/// `stream_options.include_usage` is false); then `[DONE]`. A failure
/// after the response began is one error event
/// ([`GatewayError::sse_event`]) and then `[DONE]`, and the other choices
/// are dropped. With logprobs, each chunk carries its tokens'.
pub(super) fn stream(
    c: Choices,
    m: Meta,
) -> Sse<impl tokio_stream::Stream<Item = Result<SseEvent, Infallible>>> {
    let wants = c.wants_logprobs();
    // Events to SSE frames on a task of their own: when the client goes
    // away (noticed by hyper on a write: an event or a keep-alive comment)
    // its receiver drops, this task drops the choices, and the mesh sees
    // each request abandoned.
    let (tx, out) = tokio::sync::mpsc::channel::<SseEvent>(64);
    let span = m.span.clone();
    let frames = async move {
        let mut c = c;
        let (k, n) = (c.len(), c.n());
        // A scored prompt's choices open at its `Event::Prompt` (the
        // first of its stream), with the scores; the others at once.
        for i in (0..k).filter(|_| !m.shape.scores_prompt()) {
            if let Some(frame) = opening(&m, i, n, None) {
                if tx.send(frame).await.is_err() {
                    return;
                }
            }
        }
        let tokenizer = m.router.tokenizer();
        let mut lps: Vec<logprobs::Logprobs<'_>> = (0..k)
            .map(|i| logprobs::Logprobs::new(tokenizer, m.echo(i, n).chars().count()))
            .collect();
        let mut tally = Tally {
            left: k,
            ..Tally::default()
        };
        let mut parsers: Vec<Parser> = (0..k).map(|_| Parser::new(&m.reading)).collect();
        loop {
            // Leave as soon as the client is gone, not at the next event:
            // dropping the choices is what tells the mesh to abort.
            let ev = tokio::select! {
                ev = c.next() => ev,
                () = tx.closed() => return,
            };
            let Some((i, ev)) = ev else { return };
            let (frames, last) = match ev {
                Event::Prompt(tokens) => {
                    let p = i / n.max(1);
                    let frames = (p * n..(p * n + n).min(k))
                        .filter_map(|j| opening(&m, j, n, Some(&tokens)))
                        .collect();
                    (frames, false)
                }
                Event::Text { text, logprobs } => {
                    let lp = wants.then(|| {
                        let part = lps[i].part(&logprobs);
                        match m.kind {
                            Kind::Completion => part.completion(),
                            Kind::Chat => part.chat(),
                        }
                    });
                    let mut ds = if m.reading.is_plain() {
                        vec![json!({"content": text})]
                    } else {
                        deltas(parsers[i].push(&text))
                    };
                    // Logprobs of tokens whose text is held back still go
                    // out now, with no text.
                    if ds.is_empty() && lp.is_some() {
                        ds.push(json!({"content": ""}));
                    }
                    let mut lp = lp;
                    let frames = ds
                        .into_iter()
                        .map(|d| chunk(&m, i, d, lp.take(), Value::Null, None))
                        .collect();
                    (frames, false)
                }
                Event::Done {
                    finish,
                    completion_tokens,
                    cached_tokens,
                } => {
                    tally.done(i, n, completion_tokens, cached_tokens);
                    let last = tally.left == 0;
                    let usage = (last && m.shape.stream_usage).then(|| tally.usage(&c));
                    let mut frames: Vec<SseEvent> = deltas(parsers[i].finish())
                        .into_iter()
                        .map(|d| chunk(&m, i, d, None, Value::Null, None))
                        .collect();
                    let reason = finish_reason(finish, parsers[i].calls());
                    frames.push(chunk(&m, i, json!({}), None, json!(reason), usage));
                    if last {
                        frames.push(SseEvent::default().data("[DONE]"));
                    }
                    (frames, last)
                }
                Event::Error(e) => (
                    vec![
                        GatewayError::from(e).sse_event(),
                        SseEvent::default().data("[DONE]"),
                    ],
                    true,
                ),
            };
            for f in frames {
                if tx.send(f).await.is_err() {
                    return;
                }
            }
            if last {
                return;
            }
        }
    };
    tokio::spawn(frames.instrument(span));
    let all = ReceiverStream::new(out).map(Ok);
    // A comment every 250 ms while no event flows: writing is how a
    // closed connection shows (hyper does not watch the read side here),
    // so a client that leaves during a long prefill is noticed within
    // about two intervals and both nodes are told to abort.
    Sse::new(all).keep_alive(KeepAlive::new().interval(SSE_KEEP_ALIVE))
}
