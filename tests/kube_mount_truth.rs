//! Labels tell the truth (issue 20): in the Kubernetes layout (`modelfs mount-server` and
//! `modelfs agent --kube` as separate processes, as their DaemonSets run them), a model's node
//! label and ConfigMap entry say `Ready` only while the mount server serves it. Stopping the
//! server past the agent's grace period withdraws `Ready` (the models turn `Updating`: OME's
//! node selector stops matching, nothing is evicted); a model placed while it is away never
//! becomes `Ready`; a restarted server that confirmed the mapping restores `Ready`.

mod fake_apiserver;
mod kube_common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use fake_apiserver::FakeApiServer;
use kube_common::*;
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_modelfs");

/// The processes of one node: the mount server and the agent, each restartable.
struct Node {
    dir: tempfile::TempDir,
    mount: PathBuf,
    socket: PathBuf,
    log: PathBuf,
    server: Option<Child>,
    agent: Option<Child>,
}

impl Node {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mount = dir.path().join("mnt");
        std::fs::create_dir_all(&mount).unwrap();
        Node {
            socket: dir.path().join("run/agent.sock"),
            log: dir.path().join("node.log"),
            mount,
            dir,
            server: None,
            agent: None,
        }
    }

    fn log_file(&self) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap()
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    async fn start_server(&mut self) {
        let before = self.log_text().matches("waiting for the agent").count();
        let log = self.log_file();
        self.server = Some(
            Command::new(BIN)
                .arg("mount-server")
                .arg("--mount")
                .arg(&self.mount)
                .arg("--state")
                .arg(self.state())
                .arg("--mount-socket")
                .arg(&self.socket)
                .args(["--fuse-transport", "dev"])
                .env("RUST_LOG", "info,modelfs=debug")
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap(),
        );
        // Logged once mounted and listening.
        wait_for("the mount server", || {
            (self.log_text().matches("waiting for the agent").count() > before).then_some(())
        })
        .await;
    }

    fn kill_server(&mut self) {
        if let Some(mut c) = self.server.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    fn start_agent(&mut self, server: &FakeApiServer, grace_secs: u64) {
        let kubeconfig = self.dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
        let log = self.log_file();
        self.agent = Some(
            Command::new(BIN)
                .args(["agent", "--kube", "--node-name", NODE, "--namespace", "ome"])
                .arg("--mount")
                .arg(&self.mount)
                .arg("--state")
                .arg(self.state())
                .arg("--mount-socket")
                .arg(&self.socket)
                .args(["--allow-local-sources", "--gc-grace-secs", "1"])
                // Nothing here asks its HTTP endpoint: any port.
                .arg("--listen")
                .arg("127.0.0.1:0")
                .arg("--mount-server-grace-secs")
                .arg(grace_secs.to_string())
                .env("KUBECONFIG", &kubeconfig)
                .env("RUST_LOG", "info,modelfs=debug")
                .env_remove("HF_TOKEN")
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap(),
        );
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for child in [self.agent.take(), self.server.take()]
            .into_iter()
            .flatten()
        {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
    }
}

fn source(root: &Path, name: &str) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(dir.join("weights")).unwrap();
    std::fs::write(dir.join("config.json"), format!("{{\"model\":\"{name}\"}}")).unwrap();
    std::fs::write(dir.join("weights/w.bin"), name.repeat(10_000)).unwrap();
    dir
}

fn label(server: &FakeApiServer, model: &str) -> Option<String> {
    node_labels(server)
        .get(&format!("models.ome.io/clusterbasemodel.{model}"))
        .cloned()
}

/// Every value the node label of `model` had in the versions `from..to` of the Node.
fn label_history(nodes: &[Value], model: &str) -> Vec<String> {
    let key = format!("models.ome.io/clusterbasemodel.{model}");
    nodes
        .iter()
        .filter_map(|n| n["metadata"]["labels"][&key].as_str().map(str::to_owned))
        .collect()
}

/// Every status the ConfigMap entry of `model` had in the versions of the ConfigMap.
fn status_history(configmaps: &[Value], model: &str) -> Vec<String> {
    let key = format!("clusterbasemodel.{model}");
    configmaps
        .iter()
        .filter_map(|cm| cm["data"][&key].as_str())
        .filter_map(|entry| serde_json::from_str::<Value>(entry).ok())
        .filter_map(|entry| entry["status"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ready_is_withdrawn_while_the_mount_server_is_away_and_restored_after() {
    let server = FakeApiServer::start().await;
    let data = tempfile::tempdir().unwrap();
    server.put(
        NODES,
        json!({"metadata": {"name": NODE, "labels": {"gpu": "h100"}}}),
    );
    let uri = |name: &str| format!("local://{}", source(data.path(), name).display());
    server.put(CBM, cluster_model("a", json!({"storageUri": uri("a")})));

    let mut node = Node::new();
    node.start_server().await;
    node.start_agent(&server, 1);
    wait_status(&server, "clusterbasemodel.a", "Ready").await;
    wait_for("a's label Ready", || {
        (label(&server, "a").as_deref() == Some("Ready")).then_some(())
    })
    .await;

    // The mount server dies and stays away past the grace period: `Updating`, with the
    // reason, on the label and in the ConfigMap.
    node.kill_server();
    let entry = wait_status(&server, "clusterbasemodel.a", "Updating").await;
    assert_eq!(
        entry["reason"], "the mount server is unreachable",
        "{entry}"
    );
    wait_for("a's label Updating", || {
        (label(&server, "a").as_deref() == Some("Updating")).then_some(())
    })
    .await;
    // Other labels of the node are untouched.
    assert_eq!(node_labels(&server)["gpu"], "h100");

    // A model created while the server is away is placed (its files are in a store) but is
    // not Ready: nothing serves it.
    server.put(CBM, cluster_model("b", json!({"storageUri": uri("b")})));
    wait_for("b placed while the server is away", || {
        let entry = entries(&server).get("clusterbasemodel.b").cloned()?;
        (entry["reason"] == "the mount server is unreachable").then_some(())
    })
    .await;
    assert_eq!(label(&server, "b").as_deref(), Some("Updating"));
    let (nodes_away, configmaps_away) = (server.history(NODES), server.history(CM));

    // Back: both Ready once the restarted server confirmed the mapping, and served.
    node.start_server().await;
    wait_for("a and b Ready again", || {
        (label(&server, "a").as_deref() == Some("Ready")
            && label(&server, "b").as_deref() == Some("Ready")
            && status_of(&server, "clusterbasemodel.a").as_deref() == Some("Ready")
            && status_of(&server, "clusterbasemodel.b").as_deref() == Some("Ready"))
        .then_some(())
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(node.mount.join("b/config.json")).unwrap(),
        "{\"model\":\"b\"}"
    );
    assert!(entries(&server)["clusterbasemodel.b"]["reason"].is_null());

    // b was never Ready before the server was back, on the label or in the ConfigMap.
    assert!(
        !label_history(&nodes_away, "b").contains(&"Ready".to_owned()),
        "b's label was Ready while the server was away: {:?}",
        label_history(&nodes_away, "b")
    );
    assert!(
        !status_history(&configmaps_away, "b").contains(&"Ready".to_owned()),
        "b's entry was Ready while the server was away: {:?}",
        status_history(&configmaps_away, "b")
    );
    let log = node.log_text();
    assert!(
        log.contains("unreachable past the grace period")
            && log.contains("confirmed its mapping again"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_short_absence_within_the_grace_period_keeps_ready() {
    let server = FakeApiServer::start().await;
    let data = tempfile::tempdir().unwrap();
    server.put(NODES, json!({"metadata": {"name": NODE}}));
    let uri = format!("local://{}", source(data.path(), "a").display());
    server.put(CBM, cluster_model("a", json!({"storageUri": uri})));
    let mut node = Node::new();
    node.start_server().await;
    node.start_agent(&server, 60);
    wait_for("a's label Ready", || {
        (label(&server, "a").as_deref() == Some("Ready")).then_some(())
    })
    .await;
    let before = server.history(NODES).len();
    node.kill_server();
    node.start_server().await;
    // The agent reconnected and the server confirmed the mapping again.
    let reconnects = || {
        node.log_text()
            .matches("reconnected to the mount server")
            .count()
    };
    wait_for("the agent reconnected", || (reconnects() > 0).then_some(())).await;
    wait_for("the mapping confirmed", || {
        node.log_text()
            .rsplit("reconnected to the mount server")
            .next()
            .filter(|after| after.contains("mapping applied"))
            .map(drop)
    })
    .await;
    let after = server.history(NODES);
    assert!(
        label_history(&after[before..], "a")
            .iter()
            .all(|v| v == "Ready"),
        "a's label changed during a restart within the grace period: {:?}",
        label_history(&after[before..], "a")
    );
    assert_eq!(label(&server, "a").as_deref(), Some("Ready"));
}
