//! docs/CONFIG.md names every table and key the config reads, and nothing
//! the config does not read: the keys are taken from the structs the file
//! is deserialised into (their source, here), so a key added, renamed or
//! removed in the code fails until the page says so.

use std::collections::BTreeSet;

/// Field names of `struct NAME { ... }` in `src` (one field a line).
fn fields(src: &str, name: &str) -> Vec<String> {
    let start = src
        .find(&format!("struct {name} {{"))
        .unwrap_or_else(|| panic!("struct {name}"));
    let body = &src[start..];
    let body = &body[..body.find("\n}").unwrap()];
    body.lines()
        .skip(1)
        .filter_map(|l| {
            let l = l.trim();
            if l.starts_with("//") || l.starts_with('#') {
                return None;
            }
            let l = l.strip_prefix("pub ").unwrap_or(l);
            let (f, _) = l.split_once(": ")?;
            f.chars()
                .all(|c| c.is_ascii_lowercase() || c == '_')
                .then(|| f.to_string())
        })
        .collect()
}

/// The keys of one `## ` section of the page (first column, in backticks).
fn documented(page: &str, heading: &str) -> BTreeSet<String> {
    let start = page
        .find(&format!("## {heading}"))
        .unwrap_or_else(|| panic!("docs/CONFIG.md has no section {heading}"));
    let rest = &page[start + 3..];
    let section = &rest[..rest.find("\n## ").unwrap_or(rest.len())];
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`'))
        .map(|(k, _)| k.to_string())
        .collect()
}

#[test]
fn every_config_key_is_documented() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/");
    let read = |p: &str| std::fs::read_to_string(format!("{root}{p}")).unwrap();
    let (lib, cluster) = (read("src/lib.rs"), read("src/cluster.rs"));
    let page = read("../../docs/CONFIG.md");
    let tables = fields(&lib, "RawFile");
    assert_eq!(
        tables,
        [
            "engine",
            "tiers",
            "tenants",
            "cluster",
            "nodes",
            "telemetry",
            "model"
        ],
        "a table was added or renamed: document it in docs/CONFIG.md and here"
    );
    for (heading, src, strukt) in [
        ("`[[tiers]]`", &lib, "RawTier"),
        ("`[[tenants]]`", &lib, "RawTenant"),
        ("`[engine]`", &lib, "EngineSection"),
        ("`[model]`", &lib, "ModelSection"),
        ("`[telemetry]`", &lib, "TelemetrySection"),
        ("`[cluster]`", &cluster, "RawCluster"),
        ("`[[nodes]]`", &cluster, "RawNode"),
    ] {
        let code: BTreeSet<String> = fields(src, strukt).into_iter().collect();
        assert!(code.len() >= 3, "{strukt}: {code:?}");
        let doc = documented(&page, heading);
        assert_eq!(
            code,
            doc,
            "docs/CONFIG.md {heading} vs struct {strukt}: in the code only {:?}, in the page only {:?}",
            code.difference(&doc).collect::<Vec<_>>(),
            doc.difference(&code).collect::<Vec<_>>()
        );
    }
}
