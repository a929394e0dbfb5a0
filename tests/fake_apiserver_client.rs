//! The fake API server (tests/fake_apiserver) against the official Kubernetes Python client:
//! create, get, list with selectors, replace with a stale resourceVersion (409), patch,
//! generation, finalizers and deletionTimestamp, delete preconditions, and a watch that sees
//! the object's whole life. This keeps the fake, and so every Kubernetes test, faithful to the
//! real API server on the points the daemon and OME's controllers rely on.

mod common;
mod fake_apiserver;

use std::process::Command;

use fake_apiserver::FakeApiServer;

const SCRIPT: &str = include_str!("fake_apiserver/client_check.py");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_python_client_sees_a_faithful_api_server() {
    let server = FakeApiServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
    let python = common::python();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg("-c")
            .arg(SCRIPT)
            .arg(&kubeconfig)
            .env_remove("KUBECONFIG")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "client check failed:\nstdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    // The watch saw the object's whole life, in order.
    let events: Vec<serde_json::Value> =
        serde_json::from_str(stdout.lines().last().unwrap_or("[]")).unwrap();
    let types: Vec<(&str, bool)> = events
        .iter()
        .map(|e| {
            (
                e["type"].as_str().unwrap(),
                e["deleting"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(types.first(), Some(&("ADDED", false)), "{events:?}");
    assert_eq!(types.last(), Some(&("DELETED", true)), "{events:?}");
    let first_deleting = types.iter().position(|t| t.1).unwrap();
    assert_eq!(types[first_deleting].0, "MODIFIED", "{events:?}");
    assert!(types[..first_deleting].iter().all(|t| !t.1), "{events:?}");
    assert!(
        events.last().unwrap()["finalizers"]
            .as_array()
            .unwrap()
            .is_empty(),
        "{events:?}"
    );
    // The ClusterBaseModel without finalizers left through a DELETED event too.
    assert!(server
        .get("apis/ome.io/v1beta1/clusterbasemodels", "", "plain")
        .is_none());
    assert!(server
        .history("apis/ome.io/v1beta1/clusterbasemodels")
        .iter()
        .any(|o| o["metadata"]["name"] == "plain"));
}
