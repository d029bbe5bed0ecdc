use kvmesh_tokenizer::testing::tiny_text_tokenizer_with;

use super::*;

#[test]
fn names_parse_and_an_unknown_one_lists_the_known() {
    for name in ToolParserSetting::names() {
        let s: ToolParserSetting = name.parse().expect("a known name");
        assert_eq!(s.to_string(), name);
    }
    for name in ReasoningParserSetting::names() {
        let s: ReasoningParserSetting = name.parse().expect("a known name");
        assert_eq!(s.to_string(), name);
    }
    let e = "pythonic"
        .parse::<ToolParserSetting>()
        .expect_err("unknown");
    assert_eq!(
        e.to_string(),
        "unknown tool-call parser \"pythonic\": expected one of auto, hermes, llama3_json, mistral"
    );
    let e = "granite"
        .parse::<ReasoningParserSetting>()
        .expect_err("unknown");
    assert_eq!(
        e.to_string(),
        "unknown reasoning parser \"granite\": expected one of auto, none, qwen3, deepseek_r1"
    );
}

#[test]
fn auto_reads_the_template_and_a_setting_overrides_it() {
    let llama = tiny_text_tokenizer_with(
        "{{ '<|python_tag|>' }}{% for m in messages %}{{ m.content }}{% endfor %}",
        &["<|python_tag|>"],
        &[],
    );
    let p = Parsers::resolve(
        ToolParserSetting::Auto,
        ReasoningParserSetting::Auto,
        &llama,
    );
    assert_eq!(
        (p.tool.name(), p.reasoning.map(|r| r.name())),
        ("llama3_json", None)
    );
    assert!(
        p.describe().contains("llama3_json (auto"),
        "{}",
        p.describe()
    );
    // The marker is a special token here: requests reading calls keep it.
    let tag = llama.token_to_id("<|python_tag|>").expect("added");
    assert_eq!(p.keep(true, false), vec![tag]);
    assert_eq!(p.keep(false, true), Vec::<u32>::new());

    let qwen = tiny_text_tokenizer_with(
        "{% for m in messages %}{{ m.content }}{% endfor %}<tool_call><think>\n",
        &[],
        &["<think>", "</think>", "<tool_call>"],
    );
    let p = Parsers::resolve(ToolParserSetting::Auto, ReasoningParserSetting::Auto, &qwen);
    assert_eq!(
        (p.tool.name(), p.reasoning.map(|r| r.name())),
        ("hermes", Some("qwen3"))
    );
    // Ordinary added tokens decode as they are: nothing to keep.
    assert_eq!(p.keep(true, true), Vec::<u32>::new());
    let off = Parsers::resolve(
        "mistral".parse().expect("known"),
        ReasoningParserSetting::None,
        &qwen,
    );
    assert_eq!(
        (off.tool.name(), off.reasoning.is_none()),
        ("mistral", true)
    );
    assert!(
        off.describe().contains("mistral (set)"),
        "{}",
        off.describe()
    );
}

#[test]
fn a_request_reads_reasoning_only_in_an_unconstrained_chat_that_allows_it() {
    let qwen = tiny_text_tokenizer_with(
        "{% for m in messages %}{{ m.content }}{% endfor %}<think>",
        &["[TOOL_CALLS]"],
        &["<think>", "</think>"],
    );
    let p = Parsers::resolve(
        "mistral".parse().expect("known"),
        ReasoningParserSetting::Auto,
        &qwen,
    );
    let open = qwen.encode_raw("hi<think>\n").expect("encode");
    let closed = qwen
        .encode_raw("hi<think>\n\n</think>\n\n")
        .expect("encode");
    let auto = Mode::Auto { parallel: true };
    let r = p.reading(auto.clone(), true, false, None, &open, &qwen);
    assert!(r.reasoning.is_some_and(|r| r.opened));
    assert_eq!(
        p.keep_for(&r),
        vec![qwen.token_to_id("[TOOL_CALLS]").expect("special")]
    );
    let r = p.reading(auto.clone(), true, false, Some(true), &closed, &qwen);
    assert!(r.reasoning.is_some_and(|r| !r.opened));
    for (chat, constrained, thinking) in [
        (false, false, None),
        (true, true, None),
        (true, false, Some(false)),
    ] {
        let r = p.reading(Mode::Text, chat, constrained, thinking, &open, &qwen);
        assert!(r.reasoning.is_none(), "{chat} {constrained} {thinking:?}");
        assert!(r.is_plain());
        assert_eq!(p.keep_for(&r), Vec::<u32>::new());
    }
}
