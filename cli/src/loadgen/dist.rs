//! Length distributions (`--prompt-len`, `--output-len`) and the
//! exponential gaps of Poisson arrivals, drawn from seeded generators: the
//! same seed draws the same lengths and arrival times.

use std::fmt;

use rand::rngs::StdRng;
use rand::Rng;

/// A distribution of token counts. Every draw is at least 1.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum LenDist {
    /// `fixed:N`.
    Fixed(usize),
    /// `uniform:A-B`, both ends included.
    Uniform {
        /// A.
        lo: usize,
        /// B.
        hi: usize,
    },
    /// `normal:MEAN,SD`, rounded, clamped to at least 1.
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        sd: f64,
    },
    /// `lognormal:MEAN,SD`: a log-normal with this mean and standard
    /// deviation (of the lengths, not of their logarithm), rounded, at
    /// least 1. Heavy-tailed, like real prompt lengths.
    LogNormal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        sd: f64,
    },
}

const FORMS: &str = "fixed:N, uniform:A-B, normal:MEAN,SD or lognormal:MEAN,SD";

impl LenDist {
    /// Parses `spec`; the error names `flag`, the spec and what is wrong.
    pub(crate) fn parse(flag: &str, spec: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("{flag} {spec:?}: {why} (expected {FORMS})");
        let (kind, args) = spec
            .split_once(':')
            .ok_or_else(|| bad("no distribution name"))?;
        let count = |s: &str, what: &str| -> Result<usize, String> {
            match s.trim().parse::<usize>() {
                Ok(0) => Err(bad(&format!("{what} must be at least 1"))),
                Ok(n) => Ok(n),
                Err(_) => Err(bad(&format!("{what} {s:?} is not a whole number"))),
            }
        };
        let pair = |what: &str| -> Result<(f64, f64), String> {
            let (m, s) = args
                .split_once(',')
                .ok_or_else(|| bad(&format!("{what} needs MEAN,SD")))?;
            let num = |x: &str, name: &str| {
                x.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite())
                    .ok_or_else(|| bad(&format!("{name} {x:?} is not a number")))
            };
            let (mean, sd) = (num(m, "MEAN")?, num(s, "SD")?);
            if mean <= 0.0 {
                return Err(bad("MEAN must be above 0"));
            }
            if sd < 0.0 {
                return Err(bad("SD must not be negative"));
            }
            Ok((mean, sd))
        };
        match kind.trim() {
            "fixed" => Ok(Self::Fixed(count(args, "N")?)),
            "uniform" => {
                let (a, b) = args
                    .split_once('-')
                    .ok_or_else(|| bad("uniform needs A-B"))?;
                let (lo, hi) = (count(a, "A")?, count(b, "B")?);
                if lo > hi {
                    return Err(bad("A must not be above B"));
                }
                Ok(Self::Uniform { lo, hi })
            }
            "normal" => pair("normal").map(|(mean, sd)| Self::Normal { mean, sd }),
            "lognormal" => pair("lognormal").map(|(mean, sd)| Self::LogNormal { mean, sd }),
            other => Err(bad(&format!("unknown distribution {other:?}"))),
        }
    }

    /// One draw (at least 1).
    pub(crate) fn sample(&self, rng: &mut StdRng) -> usize {
        let rounded = |x: f64| x.round().clamp(1.0, usize::MAX as f64) as usize;
        match *self {
            Self::Fixed(n) => n,
            Self::Uniform { lo, hi } => rng.random_range(lo..=hi),
            Self::Normal { mean, sd } => rounded(mean + sd * standard_normal(rng)),
            Self::LogNormal { mean, sd } => {
                // ln X ~ N(mu, sigma^2) with E[X] = mean, SD[X] = sd.
                let sigma2 = (1.0 + (sd / mean).powi(2)).ln();
                let mu = mean.ln() - sigma2 / 2.0;
                rounded((mu + sigma2.sqrt() * standard_normal(rng)).exp())
            }
        }
    }
}

impl fmt::Display for LenDist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Fixed(n) => write!(f, "fixed:{n}"),
            Self::Uniform { lo, hi } => write!(f, "uniform:{lo}-{hi}"),
            Self::Normal { mean, sd } => write!(f, "normal:{mean},{sd}"),
            Self::LogNormal { mean, sd } => write!(f, "lognormal:{mean},{sd}"),
        }
    }
}

/// A standard normal draw (Box-Muller; one of the pair is used, so each
/// draw costs two uniforms and the sequence depends only on the seed).
pub(crate) fn standard_normal(rng: &mut StdRng) -> f64 {
    // u1 in (0, 1] keeps the logarithm finite.
    let u1 = 1.0 - rng.random::<f64>();
    let u2 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// The gap before the next arrival of a Poisson process of `rate` per
/// second: exponential with mean `1 / rate`, in seconds.
pub(crate) fn exponential_gap(rng: &mut StdRng, rate: f64) -> f64 {
    let u = rng.random::<f64>();
    -(1.0 - u).ln() / rate
}
