use proptest::prelude::*;

use super::*;
use crate::reasoning::{DeepSeekR1, Qwen3};
use crate::tools::parsers::{Llama3Json, Mistral, TOOL_PARSERS};

const SAMPLE: &str = "Let me check. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call> done <tool";

fn reading(mode: Mode) -> Reading {
    Reading {
        mode,
        ..Reading::default()
    }
}

fn auto() -> Reading {
    reading(Mode::Auto { parallel: true })
}

/// `auto` calls in `tool`'s format, after `reasoning`'s.
fn both(tool: &'static dyn ToolParser, reasoning: &'static dyn ReasoningParser) -> Reading {
    Reading {
        tool,
        reasoning: Some(Reasoning {
            parser: reasoning,
            opened: false,
        }),
        ..auto()
    }
}

fn whole(r: &Reading, pieces: &[&str]) -> Answer {
    let mut p = Parser::new(r);
    let mut a = Answer::default();
    for piece in pieces {
        a.absorb(p.push(piece));
    }
    a.absorb(p.finish());
    a
}

/// The answer with ids checked and left out (they are random).
fn shape(a: &Answer) -> (String, String, Vec<(String, String)>) {
    (
        a.reasoning.clone(),
        a.content.clone(),
        a.calls
            .iter()
            .map(|(id, n, args)| {
                let hermes = id.starts_with("call_") && id.len() == 29;
                let mistral = id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric());
                assert!(hermes || mistral, "{id}");
                (n.clone(), args.clone())
            })
            .collect(),
    )
}

#[test]
fn hermes_blocks_become_calls_whole() {
    let a = whole(&auto(), &[SAMPLE]);
    assert_eq!(
        shape(&a),
        (
            String::new(),
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
        &auto(),
        &["<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n"],
    );
    assert_eq!(a.content(), None);
    assert_eq!(whole(&auto(), &["plain"]).content(), Some("plain"));
}

#[test]
fn a_call_streams_as_its_start_then_its_arguments() {
    let mut p = Parser::new(&auto());
    assert_eq!(p.push("a <tool"), vec![Out::Content("a ".into())]);
    assert_eq!(p.push("box"), vec![Out::Content("<toolbox".into())]);
    assert_eq!(p.push("<tool_call>{\"name\": \"f\", "), vec![]);
    let out = p.push("\"arguments\": {\"x\": 1}}</tool_call>");
    assert!(
        matches!(&out[..], [Out::Start { index: 0, name, .. }, Out::Args { index: 0, fragment }]
            if name == "f" && fragment == "{\"x\":1}"),
        "{out:?}"
    );
    assert_eq!(p.push("<"), vec![]);
    assert_eq!(p.finish(), vec![Out::Content("<".into())]);
    assert_eq!(p.calls(), 1);
}

#[test]
fn without_parallel_calls_only_the_first_is_kept() {
    let a = whole(&reading(Mode::Auto { parallel: false }), &[SAMPLE]);
    assert_eq!(
        shape(&a).2,
        vec![("get_weather".into(), "{\"city\":\"Paris\"}".into())]
    );
}

#[test]
fn named_streams_arguments_and_required_parses_the_array() {
    let mut p = Parser::new(&reading(Mode::Named("f".into())));
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
    let required = reading(Mode::Required);
    let a = whole(&required, &[&text[..10], &text[10..]]);
    assert_eq!(
        shape(&a),
        (
            String::new(),
            String::new(),
            vec![("f".into(), "{\"x\":1}".into()), ("g".into(), "{}".into())]
        )
    );
    // Cut short (the budget): the text, as content.
    let a = whole(&required, &[&text[..10]]);
    assert_eq!((a.content.as_str(), a.calls.len()), (&text[..10], 0));
    assert_eq!(
        whole(&reading(Mode::Text), &["<tool_call>x"]).content,
        "<tool_call>x"
    );
    // A Mistral model's calls carry Mistral's ids in every mode.
    let named = Reading {
        tool: &Mistral,
        ..reading(Mode::Named("f".into()))
    };
    let a = whole(&named, &["{}"]);
    assert_eq!(a.calls[0].0.len(), 9);
}

#[test]
fn reasoning_comes_first_and_the_tools_read_what_follows_it() {
    let text = "<think>Call it? <tool_call> is the way.</think>\n\n[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": [1]}}]";
    let a = whole(&both(&Mistral, &DeepSeekR1), &[text]);
    assert_eq!(
        shape(&a),
        (
            "Call it? <tool_call> is the way.".into(),
            String::new(),
            vec![("f".into(), "{\"a\":[1]}".into())]
        )
    );
    assert_eq!((a.content(), a.reasoning().is_some()), (None, true));
    // A call written inside the reasoning is reasoning (the tools read
    // only the answer), unless the format ends reasoning there (Qwen3).
    let text =
        "<think>{\"name\": \"f\", \"parameters\": {}}</think>{\"name\": \"g\", \"parameters\": {}}";
    let a = whole(&both(&Llama3Json, &DeepSeekR1), &[text]);
    assert_eq!(
        shape(&a).2,
        vec![("g".into(), "{}".into())],
        "only the call after the block"
    );
    let text = "<think>Let me call.<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>";
    let a = whole(&both(&crate::tools::parsers::Hermes, &Qwen3), &[text]);
    assert_eq!(
        shape(&a),
        (
            "Let me call.".into(),
            String::new(),
            vec![("f".into(), "{}".into())]
        )
    );
    // Truncated inside the block: reasoning only, content null.
    let a = whole(&both(&Mistral, &Qwen3), &["<think>hmm"]);
    assert_eq!((a.reasoning(), a.content()), (Some("hmm"), None));
    // Reasoning streams as it comes.
    let mut p = Parser::new(&both(&Mistral, &Qwen3));
    assert_eq!(p.push("<think>a"), vec![Out::Reasoning("a".into())]);
    assert_eq!(p.push("b</th"), vec![Out::Reasoning("b".into())]);
    assert_eq!(p.push("ink>c"), vec![Out::Content("c".into())]);
}

/// Pieces of model output, markup of every format among them.
const ATOMS: &[&str] = &[
    "<tool_call>",
    "</tool_call>",
    "{\"name\": \"f\", \"arguments\": {\"x\": \"}\"}}",
    "{\"name\": \"g\", \"parameters\": {}}",
    "[{\"name\": \"h\", \"arguments\": {}}]",
    "<think>",
    "</think>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    "{",
    "}",
    "[",
    "]",
    ";",
    ",",
    ":",
    "\"",
    "\\",
    " ",
    "\n",
    "name",
    "é",
    "text",
    "<",
    "</",
];

fn readings() -> Vec<Reading> {
    let mut all = vec![reading(Mode::Required), reading(Mode::Named("f".into()))];
    for tool in TOOL_PARSERS {
        for parallel in [true, false] {
            let r = Reading {
                tool,
                ..reading(Mode::Auto { parallel })
            };
            all.push(r.clone());
            for parser in crate::reasoning::REASONING_PARSERS {
                for opened in [false, true] {
                    all.push(Reading {
                        reasoning: Some(Reasoning { parser, opened }),
                        ..r.clone()
                    });
                }
            }
        }
    }
    all
}

/// What an answer may open with: where the formats decide what it is.
const LEADS: &[&str] = &[
    "",
    "<think>",
    " \n<think>",
    "\n",
    "[TOOL_CALLS]",
    "<|python_tag|>",
    "{",
    " {\"name\": \"g\", \"parameters\": {}}",
    "<tool_call>",
    "</think>",
];

/// `lead` and `atoms` as text, and `cuts` (positions modulo its length,
/// whole characters) as the pieces it streams in.
fn text_and_pieces(lead: usize, atoms: &[usize], cuts: &[usize]) -> (String, Vec<usize>) {
    let text: String = std::iter::once(LEADS[lead])
        .chain(atoms.iter().map(|&i| ATOMS[i]))
        .collect();
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|c| c % (text.len() + 1))
        .filter(|&c| text.is_char_boundary(c))
        .collect();
    at.sort_unstable();
    (text, at)
}

fn pieces_at<'t>(text: &'t str, at: &[usize]) -> Vec<&'t str> {
    let mut pieces = Vec::new();
    let mut from = 0;
    for &c in at.iter().chain([&text.len()]) {
        pieces.push(&text[from..c]);
        from = c;
    }
    pieces
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Any output, cut anywhere, streams to exactly its whole answer in
    /// every format and mode, and nothing panics.
    #[test]
    fn streamed_pieces_add_up_to_the_whole_answer(
        lead in 0..LEADS.len(),
        atoms in proptest::collection::vec(0..ATOMS.len(), 0..24),
        cuts in proptest::collection::vec(0usize..1000, 0..12),
    ) {
        let (text, at) = text_and_pieces(lead, &atoms, &cuts);
        let pieces = pieces_at(&text, &at);
        for r in readings() {
            let want = shape(&whole(&r, &[&text]));
            prop_assert_eq!(shape(&whole(&r, &pieces)), want, "{:?} {:?}", r, pieces);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// A shorter output cut in two at every split point.
    #[test]
    fn every_split_point_gives_the_whole_answer(
        lead in 0..LEADS.len(),
        atoms in proptest::collection::vec(0..ATOMS.len(), 0..10),
    ) {
        let (text, _) = text_and_pieces(lead, &atoms, &[]);
        for r in readings() {
            let want = shape(&whole(&r, &[&text]));
            for c in (1..text.len()).filter(|&c| text.is_char_boundary(c)) {
                prop_assert_eq!(
                    shape(&whole(&r, &[&text[..c], &text[c..]])),
                    want.clone(),
                    "{:?} cut at {}", r, c
                );
            }
        }
    }
}
