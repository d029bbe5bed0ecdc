//! Qwen3 (and QwQ, Qwen 3.5, and R1 distillations whose template opens the
//! block): `<think>...</think>` before the answer. The output is reasoning
//! from its start when it opens with `<think>` or when the prompt left one
//! open (thinking models put it in the generation prompt, as vLLM's
//! `qwen3` parser tolerates); otherwise the model is answering without
//! thinking (`enable_thinking: false` writes a closed, empty block into
//! the prompt; instruct-only models write none) and it is all content.
//! `<tool_call>` inside reasoning ends it, as Qwen 3.5 may call a tool
//! without closing the block.

use super::think::{Rules, Think, CLOSE, OPEN};
use super::{ReasoningParser, ReasoningStream};

/// The `qwen3` format.
#[derive(Clone, Copy, Debug, Default)]
pub struct Qwen3;

impl ReasoningParser for Qwen3 {
    fn name(&self) -> &'static str {
        "qwen3"
    }

    fn speaks(&self, template: &str) -> bool {
        template.contains(OPEN)
    }

    fn markers(&self) -> &'static [&'static str] {
        &[OPEN, CLOSE]
    }

    fn stream(&self, opened: bool) -> Box<dyn ReasoningStream> {
        Box::new(Think::new(
            Rules {
                implicit: false,
                tool_call_ends: true,
            },
            opened,
        ))
    }
}
