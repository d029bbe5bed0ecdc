//! Planted bugs, one defence switched off at a time (`--plant-bug`): the
//! next defence stops each, and the request fails instead of leaking.

use super::*;

fn start_planted(bug: &str, extra: &[&str]) -> Mesh {
    let mut args = vec!["--plant-bug", bug, "--transport", "tcp"];
    args.extend_from_slice(extra);
    start_tiny(&args)
}

/// [`start_planted`] with the mesh's log captured (level warn).
fn start_planted_logged(bug: &str, extra: &[&str]) -> Mesh {
    let mut args = vec![
        "--fault-injection",
        "--lease-ms",
        LEASE_MS,
        "--abort-timeout-ms",
        ABORT_TIMEOUT_MS,
        "--plant-bug",
        bug,
        "--transport",
        "tcp",
    ];
    args.extend_from_slice(extra);
    Mesh::start_logged(&tiny_model_dir(), &args, "warn")
}

/// Planted bug: the router admits everything. The nodes' own re-checks
/// (I3 at decode) still refuse a prompt that does not fit: the decode
/// node's typed refusal (400 `decode_refused`), no reservation granted,
/// pages whole.
#[test]
fn planted_no_admission_is_stopped_by_the_nodes_own_checks() {
    let mesh = start_planted(
        "no-admission",
        &["--kv-pool-tokens", "64", "--allow-small-pool"],
    );
    for (max_tokens, what) in [(100, "over the pool"), (300, "over the window")] {
        let e = complete(&mesh.http, PROMPT, max_tokens, false, &[])
            .expect_err("admitted by the bug, refused by decode");
        assert_eq!(
            failure(&e),
            Some((400, "decode_refused".to_owned())),
            "{what}: {e}"
        );
    }
    assert_eq!(granted(&mesh), 0.0);
    mesh.assert_pages_come_back();
    // Requests that fit still work.
    let want = reference(&tiny_model_dir(), PROMPT, 4);
    assert_eq!(
        complete(&mesh.http, PROMPT, 4, false, &[]).as_deref(),
        Ok(want.as_str())
    );
}

/// Planted bug: decode goes live without verifying the transfer. A frame
/// dropped on the way leaves slots that hold the previous request's KV
/// (scrubbing off); the watermarks only cover what landed, so the first
/// read of the hole is a guard violation (I2) and the request fails,
/// rather than answering from foreign data: the client gets 502
/// `decode_failed` with a fixed message, and the router's log carries the
/// decode node's reason (the unwritten slot).
#[test]
fn planted_no_verification_is_stopped_by_the_watermarks() {
    let mesh = start_planted_logged("no-verification", &["--scrub", "off"]);
    // Someone else's KV in the pages first.
    let other = "Secret QUOKKA-2208 belongs to another tenant entirely, do not read";
    complete(&mesh.http, other, 8, false, &[]).expect("filler request");
    let before = guard_violations(&mesh);
    let e = complete(
        &mesh.http,
        PROMPT,
        8,
        false,
        &[("x-kvmesh-fault", "frame:1=drop")],
    )
    .expect_err("an unverified hole must fail the request");
    assert_eq!(failure(&e), Some((502, "decode_failed".to_owned())), "{e}");
    assert!(
        !e.contains("unwritten"),
        "the node's words reached the client: {e}"
    );
    let logged = mesh.log_line(
        &["a node failed a request", "decode-0", "unwritten"],
        Duration::from_secs(10),
    );
    assert!(
        logged.is_some(),
        "the router did not log the decode node's reason"
    );
    wait_until(&format!("a guard violation counted for {e}"), || {
        guard_violations(&mesh) > before
    });
    mesh.assert_pages_come_back();
    // A complete transfer is unaffected by the bug.
    let want = reference(&tiny_model_dir(), PROMPT, 8);
    assert_eq!(
        complete(&mesh.http, PROMPT, 8, false, &[]).as_deref(),
        Ok(want.as_str())
    );
}

/// Planted bug: decode frees an aborted reservation's pages at once, with
/// the writer still writing (no confirmation, no revocation). The next
/// request gets those pages; the writer's late frames arrive for them and
/// the receiver check refuses every one (counted), so that request's
/// answer still equals the reference.
#[test]
fn planted_no_confirm_or_revoke_is_stopped_by_the_receiver_check() {
    let mesh = start_planted(
        "no-confirm-or-revoke",
        &["--kv-pool-tokens", "64", "--allow-small-pool"],
    );
    let before = kv_refused(&mesh);
    // Client A leaves while prefill is held up before its first frame.
    let body = json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": true});
    let s = post_streaming_headers(
        &mesh.http,
        "/v1/completions",
        &body,
        &[("x-kvmesh-fault", "frame:0=delay:1500")],
    );
    assert_eq!(s.status, 200);
    std::thread::sleep(Duration::from_millis(300));
    drop(s);
    // B takes the freed pages (the pool holds one such request at a time)
    // while A's writer is still to send its frames.
    std::thread::sleep(Duration::from_millis(200));
    let want = reference(&tiny_model_dir(), "Once upon a time there was", 12);
    let b = complete(&mesh.http, "Once upon a time there was", 12, false, &[]);
    assert_eq!(b.as_deref(), Ok(want.as_str()));
    wait_until("the late frames refused", || kv_refused(&mesh) > before);
    mesh.assert_pages_come_back();
}
