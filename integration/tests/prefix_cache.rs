//! The prefix cache through the mesh (in this process): a tenant's repeat
//! is served from its cached pages and answers the same tokens as the
//! reference engine; another tenant, or a different `cache_salt`, finds
//! nothing (design/prefix-cache.md rules 1-3, 8); the next turn of a
//! conversation finds the previous answer's pages at decode; with the
//! cache off nothing is kept; another tenant's copy of a cached prompt
//! costs the work a cold miss costs (the side channel, by work; its
//! timings are `kvmesh bench-cache`'s). The planted bug that drops the tenant from
//! the namespace is caught by the same scenario in `prefix_cache_planted.rs`.

use kvmesh_integration::cache::{complete, isolation};
use kvmesh_integration::http;
use kvmesh_integration::inproc::{InProcessMesh, Options};
use kvmesh_integration::{reference_text, tiny_model_dir};
use kvmesh_model::default_model;
use serde_json::json;

/// About 70 tokens: four full pages of 16 before the last token's.
const PROMPT: &str = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. \
                      A stitch in time saves nine. The early bird catches the worm. Every cloud has a silver lining.";

fn start(prefix_cache: bool) -> InProcessMesh {
    InProcessMesh::start(
        &tiny_model_dir(),
        Options {
            api_keys: vec![
                ("sk-alpha".into(), "alpha".into()),
                ("sk-beta".into(), "beta".into()),
            ],
            prefix_cache,
            ..Options::default()
        },
    )
    .unwrap_or_else(|e| panic!("starting the mesh: {e:#}"))
}

fn node_metric(m: &InProcessMesh, name: &str, node: &str) -> f64 {
    m.metric(&format!("{name}{{node=\"{node}\""))
        .unwrap_or_else(|| panic!("{name} of {node} missing:\n{}", m.metrics()))
}

#[test]
fn a_tenant_reuses_its_own_prefix_and_nobody_else_does() {
    let m = start(true);
    let want = reference_text(&tiny_model_dir(), PROMPT, false, 8);
    let iso = isolation(&m.http, "sk-alpha", "sk-beta", PROMPT, 8);
    assert_eq!(iso.a_first, 0, "{iso:?}");
    assert!(
        iso.a_repeat >= 32 && iso.a_repeat.is_multiple_of(16),
        "{iso:?}"
    );
    assert_eq!(iso.b_same, 0, "another tenant must find nothing: {iso:?}");
    assert_eq!(iso.a_salted, 0, "a salt is a namespace of its own: {iso:?}");
    assert_eq!(iso.a_salted_repeat, iso.a_repeat, "{iso:?}");
    assert_eq!(iso.b_salted, 0, "a salt never crosses tenants: {iso:?}");
    for (i, t) in iso.texts.iter().enumerate() {
        assert_eq!(t, &want, "response {i}: the cache changed the output");
    }
    // Both sides cached: prefill computed only the suffix, decode granted
    // only the pages it lacked (its hits count in its own metrics). The
    // gateway's copies come with the nodes' load reports: read them from
    // reports sent after the requests (one sent between the two repeats
    // holds only one of them).
    let want = 2 * iso.a_repeat;
    assert_eq!(m.prefill_pool().cache.counters.hit_tokens, want, "{iso:?}");
    http::wait_fresh_reports(&m.http, &["prefill-0", "decode-0"]);
    let prefill_hits = node_metric(&m, "kvmesh_node_prefix_cache_hit_tokens_total", "prefill-0");
    assert_eq!(prefill_hits as u64, want, "prefill's hits as reported");
    assert!(node_metric(&m, "kvmesh_node_prefix_cache_hit_tokens_total", "decode-0") > 0.0);
    assert!(node_metric(&m, "kvmesh_node_prefix_cache_entries", "decode-0") > 0.0);
    assert_eq!(
        node_metric(&m, "kvmesh_node_prefix_cache_leased_pages", "decode-0"),
        0.0
    );
    m.assert_pages_come_back();
    assert_eq!(m.decode_pool().guard_violations, 0);
    m.shutdown().expect("drains");
}

/// What one request cost the mesh: its cached tokens, the KV bytes decode
/// received for it, and the hits prefill and decode counted.
#[derive(Debug, PartialEq, Eq)]
struct Cost {
    cached: u64,
    kv_bytes: u64,
    prefill_hits: u64,
    decode_hits: u64,
}

fn cost(m: &InProcessMesh, key: &str, prompt: &str) -> Cost {
    let counters = |m: &InProcessMesh| {
        (
            m.decode_table().kv_bytes_received,
            m.prefill_pool().cache.counters.hit_tokens,
            m.decode_pool().cache.counters.hit_tokens,
        )
    };
    let before = counters(m);
    let (_, cached) = complete(&m.http, Some(key), prompt, None, 4);
    // The transfer was verified before the first token left decode.
    let after = counters(m);
    Cost {
        cached,
        kv_bytes: after.0 - before.0,
        prefill_hits: after.1 - before.1,
        decode_hits: after.2 - before.2,
    }
}

/// Design/prefix-cache.md rule 8, by the work each request causes: tenant
/// B's copy of tenant A's cached prompt computes and ships exactly what
/// A's cold miss did; A's repeat ships only what decode lacks.
#[test]
fn another_tenants_copy_of_a_cached_prompt_costs_what_a_cold_miss_costs() {
    let m = start(true);
    let a_cold = cost(&m, "sk-alpha", PROMPT);
    let a_repeat = cost(&m, "sk-alpha", PROMPT);
    let b_same = cost(&m, "sk-beta", PROMPT);
    let b_fresh = cost(&m, "sk-beta", "Completely different words start this prompt, and it shares no page with the other one at all.");
    assert_eq!(a_cold.cached, 0, "{a_cold:?}");
    assert!(a_cold.kv_bytes > 0, "{a_cold:?}");
    assert_eq!(b_same, a_cold, "B's copy must cost what a cold miss costs");
    assert_eq!(
        (b_fresh.cached, b_fresh.prefill_hits, b_fresh.decode_hits),
        (0, 0, 0)
    );
    assert!(
        a_repeat.cached > 0 && a_repeat.prefill_hits == a_repeat.cached,
        "{a_repeat:?}"
    );
    assert!(a_repeat.decode_hits >= a_repeat.cached, "{a_repeat:?}");
    assert!(
        a_repeat.kv_bytes < a_cold.kv_bytes,
        "decode's hit is not shipped again: {a_repeat:?} vs {a_cold:?}"
    );
    m.assert_pages_come_back();
    m.shutdown().expect("drains");
}

#[test]
fn with_the_cache_off_nothing_is_kept() {
    let m = start(false);
    for _ in 0..2 {
        let (_, cached) = complete(&m.http, Some("sk-alpha"), PROMPT, None, 4);
        assert_eq!(cached, 0);
    }
    assert_eq!(m.decode_pool().cache.entries, 0);
    assert_eq!(m.prefill_pool().cache.entries, 0);
    assert_eq!(
        node_metric(&m, "kvmesh_node_prefix_cache_max_pages", "decode-0"),
        0.0
    );
    m.shutdown().expect("drains");
}

/// The default model, where its answers read back as the tokens it
/// generated: turn 2's prompt is turn 1's prompt, its answer and a new
/// question; decode holds the answer's pages too (prefill never saw
/// them), so decode's hit is longer than prefill's.
#[test]
fn the_next_turn_finds_the_previous_answer_at_decode() {
    let Some(model) = default_model::cached_default_model() else {
        eprintln!("note: default model not cached; skipped");
        return;
    };
    let m = InProcessMesh::start(&model, Options::default()).expect("mesh");
    let chat = |msgs: &serde_json::Value| {
        let r = http::post(
            &m.http,
            "/v1/chat/completions",
            &json!({"messages": msgs, "max_tokens": 48, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        (
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(u64::MAX),
        )
    };
    let system = "You are a careful assistant. Answer in full sentences, and explain your reasoning step by step.";
    let mut msgs = json!([
        {"role": "system", "content": system},
        {"role": "user", "content": "Why is the sky blue?"}
    ]);
    let (answer, _) = chat(&msgs);
    let decode_before = m.decode_pool().cache.counters.hit_tokens;
    msgs.as_array_mut().expect("array").extend([
        json!({"role": "assistant", "content": answer}),
        json!({"role": "user", "content": "And why are sunsets red?"}),
    ]);
    let (_, prefill_cached) = chat(&msgs);
    let decode_hit = m.decode_pool().cache.counters.hit_tokens - decode_before;
    assert!(prefill_cached > 0, "turn 1's prompt is cached at prefill");
    assert!(
        decode_hit > prefill_cached,
        "decode reuses the answer's pages too: decode {decode_hit}, prefill {prefill_cached}"
    );
    m.assert_pages_come_back();
    m.shutdown().expect("drains");
}
