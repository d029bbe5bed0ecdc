//! [`TextTokenizer`]: text to token ids and back, chat templates, and
//! [`StreamDecoder`] for incremental detokenization.
//!
//! A Hugging Face directory provides `tokenizer.json` (read by the
//! `tokenizers` crate as is) and optionally `tokenizer_config.json`; a GGUF
//! file provides a vocabulary from which the tokenizer transformers would
//! build is built: byte-level BPE or SentencePiece (submodule `gguf`). Chat
//! templates are rendered with minijinja in `chat`; streaming
//! detokenization lives in `stream`.
//!
//! `encode` follows `tokenizer(text)` in transformers: special-token text in
//! the input (such as `<|im_start|>`) becomes the special token, and BOS
//! (EOS) is added only when the model's tokenizer says so, and not a second
//! time when the text already has it. [`TextTokenizer::encode_raw`] adds
//! nothing (templates write their own BOS).
//!
//! [`TextTokenizer::encode_chat`] owns this invariant: **message content
//! never becomes control tokens; only the special tokens the chat template
//! itself writes do.** Special-token text a user puts in a message (say
//! `hi<|im_end|>\n<|im_start|>system\n...`) is tokenized as the ordinary
//! text it is, so it cannot forge a turn. For content without special-token
//! text the ids are exactly those of `encode_raw` on the rendered template,
//! i.e. what Hugging Face's tokenizer gives for the rendering; a template
//! that rewrites or inspects content so that it cannot be kept apart is
//! refused with a `ChatTemplate` error. The submodule `chat_encode` does it.

mod chat;
mod chat_encode;
mod gguf;
mod stream;
mod tools;

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use crate::error::{Result, TokenizerError};

pub use stream::StreamDecoder;

#[cfg(any(test, feature = "testing"))]
pub(crate) use self::gguf::byte_chars;
pub use tools::{FunctionCall, ToolCall};

/// One message of a conversation, as chat templates expect it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant` (templates may accept others).
    pub role: String,
    /// The message text.
    pub content: String,
    /// An assistant message's calls of tools (absent for templates when
    /// empty, as transformers leaves it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A `tool` message: the function's name, when the client gave it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant message's reasoning, as a reasoning model's answer
    /// carried it back (templates such as Qwen3's read it; the others
    /// ignore it). Template text: refused if it holds special-token text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// How a conversation is rendered besides its messages and tools:
/// `apply_chat_template`'s keyword arguments that kvmesh passes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChatOptions {
    /// Append the assistant's generation prompt.
    pub add_generation_prompt: bool,
    /// `enable_thinking` for templates that read it (Qwen3's: `false`
    /// writes an empty, closed `<think>` block into the generation
    /// prompt); `None` leaves it undefined, the template's default.
    pub enable_thinking: Option<bool>,
}

impl ChatOptions {
    /// With the generation prompt or not, nothing else set.
    pub fn prompt(add_generation_prompt: bool) -> Self {
        Self {
            add_generation_prompt,
            enable_thinking: None,
        }
    }
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }
}

/// A model's tokenizer with its special tokens and chat template. Cloning
/// copies the vocabulary (a few MB): done once per process, for the router.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// What [`TextTokenizer::encode_chat`] encodes with (a copy of `inner`
    /// that reads special-token text as text, and the added-token table).
    chat: Arc<chat_encode::ChatEncoder>,
    /// One past the largest id the tokenizer can produce.
    vocab_size: usize,
    bos_token: Option<String>,
    bos_id: Option<u32>,
    eos_token: Option<String>,
    eos_ids: Vec<u32>,
    /// Prepend BOS in [`TextTokenizer::encode`] if the tokenizer itself did not.
    add_bos: bool,
    /// Append this EOS in [`TextTokenizer::encode`] if the ids do not
    /// already end with it (GGUF `add_eos_token`).
    add_eos: Option<u32>,
    chat_template: Option<String>,
}

/// A tokenizer's special tokens and whether `encode` adds them, as a
/// source (a Hugging Face directory, a GGUF file) states them.
#[derive(Clone, Debug, Default)]
pub(crate) struct Specials {
    pub(crate) bos_token: Option<String>,
    pub(crate) bos_id: Option<u32>,
    pub(crate) eos_token: Option<String>,
    /// The ids that end generation, EOS first.
    pub(crate) eos_ids: Vec<u32>,
    /// Prepend BOS (only where `bos_id` is known).
    pub(crate) add_bos: bool,
    /// The EOS id to append, if the source says to.
    pub(crate) add_eos: Option<u32>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("eos_ids", &self.eos_ids)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish_non_exhaustive()
    }
}

impl TextTokenizer {
    /// Load `tokenizer.json` from a Hugging Face model directory, with
    /// `tokenizer_config.json` when present (`chat_template`, `bos_token`,
    /// `eos_token`, `add_bos_token`). A chat template may also come from
    /// `chat_template.jinja` or `chat_template.json`, as newer checkpoints
    /// store it.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => TokenizerError::MissingFile {
                path: path.clone(),
                what: "tokenizer.json",
            },
            _ => TokenizerError::io(&path, e),
        })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            TokenizerError::malformed(
                &path,
                format!("not a tokenizer the tokenizers crate can read: {e}"),
            )
        })?;

        let config_path = dir.join("tokenizer_config.json");
        let config = match std::fs::read_to_string(&config_path) {
            Ok(text) => match serde_json::from_str::<Value>(&text) {
                Ok(Value::Object(obj)) => obj,
                Ok(_) => {
                    return Err(TokenizerError::malformed(
                        &config_path,
                        "the top level is not a JSON object",
                    ))
                }
                Err(e) => {
                    return Err(TokenizerError::malformed(
                        &config_path,
                        format!("not valid JSON: {e}"),
                    ))
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Map::new(),
            Err(e) => return Err(TokenizerError::io(&config_path, e)),
        };
        let token_field = |key: &str| -> Result<Option<String>> {
            match config.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(v) => match v.get("content") {
                    Some(Value::String(s)) => Ok(Some(s.clone())),
                    _ => Err(invalid(
                        &config_path,
                        key,
                        v,
                        "expected a string or {\"content\": string}",
                    )),
                },
            }
        };
        let bos_token = token_field("bos_token")?;
        let eos_token = token_field("eos_token")?;
        let add_bos = match config.get("add_bos_token") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(invalid(
                    &config_path,
                    "add_bos_token",
                    v,
                    "expected true or false",
                ))
            }
        };
        let chat_template = match config.get("chat_template") {
            None | Some(Value::Null) => chat::template_from_side_files(dir)?,
            Some(v) => Some(chat::template_from_config_value(&config_path, v)?),
        };

        let bos_id = bos_token.as_deref().and_then(|t| inner.token_to_id(t));
        let eos_ids = eos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .into_iter()
            .collect();
        // EOS, when a checkpoint adds it, is in tokenizer.json's
        // post-processor, which `encode` runs.
        let specials = Specials {
            bos_token,
            bos_id,
            eos_token,
            eos_ids,
            add_bos,
            add_eos: None,
        };
        Self::assemble(inner, specials, chat_template)
    }

    /// The one place every tokenizer is finished, whatever its source. A
    /// `tokenizer.json` may carry `truncation` or `padding` (common after
    /// `save_pretrained`): either would silently change a prompt, so both
    /// are switched off here. kvmesh never cuts or pads a prompt; one past
    /// the context is refused by admission, naming its length.
    pub(crate) fn assemble(
        mut inner: tokenizers::Tokenizer,
        specials: Specials,
        chat_template: Option<String>,
    ) -> Result<Self> {
        inner
            .with_truncation(None)
            .map_err(|e| TokenizerError::Tokenizer {
                detail: format!("cannot switch truncation off: {e}"),
            })?;
        inner.with_padding(None);
        let Specials {
            bos_token,
            bos_id,
            eos_token,
            eos_ids,
            add_bos,
            add_eos,
        } = specials;
        let chat = Arc::new(chat_encode::ChatEncoder::new(&inner));
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        Ok(Self {
            inner,
            chat,
            vocab_size,
            bos_token,
            bos_id,
            eos_token,
            eos_ids,
            add_bos: add_bos && bos_id.is_some(),
            add_eos,
            chat_template,
        })
    }

    /// Token ids of `text`, as `tokenizer(text)` in transformers: special
    /// tokens written in the text become those tokens, BOS is prepended
    /// when the tokenizer is configured to add it (and the text did not
    /// already begin with it), and EOS appended likewise (a GGUF file's
    /// `add_eos_token`). Unlike transformers, a text that already begins
    /// with BOS (ends with EOS) does not get a second one.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.with_bos(self.encode_with(text, true)?);
        if let Some(eos) = self.add_eos {
            if ids.last() != Some(&eos) {
                ids.push(eos);
            }
        }
        Ok(ids)
    }

    /// `ids` with BOS prepended when the tokenizer is configured to add it
    /// and they do not already begin with it (what `encode` adds).
    pub fn with_bos(&self, mut ids: Vec<u32>) -> Vec<u32> {
        if let Some(bos) = self.bos_id.filter(|_| self.add_bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        ids
    }

    /// Token ids of `text` with nothing added (no BOS, no post-processor);
    /// special-token text anywhere in `text` becomes the special token, so
    /// this is not how to encode a conversation that holds user text: use
    /// [`TextTokenizer::encode_chat`].
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, false)
    }

    fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Tokenizer {
                detail: format!("cannot encode the text: {e}"),
            })
    }

    /// Text of `ids`; special tokens are dropped if `skip_special_tokens`.
    /// Ids the vocabulary lacks are skipped.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Tokenizer {
                detail: format!("cannot decode {} ids: {e}", ids.len()),
            })
    }

    /// One past the largest token id (added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The tokenizer as `tokenizer.json` text (what the `tokenizers` crate
    /// writes; a GGUF vocabulary's too), for libraries that read every
    /// token's bytes themselves (structured output's token trie).
    pub fn to_json(&self) -> Result<String> {
        self.inner
            .to_string(false)
            .map_err(|e| TokenizerError::Tokenizer {
                detail: format!("cannot write the tokenizer as JSON: {e}"),
            })
    }

    /// The id of a token written as its vocabulary entry (e.g. `<|im_end|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary entry of `id` (e.g. `Ġthe` in a byte-level BPE), if
    /// the vocabulary has it.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Ids that end generation according to the tokenizer's configuration.
    /// The model configuration may name more (`ModelConfig::eos_token_ids`).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_ids.clone()
    }

    /// The beginning-of-sequence token's text, if the model names one.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The end-of-sequence token's text, if the model names one.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The Jinja chat template, if the model ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Render `messages` with the model's chat template, as transformers'
    /// `apply_chat_template(..., tokenize=False)` does. To tokenize a
    /// conversation use [`TextTokenizer::encode_chat`]: `encode_raw` of
    /// this string would turn special-token text in message content into
    /// control tokens.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.apply_chat_template_tools(messages, &[], add_generation_prompt)
    }

    /// [`TextTokenizer::apply_chat_template`] with `tools` (function
    /// definitions, `{"type": "function", "function": {...}}`) offered to
    /// the model: passed to a template that reads `tools`, else written as
    /// Hermes templates do (see [`TextTokenizer::encode_chat_tools`]).
    pub fn apply_chat_template_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self.template()?;
        let (messages, tools) = with_tools(template, messages, tools);
        chat::render(
            template,
            &messages,
            tools,
            ChatOptions::prompt(add_generation_prompt),
            self.bos_token(),
            self.eos_token(),
        )
    }

    /// Chat messages to token ids, as a chat request is run: rendered
    /// through the chat template with the generation prompt, nothing added
    /// (the template writes any BOS itself, as transformers'
    /// `apply_chat_template(tokenize=True)` assumes).
    ///
    /// Message content never becomes control tokens; only the special
    /// tokens the template itself writes do. Special-token text in content
    /// (`<|im_end|>` typed by a user) is encoded as ordinary text, so it
    /// cannot end a turn or open a forged one. For content without
    /// special-token text the ids are exactly
    /// `encode_raw(&apply_chat_template(messages, true)?)`, Hugging Face's
    /// tokenization of the rendering.
    ///
    /// Errors with [`TokenizerError::ChatTemplate`] when there is no
    /// template, it fails to render, it rewrites or inspects content so that
    /// the content cannot be located in its output (slicing, `upper`...),
    /// or a role contains special-token text (roles are template text).
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        self.encode_chat_with(messages, true)
    }

    /// [`TextTokenizer::encode_chat`], with the generation prompt only if
    /// `add_generation_prompt` (vLLM's `/tokenize` lets a client choose).
    /// The same guarantee: content never becomes control tokens.
    pub fn encode_chat_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        self.encode_chat_tools(messages, &[], add_generation_prompt)
    }

    /// [`TextTokenizer::encode_chat_with`] with `tools` (function
    /// definitions, `{"type": "function", "function": {...}}`) offered to
    /// the model, and messages that may carry tool calls and answers.
    ///
    /// A template that reads `tools` renders them and the tool messages
    /// itself, as transformers has it; a string in the tool parts that
    /// holds special-token text is then refused (`ChatTemplate`), since
    /// the template writes it as its own text. A template that does not
    /// read `tools` gets the conversation rewritten as Hermes and Qwen2.5
    /// templates render it (tools listed in a system message, calls as
    /// `<tool_call>` blocks, answers as `<tool_response>` blocks in a user
    /// turn), all of it message content and so protected like any.
    pub fn encode_chat_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        self.encode_chat_opts(messages, tools, ChatOptions::prompt(add_generation_prompt))
    }

    /// [`TextTokenizer::encode_chat_tools`] with the template's other
    /// arguments ([`ChatOptions`]). The same guarantee: content never
    /// becomes control tokens.
    pub fn encode_chat_opts(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        opts: ChatOptions,
    ) -> Result<Vec<u32>> {
        let template = self.template()?;
        let (messages, tools) = with_tools(template, messages, tools);
        self.chat.encode(self, template, &messages, tools, opts)
    }

    fn template(&self) -> Result<&str> {
        self.chat_template
            .as_deref()
            .ok_or_else(|| TokenizerError::ChatTemplate {
                detail: "the model has no chat template (none in tokenizer_config.json or the \
                         GGUF metadata); send a plain prompt instead"
                    .into(),
            })
    }

    /// A decoder that turns ids into text one at a time (special tokens skipped).
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }
}

/// The messages and tools a template is given: as they are for one that
/// reads `tools` (`Some`), or rewritten the Hermes way (`None`: no tools
/// variable).
fn with_tools<'m>(
    template: &str,
    messages: &'m [ChatMessage],
    tools: &'m [Value],
) -> (std::borrow::Cow<'m, [ChatMessage]>, Option<&'m [Value]>) {
    use std::borrow::Cow;
    if !tools::involves_tools(messages, tools) {
        return (Cow::Borrowed(messages), None);
    }
    if tools::template_reads_tools(template) {
        (Cow::Borrowed(messages), Some(tools))
    } else {
        (Cow::Owned(tools::hermes(messages, tools)), None)
    }
}

pub(crate) fn invalid(path: &Path, field: &str, v: &Value, reason: &str) -> TokenizerError {
    let mut value = v.to_string();
    if value.len() > 80 {
        let cut = (0..=77)
            .rev()
            .find(|&i| value.is_char_boundary(i))
            .unwrap_or(0);
        value.truncate(cut);
        value.push_str("...");
    }
    TokenizerError::InvalidField {
        path: path.to_owned(),
        field: field.to_owned(),
        value,
        reason: reason.to_owned(),
    }
}

#[cfg(test)]
mod tests;
