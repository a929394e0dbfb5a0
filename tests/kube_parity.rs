//! OME parity in Kubernetes mode that needs the node and OME's own objects, end to end: the
//! real `modelfs` binary with a real FUSE mount, the in-process fake API server, and the OCI
//! Object Storage look-alike (verifying every request's signature).

mod common;
mod fake_apiserver;
mod kube_common;
mod oci_common;

use std::collections::BTreeMap;
use std::path::Path;

use common::http_get;
use fake_apiserver::FakeApiServer;
use kube_common::*;
use modelfs_devhub::oci::{DevObject, OciDev, OciDevConfig};
use modelfs_ome::shape;
use oci_common::ApiKey;
use serde_json::{json, Value};

const NS: &str = "devns";
const BUCKET: &str = "engines";

/// The relative paths and contents of the regular files below `dir`. A name that is gone by
/// the time it is read (the mapping flipped during the walk, as tests that wait for a flip
/// see) is left out: the next walk sees the new mapping whole.
fn files_below(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, found: &mut BTreeMap<String, Vec<u8>>) {
        let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if gone(&e) => return,
            Err(e) => panic!("listing {}: {e}", dir.display()),
        };
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, found);
            } else {
                let rel = path.strip_prefix(root).unwrap().display().to_string();
                match std::fs::read(&path) {
                    Ok(bytes) => {
                        found.insert(rel, bytes);
                    }
                    Err(e) if gone(&e) => {}
                    Err(e) => panic!("reading {}: {e}", path.display()),
                }
            }
        }
    }
    let mut found = BTreeMap::new();
    walk(dir, dir, &mut found);
    found
}

fn trt_model(name: &str, prefix: &str, metadata: Value) -> Value {
    json!({"metadata": {"name": name}, "spec": {
        "modelFormat": {"name": "tensorrtllm"},
        "additionalMetadata": metadata,
        "storage": {"storageUri": format!("oci://n/{NS}/b/{BUCKET}/o/{prefix}"),
            "parameters": {"auth": "UserPrincipal", "region": "us-ashburn-1"}}}})
}

/// The model's entry in the daemon's `/v1/models`.
fn api_entry(daemon: &Daemon, key: &str) -> Value {
    let (code, body) = http_get(&daemon.listen, "/v1/models").expect("daemon answers");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str::<Value>(&body).unwrap()[key].clone()
}

/// OME's TensorRT-LLM shape filter: the node's instance type label, mapped through the
/// `instance-type-map` of `model-agent-config-map`, selects the engine tree a serving model
/// gets; the alias is in the status and the status table; a non-serving type gets every
/// object; no object for the alias fails the model with OME's reason; a relabelled node gets
/// its own shape's files.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tensorrt_llm_models_get_the_engines_of_the_nodes_shape() {
    let oci = OciDev::new(OciDevConfig::default());
    oci.create_bucket(NS, BUCKET);
    let objects = [
        ("llama/H100/rank0.engine", "h100 engine"),
        ("llama/H100/config.json", "{\"gpu\": \"h100\"}"),
        ("llama/L40S/rank0.engine", "l40s engine"),
        ("llama/A100-80G/rank0.engine", "a100 engine"),
        ("llama/tokenizer.json", "{}"),
        ("a10-only/A10/rank0.engine", "a10 engine"),
    ];
    for (name, body) in objects {
        oci.put_object(NS, BUCKET, name, DevObject::new(body.as_bytes().to_vec()));
    }
    let running = oci.serve("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let keys = tempfile::tempdir().unwrap();
    let key = ApiKey::generate(keys.path(), "agent");
    key.register(&running.server);
    let oci_config = key.config_file(keys.path());

    let server = FakeApiServer::start().await;
    server.put(
        NODES,
        json!({"metadata": {"name": NODE, "labels": {
            shape::INSTANCE_TYPE_LABEL: "gpu.big.8",
            shape::DEPRECATED_INSTANCE_TYPE_LABEL: "BM.GPU.A10.4"}}}),
    );
    server.put(
        CM,
        json!({"metadata": {"name": shape::CONFIG_MAP_NAME, "namespace": "ome"},
            "data": {shape::INSTANCE_TYPE_MAP_KEY:
                "{\"gpu.big.8\": \"H100\", \"gpu.small.1\": \"L40S\"}"}}),
    );
    server.put(CBM, trt_model("trt", "llama", json!({})));
    server.put(
        CBM,
        trt_model("trt-custom", "llama", json!({"type": "CustomType"})),
    );
    server.put(CBM, trt_model("trt-a10", "a10-only", json!({})));
    let endpoint = running.url();
    let daemon = start_daemon(
        &server,
        &[],
        &[
            ("MODELFS_OCI_ENDPOINT", endpoint.as_str()),
            ("OCI_CONFIG_PATH", oci_config.to_str().unwrap()),
        ],
    );

    let entry = wait_status(&server, "clusterbasemodel.trt", "Ready").await;
    assert_eq!(entry["shape"], "H100", "{entry}");
    let served = files_below(&daemon.mount.join("trt"));
    assert_eq!(
        served.keys().collect::<Vec<_>>(),
        ["H100/config.json", "H100/rank0.engine"]
    );
    assert_eq!(served["H100/rank0.engine"], b"h100 engine");
    assert_eq!(api_entry(&daemon, "clusterbasemodel.trt")["shape"], "H100");

    // Not a serving model: OME does not filter it.
    let custom = wait_status(&server, "clusterbasemodel.trt-custom", "Ready").await;
    assert!(custom.get("shape").is_none(), "{custom}");
    assert_eq!(
        files_below(&daemon.mount.join("trt-custom")).len(),
        5,
        "every object of the prefix"
    );

    let failed = wait_status(&server, "clusterbasemodel.trt-a10", "Failed").await;
    let reason = failed["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("no suitable objects found for shape H100"),
        "{reason}"
    );

    // The table shows the shape beside the model.
    let table = std::process::Command::new(env!("CARGO_BIN_EXE_modelfs"))
        .args(["status", "--listen", &daemon.listen])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    let row = table
        .lines()
        .find(|l| l.starts_with("clusterbasemodel.trt "))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(row.contains("shape H100"), "{table}");

    // Another instance type on the node: its alias's engines replace the others.
    server.merge(
        NODES,
        "",
        NODE,
        &json!({"metadata": {"labels": {shape::INSTANCE_TYPE_LABEL: "gpu.small.1"}}}),
    );
    // The status names the new alias at once; the files follow once its objects are in (the
    // old ones are served until then, as for any refresh).
    wait_for("trt on the L40S engines", || {
        let entry = entries(&server).get("clusterbasemodel.trt").cloned()?;
        let files = files_below(&daemon.mount.join("trt"));
        (entry["status"] == "Ready"
            && entry["shape"] == "L40S"
            && files.keys().collect::<Vec<_>>() == ["L40S/rank0.engine"])
        .then_some(())
    })
    .await;

    // An instance type map that is not JSON fails only the models that need it.
    server.put(
        CM,
        json!({"metadata": {"name": shape::CONFIG_MAP_NAME, "namespace": "ome"},
            "data": {shape::INSTANCE_TYPE_MAP_KEY: "{not json"}}),
    );
    // The map is read on every planning pass; a node event starts one now rather than at the
    // next resync.
    server.merge(
        NODES,
        "",
        NODE,
        &json!({"metadata": {"labels": {"touched": "1"}}}),
    );
    let broken = wait_status(&server, "clusterbasemodel.trt", "Failed").await;
    assert!(
        broken["reason"]
            .as_str()
            .unwrap_or_default()
            .contains(shape::INSTANCE_TYPE_MAP_KEY),
        "{broken}"
    );
    assert_eq!(
        status_of(&server, "clusterbasemodel.trt-custom").as_deref(),
        Some("Ready")
    );
    drop(daemon);
}

/// Only what modelfs wrote is removed: a model-shaped ConfigMap key and node label added by
/// hand stay through every write; the entry OME's agent left for a model modelfs now serves is
/// taken over, and removed with its label when the model goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_keys_and_labels_modelfs_wrote_are_removed() {
    let server = FakeApiServer::start().await;
    let handmade_label = "models.ome.io/clusterbasemodel.handmade";
    let served_label = "models.ome.io/clusterbasemodel.served";
    server.put(
        NODES,
        json!({"metadata": {"name": NODE, "labels": {
            handmade_label: "Ready", served_label: "Updating"}}}),
    );
    let handmade_entry = "{\"name\":\"handmade\",\"status\":\"Ready\"}";
    server.put(
        CM,
        json!({"metadata": {"name": NODE, "namespace": "ome",
            "labels": {"models.ome/basemodel-status": "true"}},
            "data": {
                "clusterbasemodel.handmade": handmade_entry,
                "clusterbasemodel.served": "{\"name\":\"served\",\"status\":\"Updating\"}",
                "unrelated": "kept"}}),
    );
    server.put(
        CBM,
        cluster_model("served", json!({"storageUri": "vendor://nvidia/llama"})),
    );
    server.put(
        CBM,
        cluster_model("other", json!({"storageUri": "vendor://nvidia/other"})),
    );
    let daemon = start_daemon(&server, &[], &[]);

    wait_status(&server, "clusterbasemodel.served", "Ready").await;
    wait_status(&server, "clusterbasemodel.other", "Ready").await;
    wait_for("the served label", || {
        (node_labels(&server).get(served_label).map(String::as_str) == Some("Ready")).then_some(())
    })
    .await;
    let data = |server: &FakeApiServer| server.get(CM, "ome", NODE).unwrap()["data"].clone();
    assert_eq!(data(&server)["clusterbasemodel.handmade"], handmade_entry);
    assert_eq!(data(&server)["unrelated"], "kept");
    assert_eq!(node_labels(&server)[handmade_label], "Ready");

    server.delete(CBM, "", "served");
    wait_for("served removed", || {
        let gone = !entries(&server).contains_key("clusterbasemodel.served")
            && !node_labels(&server).contains_key(served_label);
        gone.then_some(())
    })
    .await;
    assert_eq!(data(&server)["clusterbasemodel.handmade"], handmade_entry);
    assert_eq!(node_labels(&server)[handmade_label], "Ready");
    assert_eq!(
        status_of(&server, "clusterbasemodel.other").as_deref(),
        Some("Ready")
    );

    drop(daemon);
}
