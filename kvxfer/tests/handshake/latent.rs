//! Latent entries (multi-head latent attention) through every transport:
//! one block per layer, keys only, under the same grant, checksum and
//! watermark rules as key-value pages.

use super::common::*;
use kvmesh_kvpool::{KvDtype, KvEntry};

both!(a_latent_pool_transfer_ships_keys_only_and_goes_live);
/// A latent pool's grant says so; the writer ships one block per layer
/// (a V is refused by the writer before anything is sent), the checksums
/// match the landed keys, and the prompt reads back with an empty V,
/// readable exactly up to the prompt, in f32 and f16.
async fn a_latent_pool_transfer_ships_keys_only_and_goes_live(kind: TransportKind) {
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let cfg = pool_config_of(dtype).with_entry(KvEntry::Latent);
        let node = Node::with_pool(kind, table_config(), cfg).await;
        let client = node.client().await;
        assert_eq!(client.geometry().entry, KvEntry::Latent);
        let (grant, pending) = node
            .table
            .reserve(Node::request(10, 6, client.writer()))
            .expect("reserve");
        assert_eq!(grant.geometry.entry, KvEntry::Latent);
        let mut w = client.begin(grant).expect("begin");
        let (k, v) = layer_kv(10, 0, 2.5);
        // A V for a latent grant is refused, not sent.
        assert!(w.write_layer(0, &k, &v).await.is_err());
        for layer in 0..N_LAYERS as u16 {
            let (k, _) = layer_kv(10, layer, 2.5);
            w.write_layer(layer, &k, &[]).await.expect("keys");
        }
        let sent = w.bytes_written();
        w.finish(5).await.expect("finish");
        let live = pending.wait().await.expect("verified and live");
        // Keys only: half what a key-value transfer of the prompt sends.
        assert_eq!(sent, (N_LAYERS * 10 * KV_DIM * dtype.size()) as u64);
        let res = live.reservation();
        let reader = res.reader();
        for layer in 0..N_LAYERS {
            assert_eq!(res.written_tokens(layer), 10);
            let (k, _) = layer_kv(10, layer as u16, 2.5);
            let mut got = Vec::new();
            for (i, entry) in res.table().iter().enumerate().take(3) {
                let slots = (10 - i * PAGE_SIZE).min(PAGE_SIZE);
                let s = kvmesh_kernels::PagedKv::read_page(&reader, *entry, layer, slots)
                    .expect("verified prompt is readable");
                assert!(s.v.is_empty());
                got.extend(s.k.to_f32());
            }
            let want: Vec<f32> = match dtype {
                KvDtype::F32 => k,
                KvDtype::F16 => k.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
            };
            assert_eq!(got, want, "layer {layer}");
        }
        drop(live);
        node.assert_idle().await;
    }
}
