//! A host cut off mid-transfer for 10 s, then joined again: what its
//! streams, its grants, etcd and the router do, and that it comes back
//! without a restart.
//!
//! "Mid-transfer" is made and seen from outside: the cut side's links run
//! at 1 Mbit/s, so a prompt's KV takes about a second to ship, and the
//! test cuts the host whose interface has moved the first 16 KB of it
//! (its kernel's byte counters), so the grant exists and its pages are
//! partly written.

use std::time::{Duration, Instant};

use kvmesh_integration::netlab::mesh::LabMesh;
use kvmesh_integration::netlab::Shape;

use super::{
    assert_nothing_leaked, long_prompt, outcomes, reference, stream, wait_until, within, Streamed,
};

/// How long the link stays down.
const CUT: Duration = Duration::from_secs(10);
/// Bytes of KV a host moves before it is cut.
const MID: u64 = 16 * 1024;
/// A prompt's words: about 150 tokens of the tiny model, with room for
/// the answer in its 256-token context.
const WORDS: usize = 55;

/// Which of `hosts` has `sent` (else received) `MID` more bytes than at
/// `base`; waits at most 20 s.
fn mover(
    mesh: &LabMesh,
    hosts: [&'static str; 2],
    base: [(u64, u64); 2],
    sent: bool,
) -> &'static str {
    let mut found = None;
    wait_until("a host moving KV", Duration::from_secs(20), || {
        for (i, h) in hosts.iter().enumerate() {
            let (rx, tx) = mesh.lab.interface_bytes(h);
            let moved = if sent { tx - base[i].1 } else { rx - base[i].0 };
            if moved > MID {
                found = Some(hosts[i]);
                return true;
            }
        }
        false
    });
    found.expect("found")
}

fn bytes(mesh: &LabMesh, hosts: [&str; 2]) -> [(u64, u64); 2] {
    hosts.map(|h| mesh.lab.interface_bytes(h))
}

fn granted(mesh: &LabMesh, node: &str) -> f64 {
    mesh.node_value("kvmesh_node_reservations_granted_total", node)
        .unwrap_or(0.0)
}

fn up(mesh: &LabMesh, node: &str) -> bool {
    mesh.node_value("kvmesh_node_up", node) == Some(1.0)
}

/// `n` short completions, 4 at a time, each equal to the reference.
fn completions_equal_reference(mesh: &LabMesh, tag: &str, n: usize, what: &str) {
    let prompts: Vec<String> = (0..n).map(|i| format!("{tag} {i}: a small fox")).collect();
    let want: Vec<String> = prompts.iter().map(|p| reference(p, 8)).collect();
    for (chunk, want) in prompts.chunks(4).zip(want.chunks(4)) {
        let rxs: Vec<_> = chunk.iter().map(|p| stream(mesh, p, 8)).collect();
        for ((rx, w), p) in rxs.into_iter().zip(want).zip(chunk) {
            let s = within("a completion", Duration::from_secs(60), move || {
                rx.recv().expect("result")
            });
            assert!(s.finished, "[{what}] {p:?}: {s:?}");
            assert_eq!(&s.text, w, "[{what}] {p:?}");
        }
    }
}

/// The outcome counts of `node`'s grants, as the router last heard.
fn ended(mesh: &LabMesh, node: &str) -> Vec<(String, f64)> {
    outcomes(&mesh.metrics(), node)
}

/// The outcomes whose counts grew from `before` to `after`.
fn grew(before: &[(String, f64)], after: &[(String, f64)]) -> Vec<String> {
    after
        .iter()
        .filter(|(k, v)| {
            let b = before.iter().find(|(bk, _)| bk == k).map_or(0.0, |x| x.1);
            *v > b
        })
        .map(|(k, v)| {
            let b = before.iter().find(|(bk, _)| bk == k).map_or(0.0, |x| x.1);
            format!("{k} +{}", v - b)
        })
        .collect()
}

/// What happened after a cut, each seen by one poller (every 50 ms) so
/// that each time is measured from the cut, not after the others.
struct AfterCut {
    /// The client's stream, once it ended.
    stream: Streamed,
    /// Times from the cut until the router stopped choosing the host and
    /// until etcd dropped its key.
    left: Duration,
    expired: Duration,
    /// Time from the cut until `also` held (when one was given).
    also: Option<Duration>,
}

/// Polls until `rx` has the stream's end, the router has `host` down,
/// etcd has dropped its key and `also` holds (if given); panics past
/// `bound` for the stream or 20 s for the rest.
fn after_cut(
    mesh: &LabMesh,
    host: &str,
    rx: &std::sync::mpsc::Receiver<Streamed>,
    cut: Instant,
    bound: Duration,
    also: Option<&dyn Fn() -> bool>,
    what: &str,
) -> AfterCut {
    let (mut stream, mut left, mut expired, mut also_at) = (None, None, None, None);
    loop {
        if let Some(f) = also {
            if also_at.is_none() && f() {
                also_at = Some(cut.elapsed());
            }
        }
        if stream.is_none() {
            stream = rx.try_recv().ok();
        }
        if left.is_none() && !up(mesh, host) {
            left = Some(cut.elapsed());
        }
        if expired.is_none() && !mesh.registered().iter().any(|n| n == host) {
            expired = Some(cut.elapsed());
        }
        if let (Some(l), Some(e), true) = (left, expired, also.is_none() || also_at.is_some()) {
            if let Some(stream) = stream.take() {
                return AfterCut {
                    stream,
                    left: l,
                    expired: e,
                    also: also_at,
                };
            }
        }
        let t = cut.elapsed();
        assert!(
            stream.is_some() || t < bound + Duration::from_secs(5),
            "[{what}] the stream through the cut {host} did not end within {t:?}"
        );
        assert!(
            t < Duration::from_secs(20) || stream.is_none(),
            "[{what}] {host} cut {t:?} ago: still routed {}, still in etcd {}, waiting on another condition {}",
            left.is_none(),
            expired.is_none(),
            also.is_some() && also_at.is_none()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// etcd drops a cut node's key within its TTL after the last keep-alive
/// (sent every third of it) plus etcd's expiry check (500 ms): within a
/// TTL and a second of the cut, with slack for the 50 ms polling.
fn assert_lease_expired_in_time(mesh: &LabMesh, host: &str, expired: Duration, what: &str) {
    let bound = Duration::from_secs(mesh.options.lease_ttl_s) + Duration::from_millis(1500);
    assert!(
        expired <= bound,
        "[{what}] etcd dropped {host} {expired:?} after the cut; its lease allows {bound:?}"
    );
}

/// Waits `CUT` after `cut`, joins `host` again and waits until etcd and
/// the router have it back; the times from the heal to each.
fn heal_and_rejoin(mesh: &mut LabMesh, host: &str, cut: Instant, what: &str) -> (f64, f64) {
    std::thread::sleep(CUT.saturating_sub(cut.elapsed()));
    mesh.lab.shape_all(Shape::default());
    let pid = mesh.proc(host).id();
    mesh.lab.set_link(host, true);
    let healed = Instant::now();
    wait_until("re-registration", Duration::from_secs(30), || {
        mesh.registered().iter().any(|n| n == host)
    });
    let registered = healed.elapsed().as_secs_f64();
    wait_until("back in routing", Duration::from_secs(30), || {
        up(mesh, host)
    });
    let routed = healed.elapsed().as_secs_f64();
    let p = mesh.proc(host);
    assert!(
        p.wait_exit(Duration::ZERO).is_none() && p.id() == pid,
        "[{what}] {host} was not the same running process after the partition"
    );
    (registered, routed)
}

/// A decode host cut off while a prompt's KV is on its way to it.
pub fn decode(mesh: &mut LabMesh, what: &str) {
    let decodes = ["decode-0", "decode-1"];
    let slow = Shape {
        rate_bps: Some(1_000_000),
        ..Shape::default()
    };
    for d in decodes {
        mesh.lab.shape(d, slow);
    }
    let prompt = long_prompt("decode-cut", WORDS);
    let bound = Duration::from_millis(mesh.options.lease_ms + mesh.options.abort_timeout_ms);
    let before: Vec<_> = decodes.iter().map(|d| ended(mesh, d)).collect();
    let base = bytes(mesh, decodes);
    let rx = stream(mesh, &prompt, 8);
    let victim = mover(mesh, decodes, base, false);
    mesh.lab.set_link(victim, false);
    let cut = Instant::now();
    let other = if victim == "decode-0" {
        "decode-1"
    } else {
        "decode-0"
    };
    mesh.lab.shape(other, Shape::default());

    // The client's stream ends with a typed error within the bound, the
    // router stops choosing the node, etcd's lease for it expires.
    let AfterCut {
        stream: s,
        left,
        expired,
        ..
    } = after_cut(mesh, victim, &rx, cut, bound, None, what);
    assert_lease_expired_in_time(mesh, victim, expired, what);
    let ended_after = s.ended.duration_since(cut);
    assert!(
        !s.finished && s.error.is_some(),
        "[{what}] the stream to the cut decode node did not end with an error: {s:?}"
    );
    assert!(
        ended_after <= bound,
        "[{what}] the stream ended {ended_after:?} after the cut; the bound is {bound:?}"
    );
    // The other decode node serves.
    let g0 = granted(mesh, other);
    completions_equal_reference(mesh, "while decode is cut", 4, what);
    mesh.wait_fresh_reports(&[other]);
    let g1 = granted(mesh, other);
    assert!(
        g1 - g0 >= 4.0,
        "[{what}] {other} granted {} of 4 requests made while {victim} was cut",
        g1 - g0
    );
    let (registered, routed) = heal_and_rejoin(mesh, victim, cut, what);

    // Its grant ended without completing, and nothing leaked.
    let after = assert_nothing_leaked(mesh, what);
    let i = decodes.iter().position(|d| *d == victim).expect("a decode");
    let changed = grew(&before[i], &ended(mesh, victim));
    assert!(
        !changed.is_empty() && changed.iter().all(|c| !c.starts_with("completed")),
        "[{what}] the cut grant on {victim}: outcomes changed {changed:?}"
    );
    // It takes traffic again, and answers right on reused pages.
    let g0 = granted(mesh, victim);
    let mut rounds = 0;
    while granted(mesh, victim) <= g0 {
        rounds += 1;
        assert!(
            rounds <= 4,
            "[{what}] {victim} took no request after it rejoined"
        );
        completions_equal_reference(mesh, &format!("after the decode cut {rounds}"), 4, what);
        // The poller asks every node at each tick: two fresh reports of
        // the node that stayed up cover the victim's too, if it answers.
        mesh.wait_fresh_reports(&[other]);
    }
    println!(
        "CHECKED [{what}] decode host {victim} cut mid-transfer for 10 s: the stream ended with error {:?} \
         {:.2} s after the cut (bound: lease + abort = {:.0} s); out of routing by {:.2} s; 4 requests served by \
         {other}, equal to the reference; etcd lease gone {:.2} s after the cut (TTL {} s); its grant ended {changed:?} \
         (not completed); healed: registered again after {registered:.2} s, routed after {routed:.2} s, same process; \
         it served again, equal to the reference; nothing leaked {after:?}",
        s.error.as_deref().unwrap_or_default(),
        ended_after.as_secs_f64(),
        bound.as_secs_f64(),
        left.as_secs_f64(),
        expired.as_secs_f64(),
        mesh.options.lease_ttl_s,
    );
}

/// A prefill host cut off while it writes a prompt's KV to a decode node.
pub fn prefill(mesh: &mut LabMesh, what: &str) {
    let prefills = ["prefill-0", "prefill-1"];
    let decodes = ["decode-0", "decode-1"];
    let slow = Shape {
        rate_bps: Some(1_000_000),
        ..Shape::default()
    };
    for p in prefills {
        mesh.lab.shape(p, slow);
    }
    let prompt = long_prompt("prefill-cut", WORDS);
    let want = reference(&prompt, 8);
    let bound = Duration::from_millis(mesh.options.lease_ms + mesh.options.abort_timeout_ms);
    let before: Vec<_> = decodes.iter().map(|d| ended(mesh, d)).collect();
    let base = bytes(mesh, prefills);
    let dbase = bytes(mesh, decodes);
    let rx = stream(mesh, &prompt, 8);
    let victim = mover(mesh, prefills, base, true);
    mesh.lab.set_link(victim, false);
    let cut = Instant::now();
    // The decode node it was writing to: the one that received the most.
    let holder = {
        let now = bytes(mesh, decodes);
        if now[0].0 - dbase[0].0 >= now[1].0 - dbase[1].0 {
            "decode-0"
        } else {
            "decode-1"
        }
    };
    let other = if victim == "prefill-0" {
        "prefill-1"
    } else {
        "prefill-0"
    };
    mesh.lab.shape(other, Shape::default());

    // Decode holds the grant's pages until it has revoked the cut
    // writer's path or the writer confirmed (impossible while it is cut
    // off): the grant's end is watched with the rest.
    let h = decodes.iter().position(|d| *d == holder).expect("a decode");
    let holder_ended = || !grew(&before[h], &ended(mesh, holder)).is_empty();
    let AfterCut {
        stream: s,
        left,
        expired,
        also: freed_after,
    } = after_cut(mesh, victim, &rx, cut, bound, Some(&holder_ended), what);
    let freed_after = freed_after.expect("watched");
    assert_lease_expired_in_time(mesh, victim, expired, what);
    // The client: a typed error, or the right answer from a retry; never
    // a wrong answer.
    let ended_after = s.ended.duration_since(cut);
    let client = match (&s.error, s.finished) {
        (Some(code), false) => format!("error {code:?}"),
        (None, true) => {
            assert_eq!(s.text, want, "[{what}] a wrong answer after a prefill cut");
            "the reference answer (retried)".to_owned()
        }
        _ => panic!("[{what}] the stream neither failed with a code nor finished: {s:?}"),
    };
    assert!(
        ended_after <= bound,
        "[{what}] the stream ended {ended_after:?} after the cut; the bound is {bound:?}"
    );
    // How it ended: a revocation (the table records one only once the
    // writer's connection or endpoint is torn down, so nothing of the cut
    // writer can land any more) or a confirmed abort; never completed.
    let changed = grew(&before[h], &ended(mesh, holder));
    let revoked = ["lease_expired", "abort_timed_out", "writer_lost", "aborted"];
    assert!(
        changed
            .iter()
            .all(|c| revoked.iter().any(|r| c.starts_with(r))),
        "[{what}] the grant {victim} was writing on {holder} ended {changed:?}: \
         not revoked or confirmed"
    );
    // And not early: after an abort (the router's, when the client's
    // request failed) decode waits the whole abort timeout for a
    // confirmation the cut writer cannot send before it revokes; a
    // report comes every 200 ms, hence the slack.
    let abort = Duration::from_millis(mesh.options.abort_timeout_ms);
    if changed.iter().any(|c| c.starts_with("abort_timed_out")) {
        assert!(
            freed_after + Duration::from_millis(300) >= ended_after + abort,
            "[{what}] {holder} revoked {freed_after:?} after the cut, the request failed \
             {ended_after:?} after it: sooner than the abort timeout {abort:?}"
        );
    }
    completions_equal_reference(mesh, "while prefill is cut", 4, what);
    let (registered, routed) = heal_and_rejoin(mesh, victim, cut, what);
    let after = assert_nothing_leaked(mesh, what);
    completions_equal_reference(mesh, "after the prefill cut", 4, what);
    println!(
        "CHECKED [{what}] prefill host {victim} cut mid-transfer to {holder} for 10 s: the client got {client} \
         {:.2} s after the cut; out of routing after {:.2} s; {holder} ended the grant {changed:?} \
         {:.2} s after the cut (a revocation: the cut writer's connection torn down before the pages \
         were freed, no sooner than the abort timeout after the abort); 4 requests while cut equal \
         the reference; etcd lease gone {:.2} s after the cut; healed: registered again after {registered:.2} s, routed after {routed:.2} s, same process; \
         answers equal the reference after; nothing leaked {after:?}",
        ended_after.as_secs_f64(),
        left.as_secs_f64(),
        freed_after.as_secs_f64(),
        expired.as_secs_f64(),
    );
}
