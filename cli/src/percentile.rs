//! The one percentile definition every benchmark of the command reports.

/// Percentile `p` (0 to 100) of ascending `sorted`, interpolating
/// linearly between the two nearest ranks (numpy's default, as vLLM's
/// benchmark reports); `None` without samples.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let pos = (p / 100.0).clamp(0.0, 1.0) * last as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64))
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let xs: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&xs, 50.0), Some(5.5));
        assert_eq!(percentile(&xs, 0.0), Some(1.0));
        assert_eq!(percentile(&xs, 100.0), Some(10.0));
        let p90 = percentile(&xs, 90.0).expect("samples");
        assert!((p90 - 9.1).abs() < 1e-9, "{p90}");
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
    }
}
