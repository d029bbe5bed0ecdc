//! Distribution specs, percentile and gap arithmetic, exact-length prompts
//! and the determinism of the workload.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::dist::{exponential_gap, LenDist};
use super::stats::{ratios, timings, Dist, Sample, Summary};
use super::workload::{
    build_prompt, check_lengths, one_token_words, Arrivals, Workload, WorkloadSpec,
};
use super::{mode_of, BenchArgs, Mode};

fn tiny_tokenizer() -> Arc<kvmesh_model::TextTokenizer> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/tiny-llama");
    Arc::new(kvmesh_model::TextTokenizer::from_hf_dir(&dir).expect("tiny tokenizer"))
}

#[test]
fn specs_parse_and_print_back() {
    for (spec, want) in [
        ("fixed:32", LenDist::Fixed(32)),
        ("uniform:16-128", LenDist::Uniform { lo: 16, hi: 128 }),
        ("uniform:5-5", LenDist::Uniform { lo: 5, hi: 5 }),
        (
            "normal:100,20",
            LenDist::Normal {
                mean: 100.0,
                sd: 20.0,
            },
        ),
        (
            "lognormal:200,150.5",
            LenDist::LogNormal {
                mean: 200.0,
                sd: 150.5,
            },
        ),
    ] {
        let d = LenDist::parse("--prompt-len", spec).expect(spec);
        assert_eq!(d, want, "{spec}");
        assert_eq!(LenDist::parse("--prompt-len", &d.to_string()), Ok(d));
    }
}

#[test]
fn bad_specs_name_the_flag_the_spec_and_the_problem() {
    for (spec, problem) in [
        ("32", "no distribution name"),
        ("fixed:0", "at least 1"),
        ("fixed:x", "not a whole number"),
        ("uniform:9-3", "A must not be above B"),
        ("uniform:9", "A-B"),
        ("uniform:0-3", "at least 1"),
        ("normal:100", "MEAN,SD"),
        ("normal:0,5", "MEAN must be above 0"),
        ("normal:10,-1", "SD must not be negative"),
        ("normal:10,inf", "not a number"),
        ("lognormal:abc,1", "not a number"),
        ("poisson:3", "unknown distribution"),
    ] {
        let e = LenDist::parse("--output-len", spec).expect_err(spec);
        assert!(
            e.contains("--output-len") && e.contains(spec) && e.contains(problem),
            "{spec}: {e}"
        );
    }
}

#[test]
fn draws_stay_in_range_and_repeat_with_the_seed() {
    let draw = |spec: &str, seed| {
        let d = LenDist::parse("--prompt-len", spec).expect(spec);
        let mut rng = StdRng::seed_from_u64(seed);
        (0..2000).map(|_| d.sample(&mut rng)).collect::<Vec<_>>()
    };
    let u = draw("uniform:3-7", 1);
    assert!(u.iter().all(|&n| (3..=7).contains(&n)));
    assert!((3..=7).all(|n| u.contains(&n)), "every value drawn");
    // A normal whose mean is near 0 clamps to 1, never 0.
    let n = draw("normal:2,10", 2);
    assert!(n.iter().all(|&x| x >= 1) && n.contains(&1));
    // Means near the asked ones (2000 draws; generous bounds).
    let mean = |xs: &[usize]| xs.iter().sum::<usize>() as f64 / xs.len() as f64;
    assert!((mean(&draw("normal:100,10", 3)) - 100.0).abs() < 2.0);
    assert!((mean(&draw("lognormal:100,50", 4)) - 100.0).abs() < 8.0);
    assert_eq!(draw("lognormal:100,50", 5), draw("lognormal:100,50", 5));
    assert_ne!(draw("uniform:1-1000", 6), draw("uniform:1-1000", 7));

    let mut rng = StdRng::seed_from_u64(8);
    let gaps: Vec<f64> = (0..4000).map(|_| exponential_gap(&mut rng, 4.0)).collect();
    assert!(gaps.iter().all(|&g| g >= 0.0 && g.is_finite()));
    let m = gaps.iter().sum::<f64>() / gaps.len() as f64;
    assert!((m - 0.25).abs() < 0.02, "mean gap {m}");
}

#[test]
fn a_distribution_is_in_milliseconds() {
    let d = Dist::of_secs([0.004, 0.001, 0.003, 0.002]).expect("samples");
    assert!(
        (d.p50 - 2.5).abs() < 1e-9 && (d.mean - 2.5).abs() < 1e-9,
        "{d:?}"
    );
    assert!((d.p99 - 3.97).abs() < 1e-9, "{d:?}");
}

#[test]
fn an_event_of_several_tokens_counts_as_several_gaps() {
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let (ttft, itl) = timings(t0, &[(at(100), 1), (at(110), 1), (at(140), 3)]);
    assert_eq!(ttft, Some(0.1));
    assert_eq!(itl.len(), 4);
    assert!((itl[0] - 0.010).abs() < 1e-9);
    assert!(itl[1..].iter().all(|g| (g - 0.010).abs() < 1e-9), "{itl:?}");
    assert_eq!(timings(t0, &[]), (None, Vec::new()));
}

fn sample(index: usize, output_len: usize, output_tokens: usize, error: Option<&str>) -> Sample {
    let t0 = Instant::now();
    Sample {
        index,
        prompt_tokens: 10,
        output_len,
        sent: t0,
        ttft: Some(0.01 * (index + 1) as f64),
        itl: vec![0.002; output_tokens.saturating_sub(1)],
        end: t0 + Duration::from_millis(100),
        output_tokens,
        server_prompt_tokens: Some(if index == 2 { 11 } else { 10 }),
        error: error.map(str::to_owned),
    }
}

/// Rounds pool their latencies, and their rates count only the rounds' own
/// spans, not the time other targets ran in between.
#[test]
fn rounds_pool_latencies_and_rate_over_their_own_spans() {
    let at = |s: Sample, from_ms: u64, to_ms: u64, base: Instant| Sample {
        sent: base + Duration::from_millis(from_ms),
        end: base + Duration::from_millis(to_ms),
        ..s
    };
    let base = Instant::now();
    // Round 1 spans 0-1000 ms, round 2 spans 5000-6000 ms (another target
    // ran from 1000 to 5000): 2 s of this target's time, not 6.
    let s = Summary::of_rounds(vec![
        vec![
            at(sample(0, 8, 8, None), 0, 500, base),
            at(sample(1, 8, 8, None), 500, 1000, base),
        ],
        vec![
            at(sample(0, 8, 8, None), 5000, 5500, base),
            at(sample(1, 8, 8, None), 5500, 6000, base),
        ],
    ]);
    assert_eq!((s.requests, s.completed), (4, 4));
    assert!((s.duration_s - 2.0).abs() < 1e-9, "{}", s.duration_s);
    assert!((s.requests_per_s() - 2.0).abs() < 1e-9);
    assert!((s.output_tokens_per_s() - 16.0).abs() < 1e-9);
    // TTFTs 10 and 20 ms in each round: all four pooled.
    let ttft = s.ttft.expect("ttft");
    assert!((ttft.mean - 15.0).abs() < 1e-9, "{ttft:?}");
}

#[test]
fn a_summary_counts_only_completed_requests() {
    let s = Summary::of(vec![
        sample(1, 8, 8, None),
        sample(0, 4, 4, None),
        sample(2, 5, 5, None),
        sample(3, 9, 2, Some("http 503 server_error/no_healthy_node")),
    ]);
    assert_eq!((s.requests, s.completed, s.failed), (4, 3, 1));
    assert_eq!((s.output_tokens, s.expected_output_tokens), (17, 17));
    assert_eq!(s.prompt_len_mismatches, 1);
    assert_eq!(
        s.errors.get("http 503 server_error/no_healthy_node"),
        Some(&1)
    );
    assert_eq!(s.samples[0].index, 0, "ordered by index");
    let ttft = s.ttft.expect("ttft");
    assert!((ttft.p50 - 20.0).abs() < 1e-9, "{ttft:?}");
    let j = s.json();
    assert_eq!(j["per_request"].as_array().map(Vec::len), Some(4));
    assert_eq!(j["completed"], 3);
    let r = ratios(&s, &s);
    assert_eq!(r["ttft_p50_ms"], 1.0);
    assert_eq!(r["output_tokens_s"], 1.0);
}

#[test]
fn prompts_have_exactly_the_drawn_token_count() {
    let tok = tiny_tokenizer();
    let words = one_token_words(&tok).expect("words");
    let mut rng = StdRng::seed_from_u64(9);
    for n in [1, 2, 3, 17, 64, 200] {
        let (text, ids) = build_prompt(&tok, &words, n, &mut rng).expect("prompt");
        assert_eq!(ids.len(), n, "{text:?}");
        assert_eq!(tok.encode(&text).expect("encode"), ids);
    }
}

#[test]
fn the_same_seed_gives_the_same_workload_and_arrivals() {
    let tok = tiny_tokenizer();
    let words = Arc::new(one_token_words(&tok).expect("words"));
    let spec = WorkloadSpec {
        seed: 42,
        prompt_len: LenDist::Uniform { lo: 4, hi: 60 },
        output_len: LenDist::Normal {
            mean: 20.0,
            sd: 5.0,
        },
        requests: Some(12),
        max_model_len: 256,
    };
    let all = |spec: &WorkloadSpec| {
        let mut w = Workload::new(Arc::clone(&tok), Arc::clone(&words), spec.clone());
        let mut out = Vec::new();
        while let Some(r) = w.next_request().expect("request") {
            out.push((r.index, r.text, r.prompt_ids, r.output_len));
        }
        out
    };
    let a = all(&spec);
    assert_eq!(a.len(), 12);
    assert_eq!(a, all(&spec));
    assert_ne!(a, all(&spec.warmup(12)), "warm-up draws its own");
    assert!(a.iter().all(|(_, _, ids, _)| (4..=60).contains(&ids.len())));
    let longest = check_lengths(&spec, 12).expect("fits");
    assert_eq!(
        longest,
        a.iter()
            .map(|(_, _, p, o)| p.len() + o)
            .max()
            .expect("requests")
    );
    let offsets = |seed| {
        let mut arr = Arrivals::new(seed, 2.0);
        (0..5).map(|_| arr.next_offset()).collect::<Vec<_>>()
    };
    assert_eq!(offsets(42), offsets(42));
    assert!(offsets(42).windows(2).all(|w| w[0] < w[1]));

    let too_long = WorkloadSpec {
        prompt_len: LenDist::Fixed(250),
        output_len: LenDist::Fixed(10),
        ..spec
    };
    let e = check_lengths(&too_long, 1).expect_err("over the context");
    assert!(
        e.to_string().contains("256") && e.to_string().contains("--output-len"),
        "{e}"
    );
}

#[derive(Parser, Debug)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
}

fn load_flags(args: &[&str]) -> Result<(Mode, Option<usize>, Option<Duration>), String> {
    let cli = Cli::try_parse_from(std::iter::once("kvmesh-bench").chain(args.iter().copied()))
        .map_err(|e| e.to_string())?;
    mode_of(&cli.bench).map_err(|e| e.to_string())
}

#[test]
fn load_flags_default_check_and_conflict() {
    assert_eq!(
        load_flags(&[]),
        Ok((Mode::Closed { concurrency: 4 }, Some(100), None))
    );
    assert_eq!(
        load_flags(&["--rate", "2.5", "--duration", "10"]),
        Ok((
            Mode::Open { rate: 2.5 },
            None,
            Some(Duration::from_secs(10))
        ))
    );
    for (args, needle) in [
        (&["--rate", "0"][..], "--rate"),
        (&["--rate", "NaN"][..], "--rate"),
        (&["--concurrency", "0"][..], "--concurrency"),
        (&["--requests", "0"][..], "--requests"),
        (&["--duration=-1"][..], "--duration"),
        (&["--duration", "1e30"][..], "--duration"),
        (&["--concurrency", "2", "--rate", "1"][..], "--rate"),
    ] {
        let e = load_flags(args).expect_err(&format!("{args:?}"));
        assert!(e.contains(needle), "{args:?}: {e}");
    }
}
