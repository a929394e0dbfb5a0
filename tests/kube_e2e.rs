//! Kubernetes mode end to end: the real `modelfs` binary with a real FUSE mount, talking to
//! the in-process fake API server through a kubeconfig.

mod fake_apiserver;
mod kube_common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use fake_apiserver::FakeApiServer;
use kube_common::*;
use serde_json::{json, Value};

fn source_dir(root: &Path, name: &str, files: &[(&str, Vec<u8>)]) -> PathBuf {
    let dir = root.join(name);
    for (path, content) in files {
        let file = dir.join(path);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(file, content).unwrap();
    }
    dir
}

fn node(labels: Value) -> Value {
    json!({"metadata": {"name": NODE, "labels": labels}, "status": {"capacity": {"cpu": "2"}}})
}

async fn fetched_bytes(listen: &str) -> u64 {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let text = reqwest::get(format!("http://{listen}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.contains("fetched_bytes") && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn models_policy_flips_deletion_and_racing_writer() {
    let server = FakeApiServer::start().await;
    let data = tempfile::tempdir().unwrap();
    let big: Vec<u8> = (0..32u32 << 20).map(|i| (i % 251) as u8).collect();
    let src = source_dir(
        data.path(),
        "llama",
        &[
            ("config.json", b"{\"model\":1}".to_vec()),
            ("weights/model.safetensors", big.clone()),
        ],
    );
    server.put(NODES, node(json!({"gpu": "h100"})));
    // The Secret a ClusterBaseModel names lives in the daemon's namespace.
    server.put(
        "api/v1/secrets",
        json!({"metadata": {"name": "hf", "namespace": "ome"}, "data": {"token": "c2VjcmV0"}}),
    );
    let uri = format!("local://{}", src.display());
    server.put(
        CBM,
        cluster_model("llama", json!({"storageUri": uri, "key": "hf"})),
    );
    server.put(
        BM,
        base_model(
            "team",
            "llama",
            json!({"storageUri": uri, "downloadPolicy": "ReuseIfExists"}),
        ),
    );
    let daemon = start_daemon(&server, &["--allow-local-sources"], &[]);
    let mnt = daemon.mount.clone();
    let parent_key = "clusterbasemodel.llama";
    let child_key = "team.basemodel.llama";
    let parent = wait_status(&server, parent_key, "Ready").await;
    let child = wait_status(&server, child_key, "Ready").await;

    // The mount serves both, with the source's bytes.
    assert_eq!(
        std::fs::read(mnt.join("llama/config.json")).unwrap(),
        b"{\"model\":1}"
    );
    assert_eq!(
        std::fs::read(mnt.join("team/llama/weights/model.safetensors")).unwrap(),
        big
    );
    // OME's layout: the parent records itself, the child its parent.
    let parent_path = mnt.join("llama").display().to_string();
    let child_path = mnt.join("team/llama").display().to_string();
    let sha = parent["config"]["artifact"]["sha"].as_str().unwrap();
    assert!(!sha.is_empty());
    assert_eq!(parent["name"], "llama");
    assert_eq!(
        parent["config"]["artifact"]["parentPath"],
        json!({parent_key: parent_path})
    );
    assert_eq!(
        parent["config"]["artifact"]["childrenPaths"],
        json!([child_path])
    );
    assert_eq!(child["config"]["artifact"]["sha"], sha);
    assert_eq!(
        child["config"]["artifact"]["parentPath"],
        json!({parent_key: parent_path})
    );
    let cm = server.get(CM, "ome", NODE).unwrap();
    assert_eq!(
        cm["metadata"]["labels"]["models.ome/basemodel-status"],
        "true"
    );
    assert_eq!(cm["metadata"]["labels"]["node"], NODE);
    wait_for("Ready labels", || {
        let labels = node_labels(&server);
        (labels
            .get("models.ome.io/clusterbasemodel.llama")
            .map(String::as_str)
            == Some("Ready")
            && labels
                .get("models.ome.io/team.basemodel.llama")
                .map(String::as_str)
                == Some("Ready"))
        .then_some(())
    })
    .await;
    assert_eq!(node_labels(&server)["gpu"], "h100");
    // The ConfigMap went through Updating before Ready.
    let history = server.history(CM);
    assert!(
        history.iter().any(|cm| cm["data"][parent_key]
            .as_str()
            .is_some_and(|v| v.contains("\"Updating\""))),
        "no Updating entry in the ConfigMap history"
    );
    // Events: Ready on the model objects.
    wait_for("Ready events", || {
        let events = server.list("apis/events.k8s.io/v1/events");
        let ready_for = |kind: &str, name: &str| {
            events.iter().any(|e| {
                e["reason"] == "Ready"
                    && e["regarding"]["kind"] == kind
                    && e["regarding"]["name"] == name
            })
        };
        (ready_for("ClusterBaseModel", "llama") && ready_for("BaseModel", "llama")).then_some(())
    })
    .await;

    // Another client keeps rewriting the ConfigMap (read-modify-write with retries) while the
    // daemon writes status for a policy flip: no update of either may be lost.
    let racer_client = server.client().await;
    let racer = tokio::spawn(async move {
        use k8s_openapi::api::core::v1::ConfigMap;
        let api: kube::Api<ConfigMap> = kube::Api::namespaced(racer_client, "ome");
        let mut conflicts = 0;
        for i in 0..40 {
            loop {
                let mut cm = api.get(NODE).await.unwrap();
                cm.data
                    .get_or_insert_with(Default::default)
                    .insert(format!("external-{i}"), format!("{i}"));
                match api.replace(NODE, &Default::default(), &cm).await {
                    Ok(_) => break,
                    Err(kube::Error::Api(s)) if s.code == 409 => conflicts += 1,
                    Err(e) => panic!("{e}"),
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        conflicts
    });
    // T-01: the child gets its own copy, then the mapping flips to it.
    server.merge(
        BM,
        "team",
        "llama",
        &json!({"spec": {"storage": {"downloadPolicy": "AlwaysDownload"}}}),
    );
    wait_for("child owns its copy", || {
        let e = entries(&server);
        (e[child_key]["status"] == "Ready"
            && e[child_key]["config"]["artifact"]["parentPath"] == json!({child_key: child_path})
            && e[parent_key]["config"]["artifact"]["childrenPaths"] == json!([]))
        .then_some(())
    })
    .await;
    // T-02: back to reuse; the mapping flips to the cluster model's copy at once.
    server.merge(
        BM,
        "team",
        "llama",
        &json!({"spec": {"storage": {"downloadPolicy": "ReuseIfExists"}}}),
    );
    wait_for("child maps onto the parent again", || {
        let e = entries(&server);
        (e[child_key]["config"]["artifact"]["parentPath"] == json!({parent_key: parent_path})
            && e[parent_key]["config"]["artifact"]["childrenPaths"] == json!([child_path]))
        .then_some(())
    })
    .await;
    let racer_conflicts = racer.await.unwrap();
    let data = entries(&server);
    for i in 0..40 {
        assert_eq!(
            data[&format!("external-{i}")],
            json!(i),
            "external-{i} lost"
        );
    }
    assert_eq!(data[child_key]["status"], "Ready");
    eprintln!("racing writer saw {racer_conflicts} conflicts");
    assert_eq!(
        std::fs::read(mnt.join("team/llama/weights/model.safetensors")).unwrap(),
        big
    );
    // A policy-flip Event was published.
    wait_for("PolicyApplied event", || {
        server
            .list("apis/events.k8s.io/v1/events")
            .iter()
            .any(|e| e["reason"] == "PolicyApplied")
            .then_some(())
    })
    .await;

    // Deletion removes the key and the label; other writers' keys stay.
    server.delete(BM, "team", "llama");
    wait_for("child key and label removed", || {
        (!entries(&server).contains_key(child_key)
            && !node_labels(&server).contains_key("models.ome.io/team.basemodel.llama"))
        .then_some(())
    })
    .await;
    assert!(!mnt.join("team/llama").exists());
    assert_eq!(entries(&server)["external-0"], json!(0));
    assert_eq!(status_of(&server, parent_key).as_deref(), Some("Ready"));
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn targeting_malformed_objects_and_api_restarts() {
    let server = FakeApiServer::start().await;
    let data = tempfile::tempdir().unwrap();
    let src = source_dir(data.path(), "m", &[("a.txt", b"alpha".to_vec())]);
    let uri = format!("local://{}", src.display());
    server.put(NODES, node(json!({"gpu": "h100", "zone": "a"})));
    let affinity = |exprs: Value| {
        json!({"storageUri": uri, "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": exprs}]}}})
    };
    // name, storage, targeted with labels {gpu: h100, zone: a}, after adding pool=x
    let cases: Vec<(&str, Value, bool, bool)> = vec![
        ("plain", json!({"storageUri": uri}), true, true),
        (
            "sel-gpu",
            json!({"storageUri": uri, "nodeSelector": {"gpu": "h100"}}),
            true,
            true,
        ),
        (
            "sel-pool",
            json!({"storageUri": uri, "nodeSelector": {"pool": "x"}}),
            false,
            true,
        ),
        (
            "sel-a100",
            json!({"storageUri": uri, "nodeSelector": {"gpu": "a100"}}),
            false,
            false,
        ),
        (
            "in-zone",
            affinity(json!([{"key": "zone", "operator": "In", "values": ["a"]}])),
            true,
            true,
        ),
        (
            "notin-pool",
            affinity(json!([{"key": "pool", "operator": "NotIn", "values": ["x"]}])),
            true,
            false,
        ),
        (
            "nopool",
            affinity(json!([{"key": "pool", "operator": "DoesNotExist"}])),
            true,
            false,
        ),
        (
            "haspool",
            affinity(json!([{"key": "pool", "operator": "Exists"}])),
            false,
            true,
        ),
        (
            "byname",
            json!({"storageUri": uri, "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In",
                        "values": [NODE]}]}]}}}),
            true,
            true,
        ),
        (
            "emptyterm",
            json!({"storageUri": uri, "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{}]}}}),
            false,
            false,
        ),
    ];
    for (name, storage, _, _) in &cases {
        server.put(
            CBM,
            cluster_model(name, json!(storage.as_object().unwrap().clone())),
        );
    }
    // Malformed objects: each fails alone.
    let malformed: Vec<(&str, Value, &str)> = vec![
        (
            "nostorage",
            json!({"metadata": {"name": "nostorage", "namespace": "t"}, "spec": {}}),
            "storage",
        ),
        (
            "nouri",
            base_model("t", "nouri", json!({"path": "t/nouri"})),
            "storageUri",
        ),
        (
            "scheme",
            base_model("t", "scheme", json!({"storageUri": "ftp://x/y"})),
            "ftp",
        ),
        (
            "s3",
            base_model("t", "s3", json!({"storageUri": "github://org/m"})),
            "github",
        ),
        // A path outside the models root is no error for local:// (OME's agent reports such
        // a model Ready, the pod binds the node directory): a path that climbs is.
        (
            "badpath",
            base_model(
                "t",
                "badpath",
                json!({"storageUri": uri, "path": "/etc/../m"}),
            ),
            "\"..\" is not allowed",
        ),
    ];
    for (_, object, _) in &malformed {
        server.put(BM, object.clone());
    }
    let daemon = start_daemon(&server, &["--allow-local-sources"], &[]);

    let check_targets = |after: bool| {
        let e = entries(&server);
        cases.iter().all(|(name, _, before_change, after_change)| {
            let wanted = if after { *after_change } else { *before_change };
            let key = format!("clusterbasemodel.{name}");
            let ready = e.get(&key).is_some_and(|v| v["status"] == "Ready");
            let label = node_labels(&server)
                .get(&format!("models.ome.io/{key}"))
                .cloned();
            if wanted {
                ready && label.as_deref() == Some("Ready")
            } else {
                !e.contains_key(&key) && label.is_none()
            }
        })
    };
    wait_for("targeting with the initial labels", || {
        check_targets(false).then_some(())
    })
    .await;
    for (name, _, reason_fragment) in &malformed {
        let entry = wait_status(&server, &format!("t.basemodel.{name}"), "Failed").await;
        let reason = entry["reason"].as_str().unwrap_or_default();
        assert!(reason.contains(reason_fragment), "{name}: {reason}");
        assert_eq!(
            node_labels(&server)
                .get(&format!("models.ome.io/t.basemodel.{name}"))
                .map(String::as_str),
            Some("Failed")
        );
    }
    assert_eq!(
        std::fs::read(daemon.mount.join("plain/a.txt")).unwrap(),
        b"alpha"
    );
    wait_for("Failed event with reason", || {
        server
            .list("apis/events.k8s.io/v1/events")
            .iter()
            .any(|e| {
                e["reason"] == "Failed"
                    && e["regarding"]["name"] == "nostorage"
                    && e["note"].as_str().is_some_and(|n| n.contains("storage"))
            })
            .then_some(())
    })
    .await;

    // Node labels change at run time: targeting is re-evaluated.
    server.merge(
        NODES,
        "",
        NODE,
        &json!({"metadata": {"labels": {"pool": "x"}}}),
    );
    wait_for("targeting after adding pool=x", || {
        check_targets(true).then_some(())
    })
    .await;
    assert!(!daemon.mount.join("nopool").exists());
    assert_eq!(
        std::fs::read(daemon.mount.join("haspool/a.txt")).unwrap(),
        b"alpha"
    );

    // API server restart: watches break, history is lost (410 on resume), requests fail for a
    // while. The daemon re-lists and does no duplicate work.
    let fetched_before = fetched_bytes(&daemon.listen).await;
    let lists_before = server
        .requests()
        .iter()
        .filter(|r| {
            r.starts_with("GET /apis/ome.io/v1beta1/clusterbasemodels?")
                && !r.contains("watch=true")
        })
        .count();
    let snapshot = entries(&server);
    server.restart(Duration::from_secs(2));
    wait_for("re-list after the restart", || {
        let lists = server
            .requests()
            .iter()
            .filter(|r| {
                r.starts_with("GET /apis/ome.io/v1beta1/clusterbasemodels?")
                    && !r.contains("watch=true")
            })
            .count();
        (lists > lists_before).then_some(())
    })
    .await;
    // A change after the restart is seen.
    server.put(CBM, cluster_model("late", json!({"storageUri": uri})));
    wait_status(&server, "clusterbasemodel.late", "Ready").await;
    let after = entries(&server);
    for (key, value) in &snapshot {
        assert_eq!(
            after.get(key),
            Some(value),
            "{key} changed across the restart"
        );
    }
    // Only the new model was fetched ("late" imports 5 bytes, or 0 if deduplicated).
    let fetched_after = fetched_bytes(&daemon.listen).await;
    assert!(
        fetched_after <= fetched_before + 5,
        "duplicate work: fetched {fetched_before} -> {fetched_after}"
    );
    drop(daemon);
}
