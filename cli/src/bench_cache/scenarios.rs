//! The scenarios, each against one running gateway: the multi-turn chat
//! (and its exact repeat), requests that share nothing, and the side
//! channel between two tenants. Each returns what its requests measured;
//! the report compares targets.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use kvmesh_model::TextTokenizer;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Deserialize;
use serde_json::{json, Value};

use super::client::{send, Answer, Prompt};
use crate::loadgen::workload::build_prompt;

/// API keys of the two tenants of the started mesh (`serve --api-key`).
pub(crate) const TENANT_A: (&str, &str) = ("sk-bench-tenant-a", "bench-a");
/// The started mesh's key for its `/metrics` (scope `metrics` only).
pub(crate) const SCRAPER: (&str, &str) = ("sk-bench-scraper", "bench-scraper");
pub(crate) const TENANT_B: (&str, &str) = ("sk-bench-tenant-b", "bench-b");

/// The conversations of the multi-turn scenario: one system prompt all of
/// them share, and each conversation's user messages, in turn order
/// (`--script FILE` holds this as JSON).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Script {
    pub(crate) system: String,
    pub(crate) users: Vec<Vec<String>>,
    /// Tokens each answer may have (`max_tokens`; greedy, so an answer
    /// may end sooner at the end-of-sequence token).
    pub(crate) answer_tokens: usize,
}

impl Script {
    /// A script of `conversations` conversations of `turns` user messages
    /// of about `turn_tokens` tokens after a system prompt of about
    /// `system_tokens`, from `seed`.
    pub(crate) fn generate(
        tok: &TextTokenizer,
        words: &[&str],
        seed: u64,
        shape: Shape,
    ) -> Result<Self> {
        let mut rng = StdRng::seed_from_u64(seed);
        let system = build_prompt(tok, words, shape.system_tokens, &mut rng)?.0;
        let mut users = Vec::new();
        for _ in 0..shape.conversations {
            let mut turns = Vec::new();
            for _ in 0..shape.turns {
                turns.push(build_prompt(tok, words, shape.turn_tokens, &mut rng)?.0);
            }
            users.push(turns);
        }
        Ok(Self {
            system: system.trim_start().to_owned(),
            users,
            answer_tokens: shape.answer_tokens,
        })
    }

    /// Turns of the longest conversation.
    pub(crate) fn turns(&self) -> usize {
        self.users.iter().map(Vec::len).max().unwrap_or(0)
    }

    pub(crate) fn check(&self) -> Result<()> {
        if self.users.is_empty() || self.users.iter().any(Vec::is_empty) {
            bail!("the script needs at least one conversation, each of at least one turn");
        }
        if self.answer_tokens == 0 {
            bail!("answer_tokens must be at least 1");
        }
        Ok(())
    }
}

/// The sizes a generated [`Script`] has.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub(crate) conversations: usize,
    pub(crate) turns: usize,
    pub(crate) system_tokens: usize,
    pub(crate) turn_tokens: usize,
    pub(crate) answer_tokens: usize,
}

/// What the multi-turn scenario measured on one target, per conversation
/// and turn.
#[derive(Clone, Debug, Default)]
pub(crate) struct MultiTurn {
    pub(crate) ttft: Vec<Vec<f64>>,
    pub(crate) cached: Vec<Vec<u64>>,
    pub(crate) prompt_tokens: Vec<Vec<u64>>,
    /// Each conversation's last request, sent again exactly.
    pub(crate) repeat_ttft: Vec<f64>,
    pub(crate) repeat_cached: Vec<u64>,
}

impl MultiTurn {
    /// Requests sent.
    pub(crate) fn requests(&self) -> usize {
        self.ttft.iter().map(Vec::len).sum::<usize>() + self.repeat_ttft.len()
    }

    /// This and `other`'s conversations, as one.
    pub(crate) fn extend(&mut self, other: MultiTurn) {
        self.ttft.extend(other.ttft);
        self.cached.extend(other.cached);
        self.prompt_tokens.extend(other.prompt_tokens);
        self.repeat_ttft.extend(other.repeat_ttft);
        self.repeat_cached.extend(other.repeat_cached);
    }

    pub(crate) fn json(&self) -> Value {
        json!({
            "ttft_s": self.ttft,
            "cached_tokens": self.cached,
            "prompt_tokens": self.prompt_tokens,
            "repeat_ttft_s": self.repeat_ttft,
            "repeat_cached_tokens": self.repeat_cached,
        })
    }
}

/// One conversation: its messages so far.
struct Conversation {
    messages: Vec<Value>,
    answers: Vec<Answer>,
}

impl Conversation {
    fn new(system: &str) -> Self {
        Self {
            messages: vec![json!({"role": "system", "content": system})],
            answers: Vec::new(),
        }
    }

    /// Sends the next user message with the whole history; the answer
    /// joins the history.
    async fn turn(&mut self, addr: &str, user: &str, s: &Script, timeout: Duration) -> Result<()> {
        self.messages.push(json!({"role": "user", "content": user}));
        let msgs = Value::Array(self.messages.clone());
        let a = send(
            addr,
            TENANT_A.0,
            Prompt::Chat(&msgs),
            s.answer_tokens,
            timeout,
        )
        .await?;
        self.messages
            .push(json!({"role": "assistant", "content": a.text}));
        self.answers.push(a);
        Ok(())
    }

    /// The last request again, exactly.
    async fn repeat(&self, addr: &str, s: &Script, timeout: Duration) -> Result<Answer> {
        let last = Value::Array(self.messages[..self.messages.len() - 1].to_vec());
        send(
            addr,
            TENANT_A.0,
            Prompt::Chat(&last),
            s.answer_tokens,
            timeout,
        )
        .await
    }
}

/// The conversations of `script`, as tenant A: concurrently (each its
/// turns in order), or `sequential` (turn 1 of every conversation, then
/// turn 2, ...: one request at a time); then each conversation's last
/// request again.
pub(crate) async fn multi_turn(
    addr: &str,
    script: &Script,
    sequential: bool,
    timeout: Duration,
) -> Result<MultiTurn> {
    let mut convs: Vec<Conversation> = script
        .users
        .iter()
        .map(|_| Conversation::new(&script.system))
        .collect();
    let mut repeats = Vec::new();
    if sequential {
        for t in 0..script.turns() {
            for (c, users) in convs.iter_mut().zip(&script.users) {
                if let Some(u) = users.get(t) {
                    c.turn(addr, u, script, timeout).await?;
                }
            }
        }
        for c in &convs {
            repeats.push(c.repeat(addr, script, timeout).await?);
        }
    } else {
        let mut tasks = tokio::task::JoinSet::new();
        for (i, (mut c, users)) in convs.drain(..).zip(script.users.clone()).enumerate() {
            let (addr, s) = (addr.to_owned(), script.clone());
            tasks.spawn(async move {
                for u in &users {
                    c.turn(&addr, u, &s, timeout).await?;
                }
                let r = c.repeat(&addr, &s, timeout).await?;
                anyhow::Ok((i, c, r))
            });
        }
        let mut done = Vec::new();
        while let Some(r) = tasks.join_next().await {
            done.push(r.context("a conversation's task failed")??);
        }
        done.sort_by_key(|(i, _, _)| *i);
        for (_, c, r) in done {
            convs.push(c);
            repeats.push(r);
        }
    }
    let mut out = MultiTurn::default();
    for (c, r) in convs.iter().zip(repeats) {
        out.ttft.push(c.answers.iter().map(|a| a.ttft).collect());
        out.cached
            .push(c.answers.iter().map(|a| a.cached_tokens).collect());
        out.prompt_tokens
            .push(c.answers.iter().map(|a| a.prompt_tokens).collect());
        out.repeat_ttft.push(r.ttft);
        out.repeat_cached.push(r.cached_tokens);
    }
    Ok(out)
}

/// Prompts of `tokens` tokens that share nothing (random words from the
/// first), from `seed`.
pub(crate) fn fresh_prompts(
    tok: &TextTokenizer,
    words: &[&str],
    seed: u64,
    n: usize,
    tokens: usize,
) -> Result<Vec<String>> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| Ok(build_prompt(tok, words, tokens, &mut rng)?.0))
        .collect()
}

/// Each prompt once, one at a time, as tenant A: TTFT and cached tokens.
pub(crate) async fn no_sharing(
    addr: &str,
    prompts: &[String],
    max_tokens: usize,
    timeout: Duration,
) -> Result<Vec<Answer>> {
    let mut out = Vec::new();
    for p in prompts {
        out.push(send(addr, TENANT_A.0, Prompt::Text(p), max_tokens, timeout).await?);
    }
    Ok(out)
}

/// The four requests of one side-channel sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Probe {
    /// Tenant A's first sight of the prompt: a cold miss.
    ACold,
    /// A's exact repeat: a hit.
    ARepeat,
    /// Tenant B, the same prompt: must cost what a cold miss costs.
    BSame,
    /// B, a prompt nobody sent (the control cold miss).
    BFresh,
}

impl Probe {
    pub(crate) const ALL: [Probe; 4] = [Probe::ACold, Probe::ARepeat, Probe::BSame, Probe::BFresh];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Probe::ACold => "a_cold",
            Probe::ARepeat => "a_repeat",
            Probe::BSame => "b_same",
            Probe::BFresh => "b_fresh",
        }
    }
}

/// `samples` rounds of: A sends a fresh prompt P; then, in an order drawn
/// from `seed`, A repeats P, B sends P, and B sends another fresh prompt.
/// Returns every request's probe and answer.
pub(crate) async fn side_channel(
    addr: &str,
    tok: &TextTokenizer,
    words: &[&str],
    seed: u64,
    samples: usize,
    tokens: usize,
    timeout: Duration,
) -> Result<Vec<(Probe, Answer)>> {
    let prompts = fresh_prompts(tok, words, seed, 2 * samples, tokens)?;
    let mut order_rng = StdRng::seed_from_u64(seed ^ 0x5349_4445);
    let mut out = Vec::new();
    for pair in prompts.chunks_exact(2) {
        let (p, control) = (&pair[0], &pair[1]);
        let mut rest = [Probe::ARepeat, Probe::BSame, Probe::BFresh];
        rest.shuffle(&mut order_rng);
        for probe in std::iter::once(Probe::ACold).chain(rest) {
            let (key, text) = match probe {
                Probe::ACold | Probe::ARepeat => (TENANT_A.0, p),
                Probe::BSame => (TENANT_B.0, p),
                Probe::BFresh => (TENANT_B.0, control),
            };
            out.push((
                probe,
                send(addr, key, Prompt::Text(text), 1, timeout).await?,
            ));
        }
    }
    Ok(out)
}
