//! DeepSeek-R1 (and its distillations): `<think>...</think>` before the
//! answer. R1's later templates open the block in the generation prompt
//! and the model may not write `<think>` at all, so everything before
//! `</think>` is reasoning whether or not it was opened (vLLM's
//! `deepseek_r1`): an answer with no `</think>` is all reasoning.

use super::think::{Rules, Think, CLOSE, OPEN};
use super::{ReasoningParser, ReasoningStream};

/// The `deepseek_r1` format.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeepSeekR1;

impl ReasoningParser for DeepSeekR1 {
    fn name(&self) -> &'static str {
        "deepseek_r1"
    }

    /// Never chosen by `auto`: a template with `<think>` gets `qwen3`,
    /// which reads R1's output the same way when the template opens the
    /// block (R1 0528 and later) and does not take an answer without tags
    /// for reasoning.
    fn speaks(&self, _template: &str) -> bool {
        false
    }

    fn markers(&self) -> &'static [&'static str] {
        &[OPEN, CLOSE]
    }

    fn stream(&self, opened: bool) -> Box<dyn ReasoningStream> {
        Box::new(Think::new(
            Rules {
                implicit: true,
                tool_call_ends: false,
            },
            opened,
        ))
    }
}
