use super::*;

/// What `p` finds in `pieces`, adjacent texts joined (a stream may cut
/// content anywhere; only what it adds up to is compared).
fn run(p: &dyn ToolParser, pieces: &[&str]) -> Vec<Found> {
    let mut s = p.stream();
    let mut raw = Vec::new();
    for piece in pieces {
        s.push(piece, &mut raw);
    }
    s.finish(&mut raw);
    let mut out: Vec<Found> = Vec::new();
    for f in raw {
        match (out.last_mut(), f) {
            (Some(Found::Text(a)), Found::Text(b)) => a.push_str(&b),
            (_, Found::Text(t)) if t.is_empty() => panic!("an empty text piece"),
            (_, f) => out.push(f),
        }
    }
    out
}

fn call(name: &str, arguments: &str) -> Found {
    Found::Call {
        name: name.into(),
        arguments: arguments.into(),
    }
}

fn text(t: &str) -> Found {
    Found::Text(t.into())
}

/// `text` cut into two and three pieces at every character boundary
/// (and one character at a time) reads as it does whole; no streamed
/// content piece holds any of `markup`.
fn every_split(p: &dyn ToolParser, whole: &str, markup: &[&str]) -> Vec<Found> {
    let want = run(p, &[whole]);
    let bounds: Vec<usize> = (1..whole.len())
        .filter(|&i| whole.is_char_boundary(i))
        .collect();
    for &a in &bounds {
        for &b in bounds.iter().filter(|&&b| b >= a).take(9) {
            let pieces = [&whole[..a], &whole[a..b], &whole[b..]];
            assert_eq!(run(p, &pieces), want, "{} cut at {a}, {b}", p.name());
            let mut s = p.stream();
            let mut out = Vec::new();
            for piece in pieces {
                s.push(piece, &mut out);
            }
            for f in &out {
                if let Found::Text(t) = f {
                    for m in markup {
                        assert!(!t.contains(m), "{}: {m} leaked into {t:?}", p.name());
                    }
                }
            }
        }
    }
    let chars: Vec<String> = whole.chars().map(String::from).collect();
    let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(run(p, &chars), want, "{} one character at a time", p.name());
    want
}

#[test]
fn hermes_reads_blocks_anywhere_and_keeps_bad_ones_as_text() {
    let sample = "Let me check. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"get_time\"}</tool_call> done <tool";
    assert_eq!(
        every_split(&Hermes, sample, &["<tool_call>", "</tool_call>"]),
        vec![
            text("Let me check. "),
            call("get_weather", "{\"city\":\"Paris\"}"),
            text("\n"),
            call("get_time", "{}"),
            text(" done <tool"),
        ]
    );
    for bad in [
        "<tool_call>{\"name\": \"f\", \"arguments\": </tool_call>",
        "<tool_call>not json</tool_call>",
        "<tool_call>{\"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",
        "<tool_call>{\"name\": \"f\"",
    ] {
        assert_eq!(run(&Hermes, &[bad]), vec![text(bad)], "{bad}");
    }
    // Unclosed but whole: a call (vLLM's Hermes parser accepts it too).
    assert_eq!(
        run(
            &Hermes,
            &["<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}"]
        ),
        vec![call("f", "{\"x\":1}")]
    );
    // Arguments written as a JSON string of an object.
    assert_eq!(
        run(
            &Hermes,
            &["<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>"]
        ),
        vec![call("f", "{\"x\":1}")]
    );
}

#[test]
fn llama3_json_reads_the_whole_answer_as_calls() {
    let one = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
    assert_eq!(
        every_split(&Llama3Json, &format!("\n {one}\n"), &[]),
        vec![call("get_weather", "{\"city\":\"Paris\"}")]
    );
    let several = "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"s\": \"}{;\"}}; {\"name\": \"b\", \"arguments\": {}}";
    assert_eq!(
        every_split(&Llama3Json, several, &["<|python_tag|>"]),
        vec![call("a", "{\"s\":\"}{;\"}"), call("b", "{}")]
    );
    // Text, then the tag and a call.
    assert_eq!(
        every_split(
            &Llama3Json,
            "Checking.<|python_tag|>{\"name\": \"a\", \"parameters\": {}}",
            &["<|python_tag|>"]
        ),
        vec![text("Checking."), call("a", "{}")]
    );
    // Text first: content, whatever JSON follows.
    let prose = "The call is {\"name\": \"a\", \"parameters\": {}}";
    assert_eq!(every_split(&Llama3Json, prose, &[]), vec![text(prose)]);
    // JSON that is no call, or does not close, is content, gap and all;
    // so is what follows it.
    for bad in [
        " {\"answer\": 42} more",
        "{\"name\": \"a\", \"parameters\": [1]}",
        "{\"name\": \"a\", \"parameters\": {\"x\": 1}",
        "{\"name\": \"a\", \"parameters\": {}, \"arguments\": {}}",
    ] {
        assert_eq!(every_split(&Llama3Json, bad, &[]), vec![text(bad)], "{bad}");
    }
    // A call, then something that is not one: the call stands.
    assert_eq!(
        every_split(
            &Llama3Json,
            "{\"name\": \"a\", \"parameters\": {}}; oops",
            &[]
        ),
        vec![call("a", "{}"), text("; oops")]
    );
    // The code of a built-in tool after the tag: content without the tag.
    assert_eq!(
        every_split(
            &Llama3Json,
            "<|python_tag|>import math",
            &["<|python_tag|>"]
        ),
        vec![text("import math")]
    );
    assert_eq!(run(&Llama3Json, &["<|python"]), vec![text("<|python")]);
}

#[test]
fn mistral_reads_the_list_after_the_marker() {
    let list = "Sure. [TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {}}]";
    assert_eq!(
        every_split(&Mistral, list, &["[TOOL_CALLS]"]),
        vec![
            text("Sure. "),
            call("get_weather", "{\"city\":\"Paris\"}"),
            call("get_time", "{}"),
        ]
    );
    // v11: name[ARGS]{...}, once per call.
    let v11 = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Oslo\"}[TOOL_CALLS]get_time[ARGS]{}";
    assert_eq!(
        every_split(&Mistral, v11, &["[TOOL_CALLS]", "[ARGS]"]),
        vec![
            call("get_weather", "{\"city\":\"Oslo\"}"),
            call("get_time", "{}")
        ]
    );
    // Malformed or cut short: the text after the marker is content, and
    // no call is made up.
    for (bad, shown) in [
        ("[TOOL_CALLS] [{\"name\": \"f\"", " [{\"name\": \"f\""),
        (
            "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": 1}]",
            "[{\"name\": \"f\", \"arguments\": 1}]",
        ),
        ("[TOOL_CALLS][]", "[]"),
        ("[TOOL_CALLS] sorry", " sorry"),
        ("[TOOL_CALLS]f[ARGS][1]", "f[ARGS][1]"),
        ("[TOOL_CALLS]f[ARG]{}", "f[ARG]{}"),
        ("[TOOL_CALLS]f[ARGS]{\"x\"", "f[ARGS]{\"x\""),
    ] {
        assert_eq!(run(&Mistral, &[bad]), vec![text(shown)], "{bad}");
        every_split(&Mistral, bad, &["[TOOL_CALLS]"]);
    }
    assert_eq!(run(&Mistral, &["[TOOL_CALLS]"]), vec![]);
    assert_eq!(run(&Mistral, &["a [TOOL_"]), vec![text("a [TOOL_")]);
}

#[test]
fn mistral_ids_are_nine_alphanumerics() {
    let ids: Vec<String> = (0..64).map(|_| Mistral.call_id()).collect();
    for id in &ids {
        assert!(
            id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()),
            "{id}"
        );
    }
    assert!(ids.iter().any(|id| id != &ids[0]), "ids are fresh");
    assert!(Hermes.call_id().starts_with("call_"));
}

#[test]
fn text_is_held_back_at_most_a_marker_long() {
    // Text that keeps starting what could be a marker, and never is one.
    let tease = "a <tool_cal [TOOL_CALL <|python_ta b ";
    for p in TOOL_PARSERS {
        let mut s = p.stream();
        let (mut fed, mut shown) = (0usize, 0usize);
        for c in tease.repeat(20).chars() {
            let mut out = Vec::new();
            s.push(c.encode_utf8(&mut [0; 4]), &mut out);
            fed += c.len_utf8();
            shown += out
                .iter()
                .map(|f| match f {
                    Found::Text(t) => t.len(),
                    Found::Call { .. } => panic!("{}: a call made up", p.name()),
                })
                .sum::<usize>();
            let longest = "<|python_tag|>".len();
            assert!(
                fed - shown < longest,
                "{}: {} bytes held",
                p.name(),
                fed - shown
            );
        }
    }
}

#[test]
fn whitespace_is_held_back_at_most_max_gap() {
    for (p, marker) in [
        (&Hermes as &dyn ToolParser, ""),
        (&Llama3Json, ""),
        (&Llama3Json, "<|python_tag|>"),
        (&Mistral, "[TOOL_CALLS]"),
    ] {
        let mut s = p.stream();
        let mut out = Vec::new();
        s.push(marker, &mut out);
        let (mut fed, mut shown) = (0usize, 0usize);
        for _ in 0..500 {
            let mut out = Vec::new();
            s.push(" ", &mut out);
            fed += 1;
            shown += out
                .iter()
                .map(|f| match f {
                    Found::Text(t) => t.len(),
                    Found::Call { .. } => 0,
                })
                .sum::<usize>();
            assert!(
                fed - shown <= MAX_GAP,
                "{} {marker}: {} held",
                p.name(),
                fed - shown
            );
        }
        // A call after them still is one.
        let mut out = Vec::new();
        s.push("{\"name\": \"f\", \"arguments\": {}}", &mut out);
        s.finish(&mut out);
        let wants_call = !matches!((p.name(), marker), ("hermes", _) | ("mistral", _));
        assert_eq!(
            out.iter().any(|f| matches!(f, Found::Call { .. })),
            wants_call,
            "{} {marker}: {out:?}",
            p.name()
        );
    }
}

#[test]
fn auto_reads_the_format_from_the_template() {
    let pick = |t: &str| for_template(Some(t)).0.name();
    assert_eq!(pick("{{ '<tool_call>' }}"), "hermes");
    assert_eq!(
        pick("{{- '<|python_tag|>' + tool_call.name }}"),
        "llama3_json"
    );
    assert_eq!(
        pick("Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}."),
        "llama3_json"
    );
    assert_eq!(pick("{{ '[TOOL_CALLS]' + tool_calls|tojson }}"), "mistral");
    let (p, spoken) = for_template(Some("{{ messages }}"));
    assert_eq!((p.name(), spoken), ("hermes", false), "the default");
    assert!(!for_template(None).1);
    assert_eq!(by_name("mistral").map(|p| p.name()), Some("mistral"));
    assert!(by_name("pythonic").is_none());
}
