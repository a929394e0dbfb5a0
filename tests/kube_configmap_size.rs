//! The node ConfigMap's 1 MiB limit, end to end against the fake API server (which refuses a
//! larger ConfigMap with 422 as the real one does): when another writer's data leaves little
//! room, the entries shrink to name and status, then the ones that do not fit are left out
//! with Events; node labels are written throughout, and the full layout comes back when room
//! does.

mod fake_apiserver;
mod kube_common;

use std::path::PathBuf;

use fake_apiserver::{FakeApiServer, CONFIGMAP_MAX_DATA_BYTES};
use kube_common::*;
use serde_json::{json, Value};

const OTHER_KEY: &str = "other-writer";
/// Room other writers leave for this daemon: the bare entries of two models ("Ready" or
/// "Updating", 47 or 50 bytes each with their keys), never the minimal or full ones, and not
/// three bare entries.
const ROOM: usize = 120;

fn source(root: &std::path::Path, name: &str) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        format!("{{\"model_type\": \"llama\", \"name\": \"{name}\"}}"),
    )
    .unwrap();
    dir
}

fn events(server: &FakeApiServer, reason: &str, kind: &str, name: &str) -> usize {
    server
        .list("apis/events.k8s.io/v1/events")
        .iter()
        .filter(|e| {
            e["reason"] == reason
                && e["regarding"]["kind"] == kind
                && e["regarding"]["name"] == name
        })
        .count()
}

fn label(server: &FakeApiServer, key: &str) -> Option<String> {
    node_labels(server)
        .get(&format!("models.ome.io/{key}"))
        .cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_configmap_shrinks_entries_keeps_labels_and_reports_it() {
    let server = FakeApiServer::start().await;
    let data = tempfile::tempdir().unwrap();
    server.put(
        NODES,
        json!({"metadata": {"name": NODE, "labels": {}}, "status": {}}),
    );
    // Another writer fills the ConfigMap up to ROOM bytes below the limit.
    let filler = "x".repeat(CONFIGMAP_MAX_DATA_BYTES - ROOM - OTHER_KEY.len());
    server.put(
        CM,
        json!({"metadata": {"name": NODE, "namespace": "ome",
            "labels": {"models.ome/basemodel-status": "true", "node": NODE}},
            "data": {OTHER_KEY: filler}}),
    );
    for name in ["a", "b"] {
        let uri = format!("local://{}", source(data.path(), name).display());
        server.put(CBM, cluster_model(name, json!({"storageUri": uri})));
    }
    let daemon = start_daemon(&server, &["--allow-local-sources"], &[]);

    // Name and status only; labels as usual; the foreign entry untouched.
    for key in ["clusterbasemodel.a", "clusterbasemodel.b"] {
        let entry = wait_status(&server, key, "Ready").await;
        assert_eq!(entry.as_object().unwrap().len(), 2, "{entry}");
        wait_for("Ready label", || {
            (label(&server, key).as_deref() == Some("Ready")).then_some(())
        })
        .await;
    }
    let cm = server.get(CM, "ome", NODE).unwrap();
    assert_eq!(
        cm["data"][OTHER_KEY].as_str().map(str::len),
        Some(filler.len())
    );
    wait_for("NodeStatusTruncated on the Node", || {
        (events(&server, "NodeStatusTruncated", "Node", NODE) > 0).then_some(())
    })
    .await;

    // A third model does not fit even bare: left out of the ConfigMap (the earlier keys stay),
    // its label still says Ready, and its object gets a Warning Event.
    let uri = format!("local://{}", source(data.path(), "c").display());
    server.put(CBM, cluster_model("c", json!({"storageUri": uri})));
    wait_for("label of c Ready", || {
        (label(&server, "clusterbasemodel.c").as_deref() == Some("Ready")).then_some(())
    })
    .await;
    wait_for("StatusNotRecorded on c", || {
        (events(&server, "StatusNotRecorded", "ClusterBaseModel", "c") > 0).then_some(())
    })
    .await;
    let now = entries(&server);
    assert!(!now.contains_key("clusterbasemodel.c"));
    assert_eq!(now["clusterbasemodel.a"]["status"], "Ready");
    assert_eq!(now["clusterbasemodel.b"]["status"], "Ready");
    // The daemon's own status still has everything.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let local: Value = reqwest::get(format!("http://{}/v1/models", daemon.listen))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(local["clusterbasemodel.c"]["status"], "Ready");

    // Room again (the other writer shrinks its data; a model deletion triggers the next
    // write): full entries, and the Node hears that it is complete again.
    server.merge(CM, "ome", NODE, &json!({"data": {OTHER_KEY: "small"}}));
    server.delete(CBM, "", "a");
    wait_for("full entries for b and c", || {
        let now = entries(&server);
        (!now.contains_key("clusterbasemodel.a")
            && ["clusterbasemodel.b", "clusterbasemodel.c"]
                .iter()
                .all(|k| {
                    now.get(*k)
                        .is_some_and(|e| e["config"]["artifact"]["sha"].is_string())
                }))
        .then_some(())
    })
    .await;
    wait_for("NodeStatusComplete on the Node", || {
        (events(&server, "NodeStatusComplete", "Node", NODE) > 0).then_some(())
    })
    .await;
    assert!(
        !daemon.log_text().contains("panicked"),
        "{}",
        daemon.log_text()
    );
}
