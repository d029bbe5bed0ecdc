//! Logprobs as OpenAI's two response shapes carry them: completions'
//! parallel lists (`tokens`, `token_logprobs`, `top_logprobs`,
//! `text_offset`) and chat's list of entries (`token`, `logprob`, `bytes`,
//! `top_logprobs`). The numbers are the sampler's (`mesh::TokenLogprob`);
//! this module only names the tokens and lays them out, for a whole answer
//! or one streamed chunk at a time.

use kvmesh_tokenizer::TextTokenizer;
use serde_json::{json, Map, Value};

use crate::mesh::{PromptToken, TokenLogprob};

/// What a logprob of minus infinity is written as (JSON has no infinity;
/// vLLM writes the same).
const FLOOR: f32 = -9999.0;

/// One token, named.
struct Named {
    id: u32,
    text: String,
    bytes: Vec<u8>,
    logprob: f32,
}

struct Entry {
    token: Named,
    top: Vec<Named>,
    /// Characters before this token's text in the answer.
    offset: usize,
    /// False for the prompt's first token (echo): nothing precedes it, so
    /// it has no logprob and no alternatives (OpenAI and vLLM write null).
    scored: bool,
}

/// Logprobs of some tokens of one answer.
pub(crate) struct Logprobs<'a> {
    tokenizer: &'a TextTokenizer,
    /// Characters of the answer before the next token (its text offset).
    offset: usize,
    entries: Vec<Entry>,
}

impl<'a> Logprobs<'a> {
    /// None yet; the answer's first token starts at character `offset` (an
    /// echoed prompt's length).
    pub(crate) fn new(tokenizer: &'a TextTokenizer, offset: usize) -> Self {
        Self {
            tokenizer,
            offset,
            entries: Vec::new(),
        }
    }

    fn named(&self, id: u32, logprob: f32) -> Named {
        // A token alone may be part of a character: its text then has
        // U+FFFD where the character's bytes are; `bytes` are exact for
        // whole-character tokens.
        let text = self.tokenizer.decode(&[id], false).unwrap_or_default();
        Named {
            id,
            bytes: text.as_bytes().to_vec(),
            text,
            logprob: if logprob.is_finite() { logprob } else { FLOOR },
        }
    }

    fn entry(&mut self, t: &TokenLogprob) -> Entry {
        let token = self.named(t.id, t.logprob);
        let top = t.top.iter().map(|&(id, lp)| self.named(id, lp)).collect();
        let offset = self.offset;
        self.offset += token.text.chars().count();
        Entry {
            token,
            top,
            offset,
            scored: true,
        }
    }

    /// The prompt's tokens (`echo` with `logprobs`), with `k`
    /// alternatives each, before any token of the answer: their offsets
    /// run from 0 through the echoed prompt; the answer's go on from
    /// where [`Self::new`] put them (the echoed text's length).
    pub(crate) fn prompt(&mut self, tokens: &[PromptToken], k: usize) {
        let answer = std::mem::replace(&mut self.offset, 0);
        for t in tokens {
            let mut e = match &t.score {
                Some(s) => {
                    let mut top = s.top.clone();
                    top.truncate(k);
                    self.entry(&TokenLogprob {
                        id: t.id,
                        logprob: s.logprob,
                        top,
                    })
                }
                None => self.entry(&TokenLogprob {
                    id: t.id,
                    logprob: 0.0,
                    top: Vec::new(),
                }),
            };
            e.scored = t.score.is_some();
            self.entries.push(e);
        }
        self.offset = answer;
    }

    /// Adds `tokens` (the next of the answer).
    pub(crate) fn extend(&mut self, tokens: &[TokenLogprob]) {
        for t in tokens {
            let e = self.entry(t);
            self.entries.push(e);
        }
    }

    /// `tokens` (the next of the answer) on their own, for one streamed
    /// chunk; offsets go on from this answer's.
    pub(crate) fn part(&mut self, tokens: &[TokenLogprob]) -> Logprobs<'a> {
        let entries = tokens.iter().map(|t| self.entry(t)).collect();
        Logprobs {
            tokenizer: self.tokenizer,
            offset: self.offset,
            entries,
        }
    }

    /// Completions' shape. `top_logprobs` maps text to logprob and holds
    /// the chosen token too (as vLLM's does).
    pub(crate) fn completion(&self) -> Value {
        let top: Vec<Value> = self
            .entries
            .iter()
            .map(|e| {
                if !e.scored {
                    return Value::Null;
                }
                let mut m = Map::new();
                for n in e.top.iter().chain(std::iter::once(&e.token)) {
                    m.entry(n.text.clone()).or_insert(json!(n.logprob));
                }
                Value::Object(m)
            })
            .collect();
        json!({
            "tokens": self.entries.iter().map(|e| e.token.text.as_str()).collect::<Vec<_>>(),
            "token_logprobs": self.entries.iter().map(|e| e.scored.then_some(e.token.logprob)).collect::<Vec<_>>(),
            "top_logprobs": top,
            "text_offset": self.entries.iter().map(|e| e.offset).collect::<Vec<_>>(),
        })
    }

    /// Chat's shape.
    pub(crate) fn chat(&self) -> Value {
        let one = |n: &Named| json!({"token": n.text, "logprob": n.logprob, "bytes": n.bytes});
        let content: Vec<Value> = self
            .entries
            .iter()
            .map(|e| {
                let mut v = one(&e.token);
                v["top_logprobs"] = e.top.iter().map(one).collect();
                v
            })
            .collect();
        json!({"content": content, "refusal": null})
    }

    /// The public gRPC API's shape.
    pub(crate) fn grpc(&self) -> Vec<kvmesh_proto::v1::TokenLogprob> {
        use kvmesh_proto::v1::{TokenLogprob as Msg, TopLogprob};
        self.entries
            .iter()
            .map(|e| Msg {
                token_id: e.token.id,
                token: e.token.text.clone(),
                bytes: e.token.bytes.clone(),
                logprob: e.token.logprob,
                top_logprobs: e
                    .top
                    .iter()
                    .map(|n| TopLogprob {
                        token_id: n.id,
                        token: n.text.clone(),
                        bytes: n.bytes.clone(),
                        logprob: n.logprob,
                    })
                    .collect(),
            })
            .collect()
    }
}

/// vLLM's `prompt_logprobs`: `null` for the first prompt token, then per
/// token a map from token id (a string, as JSON keys are) to `logprob`,
/// `rank` and `decoded_token`, holding the prompt's own token first and
/// the `k` most likely.
pub(crate) fn vllm_prompt(tokenizer: &TextTokenizer, tokens: &[PromptToken], k: usize) -> Value {
    let text = |id: u32| tokenizer.decode(&[id], false).unwrap_or_default();
    let one = |id: u32, logprob: f32, rank: u32| {
        json!({
            "logprob": if logprob.is_finite() { logprob } else { FLOOR },
            "rank": rank,
            "decoded_token": text(id),
        })
    };
    tokens
        .iter()
        .map(|t| {
            let Some(s) = &t.score else {
                return Value::Null;
            };
            let mut m = Map::new();
            m.insert(t.id.to_string(), one(t.id, s.logprob, s.rank));
            for (i, &(id, lp)) in s.top.iter().take(k).enumerate() {
                m.entry(id.to_string())
                    .or_insert_with(|| one(id, lp, u32::try_from(i + 1).unwrap_or(u32::MAX)));
            }
            Value::Object(m)
        })
        .collect()
}

/// The public gRPC API's `prompt_logprobs`: one entry per prompt token,
/// `k` alternatives each; the first token's entry names it with logprob 0
/// and no alternatives (see `GenerateResponse.prompt_logprobs`).
pub(crate) fn grpc_prompt(
    tokenizer: &TextTokenizer,
    tokens: &[PromptToken],
    k: usize,
) -> Vec<kvmesh_proto::v1::TokenLogprob> {
    let mut l = Logprobs::new(tokenizer, 0);
    l.prompt(tokens, k);
    let mut out = l.grpc();
    if let Some(first) = out.first_mut() {
        first.logprob = 0.0;
        first.top_logprobs.clear();
    }
    out
}
