//! `kvmesh bench-cache` end to end on the tiny model, every scenario, one
//! round: checked on the report's structure and on what the cache did
//! (cached tokens, KV bytes shipped, the side channel's hits), never on
//! its timings.

use kvmesh_integration::{run_reported, tiny_model_dir};
use serde_json::Value;

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap_or_else(|| panic!("not a count: {x}")))
        .collect()
}

#[test]
fn bench_cache_measures_hits_bytes_and_the_side_channel() {
    let model = tiny_model_dir().to_string_lossy().into_owned();
    let (stdout, v) = run_reported(&[
        "bench-cache",
        "--model",
        &model,
        "--rounds",
        "1",
        "--conversations",
        "2",
        "--turns",
        "3",
        "--system-tokens",
        "40",
        "--turn-tokens",
        "20",
        "--answer-tokens",
        "4",
        "--fresh-requests",
        "3",
        "--fresh-tokens",
        "40",
        "--side-samples",
        "3",
        "--side-tokens",
        "40",
    ]);
    for row in [
        "turn 3",
        "exact repeat",
        "KV bytes shipped per request",
        "no sharing",
        "b_same vs b_fresh",
        "goals",
    ] {
        assert!(stdout.contains(row), "no {row:?} in:\n{stdout}");
    }

    // Multi-turn: 2 conversations x 3 turns on both targets; with the
    // cache on, every turn after a conversation's first finds the history
    // and the exact repeat finds the whole prompt but its last page's
    // token; with it off, nothing.
    for target in ["on", "off"] {
        let mt = &v["multi_turn"][target];
        let ttft = mt["ttft_s"].as_array().expect("ttft_s");
        assert_eq!(ttft.len(), 2, "{mt}");
        for c in ttft {
            assert_eq!(c.as_array().map(Vec::len), Some(3), "{mt}");
        }
        assert_eq!(mt["repeat_ttft_s"].as_array().map(Vec::len), Some(2));
    }
    let on = &v["multi_turn"]["on"];
    for (c, conv) in on["cached_tokens"]
        .as_array()
        .expect("cached")
        .iter()
        .enumerate()
    {
        let cached = u64s(conv);
        let prompt = u64s(&on["prompt_tokens"][c]);
        for t in 1..3 {
            assert!(cached[t] > 0, "conversation {c} turn {t}: {cached:?}");
            assert!(cached[t] < prompt[t], "{cached:?} {prompt:?}");
        }
    }
    for (c, r) in u64s(&on["repeat_cached_tokens"]).into_iter().enumerate() {
        let last = u64s(&on["prompt_tokens"][c])[2];
        // Whole pages of 16, all but the one holding the last token.
        assert_eq!(r, (last - 1) / 16 * 16, "conversation {c}");
    }
    let off = &v["multi_turn"]["off"];
    for conv in off["cached_tokens"].as_array().expect("cached") {
        assert!(u64s(conv).iter().all(|&n| n == 0), "{off}");
    }
    // Decode's hits are not shipped: fewer KV bytes per request with the
    // cache on, over the same requests.
    let kv = &v["kv_bytes"];
    assert_eq!(kv["on"]["requests"], kv["off"]["requests"]);
    assert_eq!(kv["on"]["requests"].as_u64(), Some(8));
    let (b_on, b_off) = (
        kv["on"]["bytes"].as_u64().expect("bytes"),
        kv["off"]["bytes"].as_u64().expect("bytes"),
    );
    assert!(b_on > 0 && b_on < b_off, "{kv}");

    // No sharing: nothing hit on either target.
    for target in ["on", "off"] {
        let cached = u64s(&v["no_sharing"][target]["cached_tokens"]);
        assert_eq!(cached, vec![0, 0, 0], "{target}");
    }

    // The side channel: A's repeat hits, B's copy and both cold misses do
    // not; the KS figures are there.
    let side = &v["side_channel"];
    assert!(
        u64s(&side["a_repeat"]["cached_tokens"])
            .iter()
            .all(|&n| n == 32),
        "{side}"
    );
    for probe in ["a_cold", "b_same", "b_fresh"] {
        assert_eq!(
            u64s(&side[probe]["cached_tokens"]),
            vec![0, 0, 0],
            "{probe}"
        );
    }
    for pair in ["b_same_vs_b_fresh", "a_repeat_vs_a_cold"] {
        let d = side[pair]["ks_d"].as_f64().expect("ks_d");
        let p = side[pair]["ks_p"].as_f64().expect("ks_p");
        assert!(
            (0.0..=1.0).contains(&d) && (0.0..=1.0).contains(&p),
            "{pair}: {side}"
        );
    }
    assert_eq!(
        v["goals"].as_array().map(Vec::len),
        Some(3),
        "{}",
        v["goals"]
    );
}
