//! The mesh file's `router` section: the gateway's listeners, its limits,
//! API keys and the answer parsers.

use std::path::Path;

use anyhow::Result;
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
    /// Requests dispatched at once.
    #[serde(default = "default_running")]
    pub max_running: usize,
    /// Requests queued at most.
    #[serde(default = "default_queued")]
    pub max_queued: usize,
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
}

impl ApiKey {
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
