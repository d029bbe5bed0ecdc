//! Medians and the two-sample Kolmogorov-Smirnov test the side-channel
//! figures are reported with.
//!
//! The KS statistic `D` is the largest distance between the two samples'
//! empirical distribution functions (0: the same ranks, 1: every value of
//! one below every value of the other). Its p-value here is the
//! asymptotic Kolmogorov distribution with Stephens' small-sample
//! correction, `Q(λ)` at `λ = (√nₑ + 0.12 + 0.11/√nₑ)·D`, `nₑ = nm/(n+m)`:
//! the probability of a `D` at least this large if both samples came from
//! one continuous distribution. Approximate for a dozen samples a side
//! (it errs large, i.e. toward "indistinguishable", by a few percent
//! there), which is why the report gives `D` and the medians too.

use serde_json::{json, Value};

/// The median of `xs` (the mean of the middle two for an even count);
/// `None` when empty.
pub(crate) fn median(xs: &[f64]) -> Option<f64> {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// The result of [`ks_two_sample`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Ks {
    /// The statistic, 0 to 1.
    pub(crate) d: f64,
    /// Its asymptotic p-value, 0 to 1.
    pub(crate) p: f64,
}

impl Ks {
    pub(crate) fn json(&self) -> Value {
        json!({"ks_d": self.d, "ks_p": self.p})
    }
}

/// The two-sample KS test of `a` against `b`; `None` when either is empty.
pub(crate) fn ks_two_sample(a: &[f64], b: &[f64]) -> Option<Ks> {
    if a.is_empty() || b.is_empty() {
        return None;
    }
    let mut a = a.to_vec();
    let mut b = b.to_vec();
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    let (n, m) = (a.len() as f64, b.len() as f64);
    let (mut i, mut j, mut d) = (0usize, 0usize, 0.0f64);
    // Walk the merged order; ties advance both sides before comparing.
    while i < a.len() && j < b.len() {
        let x = a[i].min(b[j]);
        while i < a.len() && a[i] <= x {
            i += 1;
        }
        while j < b.len() && b[j] <= x {
            j += 1;
        }
        d = d.max((i as f64 / n - j as f64 / m).abs());
    }
    let ne = n * m / (n + m);
    let lambda = (ne.sqrt() + 0.12 + 0.11 / ne.sqrt()) * d;
    Some(Ks {
        d,
        p: kolmogorov_q(lambda),
    })
}

/// `Q(λ) = 2 Σₖ (-1)^(k-1) exp(-2k²λ²)`, the Kolmogorov survival
/// function; 1 at (and near) 0.
fn kolmogorov_q(lambda: f64) -> f64 {
    if lambda < 0.2 {
        return 1.0;
    }
    let mut sum = 0.0;
    let mut sign = 1.0;
    for k in 1..=100 {
        let k = f64::from(k);
        let term = sign * (-2.0 * k * k * lambda * lambda).exp();
        sum += term;
        if term.abs() < 1e-12 {
            break;
        }
        sign = -sign;
    }
    (2.0 * sum).clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_take_the_middle() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }

    #[test]
    fn samples_apart_give_d_one_and_a_small_p() {
        let a: Vec<f64> = (0..12).map(f64::from).collect();
        let b: Vec<f64> = (100..112).map(f64::from).collect();
        let ks = ks_two_sample(&a, &b).expect("samples");
        assert_eq!(ks.d, 1.0);
        // λ = (√6 + 0.12 + 0.11/√6)·1 ≈ 2.614: Q ≈ 2e-6.
        assert!(ks.p < 1e-5 && ks.p > 1e-7, "{ks:?}");
    }

    #[test]
    fn one_sample_against_itself_gives_d_zero_and_p_one() {
        let a = [5.0, 1.0, 4.0, 2.0, 3.0];
        let ks = ks_two_sample(&a, &a).expect("samples");
        assert_eq!(ks, Ks { d: 0.0, p: 1.0 });
    }

    #[test]
    fn interleaved_samples_give_the_hand_computed_d() {
        // a: 1 3 5 7, b: 2 4 6 8: the EDFs differ by 1/4 at most.
        let ks = ks_two_sample(&[1.0, 3.0, 5.0, 7.0], &[2.0, 4.0, 6.0, 8.0]).expect("samples");
        assert!((ks.d - 0.25).abs() < 1e-12, "{ks:?}");
        // λ ≈ 0.403: Q ≈ 0.997, far from significant.
        assert!(ks.p > 0.99, "{ks:?}");
        // a shifted up by half: 2 of 4 of b below a's first value.
        let ks = ks_two_sample(&[3.5, 5.0, 6.5, 9.0], &[1.0, 2.0, 4.0, 6.0]).expect("samples");
        assert!((ks.d - 0.5).abs() < 1e-12, "{ks:?}");
        // λ = (√2 + 0.12 + 0.11/√2)·0.5 ≈ 0.806: Q ≈ 0.535.
        assert!((ks.p - 0.535).abs() < 0.01, "{ks:?}");
    }

    #[test]
    fn ties_across_samples_do_not_count_as_distance() {
        let ks = ks_two_sample(&[1.0, 1.0, 2.0], &[1.0, 2.0, 2.0]).expect("samples");
        assert!((ks.d - 1.0 / 3.0).abs() < 1e-12, "{ks:?}");
        assert_eq!(ks_two_sample(&[], &[1.0]), None);
    }
}
