//! ARCHITECTURE.md's arrow list ("Crates and arrows") is the workspace's
//! real dependency graph: every crate of the workspace is listed once, its
//! arrows are exactly the workspace crates in its `[dependencies]`
//! (optional ones included; dev- and build-dependencies are not arrows),
//! and every arrow points down the list. The graph comes from
//! `cargo metadata --no-deps` (the manifests only: offline, no build, well
//! under a second).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

/// The heading the list sits under; the list is the first fenced block
/// after it.
const HEADING: &str = "## Crates and arrows";

/// A crate's name as the list writes its arrows: without `kvmesh-`.
fn short(name: &str) -> &str {
    name.strip_prefix("kvmesh-").unwrap_or(name)
}

/// One line of the list: the crate, and the crates it links.
type Line = (String, BTreeSet<String>);

/// The list in `doc`, in its order. A line is `NAME <- A, B, C  what it
/// holds` (`-` for no arrows); the arrows end at the first two spaces.
fn arrow_list(doc: &str) -> Result<Vec<Line>, String> {
    let after = doc
        .find(HEADING)
        .map(|i| &doc[i..])
        .ok_or(format!("no {HEADING:?} heading"))?;
    let open = after.find("```\n").ok_or("no fenced block after it")? + 4;
    let block = &after[open..];
    let block = &block[..block.find("```").ok_or("the block never closes")?];
    let mut lines = Vec::new();
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        let (name, rest) = line
            .split_once("<-")
            .ok_or(format!("no `<-` in {line:?}"))?;
        let rest = rest.trim_start();
        let deps = rest.split_once("  ").map_or(rest, |(d, _)| d).trim();
        let deps = if deps == "-" {
            BTreeSet::new()
        } else {
            deps.split(',')
                .map(|d| short(d.trim()).to_owned())
                .collect()
        };
        lines.push((short(name.trim()).to_owned(), deps));
    }
    Ok(lines)
}

/// Every workspace crate with the workspace crates it links, from
/// `cargo metadata`.
fn cargo_graph() -> BTreeMap<String, BTreeSet<String>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .arg("--manifest-path")
        .arg(root.join("Cargo.toml"))
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let members: BTreeSet<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    packages
        .iter()
        .map(|p| {
            let name = p["name"].as_str().expect("package name");
            let deps = p["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                // `kind` is null for a normal dependency, "dev" or "build"
                // otherwise.
                .filter(|d| d["kind"].is_null())
                .filter_map(|d| d["name"].as_str())
                .filter(|d| members.contains(d))
                .map(|d| short(d).to_owned())
                .collect();
            (short(name).to_owned(), deps)
        })
        .collect()
}

/// What differs between the `list` and the `graph`, one line each (empty
/// when they agree).
fn differences(list: &[Line], graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut diff = Vec::new();
    // Where each crate is listed (first time).
    let mut at = BTreeMap::new();
    for (i, (name, _)) in list.iter().enumerate() {
        at.entry(name.as_str()).or_insert(i);
    }
    for (i, (name, deps)) in list.iter().enumerate() {
        if at[name.as_str()] != i {
            diff.push(format!("{name}: listed twice"));
            continue;
        }
        let Some(real) = graph.get(name) else {
            diff.push(format!(
                "{name}: listed, but no workspace crate has that name"
            ));
            continue;
        };
        let join = |s: Vec<&String>| s.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ");
        let missing = join(real.difference(deps).collect());
        let extra = join(deps.difference(real).collect());
        if !missing.is_empty() {
            diff.push(format!(
                "{name}: links {missing} (Cargo.toml), which the list leaves out"
            ));
        }
        if !extra.is_empty() {
            diff.push(format!(
                "{name}: the list says it links {extra}, which Cargo.toml does not"
            ));
        }
        for d in deps {
            if at.get(d.as_str()).is_some_and(|&j| j > i) {
                diff.push(format!(
                    "{name}: its arrow from {d} points up the list: list {d} above {name}"
                ));
            }
        }
    }
    for name in graph.keys() {
        if !at.contains_key(name.as_str()) {
            diff.push(format!("{name}: a workspace crate the list leaves out"));
        }
    }
    diff
}

#[test]
fn the_arrow_list_is_the_workspace_graph() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../ARCHITECTURE.md");
    let doc = std::fs::read_to_string(&path).expect("read ARCHITECTURE.md");
    let list = arrow_list(&doc).unwrap_or_else(|e| panic!("ARCHITECTURE.md's arrow list: {e}"));
    let diff = differences(&list, &cargo_graph());
    assert!(
        diff.is_empty(),
        "ARCHITECTURE.md's arrow list ({HEADING}) differs from the workspace's \
         dependencies:\n  {}",
        diff.join("\n  ")
    );
}

#[test]
fn a_list_that_strays_from_the_graph_is_told_edge_by_edge() {
    let doc = format!(
        "{HEADING}\n\nprose\n\n```\n\
         kvmesh-proto  <- meshauth, model  contract\n\
         kvmesh-meshauth  <- -  auth\n\
         kvmesh-ghost  <- -  nothing\n\
         ```\n"
    );
    let list = arrow_list(&doc).expect("parses");
    assert_eq!(list[0].0, "proto");
    assert_eq!(
        list[0].1,
        ["meshauth", "model"]
            .map(String::from)
            .into_iter()
            .collect()
    );
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("proto", &["meshauth", "telemetry"][..]),
        ("meshauth", &[]),
        ("telemetry", &[]),
        ("model", &[]),
    ]
    .into_iter()
    .map(|(n, d)| (n.to_owned(), d.iter().map(|d| d.to_string()).collect()))
    .collect();
    assert_eq!(
        differences(&list, &graph),
        [
            "proto: links telemetry (Cargo.toml), which the list leaves out",
            "proto: the list says it links model, which Cargo.toml does not",
            "proto: its arrow from meshauth points up the list: list meshauth above proto",
            "ghost: listed, but no workspace crate has that name",
            "model: a workspace crate the list leaves out",
            "telemetry: a workspace crate the list leaves out",
        ]
    );
}
