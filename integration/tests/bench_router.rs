//! `kvmesh bench-router` on the tiny model, briefly: the in-process part
//! reports every step, and in the live part every over-length request is
//! refused before any node is involved: no reservation granted, the
//! router's refusal count up by exactly the number sent. Counts only; the
//! times it prints are never checked.

use kvmesh_integration::{run_reported, tiny_model_dir};

#[test]
fn over_length_prompts_are_refused_without_a_grant() {
    let model = tiny_model_dir().to_string_lossy().into_owned();
    let (_, v) = run_reported(&[
        "bench-router",
        "--model",
        &model,
        "--iterations",
        "20",
        "--warmup",
        "2",
        "--duration",
        "2",
        "--clients",
        "2",
    ]);
    assert_eq!(v["pass"], true, "{v}");

    let steps = v["in_process"]["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), 9, "{v}");
    for prompt in ["completion", "chat"] {
        let key = format!("{prompt}_prompt_tokens");
        assert!(v["in_process"][&key].as_u64().unwrap_or(0) >= 2000, "{v}");
        assert!(
            steps
                .iter()
                .any(|s| s["prompt"] == prompt && s["step"] == "validate + admit"),
            "{v}"
        );
    }

    let live = &v["live"];
    let sent = live["sent"].as_u64().expect("sent");
    assert!(sent > 0, "{v}");
    assert_eq!(live["refused_context_length"].as_u64(), Some(sent), "{v}");
    assert_eq!(live["errors"].as_object().map(|e| e.len()), Some(0), "{v}");
    // The decode node reports its grants; none were made.
    let before = live["granted_before"].as_object().expect("granted_before");
    assert!(before.contains_key("decode-0"), "{v}");
    assert_eq!(live["granted_before"], live["granted_after"], "{v}");
    let rise = live["rejected_after"].as_f64().expect("rejected_after")
        - live["rejected_before"].as_f64().expect("rejected_before");
    assert_eq!(rise, sent as f64, "{v}");
    assert_eq!(
        live["rejected_rise_by_reason"]["context_length_exceeded"].as_f64(),
        Some(sent as f64),
        "{v}"
    );
}
