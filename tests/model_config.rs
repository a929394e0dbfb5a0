//! Config parsing end to end in standalone mode: a real mount, `GET /v1/models`, `modelfs
//! status`, a restart that does not parse again, and models whose config is broken, missing or
//! marked to be skipped.

mod common;

use std::path::Path;

use common::*;
use serde_json::{json, Value};

/// A real safetensors file of f32 zeros with the given tensors.
fn safetensors(tensors: &[(&str, &[usize])]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for (name, shape) in tensors {
        let len = shape.iter().product::<usize>() * 4;
        header.insert(
            name.to_string(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let header = serde_json::to_vec(&header).unwrap();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header);
    out.resize(out.len() + offset, 0);
    out
}

/// A Llama model directory as published: OME's Llama 3.2 1B config beside two safetensors
/// shards named by an index. The shards hold 128_064 parameters, so the parameter count can
/// only come from their headers (the config alone would give OME's "1B").
/// `None` without the `hf-configs` fixtures (the test is then skipped, one line says so).
pub fn llama_dir(dir: &Path) -> Option<()> {
    let config = std::fs::read(modelfs_test_fixtures::require(
        "config_fields_in_status_broken_missing_and_skipped_configs_stay_ready",
        "hf-configs/llama3_2_1b.json",
    )?)
    .unwrap();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
    std::fs::write(
        dir.join("model-00001-of-00002.safetensors"),
        safetensors(&[("model.embed_tokens.weight", &[1000, 64])]),
    )
    .unwrap();
    std::fs::write(
        dir.join("model-00002-of-00002.safetensors"),
        safetensors(&[
            ("lm_head.weight", &[1000, 64]),
            ("model.norm.weight", &[64]),
        ]),
    )
    .unwrap();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        json!({"metadata": {"total_size": 512256}, "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
            "model.norm.weight": "model-00002-of-00002.safetensors"}})
        .to_string(),
    )
    .unwrap();
    std::fs::write(dir.join("tokenizer.json"), b"{}").unwrap();
    Some(())
}

fn model_yaml(name: &str, dir: &Path, annotations: &str) -> String {
    format!(
        "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: {name}\n{annotations}spec:\n  storage:\n    storageUri: local://{}\n",
        dir.display()
    )
}

fn check_llama(entry: &Value) {
    let c = &entry["config"];
    assert_eq!(c["modelType"], "llama", "{entry}");
    assert_eq!(c["modelArchitecture"], "LlamaForCausalLM");
    assert_eq!(
        c["modelParameterSize"], "128.06K",
        "from the safetensors headers"
    );
    assert_eq!(c["maxTokens"], 131072);
    assert_eq!(c["modelCapabilities"], json!(["TEXT_TO_TEXT"]));
    assert_eq!(
        c["modelFramework"],
        json!({"name": "transformers", "version": "4.45.0.dev0"})
    );
    assert_eq!(
        c["modelFormat"],
        json!({"name": "safetensors", "version": "1.0.0"})
    );
    assert_eq!(
        c["decodedModelConfiguration"]["model_size_bytes"],
        128_064 * 2,
        "bfloat16"
    );
    assert!(c.get("quantization").is_none());
    assert!(entry.get("configWarning").is_none());
    assert!(!c["artifact"]["sha"].as_str().unwrap().is_empty());
}

#[test]
fn config_fields_in_status_broken_missing_and_skipped_configs_stay_ready() {
    let env = TestEnv::new();
    let llama = env.dir("llama");
    if llama_dir(&llama).is_none() {
        return;
    }
    let broken = env.dir("broken");
    std::fs::write(broken.join("config.json"), b"{\"model_type\": \"llama\",").unwrap();
    std::fs::write(broken.join("weights.bin"), bytes(1, 4096)).unwrap();
    let missing = env.dir("missing");
    std::fs::write(missing.join("weights.bin"), bytes(2, 4096)).unwrap();
    let yaml = [
        model_yaml("llama", &llama, ""),
        model_yaml("broken", &broken, ""),
        model_yaml("missing", &missing, ""),
        model_yaml(
            "skipped",
            &llama,
            "  annotations:\n    ome.oracle.com/skip-config-parsing: \"True\"\n",
        ),
    ]
    .join("---\n");
    env.write_models("models.yaml", &yaml);
    let d = Daemon::start(&env, &[]);

    let status = d.wait_until("config parsed", std::time::Duration::from_secs(60), |s| {
        s["clusterbasemodel.llama"]["config"]["modelType"] == "llama"
            && s["clusterbasemodel.broken"]["configWarning"].is_string()
            && s["clusterbasemodel.missing"]["configWarning"].is_string()
            && s["clusterbasemodel.skipped"]["status"] == "Ready"
    });
    check_llama(&status["clusterbasemodel.llama"]);

    // A broken or missing config is a warning: the model is Ready and served.
    for (key, want) in [
        ("clusterbasemodel.broken", "config.json: invalid JSON"),
        (
            "clusterbasemodel.missing",
            "no model_index.json or config.json",
        ),
    ] {
        let e = &status[key];
        assert_eq!(e["status"], "Ready", "{key}: {e}");
        assert!(
            e["configWarning"].as_str().unwrap().contains(want),
            "{key}: {e}"
        );
        assert!(e["config"].get("modelType").is_none());
        assert!(e.get("reason").is_none());
    }
    assert_eq!(
        std::fs::read(env.mount.join("broken/weights.bin")).unwrap(),
        bytes(1, 4096)
    );

    // The skip annotation hides the fields even though the artifact (shared with "llama")
    // was parsed.
    let skipped = &status["clusterbasemodel.skipped"];
    assert!(skipped["config"].get("modelType").is_none(), "{skipped}");
    assert!(skipped.get("configWarning").is_none());
    assert_eq!(
        skipped["config"]["artifact"]["sha"],
        status["clusterbasemodel.llama"]["config"]["artifact"]["sha"]
    );

    // The mount serves the config that was parsed.
    assert_eq!(
        std::fs::read(env.mount.join("llama/config.json")).unwrap(),
        std::fs::read(llama.join("config.json")).unwrap()
    );

    // `modelfs status` shows the model column.
    let table = sh(&format!("{BIN} status --state {}", env.state.display()));
    let line = |name: &str| {
        table
            .lines()
            .find(|l| l.starts_with(&format!("clusterbasemodel.{name} ")))
            .unwrap_or_else(|| panic!("{name} in\n{table}"))
            .to_string()
    };
    assert!(table.lines().next().unwrap().contains("MODEL"), "{table}");
    assert!(
        line("llama").contains("LlamaForCausalLM 128.06K"),
        "{table}"
    );
    assert!(line("broken").contains("config?"), "{table}");
    assert!(!line("skipped").contains("LlamaForCausalLM"), "{table}");

    // Parsed once per artifact: three artifacts (llama and skipped share one), three parses,
    // each kept beside its artifact record.
    let log = d.log_text();
    assert_eq!(log.matches("model config parsed").count(), 1, "{log}");
    assert_eq!(log.matches("model config not usable").count(), 2, "{log}");
    let cached = std::fs::read_dir(env.state.join("artifacts"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".modelconfig.json")
        })
        .count();
    assert_eq!(cached, 3);
    assert!(d.stop());

    // A restart reads the cached results: same fields, no parse.
    let d = Daemon::start(&env, &[]);
    let after = d.wait_until("back", std::time::Duration::from_secs(60), |s| {
        s["clusterbasemodel.llama"]["config"]["modelType"] == "llama"
            && s["clusterbasemodel.broken"]["configWarning"].is_string()
    });
    check_llama(&after["clusterbasemodel.llama"]);
    assert_eq!(
        after["clusterbasemodel.broken"]["configWarning"],
        status["clusterbasemodel.broken"]["configWarning"]
    );
    let log = d.log_text();
    assert!(!log.contains("model config parsed"), "{log}");
    assert!(!log.contains("model config not usable"), "{log}");
    assert!(d.stop());
}
