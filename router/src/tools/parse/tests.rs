use super::*;

const SAMPLE: &str = "Let me check. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call> done <tool";

fn whole(mode: Mode, pieces: &[&str]) -> Answer {
    let mut p = Parser::new(mode);
    let mut a = Answer::default();
    for piece in pieces {
        a.absorb(p.push(piece));
    }
    a.absorb(p.finish());
    a
}

/// The answer with ids blanked (they are random).
fn shape(a: &Answer) -> (String, Vec<(String, String)>) {
    (
        a.content.clone(),
        a.calls
            .iter()
            .map(|(id, n, args)| {
                assert!(id.starts_with("call_") && id.len() == 29, "{id}");
                (n.clone(), args.clone())
            })
            .collect(),
    )
}

fn auto() -> Mode {
    Mode::Auto { parallel: true }
}

#[test]
fn hermes_blocks_become_calls_whole() {
    let a = whole(auto(), &[SAMPLE]);
    assert_eq!(
        shape(&a),
        (
            "Let me check. \n done <tool".to_owned(),
            vec![
                ("get_weather".into(), "{\"city\":\"Paris\"}".into()),
                ("get_time".into(), "{}".into()),
            ]
        )
    );
    assert_ne!(a.calls[0].0, a.calls[1].0, "ids are fresh");
    // Only whitespace around calls: content is null.
    let a = whole(
        auto(),
        &["<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n"],
    );
    assert_eq!(a.content(), None);
    assert_eq!(whole(auto(), &["plain"]).content(), Some("plain"));
}

#[test]
fn split_at_every_byte_boundary_gives_the_same_answer() {
    let want = shape(&whole(auto(), &[SAMPLE]));
    for cut in 1..SAMPLE.len() {
        for cut2 in [cut, (cut + 7).min(SAMPLE.len())] {
            let pieces = [&SAMPLE[..cut], &SAMPLE[cut..cut2], &SAMPLE[cut2..]];
            let mut p = Parser::new(auto());
            let mut a = Answer::default();
            for piece in pieces {
                let out = p.push(piece);
                // Nothing emitted as content is part of a block.
                for o in &out {
                    if let Out::Content(t) = o {
                        assert!(!t.contains('{'), "cut {cut}: block text leaked: {t:?}");
                    }
                }
                a.absorb(out);
            }
            a.absorb(p.finish());
            assert_eq!(shape(&a), want, "cut at {cut}, {cut2}");
        }
    }
    // Byte by byte (whole characters: the sample is ASCII).
    let pieces: Vec<&str> = (0..SAMPLE.len()).map(|i| &SAMPLE[i..i + 1]).collect();
    assert_eq!(shape(&whole(auto(), &pieces)), want);
}

#[test]
fn a_possible_opening_is_held_back_and_released() {
    let mut p = Parser::new(auto());
    assert_eq!(p.push("a <tool"), vec![Out::Content("a ".into())]);
    assert_eq!(p.push("box"), vec![Out::Content("<toolbox".into())]);
    assert_eq!(p.push("<"), vec![]);
    assert_eq!(p.finish(), vec![Out::Content("<".into())]);
}

#[test]
fn malformed_calls_stay_text() {
    for bad in [
        "<tool_call>{\"name\": \"f\", \"arguments\": </tool_call>",
        "<tool_call>not json</tool_call>",
        "<tool_call>{\"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": \"f\"",
    ] {
        let a = whole(auto(), &[bad]);
        assert_eq!((a.content.as_str(), a.calls.len()), (bad, 0), "{bad}");
    }
    // An unclosed block that parses at the end is a call (vLLM).
    let a = whole(
        auto(),
        &["<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}"],
    );
    assert_eq!(shape(&a).1, vec![("f".into(), "{\"x\":1}".into())]);
}

#[test]
fn without_parallel_calls_only_the_first_is_kept() {
    let a = whole(Mode::Auto { parallel: false }, &[SAMPLE]);
    assert_eq!(
        shape(&a).1,
        vec![("get_weather".into(), "{\"city\":\"Paris\"}".into())]
    );
}

#[test]
fn named_streams_arguments_and_required_parses_the_array() {
    let mut p = Parser::new(Mode::Named("f".into()));
    let first = p.push("{\"x\":");
    assert!(matches!(&first[0], Out::Start { index: 0, name, .. } if name == "f"));
    assert_eq!(
        first[1],
        Out::Args {
            index: 0,
            fragment: "{\"x\":".into()
        }
    );
    assert_eq!(
        p.push("1}"),
        vec![Out::Args {
            index: 0,
            fragment: "1}".into()
        }]
    );
    assert_eq!(p.finish(), vec![]);

    let text = "[{\"name\":\"f\",\"parameters\":{\"x\":1}},{\"name\":\"g\",\"parameters\":{}}]";
    let a = whole(Mode::Required, &[&text[..10], &text[10..]]);
    assert_eq!(
        shape(&a),
        (
            String::new(),
            vec![("f".into(), "{\"x\":1}".into()), ("g".into(), "{}".into())]
        )
    );
    // Cut short (the budget): the text, as content.
    let a = whole(Mode::Required, &[&text[..10]]);
    assert_eq!((a.content.as_str(), a.calls.len()), (&text[..10], 0));
    assert_eq!(whole(Mode::Text, &["<tool_call>x"]).content, "<tool_call>x");
}
