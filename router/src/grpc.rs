//! The public gRPC API (`kvmesh.v1.Generation`), the standard gRPC health
//! service and server reflection, over the same admission and dispatch as
//! the HTTP gateway.

use std::pin::Pin;

use kvmesh_proto::v1::generation_server::{Generation, GenerationServer};
use kvmesh_proto::v1::{
    generate_request, tokenize_request, Chat, FinishReason, GenerateRequest, GenerateResponse,
    ListModelsRequest, ListModelsResponse, Model, TokenizeRequest, TokenizeResponse, Usage,
};
use kvmesh_tokenizer::ChatMessage;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::auth::Tenant;
use crate::dispatch::{self, Event, Finish, Job};
use crate::error::Rejection;
use crate::validate::{self, invalid, Prompt};
use crate::Router;

/// The public gRPC server: Generation (behind the API-key check), health,
/// reflection.
pub fn service(router: Router) -> tonic::transport::server::Router {
    let (reporter, health) = tonic_health::server::health_reporter();
    let mut draining = router.draining.subscribe();
    tokio::spawn(async move {
        reporter.set_serving::<GenerationServer<Api>>().await;
        // A drain: health says not serving, for the whole server too.
        let _ = draining.wait_for(|d| *d).await;
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

/// The Generation service.
#[derive(Debug, Clone)]
pub struct Api {
    router: Router,
}

fn chat(c: Chat) -> Vec<ChatMessage> {
    c.messages
        .into_iter()
        .map(|m| ChatMessage::new(m.role, m.content))
        .collect()
}

impl Api {
    /// The caller's tenant from its `authorization` metadata; every call
    /// starts here (UNAUTHENTICATED before anything else).
    fn tenant<T>(&self, req: &Request<T>) -> Result<Tenant, Status> {
        let header = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        self.router.config().api_keys.check(header).map_err(|e| {
            self.router.metrics.rejected("unauthenticated");
            Status::unauthenticated(e.message())
        })
    }

    fn tokenize_input(
        &self,
        model: &str,
        prompt: Option<Result<String, Chat>>,
    ) -> Result<Vec<u32>, Status> {
        if !model.is_empty() && model != self.router.config().model_id {
            return Err(Rejection::UnknownModel(model.to_owned()).grpc());
        }
        let t = self.router.tokenizer();
        match prompt {
            Some(Ok(text)) => t.encode(&text),
            Some(Err(c)) => t.encode_chat(&chat(c)),
            None => {
                return Err(Status::invalid_argument(
                    "input: a prompt or a chat is required",
                ))
            }
        }
        .map_err(|e| Status::invalid_argument(e.to_string()))
    }
}

type GenStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Generation for Api {
    type GenerateStream = GenStream;

    async fn generate(&self, req: Request<GenerateRequest>) -> Result<Response<GenStream>, Status> {
        let tenant = self.tenant(&req)?;
        let r = req.into_inner();
        let input = r.input.map(|i| match i {
            generate_request::Input::Prompt(p) => Ok(p),
            generate_request::Input::Chat(c) => Err(c),
        });
        let prompt = match input {
            Some(Ok(text)) => Prompt::Text(text),
            Some(Err(c)) => Prompt::Chat(chat(c)),
            None => {
                let e = invalid("input", "input: a prompt or a chat is required");
                self.router.refused(&e);
                return Err(e.grpc());
            }
        };
        let checked = validate::request(
            &self.router,
            validate::Request {
                model: Some(r.model),
                prompt,
                // 0 is the proto's unset: the default budget.
                max_tokens: (r.max_tokens != 0).then_some(u64::from(r.max_tokens)),
                max_tokens_param: "max_tokens",
                temperature: r.temperature.map(f64::from),
                top_p: r.top_p.map(f64::from),
                seed: r.seed,
                stop: r.stop,
                ignore_eos: false,
            },
        );
        let (ids, s) = match checked {
            Ok(v) => v.into_parts(),
            Err(e) => {
                self.router.refused(&e);
                return Err(e.grpc());
            }
        };
        let prompt_tokens = ids.len();
        let permit = self
            .router
            .admit(prompt_tokens, s.max_tokens)
            .await
            .map_err(|e| e.grpc())?;
        let job = Job {
            prompt_ids: ids,
            max_tokens: s.max_tokens,
            temperature: s.temperature,
            top_p: s.top_p,
            seed: s.seed,
            stop: s.stop,
            ignore_eos: s.ignore_eos,
            tenant,
            faults: kvmesh_faults::FaultPlan::none(),
        };
        let mut rx = dispatch::start(&self.router, job, permit).map_err(|e| e.grpc())?;
        let (tx, out) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            while let Some(ev) = rx.recv().await {
                let msg = match ev {
                    Event::Text(text) => GenerateResponse {
                        text,
                        ..Default::default()
                    },
                    Event::Done {
                        finish,
                        completion_tokens,
                    } => GenerateResponse {
                        finish_reason: match finish {
                            Finish::Stop => FinishReason::Stop,
                            Finish::Length => FinishReason::Length,
                        } as i32,
                        usage: Some(Usage {
                            prompt_tokens: prompt_tokens as u32,
                            completion_tokens: completion_tokens as u32,
                        }),
                        ..Default::default()
                    },
                    Event::Error(e) => GenerateResponse {
                        finish_reason: FinishReason::Error as i32,
                        error: e.to_string(),
                        ..Default::default()
                    },
                };
                if tx.send(Ok(msg)).await.is_err() {
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
        let r = req.into_inner();
        let input = r.input.map(|i| match i {
            tokenize_request::Input::Prompt(p) => Ok(p),
            tokenize_request::Input::Chat(c) => Err(c),
        });
        let token_ids = self.tokenize_input(&r.model, input)?;
        Ok(Response::new(TokenizeResponse { token_ids }))
    }

    async fn list_models(
        &self,
        _req: Request<ListModelsRequest>,
    ) -> Result<Response<ListModelsResponse>, Status> {
        let c = self.router.config();
        Ok(Response::new(ListModelsResponse {
            models: vec![Model {
                id: c.model_id.clone(),
                max_model_len: u32::try_from(c.max_model_len).unwrap_or(u32::MAX),
            }],
        }))
    }
}
