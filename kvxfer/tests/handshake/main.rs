//! The reservation and abort handshake over real transports (TCP on
//! 127.0.0.1; a Unix socket with a shared-memory pool), race by race
//! (design/kv-safety.md section 3, issue 3 item 6). Every case checks the
//! same outcome: exactly one end for the reservation, no page reused while
//! writable, every page free again, no guard violation.

mod child;
mod common;

use std::time::Duration;

use common::*;
use kvmesh_kvpool::KvDtype;
use kvmesh_kvwire::{
    decode_message, AbortConfirmed, AbortReason, Capability, Dtype, FirstToken, Message,
    PromptScore, TokenLogprobs, TransferDone, WriterId,
};
use kvmesh_kvxfer::handshake::{Outcome, ReserveError, RevokeCause, TableConfig, VerifyError};
use kvmesh_kvxfer::transport::client::WriterError;

/// One test per transport. The UCX one says "not run" where libucp is
/// missing (the test command installs it).
macro_rules! both {
    ($name:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn tcp() {
                super::$name(super::TransportKind::Tcp).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn shm() {
                super::$name(super::TransportKind::Shm).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ucx() {
                if let Err(e) = super::TransportKind::Ucx.available() {
                    eprintln!("not run: {e}");
                    return;
                }
                super::$name(super::TransportKind::Ucx).await
            }
        }
    };
}

// After the macro, which it uses.
mod after_release;
mod grant_bounds;
mod latent;
mod mesh_auth;
mod tls;

both!(transfer_verifies_and_goes_live);
async fn transfer_verifies_and_goes_live(kind: TransportKind) {
    let node = Node::start(kind).await;
    let client = node.client().await;
    let (grant, pending) = node
        .table
        .reserve(Node::request(10, 6, client.writer()))
        .expect("reserve");
    // Prompt 10 + budget 6 = 16 tokens = 4 pages; the grant covers the
    // prompt's 3.
    assert_eq!(grant.pages.len(), 3);
    assert_eq!(node.free(), N_PAGES - 4);
    let mut w = client.begin(grant).expect("begin");
    write_layers(&mut w, 0..N_LAYERS as u16, 1.0).await;
    // The first token's report crosses with the transfer, whatever path
    // the pages took: what the router will be told is what prefill sent.
    let first = FirstToken {
        id: 77,
        logprobs: Some(TokenLogprobs {
            logprob: -0.25,
            top: vec![(77, -0.25), (3, -2.0)],
        }),
        cached_tokens: 4,
        prompt_scores: (1..10)
            .map(|i| PromptScore {
                logprob: -(i as f32),
                rank: i,
                top: vec![(i, -0.5)],
            })
            .collect(),
    };
    w.finish(first.clone()).await.expect("finish");
    let live = pending.wait().await.expect("live");
    assert_eq!((live.prompt_tokens(), live.first_token()), (10, 77));
    assert_eq!(live.first(), &first);
    assert_prompt(live.reservation(), 10, 1.0);
    assert_eq!(node.table.stats().ended("completed"), 1);
    drop(live);
    node.assert_idle().await;
    assert_eq!(node.table.stats().ended_total(), 1);
}

both!(a_cached_head_is_leased_not_granted_and_the_transfer_ships_the_rest);
/// With the pool's prefix cache on: a first sequence's full pages enter
/// the cache when it ends; a second with the same prompt (same namespace
/// and keys) leases them, its grant covers only the page of the last
/// prompt tokens (`cached_tokens` 8 of 10), the writer ships only that
/// page, and the live sequence reads all 10 positions, the head from the
/// cache. The page of the last prompt token is always granted, even when
/// every page of the prompt is cached.
async fn a_cached_head_is_leased_not_granted_and_the_transfer_ships_the_rest(kind: TransportKind) {
    use kvmesh_kvpool::{Namespace, PageKey};
    let node = Node::start(kind).await;
    node.table.pool().set_cache_pages(N_PAGES / 2);
    let client = node.client().await;
    let ns = Namespace::from_slice(&[1; 32]).expect("32 bytes");
    let keys: Vec<PageKey> = (0..3u8)
        .map(|i| PageKey::from_slice(&[i + 1; 32]).expect("32 bytes"))
        .collect();
    let cached = |prompt: usize| kvmesh_kvxfer::handshake::ReserveRequest {
        cached: Some((ns, keys[..prompt / PAGE_SIZE].to_vec())),
        ..Node::request(prompt, 2, client.writer())
    };
    // First: a cold cache, all three pages granted.
    let (grant, pending) = node.table.reserve(cached(10)).expect("reserve");
    assert_eq!((grant.cached_tokens, grant.pages.len()), (0, 3));
    let mut w = client.begin(grant).expect("begin");
    write_layers(&mut w, 0..N_LAYERS as u16, 1.0).await;
    w.finish(7).await.expect("finish");
    let mut live = pending.wait().await.expect("live");
    assert_prompt(live.reservation(), 10, 1.0);
    live.reservation_mut().cache_as(ns, keys.clone());
    drop(live);
    assert_eq!(node.table.pool().cache_stats().entries, 2);

    // Second: pages 0 and 1 come from the cache.
    let (grant, pending) = node.table.reserve(cached(10)).expect("reserve");
    assert_eq!((grant.cached_tokens, grant.pages.len()), (8, 1));
    let mut w = client.begin(grant).expect("begin");
    write_layers(&mut w, 0..N_LAYERS as u16, 1.0).await;
    w.finish(7).await.expect("finish");
    let live = pending.wait().await.expect("live");
    assert_eq!(live.reservation().cached_tokens(), 8);
    assert_prompt(live.reservation(), 10, 1.0);
    drop(live);

    // A prompt of exactly two pages, both cached: the last one is granted.
    let (grant, pending) = node.table.reserve(cached(8)).expect("reserve");
    assert_eq!((grant.cached_tokens, grant.pages.len()), (4, 1));
    let mut w = client.begin(grant).expect("begin");
    write_layers(&mut w, 0..N_LAYERS as u16, 1.0).await;
    w.finish(7).await.expect("finish");
    let live = pending.wait().await.expect("live");
    assert_prompt(live.reservation(), 8, 1.0);
    drop(live);
    assert_eq!(node.table.pool().clear_cache(), 2);
    node.assert_idle().await;
}

both!(an_f16_pool_transfer_verifies_and_goes_live);
/// The same transfer into an f16 pool: the writer encodes f16 (half the
/// bytes), its checksums cover the f16 bytes, and they match the pages as
/// they landed; the prompt reads back as f16 rounds it.
async fn an_f16_pool_transfer_verifies_and_goes_live(kind: TransportKind) {
    let node = Node::with_pool(kind, table_config(), pool_config_of(KvDtype::F16)).await;
    let client = node.client().await;
    assert_eq!(client.geometry().dtype, Dtype::F16);
    let (grant, pending) = node
        .table
        .reserve(Node::request(10, 6, client.writer()))
        .expect("reserve");
    assert_eq!(grant.geometry.dtype, Dtype::F16);
    let mut w = client.begin(grant).expect("begin");
    write_layers(&mut w, 0..N_LAYERS as u16, 1.5).await;
    w.finish(5).await.expect("finish");
    let live = pending.wait().await.expect("verified and live");
    assert_prompt(live.reservation(), 10, 1.5);
    assert_eq!(node.table.stats().ended("completed"), 1);
    drop(live);
    node.assert_idle().await;
}

both!(abort_before_the_grant_reaches_the_writer);
async fn abort_before_the_grant_reaches_the_writer(kind: TransportKind) {
    let node = Node::start(kind).await;
    let client = node.client().await;
    let (grant, pending) = node
        .table
        .reserve(Node::request(9, 3, client.writer()))
        .expect("reserve");
    assert_eq!(
        node.table
            .abort(grant.reservation, AbortReason::CLIENT_GONE),
        Ok("aborting")
    );
    // The writer has never seen the grant; it still confirms, leaving a
    // tombstone, and the pages come back only then.
    let ended = pending.wait().await.expect_err("aborted");
    assert_eq!(ended.outcome, Outcome::Aborted(AbortReason::CLIENT_GONE));
    node.assert_idle().await;
    // The grant arrives late: refused, nothing written.
    assert!(matches!(client.begin(grant), Err(WriterError::Aborted(_))));
    let s = node.table.stats();
    assert_eq!((s.ended("aborted"), s.ended_total()), (1, 1));
}

both!(abort_during_writes);
async fn abort_during_writes(kind: TransportKind) {
    let node = Node::start(kind).await;
    let client = node.client().await;
    let (grant, pending) = node
        .table
        .reserve(Node::request(12, 4, client.writer()))
        .expect("reserve");
    let id = grant.reservation;
    let mut w = client.begin(grant).expect("begin");
    write_layers(&mut w, 0..1, 2.0).await;
    node.table
        .abort(id, AbortReason::CLIENT_GONE)
        .expect("abort");
    let ended = pending.wait().await.expect_err("aborted");
    assert_eq!(ended.outcome, Outcome::Aborted(AbortReason::CLIENT_GONE));
    // The writer stopped for good.
    let (k, v) = layer_kv(12, 1, 2.0);
    assert!(matches!(
        w.write_layer(1, &k, &v).await,
        Err(WriterError::Aborted(_))
    ));
    node.assert_idle().await;
    assert_eq!(node.table.stats().ended_total(), 1);
}

/// Transfer-done is in flight when the abort happens: the abort wins, the
/// done is refused, the writer's confirmation releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_after_transfer_done_before_verification() {
    let node = Node::start(TransportKind::Tcp).await;
    let mut raw = RawWriter::connect(&node).await;
    let (grant, pending) = node
        .table
        .reserve(Node::request(6, 2, raw.id))
        .expect("reserve");
    for layer in 0..N_LAYERS as u16 {
        for f in frames_for(&grant, layer, 3.0) {
            raw.send_bytes(&f).await;
        }
    }
    wait_for("frames landed", || node.table.stats().frames_landed == 4).await;
    node.table
        .abort(grant.reservation, AbortReason::CLIENT_GONE)
        .expect("abort");
    let abort = raw.recv().await.expect("abort message");
    assert!(matches!(
        decode_message(&abort).expect("decodes").0,
        Message::Abort(_)
    ));
    let done = TransferDone {
        reservation: grant.reservation,
        capability: grant.capability.clone(),
        tokens_written: 6,
        first: 5.into(),
        page_checksums: checksums_for(&grant, 3.0),
    };
    raw.send(&Message::TransferDone(done)).await;
    raw.send(&Message::AbortConfirmed(AbortConfirmed {
        reservation: grant.reservation,
        frames_sent: 4,
    }))
    .await;
    let ended = pending.wait().await.expect_err("the abort wins");
    assert_eq!(ended.outcome, Outcome::Aborted(AbortReason::CLIENT_GONE));
    node.assert_idle().await;
    let s = node.table.stats();
    assert_eq!(
        s.control_rejected("illegal_transition"),
        1,
        "the done was refused"
    );
    assert_eq!(s.ended_total(), 1);
}

both!(abort_after_the_sequence_went_live);
async fn abort_after_the_sequence_went_live(kind: TransportKind) {
    let node = Node::start(kind).await;
    let client = node.client().await;
    let (grant, pending) = node
        .table
        .reserve(Node::request(5, 5, client.writer()))
        .expect("reserve");
    let id = grant.reservation;
    let mut w = client.begin(grant).expect("begin");
    write_layers(&mut w, 0..N_LAYERS as u16, 4.0).await;
    w.finish(1).await.expect("finish");
    let live = pending.wait().await.expect("live");
    // Too late to abort the handshake: it ended once, as completed. The
    // decode side ends the sequence by dropping it.
    assert_eq!(
        node.table.abort(id, AbortReason::CLIENT_GONE),
        Ok("completed")
    );
    assert_eq!(node.free(), N_PAGES - 3);
    drop(live);
    node.assert_idle().await;
    assert_eq!(node.table.stats().ended_total(), 1);
}

both!(writer_connection_lost_mid_transfer);
async fn writer_connection_lost_mid_transfer(kind: TransportKind) {
    let node = Node::start(kind).await;
    let client = node.client().await;
    let (grant, pending) = node
        .table
        .reserve(Node::request(12, 2, client.writer()))
        .expect("reserve");
    let mut w = client.begin(grant).expect("begin");
    write_layers(&mut w, 0..1, 7.0).await;
    drop(w);
    drop(client);
    let ended = pending.wait().await.expect_err("revoked");
    assert_eq!(ended.outcome, Outcome::Revoked(RevokeCause::WriterLost));
    node.assert_idle().await;
    assert_eq!(node.table.stats().ended_total(), 1);
}

/// The writer never confirms the abort: after the abort timeout the write
/// path is revoked (the writer is told), then the pages are freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_confirmation_within_the_abort_timeout() {
    let node = Node::start(TransportKind::Tcp).await;
    let mut raw = RawWriter::connect(&node).await;
    let (grant, pending) = node
        .table
        .reserve(Node::request(6, 2, raw.id))
        .expect("reserve");
    for f in frames_for(&grant, 0, 8.0) {
        raw.send_bytes(&f).await;
    }
    node.table
        .abort(grant.reservation, AbortReason::CLIENT_GONE)
        .expect("abort");
    let start = std::time::Instant::now();
    let ended = pending.wait().await.expect_err("revoked");
    assert_eq!(ended.outcome, Outcome::Revoked(RevokeCause::AbortTimedOut));
    assert!(
        start.elapsed() >= Duration::from_millis(250),
        "held until the timeout"
    );
    let mut kinds = Vec::new();
    for _ in 0..2 {
        let m = raw.recv().await.expect("message");
        kinds.push(decode_message(&m).expect("decodes").0.message_type());
    }
    use kvmesh_kvwire::MessageType;
    assert_eq!(kinds, [MessageType::Abort, MessageType::Revoke]);
    // A confirmation after the revocation is late: refused, nothing freed twice.
    raw.send(&Message::AbortConfirmed(AbortConfirmed {
        reservation: grant.reservation,
        frames_sent: 2,
    }))
    .await;
    wait_for("late confirm refused", || {
        node.table.stats().control_rejected("already_ended") == 1
    })
    .await;
    node.assert_idle().await;
    assert_eq!(node.table.stats().ended_total(), 1);
}

both!(lease_expires_without_transfer_done);
async fn lease_expires_without_transfer_done(kind: TransportKind) {
    let node = Node::with(
        kind,
        TableConfig {
            lease: Duration::from_millis(200),
            ..table_config()
        },
    )
    .await;
    let client = node.client().await;
    let (grant, pending) = node
        .table
        .reserve(Node::request(4, 4, client.writer()))
        .expect("reserve");
    let mut w = client.begin(grant).expect("begin");
    write_layers(&mut w, 0..1, 9.0).await;
    let ended = pending.wait().await.expect_err("expired");
    assert_eq!(ended.outcome, Outcome::Revoked(RevokeCause::LeaseExpired));
    node.assert_idle().await;
    // The writer learns of the revocation and stops.
    let mut told = None;
    for _ in 0..500 {
        if let Err(e) = w.check().await {
            told = Some(e);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(matches!(told, Some(WriterError::Revoked(_))), "{told:?}");
    let (k, v) = layer_kv(4, 1, 9.0);
    assert!(matches!(
        w.write_layer(1, &k, &v).await,
        Err(WriterError::Revoked(_))
    ));
    assert_eq!(node.table.stats().ended_total(), 1);
}

/// I4: a short transfer (one page of a three-page prompt, as in the
/// incident) and a transfer with a missing frame never become sequences.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_or_incomplete_transfers_are_refused() {
    let node = Node::start(TransportKind::Tcp).await;
    let mut raw = RawWriter::connect(&node).await;

    // One page and a transfer-done that claims one page's tokens.
    let (g, p) = node
        .table
        .reserve(Node::request(10, 2, raw.id))
        .expect("reserve");
    for layer in 0..N_LAYERS as u16 {
        raw.send_bytes(&frames_for(&g, layer, 1.0)[0]).await;
    }
    raw.send(&Message::TransferDone(TransferDone {
        reservation: g.reservation,
        capability: g.capability.clone(),
        tokens_written: 4,
        first: 1.into(),
        page_checksums: checksums_for(&g, 1.0)[..1].to_vec(),
    }))
    .await;
    let e = p.wait().await.expect_err("refused");
    assert_eq!(
        e.outcome,
        Outcome::Revoked(RevokeCause::VerificationFailed(VerifyError::TokenCount {
            granted: 10,
            written: 4
        }))
    );

    // Right counts, but one frame never sent: the landed checksum differs.
    let (g, p) = node
        .table
        .reserve(Node::request(10, 2, raw.id))
        .expect("reserve");
    for layer in 0..N_LAYERS as u16 {
        for (i, f) in frames_for(&g, layer, 2.0).iter().enumerate() {
            if !(layer == 1 && i == 2) {
                raw.send_bytes(f).await;
            }
        }
    }
    raw.send(&Message::TransferDone(TransferDone {
        reservation: g.reservation,
        capability: g.capability.clone(),
        tokens_written: 10,
        first: 1.into(),
        page_checksums: checksums_for(&g, 2.0),
    }))
    .await;
    let e = p.wait().await.expect_err("refused");
    assert!(
        matches!(
            e.outcome,
            Outcome::Revoked(RevokeCause::VerificationFailed(VerifyError::Checksum {
                index: 2,
                ..
            }))
        ),
        "{e:?}"
    );
    node.assert_idle().await;
    assert_eq!(node.table.stats().ended("verification_failed"), 2);
}

/// Frames with a forged capability, a stale generation or from another
/// writer's connection are refused and counted; they never land (the
/// transfer then verifies with the true data).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_frames_are_refused_and_counted() {
    let node = Node::start(TransportKind::Tcp).await;
    let mut raw = RawWriter::connect(&node).await;
    let mut intruder = RawWriter::connect(&node).await;
    let (g, p) = node
        .table
        .reserve(Node::request(4, 0, raw.id))
        .expect("reserve");

    let mut forged = g.clone();
    forged.capability = Capability::mint().expect("rng");
    let mut stale = g.clone();
    stale.pages[0].generation -= 1;
    for bad in [&forged, &stale] {
        for f in frames_for(bad, 0, 66.0) {
            raw.send_bytes(&f).await;
        }
    }
    // The right grant, the wrong connection.
    for f in frames_for(&g, 0, 66.0) {
        intruder.send_bytes(&f).await;
    }
    wait_for("three refusals", || node.table.stats().frame_rejects == 3).await;
    let r = node.table.frame_rejects();
    assert_eq!(
        (
            r.get("bad_capability"),
            r.get("stale_generation"),
            r.get("unknown_reservation")
        ),
        (1, 1, 1)
    );
    // A transfer-done from the intruder is refused too.
    intruder
        .send(&Message::TransferDone(TransferDone {
            reservation: g.reservation,
            capability: g.capability.clone(),
            tokens_written: 4,
            first: 0.into(),
            page_checksums: checksums_for(&g, 66.0),
        }))
        .await;
    wait_for("wrong connection", || {
        node.table.stats().control_rejected("wrong_connection") == 1
    })
    .await;

    for layer in 0..N_LAYERS as u16 {
        for f in frames_for(&g, layer, 10.0) {
            raw.send_bytes(&f).await;
        }
    }
    raw.send(&Message::TransferDone(TransferDone {
        reservation: g.reservation,
        capability: g.capability.clone(),
        tokens_written: 4,
        first: 0.into(),
        page_checksums: checksums_for(&g, 10.0),
    }))
    .await;
    let live = p.wait().await.expect("verifies");
    assert_prompt(live.reservation(), 4, 10.0);
    drop(live);
    node.assert_idle().await;
    assert_eq!(node.table.pool().guard_violations(), 0);
}

/// Reserve's typed refusals; none takes a page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_refusals_take_nothing() {
    let node = Node::start(TransportKind::Tcp).await;
    let client = node.client().await;
    let w = client.writer();
    let r = |n, m, writer| node.table.reserve(Node::request(n, m, writer)).map(|_| ());
    assert!(matches!(r(0, 4, w), Err(ReserveError::EmptyPrompt)));
    assert!(matches!(
        r(30, 3, w),
        Err(ReserveError::TooLong {
            requested: 33,
            max_seq_tokens: 32,
            ..
        })
    ));
    assert!(matches!(
        r(2, 1, WriterId::mint().expect("rng")),
        Err(ReserveError::WriterNotConnected { .. })
    ));
    let (_g, _p) = node
        .table
        .reserve(Node::request(20, 0, w))
        .expect("5 pages");
    // 3 pages left; 16 tokens need 4: refused whole, nothing taken.
    assert!(matches!(
        r(12, 4, w),
        Err(ReserveError::Exhausted {
            needed_pages: 4,
            free_pages: 3
        })
    ));
    assert_eq!(node.free(), 3);
    assert_eq!(node.table.stats().refused, 4);
}

both!(many_concurrent_reservations_with_random_aborts);
async fn many_concurrent_reservations_with_random_aborts(kind: TransportKind) {
    let node = std::sync::Arc::new(Node::start(kind).await);
    let client = node.client().await;
    let mut tasks = Vec::new();
    for i in 0..40u32 {
        let (node, client) = (std::sync::Arc::clone(&node), client.clone());
        tasks.push(tokio::spawn(async move {
            let n = 1 + (i as usize * 7) % 11;
            let got = loop {
                match node.table.reserve(Node::request(n, 1, client.writer())) {
                    Ok(g) => break g,
                    Err(ReserveError::Exhausted { .. }) => {
                        tokio::time::sleep(Duration::from_millis(2)).await
                    }
                    Err(e) => panic!("{e}"),
                }
            };
            let (grant, pending) = got;
            let id = grant.reservation;
            let seed = i as f32 * 100.0;
            let mut w = client.begin(grant).expect("begin");
            let abort_at = i % 4; // 0: before writing, 1: mid, 2: after done, 3: never
            for layer in 0..N_LAYERS as u16 {
                if abort_at == u32::from(layer) {
                    let _ = node.table.abort(id, AbortReason::CLIENT_GONE);
                }
                let (k, v) = layer_kv(n, layer, seed);
                if w.write_layer(layer, &k, &v).await.is_err() {
                    break;
                }
            }
            let _ = w.finish(3).await;
            if abort_at == 2 {
                let _ = node.table.abort(id, AbortReason::CLIENT_GONE);
            }
            match pending.wait().await {
                Ok(live) => {
                    assert_prompt(live.reservation(), n, seed);
                    tokio::task::yield_now().await;
                    drop(live);
                    true
                }
                Err(e) => {
                    assert!(matches!(e.outcome, Outcome::Aborted(_)), "{e:?}");
                    false
                }
            }
        }));
    }
    let mut completed = 0;
    for t in tasks {
        completed += u64::from(t.await.expect("task"));
    }
    node.assert_idle().await;
    let s = node.table.stats();
    assert_eq!(s.granted, 40);
    assert_eq!(s.ended_total(), 40, "{s:?}");
    assert_eq!(s.ended("completed"), completed);
    assert!(
        completed >= 10,
        "the never-aborted tenth all complete: {completed}"
    );
}
