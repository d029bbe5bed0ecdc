//! The non-matmul kernels on every path this CPU runs, in one run:
//! attention (prefill chunk and decode steps at two depths, f32 and f16 pools), SwiGLU,
//! RMSNorm and the f16 conversions, at SmolLM2-135M's shapes (9 query
//! heads, 3 KV heads, head size 64, hidden 576, intermediate 1536).
//! Times are medians in microseconds; `512/avx2` is AVX2's time over
//! AVX-512's (above 1 when AVX-512 is faster). A benchmark, not a test.
//!
//! `cargo bench -p kvmesh-kernels --bench paths`

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvmesh_kernels::activation::swiglu_with;
use kvmesh_kernels::attention::paged_attention_with;
use kvmesh_kernels::cpu::{self, Path};
use kvmesh_kernels::norm::rms_norm_with;
use kvmesh_kernels::paged::{f16_to_f32_slice_with, f32_to_f16_slice_with};
use kvmesh_kernels::{
    AttentionShape, GuardViolation, KvGeometry, KvValues, PageRef, PageSlices, PagedKv,
};

/// Median seconds of `f` over enough runs to fill about `budget`.
fn time(budget: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let mut xs = Vec::new();
    let start = Instant::now();
    while start.elapsed() < budget || xs.len() < 5 {
        let t = Instant::now();
        f();
        xs.push(t.elapsed().as_secs_f64());
    }
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn noise(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s as f32 / u32::MAX as f32 * 2.0 - 1.0
        })
        .collect()
}

/// Pages in memory, every read allowed (the pool's checks are measured
/// elsewhere).
struct Pages {
    geo: KvGeometry,
    k: Vec<f32>,
    v: Vec<f32>,
    kh: Vec<half::f16>,
    vh: Vec<half::f16>,
    f16: bool,
}

impl PagedKv for Pages {
    fn geometry(&self) -> KvGeometry {
        self.geo
    }

    fn read_page(
        &self,
        e: PageRef,
        _layer: usize,
        n: usize,
    ) -> Result<PageSlices<'_>, GuardViolation> {
        let per = self.geo.page_size * self.geo.kv_dim();
        let at = e.page as usize * per;
        let len = n * self.geo.kv_dim();
        Ok(if self.f16 {
            PageSlices {
                k: KvValues::F16(&self.kh[at..at + len]),
                v: KvValues::F16(&self.vh[at..at + len]),
            }
        } else {
            PageSlices {
                k: KvValues::F32(&self.k[at..at + len]),
                v: KvValues::F32(&self.v[at..at + len]),
            }
        })
    }

    fn report(&self, _: &GuardViolation) {}
}

fn row(name: &str, paths: &[Path], mut f: impl FnMut(Path)) {
    // `PATHS_BENCH=attention` (a substring of the name) runs some rows.
    if std::env::var("PATHS_BENCH").is_ok_and(|s| !name.contains(s.as_str())) {
        return;
    }
    let budget = Duration::from_millis(200);
    let us: Vec<f64> = paths.iter().map(|&p| time(budget, || f(p)) * 1e6).collect();
    print!("{name:<36}");
    for u in &us {
        print!(" {u:>11.1}");
    }
    let of = |p: Path| {
        paths
            .iter()
            .position(|&q| q == p)
            .map_or(f64::NAN, |i| us[i])
    };
    println!(" {:>9.2}", of(Path::Avx2) / of(Path::Avx512));
}

fn main() {
    // On one of the pool's threads, as the model's forward pass runs (a
    // parallel call then starts from inside the pool).
    rayon::scope(|_| tables());
}

fn tables() {
    let paths: Vec<Path> = cpu::available_paths().into_iter().rev().collect();
    println!(
        "kernels per path, {} threads (rayon); us per call (median)",
        rayon::current_num_threads()
    );
    print!("{:<36}", "kernel");
    for p in &paths {
        print!(" {:>11}", format!("{} us", p.name()));
    }
    println!(" {:>9}", "512/avx2");

    let (nh, nkv, hd, ps, ctx) = (9, 3, 64, 16, 1024);
    let geo = KvGeometry {
        page_size: ps,
        n_kv_heads: nkv,
        head_dim: hd,
        entry: kvmesh_kernels::KvEntry::KeyValue,
    };
    let (k, v) = (noise(ctx * nkv * hd, 3), noise(ctx * nkv * hd, 5));
    let mut pages = Pages {
        geo,
        kh: k.iter().map(|x| half::f16::from_f32(*x)).collect(),
        vh: v.iter().map(|x| half::f16::from_f32(*x)).collect(),
        k,
        v,
        f16: false,
    };
    let table: Vec<PageRef> = (0..ctx / ps)
        .map(|p| PageRef {
            page: p as u32,
            generation: 0,
        })
        .collect();
    let shape = AttentionShape {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        v_dim: hd,
        scale: 0.125,
        window: None,
        softcap: None,
        sinks: None,
    };
    for f16 in [false, true] {
        pages.f16 = f16;
        let dt = if f16 { "f16" } else { "f32" };
        for (what, from, to) in [
            ("prefill 512", 0, 512),
            ("decode @255", 255, 256),
            ("decode @1023", 1023, 1024),
        ] {
            let positions: Vec<usize> = (from..to).collect();
            let q = noise(positions.len() * nh * hd, 7);
            let mut out = vec![0.0; q.len()];
            row(&format!("attention {what} {dt}"), &paths, |p| {
                paged_attention_with(p, &pages, &table, 0, &shape, &q, &positions, &mut out)
                    .expect("read");
                black_box(&out);
            });
        }
    }
    for t in [1, 64] {
        let gu = noise(t * 2 * 1536, 11);
        let mut out = vec![0.0; t * 1536];
        row(&format!("swiglu [{t}x1536]"), &paths, |p| {
            swiglu_with(p, &gu, 1536, &mut out);
            black_box(&out);
        });
        let x = noise(t * 576, 13);
        let w = noise(576, 17);
        let mut out = vec![0.0; t * 576];
        row(&format!("rms_norm [{t}x576]"), &paths, |p| {
            rms_norm_with(p, &x, &w, 1e-5, &mut out);
            black_box(&out);
        });
    }
    let n = 64 * 1024;
    let x = noise(n, 19);
    let mut h = vec![half::f16::ZERO; n];
    row("f32 -> f16 [64Ki]", &paths, |p| {
        f32_to_f16_slice_with(p, &x, &mut h);
        black_box(&h);
    });
    let mut back = vec![0.0; n];
    row("f16 -> f32 [64Ki]", &paths, |p| {
        f16_to_f32_slice_with(p, &h, &mut back);
        black_box(&back);
    });
}
