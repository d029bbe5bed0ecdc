//! Tokenization as a service, for HTTP (vLLM's `/tokenize` and
//! `/detokenize`) and the public gRPC API (`Tokenize`, `Detokenize`) alike.
//!
//! A prompt or a conversation is encoded exactly as a generation request
//! with the same input is ([`validate::request`]'s encodings and role
//! checks), so a client can count or inspect what the mesh will run; in
//! particular chat content goes through
//! [`TextTokenizer::encode_chat_with`](kvmesh_tokenizer::TextTokenizer::encode_chat_with),
//! where special-token text in a message stays text. Nothing here reaches
//! a node.

use kvmesh_tokenizer::ChatMessage;

use crate::error::Rejection;
use crate::validate::{self, invalid};
use crate::Router;

/// What to tokenize, with vLLM's switches.
#[derive(Clone, Debug)]
pub enum Input {
    /// Text, as a completions prompt.
    Prompt {
        /// The text; special-token text in it becomes those tokens, as in a
        /// completions prompt.
        text: String,
        /// Add what the tokenizer adds (BOS where the model says so); what
        /// a completions request gets. vLLM's default: yes.
        add_special_tokens: bool,
    },
    /// A conversation, through the model's chat template.
    Chat {
        /// The messages, oldest first (roles checked as for generation).
        messages: Vec<ChatMessage>,
        /// Append the assistant's generation prompt (what a chat request
        /// runs). vLLM's default: yes.
        add_generation_prompt: bool,
        /// Add the tokenizer's BOS on top of what the template writes, as
        /// vLLM does when asked. vLLM's default: no.
        add_special_tokens: bool,
    },
}

/// A tokenization's result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tokens {
    /// The ids, in order.
    pub ids: Vec<u32>,
    /// The vocabulary entry of each id, when asked for.
    pub strs: Option<Vec<String>>,
}

/// `input` as token ids (and their vocabulary entries if `with_strs`),
/// or the typed refusal naming the field.
pub fn tokenize(
    r: &Router,
    model: Option<&str>,
    input: Input,
    with_strs: bool,
) -> Result<Tokens, Rejection> {
    validate::model(r, model)?;
    let t = r.tokenizer();
    let ids = match input {
        Input::Prompt {
            text,
            add_special_tokens,
        } => if add_special_tokens {
            t.encode(&text)
        } else {
            t.encode_raw(&text)
        }
        .map_err(|e| invalid("prompt", e.to_string()))?,
        Input::Chat {
            messages,
            add_generation_prompt,
            add_special_tokens,
        } => {
            let ids = t
                .encode_chat_with(&validate::roles(&messages)?, add_generation_prompt)
                .map_err(|e| invalid("messages", e.to_string()))?;
            if add_special_tokens {
                t.with_bos(ids)
            } else {
                ids
            }
        }
    };
    let strs = with_strs.then(|| {
        ids.iter()
            .map(|&id| t.id_to_token(id).unwrap_or_default())
            .collect()
    });
    Ok(Tokens { ids, strs })
}

/// The text of `ids` (special tokens kept, as vLLM's `/detokenize`), or a
/// refusal naming `param` for an id outside the vocabulary.
pub fn detokenize(
    r: &Router,
    model: Option<&str>,
    ids: &[u32],
    param: &'static str,
) -> Result<String, Rejection> {
    validate::model(r, model)?;
    validate::in_vocabulary(r, ids, param)?;
    r.tokenizer()
        .decode(ids, false)
        .map_err(|e| invalid(param, e.to_string()))
}
