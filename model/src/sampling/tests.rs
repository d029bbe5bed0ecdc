use super::*;

fn seeded(p: SamplingParams) -> SamplingParams {
    SamplingParams { seed: Some(7), ..p }
}

/// Draws `n` tokens from the same logits row (a fresh copy each time, as
/// the model would give).
fn draws(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<u32> {
    (0..n)
        .map(|_| s.sample(&mut logits.to_vec()).token)
        .collect()
}

fn row() -> Vec<f32> {
    (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect()
}

#[test]
fn greedy_picks_first_maximum() {
    let mut s = Sampler::plain(SamplingParams::greedy());
    assert_eq!(s.sample(&mut [0.1, 3.0, 3.0, -1.0]).token, 1);
}

/// The index a scan keeping the first strictly larger logit gives.
fn first_max_scan(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// `argmax` gives the scan's index on rows of every length around its
/// 16 lanes, with ties, NaNs (first or anywhere), infinities and +-0.
#[test]
fn argmax_is_the_first_maximum_of_a_scan() {
    let mut rng = StdRng::seed_from_u64(0x9E37_79B9);
    let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 2.5];
    for len in (0..70).chain([1000, 4099, 262_144]) {
        for round in 0..6 {
            let mut row: Vec<f32> = (0..len)
                .map(|_| rng.random_range(0..64) as f32 / 8.0 - 4.0)
                .collect();
            // Plant specials: round 0 none, then more of them.
            for _ in 0..round * (1 + len / 50) {
                if len > 0 {
                    let at = rng.random_range(0..len);
                    row[at] = specials[rng.random_range(0..specials.len())];
                }
            }
            if round == 5 && len > 0 {
                row[0] = f32::NAN;
            }
            assert_eq!(
                argmax(&row),
                first_max_scan(&row),
                "len {len}, round {round}: {row:?}"
            );
        }
    }
    assert_eq!(
        argmax(&[-0.0, 0.0, -1.0]),
        0,
        "+0 does not beat an earlier -0"
    );
    assert_eq!(argmax(&[-1.0, 0.0, -0.0, f32::NAN]), 1);
    assert_eq!(
        argmax(&[f32::NAN, 9.0]),
        0,
        "a NaN first logit, as the scan"
    );
    assert_eq!(argmax(&[]), 0);
}

#[test]
fn same_seed_same_tokens_and_top_k_limits_choices() {
    let logits = row();
    let params = seeded(SamplingParams {
        top_k: Some(3),
        ..SamplingParams::default()
    });
    let mut a = Sampler::plain(params.clone());
    let mut b = Sampler::plain(params);
    let xs = draws(&mut a, &logits, 100);
    assert_eq!(xs, draws(&mut b, &logits, 100));
    let mut top: Vec<u32> = (0..50u32).collect();
    top.sort_by(|&i, &j| logits[j as usize].total_cmp(&logits[i as usize]));
    assert!(
        xs.iter().all(|x| top[..3].contains(x)),
        "sampled outside the top 3"
    );
    assert!(
        top[..3].iter().filter(|t| xs.contains(t)).count() >= 2,
        "sampling is not spreading"
    );
}

#[test]
fn tiny_top_p_is_greedy() {
    let mut s = Sampler::plain(seeded(SamplingParams {
        top_p: 1e-6,
        ..SamplingParams::default()
    }));
    assert!(draws(&mut s, &[0.0, 5.0, 1.0, 4.9], 20)
        .iter()
        .all(|&t| t == 1));
}

#[test]
fn a_bias_of_100_forces_its_token_and_minus_100_bans_one() {
    let logits = row();
    let mut forced = Sampler::plain(seeded(SamplingParams {
        logit_bias: vec![(11, 100.0)],
        ..SamplingParams::default()
    }));
    assert!(draws(&mut forced, &logits, 50).iter().all(|&t| t == 11));
    let best = argmax(&logits);
    let mut banned = Sampler::plain(SamplingParams {
        logit_bias: vec![(best, -100.0), (10_000, 5.0)],
        ..SamplingParams::greedy()
    });
    let t = banned.sample(&mut logits.clone()).token;
    assert_ne!(t, best, "a -100 bias still drew the token");
}

#[test]
fn min_tokens_holds_off_the_stop_tokens() {
    // Token 3 (the stop token) is by far the most likely.
    let mut logits = vec![0.0f32; 8];
    logits[3] = 10.0;
    logits[5] = 1.0;
    let mut s = Sampler::new(
        SamplingParams {
            min_tokens: 4,
            ..SamplingParams::greedy()
        },
        &[1, 2],
        &[3],
    );
    assert_eq!(draws(&mut s, &logits, 6), [5, 5, 5, 5, 3, 3]);
    // Resumed after prefill's first token, the count goes on.
    let mut d = Sampler::new(
        SamplingParams {
            min_tokens: 2,
            ..SamplingParams::greedy()
        },
        &[1, 2],
        &[3],
    );
    d.resume(5);
    assert_eq!(draws(&mut d, &logits, 2), [5, 3]);
}

#[test]
fn a_frequency_penalty_lowers_repeats_and_presence_moves_on() {
    let logits = row();
    let count_top = |p: SamplingParams| {
        let mut s = Sampler::plain(p);
        let xs = draws(&mut s, &logits, 40);
        let best = argmax(&logits);
        xs.iter().filter(|&&t| t == best).count()
    };
    let plain = count_top(SamplingParams::greedy());
    let penalized = count_top(SamplingParams {
        frequency_penalty: 2.0,
        ..SamplingParams::greedy()
    });
    assert_eq!(plain, 40);
    assert!(
        penalized < 10,
        "a frequency penalty of 2 still repeated the top token {penalized} of 40 times"
    );
    // Presence: two close tokens alternate no more; after each was drawn
    // once the penalty is equal, so the first comes back.
    let mut s = Sampler::plain(SamplingParams {
        presence_penalty: 1.0,
        ..SamplingParams::greedy()
    });
    assert_eq!(draws(&mut s, &[0.0, 2.0, 1.5, 0.0], 3), [1, 2, 1]);
    // A negative penalty encourages repeats.
    let mut s = Sampler::plain(SamplingParams {
        frequency_penalty: -2.0,
        ..SamplingParams::greedy()
    });
    s.resume(2);
    assert_eq!(s.sample(&mut [0.0, 2.0, 1.5, 0.0]).token, 2);
}

#[test]
fn the_repetition_penalty_covers_the_prompt() {
    // Token 1 leads, but it is in the prompt: divided by 3 it falls
    // behind token 2. A negative logit is multiplied (pushed further).
    let mut s = Sampler::new(
        SamplingParams {
            repetition_penalty: 3.0,
            ..SamplingParams::greedy()
        },
        &[1, 0, 1],
        &[],
    );
    let mut l = [-1.0f32, 3.0, 1.5, -0.1];
    assert_eq!(s.sample(&mut l).token, 2);
    assert_eq!(l, [-3.0, 1.0, 1.5, -0.1]);
    // The drawn token joins: its next logit is penalized too.
    let mut l = [-1.0f32, 3.0, 1.5, -0.1];
    assert_eq!(s.sample(&mut l).token, 1);
    assert_eq!(l[2], 0.5);
}

#[test]
fn min_p_drops_the_unlikely() {
    // p(0) / p(1) = e^-3 < 0.1: token 0 is never drawn with min_p 0.1.
    let logits = [0.0f32, 3.0, 2.9, 2.8];
    let mut s = Sampler::plain(seeded(SamplingParams {
        min_p: 0.1,
        ..SamplingParams::default()
    }));
    let xs = draws(&mut s, &logits, 300);
    assert!(!xs.contains(&0), "min_p let an unlikely token through");
    assert!([1, 2, 3].iter().all(|t| xs.contains(t)));
    let mut free = Sampler::plain(seeded(SamplingParams::default()));
    assert!(draws(&mut free, &logits, 300).contains(&0));
}

#[test]
fn logprobs_are_the_processed_distributions() {
    let logits = row();
    let t = 0.7f32;
    let mut s = Sampler::plain(seeded(SamplingParams {
        temperature: t,
        logprobs: Some(5),
        logit_bias: vec![(4, 1.0)],
        ..SamplingParams::default()
    }));
    let out = s.sample(&mut logits.clone());
    let lp = out.logprobs.expect("asked for");
    let mut biased = logits.clone();
    biased[4] += 1.0;
    let norm = biased.iter().map(|&l| (l / t).exp()).sum::<f32>().ln();
    let want = |id: u32| biased[id as usize] / t - norm;
    assert!((lp.logprob - want(out.token)).abs() < 1e-4);
    assert_eq!(lp.top.len(), 5);
    for w in lp.top.windows(2) {
        assert!(w[0].1 >= w[1].1, "top entries most likely first");
    }
    for &(id, l) in &lp.top {
        assert!(
            (l - want(id)).abs() < 1e-4,
            "token {id}: {l} vs {}",
            want(id)
        );
    }
    // Greedy: the chosen token is the first entry, logprobs at T = 1.
    let mut g = Sampler::plain(SamplingParams {
        logprobs: Some(3),
        ..SamplingParams::greedy()
    });
    let out = g.sample(&mut logits.clone());
    let lp = out.logprobs.expect("asked for");
    assert_eq!(lp.top[0].0, out.token);
    assert_eq!(lp.top[0].1, lp.logprob);
    let all: f32 = logits.iter().map(|&l| l.exp()).sum();
    assert!((lp.logprob - (logits[out.token as usize].exp() / all).ln()).abs() < 1e-4);
    // None asked: none computed.
    let mut n = Sampler::plain(SamplingParams::greedy());
    assert_eq!(n.sample(&mut logits.clone()).logprobs, None);
    let mut z = Sampler::plain(SamplingParams {
        logprobs: Some(0),
        ..SamplingParams::greedy()
    });
    assert!(z
        .sample(&mut logits.clone())
        .logprobs
        .expect("some")
        .top
        .is_empty());
}

#[test]
fn a_resumed_sampler_draws_what_one_sampler_would() {
    let logits = row();
    let params = seeded(SamplingParams {
        temperature: 1.3,
        frequency_penalty: 0.8,
        repetition_penalty: 1.2,
        min_tokens: 2,
        ..SamplingParams::default()
    });
    let prompt = [3, 4, 5];
    let mut one = Sampler::new(params.clone(), &prompt, &[9]);
    let all = draws(&mut one, &logits, 12);
    let mut first = Sampler::new(params.clone(), &prompt, &[9]);
    let head = first.sample(&mut logits.clone()).token;
    assert_eq!(head, all[0]);
    let mut rest = Sampler::new(params, &prompt, &[9]);
    rest.resume(head);
    assert_eq!(draws(&mut rest, &logits, 11), all[1..]);
}

#[test]
fn validate_names_the_field() {
    let bad = [
        (
            SamplingParams {
                top_p: 1.5,
                ..SamplingParams::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                min_p: 1.5,
                ..SamplingParams::default()
            },
            "min_p",
        ),
        (
            SamplingParams {
                presence_penalty: 2.5,
                ..SamplingParams::default()
            },
            "presence_penalty",
        ),
        (
            SamplingParams {
                repetition_penalty: 0.0,
                ..SamplingParams::default()
            },
            "repetition_penalty",
        ),
        (
            SamplingParams {
                logit_bias: vec![(3, 101.0)],
                ..SamplingParams::default()
            },
            "logit_bias",
        ),
        (
            SamplingParams {
                logprobs: Some(21),
                ..SamplingParams::default()
            },
            "logprobs",
        ),
    ];
    for (p, field) in bad {
        let e = p.validate().expect_err(field);
        assert!(e.contains(field), "{e} does not name {field}");
    }
    assert_eq!(SamplingParams::default().validate(), Ok(()));
}
