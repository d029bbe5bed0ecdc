use super::*;
use crate::table::Decoded;

/// Issue 35 item 6: the device write refuses a chunk that would write
/// its sequence's shared head (pages leased from the prefix cache)
/// before any value is written, with the error the CPU pool gives for
/// the same write. Host-side, so no GPU is needed: the record is set
/// before the step, and `kv_write` writes nothing for a set record.
#[test]
fn a_chunk_writing_the_shared_head_is_refused_as_the_cpu_pool_refuses_it() {
    use kvmesh_kvpool::{KvDtype, KvPool, Namespace, PageKey, PoolConfig, ScrubMode};
    let pool = KvPool::new(PoolConfig {
        page_size: 4,
        n_pages: 8,
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 2,
        entry: kvmesh_kernels::KvEntry::KeyValue,
        dtype: KvDtype::F32,
        scrub: ScrubMode::Off,
        poison: false,
    })
    .expect("pool");
    pool.set_cache_pages(8);
    let ns = Namespace::from_slice(&[1; 32]).expect("ns");
    let keys: Vec<PageKey> = (0..2u8)
        .map(|i| PageKey::from_slice(&[i + 1; 32]).expect("key"))
        .collect();
    let mut first = pool.reserve(8).expect("reserve");
    let eight = vec![1.0f32; 8 * 2];
    first.write(0, 0, &eight, &eight).expect("write");
    first.cache_as(ns, keys.clone());
    drop(first);
    let mut r = pool.reserve_cached(&ns, &keys, 12).expect("cached");
    assert_eq!(r.cached_tokens(), 8);
    let one = [9.0f32; 2];
    let cpu = r.write(0, 4, &one, &one).expect_err("the CPU pool refuses");
    let chunk = |start, rows| ChunkSpec {
        table: r.table().to_vec(),
        start,
        rows,
        cached: r.cached_tokens(),
    };
    let words = initial_records(&[chunk(4, 1), chunk(8, 1), chunk(7, 2), chunk(0, 0)]);
    let decoded: Vec<Decoded> = words
        .chunks(8)
        .map(|w| Violation::from_words(w).decode(8))
        .collect();
    let kvmesh_kvpool::PoolError::SharedPage { position, cached } = cpu else {
        panic!("{cpu:?}")
    };
    assert_eq!(decoded[0], Decoded::SharedPage { position, cached });
    assert_eq!(
        decoded[1..],
        [
            Decoded::Clean,
            Decoded::SharedPage {
                position: 7,
                cached: 8
            },
            Decoded::Clean,
        ],
        "its own page is writable; a chunk straddling the head is not; an empty one writes nothing"
    );
}

/// The device kernels decode Q4_1 and Q8_0 only; every other format
/// the CPU kernels run gets an error naming it, before any launch.
#[test]
fn formats_without_a_device_kernel_are_named() {
    for format in QFormat::ALL {
        let code = device_format_code(format);
        match format {
            QFormat::Q4_1 => assert_eq!(code, Some(0)),
            QFormat::Q8_0 => assert_eq!(code, Some(1)),
            _ => {
                assert_eq!(code, None, "{format}");
                let err = format_code("qmatvec", format)
                    .expect_err("no kernel")
                    .to_string();
                assert!(
                    err.contains(&format!("format {format} has no device qmatvec kernel")),
                    "{err}"
                );
            }
        }
    }
}
