//! Every write is bounded by its own grant's pages, not by the pool: a
//! writer holding a valid key (or capability) for grant A that aims at
//! grant B's page is refused and counted, on every transport, and B then
//! verifies with its own data (issue 35, item 3).
//!
//! Each case writes B completely first, then sends A's write into B's
//! page, then finishes B: had the write landed, B's checksums would fail.

use super::*;

/// A 4-token prompt: one page each.
const PROMPT: usize = 4;

/// The end of a one-sided case, after the refused write: B's writer
/// finishes and B verifies with its own data, A is aborted, and the pool
/// is whole again.
async fn b_verifies_and_a_ends(
    node: &Node,
    wb: kvmesh_kvxfer::transport::client::GrantWriter,
    pb: kvmesh_kvxfer::handshake::Pending,
    a: &kvmesh_kvwire::Grant,
    pa: kvmesh_kvxfer::handshake::Pending,
) {
    wb.finish(1).await.expect("finish b");
    let live = pb.wait().await.expect("b verifies");
    assert_prompt(live.reservation(), PROMPT, 6.0);
    drop(live);
    node.table
        .abort(a.reservation, AbortReason::CLIENT_GONE)
        .expect("abort a");
    pa.wait().await.expect_err("a aborted");
    node.assert_idle().await;
}

/// TCP: a frame with A's reservation and capability naming B's page is
/// refused on arrival (`wrong_page`), as `Grant::check_frame` is run on
/// every frame before it lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_of_grant_a_for_grant_bs_page_is_refused_tcp() {
    let node = Node::start(TransportKind::Tcp).await;
    let mut raw = RawWriter::connect(&node).await;
    let (a, pa) = node
        .table
        .reserve(Node::request(PROMPT, 0, raw.id))
        .expect("reserve a");
    let (b, pb) = node
        .table
        .reserve(Node::request(PROMPT, 0, raw.id))
        .expect("reserve b");
    assert_ne!(a.pages[0].page, b.pages[0].page);
    for layer in 0..N_LAYERS as u16 {
        for f in frames_for(&b, layer, 6.0) {
            raw.send_bytes(&f).await;
        }
    }
    let mut cross = a.clone();
    cross.pages[0] = b.pages[0];
    for f in frames_for(&cross, 0, 5.0) {
        raw.send_bytes(&f).await;
    }
    raw.send(&Message::TransferDone(TransferDone {
        reservation: b.reservation,
        capability: b.capability.clone(),
        tokens_written: PROMPT as u64,
        first: 1.into(),
        page_checksums: checksums_for(&b, 6.0),
    }))
    .await;
    let live = pb.wait().await.expect("b verifies");
    assert_prompt(live.reservation(), PROMPT, 6.0);
    assert_eq!(node.table.frame_rejects().get("wrong_page"), 1);
    drop(live);
    node.table
        .abort(a.reservation, AbortReason::CLIENT_GONE)
        .expect("abort a");
    raw.send(&Message::AbortConfirmed(AbortConfirmed {
        reservation: a.reservation,
        // The one cross frame, refused.
        frames_sent: 1,
    }))
    .await;
    pa.wait().await.expect_err("a aborted");
    node.assert_idle().await;
}

/// Shared memory: a one-sided write with A's lane key into B's page is
/// refused by the page-owner table before anything is copied, and the
/// refusal is counted in the mapping, where the decode node reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_with_grant_as_key_into_grant_bs_page_is_refused_shm() {
    let node = Node::start(TransportKind::Shm).await;
    let client = node.client().await;
    let (a, pa) = node
        .table
        .reserve(Node::request(PROMPT, 0, client.writer()))
        .expect("reserve a");
    let (b, pb) = node
        .table
        .reserve(Node::request(PROMPT, 0, client.writer()))
        .expect("reserve b");
    let mut wb = client.begin(b.clone()).expect("begin b");
    write_layers(&mut wb, 0..N_LAYERS as u16, 6.0).await;

    let region = kvmesh_kvxfer::shm::ShmRegion::open(&node.shm_path(), None).expect("map");
    let (k, v) = layer_kv(PROMPT, 0, 5.0);
    let key_a = kvmesh_kvxfer::shm::WriteKey::from_u64(a.write_key);
    let cross = region.write_slots(
        key_a,
        b.pages[0].page,
        0,
        0,
        bytemuck::cast_slice(&k),
        bytemuck::cast_slice(&v),
    );
    assert!(
        matches!(
            cross,
            Err(kvmesh_kvxfer::shm::ShmError::OutsideGrant { page, .. }) if page == b.pages[0].page
        ),
        "A's key does not reach B's page: {cross:?}"
    );
    // A's key still writes A's own page.
    region
        .write_slots(
            key_a,
            a.pages[0].page,
            0,
            0,
            bytemuck::cast_slice(&k),
            bytemuck::cast_slice(&v),
        )
        .expect("A's key writes A's page");
    assert_eq!(
        node.table.landing().refused(),
        vec![("outside_grant", 1)],
        "counted where the decode node reports refusals"
    );

    b_verifies_and_a_ends(&node, wb, pb, &a, pa).await;
}

/// UCX (data messages: loopback has no hardware RMA lane): an endpoint
/// bound with A's key that sends data for B's page is refused by the
/// target's data handler and counted; A's key still lands in A's page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_message_with_grant_as_key_into_grant_bs_page_is_refused_ucx() {
    if let Err(e) = kvmesh_ucx::load() {
        eprintln!("not run: {e}");
        return;
    }
    let node = Node::start(TransportKind::Ucx).await;
    let client = node.client().await;
    let (a, pa) = node
        .table
        .reserve(Node::request(PROMPT, 0, client.writer()))
        .expect("reserve a");
    let (b, pb) = node
        .table
        .reserve(Node::request(PROMPT, 0, client.writer()))
        .expect("reserve b");
    let mut wb = client.begin(b.clone()).expect("begin b");
    write_layers(&mut wb, 0..N_LAYERS as u16, 6.0).await;

    let remote = node.ucx_remote();
    let rogue = kvmesh_ucx::Initiator::with_path(kvmesh_ucx::DataPath::Messages).expect("writer");
    rogue
        .bind(a.write_key, remote, Duration::from_secs(5))
        .await
        .expect("A's key binds");
    let page_bytes = (N_LAYERS * 2 * PAGE_SIZE * KV_DIM * 4) as u64;
    let junk = vec![0x5au8; PAGE_SIZE * KV_DIM * 4];
    rogue
        .put(
            a.write_key,
            u64::from(b.pages[0].page) * page_bytes,
            junk.clone(),
        )
        .await
        .expect("posted");
    rogue
        .put(a.write_key, u64::from(a.pages[0].page) * page_bytes, junk)
        .await
        .expect("posted");
    // The fence answers once both messages were handled.
    rogue.flush(a.write_key).await.expect("fenced");
    assert_eq!(
        node.table.landing().refused(),
        vec![("outside_grant", 1), ("too_many_unbound", 0)],
        "B's page refused, A's landed"
    );

    b_verifies_and_a_ends(&node, wb, pb, &a, pa).await;
}
