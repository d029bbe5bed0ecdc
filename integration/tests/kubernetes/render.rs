//! The manifests as kustomize renders them, read without a cluster: the
//! files a kustomization lists (every manifest beside it listed), their
//! documents, and the documents with its `patches` (JSON patches) applied.

use std::path::{Path, PathBuf};

use serde_yaml_ng::Value;

/// The kustomization in `at`, its keys checked: only `resources`,
/// `labels` and `patches` (JSON patches, [`rendered`]) are used, so what
/// this test reads is all kustomize applies.
fn kustomization(at: &Path) -> Value {
    let path = at.join("kustomization.yaml");
    let k: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .expect("YAML");
    for key in k.as_mapping().expect("a mapping").keys() {
        let key = key.as_str().expect("a string key");
        assert!(
            ["apiVersion", "kind", "labels", "resources", "patches"].contains(&key),
            "{}: {key} is not read by this test",
            path.display()
        );
    }
    k
}

/// The manifest files the kustomization in `at` applies: its `resources`,
/// files and (recursively) kustomization folders; every manifest beside a
/// kustomization is listed by it.
pub fn resources(at: &Path) -> Vec<PathBuf> {
    let path = at.join("kustomization.yaml");
    let k = kustomization(at);
    let mut files = Vec::new();
    let mut listed = Vec::new();
    for r in k["resources"].as_sequence().expect("resources") {
        let p = at.join(r.as_str().expect("a path"));
        if p.is_dir() {
            files.extend(resources(&p));
        } else {
            listed.push(r.as_str().expect("a path").to_owned());
            // Canonical: `etcd/../base/decode.yaml` is `base/decode.yaml`.
            files.push(
                p.canonicalize()
                    .unwrap_or_else(|e| panic!("{}: {e}", p.display())),
            );
        }
    }
    let mut beside: Vec<String> = std::fs::read_dir(at)
        .expect("folder")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    beside.sort();
    listed.sort();
    assert_eq!(listed, beside, "{}", path.display());
    files
}

/// Every document of `files`.
pub fn documents(files: &[PathBuf]) -> Vec<Value> {
    let mut docs = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).expect("manifest");
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            docs.push(
                serde::Deserialize::deserialize(doc)
                    .unwrap_or_else(|e| panic!("{}: {e}", f.display())),
            );
        }
    }
    docs
}

/// The documents the kustomization in `at` renders: its resources' (a
/// folder's rendered in turn), with its `patches` applied. Each patch is
/// a JSON patch of `add` operations on the one resource its target names.
pub fn rendered(at: &Path) -> Vec<Value> {
    let k = kustomization(at);
    let mut docs = Vec::new();
    for r in k["resources"].as_sequence().expect("resources") {
        let p = at.join(r.as_str().expect("a path"));
        if p.is_dir() {
            docs.extend(rendered(&p));
        } else {
            docs.extend(documents(&[p]));
        }
    }
    for patch in k["patches"].as_sequence().into_iter().flatten() {
        let t = &patch["target"];
        let target = docs
            .iter_mut()
            .find(|d| d["kind"] == t["kind"] && d["metadata"]["name"] == t["name"])
            .unwrap_or_else(|| panic!("no resource {t:?} to patch"));
        let ops: Value = serde_yaml_ng::from_str(patch["patch"].as_str().expect("an inline patch"))
            .expect("patch YAML");
        for op in ops.as_sequence().expect("a JSON patch") {
            let path = op["path"].as_str().expect("path");
            match op["op"].as_str() {
                Some("add") => add(target, path, op["value"].clone(), false),
                Some("replace") => add(target, path, op["value"].clone(), true),
                _ => panic!("only `add` and `replace` are applied here: {op:?}"),
            }
        }
    }
    docs
}

/// JSON patch `add` (or, `replace`, `replace` of what is there) of
/// `value` at the JSON pointer `path` in `doc`.
fn add(doc: &mut Value, path: &str, value: Value, replace: bool) {
    let (parent, last) = path.rsplit_once('/').expect("a JSON pointer");
    let mut at = doc;
    for token in parent.split('/').skip(1) {
        at = match token.parse::<usize>() {
            Ok(i) if at.is_sequence() => &mut at[i],
            _ => &mut at[token],
        };
        assert!(!at.is_null(), "{path}: no {token:?}");
    }
    match (at, last, replace) {
        (Value::Sequence(seq), "-", false) => seq.push(value),
        (Value::Sequence(seq), i, false) => seq.insert(i.parse().expect("an index"), value),
        (Value::Mapping(map), key, _) => {
            let was = map.insert(Value::from(key), value);
            assert!(!replace || was.is_some(), "{path}: nothing to replace");
        }
        (other, _, _) => panic!("{path}: cannot patch {other:?}"),
    }
}

/// `doc` without the label the kustomizations add (kustomize's output
/// carries it; the files do not).
pub fn unlabelled(mut doc: Value) -> Value {
    // `get_mut`, not indexing: indexing a mapping mutably adds the key.
    if let Some(meta) = doc.get_mut("metadata").and_then(Value::as_mapping_mut) {
        if let Some(labels) = meta.get_mut("labels").and_then(Value::as_mapping_mut) {
            labels.remove("app.kubernetes.io/part-of");
            if labels.is_empty() {
                meta.remove("labels");
            }
        }
    }
    doc
}

/// (kind, name) of each document, sorted.
pub fn kinds_and_names(docs: &[Value]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = docs
        .iter()
        .map(|d| {
            (
                d["kind"].as_str().expect("kind").to_owned(),
                d["metadata"]["name"].as_str().expect("name").to_owned(),
            )
        })
        .collect();
    out.sort();
    out
}
