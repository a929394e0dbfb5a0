//! What the Kubernetes-mode end-to-end tests share: the `modelfs serve --kube` daemon they run
//! against the fake API server, and readers of what it reports there (the node ConfigMap's
//! entries, the node's labels).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::fake_apiserver::FakeApiServer;

pub const NODE: &str = "node-a";
pub const CM: &str = "api/v1/configmaps";
pub const NODES: &str = "api/v1/nodes";
pub const BM: &str = "apis/ome.io/v1beta1/basemodels";
pub const CBM: &str = "apis/ome.io/v1beta1/clusterbasemodels";
pub const TIMEOUT: Duration = Duration::from_secs(90);

/// Waits until the daemon's agent names the address it listens on in `file`
/// (`--listen-addr-file`; it listens on a port it picks, not on one probed here and released,
/// which another process could take first). Kills `child` and panics if it exits first or
/// names none within [`TIMEOUT`].
fn listen_addr(file: &Path, child: &mut Child, log: &Path) -> String {
    let deadline = Instant::now() + TIMEOUT;
    let why = loop {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        if let Ok(addr) = text.trim().parse::<std::net::SocketAddr>() {
            return addr.to_string();
        }
        if let Ok(Some(status)) = child.try_wait() {
            break format!("exited ({status})");
        }
        if Instant::now() >= deadline {
            break format!("named no address within {TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = child.kill();
    let _ = child.wait();
    panic!(
        "the daemon {why}; log:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

pub struct Daemon {
    pub child: Child,
    pub mount: PathBuf,
    pub listen: String,
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

/// Ctrl-C (SIGINT) ends the daemon and its mount (SIGTERM would hand the mount on to a
/// successor, kept by the keeper); whatever is left is released before the directory goes.
impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut exited = false;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                exited = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if !exited {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = Command::new(env!("CARGO_BIN_EXE_modelfs"))
            .arg("unmount")
            .arg("--mount")
            .arg(&self.mount)
            .arg("--state")
            .arg(self._dir.path().join("state"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

impl Daemon {
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// Starts the daemon in Kubernetes mode against `server`, with `extra` flags and `env`
/// variables (`HF_TOKEN` is removed from the inherited environment).
pub fn start_daemon(server: &FakeApiServer, extra: &[&str], env: &[(&str, &str)]) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
    let mount = dir.path().join("mnt");
    std::fs::create_dir_all(&mount).unwrap();
    let listen_file = dir.path().join("daemon.addr");
    let log = dir.path().join("daemon.log");
    let mut command = Command::new(env!("CARGO_BIN_EXE_modelfs"));
    command
        .args(["serve", "--kube", "--node-name", NODE, "--namespace", "ome"])
        .arg("--mount")
        .arg(&mount)
        .arg("--state")
        .arg(dir.path().join("state"))
        .args(["--listen", "127.0.0.1:0", "--gc-grace-secs", "1"])
        .arg("--listen-addr-file")
        .arg(&listen_file)
        .args(extra)
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "info,modelfs=debug")
        .env_remove("HF_TOKEN")
        .stderr(std::fs::File::create(&log).unwrap());
    for (name, value) in env {
        command.env(name, value);
    }
    let mut child = command.spawn().expect("spawn modelfs");
    let listen = listen_addr(&listen_file, &mut child, &log);
    Daemon {
        child,
        mount,
        listen,
        log,
        _dir: dir,
    }
}

pub fn cluster_model(name: &str, storage: Value) -> Value {
    json!({"metadata": {"name": name}, "spec": {"modelFormat": {"name": "safetensors"},
        "storage": storage}})
}

pub fn base_model(namespace: &str, name: &str, storage: Value) -> Value {
    json!({"metadata": {"name": name, "namespace": namespace},
        "spec": {"modelFormat": {"name": "safetensors"}, "storage": storage}})
}

/// The node ConfigMap's entries, parsed.
pub fn entries(server: &FakeApiServer) -> BTreeMap<String, Value> {
    server
        .get(CM, "ome", NODE)
        .and_then(|cm| cm["data"].as_object().cloned())
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| {
            let parsed = serde_json::from_str(v.as_str().unwrap_or("null")).unwrap_or(v);
            (k, parsed)
        })
        .collect()
}

pub fn node_labels(server: &FakeApiServer) -> BTreeMap<String, String> {
    server
        .get(NODES, "", NODE)
        .and_then(|n| serde_json::from_value(n["metadata"]["labels"].clone()).ok())
        .unwrap_or_default()
}

pub async fn wait_for<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(value) = check() {
            return value;
        }
        if Instant::now() > deadline {
            panic!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub async fn wait_status(server: &FakeApiServer, key: &str, status: &str) -> Value {
    wait_for(&format!("{key} {status}"), || {
        let entry = entries(server).get(key).cloned()?;
        (entry["status"] == status).then_some(entry)
    })
    .await
}

pub fn status_of(server: &FakeApiServer, key: &str) -> Option<String> {
    entries(server)
        .get(key)
        .and_then(|e| e["status"].as_str().map(str::to_owned))
}
