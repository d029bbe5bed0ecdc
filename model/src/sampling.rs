//! Token selection from logits: greedy, or temperature / top-k / top-p
//! sampling from a seeded generator (the same seed gives the same tokens).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How to pick the next token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `0` (or below [`GREEDY_BELOW`]) is greedy.
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability
    /// adds up to at least `top_p` (`1.0` keeps all).
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (`None` keeps all).
    pub top_k: Option<usize>,
    /// Seed of the sampler; `None` draws one from the OS.
    pub seed: Option<u64>,
}

/// Temperatures below this are treated as greedy.
pub const GREEDY_BELOW: f32 = 1e-5;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Check ranges; the error names the field and value.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if self.top_k == Some(0) {
            return Err("top_k must be at least 1, got 0".into());
        }
        Ok(())
    }
}

/// A sampler with its own random state.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    scratch: Vec<(u32, f32)>,
}

/// Index of the largest logit; the first one on ties (as `torch.argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    /// A sampler for `params`.
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Self {
            params,
            rng,
            scratch: Vec::new(),
        }
    }

    /// Moves the random state past one draw, as `sample` does for a
    /// non-greedy choice: a sampler that continues a generation whose first
    /// token was sampled elsewhere (by a prefill node with the same seed)
    /// then draws what one sampler would have drawn.
    pub fn advance(&mut self) {
        let p = self.params;
        if !(p.temperature < GREEDY_BELOW || p.top_k == Some(1)) {
            let _: f32 = self.rng.random();
        }
    }

    /// Pick the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = self.params;
        if p.temperature < GREEDY_BELOW || p.top_k == Some(1) {
            return argmax(logits);
        }
        let c = &mut self.scratch;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| l.is_finite())
                .map(|(i, &l)| (i as u32, l / p.temperature)),
        );
        if c.is_empty() {
            return argmax(logits);
        }
        c.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
        if let Some(k) = p.top_k {
            c.truncate(k.max(1));
        }
        let max = c[0].1;
        let mut total = 0.0f32;
        for e in c.iter_mut() {
            e.1 = (e.1 - max).exp();
            total += e.1;
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0f32;
            let mut keep = c.len();
            for (i, e) in c.iter().enumerate() {
                acc += e.1 / total;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
            total = c.iter().map(|e| e.1).sum();
        }
        let mut r = self.rng.random::<f32>() * total;
        for e in c.iter() {
            if r < e.1 {
                return e.0;
            }
            r -= e.1;
        }
        c[c.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_limits_choices() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: Some(3),
            seed: Some(7),
        };
        let mut a = Sampler::new(params);
        let mut b = Sampler::new(params);
        let xs: Vec<u32> = (0..100).map(|_| a.sample(&logits)).collect();
        let ys: Vec<u32> = (0..100).map(|_| b.sample(&logits)).collect();
        assert_eq!(xs, ys);
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
        let logits = [0.0f32, 5.0, 1.0, 4.9];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 1e-6,
            top_k: None,
            seed: Some(1),
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&logits), 1);
        }
    }

    #[test]
    fn validate_names_the_field() {
        let e = SamplingParams {
            top_p: 1.5,
            ..SamplingParams::default()
        }
        .validate()
        .expect_err("top_p 1.5 is out of range");
        assert!(e.contains("top_p") && e.contains("1.5"));
    }
}
