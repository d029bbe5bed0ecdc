//! Rotary position embeddings.
//!
//! Two layouts of the same rotation:
//! - [`RopeLayout::RotateHalf`] (Hugging Face): dimension `i` pairs with
//!   `i + head_dim / 2`.
//! - [`RopeLayout::Interleaved`] (GGUF/llama.cpp, whose converter permutes
//!   the Q and K projection rows to suit it): dimension `2i` pairs with
//!   `2i + 1`.
//!
//! Frequencies follow Hugging Face's `_compute_default_rope_parameters`,
//! `linear` and `llama3` scalings, computed in f32 as it does.

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
}

/// Precomputed inverse frequencies for one head size.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    head_dim: usize,
    layout: RopeLayout,
}

impl Rope {
    /// Frequencies for `rotary_dim == head_dim` (all Llama-family models).
    pub fn new(head_dim: usize, theta: f32, scaling: RopeScaling, layout: RopeLayout) -> Self {
        let half = head_dim / 2;
        let mut inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
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
        }
        Self {
            inv_freq,
            head_dim,
            layout,
        }
    }

    /// The inverse frequency of each rotated pair, scaling applied
    /// (`head_dim / 2` values): what a device kernel is given so that it
    /// rotates by the same angles.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The pair layout this instance rotates.
    pub fn layout(&self) -> RopeLayout {
        self.layout
    }

    /// Rotate every head of every token in place.
    ///
    /// `x` is `[positions.len()][n_heads][head_dim]`.
    pub fn apply(&self, x: &mut [f32], positions: &[usize], n_heads: usize) {
        let d = self.head_dim;
        let half = d / 2;
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
                cos[i] = angle.cos();
                sin[i] = angle.sin();
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
