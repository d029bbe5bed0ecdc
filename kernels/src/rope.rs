//! Rotary position embeddings.
//!
//! Two layouts of the same rotation:
//! - [`RopeLayout::RotateHalf`] (Hugging Face): dimension `i` pairs with
//!   `i + head_dim / 2`.
//! - [`RopeLayout::Interleaved`] (GGUF/llama.cpp, whose converter permutes
//!   the Q and K projection rows to suit it): dimension `2i` pairs with
//!   `2i + 1`.
//!
//! Frequencies follow transformers' `_compute_default_rope_parameters`,
//! and its `linear`, `llama3` and `yarn` scalings, computed in the
//! precision it uses (f32 tensors, f64 where it computes in Python floats).
//! YaRN also scales the rotation's magnitude: cos and sin are multiplied
//! by its attention factor, where transformers multiplies them (so q and k
//! both carry it, and their dot product its square).

/// How the rotated pairs are laid out within a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs `(i, i + d/2)`: Hugging Face checkpoints.
    RotateHalf,
    /// Pairs `(2i, 2i + 1)`: GGUF checkpoints as stored.
    Interleaved,
}

/// Frequency scaling of the rotary embedding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain `theta ^ (-2i / d)`.
    None,
    /// Positions divided by `factor`.
    Linear {
        /// Position divisor.
        factor: f32,
    },
    /// Llama 3.1 scaling: long wavelengths divided by `factor`, short ones
    /// kept, a smooth blend between.
    Llama3 {
        /// Divisor for low frequencies.
        factor: f32,
        /// Wavelength bound (as a fraction of the original context) of the
        /// low-frequency band.
        low_freq_factor: f32,
        /// Wavelength bound of the high-frequency band.
        high_freq_factor: f32,
        /// Context length the model was trained with before scaling.
        original_max_position_embeddings: usize,
    },
    /// YaRN: frequencies whose wavelength is short against the original
    /// context kept, long ones divided by `factor`, a linear ramp between;
    /// cos and sin multiplied by an attention factor.
    Yarn(Yarn),
}

/// YaRN's parameters, as transformers' `_compute_yarn_parameters` reads
/// them (their defaults resolved by whoever parses the configuration).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// Context extension factor (interpolated frequencies are divided by it).
    pub factor: f64,
    /// Context length before scaling: the ramp's bounds are measured in
    /// rotations over it.
    pub original_max_position_embeddings: usize,
    /// Rotations over the original context above which a frequency is kept
    /// (transformers' default 32).
    pub beta_fast: f64,
    /// Rotations below which a frequency is fully interpolated (default 1).
    pub beta_slow: f64,
    /// Round the ramp's bounds outward to whole dimensions (default true;
    /// gpt-oss turns it off).
    pub truncate: bool,
    /// cos and sin are multiplied by this ([`yarn_attention_factor`] unless
    /// the configuration gives it).
    pub attention_factor: f32,
}

/// YaRN's default attention factor: `0.1 ln(factor) + 1` (1 for a factor
/// of at most 1), or with DeepSeek's `mscale` and `mscale_all_dim` (both
/// nonzero) the ratio of that expression with each as a multiplier of the
/// logarithm. In f64, rounded once, as transformers computes it in Python
/// floats and torch rounds the scalar to f32 when it multiplies cos and sin.
pub fn yarn_attention_factor(factor: f64, mscale: Option<f64>, mscale_all_dim: Option<f64>) -> f32 {
    let get = |m: f64| {
        if factor <= 1.0 {
            1.0
        } else {
            0.1 * m * factor.ln() + 1.0
        }
    };
    match (mscale, mscale_all_dim) {
        (Some(m), Some(all)) if m != 0.0 && all != 0.0 => (get(m) / get(all)) as f32,
        _ => get(1.0) as f32,
    }
}

/// Precomputed inverse frequencies for one head size.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    /// cos and sin are multiplied by this (YaRN; 1 otherwise).
    attention_factor: f32,
    head_dim: usize,
    /// The leading dimensions of each head that rotate (all of them but in
    /// partial rotary embeddings, GLM-4.5's half); the rest pass through.
    rotary_dim: usize,
    layout: RopeLayout,
}

impl Rope {
    /// Frequencies for `rotary_dim == head_dim` (all Llama-family models).
    pub fn new(head_dim: usize, theta: f32, scaling: RopeScaling, layout: RopeLayout) -> Self {
        Self::partial(head_dim, head_dim, theta, scaling, layout)
    }

    /// A partial rotary embedding: the first `rotary_dim` dimensions of
    /// each head rotate, with frequencies computed for `rotary_dim` as
    /// transformers does (`dim = head_dim * partial_rotary_factor`); the
    /// others pass through unchanged. `rotary_dim` is even and at most
    /// `head_dim` (the configuration checks it).
    pub fn partial(
        head_dim: usize,
        rotary_dim: usize,
        theta: f32,
        scaling: RopeScaling,
        layout: RopeLayout,
    ) -> Self {
        let rotary_dim = rotary_dim.min(head_dim);
        let half = rotary_dim / 2;
        // transformers' `base ** (arange(0, dim, 2) / dim)`, in f32.
        let pos_freq = |i: usize| theta.powf((2 * i) as f32 / rotary_dim as f32);
        let mut inv_freq: Vec<f32> = (0..half).map(|i| 1.0 / pos_freq(i)).collect();
        let mut attention_factor = 1.0;
        match scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => inv_freq.iter_mut().for_each(|f| *f /= factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = original_max_position_embeddings as f32;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
            RopeScaling::Yarn(y) => {
                attention_factor = y.attention_factor;
                let ramp = yarn_ramp(rotary_dim, theta, &y);
                // The scalar factor is rounded to f32 where torch
                // multiplies the f32 tensor by it.
                let factor = y.factor as f32;
                for (i, (f, r)) in inv_freq.iter_mut().zip(ramp).enumerate() {
                    let p = pos_freq(i);
                    let extrapolation = 1.0 / p;
                    let interpolation = 1.0 / (factor * p);
                    // transformers' `inv_freq_extrapolation_factor`.
                    let keep = 1.0 - r;
                    *f = interpolation * (1.0 - keep) + extrapolation * keep;
                }
            }
        }
        Self {
            inv_freq,
            attention_factor,
            head_dim,
            rotary_dim,
            layout,
        }
    }

    /// The rotated dimensions of each head.
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// What cos and sin are multiplied by (YaRN's attention factor; 1 for
    /// every other scaling): a device kernel that does not apply it must
    /// refuse a rope where it is not 1.
    pub fn attention_factor(&self) -> f32 {
        self.attention_factor
    }

    /// The inverse frequency of each rotated pair, scaling applied
    /// (`rotary_dim / 2` values): what a device kernel is given so that it
    /// rotates by the same angles.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The pair layout this instance rotates.
    pub fn layout(&self) -> RopeLayout {
        self.layout
    }

    /// Rotate every head of every token in place (its first `rotary_dim`
    /// dimensions).
    ///
    /// `x` is `[positions.len()][n_heads][head_dim]`.
    pub fn apply(&self, x: &mut [f32], positions: &[usize], n_heads: usize) {
        let d = self.head_dim;
        let half = self.rotary_dim / 2;
        assert_eq!(
            x.len(),
            positions.len() * n_heads * d,
            "rope input has the wrong length"
        );
        let mut cos = vec![0.0f32; half];
        let mut sin = vec![0.0f32; half];
        for (t, &pos) in positions.iter().enumerate() {
            for i in 0..half {
                let angle = pos as f32 * self.inv_freq[i];
                // (Times 1 is exact: no other scaling changes here.)
                cos[i] = angle.cos() * self.attention_factor;
                sin[i] = angle.sin() * self.attention_factor;
            }
            for h in 0..n_heads {
                let head = &mut x[(t * n_heads + h) * d..][..d];
                for i in 0..half {
                    let (a, b) = match self.layout {
                        RopeLayout::RotateHalf => (i, i + half),
                        RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cos[i] - x1 * sin[i];
                    head[b] = x1 * cos[i] + x0 * sin[i];
                }
            }
        }
    }
}

/// YaRN's linear ramp over the `head_dim / 2` rotated pairs: 0 where a
/// frequency is kept (it turns more than `beta_fast` times over the
/// original context), 1 where it is interpolated (fewer than `beta_slow`
/// times), linear between, as transformers' `find_correction_range` and
/// `linear_ramp_factor` compute it: the bounds in f64, the ramp in f32.
fn yarn_ramp(head_dim: usize, theta: f32, y: &Yarn) -> Vec<f32> {
    let dim = head_dim as f64;
    let base = f64::from(theta);
    let original = y.original_max_position_embeddings as f64;
    // The dimension at which a frequency turns `rotations` times over the
    // original context.
    let correction_dim = |rotations: f64| {
        (dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln())
    };
    let (mut low, mut high) = (correction_dim(y.beta_fast), correction_dim(y.beta_slow));
    if y.truncate {
        low = low.floor();
        high = high.ceil();
    }
    let low = low.max(0.0);
    let mut high = high.min(dim - 1.0);
    if low == high {
        // transformers' guard against a zero-width ramp.
        high += 0.001;
    }
    // torch rounds each Python-float operand to f32 where it meets the f32
    // `arange`.
    let (from, width) = (low as f32, (high - low) as f32);
    (0..head_dim / 2)
        .map(|i| ((i as f32 - from) / width).clamp(0.0, 1.0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A partial rope is the full rope of `rotary_dim` on each head's
    /// leading dimensions, and leaves the rest as they were.
    #[test]
    fn partial_rotates_the_leading_dimensions_only() {
        let (d, r) = (16, 8);
        let part = Rope::partial(d, r, 10000.0, RopeScaling::None, RopeLayout::RotateHalf);
        let full = Rope::new(r, 10000.0, RopeScaling::None, RopeLayout::RotateHalf);
        assert_eq!(part.inv_freq(), full.inv_freq());
        let x: Vec<f32> = (0..2 * 3 * d).map(|i| (i as f32 * 0.37).sin()).collect();
        let positions = [5, 17];
        let mut got = x.clone();
        part.apply(&mut got, &positions, 3);
        let mut lead: Vec<f32> = x.chunks(d).flat_map(|h| h[..r].to_vec()).collect();
        full.apply(&mut lead, &positions, 3);
        for (h, (g, x)) in got.chunks(d).zip(x.chunks(d)).enumerate() {
            assert_eq!(&g[..r], &lead[h * r..(h + 1) * r], "head {h}");
            assert_eq!(&g[r..], &x[r..], "head {h} pass-through");
            assert_ne!(&g[..r], &x[..r], "head {h} rotated");
        }
    }

    #[test]
    fn position_zero_is_identity() {
        let rope = Rope::new(8, 10000.0, RopeScaling::None, RopeLayout::RotateHalf);
        let mut x: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let orig = x.clone();
        rope.apply(&mut x, &[0, 0], 1);
        assert_eq!(x, orig);
    }

    #[test]
    fn rotation_preserves_pair_norms_and_layouts_agree_under_permutation() {
        let d = 8;
        let rope_h = Rope::new(d, 500.0, RopeScaling::None, RopeLayout::RotateHalf);
        let rope_i = Rope::new(d, 500.0, RopeScaling::None, RopeLayout::Interleaved);
        let x: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin()).collect();
        // Interleave: position 2i <- i, 2i+1 <- i + d/2.
        let mut xi = vec![0.0; d];
        for i in 0..d / 2 {
            xi[2 * i] = x[i];
            xi[2 * i + 1] = x[i + d / 2];
        }
        let mut xh = x.clone();
        rope_h.apply(&mut xh, &[7], 1);
        rope_i.apply(&mut xi, &[7], 1);
        for i in 0..d / 2 {
            assert!((xh[i] - xi[2 * i]).abs() < 1e-6);
            assert!((xh[i + d / 2] - xi[2 * i + 1]).abs() < 1e-6);
            let before = x[i].hypot(x[i + d / 2]);
            let after = xh[i].hypot(xh[i + d / 2]);
            assert!((before - after).abs() < 1e-5);
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let d = 64;
        let plain = Rope::new(d, 500000.0, RopeScaling::None, RopeLayout::RotateHalf);
        let scaled = Rope::new(
            d,
            500000.0,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            },
            RopeLayout::RotateHalf,
        );
        assert_eq!(
            plain.inv_freq[0], scaled.inv_freq[0],
            "highest frequency is kept"
        );
        let last = d / 2 - 1;
        assert!(
            (plain.inv_freq[last] / 8.0 - scaled.inv_freq[last]).abs() < 1e-12,
            "lowest frequency is divided"
        );
    }

    /// YaRN's frequencies and attention factor against transformers 5.24's
    /// `_compute_yarn_parameters` (the f32 bits it returns) for: the
    /// golden tiny model's rope (a ramp over three pairs), gpt-oss's
    /// untruncated ramp, DeepSeek's `mscale`/`mscale_all_dim`, and an
    /// explicit attention factor with other betas.
    #[test]
    fn yarn_equals_transformers() {
        let yarn = |factor: f64, original: usize, betas: (f64, f64), truncate: bool, af: f32| {
            RopeScaling::Yarn(Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: betas.0,
                beta_slow: betas.1,
                truncate,
                attention_factor: af,
            })
        };
        let cases: [(usize, f32, RopeScaling, f32, &[u32]); 4] = [
            (
                16,
                500.0,
                yarn(
                    4.0,
                    32,
                    (32.0, 1.0),
                    true,
                    yarn_attention_factor(4.0, None, None),
                ),
                1.138_629_4,
                &[
                    0x3f800000, 0x3eb09666, 0x3dd88cb4, 0x3cc72a9d, 0x3c372dbf, 0x3ba8796d,
                    0x3b1af347, 0x3a8e830d,
                ],
            ),
            (
                64,
                150_000.0,
                yarn(
                    32.0,
                    4096,
                    (32.0, 1.0),
                    false,
                    yarn_attention_factor(32.0, None, None),
                ),
                1.346_573_6,
                &[
                    0x3f800000, 0x3f306535, 0x3ef316a2, 0x3ea77faa, 0x3e66d3fa, 0x3e1f0cfd,
                    0x3ddb2f9f, 0x3d970764, 0x3d502194, 0x3d01ddd5, 0x3c9e646f, 0x3c3dec94,
                    0x3bdea840, 0x3b7cfe14, 0x3b093803, 0x3a89f778, 0x39ef543c, 0x390799b9,
                    0x3820adc6, 0x37dd6dfc, 0x37989328, 0x375242fa, 0x3710e12c, 0x36c7a82b,
                    0x3689928c, 0x363d9647, 0x3602a245, 0x35b40668, 0x35781728, 0x352af200,
                    0x34eb93eb, 0x34a252d3,
                ],
            ),
            (
                32,
                10_000.0,
                yarn(
                    8.0,
                    2048,
                    (32.0, 1.0),
                    true,
                    yarn_attention_factor(8.0, Some(1.0), Some(0.5)),
                ),
                1.094_18,
                &[
                    0x3f800000, 0x3f0ff59a, 0x3ea1e89b, 0x3e361887, 0x3dcccccd, 0x3d498b0a,
                    0x3cc24a55, 0x3c361887, 0x3ba3d70a, 0x3b0a3375, 0x3a4f3e38, 0x39691528,
                    0x3903126f, 0x38936a16, 0x3825cb60, 0x37ba7753,
                ],
            ),
            (
                16,
                1_000_000.0,
                yarn(4.0, 32768, (16.0, 2.0), true, 0.9),
                0.9,
                &[
                    0x3f800000, 0x3e361887, 0x3d0186e3, 0x3bb8449c, 0x3a23d70b, 0x383a7753,
                    0x3704a2b2, 0x35bcb0c1,
                ],
            ),
        ];
        for (d, theta, scaling, af, want) in cases {
            let rope = Rope::new(d, theta, scaling, RopeLayout::RotateHalf);
            assert_eq!(rope.attention_factor(), af, "{scaling:?}");
            let got: Vec<u32> = rope.inv_freq().iter().map(|f| f.to_bits()).collect();
            // At most one unit in the last place: `powf` is the C library's
            // here and SLEEF's in torch.
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                assert!(
                    g.abs_diff(w) <= 1,
                    "{scaling:?} pair {i}: {g:#x}, transformers {w:#x}"
                );
            }
            assert_eq!(got.len(), want.len());
        }
        assert_eq!(yarn_attention_factor(1.0, None, None), 1.0);
        assert_eq!(yarn_attention_factor(0.5, Some(1.0), Some(1.0)), 1.0);
        // A zero mscale falls back to the plain factor, as transformers'
        // truthiness test does.
        assert_eq!(
            yarn_attention_factor(4.0, Some(0.0), Some(1.0)),
            yarn_attention_factor(4.0, None, None)
        );
    }

    /// YaRN's attention factor scales cos and sin, so a rotated vector's
    /// length by exactly that factor's rounding, at every position
    /// including 0 (where transformers scales too).
    #[test]
    fn yarn_scales_the_rotation_by_its_attention_factor() {
        let y = Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: 1.25,
        };
        let rope = Rope::new(8, 500.0, RopeScaling::Yarn(y), RopeLayout::RotateHalf);
        let x: Vec<f32> = (0..16).map(|i| (i as f32 * 0.71).cos()).collect();
        let mut r = x.clone();
        rope.apply(&mut r, &[0, 40], 1);
        // Position 0: cos 1, sin 0, so every value times 1.25 exactly.
        for (a, b) in r[..8].iter().zip(&x[..8]) {
            assert_eq!(*a, b * 1.25);
        }
        for i in 0..4 {
            let before = x[8 + i].hypot(x[8 + i + 4]);
            let after = r[8 + i].hypot(r[8 + i + 4]);
            assert!((after - 1.25 * before).abs() < 1e-5, "pair {i}");
        }
    }
}
