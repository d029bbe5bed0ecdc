//! The 8-bit-activation numerics class (`--activations int8`) against
//! transformers, on the real GGUFs the project ships, in the quantized mode.
//! The reference computes with f32 activations on the same dequantized
//! weights, so besides summation order the class adds its activations'
//! rounding (half a step of a 32-value group's scale per value): its
//! tolerance, [`INT8`], is measured on these files and stated here, and the
//! greedy text of every golden prompt is the reference's up to the first
//! step where the reference's top-2 gap is below the class's `gap_tie`.
//!
//! The class is a property of the process, so this file is its own test
//! binary: every test selects it first.

mod common;

use common::golden::{check_greedy, quantized_engine_for, read_golden, Tolerance};
use kvmesh_kernels::cpu::{self, Activations};
use kvmesh_model::engine::Engine;

/// The 8-bit-activation class's tolerance (see the module docs).
const INT8: Tolerance = Tolerance {
    abs: 0.3,
    rel: 0.05,
    gap_tie: 0.3,
};

fn int8_engine(name: &str) -> Option<Engine> {
    assert_eq!(
        cpu::select_activations(Activations::Int8),
        Ok(Activations::Int8)
    );
    let path = if name == "smollm2" {
        common::smollm2()?
    } else {
        common::shipped(name)?
    };
    let engine = quantized_engine_for(&path);
    assert!(cpu::numerics().ends_with("-i8"), "{}", cpu::numerics());
    Some(engine)
}

fn check(name: &str, golden: &str) {
    let Some(engine) = int8_engine(name) else {
        return;
    };
    let worst = check_greedy(&engine, &read_golden(golden), None, &INT8);
    eprintln!("{name} int8: worst logit error = {worst:.3} of tolerance");
    assert_eq!(
        engine.pool().free_pages(),
        engine.pool().capacity_pages(),
        "pages leaked"
    );
}

/// The default model (SmolLM2 135M Instruct, Q4_1 with a Q8_0 output).
#[test]
fn smollm2_int8_matches_transformers() {
    check("smollm2", "smollm2-135m-instruct-q4_1.json");
}

/// Qwen2.5-Coder 0.5B Instruct Q4_K_M (Q5_0, Q8_0, Q4_K, Q6_K).
#[test]
fn qwen25_coder_int8_matches_transformers() {
    check(
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.json",
    );
}

/// Gemma 3 270M Q4_K_M (Q5_0, Q4_K, Q8_0, Q6_K).
#[test]
fn gemma3_270m_int8_matches_transformers() {
    check("gemma3-270m", "gemma-3-270m-q4_k_m.json");
}
