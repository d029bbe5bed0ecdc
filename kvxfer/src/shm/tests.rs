//! Tests of the mapping, its header, the lane protocol and the peer watcher.
#![allow(clippy::unwrap_used)]

use super::*;
use kvmesh_kvpool::PoolMemory;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::time::{Duration, Instant};

const L: ShmLayout = ShmLayout {
    page_size: 4,
    n_layers: 2,
    n_kv_heads: 2,
    head_dim: 3,
    dtype: kvmesh_kernels::KvDtype::F32,
    entry: kvmesh_kernels::KvEntry::KeyValue,
    n_pages: 5,
    n_lanes: 8,
};
const KV: usize = 6;

/// Float offset of the K value of (page, layer, slot); V is `block` on.
fn k_at(page: usize, layer: usize, slot: usize) -> usize {
    page * L.page_values().unwrap() + layer * 2 * 4 * KV + slot * KV
}

fn read(r: &ShmRegion, off: usize) -> f32 {
    let l = r.layout();
    assert!(off < l.n_pages as usize * l.page_values().unwrap());
    // SAFETY: in bounds (asserted); volatile because other threads or
    // mappings write here, and the test wants the value in memory now.
    unsafe { r.data_ptr().as_ptr().cast::<f32>().add(off).read_volatile() }
}

/// Values as `write_slots` takes them (an f32 region's encoding).
fn le(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

fn slots(n: usize, base: f32) -> (Vec<f32>, Vec<f32>) {
    let k: Vec<f32> = (0..n * KV).map(|i| base + i as f32).collect();
    let v = k.iter().map(|x| -x).collect();
    (k, v)
}

#[test]
fn sizes_and_key() {
    assert_eq!(L.page_values(), Some(2 * 2 * 4 * 6));
    // Lanes end at 4096 + 8 * 64, owners at + 5 * 8: still below 8192.
    assert_eq!(L.data_offset(), Some(8192));
    assert_eq!(L.total_len(), Some(8192 + 5 * 96 * 4));
    assert_eq!(ShmLayout { head_dim: 0, ..L }.total_len(), None);
    assert_eq!(
        ShmLayout {
            n_pages: u64::MAX,
            ..L
        }
        .total_len(),
        None
    );
    let key = WriteKey {
        lane: 7,
        epoch: 0xdead_beef,
    };
    assert_eq!(WriteKey::from_u64(key.to_u64()), key);
    let d = tempfile::tempdir().unwrap();
    let e = ShmRegion::create(
        d.path(),
        ShmLayout {
            n_pages: u64::MAX,
            ..L
        },
    )
    .unwrap_err();
    assert_eq!(e.kind(), "too_large");
    let e = ShmRegion::create(d.path(), ShmLayout { n_lanes: 0, ..L }).unwrap_err();
    assert_eq!(e.kind(), "bad_header");
    fn send_sync<T: Send + Sync>() {}
    send_sync::<ShmRegion>();
}

#[test]
fn create_open_round_trip_both_ways() {
    let d = tempfile::tempdir().unwrap();
    let a = ShmRegion::create(d.path(), L).unwrap();
    let name = a.path().file_name().unwrap().to_str().unwrap().to_owned();
    let pid = std::process::id().to_string();
    assert!(
        name.starts_with(&format!("kvmesh-pool-{pid}-"))
            && name.ends_with(".shm")
            && name.len() == 12 + pid.len() + 1 + 32 + 4,
        "{name}"
    );
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(a.path()).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o600, "owner-only");
    let b = ShmRegion::open(a.path(), Some(&L)).unwrap();
    assert_eq!(*b.layout(), L);

    let key = a.lane_open(3, &[4, 0]).unwrap();
    let (k, v) = slots(2, 1.0);
    a.write_slots(key, 4, 1, 2, le(&k), le(&v)).unwrap();
    let off = k_at(4, 1, 2);
    assert_eq!(read(&b, off), 1.0);
    assert_eq!(read(&b, off + 2 * KV - 1), 12.0);
    assert_eq!(read(&b, off + 4 * KV), -1.0);

    // The opener writes, the creator reads; both see one lane state.
    let (k, v) = slots(1, 100.0);
    b.write_slots(key, 0, 0, 0, le(&k), le(&v)).unwrap();
    assert_eq!(read(&a, 0), 100.0);
    assert_eq!(read(&a, 4 * KV), -100.0);
    assert_eq!(b.lane_close(key).unwrap(), LaneClose::Drained);
    assert_eq!(
        a.write_slots(key, 0, 0, 0, le(&k), le(&v))
            .unwrap_err()
            .kind(),
        "lane_closed"
    );

    // The creator unlinks on drop; the opener's mapping stays usable.
    let path = a.path().to_owned();
    drop(a);
    assert!(!path.exists());
    let key = b.lane_open(3, &[1]).unwrap();
    b.write_slots(key, 1, 0, 0, le(&k), le(&v)).unwrap();
    assert_eq!(read(&b, k_at(1, 0, 0)), 100.0);
}

#[test]
fn corrupt_headers_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let a = ShmRegion::create(d.path(), L).unwrap();
    let total = L.total_len().unwrap() as u64;
    let corrupt = |name: &str, f: &dyn Fn(&File)| {
        let p = d.path().join(name);
        std::fs::copy(a.path(), &p).unwrap();
        f(&OpenOptions::new().write(true).open(&p).unwrap());
        let e = ShmRegion::open(&p, None).unwrap_err();
        assert_eq!(e.kind(), "bad_header", "{name}: {e}");
        e.to_string()
    };
    let at = |off: u64, bytes: &[u8]| {
        let bytes = bytes.to_vec();
        move |f: &File| f.write_all_at(&bytes, off).unwrap()
    };
    assert!(corrupt("magic", &at(0, b"X")).contains("magic"));
    // Versions 1 (no page owners) and 2 (no entry code) are refused, as is
    // any other.
    assert!(corrupt("version", &at(8, &1u32.to_le_bytes())).contains("version"));
    assert!(corrupt("version2", &at(8, &2u32.to_le_bytes())).contains("version"));
    assert!(corrupt("version4", &at(8, &4u32.to_le_bytes())).contains("version"));
    assert!(corrupt("entry", &at(72, &2u32.to_le_bytes())).contains("entry"));
    assert!(corrupt("zero", &at(12, &0u32.to_le_bytes())).contains("page_size is 0"));
    assert!(corrupt("dtype", &at(28, &2u32.to_le_bytes())).contains("dtype"));
    // A latent entry halves the page: the stated sizes no longer add up.
    assert!(corrupt("latent", &at(72, &1u32.to_le_bytes())).contains("total_len"));
    assert!(corrupt("pages", &at(32, &6u64.to_le_bytes())).contains("total_len"));
    assert!(corrupt("lanes", &at(40, &u64::MAX.to_le_bytes())).contains("n_lanes"));
    assert!(corrupt("data_off", &at(56, &4160u64.to_le_bytes())).contains("data_offset"));
    assert!(corrupt("trunc", &|f: &File| f.set_len(total - 4).unwrap()).contains("file length"));
    assert!(corrupt("tiny", &|f: &File| f.set_len(10).unwrap()).contains("shorter"));

    let other = ShmLayout { n_layers: 3, ..L };
    match ShmRegion::open(a.path(), Some(&other)).unwrap_err() {
        ShmError::LayoutMismatch { expected, found } => {
            assert_eq!((expected, found), (other, L))
        }
        e => panic!("{e}"),
    }
    assert_eq!(
        ShmRegion::open(&d.path().join("none"), None)
            .unwrap_err()
            .kind(),
        "io"
    );
}

#[test]
fn lane_protocol() {
    let d = tempfile::tempdir().unwrap();
    let r = ShmRegion::create(d.path(), L).unwrap();
    let key = r.lane_open(2, &[1]).unwrap();
    assert_eq!(key, WriteKey { lane: 2, epoch: 1 });
    assert_eq!(r.lane_open(2, &[1]).unwrap_err().kind(), "lane_busy");
    let (k, v) = slots(1, 5.0);
    r.write_slots(key, 1, 0, 3, le(&k), le(&v)).unwrap();
    assert_eq!(r.lane_close(key).unwrap(), LaneClose::Drained);
    assert_eq!(r.lane_close(key).unwrap(), LaneClose::Drained, "idempotent");

    let (k2, v2) = slots(1, 9.0);
    match r.write_slots(key, 1, 0, 3, le(&k2), le(&v2)).unwrap_err() {
        ShmError::LaneClosed {
            lane: 2,
            key_epoch: 1,
            lane_epoch: 2,
        } => {}
        e => panic!("{e}"),
    }
    assert_eq!(
        read(&r, k_at(1, 0, 3)),
        5.0,
        "a refused write wrote nothing"
    );

    let key2 = r.lane_open(2, &[1]).unwrap();
    assert_eq!(key2.epoch, 3);
    assert_eq!(
        r.write_slots(key, 1, 0, 3, le(&k2), le(&v2))
            .unwrap_err()
            .kind(),
        "lane_closed"
    );
    assert_eq!(r.lane_close(key).unwrap(), LaneClose::Drained, "moved on");
    assert_eq!(r.lane_close(key2).unwrap(), LaneClose::Drained);
    // A forged even key matching the closed epoch, or a future one, never works.
    let even = WriteKey { lane: 2, epoch: 4 };
    assert_eq!(
        r.write_slots(even, 1, 0, 3, le(&k2), le(&v2))
            .unwrap_err()
            .kind(),
        "lane_closed"
    );
    assert_eq!(r.lane_close(even).unwrap_err().kind(), "lane_closed");
    assert_eq!(
        r.lane_close(WriteKey { lane: 2, epoch: 9 })
            .unwrap_err()
            .kind(),
        "lane_closed"
    );
    assert_eq!(read(&r, k_at(1, 0, 3)), 5.0);

    // A writer inside (simulated, as a dead process would leave it):
    // close says Busy, open refuses, force reset frees the lane.
    let key3 = r.lane_open(5, &[0]).unwrap();
    r.lane(5).unwrap().active.fetch_add(1, Ordering::SeqCst);
    assert_eq!(
        r.lane_force_reset(5).unwrap_err().kind(),
        "lane_busy",
        "open lane"
    );
    assert_eq!(r.lane_close(key3).unwrap(), LaneClose::Busy { active: 1 });
    assert_eq!(r.lane_open(5, &[0]).unwrap_err().kind(), "lane_busy");
    r.lane_force_reset(5).unwrap();
    assert_eq!(r.lane_close(key3).unwrap(), LaneClose::Drained);
    assert_eq!(r.lane_open(5, &[0]).unwrap().epoch, 3);
}

#[test]
fn bad_arguments_are_typed_and_write_nothing() {
    let d = tempfile::tempdir().unwrap();
    let r = ShmRegion::create(d.path(), L).unwrap();
    let key = r.lane_open(0, &[0]).unwrap();
    let (k, v) = slots(1, 7.0);
    let (k2, v2) = slots(2, 7.0);
    let kind = |e: ShmError| e.kind();
    assert_eq!(kind(r.lane_open(8, &[0]).unwrap_err()), "lane_out_of_range");
    assert_eq!(kind(r.lane_open(1, &[5]).unwrap_err()), "out_of_bounds");
    assert_eq!(
        kind(r.lane_close(WriteKey { lane: 8, epoch: 1 }).unwrap_err()),
        "lane_out_of_range"
    );
    assert_eq!(
        kind(r.lane_force_reset(u32::MAX).unwrap_err()),
        "lane_out_of_range"
    );
    let far = WriteKey { lane: 9, epoch: 1 };
    assert_eq!(
        kind(r.write_slots(far, 0, 0, 0, le(&k), le(&v)).unwrap_err()),
        "lane_out_of_range"
    );
    match r.write_slots(key, 5, 0, 0, le(&k), le(&v)).unwrap_err() {
        ShmError::OutOfBounds {
            what: "page",
            value: 5,
            limit: 5,
        } => {}
        e => panic!("{e}"),
    }
    match r.write_slots(key, 0, 2, 0, le(&k), le(&v)).unwrap_err() {
        ShmError::OutOfBounds {
            what: "layer",
            value: 2,
            limit: 2,
        } => {}
        e => panic!("{e}"),
    }
    match r.write_slots(key, 0, 0, 3, le(&k2), le(&v2)).unwrap_err() {
        ShmError::OutOfBounds {
            what: "slot_end",
            value: 5,
            limit: 4,
        } => {}
        e => panic!("{e}"),
    }
    assert_eq!(
        kind(
            r.write_slots(key, 0, 0, u32::MAX, le(&k), le(&v))
                .unwrap_err()
        ),
        "out_of_bounds"
    );
    match r.write_slots(key, 0, 0, 0, le(&k2), le(&v)).unwrap_err() {
        ShmError::BadLength {
            expected: 12,
            got: 6,
        } => {}
        e => panic!("{e}"),
    }
    match r
        .write_slots(key, 0, 0, 0, le(&k2[..8]), le(&v2[..8]))
        .unwrap_err()
    {
        ShmError::BadLength {
            expected: 6,
            got: 8,
        } => {}
        e => panic!("{e}"),
    }
    let all = L.n_pages as usize * L.page_values().unwrap();
    assert!((0..all).all(|i| read(&r, i) == 0.0), "nothing was written");
    // No failed call left a writer inside.
    assert_eq!(r.lane_close(key).unwrap(), LaneClose::Drained);
}

/// Writers hammer one key while the main thread closes its lane: every
/// write that returned Ok landed whole before `Drained`, and nothing
/// lands after it. Each writer fills a whole page (128 KiB of K and of
/// V per call), so a write still copying at `Drained` would show as a
/// torn page or a later change.
#[test]
fn no_write_lands_after_drained() {
    const WRITERS: usize = 3;
    let big = ShmLayout {
        page_size: 256,
        n_layers: 1,
        n_kv_heads: 4,
        head_dim: 32,
        dtype: kvmesh_kernels::KvDtype::F32,
        entry: kvmesh_kernels::KvEntry::KeyValue,
        n_pages: WRITERS as u64,
        n_lanes: 2,
    };
    let block = 256 * 128;
    let d = tempfile::tempdir().unwrap();
    let r = ShmRegion::create(d.path(), big).unwrap();
    let pages: Vec<u32> = (0..WRITERS as u32).collect();
    let key = r.lane_open(1, &pages).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let started = Arc::new(AtomicU32::new(0));
    let handles: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (r, stop, started) = (r.clone(), stop.clone(), started.clone());
            std::thread::spawn(move || {
                // Counter values as f32 bits, compared as bits: no
                // rounding however many writes happen.
                let (mut c, mut last_ok, mut refused) = (0u32, 0u32, 0u64);
                let mut kv = vec![0f32; block];
                // Stop only after a refusal, so each writer has also
                // run into the closed lane.
                while !(stop.load(Ordering::Relaxed) && refused > 0) {
                    c += 1;
                    kv.fill(f32::from_bits(c));
                    match r.write_slots(key, w as u32, 0, 0, le(&kv), le(&kv)) {
                        Ok(()) if last_ok == 0 => {
                            last_ok = c;
                            started.fetch_add(1, Ordering::SeqCst);
                        }
                        Ok(()) => last_ok = c,
                        Err(ShmError::LaneClosed { .. }) => refused += 1,
                        Err(e) => panic!("{e}"),
                    }
                }
                last_ok
            })
        })
        .collect();
    while started.load(Ordering::SeqCst) < WRITERS as u32 {
        std::thread::yield_now();
    }
    std::thread::sleep(Duration::from_millis(5));
    while r.lane_close(key).unwrap() != LaneClose::Drained {
        std::thread::yield_now();
    }
    // The whole page (K and V) of each writer, as bits.
    let page = |w: usize| -> Vec<u32> {
        (0..2 * block)
            .map(|i| read(&r, w * 2 * block + i).to_bits())
            .collect()
    };
    let seen: Vec<Vec<u32>> = (0..WRITERS).map(page).collect();
    for (w, p) in seen.iter().enumerate() {
        assert!(
            p.iter().all(|&x| x == p[0]),
            "writer {w}: torn page at Drained"
        );
    }
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(50) {
        for (w, p) in seen.iter().enumerate() {
            let now = read(
                &r,
                w * 2 * block + (t.elapsed().as_micros() as usize % (2 * block)),
            );
            assert_eq!(
                now.to_bits(),
                p[0],
                "writer {w} landed a write after Drained"
            );
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::Relaxed);
    for (w, h) in handles.into_iter().enumerate() {
        let last_ok = h.join().unwrap();
        assert_eq!(
            seen[w][0], last_ok,
            "writer {w}: the last accepted write is the one in memory"
        );
        assert_eq!(
            page(w),
            seen[w],
            "writer {w}: the page changed after Drained"
        );
    }
    assert_eq!(r.lane(1).unwrap().active.load(Ordering::SeqCst), 0);
}

#[test]
fn peer_process_exit_is_seen() {
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let peer = PeerProcess::from_pid(child.id() as i32).unwrap();
    assert_eq!(peer.pid(), child.id() as i32);
    assert!(!peer.has_exited());
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(peer.has_exited());
    assert_eq!(
        PeerProcess::from_pid(0).unwrap_err().kind(),
        io::ErrorKind::InvalidInput
    );
    assert_eq!(
        PeerProcess::from_pid(-3).unwrap_err().kind(),
        io::ErrorKind::InvalidInput
    );
}

/// Issue 35 item 3: a key writes its own grant's pages only. Another
/// grant's page (or a page no grant holds) is refused before anything is
/// copied, and counted in the mapping, where every process sees the count.
#[test]
fn a_key_writes_only_its_grants_pages() {
    let d = tempfile::tempdir().unwrap();
    let r = ShmRegion::create(d.path(), L).unwrap();
    let other = ShmRegion::open(r.path(), Some(&L)).unwrap();
    let a = r.lane_open(0, &[1, 2]).unwrap();
    let b = r.lane_open(1, &[3]).unwrap();
    let (k, v) = slots(1, 4.0);
    for (key, page) in [(a, 3), (a, 0), (b, 1), (b, 4)] {
        match other.write_slots(key, page, 0, 0, le(&k), le(&v)) {
            Err(ShmError::OutsideGrant {
                page: p,
                lane,
                epoch,
            }) => assert_eq!((p, lane, epoch), (page, key.lane, key.epoch)),
            e => panic!("key {key:?} page {page}: {e:?}"),
        }
    }
    assert_eq!(r.refused_outside_grant(), 4);
    let all = L.n_pages as usize * L.page_values().unwrap();
    assert!((0..all).all(|i| read(&r, i) == 0.0), "nothing was written");
    // The grants' own pages take their writes.
    other.write_slots(a, 2, 1, 0, le(&k), le(&v)).unwrap();
    other.write_slots(b, 3, 0, 0, le(&k), le(&v)).unwrap();
    assert_eq!(
        (read(&r, k_at(2, 1, 0)), read(&r, k_at(3, 0, 0))),
        (4.0, 4.0)
    );
    // Page 3 passes to a's lane's next grant once b's lane is drained:
    // b's key reaches it no more (its lane is closed), a's new key does.
    assert_eq!(r.lane_close(b).unwrap(), LaneClose::Drained);
    assert_eq!(r.lane_close(a).unwrap(), LaneClose::Drained);
    let a2 = r.lane_open(0, &[3]).unwrap();
    assert_eq!(
        other
            .write_slots(a2, 1, 0, 0, le(&k), le(&v))
            .unwrap_err()
            .kind(),
        "outside_grant"
    );
    other.write_slots(a2, 3, 0, 0, le(&k), le(&v)).unwrap();
    assert_eq!(other.refused_outside_grant(), 5);
    // No refusal left a writer inside.
    assert_eq!(r.lane_close(a2).unwrap(), LaneClose::Drained);
}

/// Issue 35 item 6: a force reset while a live writer with a stale key is
/// inside the lane (between its entry and its refusal) does not wedge the
/// lane, and the count stays exact for the lane's next grant.
#[test]
fn a_force_reset_with_a_refused_writer_inside_leaves_the_lane_usable() {
    let d = tempfile::tempdir().unwrap();
    let r = ShmRegion::create(d.path(), L).unwrap();
    let key = r.lane_open(5, &[0]).unwrap();
    // The grant's writer dies inside a write.
    std::mem::forget(r.lane(5).unwrap().enter());
    assert_eq!(r.lane_close(key).unwrap(), LaneClose::Busy { active: 1 });
    // A live writer with a stale key of this lane has entered (W1) and is
    // about to be refused when the dead writer's lane is reset.
    let stale = r.lane(5).unwrap().enter();
    r.lane_force_reset(5).unwrap();
    drop(stale);
    let next = r.lane_open(5, &[0]).expect("the lane is not wedged");
    let inside = r.lane(5).unwrap().enter();
    assert_eq!(r.lane_close(next).unwrap(), LaneClose::Busy { active: 1 });
    drop(inside);
    assert_eq!(r.lane_close(next).unwrap(), LaneClose::Drained);
    // A reset with nobody inside but the refused entrant, twice over.
    let third = r.lane_open(5, &[0]).unwrap();
    assert_eq!(r.lane_close(third).unwrap(), LaneClose::Drained);
    let a = r.lane(5).unwrap().enter();
    r.lane_force_reset(5).unwrap();
    let b = r.lane(5).unwrap().enter();
    r.lane_force_reset(5).unwrap();
    drop((a, b));
    assert_eq!(r.lane_open(5, &[0]).unwrap().epoch, 7);
}

/// The cost of the lane and owner checks: a one-slot write (24 bytes of K
/// and of V) is all overhead. Timing, so run by hand:
/// `cargo test -p kvmesh-kvxfer --lib shm::tests::small_write_cost -- --ignored --nocapture`.
#[test]
#[ignore = "timing; run by hand"]
fn small_write_cost() {
    let d = tempfile::tempdir().unwrap();
    let r = ShmRegion::create(d.path(), L).unwrap();
    let key = r.lane_open(0, &[1]).unwrap();
    let (k, v) = slots(1, 1.0);
    for round in 0..5 {
        let n = 1_000_000;
        let t = Instant::now();
        for _ in 0..n {
            r.write_slots(key, 1, 0, 0, le(&k), le(&v)).unwrap();
        }
        eprintln!(
            "round {round}: {:.1} ns per write",
            t.elapsed().as_nanos() as f64 / f64::from(n)
        );
    }
}
