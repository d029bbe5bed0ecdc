//! Where a process's tracing settings come from. The standard OpenTelemetry
//! variables win over the mesh file's `tracing:` section, which wins over
//! the defaults (the variables are how an operator or an orchestrator
//! overrides one process without editing the file every node shares):
//!
//! | setting | variables (first set wins) | mesh file | default |
//! |---|---|---|---|
//! | OTLP/gRPC endpoint; none: no export | `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_ENDPOINT` | `otlp_endpoint` | none |
//! | sampler | `OTEL_TRACES_SAMPLER` (+ `OTEL_TRACES_SAMPLER_ARG`) | `sample_ratio` (parent-based) | `parentbased_always_on` |
//! | service name | `OTEL_SERVICE_NAME` | - | `kvmesh-router`, `kvmesh-prefill`, `kvmesh-decode` |
//! | off whatever else is set | `OTEL_SDK_DISABLED=true` | - | - |
//!
//! `OTEL_TRACES_SAMPLER_ARG` alone (no `OTEL_TRACES_SAMPLER`) sets the
//! ratio of the parent-based ratio sampler. `OTEL_EXPORTER_OTLP_PROTOCOL`
//! (and its `_TRACES_` form), when set, must be `grpc`: kvmesh exports
//! over gRPC only. An empty variable counts as unset. A bad value is an
//! error at start naming the variable, never a silent default.

use thiserror::Error;

/// The mesh file's `tracing:` section, as parsed there.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FileSettings {
    /// The OTLP/gRPC collector, `http://host:4317`.
    pub otlp_endpoint: Option<String>,
    /// The share of new traces kept, 0 to 1 (a client's sampled
    /// `traceparent` is always followed).
    pub sample_ratio: Option<f64>,
}

/// How new traces are sampled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// The share of traces kept, 0 to 1.
    pub ratio: f64,
    /// Follow the parent's decision where there is one (a client's
    /// `traceparent`, or the router's context at a node); the ratio then
    /// decides only for roots.
    pub parent_based: bool,
}

impl Default for Sampling {
    /// The specification's default: `parentbased_always_on`.
    fn default() -> Self {
        Self {
            ratio: 1.0,
            parent_based: true,
        }
    }
}

/// One process's resolved settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// Where spans go; `None`: tracing is off.
    pub endpoint: Option<String>,
    /// The sampler.
    pub sampling: Sampling,
    /// `OTEL_SERVICE_NAME`, when set (else the role's name).
    pub service_name: Option<String>,
}

impl Settings {
    /// Tracing off.
    pub fn off() -> Self {
        Self {
            endpoint: None,
            sampling: Sampling::default(),
            service_name: None,
        }
    }

    /// The settings from the process's environment over `file`.
    pub fn from_env(file: Option<&FileSettings>) -> Result<Self, SettingsError> {
        Self::resolve(|k| std::env::var(k).ok(), file)
    }

    /// The settings from `var` (the environment, or a test's map) over
    /// `file`.
    pub fn resolve(
        var: impl Fn(&str) -> Option<String>,
        file: Option<&FileSettings>,
    ) -> Result<Self, SettingsError> {
        let var = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        if let Some(v) = var("OTEL_SDK_DISABLED") {
            if v.trim().eq_ignore_ascii_case("true") {
                return Ok(Self::off());
            }
        }
        for name in [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ] {
            if let Some(v) = var(name) {
                if v.trim() != "grpc" {
                    return Err(SettingsError::Protocol { name, value: v });
                }
                break;
            }
        }
        let endpoint = match [
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ]
        .into_iter()
        .find_map(|name| var(name).map(|v| (name, v)))
        {
            Some((name, v)) => Some(endpoint(name, v)?),
            None => match file.and_then(|f| f.otlp_endpoint.clone()) {
                Some(v) => Some(endpoint("tracing.otlp_endpoint", v)?),
                None => None,
            },
        };
        let mut sampling = Sampling::default();
        if let Some(r) = file.and_then(|f| f.sample_ratio) {
            sampling.ratio = ratio("tracing.sample_ratio", &r.to_string())?;
        }
        let arg = var("OTEL_TRACES_SAMPLER_ARG");
        let arg_ratio = || match &arg {
            Some(a) => ratio("OTEL_TRACES_SAMPLER_ARG", a),
            None => Ok(1.0),
        };
        match var("OTEL_TRACES_SAMPLER").as_deref().map(str::trim) {
            None => {
                if arg.is_some() {
                    sampling.ratio = arg_ratio()?;
                }
            }
            Some(name) => {
                sampling = match name {
                    "always_on" => Sampling {
                        ratio: 1.0,
                        parent_based: false,
                    },
                    "always_off" => Sampling {
                        ratio: 0.0,
                        parent_based: false,
                    },
                    "traceidratio" => Sampling {
                        ratio: arg_ratio()?,
                        parent_based: false,
                    },
                    "parentbased_always_on" => Sampling {
                        ratio: 1.0,
                        parent_based: true,
                    },
                    "parentbased_always_off" => Sampling {
                        ratio: 0.0,
                        parent_based: true,
                    },
                    "parentbased_traceidratio" => Sampling {
                        ratio: arg_ratio()?,
                        parent_based: true,
                    },
                    other => return Err(SettingsError::Sampler(other.to_owned())),
                }
            }
        }
        Ok(Self {
            endpoint,
            sampling,
            service_name: var("OTEL_SERVICE_NAME").map(|s| s.trim().to_owned()),
        })
    }
}

/// `value` checked as an OTLP/gRPC endpoint: `http://` or `https://`, a
/// host, and nothing a URI cannot hold.
fn endpoint(name: &'static str, value: String) -> Result<String, SettingsError> {
    let v = value.trim();
    let bad = |reason| SettingsError::Endpoint {
        name,
        value: value.clone(),
        reason,
    };
    let rest = v
        .strip_prefix("http://")
        .or_else(|| v.strip_prefix("https://"))
        .ok_or_else(|| bad("expected http://HOST:PORT (OTLP over gRPC)"))?;
    if rest.is_empty() || rest.starts_with('/') {
        return Err(bad("no host"));
    }
    v.parse::<tonic::codegen::http::Uri>()
        .map_err(|_| bad("not a URI"))?;
    Ok(v.to_owned())
}

fn ratio(name: &'static str, value: &str) -> Result<f64, SettingsError> {
    match value.trim().parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(SettingsError::Ratio {
            name,
            value: value.to_owned(),
        }),
    }
}

/// A tracing setting that cannot be used; each names its variable or
/// mesh-file field and the value.
#[derive(Debug, Error, PartialEq)]
pub enum SettingsError {
    /// Not an endpoint kvmesh can export to.
    #[error("{name}={value:?}: {reason}")]
    Endpoint {
        /// The variable or field.
        name: &'static str,
        /// What it said.
        value: String,
        /// Why it cannot be used.
        reason: &'static str,
    },
    /// A sampling ratio outside 0..=1 or not a number.
    #[error("{name}={value:?}: expected a sampling ratio from 0 to 1")]
    Ratio {
        /// The variable or field.
        name: &'static str,
        /// What it said.
        value: String,
    },
    /// An `OTEL_TRACES_SAMPLER` this build does not have.
    #[error("OTEL_TRACES_SAMPLER={0:?}: expected always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off or parentbased_traceidratio")]
    Sampler(String),
    /// A protocol other than OTLP over gRPC.
    #[error("{name}={value:?}: kvmesh exports OTLP over gRPC only (grpc)")]
    Protocol {
        /// The variable.
        name: &'static str,
        /// What it said.
        value: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn resolve(
        vars: &[(&str, &str)],
        file: Option<FileSettings>,
    ) -> Result<Settings, SettingsError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Settings::resolve(|k| map.get(k).cloned(), file.as_ref())
    }

    fn file(endpoint: Option<&str>, ratio: Option<f64>) -> Option<FileSettings> {
        Some(FileSettings {
            otlp_endpoint: endpoint.map(str::to_owned),
            sample_ratio: ratio,
        })
    }

    #[test]
    fn nothing_configured_is_off() {
        let s = resolve(&[], None).expect("ok");
        assert_eq!(s, Settings::off());
        assert_eq!(s.sampling, Sampling::default());
        // An empty variable counts as unset.
        let s = resolve(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")], None).expect("ok");
        assert_eq!(s.endpoint, None);
    }

    #[test]
    fn the_variables_win_over_the_mesh_file() {
        let f = file(Some("http://file:4317"), Some(0.25));
        let s = resolve(&[], f.clone()).expect("ok");
        assert_eq!(s.endpoint.as_deref(), Some("http://file:4317"));
        assert_eq!(
            s.sampling,
            Sampling {
                ratio: 0.25,
                parent_based: true
            }
        );
        let s = resolve(
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4317"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.5"),
                ("OTEL_SERVICE_NAME", "edge"),
            ],
            f.clone(),
        )
        .expect("ok");
        assert_eq!(s.endpoint.as_deref(), Some("http://env:4317"));
        assert_eq!(s.sampling.ratio, 0.5);
        assert!(s.sampling.parent_based);
        assert_eq!(s.service_name.as_deref(), Some("edge"));
        // The traces-specific variable wins over the general one.
        let s = resolve(
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4317"),
                ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "https://traces:4317"),
                ("OTEL_TRACES_SAMPLER", "always_off"),
            ],
            f.clone(),
        )
        .expect("ok");
        assert_eq!(s.endpoint.as_deref(), Some("https://traces:4317"));
        assert_eq!(
            s.sampling,
            Sampling {
                ratio: 0.0,
                parent_based: false
            }
        );
        // Disabled wins over everything.
        let s = resolve(&[("OTEL_SDK_DISABLED", "TRUE")], f).expect("ok");
        assert_eq!(s, Settings::off());
    }

    #[test]
    fn every_standard_sampler_name() {
        for (name, ratio, parent_based) in [
            ("always_on", 1.0, false),
            ("always_off", 0.0, false),
            ("traceidratio", 0.1, false),
            ("parentbased_always_on", 1.0, true),
            ("parentbased_always_off", 0.0, true),
            ("parentbased_traceidratio", 0.1, true),
        ] {
            let s = resolve(
                &[
                    ("OTEL_TRACES_SAMPLER", name),
                    ("OTEL_TRACES_SAMPLER_ARG", "0.1"),
                ],
                None,
            )
            .expect(name);
            assert_eq!(
                s.sampling,
                Sampling {
                    ratio,
                    parent_based
                },
                "{name}"
            );
        }
    }

    #[test]
    fn bad_values_are_refused_naming_the_variable() {
        // Variables, mesh-file section, what the error must name.
        type Case<'a> = (&'a [(&'a str, &'a str)], Option<FileSettings>, &'a str);
        let cases: &[Case] = &[
            (
                &[("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4317")],
                None,
                "OTEL_EXPORTER_OTLP_ENDPOINT",
            ),
            (
                &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://")],
                None,
                "no host",
            ),
            (
                &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://a b:1")],
                None,
                "not a URI",
            ),
            (&[], file(Some("udp://x:1"), None), "tracing.otlp_endpoint"),
            (&[], file(None, Some(1.5)), "tracing.sample_ratio"),
            (&[], file(None, Some(f64::NAN)), "tracing.sample_ratio"),
            (
                &[
                    ("OTEL_TRACES_SAMPLER", "traceidratio"),
                    ("OTEL_TRACES_SAMPLER_ARG", "half"),
                ],
                None,
                "OTEL_TRACES_SAMPLER_ARG",
            ),
            (
                &[("OTEL_TRACES_SAMPLER_ARG", "-0.1")],
                None,
                "OTEL_TRACES_SAMPLER_ARG",
            ),
            (
                &[("OTEL_TRACES_SAMPLER", "jaeger_remote")],
                None,
                "OTEL_TRACES_SAMPLER",
            ),
            (
                &[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")],
                None,
                "OTEL_EXPORTER_OTLP_PROTOCOL",
            ),
        ];
        for (vars, f, names) in cases {
            let e = resolve(vars, f.clone()).expect_err("refused");
            assert!(e.to_string().contains(names), "{vars:?}: {e}");
        }
        let ok = resolve(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")], None).expect("grpc");
        assert_eq!(ok.endpoint, None);
    }
}
