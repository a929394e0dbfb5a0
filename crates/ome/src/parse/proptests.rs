//! Property-based tests of the manifest parser: any text, and mutations of valid manifests
//! (OME's own model files among them), parses into documents or fails with a reason, never
//! panics and never hangs; what parses goes through validation (`to_spec`) the same way.
//! Settings and the long mode: [`modelfs_proptest_support`].

use std::path::Path;

use proptest::prelude::*;

use super::*;
use modelfs_proptest_support::{apply, bounded, config, mutations, CASE_LIMIT};

const SAMPLE: &str = "\
apiVersion: ome.io/v1beta1
kind: BaseModel
metadata:
  name: llama
  namespace: team-a
  labels: {models.ome/reserve-model-artifact: \"true\"}
spec:
  modelFormat: {name: safetensors, version: \"1\"}
  maxTokens: 8192
  storage:
    storageUri: hf://meta-llama/Llama-3.1-8B@main
    path: /mnt/models/llama
    downloadPolicy: ReuseIfExists
    key: hf-secret
    parameters: {secretKey: token, token: hf_abc}
    nodeSelector: {gpu: a100}
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms:
          - matchExpressions:
              - {key: zone, operator: In, values: [a, b]}
---
apiVersion: v1
kind: List
items:
  - apiVersion: ome.io/v1beta1
    kind: ClusterBaseModel
    metadata: {name: shared}
    spec: {storage: {storageUri: 'local://../tiny'}}
";

/// Fragments that YAML gives meaning to.
const YAML_TOKENS: &[&str] = &[
    "\n---\n",
    "\n...\n",
    ": ",
    "- ",
    "? ",
    "&a ",
    "*a",
    "<<: *a",
    "!!binary ",
    "!!str ",
    "!custom ",
    "|\n",
    ">-\n",
    "{",
    "}",
    "[",
    "]",
    ",",
    "\"",
    "'",
    "#",
    "\t",
    "  ",
    "\n  ",
    "%YAML 1.2\n",
    "~",
    "null",
    "true",
    "0x1F",
    "1e999",
    ".nan",
    "-.inf",
    "\u{feff}",
    "\\u0000",
    "kind: ClusterBaseModel\n",
    "apiVersion: ome.io/v1beta1\n",
    "storageUri: ",
    "items: ",
    "metadata: ",
    "\r\n",
    "\u{85}",
    "\u{2028}",
];

/// The built-in sample and every OME manifest of the fixtures (none when they are missing: the
/// mutation properties then start from the built-in sample alone).
fn samples() -> Vec<String> {
    let mut out = vec![SAMPLE.to_owned()];
    let mut pending = vec![modelfs_test_fixtures::dir().join("ome-models")];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if let Ok(text) = std::fs::read_to_string(&path) {
                out.push(text);
            }
        }
    }
    out.sort();
    out
}

/// What the standalone scanner does with a file: parse, then validate every model.
fn parse_and_validate(text: String) -> usize {
    let Ok(documents) = parse_documents(&text) else {
        return 0;
    };
    let mut models = 0;
    for document in documents {
        match document {
            Document::Model(Ok(object)) => {
                if let Err(error) = object.to_spec(Path::new("/mnt/models")) {
                    assert!(!error.to_string().is_empty());
                }
                let _ = object.key();
                models += 1;
            }
            Document::Model(Err(error)) | Document::Invalid(error) => {
                assert!(!error.to_string().is_empty(), "an error without a reason");
            }
            Document::Other { .. } => {}
        }
    }
    models
}

fn check(text: String) {
    bounded("parsing a manifest", CASE_LIMIT, move || {
        parse_and_validate(text)
    });
}

#[test]
fn the_samples_parse() {
    let Some(dir) = modelfs_test_fixtures::require("the_samples_parse", "ome-models") else {
        return;
    };
    let samples = samples();
    assert!(samples.len() > 10, "fixtures missing: {}", dir.display());
    for sample in samples {
        assert!(parse_and_validate(sample.clone()) > 0, "{sample}");
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arbitrary_text(text in "\\PC{0,400}") {
        check(text);
    }

    #[test]
    fn arbitrary_yaml_like_text(
        parts in proptest::collection::vec(proptest::sample::select(YAML_TOKENS), 0..80),
    ) {
        check(parts.concat());
    }

    #[test]
    fn mutated_manifests(
        index in any::<proptest::sample::Index>(),
        edits in mutations(YAML_TOKENS),
    ) {
        let samples = samples();
        let sample = index.get(&samples).clone().into_bytes();
        let text = String::from_utf8_lossy(&apply(sample, &edits)).into_owned();
        check(text);
    }

}

proptest! {
    // Bombs that reach a limit cost most of a second each in a debug build: fewer cases.
    #![proptest_config(proptest::test_runner::Config {
        cases: (config().cases / 8).max(8),
        ..config()
    })]

    #[test]
    fn deep_nesting_and_alias_bombs(depth in 1usize..20_000, fan in 2usize..12, levels in 1usize..12) {
        for text in [
            format!("{}{}", "[".repeat(depth), "]".repeat(depth)),
            format!("{}1", "- ".repeat(depth.min(3000))),
            format!("{}{}", "{a: ".repeat(depth), "}".repeat(depth)),
            alias_bomb(fan, levels),
        ] {
            check(text);
        }
    }
}

/// "Billion laughs": each level lists the previous one `fan` times.
fn alias_bomb(fan: usize, levels: usize) -> String {
    let mut text = "a0: &a0 [lol]\n".to_owned();
    for level in 1..=levels {
        let refs = vec![format!("*a{}", level - 1); fan].join(", ");
        text.push_str(&format!("a{level}: &a{level} [{refs}]\n"));
    }
    text.push_str(&format!(
        "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata: {{name: x, labels: *a{levels}}}\n"
    ));
    text
}
/// Regression: a "billion laughs" file was refused only at the node budget, after seconds of
/// CPU in a debug build per change of the file; the alias replay limit stops it early.
#[test]
fn alias_bombs_stop_at_the_replay_limit() {
    let error = parse_documents(&alias_bomb(12, 12)).expect_err("a bomb is refused");
    assert!(
        error.to_string().contains("alias replay limit exceeded"),
        "{error}"
    );
    // Anchors do not reach into later documents (YAML): such a file is refused with a reason.
    let mut text = "x: &labels {team: a, tier: gold}\n".to_owned();
    for i in 0..500 {
        text.push_str(&format!(
            "---\napiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata: \
             {{name: m{i}, labels: {{team: a}}}}\nspec: {{storage: {{storageUri: hf://a/b, \
             nodeSelector: {{tier: gold}}}}}}\nextra: *labels\n"
        ));
    }
    assert!(
        parse_documents(&text).is_err(),
        "an alias into another document"
    );
}
