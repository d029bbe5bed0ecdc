//! The mesh file's `router` section: the gateway's listeners, its limits,
//! admission (the policy, each API key's share), API keys and the answer
//! parsers.

use std::path::Path;

use anyhow::Result;
use kvmesh_router::admission::{check_reserve, BadReserve, Policy, Share, Shares};
use kvmesh_router::parsing::{ReasoningParserSetting, ToolParserSetting, UnknownParser};
use serde::Deserialize;

use super::refuse;

/// The router's section.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterSection {
    /// HTTP gateway listen address.
    pub http: String,
    /// Public gRPC listen address.
    pub grpc: String,
    /// Choices dispatched at once (a request holds one slot per choice).
    #[serde(default = "default_running")]
    pub max_running: usize,
    /// Choices queued at most.
    #[serde(default = "default_queued")]
    pub max_queued: usize,
    /// How waiting requests are served: `fair` (per-tenant queues, the
    /// default) or `fifo` (arrival order).
    #[serde(default)]
    pub admission: Option<String>,
    /// Slots only a tenant running nothing may take (fair admission);
    /// absent: an eighth of `max_running` where the keys name more than
    /// one tenant, else 0.
    #[serde(default)]
    pub reserve: Option<usize>,
    /// The share of every tenant, which a key's own fields override field
    /// by field.
    #[serde(default)]
    pub default_share: Option<ShareFields>,
    /// API keys and their tenants; none: no authentication.
    #[serde(default)]
    pub api_keys: Vec<ApiKey>,
    /// How `tool_choice: auto` reads calls: `auto` (from the chat
    /// template; the default), `hermes`, `llama3_json` or `mistral`.
    #[serde(default)]
    pub tool_call_parser: Option<String>,
    /// How chat answers' reasoning is read: `auto` (the default), `none`,
    /// `qwen3` or `deepseek_r1`.
    #[serde(default)]
    pub reasoning_parser: Option<String>,
}

impl RouterSection {
    /// `admission` and the keys' shares, parsed: a weight or cap of 0, or
    /// two keys of one tenant with different limits, are refused naming
    /// the key by position (never the key).
    pub fn admission(&self, file: &Path) -> Result<(Policy, Shares)> {
        let policy = match &self.admission {
            None => Policy::default(),
            Some(v) => v
                .parse()
                .map_err(|e: String| refuse(file, "router.admission", v, &e))?,
        };
        if let Some(r) = self.reserve {
            check_reserve(policy, r, self.max_running).map_err(|e| {
                let why = match e {
                    BadReserve::Fifo => {
                        "fair admission's; admission: fifo keeps no slot back".into()
                    }
                    BadReserve::NotUnderSlots => {
                        format!("must be under router.max_running ({})", self.max_running)
                    }
                };
                refuse(file, "router.reserve", &r.to_string(), &why)
            })?;
        }
        let mut shares = Shares::default();
        let base = match &self.default_share {
            Some(d) => d.share("router.default_share", file)?,
            None => Share::default(),
        };
        shares.set_default(base);
        for (i, k) in self.api_keys.iter().enumerate() {
            let share = k.share(i, base, file)?;
            shares
                .set(&k.tenant, share)
                .map_err(|e| refuse(file, &format!("router.api_keys[{i}]"), &k.tenant, &e))?;
        }
        Ok((policy, shares))
    }

    /// `tool_call_parser` and `reasoning_parser`, parsed (absent: `auto`).
    pub fn parsers(&self, file: &Path) -> Result<(ToolParserSetting, ReasoningParserSetting)> {
        let tool = match &self.tool_call_parser {
            None => ToolParserSetting::Auto,
            Some(v) => v.parse().map_err(|e: UnknownParser| {
                refuse(
                    file,
                    "router.tool_call_parser",
                    v,
                    &format!("expected one of {}", e.known),
                )
            })?,
        };
        let reasoning = match &self.reasoning_parser {
            None => ReasoningParserSetting::Auto,
            Some(v) => v.parse().map_err(|e: UnknownParser| {
                refuse(
                    file,
                    "router.reasoning_parser",
                    v,
                    &format!("expected one of {}", e.known),
                )
            })?,
        };
        Ok((tool, reasoning))
    }
}

/// One API key.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// The secret clients send as `Authorization: Bearer KEY`.
    pub key: String,
    /// The tenant it maps to.
    pub tenant: String,
    /// What it may do: `inference`, `metrics` (the gateway's `/metrics`)
    /// or both; default `[inference]`.
    #[serde(default)]
    pub scopes: Option<Vec<String>>,
    /// Its tenant's weight in fair admission (default 1).
    #[serde(default)]
    pub weight: Option<u32>,
    /// Its tenant's dispatch slots at most (default: its fair share only).
    #[serde(default)]
    pub max_running: Option<usize>,
    /// Its tenant's queued prompt tokens at most (default: no cap of its
    /// own; a full queue is shared fairly).
    #[serde(default)]
    pub max_queued_tokens: Option<usize>,
}

/// `router.default_share`: the share of the tenants no key gives one.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShareFields {
    /// Weight in fair admission (default 1).
    #[serde(default)]
    pub weight: Option<u32>,
    /// Dispatch slots at most.
    #[serde(default)]
    pub max_running: Option<usize>,
    /// Queued prompt tokens at most.
    #[serde(default)]
    pub max_queued_tokens: Option<usize>,
}

impl ShareFields {
    fn share(&self, at: &str, file: &Path) -> Result<Share> {
        share(
            Share::default(),
            (self.weight, self.max_running, self.max_queued_tokens),
            at,
            file,
        )
    }
}

/// `base` with the file's fields at `at` over it, checked (a weight or
/// `max_running` of 0 is refused).
fn share(
    base: Share,
    (weight, max_running, max_queued_tokens): (Option<u32>, Option<usize>, Option<usize>),
    at: &str,
    file: &Path,
) -> Result<Share> {
    let mut share = base;
    if max_queued_tokens.is_some() {
        share.max_queued_tokens = max_queued_tokens;
    }
    if let Some(w) = weight {
        share.weight = std::num::NonZeroU32::new(w)
            .ok_or_else(|| refuse(file, &format!("{at}.weight"), "0", "must be at least 1"))?;
    }
    if let Some(n) = max_running {
        share.max_running = Some(std::num::NonZeroUsize::new(n).ok_or_else(|| {
            refuse(
                file,
                &format!("{at}.max_running"),
                "0",
                "must be at least 1",
            )
        })?);
    }
    Ok(share)
}

impl ApiKey {
    /// Its tenant's share: `base` (the file's `default_share`) with the
    /// fields this key gives over it, checked (a weight or `max_running`
    /// of 0 is refused).
    pub fn share(&self, i: usize, base: Share, file: &Path) -> Result<Share> {
        share(
            base,
            (self.weight, self.max_running, self.max_queued_tokens),
            &format!("router.api_keys[{i}]"),
            file,
        )
    }

    /// Its scopes, parsed (absent: inference only); an unknown one is
    /// refused naming the key's position (never the key).
    pub fn parsed_scopes(&self, i: usize, file: &Path) -> Result<Vec<kvmesh_router::auth::Scope>> {
        match &self.scopes {
            None => Ok(vec![kvmesh_router::auth::Scope::Inference]),
            Some(list) => list
                .iter()
                .map(|s| {
                    s.parse().map_err(|e: String| {
                        refuse(file, &format!("router.api_keys[{i}].scopes"), s, &e)
                    })
                })
                .collect(),
        }
    }
}

fn default_running() -> usize {
    64
}

fn default_queued() -> usize {
    256
}
