//! Logprobs as OpenAI's two response shapes carry them: completions'
//! parallel lists (`tokens`, `token_logprobs`, `top_logprobs`,
//! `text_offset`) and chat's list of entries (`token`, `logprob`, `bytes`,
//! `top_logprobs`). The numbers are the sampler's (`mesh::TokenLogprob`);
//! this module only names the tokens and lays them out, for a whole answer
//! or one streamed chunk at a time.

use kvmesh_tokenizer::TextTokenizer;
use serde_json::{json, Map, Value};

use crate::mesh::TokenLogprob;

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
        Entry { token, top, offset }
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
                let mut m = Map::new();
                for n in e.top.iter().chain(std::iter::once(&e.token)) {
                    m.entry(n.text.clone()).or_insert(json!(n.logprob));
                }
                Value::Object(m)
            })
            .collect();
        json!({
            "tokens": self.entries.iter().map(|e| e.token.text.as_str()).collect::<Vec<_>>(),
            "token_logprobs": self.entries.iter().map(|e| e.token.logprob).collect::<Vec<_>>(),
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
