//! Config back-fill in Kubernetes mode, end to end: the real `modelfs` binary with a real
//! FUSE mount against the in-process fake API server. The node ConfigMap entry carries the
//! derived fields in `config`, the model objects get them in their spec where OME's agent puts
//! them (never over a user's value), and `ome.oracle.com/skip-config-parsing` prevents both.

mod fake_apiserver;
mod kube_common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fake_apiserver::FakeApiServer;
use kube_common::*;
use serde_json::{json, Value};

fn entry(server: &FakeApiServer, key: &str) -> Option<Value> {
    let cm = server.get(CM, "ome", NODE)?;
    serde_json::from_str(cm["data"][key].as_str()?).ok()
}

/// `key`'s ConfigMap entry once it carries a config warning; asserts the model stays Ready (a
/// config it cannot use is OME's warning, not a failure).
async fn ready_with_warning(server: &FakeApiServer, daemon: &Daemon, key: &str) -> Value {
    let found = wait_for(
        &format!("{key}: entry with a config warning"),
        daemon,
        || entry(server, key).filter(|e| e["configWarning"].is_string()),
    )
    .await;
    assert_eq!(found["status"], "Ready", "{found}");
    found
}

async fn wait_for<T>(what: &str, daemon: &Daemon, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(value) = check() {
            return value;
        }
        if Instant::now() > deadline {
            panic!("timed out waiting for {what}; log:\n{}", daemon.log_text());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// OME's Llama 3.2 1B config beside one real safetensors file of 64_064 parameters.
/// `None` without the `hf-configs` fixtures (the test is then skipped, one line says so).
fn llama_dir(root: &Path, test: &str) -> Option<PathBuf> {
    let config = modelfs_test_fixtures::require(test, "hf-configs/llama3_2_1b.json")?;
    let dir = root.join("llama");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(config, dir.join("config.json")).unwrap();
    let header = json!({
        "embed.weight": {"dtype": "F32", "shape": [1000, 64], "data_offsets": [0, 256000]},
        "norm.weight": {"dtype": "F32", "shape": [64], "data_offsets": [256000, 256256]},
    })
    .to_string();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header.as_bytes());
    file.resize(file.len() + 256_256, 0);
    std::fs::write(dir.join("model.safetensors"), file).unwrap();
    Some(dir)
}

fn model(
    kind_path: &str,
    namespace: Option<&str>,
    name: &str,
    uri: &str,
    extra: Value,
) -> (String, Value) {
    let mut metadata = json!({"name": name});
    if let Some(ns) = namespace {
        metadata["namespace"] = json!(ns);
    }
    // Served at the default path: without one, a local:// model is at its own directory
    // (outside the models root here: nothing served), as OME's agent takes it.
    let path = match namespace {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_owned(),
    };
    let mut object =
        json!({"metadata": metadata, "spec": {"storage": {"storageUri": uri, "path": path}}});
    json_patch::merge(&mut object, &extra);
    (kind_path.to_string(), object)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn configmap_entry_and_spec_backfill_with_skip_and_broken_configs() {
    let server = FakeApiServer::start().await;
    let data = tempfile::tempdir().unwrap();
    let Some(llama) = llama_dir(
        data.path(),
        "configmap_entry_and_spec_backfill_with_skip_and_broken_configs",
    ) else {
        return;
    };
    let uri = format!("local://{}", llama.display());
    let broken = data.path().join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(broken.join("config.json"), b"{\"model_type\": 12}").unwrap();
    std::fs::write(broken.join("weights.bin"), vec![7u8; 1000]).unwrap();
    let broken_uri = format!("local://{}", broken.display());
    server.put(NODES, json!({"metadata": {"name": NODE, "labels": {}}}));
    let skip = json!({"metadata": {"annotations": {"ome.oracle.com/skip-config-parsing": "true"}}});
    for (resource, object) in [
        // Nothing set by the user: everything OME derives is filled in.
        model(CBM, None, "llama", &uri, json!({})),
        // Values the user set stay; the rest is filled.
        model(
            BM,
            Some("team"),
            "custom",
            &uri,
            json!({"spec": {"modelArchitecture": "MyLlama", "modelFormat": {"name": "gguf"},
                "modelCapabilities": ["EMBEDDING"], "maxTokens": 4096}}),
        ),
        // Same artifact, but the annotation asks for no parsing.
        model(BM, Some("team"), "skipped", &uri, skip.clone()),
        // Same artifact, after "skipped" in key order (see below).
        model(BM, Some("team"), "zzz", &uri, json!({})),
        model(CBM, None, "broken", &broken_uri, json!({})),
    ] {
        server.put(resource.as_str(), object);
    }
    let daemon = start_daemon(&server, &["--allow-local-sources"], &[]);

    // The ConfigMap entry carries OME's ModelConfig fields.
    let llama_entry = wait_for("llama entry with config", &daemon, || {
        entry(&server, "clusterbasemodel.llama").filter(|e| e["config"]["modelType"] == "llama")
    })
    .await;
    assert_eq!(llama_entry["status"], "Ready");
    let c = &llama_entry["config"];
    assert_eq!(c["modelArchitecture"], "LlamaForCausalLM");
    assert_eq!(
        c["modelParameterSize"], "64.06K",
        "from the safetensors header"
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
    assert_eq!(c["decodedModelConfiguration"]["context_length"], 131072);
    assert!(!c["artifact"]["sha"].as_str().unwrap().is_empty());

    // The object's spec is back-filled.
    let spec = wait_for("llama spec back-filled", &daemon, || {
        let object = server.get(CBM, "", "llama")?;
        (object["spec"]["modelArchitecture"] == "LlamaForCausalLM").then(|| object["spec"].clone())
    })
    .await;
    assert_eq!(spec["modelType"], "llama");
    assert_eq!(spec["modelParameterSize"], "64.06K");
    assert_eq!(
        spec["modelFormat"],
        json!({"name": "safetensors", "version": "1.0.0"})
    );
    assert_eq!(
        spec["modelFramework"],
        json!({"name": "transformers", "version": "4.45.0.dev0"})
    );
    assert_eq!(spec["modelCapabilities"], json!(["TEXT_TO_TEXT"]));
    assert_eq!(
        spec["modelConfiguration"]["architecture"],
        "LlamaForCausalLM"
    );
    assert_eq!(spec["modelConfiguration"]["model_size_bytes"], 64_064 * 2);
    assert!(
        spec.get("maxTokens").is_none(),
        "OME never writes spec.maxTokens"
    );
    assert!(spec.get("quantization").is_none());
    assert_eq!(spec["storage"]["storageUri"], uri.as_str());

    // User values are kept.
    let custom = wait_for("custom spec back-filled", &daemon, || {
        let object = server.get(BM, "team", "custom")?;
        (object["spec"]["modelType"] == "llama").then(|| object["spec"].clone())
    })
    .await;
    assert_eq!(custom["modelArchitecture"], "MyLlama");
    assert_eq!(custom["modelFormat"], json!({"name": "gguf"}));
    assert_eq!(custom["modelCapabilities"], json!(["EMBEDDING"]));
    assert_eq!(custom["maxTokens"], 4096);
    assert_eq!(custom["modelParameterSize"], "64.06K");

    // skip-config-parsing: "zzz" serves the same artifact and comes after "skipped" in the key
    // order the back-fill walks, so once zzz is patched, skipped would have been too.
    wait_for("zzz spec back-filled", &daemon, || {
        let object = server.get(BM, "team", "zzz")?;
        (object["spec"]["modelType"] == "llama").then_some(())
    })
    .await;
    let skipped = server.get(BM, "team", "skipped").unwrap();
    assert_eq!(
        skipped["spec"],
        json!({"storage": {"storageUri": uri, "path": "team/skipped"}}),
        "the skipped model's spec is untouched"
    );
    let skipped_path = "PATCH /apis/ome.io/v1beta1/namespaces/team/basemodels/skipped";
    assert!(
        !server
            .requests()
            .iter()
            .any(|r| r.starts_with(skipped_path)),
        "no patch of the skipped model"
    );
    let skipped_entry = entry(&server, "team.basemodel.skipped").unwrap();
    assert_eq!(skipped_entry["status"], "Ready");
    assert!(
        skipped_entry["config"].get("modelType").is_none(),
        "{skipped_entry}"
    );
    assert_eq!(
        skipped_entry["config"]["artifact"]["sha"],
        c["artifact"]["sha"]
    );

    // A broken config: Ready (entry and node label) with a warning, spec untouched.
    let broken_entry = wait_for("broken entry with warning", &daemon, || {
        entry(&server, "clusterbasemodel.broken").filter(|e| e["configWarning"].is_string())
    })
    .await;
    assert_eq!(broken_entry["status"], "Ready");
    assert!(
        broken_entry["configWarning"]
            .as_str()
            .unwrap()
            .contains("model_type"),
        "{broken_entry}"
    );
    assert!(broken_entry["config"].get("modelType").is_none());
    let labels = server.get(NODES, "", NODE).unwrap()["metadata"]["labels"].clone();
    assert_eq!(labels["models.ome.io/clusterbasemodel.broken"], "Ready");
    assert_eq!(
        server.get(CBM, "", "broken").unwrap()["spec"],
        json!({"storage": {"storageUri": broken_uri, "path": "broken"}})
    );
    assert_eq!(
        std::fs::read(daemon.mount.join("broken/weights.bin")).unwrap(),
        vec![7u8; 1000]
    );

    // Removing the annotation lets the next pass fill the spec, as OME's next parse would.
    server.merge(
        BM,
        "team",
        "skipped",
        &json!({"metadata": {"annotations": {"ome.oracle.com/skip-config-parsing": null}}}),
    );
    wait_for(
        "skipped spec back-filled after the annotation went",
        &daemon,
        || {
            let object = server.get(BM, "team", "skipped")?;
            (object["spec"]["modelArchitecture"] == "LlamaForCausalLM").then_some(())
        },
    )
    .await;
    // The ConfigMap entry and the spec are written by different tasks: either may land first.
    wait_for(
        "skipped ConfigMap entry with the config fields",
        &daemon,
        || {
            let e = entry(&server, "team.basemodel.skipped")?;
            (e["config"]["modelType"] == "llama").then_some(())
        },
    )
    .await;
}

/// What OME's parser gives for the directory, as the ConfigMap entry's `config` of a model with
/// no artifact.
fn parsed_config(dir: &Path) -> Value {
    use modelfs_ome::modelconfig::{derive, Outcome, PathFiles};
    let Outcome::Derived(derived) = derive(&PathFiles::from_dir(dir).unwrap()) else {
        panic!("{} has no usable config", dir.display());
    };
    let mut config = modelfs_ome::status::ModelConfigStatus::default();
    config.set_derived(&derived);
    serde_json::to_value(config).unwrap()
}

fn in_place(name: &str, dir: &Path) -> Value {
    // No storage.path: the model is at its local:// directory, outside the models root.
    json!({"metadata": {"name": name},
        "spec": {"storage": {"storageUri": format!("local://{}", dir.display())}}})
}

/// A `local://` model whose directory lies outside the models root has nothing served, and
/// its config is read in place, as OME's agent does: the entry's `config` is what the parser
/// gives for that directory. A missing directory fails the model with OME's words; a config
/// that does not parse, one that is a symlink out of the directory (never followed), or a
/// path that is a file leaves the model `Ready` with a warning, logged once; a `config.json` written later is read again on the next
/// `--resolve-interval-secs`. The object's spec is back-filled, as OME's parse does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_model_outside_the_root_carries_the_config_read_in_place() {
    const TEST: &str = "local_model_outside_the_root_carries_the_config_read_in_place";
    let server = FakeApiServer::start().await;
    let data = tempfile::tempdir().unwrap();
    let Some(llama) = llama_dir(data.path(), TEST) else {
        return;
    };
    let expected = parsed_config(&llama);
    let missing = data.path().join("missing");
    let broken = data.path().join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(broken.join("config.json"), b"{\"model_type\": 12}").unwrap();
    let escape = data.path().join("escape");
    std::fs::create_dir_all(&escape).unwrap();
    std::os::unix::fs::symlink(llama.join("config.json"), escape.join("config.json")).unwrap();
    // A file, not a directory: it exists, so (as for OME's agent) the model is Ready and only
    // its config is unusable.
    let file = data.path().join("file");
    std::fs::write(&file, b"not a model").unwrap();
    server.put(NODES, json!({"metadata": {"name": NODE, "labels": {}}}));
    for (name, dir) in [
        ("inplace", &llama),
        ("missing", &missing),
        ("broken", &broken),
        ("escape", &escape),
        ("file", &file),
    ] {
        server.put(CBM, in_place(name, dir));
    }
    let daemon = start_daemon(
        &server,
        &["--allow-local-sources", "--resolve-interval-secs=1"],
        &[],
    );

    let inplace = wait_for("in-place entry with config", &daemon, || {
        entry(&server, "clusterbasemodel.inplace").filter(|e| e["config"]["modelType"] == "llama")
    })
    .await;
    assert_eq!(inplace["status"], "Ready", "{inplace}");
    assert_eq!(inplace["config"], expected, "{inplace}");
    assert_eq!(inplace["config"]["modelParameterSize"], "64.06K");
    let listed: Vec<_> = std::fs::read_dir(&daemon.mount).unwrap().collect();
    assert!(listed.is_empty(), "nothing is served: {listed:?}");
    // OME's parse of a local model updates the object's spec too.
    let spec = wait_for("in-place spec back-filled", &daemon, || {
        let object = server.get(CBM, "", "inplace")?;
        (object["spec"]["modelArchitecture"] == "LlamaForCausalLM").then(|| object["spec"].clone())
    })
    .await;
    assert_eq!(spec["modelParameterSize"], "64.06K", "{spec}");

    let failed = wait_for("missing directory failed", &daemon, || {
        entry(&server, "clusterbasemodel.missing").filter(|e| e["status"] == "Failed")
    })
    .await;
    let reason = failed["reason"].as_str().unwrap();
    let ome = format!("local model path does not exist: {}", missing.display());
    assert!(
        reason.starts_with(&format!("{ome} (retry ")),
        "OME's words, and retried: {failed}"
    );

    let broken_entry = ready_with_warning(&server, &daemon, "clusterbasemodel.broken").await;
    assert!(
        broken_entry["configWarning"]
            .as_str()
            .unwrap()
            .contains("model_type"),
        "{broken_entry}"
    );
    assert!(broken_entry["config"].get("modelType").is_none());

    let escape_entry = ready_with_warning(&server, &daemon, "clusterbasemodel.escape").await;
    assert_eq!(
        escape_entry["configWarning"], "no model_index.json or config.json in the model",
        "the symlink out of the directory is not followed: {escape_entry}"
    );
    let file_entry = ready_with_warning(&server, &daemon, "clusterbasemodel.file").await;
    assert!(
        file_entry["configWarning"]
            .as_str()
            .unwrap()
            .contains("is not a directory"),
        "{file_entry}"
    );
    // The labels are written after the ConfigMap entries.
    wait_for("node labels Ready", &daemon, || {
        let labels = server.get(NODES, "", NODE)?["metadata"]["labels"].clone();
        ["broken", "escape", "file"]
            .iter()
            .all(|m| labels[format!("models.ome.io/clusterbasemodel.{m}")] == "Ready")
            .then_some(())
    })
    .await;

    // The broken config is replaced (renamed over, as editors and copy tools do, so no read
    // sees half a file): the next read shows the parsed fields.
    std::fs::copy(
        llama.join("config.json"),
        data.path().join("config.json.new"),
    )
    .unwrap();
    std::fs::rename(
        data.path().join("config.json.new"),
        broken.join("config.json"),
    )
    .unwrap();
    let fixed = wait_for("broken entry read again", &daemon, || {
        entry(&server, "clusterbasemodel.broken").filter(|e| e["config"]["modelType"] == "llama")
    })
    .await;
    assert!(fixed.get("configWarning").is_none(), "{fixed}");
    assert_eq!(fixed["config"], parsed_config(&broken), "{fixed}");
    assert_eq!(
        daemon
            .log_text()
            .matches("model config in place not usable")
            .count(),
        3,
        "one warning per model while the result stays the same"
    );
}
