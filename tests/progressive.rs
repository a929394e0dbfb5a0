//! Serving while downloading (SPEC section 13) end to end: the real daemon in standalone mode
//! fetches a sharded model from the loopback hub, throttled, and readers open files through
//! the FUSE mount before the fetch is done.

mod common;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

use common::hub::*;
use common::*;
use modelfs_devhub::hf::{Fault, FaultKind, FaultTarget, HubFile};
use sha2::{Digest, Sha256};

/// Path -> content: configs, a tokenizer, an index and three 2 MiB shards.
fn sharded(seed: u64) -> BTreeMap<String, Vec<u8>> {
    let mut f = BTreeMap::new();
    f.insert("config.json".into(), bytes(seed, 600));
    f.insert("tokenizer.json".into(), bytes(seed + 1, 3000));
    f.insert("model.safetensors.index.json".into(), bytes(seed + 2, 400));
    for i in 1..=3 {
        f.insert(
            format!("model-0000{i}-of-00003.safetensors"),
            bytes(seed + 10 + i, 2 << 20),
        );
    }
    f
}

fn publish(hub: &TestHub, repo: &str, files: &BTreeMap<String, Vec<u8>>) {
    let files = files
        .iter()
        .map(|(p, d)| {
            let lfs = p.ends_with(".safetensors");
            (p.clone(), HubFile::memory(d.clone(), lfs))
        })
        .collect();
    hub.hub().add_commit(repo, &["main"], files);
}

fn model(name: &str, repo: &str) -> String {
    format!(
        "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: {name}\nspec:\n  storage:\n    storageUri: hf://{repo}\n    downloadPolicy: AlwaysDownload\n"
    )
}

/// Every shard request trickles at 512 KiB/s: a 2 MiB shard takes about 4 s.
fn throttle_shards(hub: &TestHub) {
    hub.fault(
        FaultKind::Slow {
            bytes_per_sec: 512 << 10,
        },
        1_000_000,
        Some(".safetensors"),
    );
}

/// One file at a time, so the fetch order is observable.
fn start(env: &TestEnv, hub: &TestHub, extra: &[&str]) -> Daemon {
    let mut flags = hf_flags(hub);
    flags.extend(["--hf-max-files".to_string(), "1".to_string()]);
    flags.extend(extra.iter().map(|s| s.to_string()));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    Daemon::start(env, &flags)
}

/// Waits until the model's directory lists every file with its size (none read yet).
fn wait_listing(dir: &Path, files: &BTreeMap<String, Vec<u8>>) {
    wait_for("the complete listing", Duration::from_secs(60), || {
        files.iter().all(|(p, d)| {
            std::fs::symlink_metadata(dir.join(p)).is_ok_and(|m| m.len() == d.len() as u64)
        })
    });
}

fn read(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    std::fs::File::open(path)?.read_to_end(&mut out)?;
    Ok(out)
}

/// Whether some store holds the verified blob of `content`.
fn blob_stored(env: &TestEnv, content: &[u8]) -> bool {
    let name = hex::encode(Sha256::digest(content));
    let Ok(stores) = std::fs::read_dir(env.state.join("stores")) else {
        return false;
    };
    stores
        .flatten()
        .any(|s| s.path().join("blobs").join(&name).exists())
}

fn assert_files(dir: &Path, files: &BTreeMap<String, Vec<u8>>) {
    for (p, d) in files {
        assert!(read(&dir.join(p)).unwrap() == *d, "{p} differs");
    }
}

#[test]
fn a_reader_of_the_last_shard_gets_it_before_the_other_shards_download() {
    let hub = TestHub::start(1000);
    let files = sharded(1);
    publish(&hub, "org/llm", &files);
    throttle_shards(&hub);
    let env = TestEnv::new();
    let d = start(&env, &hub, &[]);
    env.write_models("m.yaml", &model("llm", "org/llm"));
    let dir = env.mount.join("llm");
    wait_listing(&dir, &files);
    // The status is not Ready while files are missing.
    assert_ne!(
        d.status()["clusterbasemodel.llm"]["status"].as_str(),
        Some("Ready")
    );

    let last = "model-00003-of-00003.safetensors";
    let got = read(&dir.join(last)).unwrap();
    assert!(got == files[last], "the last shard reads its own bytes");
    // Fetched next after the open asked for it: the middle shard has not verified yet (it
    // takes about 4 s once it starts, and it starts after the last one).
    let middle = &files["model-00002-of-00003.safetensors"];
    assert!(
        !blob_stored(&env, middle),
        "the middle shard was fetched before the shard the reader waited on"
    );
    assert!(d.log_text().contains("downloading"));

    d.wait_model("clusterbasemodel.llm", "Ready");
    assert_files(&dir, &files);
}

#[test]
fn a_waiting_reader_gets_eio_for_a_corrupt_download_then_the_good_bytes_after_the_retry() {
    let hub = TestHub::start(1000);
    let files = sharded(2);
    publish(&hub, "org/flaky", &files);
    // The first answer for the second shard is corrupt (fast); every other shard answer is
    // throttled, so the reader waits before the corrupt attempt ends.
    hub.fault(FaultKind::Corrupt, 1, Some("00002-of-00003"));
    throttle_shards(&hub);
    let env = TestEnv::new();
    let d = start(&env, &hub, &[]);
    env.write_models("m.yaml", &model("flaky", "org/flaky"));
    let dir = env.mount.join("flaky");
    wait_listing(&dir, &files);

    let shard = "model-00002-of-00003.safetensors";
    let err = read(&dir.join(shard)).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    // The retry verifies: a new open waits for it and reads the right bytes.
    let got = read(&dir.join(shard)).unwrap();
    assert!(got == files[shard]);
    assert!(hub.hub().stats().faults_applied >= 1);
    d.wait_model("clusterbasemodel.flaky", "Ready");
    assert_files(&dir, &files);
}

#[test]
fn an_open_past_the_deadline_fails_with_etimedout_with_a_log_line() {
    let hub = TestHub::start(1000);
    let files = sharded(3);
    publish(&hub, "org/slow", &files);
    // Slow enough that nothing but the small files verifies during the test.
    hub.fault(
        FaultKind::Slow {
            bytes_per_sec: 16 << 10,
        },
        1_000_000,
        Some(".safetensors"),
    );
    let env = TestEnv::new();
    let d = start(&env, &hub, &["--pending-open-timeout-secs", "2"]);
    env.write_models("m.yaml", &model("slow", "org/slow"));
    let dir = env.mount.join("slow");
    wait_listing(&dir, &files);
    // Small files verify first and read at once.
    assert!(read(&dir.join("config.json")).unwrap() == files["config.json"]);

    let started = Instant::now();
    let err = read(&dir.join("model-00003-of-00003.safetensors")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ETIMEDOUT), "{err}");
    assert!(started.elapsed() >= Duration::from_secs(2));
    wait_for("the log line", Duration::from_secs(10), || {
        let log = d.log_text();
        log.lines().any(|l| {
            l.contains("gave up waiting") && l.contains("slow") && l.contains("model-00003")
        })
    });
}

#[test]
fn deleting_a_model_fails_its_waiting_opens_at_once() {
    let hub = TestHub::start(1000);
    let files = sharded(4);
    publish(&hub, "org/gone", &files);
    hub.fault(
        FaultKind::Slow {
            bytes_per_sec: 16 << 10,
        },
        1_000_000,
        Some(".safetensors"),
    );
    let env = TestEnv::new();
    let d = start(&env, &hub, &[]);
    env.write_models("m.yaml", &model("gone", "org/gone"));
    let dir = env.mount.join("gone");
    wait_listing(&dir, &files);
    let path = dir.join("model-00002-of-00003.safetensors");
    let reader = std::thread::spawn(move || {
        let started = Instant::now();
        (read(&path), started.elapsed())
    });
    // Waiting once the mount server counted its open (nothing else opened a file).
    wait_for("the reader to wait", Duration::from_secs(30), || {
        d.metric(r#"modelfs_fuse_requests_total{op="open"}"#) >= 1.0
    });
    env.remove_models("m.yaml");
    let (result, waited) = reader.join().unwrap();
    let err = result.unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOENT), "{err}");
    assert!(
        waited < Duration::from_secs(120),
        "failed when the model left, not at the 600 s deadline: {waited:?}"
    );
    d.wait_gone("clusterbasemodel.gone");
}

fn sigkill(pid: u32) {
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("a pid");
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).expect("SIGKILL");
}

/// How many times an agent heard that an open waits on `file`.
fn told_wanted(log: &str, file: &str) -> usize {
    log.lines()
        .filter(|l| l.contains("an open waits on a file") && l.contains(file))
        .count()
}

/// The reader's view of a SIGKILL of the agent while it waits: it keeps waiting through the
/// restart and gets the right bytes, and the restarted agent, told again which file the open
/// waits on, fetches that shard before the others.
fn check_waiting_through_a_restart(
    env: &TestEnv,
    files: &BTreeMap<String, Vec<u8>>,
    dir: &Path,
    log: &dyn Fn() -> String,
    kill_agent: &dyn Fn(),
    restart_agent: &dyn Fn(),
) {
    wait_listing(dir, files);
    let last = "model-00003-of-00003.safetensors";
    let path = dir.join(last);
    let reader = std::thread::spawn(move || read(&path));
    wait_for(
        "the agent to hear of the waiting open",
        Duration::from_secs(30),
        || told_wanted(&log(), last) >= 1,
    );
    kill_agent();
    // Killed mid-fetch: the shard the reader waits on had not verified.
    assert!(!blob_stored(env, &files[last]), "killed too late");
    assert!(!reader.is_finished(), "the reader was still waiting");
    restart_agent();
    let got = reader
        .join()
        .unwrap()
        .expect("the waiting open is served after the restart");
    assert!(got == files[last], "the last shard reads its own bytes");
    let log = log();
    assert!(
        log.contains("serving the listing of a fetch a restart ended"),
        "the restarted agent mapped the pending model before it resolved again"
    );
    assert!(
        told_wanted(&log, last) >= 2,
        "the restarted agent heard of the waiting open too"
    );
    assert!(
        !blob_stored(env, &files["model-00002-of-00003.safetensors"]),
        "the middle shard was fetched before the shard the reader waited on"
    );
}

#[test]
fn a_reader_waiting_through_a_sigkill_of_the_supervised_agent_is_served_after_the_restart() {
    let hub = TestHub::start(1000);
    let files = sharded(5);
    publish(&hub, "org/restart", &files);
    throttle_shards(&hub);
    let env = TestEnv::new();
    let mut d = start(&env, &hub, &[]);
    env.write_models("m.yaml", &model("restart", "org/restart"));
    let dir = env.mount.join("restart");
    let agent = only_child(d.pid()).expect("one agent child");
    let log = d.log.clone();
    // `serve` restarts its agent by itself (which listens on a new port).
    let cell = std::cell::RefCell::new(&mut d);
    check_waiting_through_a_restart(
        &env,
        &files,
        &dir,
        &|| std::fs::read_to_string(&log).unwrap_or_default(),
        &|| cell.borrow_mut().follow_agent_restart(|_| sigkill(agent)),
        &|| {},
    );
    assert!(d
        .log_text()
        .contains("agent died; restarting it reason=killed by signal 9 (SIGKILL)"));
    d.wait_model("clusterbasemodel.restart", "Ready");
    assert_files(&dir, &files);
}

/// `modelfs mount-server` and `modelfs agent` as separate processes (the Kubernetes layout).
struct Split {
    server: Option<std::process::Child>,
    agent: Option<std::process::Child>,
    keeper: Option<std::process::Child>,
    keeper_socket: std::path::PathBuf,
    mount: std::path::PathBuf,
    state: std::path::PathBuf,
    log: std::path::PathBuf,
    /// The agent's address (it picks its port at each start: `--listen-addr-file`).
    listen: String,
    listen_file: std::path::PathBuf,
}

impl Split {
    fn start(env: &TestEnv, hub: &TestHub) -> Split {
        Self::start_with(env, hub, false)
    }

    /// With `keeper`, a `modelfs keeper` holds the FUSE connection across mount server
    /// restarts (the Kubernetes DaemonSets).
    fn start_with(env: &TestEnv, hub: &TestHub, keeper: bool) -> Split {
        let run = env.dir("run");
        let mut split = Split {
            server: None,
            agent: None,
            keeper: None,
            keeper_socket: run.join("keeper").join("keeper.sock"),
            mount: env.mount.clone(),
            state: env.state.clone(),
            listen_file: env.root.path().join("agent.addr"),
            log: env.root.path().join("split.log"),
            listen: String::new(),
        };
        if keeper {
            let out = split.out();
            split.keeper = Some(
                std::process::Command::new(BIN)
                    .arg("keeper")
                    .arg("--socket")
                    .arg(&split.keeper_socket)
                    .stdin(std::process::Stdio::null())
                    .stdout(out.try_clone().unwrap())
                    .stderr(out)
                    .spawn()
                    .unwrap(),
            );
            let socket = split.keeper_socket.clone();
            wait_for("the keeper", Duration::from_secs(30), || socket.exists());
        }
        split.start_server();
        split.start_agent(env, hub, &run.join("agent.sock"));
        split
    }

    fn out(&self) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap()
    }

    /// Starts a mount server and waits until it serves (a new one after a restart).
    fn start_server(&mut self) {
        let before = self.log_text().matches("waiting for the agent").count();
        let out = self.out();
        let server = std::process::Command::new(BIN)
            .arg("mount-server")
            .arg("--mount")
            .arg(&self.mount)
            .arg("--state")
            .arg(&self.state)
            .arg("--mount-socket")
            .arg(self.mount.parent().unwrap().join("run").join("agent.sock"))
            .arg("--keeper-socket")
            .arg(&self.keeper_socket)
            .args(["--fuse-transport", "dev"])
            .env("RUST_LOG", "info,modelfs=debug")
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        self.server = Some(server);
        wait_for("the mount server", Duration::from_secs(30), || {
            self.log_text().matches("waiting for the agent").count() > before
        });
    }

    /// SIGTERM, as a rolling update of the mount server's DaemonSet does: it hands the FUSE
    /// connection on to the keeper.
    fn stop_server(&mut self) {
        if let Some(mut c) = self.server.take() {
            terminate(c.id());
            c.wait().unwrap();
        }
    }

    fn start_agent(&mut self, env: &TestEnv, hub: &TestHub, socket: &Path) {
        let out = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.log)
                .unwrap()
        };
        let _ = std::fs::remove_file(&self.listen_file);
        let agent = std::process::Command::new(BIN)
            .arg("agent")
            .arg("--mount")
            .arg(&env.mount)
            .arg("--state")
            .arg(&env.state)
            .arg("--models")
            .arg(&env.models)
            .arg("--listen")
            .arg(ANY_PORT)
            .arg("--listen-addr-file")
            .arg(&self.listen_file)
            .arg("--mount-socket")
            .arg(socket)
            .args(hf_flags(hub))
            .args(["--hf-max-files", "1"])
            .env("RUST_LOG", "info,modelfs=debug")
            .stdin(std::process::Stdio::null())
            .stdout(out())
            .stderr(out())
            .spawn()
            .unwrap();
        self.agent = Some(agent);
        self.listen = listen_addr(&self.listen_file, Duration::from_secs(30), || {
            self.log_text()
        });
        wait_for("the agent", Duration::from_secs(30), || {
            matches!(http_get(&self.listen, "/readyz"), Some((200, _)))
        });
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn kill_agent(&mut self) {
        if let Some(mut a) = self.agent.take() {
            a.kill().unwrap();
            a.wait().unwrap();
        }
    }

    fn status(&self, key: &str) -> Option<String> {
        let (_, body) = http_get(&self.listen, "/v1/models")?;
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        v[key]["status"].as_str().map(str::to_string)
    }
}

impl Drop for Split {
    fn drop(&mut self) {
        self.kill_agent();
        if let Some(mut c) = self.server.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::process::Command::new(BIN)
            .arg("unmount")
            .arg("--mount")
            .arg(&self.mount)
            .arg("--keeper-socket")
            .arg(&self.keeper_socket)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        if let Some(mut k) = self.keeper.take() {
            let _ = k.kill();
            let _ = k.wait();
        }
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.mount)
            .status();
    }
}

#[test]
fn a_reader_waiting_through_a_sigkill_of_the_agent_apart_from_the_mount_server_is_served() {
    let hub = TestHub::start(1000);
    let files = sharded(6);
    publish(&hub, "org/split", &files);
    throttle_shards(&hub);
    let env = TestEnv::new();
    let mut split = Split::start(&env, &hub);
    env.write_models("m.yaml", &model("split", "org/split"));
    let dir = env.mount.join("split");
    let socket = env.root.path().join("run").join("agent.sock");
    let log = split.log.clone();
    let cell = std::cell::RefCell::new(&mut split);
    check_waiting_through_a_restart(
        &env,
        &files,
        &dir,
        &|| std::fs::read_to_string(&log).unwrap_or_default(),
        &|| cell.borrow_mut().kill_agent(),
        &|| cell.borrow_mut().start_agent(&env, &hub, &socket),
    );
    wait_for("Ready", Duration::from_secs(60), || {
        split.status("clusterbasemodel.split").as_deref() == Some("Ready")
    });
    assert_files(&dir, &files);
}

fn model_with(name: &str, repo: &str, policy: &str) -> String {
    format!(
        "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: {name}\nspec:\n  storage:\n    storageUri: hf://{repo}\n    downloadPolicy: {policy}\n"
    )
}

/// Single flight (SPEC section 13, "Interaction with what exists"): a `ReuseIfExists` model
/// that waits on another model's in-flight fetch of the same artifact is served while that
/// fetch downloads too, and a reader at its path gets a shard before the fetch completes.
#[test]
fn a_reuse_if_exists_model_waiting_on_an_in_flight_fetch_is_served_while_it_downloads() {
    let hub = TestHub::start(1000);
    let files = sharded(7);
    publish(&hub, "org/shared", &files);
    throttle_shards(&hub);
    let env = TestEnv::new();
    let d = start(&env, &hub, &[]);
    env.write_models(
        "parent.yaml",
        &model_with("parent", "org/shared", "AlwaysDownload"),
    );
    wait_listing(&env.mount.join("parent"), &files);
    env.write_models(
        "child.yaml",
        &model_with("child", "org/shared", "ReuseIfExists"),
    );
    let dir = env.mount.join("child");
    wait_listing(&dir, &files);
    let last = "model-00003-of-00003.safetensors";
    let got = read(&dir.join(last)).unwrap();
    assert!(got == files[last], "the last shard reads its own bytes");
    // Served before the shared fetch completed: neither model is Ready yet.
    let status = d.status();
    for key in ["clusterbasemodel.parent", "clusterbasemodel.child"] {
        assert_ne!(status[key]["status"].as_str(), Some("Ready"), "{key}");
    }
    assert!(
        !blob_stored(&env, &files["model-00002-of-00003.safetensors"]),
        "the middle shard was fetched before the shard the reader waited on"
    );
    // One fetch for both: the child is served from the parent's copy.
    let child = d.wait_model("clusterbasemodel.child", "Ready");
    d.wait_model("clusterbasemodel.parent", "Ready");
    assert!(
        child["config"]["artifact"]["parentPath"]
            .as_object()
            .is_some_and(|p| p.contains_key("clusterbasemodel.parent")),
        "{child}"
    );
    assert_files(&dir, &files);
    assert_files(&env.mount.join("parent"), &files);
}

/// The Hugging Face cache view is progressive too (SPEC section 13): while the model
/// downloads, its snapshot lists every file and `huggingface_hub`, offline against the view,
/// resolves the model id and reads the last shard, whose open waits for it (fetched next).
#[test]
fn huggingface_hub_reads_a_shard_through_the_cache_view_while_the_model_downloads() {
    let hub = TestHub::start(1000);
    let files = sharded(8);
    publish(&hub, "org/view", &files);
    throttle_shards(&hub);
    let env = TestEnv::new();
    let d = start(&env, &hub, &[]);
    env.write_models("m.yaml", &model("view", "org/view"));
    let repo = env.mount.join(".hf-cache").join("models--org--view");
    wait_for("the pending snapshot", Duration::from_secs(60), || {
        std::fs::read_dir(repo.join("snapshots"))
            .ok()
            .and_then(|mut r| r.next())
            .is_some()
    });
    let commit = std::fs::read_to_string(repo.join("refs").join("main")).unwrap();
    wait_listing(&repo.join("snapshots").join(&commit), &files);
    assert_ne!(
        d.status()["clusterbasemodel.view"]["status"].as_str(),
        Some("Ready")
    );

    let last = "model-00003-of-00003.safetensors";
    let home = env.dir("hf-home");
    let script = "import hashlib, json, sys\n\
                  from huggingface_hub import hf_hub_download\n\
                  p = hf_hub_download(repo_id=sys.argv[1], filename=sys.argv[2])\n\
                  print(json.dumps({'path': p, 'sha256': hashlib.sha256(open(p, 'rb').read()).hexdigest()}))\n";
    let out = std::process::Command::new(python())
        .arg("-c")
        .arg(script)
        .args(["org/view", last])
        .env("HF_HUB_CACHE", env.mount.join(".hf-cache"))
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HOME", &home)
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .env_remove("HF_TOKEN")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let res: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        res["sha256"].as_str().unwrap(),
        hex::encode(Sha256::digest(&files[last]))
    );
    assert!(
        res["path"]
            .as_str()
            .unwrap()
            .ends_with(&format!("snapshots/{commit}/{last}")),
        "{res}"
    );
    assert!(
        !blob_stored(&env, &files["model-00002-of-00003.safetensors"]),
        "the middle shard was fetched before the shard the reader waited on"
    );
    d.wait_model("clusterbasemodel.view", "Ready");
    assert_files(&repo.join("snapshots").join(&commit), &files);
}

/// A rolling update of the mount server (SIGTERM: the keeper holds the FUSE connection, a new
/// server resumes it) while a reader waits on a file of a model served while it downloads:
/// the waiting open is resent to the new server, waits there, and gets its bytes.
#[test]
fn a_reader_waiting_through_a_mount_server_restart_is_served() {
    let hub = TestHub::start(1000);
    let files = sharded(9);
    publish(&hub, "org/handon", &files);
    throttle_shards(&hub);
    let env = TestEnv::new();
    let mut split = Split::start_with(&env, &hub, true);
    env.write_models("m.yaml", &model("handon", "org/handon"));
    let dir = env.mount.join("handon");
    wait_listing(&dir, &files);
    let last = "model-00003-of-00003.safetensors";
    let path = dir.join(last);
    let reader = std::thread::spawn(move || read(&path));
    wait_for(
        "the agent to hear of the waiting open",
        Duration::from_secs(30),
        || told_wanted(&split.log_text(), last) >= 1,
    );
    split.stop_server();
    assert!(!blob_stored(&env, &files[last]), "restarted too late");
    assert!(!reader.is_finished(), "the reader was still waiting");
    split.start_server();
    wait_for("the resumed connection", Duration::from_secs(30), || {
        split
            .log_text()
            .contains("resumed the FUSE connection of the previous mount server")
    });
    let got = reader
        .join()
        .unwrap()
        .expect("the waiting open is served after the mount server restart");
    assert!(got == files[last], "the last shard reads its own bytes");
    wait_for("Ready", Duration::from_secs(60), || {
        split.status("clusterbasemodel.handon").as_deref() == Some("Ready")
    });
    assert_files(&dir, &files);
}

/// The Hugging Face cache view across a SIGKILL of the agent mid-fetch: the restarted agent's
/// first mapping already lists the resumed snapshot (refs and every file), before its fetch
/// resumes (the hub answers no resolve until the check is done), so a reader of the view
/// waits through the restart as one at the model's path does, and then gets its bytes.
#[test]
fn the_cache_view_lists_a_resumed_snapshot_right_after_an_agent_restart() {
    let hub = TestHub::start(1000);
    let files = sharded(12);
    publish(&hub, "org/resumed", &files);
    throttle_shards(&hub);
    let env = TestEnv::new();
    let mut d = start(&env, &hub, &[]);
    env.write_models("m.yaml", &model("resumed", "org/resumed"));
    let repo = env.mount.join(".hf-cache").join("models--org--resumed");
    wait_for("the pending snapshot", Duration::from_secs(60), || {
        std::fs::read_to_string(repo.join("refs").join("main")).is_ok()
    });
    let commit = std::fs::read_to_string(repo.join("refs").join("main")).unwrap();
    let snapshot = repo.join("snapshots").join(&commit);
    wait_listing(&snapshot, &files);
    let last = "model-00003-of-00003.safetensors";
    // No resolve succeeds until the view was checked: the fetch cannot resume before.
    hub.hub().add_fault(Fault {
        kind: FaultKind::Status {
            status: 503,
            retry_after: Some(1),
        },
        count: 1_000_000,
        path: None,
        target: FaultTarget::Api,
    });
    let agent = only_child(d.pid()).expect("one agent child");
    let fetches_before = d.log_text().matches("downloading source=").count();
    // Returns once the restarted agent listens: after its first mapping was confirmed.
    d.follow_agent_restart(|_| sigkill(agent));
    assert!(!blob_stored(&env, &files[last]), "killed too late");
    assert_eq!(
        std::fs::read_to_string(repo.join("refs").join("main")).ok(),
        Some(commit.clone()),
        "the restarted agent's first mapping keeps the snapshot's ref"
    );
    for (p, data) in &files {
        let meta = std::fs::symlink_metadata(snapshot.join(p));
        assert!(
            meta.is_ok_and(|m| m.len() == data.len() as u64),
            "{p} is listed in the resumed snapshot"
        );
    }
    let log = d.log_text();
    assert!(log.contains("serving the listing of a fetch a restart ended"));
    assert_eq!(
        log.matches("downloading source=").count(),
        fetches_before,
        "the fetch had not resumed when the view was checked"
    );
    // A reader of the view waits on the shard, and gets it once the fetch resumed.
    let path = snapshot.join(last);
    let reader = std::thread::spawn(move || read(&path));
    hub.hub().clear_faults();
    throttle_shards(&hub);
    let got = reader.join().unwrap().expect("the waiting open is served");
    assert!(got == files[last], "the last shard reads its own bytes");
    d.wait_model("clusterbasemodel.resumed", "Ready");
    assert_files(&snapshot, &files);
}
