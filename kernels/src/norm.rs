//! RMSNorm as Llama-family models define it: `w * x / sqrt(mean(x^2) + eps)`,
//! computed in f32.

/// Normalise each row of `x` (rows of `weight.len()` values) into `out`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    assert_eq!(
        x.len() % d,
        0,
        "rms_norm input is not a whole number of rows"
    );
    assert_eq!(x.len(), out.len(), "rms_norm output has the wrong length");
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f32 = row.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, v), w) in o.iter_mut().zip(row).zip(weight) {
            *o = w * (v * inv);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_weight_gives_unit_rms() {
        let x = [3.0f32, -4.0, 0.0, 5.0, 1.0, 1.0, 1.0, 1.0];
        let mut out = [0.0f32; 8];
        rms_norm(&x, &[1.0; 4], 0.0, &mut out);
        for row in out.chunks(4) {
            let ms: f32 = row.iter().map(|v| v * v).sum::<f32>() / 4.0;
            assert!((ms - 1.0).abs() < 1e-6);
        }
        assert!((out[0] - 3.0 / (50.0f32 / 4.0).sqrt()).abs() < 1e-6);
    }
}
