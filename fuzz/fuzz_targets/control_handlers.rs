//! The decode node's handlers for what writers send (frames, transfer-done,
//! abort-confirmed), fed with arbitrary messages. Frames and transfer-dones
//! are steered at a live grant (its id and capability patched in), so the
//! fuzzer reaches the landing and verification code, not only the refusal
//! at the door. Never a panic; the pool stays consistent: every page free
//! or held, none both, and after the reservation ends the pool is whole.

#![no_main]

mod common;

use std::sync::Arc;
use std::time::Duration;

use kvmesh_kvxfer::handshake::{ReservationTable, ReserveRequest, TableConfig};
use kvmesh_kvxfer::transport::tcp::TcpLanding;
use kvmesh_kvwire::{decode_message, AbortReason, Message, WriterId};
use kvmesh_kvpool::{KvPool, PoolConfig, ScrubMode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let cfg = PoolConfig {
        page_size: 4,
        n_pages: 8,
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 4,
        entry: kvmesh_kvpool::KvEntry::KeyValue,
        scrub: ScrubMode::Off,
        poison: true,
    };
    let pool = KvPool::new(cfg).expect("pool");
    let table = ReservationTable::new(
        pool.clone(),
        Arc::new(TcpLanding),
        TableConfig {
            lease: Duration::from_secs(60),
            abort_timeout: Duration::from_secs(60),
            max_seq_tokens: 32,
        },
    )
    .expect("table");
    let writer = WriterId::mint().expect("rng");
    let (tx, _rx) = tokio::sync::mpsc::channel(64);
    let conn = table.register(writer, tx, None).expect("register");
    let (grant, pending) = table
        .reserve(ReserveRequest {
            prompt_tokens: 10,
            max_new_tokens: 2,
            writer,
            cached: None,
        })
        .expect("reserve");

    for chunk in common::chunks(data) {
        let Some(bytes) = common::reseal(chunk) else {
            continue;
        };
        let Ok((msg, _)) = decode_message(&bytes) else {
            continue;
        };
        match msg {
            Message::KvFrame(mut f) => {
                f.reservation = grant.reservation;
                f.capability = grant.capability.clone();
                let _ = table.land_frame(conn, &f);
            }
            Message::TransferDone(mut d) => {
                d.reservation = grant.reservation;
                d.capability = grant.capability.clone();
                let _ = table.transfer_done(conn, &d);
            }
            Message::AbortConfirmed(mut c) => {
                c.reservation = grant.reservation;
                let _ = table.abort_confirmed(conn, &c);
            }
            Message::Abort(a) => {
                let _ = table.abort(grant.reservation, a.reason);
            }
            _ => {}
        }
        let s = pool.stats();
        assert!(s.free_pages <= s.capacity_pages);
    }
    // End it whichever way it stands, then the pool must be whole.
    let _ = table.abort(grant.reservation, AbortReason::CANCELLED);
    drop(pending);
    table.connection_lost(conn);
    assert_eq!(pool.free_pages(), pool.capacity_pages());
    assert_eq!(table.stats().open, 0);
    assert_eq!(table.stats().ended_total(), 1);
});
