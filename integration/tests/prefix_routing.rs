//! Routing that follows the prefix cache (issue 16 item 3), on a mesh of
//! 2 prefill and 2 decode processes: conversations that share nothing
//! spread over both nodes of each role, and every later turn of a
//! conversation lands on the prefill and decode node that hold its earlier
//! turns' pages (and finds them there), as do the samples of one prompt. Which node served a request is
//! read off the nodes' own prefix-cache counters, as the router exports
//! them: the node whose looked-up tokens grew.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvmesh_integration::cache::complete;
use kvmesh_integration::http;
use kvmesh_integration::roles::{start_two_by_two, two_by_two_mesh_file};

const NODES: [&str; 4] = ["prefill-0", "prefill-1", "decode-0", "decode-1"];

/// Per node: (looked-up tokens, hit tokens), from the router's metrics.
type Counters = BTreeMap<&'static str, (f64, f64)>;

fn counters(addr: &str) -> Counters {
    let m = http::metrics(addr);
    NODES
        .iter()
        .map(|&n| {
            let get = |name: &str| m.first(name, &[("node", n)]).unwrap_or(0.0);
            (
                n,
                (
                    get("kvmesh_node_prefix_cache_lookup_tokens_total"),
                    get("kvmesh_node_prefix_cache_hit_tokens_total"),
                ),
            )
        })
        .collect()
}

/// The counters once the nodes' reports have caught up (two reads a
/// poll and a half apart agree, and differ from `before`). The router's
/// index of cached pages comes with the same reports.
fn settled(addr: &str, before: &Counters) -> Counters {
    let t0 = Instant::now();
    let mut last = counters(addr);
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = counters(addr);
        if now == last && &now != before {
            return now;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the nodes' reports never settled: {now:?}"
        );
        last = now;
    }
}

/// The node of `role` whose counter `pick` grew from `a` to `b`: exactly one.
fn grew(a: &Counters, b: &Counters, role: &str, pick: fn(&(f64, f64)) -> f64) -> &'static str {
    let grown: Vec<_> = NODES
        .iter()
        .filter(|n| n.starts_with(role) && pick(&b[*n]) > pick(&a[*n]))
        .copied()
        .collect();
    assert_eq!(grown.len(), 1, "{role}: {grown:?} grew, {a:?} -> {b:?}");
    grown[0]
}

#[test]
fn a_conversation_follows_its_prefix_and_load_still_spreads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (file, addr) = two_by_two_mesh_file(dir.path());
    let _procs = start_two_by_two(&file, &addr);

    let systems = [
        "You are a ship's navigator. Answer in nautical terms, briefly.",
        "You are a baker. Every answer mentions bread, flour or ovens.",
        "You are a patient maths tutor who explains one step at a time.",
        "You are a gardener; talk about soil, seeds and the seasons.",
    ];
    let questions = ["What should I do first?", "And after that?", "Why?"];
    let mut history: Vec<String> = systems.iter().map(|s| format!("{s}\n")).collect();
    // (prefill node, decode node) of each conversation's first turn.
    let mut home = Vec::new();
    let mut c = counters(&addr);
    for (turn, q) in questions.iter().enumerate() {
        // Odd turns visit the conversations in reverse, so that taking
        // turns alone (the order of turn 0) would send them elsewhere.
        let mut order: Vec<usize> = (0..history.len()).collect();
        if turn % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let h = &mut history[i];
            h.push_str(&format!("User: {q}\nAssistant:"));
            let (text, cached) = complete(&addr, None, h, None, 6);
            h.push_str(&text);
            h.push('\n');
            let next = settled(&addr, &c);
            let lookup = |x: &(f64, f64)| x.0;
            let hit = |x: &(f64, f64)| x.1;
            let served = (
                grew(&c, &next, "prefill", lookup),
                grew(&c, &next, "decode", lookup),
            );
            if turn == 0 {
                assert_eq!(cached, 0, "conversation {i} shares nothing yet");
                home.push(served);
            } else {
                assert_eq!(
                    served, home[i],
                    "conversation {i}, turn {turn}: routed away from its prefix"
                );
                // It found its pages there: prefill computed only the new
                // part, and decode granted only the pages it lacked.
                assert!(cached > 0, "conversation {i}, turn {turn}: no prefill hit");
                assert_eq!(grew(&c, &next, "decode", hit), home[i].1);
            }
            c = next;
        }
    }
    // The samples of one prompt (n = 4) go where the first went, before
    // any load report could advertise its pages there: one prefill node
    // and one decode node serve all four, and samples 1-3 find the
    // prompt's full pages at both (decode: the pages sample 0 received,
    // shared while it runs).
    let prompt = "A lighthouse keeper counts the ships that pass each night and \
                  writes their names in a book that nobody has ever read";
    let v = http::complete(
        &addr,
        "/v1/completions",
        &serde_json::json!({"prompt": prompt, "n": 4, "max_tokens": 24,
                            "ignore_eos": true, "temperature": 0.8, "seed": 3}),
    );
    assert_eq!(v["choices"].as_array().map(Vec::len), Some(4), "{v}");
    let next = settled(&addr, &c);
    let lookup = |x: &(f64, f64)| x.0;
    let hit = |x: &(f64, f64)| x.1;
    let prefill = grew(&c, &next, "prefill", lookup);
    let decode = grew(&c, &next, "decode", lookup);
    assert_eq!(grew(&c, &next, "prefill", hit), prefill);
    assert_eq!(grew(&c, &next, "decode", hit), decode);
    let gained = |node: &str| next[node].1 - c[node].1;
    // At least a page each for samples 1-3 (page_size 8 in this mesh).
    assert!(gained(prefill) >= 3.0 * 8.0, "{next:?}");
    assert_eq!(gained(prefill), gained(decode), "the same full pages");

    // Conversations that share nothing took turns over each role's nodes.
    for role in ["prefill-", "decode-"] {
        let used: std::collections::BTreeSet<_> = home
            .iter()
            .flat_map(|(p, d)| [*p, *d])
            .filter(|n| n.starts_with(role))
            .collect();
        assert_eq!(used.len(), 2, "{role}* nodes used: {home:?}");
    }
}
