//! After a reservation is released its old frames and writes never land:
//! a duplicate or late frame over TCP is refused and counted, and the
//! one-sided transports (shared memory, UCX) close the old grant's write
//! path, so the pages, reused at once, verify with the next reservation's
//! data only.

use super::*;

/// After release, a duplicate frame and a late frame of the old
/// reservation are refused on arrival and counted; the pages, reused at
/// once by the next reservation (the free list is LIFO), verify and read
/// back as the new reservation's data only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_and_late_frames_after_release_tcp() {
    let node = Node::start(TransportKind::Tcp).await;
    let mut raw = RawWriter::connect(&node).await;
    let (a, pa) = node
        .table
        .reserve(Node::request(8, 0, raw.id))
        .expect("reserve a");
    let frames_a: Vec<Vec<u8>> = (0..N_LAYERS as u16)
        .flat_map(|l| frames_for(&a, l, 5.0))
        .collect();
    for f in &frames_a {
        raw.send_bytes(f).await;
    }
    // A duplicate while writing lands again, identically: harmless.
    raw.send_bytes(&frames_a[0]).await;
    raw.send(&Message::TransferDone(TransferDone {
        reservation: a.reservation,
        capability: a.capability.clone(),
        tokens_written: 8,
        first: 9.into(),
        page_checksums: checksums_for(&a, 5.0),
    }))
    .await;
    drop(pa.wait().await.expect("a live"));
    wait_for("a released", || node.free() == N_PAGES).await;

    let (b, pb) = node
        .table
        .reserve(Node::request(8, 0, raw.id))
        .expect("reserve b");
    assert_eq!(
        b.pages.iter().map(|p| p.page).collect::<Vec<_>>(),
        a.pages.iter().map(|p| p.page).collect::<Vec<_>>(),
        "b reuses a's physical pages"
    );
    let rejects_before = node.table.stats().frame_rejects;
    let frames_b: Vec<Vec<u8>> = (0..N_LAYERS as u16)
        .flat_map(|l| frames_for(&b, l, 6.0))
        .collect();
    for f in &frames_b {
        raw.send_bytes(f).await;
    }
    // Late frames of a, after b's: were they to land, b's checksums would
    // fail and b would read a's data.
    for f in &frames_a {
        raw.send_bytes(f).await;
    }
    raw.send(&Message::TransferDone(TransferDone {
        reservation: b.reservation,
        capability: b.capability.clone(),
        tokens_written: 8,
        first: 9.into(),
        page_checksums: checksums_for(&b, 6.0),
    }))
    .await;
    let live = pb.wait().await.expect("b verifies");
    assert_prompt(live.reservation(), 8, 6.0);
    let s = node.table.stats();
    assert_eq!(s.frame_rejects - rejects_before, frames_a.len() as u64);
    assert_eq!(
        node.table.frame_rejects().get("unknown_reservation"),
        frames_a.len() as u64
    );
    drop(live);
    node.assert_idle().await;
}

/// The one-sided version: after release the old grant's lane is closed, so
/// a late write with its key does not land (the writer is told); the next
/// reservation on the same pages verifies with its own data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_one_sided_write_after_release_shm() {
    let node = Node::start(TransportKind::Shm).await;
    let client = node.client().await;
    let (a, pa) = node
        .table
        .reserve(Node::request(8, 0, client.writer()))
        .expect("reserve a");
    let mut w = client.begin(a.clone()).expect("begin a");
    write_layers(&mut w, 0..N_LAYERS as u16, 5.0).await;
    w.finish(1).await.expect("finish a");
    drop(pa.wait().await.expect("a live"));
    wait_for("a released", || node.free() == N_PAGES).await;

    let (b, pb) = node
        .table
        .reserve(Node::request(8, 0, client.writer()))
        .expect("reserve b");
    assert_eq!(b.pages[0].page, a.pages[0].page, "b reuses a's pages");
    let mut wb = client.begin(b).expect("begin b");
    write_layers(&mut wb, 0..N_LAYERS as u16, 6.0).await;
    // A stale writer still holding a's grant writes one-sided into the
    // mapping, as a late RDMA write would.
    let region = kvmesh_kvxfer::shm::ShmRegion::open(&node.shm_path(), None).expect("map");
    let (k, v) = layer_kv(4, 0, 5.0);
    let late = region.write_slots(
        kvmesh_kvxfer::shm::WriteKey::from_u64(a.write_key),
        a.pages[0].page,
        0,
        0,
        bytemuck::cast_slice(&k),
        bytemuck::cast_slice(&v),
    );
    assert!(
        late.is_err(),
        "the closed lane refuses the late write: {late:?}"
    );
    wb.finish(2).await.expect("finish b");
    let live = pb.wait().await.expect("b verifies");
    assert_prompt(live.reservation(), 8, 6.0);
    drop(live);
    node.assert_idle().await;
}

/// UCX: after release, a stale writer holding the old grant's key cannot
/// bind an endpoint with it (the key was revoked with its endpoint), so it
/// has no path to put through; the next reservation on the same pages
/// verifies with its own data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_one_sided_write_after_release_ucx() {
    if let Err(e) = kvmesh_ucx::load() {
        eprintln!("not run: {e}");
        return;
    }
    let node = Node::start(TransportKind::Ucx).await;
    let client = node.client().await;
    let (a, pa) = node
        .table
        .reserve(Node::request(8, 0, client.writer()))
        .expect("reserve a");
    let mut w = client.begin(a.clone()).expect("begin a");
    write_layers(&mut w, 0..N_LAYERS as u16, 5.0).await;
    w.finish(1).await.expect("finish a");
    drop(pa.wait().await.expect("a live"));
    wait_for("a released", || node.free() == N_PAGES).await;

    let (b, pb) = node
        .table
        .reserve(Node::request(8, 0, client.writer()))
        .expect("reserve b");
    assert_eq!(b.pages[0].page, a.pages[0].page, "b reuses a's pages");
    let mut wb = client.begin(b).expect("begin b");
    write_layers(&mut wb, 0..N_LAYERS as u16, 6.0).await;
    // A stale writer with a's grant: its bind is refused.
    let remote = node.ucx_remote();
    let stale = kvmesh_ucx::Initiator::start().expect("initiator");
    let late = stale
        .bind(a.write_key, remote, Duration::from_secs(5))
        .await;
    assert!(
        matches!(late, Err(kvmesh_ucx::UcxError::Closed(_))),
        "the revoked key binds no endpoint: {late:?}"
    );
    wb.finish(2).await.expect("finish b");
    let live = pb.wait().await.expect("b verifies");
    assert_prompt(live.reservation(), 8, 6.0);
    drop(live);
    node.assert_idle().await;
}
