//! The device KV pool: the checked KV write and paged attention against the
//! CPU pool, forged tables and unwritten slots, staging, and what the
//! checks cost.

use std::sync::Arc;

use kvmesh_cuda::gpu::Gpu;
use kvmesh_cuda::ops::{ChunkSpec, StepTables};
use kvmesh_cuda::pool::{AttentionCall, DeviceKvPool};
use kvmesh_cuda::table::Decoded;
use kvmesh_kernels::{paged_attention, AttentionShape, GuardViolation, KvDtype, PageRef};
use kvmesh_kvpool::{KvPool, PoolConfig, Reservation};
use rand::rngs::StdRng;

use super::{close, gpu, poisoned, random, rng};

const N_HEADS: usize = 8;
const N_KV: usize = 2;
const HD: usize = 64;

fn pool_cfg(dtype: KvDtype) -> PoolConfig {
    PoolConfig::for_tokens(64 * 16, 16, 2, N_KV, HD).with_dtype(dtype)
}

fn host_pool(cfg: PoolConfig) -> KvPool {
    KvPool::new(cfg).expect("host pool")
}

fn shape(window: Option<usize>) -> AttentionShape {
    AttentionShape {
        n_heads: N_HEADS,
        n_kv_heads: N_KV,
        head_dim: HD,
        v_dim: HD,
        scale: 1.0 / (HD as f32).sqrt(),
        window,
        softcap: None,
        sinks: None,
    }
}

fn call(layer: usize, window: Option<usize>, checked: bool) -> AttentionCall {
    AttentionCall {
        layer,
        n_heads: N_HEADS,
        n_kv_heads: N_KV,
        head_dim: HD,
        scale: 1.0 / (HD as f32).sqrt(),
        window: window.unwrap_or(0),
        checked,
    }
}

/// One step on both sides: each chunk's K/V written at every layer (the
/// device through `kv_write`, the host through `Reservation::write`), then
/// attention at `layer`. Returns (device output, CPU output).
fn step_both(
    gpu: &Arc<Gpu>,
    dev: &mut DeviceKvPool,
    seqs: &mut [&mut Reservation],
    chunks: &[(usize, usize)],
    window: Option<usize>,
    rng: &mut StdRng,
) -> (Vec<f32>, Vec<f32>) {
    let kv_dim = N_KV * HD;
    let width = N_HEADS * HD;
    let n_rows: usize = chunks.iter().map(|c| c.1).sum();
    let specs: Vec<ChunkSpec> = seqs
        .iter()
        .zip(chunks)
        .map(|(r, &(start, rows))| ChunkSpec {
            table: r.table().to_vec(),
            start,
            rows,
            cached: 0,
        })
        .collect();
    dev.apply_events().expect("events");
    let mut tables = StepTables::new(gpu, &specs).expect("tables");
    let q = random(rng, n_rows * width);
    let dq = gpu.upload(&q).expect("q");
    let mut out = poisoned(gpu, n_rows * width);
    let mut want = vec![0f32; n_rows * width];
    for layer in 0..2 {
        let (k, v) = (random(rng, n_rows * kv_dim), random(rng, n_rows * kv_dim));
        dev.write_kv(
            layer,
            &gpu.upload(&k).expect("k"),
            &gpu.upload(&v).expect("v"),
            &mut tables,
        )
        .expect("kv_write");
        let mut row = 0;
        for (r, &(start, rows)) in seqs.iter_mut().zip(chunks) {
            r.write(
                layer,
                start,
                &k[row * kv_dim..(row + rows) * kv_dim],
                &v[row * kv_dim..(row + rows) * kv_dim],
            )
            .expect("host write");
            row += rows;
        }
    }
    let layer = 1;
    dev.attention(call(layer, window, true), &dq, &mut tables, &mut out)
        .expect("attention");
    let mut row = 0;
    for (r, &(start, rows)) in seqs.iter().zip(chunks) {
        let positions: Vec<usize> = (start..start + rows).collect();
        paged_attention(
            &r.reader(),
            r.table(),
            layer,
            &shape(window),
            &q[row * width..(row + rows) * width],
            &positions,
            &mut want[row * width..(row + rows) * width],
        )
        .expect("cpu attention");
        row += rows;
    }
    for (i, v) in tables.violations(gpu).expect("records").iter().enumerate() {
        assert_eq!(
            v.decode(dev.config().n_pages as u32),
            Decoded::Clean,
            "chunk {i}"
        );
    }
    (gpu.download(&out).expect("dl"), want)
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn paged_attention_and_kv_write_match_the_cpu_pool() {
    let Some(gpu) = gpu() else { return };
    let mut rng = rng();
    for (dtype, bound) in [(KvDtype::F32, 1e-5), (KvDtype::F16, 1e-3)] {
        for window in [None, Some(19)] {
            let mut dev = DeviceKvPool::new(gpu.clone(), host_pool(pool_cfg(dtype))).expect("pool");
            let host = dev.host().clone();
            let lens = [37usize, 5, 70];
            let mut rs: Vec<Reservation> = lens
                .iter()
                .map(|&n| host.reserve(n + 4).expect("reserve"))
                .collect();
            // Prefill (whole prompts), then four decode steps of a token
            // each.
            let steps = std::iter::once(lens.map(|n| (0, n)))
                .chain((0..4).map(|s| lens.map(|n| (n + s, 1))));
            for (i, chunks) in steps.enumerate() {
                let (got, want) = step_both(
                    &gpu,
                    &mut dev,
                    &mut rs.iter_mut().collect::<Vec<_>>(),
                    &chunks,
                    window,
                    &mut rng,
                );
                let what = if i == 0 {
                    "prefill".to_owned()
                } else {
                    format!("decode step {i}")
                };
                close(
                    &format!("attention {what} {} window {window:?}", dtype.name()),
                    &got,
                    &want,
                    bound,
                );
            }
            // The device's watermarks are the host's.
            let marks = dev.watermarks().expect("marks");
            for r in &rs {
                for (i, e) in r.table().iter().enumerate() {
                    for layer in 0..2 {
                        let want = (r.written_tokens(layer).saturating_sub(i * 16)).min(16) as u32;
                        assert_eq!(
                            marks[e.page as usize * 2 + layer],
                            want,
                            "page {} layer {layer}",
                            e.page
                        );
                    }
                }
            }
        }
    }
}

/// Attention over `table` at `positions` (one chunk) on the device:
/// the chunk's decoded record and its output.
fn device_read(
    gpu: &Arc<Gpu>,
    dev: &mut DeviceKvPool,
    table: Vec<PageRef>,
    start: usize,
    rows: usize,
) -> (Decoded, Vec<f32>) {
    dev.apply_events().expect("events");
    let mut tables = StepTables::new(
        gpu,
        &[ChunkSpec {
            table,
            start,
            rows,
            cached: 0,
        }],
    )
    .expect("tables");
    let q = gpu.upload(&vec![0.5f32; rows * N_HEADS * HD]).expect("q");
    let mut out = poisoned(gpu, rows * N_HEADS * HD);
    dev.attention(call(0, None, true), &q, &mut tables, &mut out)
        .expect("launch");
    let v = tables.violations(gpu).expect("records")[0];
    (
        v.decode(dev.config().n_pages as u32),
        gpu.download(&out).expect("dl"),
    )
}

fn cpu_read(r: &Reservation, table: &[PageRef], start: usize, rows: usize) -> GuardViolation {
    let mut out = vec![0f32; rows * N_HEADS * HD];
    let positions: Vec<usize> = (start..start + rows).collect();
    paged_attention(
        &r.reader(),
        table,
        0,
        &shape(None),
        &vec![0.5f32; rows * N_HEADS * HD],
        &positions,
        &mut out,
    )
    .expect_err("the CPU pool refuses it too")
}

/// The device names the same kind of failure, on the same page, as the
/// CPU pool. (Rows and pages are checked in parallel on the device, so the
/// record is the first failure any thread saw: when several rows or pages
/// fail, the position or page may be another failing one than the CPU's
/// first; the callers here forge exactly one failing page.)
fn same_failure(device: &Decoded, cpu: &GuardViolation) {
    let Decoded::Guard(d) = device else {
        panic!("device: {device:?}, cpu: {cpu:?}")
    };
    assert_eq!(d.kind(), cpu.kind(), "device {d:?} cpu {cpu:?}");
    let page = |v: &GuardViolation| match *v {
        GuardViolation::StaleGeneration {
            page,
            expected,
            actual,
        } => Some((page, expected, actual)),
        GuardViolation::Unwritten {
            page, watermark, ..
        } => Some((page, watermark as u64, 0)),
        GuardViolation::TableTooShort { needed, len, .. } => Some((needed as u32, len as u64, 0)),
        _ => None,
    };
    assert_eq!(page(d), page(cpu), "device {d:?} cpu {cpu:?}");
}

/// Rows `from..` of a step's output are zeros: a refused row never
/// carries values read from a page it failed the check for.
fn zeros_from(out: &[f32], from: usize) -> bool {
    out[from * N_HEADS * HD..].iter().all(|v| *v == 0.0)
}

fn write_all(dev: &mut DeviceKvPool, gpu: &Arc<Gpu>, r: &mut Reservation, n: usize) {
    let kv = vec![0.25f32; n * N_KV * HD];
    dev.apply_events().expect("events");
    let mut t = StepTables::new(
        gpu,
        &[ChunkSpec {
            table: r.table().to_vec(),
            start: 0,
            rows: n,
            cached: 0,
        }],
    )
    .expect("tables");
    let dkv = gpu.upload(&kv).expect("kv");
    for layer in 0..2 {
        dev.write_kv(layer, &dkv, &dkv, &mut t).expect("write");
        r.write(layer, 0, &kv, &kv).expect("host write");
    }
    assert_eq!(t.violations(gpu).expect("records")[0].kind, 0);
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn forged_tables_and_unwritten_slots_are_caught_on_the_device() {
    let Some(gpu) = gpu() else { return };
    let mut dev = DeviceKvPool::new(
        gpu.clone(),
        host_pool(PoolConfig {
            poison: true,
            ..pool_cfg(KvDtype::F32)
        }),
    )
    .expect("pool");
    let host = dev.host().clone();
    let n_pages = dev.config().n_pages as u32;
    let mut a = host.reserve(40).expect("a");
    write_all(&mut dev, &gpu, &mut a, 40);

    // A stale entry: b's pages released and handed to c.
    // (One page, so that exactly one entry is stale.)
    let mut b = host.reserve(16).expect("b");
    write_all(&mut dev, &gpu, &mut b, 16);
    let stale = b.table().to_vec();
    drop(b);
    let mut c = host.reserve(16).expect("c");
    assert_eq!(
        c.table()[0].page,
        stale[0].page,
        "the free list hands the page straight back"
    );
    write_all(&mut dev, &gpu, &mut c, 16);
    let (got, out) = device_read(&gpu, &mut dev, stale.clone(), 0, 16);
    let cpu = cpu_read(&c, &stale, 0, 16);
    println!("stale table:     device {got:?}\n                 cpu    {cpu:?}");
    assert_eq!(
        got,
        Decoded::Guard(cpu),
        "stale generation, as the CPU pool says it"
    );
    assert!(
        zeros_from(&out, 0),
        "a refused chunk's output is zeros, never another tenant's values"
    );

    // A page past the pool.
    let mut forged = a.table().to_vec();
    forged[1] = PageRef {
        page: n_pages + 5,
        generation: forged[1].generation,
    };
    let (got, out) = device_read(&gpu, &mut dev, forged.clone(), 0, 40);
    println!("page out of range: device {got:?}");
    assert_eq!(
        got,
        Decoded::Guard(GuardViolation::PageOutOfRange {
            page: n_pages + 5,
            n_pages
        })
    );
    assert!(zeros_from(&out, 16), "rows that need the forged page");

    // Another tenant's page under a's own generation number.
    let mut forged = a.table().to_vec();
    forged[0] = PageRef {
        page: c.table()[0].page,
        generation: forged[0].generation,
    };
    let (got, out) = device_read(&gpu, &mut dev, forged, 0, 40);
    println!("foreign page:    device {got:?}");
    assert!(
        matches!(got, Decoded::Guard(GuardViolation::StaleGeneration { .. })),
        "{got:?}"
    );
    assert!(zeros_from(&out, 0));

    // A table one page short.
    let short = a.table()[..2].to_vec();
    let (got, out) = device_read(&gpu, &mut dev, short.clone(), 0, 40);
    let cpu = cpu_read(&a, &short, 0, 40);
    println!("short table:     device {got:?}\n                 cpu    {cpu:?}");
    same_failure(&got, &cpu);
    assert!(zeros_from(&out, 32), "rows past the table");

    // Slots never written: position 40 of a (40 written).
    let mut more = host.reserve(50).expect("more");
    write_all(&mut dev, &gpu, &mut more, 40);
    let (got, out) = device_read(&gpu, &mut dev, more.table().to_vec(), 40, 2);
    let cpu = cpu_read(&more, more.table(), 40, 2);
    println!("unwritten slots: device {got:?}\n                 cpu    {cpu:?}");
    same_failure(&got, &cpu);
    assert!(zeros_from(&out, 0));

    // A write that would leave a gap (start 45, watermark 40 on page 2):
    // refused, nothing written, watermarks unchanged.
    let before = dev.watermarks().expect("marks");
    dev.apply_events().expect("events");
    let mut t = StepTables::new(
        &gpu,
        &[ChunkSpec {
            table: more.table().to_vec(),
            start: 45,
            rows: 3,
            cached: 0,
        }],
    )
    .expect("tables");
    let kv = gpu.upload(&vec![9.0f32; 3 * N_KV * HD]).expect("kv");
    dev.write_kv(0, &kv, &kv, &mut t).expect("launch");
    let got = t.violations(&gpu).expect("records")[0].decode(n_pages);
    println!("write gap:       device {got:?}");
    assert!(
        matches!(
            got,
            Decoded::WriteGap {
                slot: 13,
                watermark: 8,
                ..
            }
        ),
        "{got:?}"
    );
    assert_eq!(
        dev.watermarks().expect("marks"),
        before,
        "a refused write raises nothing"
    );
    let page = more.table()[2].page;
    let bytes = dev.download_page(page).expect("page");
    let nine = 9.0f32.to_le_bytes();
    assert!(
        !bytes.chunks(4).any(|c| c == nine),
        "a refused write wrote nothing"
    );

    // A released page is poisoned on the device as on the host.
    let page = a.table()[0].page;
    drop(a);
    dev.apply_events().expect("events");
    let bytes = dev.download_page(page).expect("page");
    assert!(
        bytes
            .chunks(4)
            .all(|c| c == kvmesh_kvpool::POISON_BITS.to_le_bytes()),
        "released page holds the canary"
    );
    let gens = dev.generations().expect("gens");
    assert_eq!(
        u64::from(gens[page as usize]) % 2,
        0,
        "a free page's generation is even"
    );
}

#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn a_staged_page_lands_with_its_watermarks() {
    let Some(gpu) = gpu() else { return };
    let mut src = DeviceKvPool::new(gpu.clone(), host_pool(pool_cfg(KvDtype::F16))).expect("pool");
    let mut dst = DeviceKvPool::new(gpu.clone(), host_pool(pool_cfg(KvDtype::F16))).expect("pool");
    let mut a = src.host().clone().reserve(30).expect("a");
    write_all(&mut src, &gpu, &mut a, 30);
    let b = dst.host().clone().reserve(30).expect("b");
    dst.apply_events().expect("events");
    for (i, (from, to)) in a.table().iter().zip(b.table()).enumerate() {
        let bytes = src.download_page(from.page).expect("down");
        let marks = [(30usize.saturating_sub(i * 16)).min(16) as u32; 2];
        dst.upload_page(to.page, &bytes, &marks).expect("up");
        assert_eq!(dst.download_page(to.page).expect("back"), bytes);
    }
    let (got, out) = device_read(&gpu, &mut dst, b.table().to_vec(), 29, 1);
    assert_eq!(got, Decoded::Clean);
    assert!(out.iter().all(|v| v.is_finite()));
    // A page index past the pool is refused before any copy.
    assert!(dst.upload_page(10_000, &[0; 4], &[0, 0]).is_err());
}

/// Prints, never asserts: what the checks cost (timings are noisy).
#[test]
#[ignore = "needs a CUDA device: scripts/gpu/run.sh runs it"]
fn checked_and_unchecked_attention_cost() {
    let Some(gpu) = gpu() else { return };
    let mut dev = DeviceKvPool::new(
        gpu.clone(),
        host_pool(PoolConfig::for_tokens(64 * 1024, 16, 1, N_KV, HD)),
    )
    .expect("pool");
    let host = dev.host().clone();
    let mut rs: Vec<Reservation> = (0..64).map(|_| host.reserve(1000).expect("r")).collect();
    for r in &mut rs {
        let kv = vec![0.1f32; 999 * N_KV * HD];
        dev.apply_events().expect("ev");
        let mut t = StepTables::new(
            &gpu,
            &[ChunkSpec {
                table: r.table().to_vec(),
                start: 0,
                rows: 999,
                cached: 0,
            }],
        )
        .expect("t");
        let d = gpu.upload(&kv).expect("kv");
        dev.write_kv(0, &d, &d, &mut t).expect("w");
    }
    let specs: Vec<ChunkSpec> = rs
        .iter()
        .map(|r| ChunkSpec {
            table: r.table().to_vec(),
            start: 998,
            rows: 1,
            cached: 0,
        })
        .collect();
    let mut t = StepTables::new(&gpu, &specs).expect("t");
    let q = gpu.upload(&vec![0.3f32; 64 * N_HEADS * HD]).expect("q");
    let mut out = gpu.zeros::<f32>(64 * N_HEADS * HD).expect("out");
    let mut time = |checked: bool| {
        for _ in 0..20 {
            dev.attention(call(0, None, checked), &q, &mut t, &mut out)
                .expect("att");
        }
        gpu.sync().expect("sync");
        let t0 = std::time::Instant::now();
        for _ in 0..200 {
            dev.attention(call(0, None, checked), &q, &mut t, &mut out)
                .expect("att");
        }
        gpu.sync().expect("sync");
        t0.elapsed().as_secs_f64() / 200.0
    };
    let (u, c) = (time(false), time(true));
    let (u2, c2) = (time(false), time(true));
    let (u, c) = (u.min(u2), c.min(c2));
    println!(
        "decode attention, 64 sequences x 999 tokens: unchecked {:.1} us, checked {:.1} us, checked/unchecked {:.3}",
        u * 1e6,
        c * 1e6,
        c / u
    );
}
