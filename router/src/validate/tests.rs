use super::*;

fn req(prompt: Prompt) -> Request {
    Request::new(prompt)
}

fn text(t: &str) -> Prompt {
    Prompt::Text(t.into())
}

fn param(e: Rejection) -> &'static str {
    match e {
        Rejection::Invalid { param, .. } => param,
        other => panic!("not a field refusal: {other:?}"),
    }
}

#[test]
fn defaults_are_one_set_and_unseeded_requests_get_their_own_seed() {
    let r = crate::openapi::tests::router(false);
    let a = request(&r, req(text("Hello"))).expect("valid");
    let s = a.settings();
    assert_eq!(s.max_tokens, DEFAULT_MAX_TOKENS);
    assert_eq!((s.sampling.temperature, s.sampling.top_p), (1.0, 1.0));
    assert_eq!(s.sampling.repetition_penalty, 1.0);
    assert_eq!((s.sampling.logprobs, s.sampling.top_k), (None, 0));
    assert!(!a.ids().is_empty());
    let seeds: std::collections::HashSet<u64> = (0..8)
        .map(|_| {
            request(&r, req(text("Hello")))
                .expect("valid")
                .settings()
                .sampling
                .seed
        })
        .collect();
    assert_eq!(seeds.len(), 8, "unseeded requests do not share a seed");
    let mut seeded = req(text("Hello"));
    seeded.sampling.seed = Some(7);
    assert_eq!(
        request(&r, seeded).expect("valid").settings().sampling.seed,
        7
    );
}

#[test]
fn refusals_name_their_field() {
    let r = crate::openapi::tests::router(false);
    assert_eq!(
        param(request(&r, req(text(""))).expect_err("empty")),
        "prompt"
    );
    assert_eq!(
        param(request(&r, req(Prompt::Chat(Vec::new()))).expect_err("no messages")),
        "messages"
    );
    let five = Request {
        stop: vec!["a".into(); 5],
        ..req(text("Hello"))
    };
    assert_eq!(param(request(&r, five).expect_err("five stops")), "stop");
    let zero = Request {
        max_tokens: Some(0),
        max_tokens_param: "max_completion_tokens",
        ..req(text("Hello"))
    };
    assert_eq!(
        param(request(&r, zero).expect_err("zero")),
        "max_completion_tokens"
    );
    let mut hot = req(text("Hello"));
    hot.sampling.temperature = Some(2.000_000_1);
    assert_eq!(param(request(&r, hot).expect_err("too hot")), "temperature");
    let vocab = r.tokenizer().vocab_size() as u32;
    type Spoil = fn(&mut Request, u32);
    let bad: [(&str, Spoil); 10] = [
        ("top_k", |q, _| q.sampling.top_k = Some(-2)),
        ("min_p", |q, _| q.sampling.min_p = Some(1.5)),
        ("presence_penalty", |q, _| {
            q.sampling.presence_penalty = Some(-2.5)
        }),
        ("frequency_penalty", |q, _| {
            q.sampling.frequency_penalty = Some(f64::NAN)
        }),
        ("repetition_penalty", |q, _| {
            q.sampling.repetition_penalty = Some(0.0)
        }),
        ("logit_bias", |q, v| q.sampling.logit_bias = vec![(v, 1.0)]),
        ("logit_bias", |q, _| {
            q.sampling.logit_bias = vec![(1, 100.5)]
        }),
        ("min_tokens", |q, _| q.sampling.min_tokens = Some(17)),
        ("stop_token_ids", |q, v| q.stop_token_ids = vec![1, v]),
        ("prompt", |q, v| q.prompt = Prompt::Ids(vec![1, v])),
    ];
    for (field, set) in bad {
        let mut q = req(text("Hello"));
        set(&mut q, vocab);
        assert_eq!(param(request(&r, q).expect_err(field)), field);
    }
    let mut many = req(text("Hello"));
    many.sampling.logprobs = Some(6);
    many.sampling.logprobs_param = "logprobs";
    many.sampling.logprobs_max = 5;
    assert_eq!(param(request(&r, many).expect_err("six")), "logprobs");
    let mut fine = req(Prompt::Ids(vec![1, 2, 3]));
    fine.sampling = SamplingIn {
        top_k: Some(-1),
        logit_bias: vec![(vocab - 1, -100.0)],
        min_tokens: Some(16),
        logprobs: Some(5),
        logprobs_max: 5,
        ..SamplingIn::default()
    };
    let v = request(&r, fine).expect("valid");
    assert_eq!(v.ids(), [1, 2, 3]);
    let s = &v.settings().sampling;
    assert_eq!((s.top_k, s.min_tokens, s.logprobs), (0, 16, Some(5)));
    assert_eq!(s.logit_bias.get(&(vocab - 1)), Some(&-100.0));
    let other = Request {
        model: Some("gpt-x".into()),
        ..req(text("Hello"))
    };
    assert!(matches!(
        request(&r, other),
        Err(Rejection::UnknownModel(_))
    ));
    let stops = Request {
        stop: vec![String::new(), "x".into()],
        ..req(text("Hello"))
    };
    assert_eq!(request(&r, stops).expect("valid").settings().stop, ["x"]);
}
