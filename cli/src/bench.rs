//! `kvmesh bench-engine`: throughput of the reference engine on one machine.
//!
//! Prefill: one prompt of `--prompt-tokens` tokens, timed from admission to
//! its first logits. Decode: `--batch` sequences with short prompts, each
//! decoding `--decode-tokens` tokens as one batched step per token; reported
//! as aggregate generated tokens per second. Every figure is the median of
//! `--repeats` runs. A benchmark, not a test: nothing here asserts a time.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use kvmesh_model::engine::{Engine, Sequence};
use kvmesh_model::sampling::argmax;

use crate::ModelArgs;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens each sequence decodes in the decode measurement.
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Batch sizes of the decode measurement.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batch: Vec<usize>,
    /// Also measure prefills that score the prompt (prompt logprobs with
    /// this many alternatives, as `echo` / `prompt_logprobs` ask prefill
    /// to), taking turns with the plain ones: both rows and the ratio.
    #[arg(long)]
    prompt_logprobs: Option<usize>,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Draw the weights at random (this seed) for the shape of --model, a directory with a config.json and a tokenizer: benchmarks of shapes whose weights are not at hand (a Llama-3-8B shape on a GPU). The text is noise; the speed is the shape's.
    #[arg(long, value_name = "SEED")]
    random_weights: Option<u64>,
    #[command(flatten)]
    model: ModelArgs,
}

/// Token ids of a filler text, repeated to `n` tokens.
fn filler(engine: &Engine, n: usize) -> Result<Vec<u32>> {
    let text = "The quick brown fox jumps over the lazy dog while the committee reviews \
                quarterly results, weather reports and 42 unrelated footnotes. ";
    let unit = engine.tokenizer().encode(text)?;
    if unit.is_empty() {
        bail!("the tokenizer produced no tokens for the filler text");
    }
    Ok(unit.iter().copied().cycle().take(n).collect())
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

pub fn run(args: BenchArgs) -> Result<()> {
    let repeats = args.repeats.max(1);
    let engine = match args.random_weights {
        None => args.model.load_engine()?,
        Some(seed) => {
            let dir =
                args.model.model.as_deref().context(
                    "--random-weights needs --model DIR (its config.json and tokenizer)",
                )?;
            if args.model.exact {
                bail!("--random-weights draws f32 weights already; --exact adds nothing");
            }
            let loaded = kvmesh_model::loader::load_random(dir, seed)?;
            Engine::from_loaded(loaded, &args.model.engine_config())?
        }
    };
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let mode = engine.model().mode();
    let kv = engine.pool().config().dtype;

    let prompt = filler(&engine, args.prompt_tokens)?;
    let start = crate::steal::CpuTimes::now();
    // Plain prefills, and with --prompt-logprobs scored ones taking turns
    // with them, so a slow spell of a shared host falls on both.
    let mut prefill = Vec::new();
    let mut scored = Vec::new();
    for _ in 0..repeats {
        for score in std::iter::once(None).chain(args.prompt_logprobs.map(Some)) {
            let mut seq = engine.admit(prompt.clone(), 1)?;
            if let Some(k) = score {
                seq.score_prompt(k)?;
            }
            let t = Instant::now();
            engine.prefill(&mut seq)?;
            let rate = args.prompt_tokens as f64 / t.elapsed().as_secs_f64();
            if score.is_some() {
                scored.push(rate);
            } else {
                prefill.push(rate);
            }
        }
    }
    let prefill = median(prefill);
    let scored = (!scored.is_empty()).then(|| median(scored));

    let mut decode = Vec::new();
    for &b in &args.batch {
        let mut runs = Vec::new();
        for _ in 0..repeats {
            let short = filler(&engine, 32)?;
            let mut seqs: Vec<Sequence> = (0..b)
                .map(|_| engine.admit(short.clone(), args.decode_tokens + 1))
                .collect::<Result<_, _>>()?;
            let mut next: Vec<u32> = Vec::with_capacity(b);
            for s in seqs.iter_mut() {
                next.push(argmax(&engine.prefill(s)?));
            }
            let t = Instant::now();
            for _ in 0..args.decode_tokens {
                let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
                let out = engine.decode_step(&mut refs, &next)?;
                next = out
                    .into_iter()
                    .map(|r| r.map(|l| argmax(&l)))
                    .collect::<Result<_, _>>()?;
            }
            runs.push((b * args.decode_tokens) as f64 / t.elapsed().as_secs_f64());
        }
        decode.push((b, median(runs)));
    }

    // The machine's ceilings, measured in this run: a batch-1 step reads
    // every weight once, a long prefill is bound by the multiply-adds.
    let path = kvmesh_kernels::cpu::path();
    let model = engine.model();
    let weight_gb = model.weight_bytes() as f64 / 1e9;
    // A prefill computes the vocabulary's logits for its last position
    // only: the layers' multiply-adds per token, the vocabulary's once.
    let prefill_flops = 2.0 * model.prefill_matmul_params(args.prompt_tokens) as f64;
    let read_gbps = kvmesh_kernels::roofline::read_gbps(256 << 20);
    let fma_gflops = kvmesh_kernels::roofline::fma_peak_gflops(path);
    // The 8-bit-activation class multiplies in integers: its ceiling is the
    // dot product it runs with (VNNI where the CPU has it), and what the
    // class's own matmul reaches of it on operands in cache.
    let int8 =
        (kvmesh_kernels::cpu::activations() == kvmesh_kernels::cpu::Activations::Int8).then(|| {
            let dot = kvmesh_kernels::quant::Dot::of(path);
            (
                dot,
                kvmesh_kernels::roofline::int8_peak_gops(dot),
                kvmesh_kernels::roofline::int8_cached_gops(dot),
            )
        });
    // What the hypervisor took of the CPU from the first prefill to the
    // last ceiling: every figure above is low by up to that share.
    let steal = start
        .zip(crate::steal::CpuTimes::now())
        .and_then(|(a, b)| a.stolen_until(b));
    let b1 = decode.iter().find(|(b, _)| *b == 1).map(|(_, r)| *r);
    let b1_gbps = b1.map(|r| r * weight_gb);
    let prefill_gflops = prefill * prefill_flops / args.prompt_tokens as f64 / 1e9;

    // On a CUDA device: its weights and its copy bandwidth, measured now.
    let device = match engine.cuda() {
        Some(c) => Some((
            c.gpu().info().clone(),
            c.weight_bytes(),
            c.gpu().copy_gbps(1 << 30)?,
        )),
        None => None,
    };
    let device_b1 = device
        .as_ref()
        .and_then(|(_, bytes, _)| b1.map(|r| r * *bytes as f64 / 1e9));
    if args.json {
        let device_json = device.as_ref().map_or_else(String::new, |(info, bytes, gbps)| {
            format!(
                "\"device\":{{\"spec\":\"{}\",\"name\":\"{}\",\"target\":\"{}\",\"weight_bytes\":{bytes},\"copy_gbps\":{gbps:.1},\"decode_b1_weight_gbps\":{}}},",
                info.spec,
                info.name,
                info.target,
                device_b1.map_or_else(|| "null".to_owned(), |g| format!("{g:.1}"))
            )
        });
        let decode_json: Vec<String> = decode
            .iter()
            .map(|(b, r)| format!("{{\"batch\":{b},\"tokens_per_s\":{r:.1}}}"))
            .collect();
        println!(
            "{{{device_json}\"threads\":{threads},\"mode\":\"{mode}\",\"cpu_kernels\":\"{path}\",\"activations\":\"{}\",\"kv_dtype\":\"{kv}\",\"prefill_tokens\":{},\"prefill_tokens_per_s\":{prefill:.1},{}\"decode\":[{}],\"roofline\":{{\"weight_bytes\":{},\"decode_b1_weight_gbps\":{},\"read_gbps\":{read_gbps:.2},\"prefill_matmul_gflops\":{prefill_gflops:.2},\"fma_peak_gflops\":{fma_gflops:.2},\"int8_peak_gops\":{},\"int8_cached_gops\":{}}},\"steal_share\":{}}}",
            kvmesh_kernels::cpu::activations(),
            args.prompt_tokens,
            scored.map_or_else(String::new, |r| format!("\"scored_prefill_tokens_per_s\":{r:.1},")),
            decode_json.join(","),
            model.weight_bytes(),
            b1_gbps.map_or_else(|| "null".to_owned(), |g| format!("{g:.2}")),
            int8.map_or_else(|| "null".to_owned(), |(_, g, _)| format!("{g:.2}")),
            int8.map_or_else(|| "null".to_owned(), |(_, _, c)| format!("{c:.2}")),
            steal.map_or_else(|| "null".to_owned(), |s| format!("{s:.3}")),
        );
    } else {
        println!(
            "kvmesh bench-engine  (mode {mode}, KV {kv}, {threads} threads, median of {repeats})"
        );
        println!("{:<28} {:>12}", "measurement", "tokens/s");
        println!(
            "{:<28} {:>12.1}",
            format!("prefill {} tokens", args.prompt_tokens),
            prefill
        );
        if let (Some(r), Some(k)) = (scored, args.prompt_logprobs) {
            println!(
                "{:<28} {:>12.1}   (time {:.3}x the plain prefill's)",
                format!("  scored, {k} alternatives"),
                r,
                prefill / r
            );
        }
        for (b, r) in &decode {
            println!(
                "{:<28} {:>12.1}",
                format!("decode batch {b} (aggregate)"),
                r
            );
        }
        if let Some((info, bytes, gbps)) = &device {
            println!(
                "device {} ({}, sm_{}, kernels {}): {:.1} MB of weights; copy bandwidth measured now {gbps:.0} GB/s",
                info.spec,
                info.name,
                info.arch,
                info.target,
                *bytes as f64 / 1e6
            );
            if let Some(g) = device_b1 {
                println!(
                    "  decode batch 1 streams {g:.0} GB/s of weights: {:.0}% of the copy bandwidth",
                    100.0 * g / gbps
                );
            }
        }
        println!("CPU kernels {path}; ceilings measured now on {threads} threads:");
        if let Some(g) = b1_gbps {
            println!(
                "  decode batch 1 streams {g:.2} GB/s of weights ({:.1} MB a token): {:.0}% of a {read_gbps:.2} GB/s read",
                weight_gb * 1e3,
                100.0 * g / read_gbps
            );
        }
        println!(
            "  prefill runs {prefill_gflops:.1} GFLOP/s in the projections: {:.0}% of a {fma_gflops:.1} GFLOP/s {path} FMA peak",
            100.0 * prefill_gflops / fma_gflops
        );
        if let Some((dot, gops, cached)) = int8 {
            println!(
                "  (8-bit activations: {:.0}% of a {gops:.1} GOP/s {} int8 dot-product peak;",
                100.0 * prefill_gflops / gops,
                dot.name()
            );
            println!(
                "   the class's own matmul on operands in cache: {cached:.1} GOP/s, {:.0}% of it)",
                100.0 * cached / gops
            );
        }
        if let Some(s) = steal {
            println!(
                "  the hypervisor took {:.0}% of this machine's CPU time meanwhile (steal): every figure is low by up to that",
                100.0 * s
            );
        }
    }
    Ok(())
}
