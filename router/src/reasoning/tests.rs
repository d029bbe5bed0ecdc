use super::*;

/// (reasoning, content) `p` makes of `pieces`.
fn run(p: &dyn ReasoningParser, opened: bool, pieces: &[&str]) -> (String, String) {
    let mut s = p.stream(opened);
    let mut parts = Vec::new();
    for piece in pieces {
        s.push(piece, &mut parts);
    }
    s.finish(&mut parts);
    let (mut reasoning, mut content) = (String::new(), String::new());
    for part in parts {
        match part {
            Part::Reasoning(t) if !t.is_empty() => reasoning.push_str(&t),
            Part::Content(t) if !t.is_empty() => content.push_str(&t),
            p => panic!("an empty part: {p:?}"),
        }
    }
    (reasoning, content)
}

/// `text` whole, in every two- and three-piece cut, and a character at a
/// time: one reading; and when the whole reading holds no tag, no streamed
/// piece holds one.
fn every_split(p: &dyn ReasoningParser, opened: bool, text: &str) -> (String, String) {
    let want = run(p, opened, &[text]);
    let tagged = |t: &str| t.contains("<think>") || t.contains("</think>");
    let clean = !tagged(&want.0) && !tagged(&want.1);
    let bounds: Vec<usize> = (1..text.len())
        .filter(|&i| text.is_char_boundary(i))
        .collect();
    for &a in &bounds {
        for &b in bounds.iter().filter(|&&b| b >= a).take(7) {
            let pieces = [&text[..a], &text[a..b], &text[b..]];
            assert_eq!(run(p, opened, &pieces), want, "cut at {a}, {b}");
            let mut s = p.stream(opened);
            let mut parts = Vec::new();
            for piece in pieces {
                s.push(piece, &mut parts);
            }
            for part in &parts {
                let (Part::Reasoning(t) | Part::Content(t)) = part;
                assert!(!clean || !tagged(t), "a tag leaked: {t:?}");
            }
        }
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(run(p, opened, &chars), want, "a character at a time");
    want
}

fn pair(r: &str, c: &str) -> (String, String) {
    (r.to_owned(), c.to_owned())
}

#[test]
fn a_think_block_is_reasoning_and_the_rest_content() {
    for p in REASONING_PARSERS {
        let text = "<think>\nThe user wants é.\n</think>\n\nHere: é.";
        assert_eq!(
            every_split(p, false, text),
            pair("\nThe user wants é.\n", "Here: é."),
            "{}",
            p.name()
        );
        // The template opened the block: the output starts inside it.
        assert_eq!(
            every_split(p, true, "Hmm.</think>Done"),
            pair("Hmm.", "Done"),
            "{}",
            p.name()
        );
        // No close yet (the budget ran out): all reasoning.
        assert_eq!(
            every_split(p, false, "<think>still thinking </thi"),
            pair("still thinking </thi", ""),
            "{}",
            p.name()
        );
        // After the block, tags are content's own business.
        assert_eq!(
            run(p, false, &["<think>a</think>b <think>c</think>"]),
            pair("a", "b <think>c</think>")
        );
        assert_eq!(run(p, false, &[""]), pair("", ""));
    }
}

#[test]
fn without_an_opening_tag_deepseek_r1_reasons_and_qwen3_answers() {
    let text = "Let me see.</think>\n42";
    assert_eq!(
        every_split(&DeepSeekR1, false, text),
        pair("Let me see.", "42")
    );
    // Qwen3 with thinking off (or an instruct model): an answer.
    assert_eq!(every_split(&Qwen3, false, text), pair("", text));
    assert_eq!(
        every_split(&Qwen3, false, " <thinking> aloud"),
        pair("", " <thinking> aloud")
    );
    assert_eq!(
        every_split(&DeepSeekR1, false, "just text"),
        pair("just text", "")
    );
    // Whitespace before the tag does not make an answer.
    assert_eq!(
        every_split(&Qwen3, false, "\n<think>x</think>y"),
        pair("x", "y")
    );
}

#[test]
fn qwen3_ends_reasoning_at_a_tool_call() {
    let text = "<think>I should call it.\n<tool_call>{\"name\": \"f\"}</tool_call>";
    assert_eq!(
        every_split(&Qwen3, false, text),
        pair(
            "I should call it.\n",
            "<tool_call>{\"name\": \"f\"}</tool_call>"
        )
    );
    assert_eq!(
        every_split(&DeepSeekR1, false, "<think>a<tool_call>b"),
        pair("a<tool_call>b", "")
    );
}

#[test]
fn leading_whitespace_is_held_back_at_most_max_lead() {
    for p in REASONING_PARSERS {
        let mut s = p.stream(false);
        let (mut fed, mut shown) = (0usize, 0usize);
        for _ in 0..500 {
            let mut parts = Vec::new();
            s.push(" ", &mut parts);
            fed += 1;
            shown += parts
                .iter()
                .map(|(Part::Reasoning(t) | Part::Content(t))| t.len())
                .sum::<usize>();
            assert!(fed - shown <= super::think::MAX_LEAD + 1, "{}", p.name());
        }
    }
    // Past that lead, <think> is text like any.
    let text = format!("{}<think>a</think>b", " ".repeat(100));
    assert_eq!(every_split(&Qwen3, false, &text), pair("", &text));
    let text = format!("{}<think>a</think>b", " ".repeat(10));
    assert_eq!(every_split(&Qwen3, false, &text), pair("a", "b"));
}

#[test]
fn the_prompt_tail_says_whether_a_block_is_open() {
    assert!(prompt_opens("<|im_start|>assistant\n<think>\n"));
    assert!(!prompt_opens(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ));
    assert!(!prompt_opens("<|im_start|>assistant\n"));
    assert!(prompt_opens("<think>a</think> user <think>"));
}

#[test]
fn auto_reads_the_format_from_the_template() {
    assert_eq!(
        for_template(Some("{{ '<think>\\n' }}")).map(|p| p.name()),
        Some("qwen3")
    );
    assert!(for_template(Some("{{ messages }}")).is_none());
    assert!(for_template(None).is_none());
    assert_eq!(
        by_name("deepseek_r1").map(|p| p.name()),
        Some("deepseek_r1")
    );
    assert!(by_name("granite").is_none());
}
