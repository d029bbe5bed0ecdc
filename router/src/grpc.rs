//! The public gRPC API (`kvmesh.v1.Generation`), the standard gRPC health
//! service and server reflection, over the same validation, admission and
//! mesh as the HTTP gateway. Every status and stream error comes from
//! [`GatewayError`] (`crate::error`), counted once through
//! [`Router::fail`].

use std::pin::Pin;

use kvmesh_proto::v1::generation_server::{Generation, GenerationServer};
use kvmesh_proto::v1::{
    generate_request, tokenize_request, Chat, DetokenizeRequest, DetokenizeResponse, FinishReason,
    GenerateRequest, GenerateResponse, ListModelsRequest, ListModelsResponse, Model,
    TokenizeRequest, TokenizeResponse, ToolCall, Usage,
};
use kvmesh_tokenizer::ChatMessage;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::auth::Tenant;
use crate::choices::{Choices, MAX_CHOICES};
use crate::error::GatewayError;
use crate::mesh::{Event, Finish};
use crate::tokenize::{self, Input};
use crate::tools::parse::{Out, Parser};
use crate::validate::{self, invalid, Prompt};
use crate::Router;

/// The gRPC health service name of the router's membership: SERVING while
/// it is current (a fixed one always is), NOT_SERVING while its source
/// (etcd) cannot be reached and the router routes on its last view.
pub const MEMBERSHIP_HEALTH: &str = "kvmesh.membership";

/// The public gRPC server: Generation (behind the API-key check), health,
/// reflection.
pub fn service(router: Router) -> tonic::transport::server::Router {
    let (reporter, health) = tonic_health::server::health_reporter();
    let mut draining = router.draining.subscribe();
    let mut discovery = router.mesh().discovery();
    tokio::spawn(async move {
        reporter.set_serving::<GenerationServer<Api>>().await;
        // The membership's own entry: NOT_SERVING while its source (etcd)
        // cannot be reached. The server and the API stay SERVING: the
        // router routes on its last view meanwhile.
        let mut watching = true;
        loop {
            let status = match discovery.borrow_and_update().degraded_since() {
                Some(_) => tonic_health::ServingStatus::NotServing,
                None => tonic_health::ServingStatus::Serving,
            };
            reporter.set_service_status(MEMBERSHIP_HEALTH, status).await;
            tokio::select! {
                r = discovery.changed(), if watching => watching = r.is_ok(),
                // A drain: health says not serving, for the whole server too.
                _ = draining.wait_for(|d| *d) => break,
            }
        }
        reporter.set_not_serving::<GenerationServer<Api>>().await;
        reporter
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
    });
    let mut server = tonic::transport::Server::builder();
    let routes = server
        .add_service(health)
        .add_service(GenerationServer::new(Api { router }));
    // Reflection lists what this port serves: the public API and health.
    match tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(kvmesh_proto::PUBLIC_FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
    {
        Ok(reflection) => routes.add_service(reflection),
        Err(e) => {
            tracing::warn!(error = %e, "gRPC reflection unavailable");
            routes
        }
    }
}

/// A started request and what its messages need besides its events.
struct Started {
    choices: Choices,
    /// How the answer's text becomes reasoning, content and tool calls.
    reading: crate::tools::parse::Reading,
    /// `echo`: the prompt's text, for each sample's first message.
    echo: Option<String>,
    /// `prompt_logprobs`: alternatives per prompt position.
    scored: Option<usize>,
}

/// The Generation service.
#[derive(Debug, Clone)]
pub struct Api {
    router: Router,
}

/// A chat's messages; a call's arguments must be JSON text (templates get
/// them as an object, transformers' convention).
fn chat(c: Chat) -> Result<Vec<ChatMessage>, crate::Rejection> {
    c.messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let tool_calls = m
                .tool_calls
                .into_iter()
                .map(|c| {
                    let arguments: serde_json::Value =
                        serde_json::from_str(&c.arguments).map_err(|e| {
                            invalid(
                                "messages",
                                format!("messages[{i}].tool_calls: arguments is not JSON: {e}"),
                            )
                        })?;
                    Ok(kvmesh_tokenizer::ToolCall::function(
                        c.id, c.name, arguments,
                    ))
                })
                .collect::<Result<_, crate::Rejection>>()?;
            Ok(ChatMessage {
                tool_calls,
                tool_call_id: (!m.tool_call_id.is_empty()).then_some(m.tool_call_id),
                name: (!m.name.is_empty()).then_some(m.name),
                reasoning_content: (!m.reasoning_content.is_empty()).then_some(m.reasoning_content),
                ..ChatMessage::new(m.role, m.content)
            })
        })
        .collect()
}

/// The message of `pieces` of a sample's answer: reasoning as
/// `reasoning_text`, content as `text`, calls as `tool_calls` (a call's
/// opening piece joined to its first arguments).
fn answer_message(pieces: Vec<Out>) -> GenerateResponse {
    let mut msg = GenerateResponse::default();
    for p in pieces {
        match p {
            Out::Reasoning(t) => msg.reasoning_text.push_str(&t),
            Out::Content(t) => msg.text.push_str(&t),
            Out::Start { index, id, name } => msg.tool_calls.push(ToolCall {
                index: u32::try_from(index).unwrap_or(u32::MAX),
                id,
                name,
                arguments: String::new(),
            }),
            Out::Args { index, fragment } => {
                let index = u32::try_from(index).unwrap_or(u32::MAX);
                match msg.tool_calls.last_mut() {
                    Some(c) if c.index == index => c.arguments.push_str(&fragment),
                    _ => msg.tool_calls.push(ToolCall {
                        index,
                        arguments: fragment,
                        ..Default::default()
                    }),
                }
            }
        }
    }
    msg
}

impl Api {
    /// `e`, counted, as the status the caller gets.
    fn fail(&self, e: impl Into<GatewayError>) -> Status {
        self.router.fail(e.into()).grpc()
    }

    /// The caller's tenant from its `authorization` metadata; every call
    /// starts here (UNAUTHENTICATED before anything else).
    fn tenant<T>(&self, req: &Request<T>) -> Result<Tenant, Status> {
        let header = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        self.router
            .config()
            .api_keys
            .check(header)
            .map_err(|e| self.fail(e))
    }

    /// The request validated and tokenized, with its sample count and
    /// echoed text: what a refused request never gets past.
    fn validate(
        &self,
        r: GenerateRequest,
    ) -> Result<(validate::Valid, usize, Option<String>), GatewayError> {
        let prompt = match r.input {
            Some(generate_request::Input::Prompt(text)) => Prompt::Text(text),
            Some(generate_request::Input::Chat(c)) => Prompt::Chat(chat(c)?),
            Some(generate_request::Input::TokenIds(t)) => Prompt::Ids(t.ids),
            None => return Err(invalid("input", "input: a prompt or a chat is required").into()),
        };
        let echo = match (&prompt, r.echo) {
            (_, false) => None,
            (Prompt::Text(t), true) => Some(t.clone()),
            (Prompt::Ids(ids), true) => Some(
                self.router
                    .tokenizer()
                    .decode(ids, false)
                    .map_err(|e| invalid("input", e.to_string()))?,
            ),
            (Prompt::Chat(_), true) => {
                return Err(invalid(
                    "echo",
                    "echo applies to a prompt or token ids, not to a chat",
                )
                .into())
            }
        };
        if r.enable_thinking.is_some() && !matches!(prompt, Prompt::Chat(_)) {
            return Err(invalid(
                "enable_thinking",
                "enable_thinking applies to a chat (the chat template's argument)",
            )
            .into());
        }
        let sampling = validate::SamplingIn {
            temperature: r.temperature.map(f64::from),
            top_p: r.top_p.map(f64::from),
            top_k: r.top_k.map(i64::from),
            min_p: r.min_p.map(f64::from),
            presence_penalty: r.presence_penalty.map(f64::from),
            frequency_penalty: r.frequency_penalty.map(f64::from),
            repetition_penalty: r.repetition_penalty.map(f64::from),
            logit_bias: r
                .logit_bias
                .into_iter()
                .map(|(id, b)| (id, f64::from(b)))
                .collect(),
            min_tokens: (r.min_tokens != 0).then_some(u64::from(r.min_tokens)),
            seed: r.seed,
            logprobs: r.logprobs.map(u64::from),
            logprobs_param: "logprobs",
            logprobs_max: kvmesh_proto::LOGPROBS_MAX,
        };
        let valid = validate::request(
            &self.router,
            validate::Request {
                model: Some(r.model),
                // 0 is the proto's unset: the default budget.
                max_tokens: (r.max_tokens != 0).then_some(u64::from(r.max_tokens)),
                max_tokens_param: "max_tokens",
                sampling,
                stop: r.stop,
                stop_token_ids: r.stop_token_ids,
                ignore_eos: r.ignore_eos,
                cache_salt: r.cache_salt,
                structured: crate::structured::from_grpc(r.structured_output)?,
                tools: crate::tools::from_grpc(r.tools, r.tool_choice, r.parallel_tool_calls)?,
                prompt_logprobs: r.prompt_logprobs.map(u64::from),
                enable_thinking: r.enable_thinking,
                ..validate::Request::new(prompt)
            },
        )?;
        let n = match r.n {
            0 => 1,
            n if n as usize <= MAX_CHOICES => n as usize,
            n => {
                return Err(invalid("n", format!("n = {n} samples; at most {MAX_CHOICES}")).into())
            }
        };
        Ok((valid, n, echo))
    }

    /// Everything before the stream starts: the front-end-neutral request,
    /// validated, admitted, started on the mesh.
    /// Also what the answer's messages need besides the events: the tool
    /// calls' parsing, the echoed prompt text (`echo`) and the prompt's
    /// alternatives per position (`prompt_logprobs`).
    async fn start(&self, tenant: Tenant, r: GenerateRequest) -> Result<Started, GatewayError> {
        let span = kvmesh_telemetry::span!("router.validate");
        let (valid, n, echo) = span
            .in_scope(|| self.validate(r))
            .inspect_err(|e| kvmesh_telemetry::fail(&span, e.kind()))?;
        kvmesh_telemetry::record(&span, "prompt_tokens", valid.ids().len() as i64);
        kvmesh_telemetry::record(&span, "n", n as i64);
        drop(span);
        let reading = valid.reading().clone();
        let scored = valid.settings().prompt_logprobs.map(|k| k as usize);
        let choices = Choices::start(
            &self.router,
            vec![valid],
            n,
            tenant,
            kvmesh_faults::FaultPlan::none(),
        )
        .await?;
        Ok(Started {
            choices,
            reading,
            echo,
            scored,
        })
    }
}

type GenStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Generation for Api {
    type GenerateStream = GenStream;

    async fn generate(&self, req: Request<GenerateRequest>) -> Result<Response<GenStream>, Status> {
        let tenant = self.tenant(&req)?;
        // The root span: a child of the caller's `traceparent` metadata
        // when valid, else a new trace.
        let span = kvmesh_telemetry::span!(
            "router.request",
            rpc.method = "kvmesh.v1.Generation/Generate"
        );
        kvmesh_telemetry::propagate::continue_grpc(&span, req.metadata());
        let Started {
            choices: mut g,
            reading,
            echo,
            scored,
        } = self
            .start(tenant, req.into_inner())
            .instrument(span.clone())
            .await
            .map_err(|e| {
                kvmesh_telemetry::fail(&span, e.kind());
                self.fail(e)
            })?;
        let (tx, out) = tokio::sync::mpsc::channel(64);
        let router = self.router.clone();
        tokio::spawn(async move {
            // Held until the answer has gone out.
            let _span = span;
            let prompt_tokens = g.prompt_tokens();
            let mut lps: Vec<_> = (0..g.len())
                .map(|_| crate::logprobs::Logprobs::new(router.tokenizer(), 0))
                .collect();
            let mut left = g.len();
            let mut parsers: Vec<Parser> = (0..g.len()).map(|_| Parser::new(&reading)).collect();
            // Each sample's first message carries the echo and the
            // prompt's scores (sample 0's `Event::Prompt`, which comes
            // before every event of the other samples).
            let mut opened = vec![false; g.len()];
            let mut prompt_lps = Vec::new();
            loop {
                // Leave as soon as the caller is gone: dropping the
                // generation tells the mesh to abort.
                let ev = tokio::select! {
                    ev = g.next() => ev,
                    () = tx.closed() => return,
                };
                let Some((i, ev)) = ev else { return };
                let end = match &ev {
                    Event::Text { .. } | Event::Prompt(_) => false,
                    Event::Done { .. } => {
                        left -= 1;
                        left == 0
                    }
                    Event::Error(_) => true,
                };
                let msg = match ev {
                    Event::Prompt(tokens) => {
                        prompt_lps = crate::logprobs::grpc_prompt(
                            router.tokenizer(),
                            &tokens,
                            scored.unwrap_or(0),
                        );
                        GenerateResponse::default()
                    }
                    Event::Text { text, logprobs } => GenerateResponse {
                        logprobs: lps[i].part(&logprobs).grpc(),
                        ..answer_message(parsers[i].push(&text))
                    },
                    Event::Done {
                        finish,
                        completion_tokens,
                        cached_tokens,
                    } => {
                        // The answer's last pieces first: `required`'s
                        // calls appear only now.
                        let rest = answer_message(parsers[i].finish());
                        GenerateResponse {
                            finish_reason: match finish {
                                Finish::Stop if parsers[i].calls() > 0 => FinishReason::ToolCalls,
                                Finish::Stop => FinishReason::Stop,
                                Finish::Length => FinishReason::Length,
                            } as i32,
                            usage: Some(Usage {
                                prompt_tokens: u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
                                completion_tokens: u32::try_from(completion_tokens)
                                    .unwrap_or(u32::MAX),
                                cached_tokens: u32::try_from(cached_tokens).unwrap_or(u32::MAX),
                            }),
                            ..rest
                        }
                    }
                    Event::Error(e) => GatewayError::from(e).grpc_stream_end(),
                };
                let mut msg = GenerateResponse {
                    index: u32::try_from(i).unwrap_or(u32::MAX),
                    ..msg
                };
                if let Some(first) = opened.get_mut(i).filter(|o| !**o) {
                    *first = true;
                    msg.prompt_text = echo.clone().unwrap_or_default();
                    msg.prompt_logprobs = prompt_lps.clone();
                }
                if tx.send(Ok(msg)).await.is_err() || end {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out),
        )))
    }

    async fn tokenize(
        &self,
        req: Request<TokenizeRequest>,
    ) -> Result<Response<TokenizeResponse>, Status> {
        self.tenant(&req)?;
        let r = req.into_inner();
        let input = match r.input {
            Some(tokenize_request::Input::Prompt(text)) => Input::Prompt {
                text,
                add_special_tokens: r.add_special_tokens.unwrap_or(true),
            },
            Some(tokenize_request::Input::Chat(c)) => Input::Chat {
                messages: chat(c).map_err(|e| GatewayError::from(e).grpc())?,
                add_generation_prompt: r.add_generation_prompt.unwrap_or(true),
                add_special_tokens: r.add_special_tokens.unwrap_or(false),
            },
            None => {
                return Err(GatewayError::from(invalid(
                    "input",
                    "input: a prompt or a chat is required",
                ))
                .grpc())
            }
        };
        if r.add_generation_prompt.is_some() && matches!(input, Input::Prompt { .. }) {
            return Err(GatewayError::from(invalid(
                "add_generation_prompt",
                "add_generation_prompt applies to a chat, not to a prompt",
            ))
            .grpc());
        }
        // Refusals are not counted: nothing was asked to generate.
        let tokens = tokenize::tokenize(&self.router, Some(&r.model), input, r.return_token_strs)
            .map_err(|e| GatewayError::from(e).grpc())?;
        Ok(Response::new(TokenizeResponse {
            token_ids: tokens.ids,
            max_model_len: u32::try_from(self.router.config().max_model_len).unwrap_or(u32::MAX),
            token_strs: tokens.strs.unwrap_or_default(),
        }))
    }

    async fn detokenize(
        &self,
        req: Request<DetokenizeRequest>,
    ) -> Result<Response<DetokenizeResponse>, Status> {
        self.tenant(&req)?;
        let r = req.into_inner();
        let text = tokenize::detokenize(&self.router, Some(&r.model), &r.token_ids, "token_ids")
            .map_err(|e| GatewayError::from(e).grpc())?;
        Ok(Response::new(DetokenizeResponse { text }))
    }

    async fn list_models(
        &self,
        req: Request<ListModelsRequest>,
    ) -> Result<Response<ListModelsResponse>, Status> {
        self.tenant(&req)?;
        let c = self.router.config();
        Ok(Response::new(ListModelsResponse {
            models: vec![Model {
                id: c.model_id.clone(),
                max_model_len: u32::try_from(c.max_model_len).unwrap_or(u32::MAX),
            }],
        }))
    }
}

#[cfg(test)]
mod tests;
