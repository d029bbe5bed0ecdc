//! Which device a node computes on: `cpu`, or `cuda[:N]`.

use std::fmt;
use std::str::FromStr;

/// The device of a node (`--device`, `device:` in the mesh file).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DeviceSpec {
    /// The CPU runtime (the reference every other backend is tested against).
    #[default]
    Cpu,
    /// CUDA device `N` (`cuda` is `cuda:0`).
    Cuda(usize),
}

/// A device string that is neither `cpu` nor `cuda[:N]`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("device {given:?}: expected cpu, cuda or cuda:N (N a device number)")]
pub struct ParseDeviceError {
    /// What was given.
    pub given: String,
}

impl FromStr for DeviceSpec {
    type Err = ParseDeviceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ParseDeviceError {
            given: s.to_owned(),
        };
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            t => {
                let n = t.strip_prefix("cuda:").ok_or_else(bad)?;
                // Digits only: no sign, no spaces, no `0x`.
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                n.parse().map(Self::Cuda).map_err(|_| bad())
            }
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSpec {
    /// Whether this is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, Self::Cuda(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form_and_prints_it_back() {
        for (s, d) in [
            ("cpu", DeviceSpec::Cpu),
            ("cuda", DeviceSpec::Cuda(0)),
            ("cuda:0", DeviceSpec::Cuda(0)),
            ("cuda:7", DeviceSpec::Cuda(7)),
        ] {
            assert_eq!(s.parse::<DeviceSpec>(), Ok(d), "{s}");
        }
        assert_eq!(DeviceSpec::Cuda(3).to_string(), "cuda:3");
        assert_eq!(DeviceSpec::Cpu.to_string(), "cpu");
        assert_eq!(
            "cuda".parse::<DeviceSpec>().map(|d| d.to_string()),
            Ok("cuda:0".into())
        );
    }

    #[test]
    fn refuses_anything_else_naming_the_input() {
        for s in [
            "",
            "gpu",
            "cuda:",
            "cuda:-1",
            "cuda:+1",
            "cuda:x",
            "cuda:1 ",
            "CUDA",
            "cuda:99999999999999999999999",
        ] {
            let e = s.parse::<DeviceSpec>().expect_err(s);
            assert_eq!(e.given, s);
            assert!(e.to_string().contains("cpu, cuda or cuda:N"));
        }
    }
}
