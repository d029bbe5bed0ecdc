//! The public gRPC API of the mesh (in this process), from a client generated from the
//! repository's protos: Generate (streamed) equals the reference engine and
//! the HTTP gateway, Tokenize, ListModels, the standard health service,
//! reflection that lists only what the port serves, and
//! typed refusals.

use kvmesh_integration::inproc::{InProcessMesh as Mesh, Options};
use kvmesh_integration::tiny_model_dir;
use kvmesh_proto::v1::generation_client::GenerationClient;
use kvmesh_proto::v1::{
    generate_request, tokenize_request, Chat, ChatMessage, FinishReason, GenerateRequest,
    ListModelsRequest, TokenizeRequest,
};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

fn reference(prompt: &str, chat: bool) -> String {
    kvmesh_integration::reference_text(&tiny_model_dir(), prompt, chat, 20)
}

/// The mesh in this process; the test's client runs on its runtime.
fn start(opts: Options) -> Mesh {
    Mesh::start(&tiny_model_dir(), opts).unwrap_or_else(|e| panic!("starting the mesh: {e:#}"))
}

#[test]
fn public_grpc_api() {
    let mesh = start(Options::default());
    mesh.block_on(public_grpc_api_of(&mesh));
}

async fn public_grpc_api_of(mesh: &Mesh) {
    let url = format!("http://{}", mesh.grpc);
    let mut client = GenerationClient::connect(url.clone())
        .await
        .expect("connect");

    for (input, chat) in [
        (generate_request::Input::Prompt("Hello world".into()), false),
        (
            generate_request::Input::Chat(Chat {
                messages: vec![ChatMessage {
                    role: "user".into(),
                    content: "Hello world".into(),
                    ..Default::default()
                }],
            }),
            true,
        ),
    ] {
        let mut stream = client
            .generate(GenerateRequest {
                input: Some(input),
                max_tokens: 20,
                temperature: Some(0.0),
                ..Default::default()
            })
            .await
            .expect("generate")
            .into_inner();
        let (mut text, mut last) = (String::new(), None);
        while let Some(m) = stream.message().await.expect("message") {
            text.push_str(&m.text);
            if m.finish_reason != FinishReason::Unspecified as i32 {
                last = Some(m);
            }
        }
        assert_eq!(text, reference("Hello world", chat), "chat={chat}");
        let last = last.expect("a final message");
        assert!(last.error.is_empty(), "{}", last.error);
        let usage = last.usage.expect("usage");
        assert!(usage.prompt_tokens > 0 && usage.completion_tokens <= 20);
    }

    // Two samples (greedy: both the reference's answer), each message
    // tagged with its sample, each sample ending with its own usage.
    let mut stream = client
        .generate(GenerateRequest {
            input: Some(generate_request::Input::Prompt("Hello world".into())),
            max_tokens: 20,
            temperature: Some(0.0),
            n: 2,
            ..Default::default()
        })
        .await
        .expect("generate n=2")
        .into_inner();
    let (mut texts, mut finals) = (vec![String::new(); 2], vec![0; 2]);
    while let Some(m) = stream.message().await.expect("message") {
        let i = m.index as usize;
        texts[i].push_str(&m.text);
        if m.finish_reason != FinishReason::Unspecified as i32 {
            assert!(m.error.is_empty(), "{}", m.error);
            assert!(m.usage.is_some_and(|u| u.completion_tokens <= 20));
            finals[i] += 1;
        }
    }
    let want = reference("Hello world", false);
    assert_eq!(texts, [want.clone(), want]);
    assert_eq!(finals, [1, 1]);

    let ids = client
        .tokenize(TokenizeRequest {
            input: Some(tokenize_request::Input::Prompt("Hello world".into())),
            ..Default::default()
        })
        .await
        .expect("tokenize")
        .into_inner()
        .token_ids;
    assert!(!ids.is_empty());

    let models = client
        .list_models(ListModelsRequest {})
        .await
        .expect("models")
        .into_inner();
    assert_eq!(models.models[0].id, "tiny-llama");
    assert_eq!(models.models[0].max_model_len, 256);

    // Over the context window: INVALID_ARGUMENT before anything runs.
    let err = client
        .generate(GenerateRequest {
            input: Some(generate_request::Input::Prompt("Hello".into())),
            max_tokens: 1000,
            ..Default::default()
        })
        .await
        .expect_err("over length");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("maximum context length is 256"),
        "{}",
        err.message()
    );
    // The HTTP gateway's validation, with its defaults and limits: an empty
    // prompt and a fifth stop string are refused before admission, named,
    // and counted like any refusal.
    let rejected = |m: &Mesh| {
        m.metric("kvmesh_requests_rejected_total{reason=\"invalid_request\"}")
            .unwrap_or(0.0)
    };
    let before = rejected(mesh);
    for (req, what) in [
        (
            GenerateRequest {
                input: Some(generate_request::Input::Prompt(String::new())),
                ..Default::default()
            },
            "prompt",
        ),
        (
            GenerateRequest {
                input: Some(generate_request::Input::Prompt("Hello".into())),
                stop: vec!["a".into(); 5],
                ..Default::default()
            },
            "stop",
        ),
    ] {
        let err = client.generate(req).await.expect_err(what);
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{what}: {err}");
    }
    assert_eq!(rejected(mesh), before + 2.0);
    let err = client
        .generate(GenerateRequest {
            model: "other".into(),
            input: Some(generate_request::Input::Prompt("Hello".into())),
            ..Default::default()
        })
        .await
        .expect_err("unknown model");
    assert_eq!(err.code(), tonic::Code::NotFound);

    let channel = tonic::transport::Endpoint::from_shared(url.clone())
        .expect("url")
        .connect()
        .await
        .expect("health channel");
    let mut health = HealthClient::new(channel);
    let status = health
        .check(HealthCheckRequest {
            service: "kvmesh.v1.Generation".into(),
        })
        .await
        .expect("health check")
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    // Reflection names exactly what this port serves: not the internal
    // Decode and Prefill services, which answer only on the nodes' ports.
    assert_eq!(
        reflected_services(url).await,
        [
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "kvmesh.v1.Generation",
        ]
    );
}

/// The services a gRPC server reflection lists, sorted.
async fn reflected_services(url: String) -> Vec<String> {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let channel = tonic::transport::Endpoint::from_shared(url)
        .expect("url")
        .connect()
        .await
        .expect("reflection channel");
    let mut client = ServerReflectionClient::new(channel);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = client
        .server_reflection_info(tokio_stream::iter([req]))
        .await
        .expect("reflection call")
        .into_inner();
    let answer = answers
        .message()
        .await
        .expect("reflection answer")
        .expect("one answer");
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("not a service list: {answer:?}")
    };
    let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    names.sort();
    names
}

#[test]
fn public_grpc_api_checks_api_keys() {
    let mesh = start(Options {
        api_keys: vec![("sk-grpc".into(), "alpha".into())],
        ..Options::default()
    });
    mesh.block_on(api_keys_of(&mesh));
}

async fn api_keys_of(mesh: &Mesh) {
    let mut client = GenerationClient::connect(format!("http://{}", mesh.grpc))
        .await
        .expect("connect");
    let req = || GenerateRequest {
        input: Some(generate_request::Input::Prompt("Hello world".into())),
        max_tokens: 4,
        temperature: Some(0.0),
        ..Default::default()
    };
    let err = client.generate(req()).await.expect_err("no key");
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let mut bad = tonic::Request::new(req());
    bad.metadata_mut()
        .insert("authorization", "Bearer sk-nope".parse().expect("ascii"));
    assert_eq!(
        client.generate(bad).await.expect_err("bad key").code(),
        tonic::Code::Unauthenticated
    );
    let mut good = tonic::Request::new(req());
    good.metadata_mut()
        .insert("authorization", "Bearer sk-grpc".parse().expect("ascii"));
    let mut stream = client.generate(good).await.expect("good key").into_inner();
    let mut text = String::new();
    while let Some(m) = stream.message().await.expect("message") {
        text.push_str(&m.text);
    }
    assert!(!text.is_empty());
}
