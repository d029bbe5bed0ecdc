//! The 8-bit-activation class through the whole mesh: `kvmesh serve
//! --activations int8` (router, prefill and decode, one class) on a real
//! K-quant model answers exactly what `kvmesh generate --activations int8`
//! does, a prompt long enough for prefill's batched kernel and the decode
//! steps' one-row kernel; its nodes report the class's numerics, so the
//! router never pairs them with f32-class nodes. Skipped with a note when
//! the model is not fetched (`kvmesh fetch-model --all`).

use kvmesh_integration::mesh::Mesh;
use kvmesh_integration::{http, reference_text_with};
use kvmesh_model::default_model::ShippedModel;
use serde_json::json;

const MAX_TOKENS: usize = 24;

#[test]
fn an_int8_mesh_answers_as_int8_generate_does() {
    let model = ShippedModel::named("qwen2.5-coder-0.5b").expect("in the catalogue");
    let Some(path) = model.cached() else {
        eprintln!(
            "note: {} is not fetched; the int8 mesh test is skipped (run `kvmesh fetch-model --all`)",
            model.file
        );
        return;
    };
    let mesh = Mesh::start(&path, &["--activations", "int8"]);
    for prompt in [
        "def quicksort(xs):\n    \"\"\"Sort a list of integers.\"\"\"\n",
        "The three largest planets of the solar system, in order, are",
    ] {
        let want =
            reference_text_with(&path, prompt, false, MAX_TOKENS, &["--activations", "int8"]);
        let r = http::post(
            &mesh.http,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["choices"][0]["text"], want.as_str(), "{prompt:?}");
    }
    // The load reports the router paired the nodes by.
    let metrics = mesh.metrics();
    let info: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("kvmesh_node_info"))
        .collect();
    assert!(!info.is_empty(), "{metrics}");
    for line in &info {
        assert!(
            line.contains("cpu_numerics=\"x86-i8\"")
                || line.contains("cpu_numerics=\"portable-i8\""),
            "{line}"
        );
    }
    mesh.assert_pages_come_back();
}
