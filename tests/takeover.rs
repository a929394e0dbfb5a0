//! The pod contract across mount server restarts (`modelfs_mount::takeover`): a "pod" (a
//! process in a private mount namespace that bound a model path before the restarts, as a
//! container without mount propagation does) reads the model throughout while the mount
//! server is SIGKILLed 20 times and upgraded 3 times to a build whose version string differs
//! (SIGTERM, the new binary started), as `modelfs serve` (standalone) and as `modelfs
//! mount-server` beside a running `modelfs agent` and `modelfs keeper` (the Kubernetes
//! layout). Not one open or read may fail, no byte may be wrong, every inode number stays;
//! the longest stall of any operation is printed (BENCHMARKS.md).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use sha2::{Digest, Sha256};

const BIN: &str = env!("CARGO_BIN_EXE_modelfs");

/// A copy of the modelfs binary whose version string differs (the same length, so nothing
/// else moves): the "new build" of an upgrade.
fn upgraded_binary(dir: &Path) -> (PathBuf, String) {
    let out = Command::new(BIN).arg("--version").output().unwrap();
    let current = String::from_utf8(out.stdout).unwrap();
    let version = current.trim().rsplit(' ').next().unwrap().to_string();
    let mut next = version.clone().into_bytes();
    let last = next.last_mut().unwrap();
    *last = if *last == b'9' { b'8' } else { b'9' };
    let next = String::from_utf8(next).unwrap();
    let mut bytes = std::fs::read(BIN).unwrap();
    let mut replaced = 0;
    let mut i = 0;
    while i + version.len() <= bytes.len() {
        if &bytes[i..i + version.len()] == version.as_bytes() {
            bytes[i..i + version.len()].copy_from_slice(next.as_bytes());
            replaced += 1;
            i += version.len();
        } else {
            i += 1;
        }
    }
    assert!(replaced > 0);
    let path = dir.join("modelfs-next");
    std::fs::write(&path, bytes).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let shown = Command::new(&path).arg("--version").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&shown.stdout).trim(),
        format!("modelfs {next}"),
        "the upgraded binary reports its own version"
    );
    (path, next)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// `modelfs serve`: the process killed, the same command started again.
    Standalone,
    /// `modelfs keeper`, `modelfs mount-server` and `modelfs agent` apart: only the mount
    /// server restarts.
    Kubernetes,
}

struct Node {
    env: TestEnv,
    layout: Layout,
    transport: Transport,
    /// The agent's `--listen-addr-file` (it listens on a port it picks at each start).
    listen_file: PathBuf,
    socket: PathBuf,
    keeper_socket: PathBuf,
    log: PathBuf,
    server: Option<Child>,
    agent: Option<Child>,
    keeper: Option<Child>,
    _uring: Option<UringParam>,
}

impl Node {
    fn new(layout: Layout, transport: Transport) -> Self {
        let env = TestEnv::new();
        let run = env.dir("run");
        let log = env.root.path().join("node.log");
        Node {
            listen_file: env.root.path().join("agent.addr"),
            socket: run.join("agent.sock"),
            keeper_socket: run.join("keeper").join("keeper.sock"),
            log,
            env,
            layout,
            transport,
            server: None,
            agent: None,
            keeper: None,
            _uring: (transport == Transport::Uring).then(UringParam::acquire),
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn output(&self) -> (Stdio, Stdio) {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        (f.try_clone().unwrap().into(), f.into())
    }

    fn common_args(&self, cmd: &mut Command) {
        cmd.arg("--mount")
            .arg(&self.env.mount)
            .arg("--state")
            .arg(&self.env.state)
            .arg("--mount-socket")
            .arg(&self.socket)
            .arg("--keeper-socket")
            .arg(&self.keeper_socket)
            .env("RUST_LOG", "info,modelfs=debug")
            .stdin(Stdio::null());
    }

    fn agent_args(&self, cmd: &mut Command) {
        cmd.arg("--models")
            .arg(&self.env.models)
            .arg("--listen")
            .arg(ANY_PORT)
            .arg("--listen-addr-file")
            .arg(&self.listen_file);
    }

    /// Starts the mount server (standalone: `serve`, which runs the agent too) with `bin`.
    fn start_server(&mut self, bin: &Path) {
        let (out, err) = self.output();
        let mut cmd = Command::new(bin);
        match self.layout {
            Layout::Standalone => {
                cmd.arg("serve");
                self.common_args(&mut cmd);
                self.agent_args(&mut cmd);
            }
            Layout::Kubernetes => {
                cmd.arg("mount-server");
                self.common_args(&mut cmd);
            }
        }
        cmd.arg("--fuse-transport")
            .arg(self.transport.flag())
            .stdout(out)
            .stderr(err);
        self.server = Some(cmd.spawn().unwrap());
    }

    fn start(&mut self) {
        if self.layout == Layout::Kubernetes {
            let (out, err) = self.output();
            self.keeper = Some(
                Command::new(BIN)
                    .arg("keeper")
                    .arg("--socket")
                    .arg(&self.keeper_socket)
                    .stdin(Stdio::null())
                    .stdout(out)
                    .stderr(err)
                    .spawn()
                    .unwrap(),
            );
            let socket = self.keeper_socket.clone();
            wait_for("the keeper", Duration::from_secs(30), || socket.exists());
        }
        self.start_server(Path::new(BIN));
        if self.layout == Layout::Kubernetes {
            let log = self.log.clone();
            wait_for("the mount server", Duration::from_secs(30), || {
                std::fs::read_to_string(&log)
                    .unwrap_or_default()
                    .contains("waiting for the agent")
            });
            let (out, err) = self.output();
            let mut cmd = Command::new(BIN);
            cmd.arg("agent");
            self.common_args(&mut cmd);
            self.agent_args(&mut cmd);
            self.agent = Some(cmd.stdout(out).stderr(err).spawn().unwrap());
        }
    }

    /// The status document of the agent that last named its address (`Null` before one did).
    fn status(&self) -> serde_json::Value {
        let listen = std::fs::read_to_string(&self.listen_file).unwrap_or_default();
        match http_get(listen.trim(), "/v1/models") {
            Some((200, body)) => serde_json::from_str(&body).unwrap_or_default(),
            _ => serde_json::Value::Null,
        }
    }

    fn resumed(&self) -> usize {
        self.log_text()
            .matches("resumed the FUSE connection of the previous mount server")
            .count()
    }

    /// Stops the mount server: SIGKILL, or SIGTERM (a hand-on, as before an upgrade).
    fn stop_server(&mut self, kill: bool) {
        let mut child = self.server.take().unwrap();
        if kill {
            child.kill().unwrap();
        } else {
            terminate(child.id());
        }
        let status = child.wait().unwrap();
        assert!(
            kill || status.success(),
            "a hand-on exits cleanly: {status}"
        );
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for c in [self.agent.take(), self.server.take()]
            .into_iter()
            .flatten()
        {
            let mut c = c;
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new(BIN)
            .arg("unmount")
            .arg("--mount")
            .arg(&self.env.mount)
            .arg("--keeper-socket")
            .arg(&self.keeper_socket)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if let Some(mut k) = self.keeper.take() {
            let _ = k.kill();
            let _ = k.wait();
        }
    }
}

/// The pod: binds `model` in a private mount namespace and runs `support/pod_reader.py`.
struct Pod {
    child: Child,
    progress: PathBuf,
    stop: PathBuf,
    /// Names the round the pod's operation times count towards.
    round: PathBuf,
}

impl Pod {
    fn start(env: &TestEnv, model: &Path, expected: &BTreeMap<String, String>) -> Pod {
        let dir = env.dir("pod");
        let view = dir.join("view");
        std::fs::create_dir_all(&view).unwrap();
        let expected_path = dir.join("expected.json");
        std::fs::write(&expected_path, serde_json::to_vec(expected).unwrap()).unwrap();
        let progress = dir.join("progress.json");
        let stop = dir.join("stop");
        let round = dir.join("round");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/pod_reader.py");
        let child = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(r#"mount --bind "$1" "$2" && shift 2 && exec "$@""#)
            .arg("sh")
            .arg(model)
            .arg(&view)
            .arg(python())
            .arg(script)
            .arg(&view)
            .arg(&expected_path)
            .arg(&progress)
            .arg(&stop)
            .arg(&round)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let pod = Pod {
            child,
            progress,
            stop,
            round,
        };
        wait_for("the pod's first pass", Duration::from_secs(60), || {
            pod.stats().is_some_and(|s| s["passes"].as_u64() >= Some(1))
        });
        pod
    }

    fn stats(&self) -> Option<serde_json::Value> {
        let text = std::fs::read_to_string(&self.progress).ok()?;
        serde_json::from_str(&text).ok()
    }

    fn set_round(&self, name: &str) {
        std::fs::write(&self.round, name).unwrap();
    }

    fn passes(&self) -> u64 {
        self.stats().and_then(|s| s["passes"].as_u64()).unwrap_or(0)
    }

    /// Waits for two more whole passes (every file opened, read and checked after now).
    fn wait_passes(&self, what: &str) {
        let target = self.passes() + 2;
        wait_for(what, Duration::from_secs(60), || self.passes() >= target);
    }

    fn finish(mut self) -> serde_json::Value {
        std::fs::write(&self.stop, b"").unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "the pod's reader failed: {status}");
        self.stats().unwrap()
    }
}

impl Drop for Pod {
    /// A test that fails mid-way must not leave its reader looping on a dead mount (and
    /// holding the test's output open).
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn model_files(env: &TestEnv) -> (PathBuf, BTreeMap<String, String>) {
    let src = env.dir("src");
    make_model_dir(&src, 12, 4 << 20);
    let files = tree(&src)
        .into_iter()
        .filter(|(_, (is_dir, ..))| !is_dir)
        .map(|(rel, (_, _, _, sha))| (rel, sha))
        .collect();
    (src, files)
}

/// A node of `layout` serving one model of 13 files (`local://`), Ready; its path in the
/// mount and the files' digests.
fn node_serving_a_model(
    layout: Layout,
    transport: Transport,
) -> (Node, PathBuf, BTreeMap<String, String>) {
    let mut node = Node::new(layout, transport);
    let (src, expected) = model_files(&node.env);
    node.env.write_models(
        "m.yaml",
        &cluster_model(
            "m",
            &format!("local://{}", src.display()),
            "ReuseIfExists",
            None,
        ),
    );
    node.start();
    let mut path = String::new();
    wait_for("the model Ready", Duration::from_secs(60), || {
        let s = node.status();
        if s["clusterbasemodel.m"]["status"] == "Ready" {
            path = s["clusterbasemodel.m"]["path"]
                .as_str()
                .unwrap_or("")
                .into();
        }
        !path.is_empty()
    });
    (node, PathBuf::from(&path), expected)
}

fn pod_survives_restarts(layout: Layout, transport: Transport, kills: usize, upgrades: usize) {
    let (mut node, model, expected) = node_serving_a_model(layout, transport);
    assert!(model.starts_with(&node.env.mount), "{}", model.display());
    for (rel, sha) in &expected {
        let data = std::fs::read(model.join(rel)).unwrap();
        assert_eq!(hex::encode(Sha256::digest(&data)), *sha, "{rel}");
    }
    let pod = Pod::start(&node.env, &model, &expected);
    let (next_bin, next_version) = upgraded_binary(node.env.root.path());

    // The upgrades go first, then back to this build, then the kills.
    let mut rounds: Vec<(bool, &Path)> = Vec::new();
    for i in 0..upgrades {
        let bin: &Path = if i % 2 == 0 {
            &next_bin
        } else {
            Path::new(BIN)
        };
        rounds.push((false, bin));
    }
    for _ in 0..kills {
        rounds.push((true, Path::new(BIN)));
    }
    for (round, (kill, bin)) in rounds.iter().enumerate() {
        let name = if *kill { "kill" } else { "upgrade" };
        pod.set_round(&format!("{name}-{round}"));
        // The pass that read the round name is under way before the server goes.
        pod.wait_passes(&format!("round {round}: the pod names the round"));
        let before = node.resumed();
        node.stop_server(*kill);
        node.start_server(bin);
        wait_for(
            &format!("round {round}: the restarted server resumes the connection"),
            Duration::from_secs(60),
            || node.resumed() > before,
        );
        pod.wait_passes(&format!("round {round}: the pod reads after the restart"));
    }
    let log = node.log_text();
    assert!(
        log.contains(&format!("previous={next_version}")) || upgrades < 2,
        "a server resumed the upgraded build's connection"
    );
    pod.set_round("after");
    pod.wait_passes("the pod names the last round");
    let stats = pod.finish();
    eprintln!(
        "{layout:?} over {transport:?}: {kills} SIGKILLs and {upgrades} upgrades under a pod: {stats}"
    );
    // The longest operation of each round: the stall one takeover caused.
    for kind in ["kill", "upgrade"] {
        let mut stalls: Vec<f64> = stats["round_max_ms"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| k.starts_with(kind))
            .map(|(_, v)| v.as_f64().unwrap())
            .collect();
        stalls.sort_by(f64::total_cmp);
        if let (Some(max), false) = (stalls.last(), stalls.is_empty()) {
            eprintln!(
                "stall per {kind} ({} rounds): median {:.0} ms, max {:.0} ms",
                stalls.len(),
                stalls[stalls.len() / 2],
                max
            );
        }
    }
    assert!(stats["opens"].as_u64().unwrap() > 0);
    if transport == Transport::Uring {
        // The keeper polls the rings (`modelfs_fuse_ring::kept`): the first server and every
        // successor serve over them, and requests that reached them while no server ran
        // wait there for the next one.
        assert_eq!(
            log.matches("the keeper polls the io_uring rings").count(),
            1,
            "the first mount's rings come from the keeper; log:\n{log}"
        );
        assert!(
            !log.contains("the keeper does not poll io_uring rings"),
            "log:\n{log}"
        );
        eprintln!(
            "requests delivered while no server ran, answered by the successor: {}; requests the dead process had taken, answered by its successor: {}",
            log.matches("a request delivered while no mount server ran waits in a kept ring")
                .count(),
            log.matches("answered a request the previous process had received")
                .count()
        );
    }
    assert_eq!(stats["failed_opens"], 0, "{stats}");
    assert_eq!(stats["failed_reads"], 0, "{stats}");
    assert_eq!(stats["wrong"], 0, "{stats}");
    assert_eq!(stats["inode_changes"], 0, "{stats}");
    assert_eq!(
        log.matches("mounting afresh").count(),
        1,
        "only the first start mounts; every restart resumed; log:\n{log}"
    );
}

#[test]
fn standalone_serve_is_killed_20_times_and_upgraded_3_times_under_a_pod() {
    pod_survives_restarts(Layout::Standalone, Transport::Dev, 20, 3);
}

/// Standalone over io_uring: the keeper `modelfs serve` starts polls the rings, so nothing
/// fails either.
#[test]
fn standalone_serve_over_io_uring_is_killed_20_times_and_upgraded_3_times_under_a_pod() {
    pod_survives_restarts(Layout::Standalone, Transport::Uring, 20, 3);
}

#[test]
fn kubernetes_mount_server_is_killed_20_times_and_upgraded_3_times_under_a_pod() {
    pod_survives_restarts(Layout::Kubernetes, Transport::Dev, 20, 3);
}

/// The same over io_uring: no request may hang (each round waits a bounded time for the pod
/// to go on), no byte may be wrong, no inode change; requests the dead process had received
/// are answered by its successor, and the ones the kernel fails are counted.
#[test]
fn kubernetes_mount_server_over_io_uring_is_killed_20_times_and_upgraded_3_times_under_a_pod() {
    pod_survives_restarts(Layout::Kubernetes, Transport::Uring, 20, 3);
}

fn mount_dev(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().dev()
}

fn read_all(model: &Path, expected: &BTreeMap<String, String>) {
    for (rel, sha) in expected {
        let data = std::fs::read(model.join(rel)).unwrap();
        assert_eq!(hex::encode(Sha256::digest(&data)), *sha, "{rel}");
    }
}

/// The mount server notices its session being disturbed from outside and recovers without a
/// human: an outside `umount` while pods keep the connection is mounted there again (the same
/// connection: the pod sees nothing), and a connection aborted through `fusectl` (every user
/// of it fails for good) is replaced by a fresh mount.
#[test]
fn an_outside_umount_and_a_fusectl_abort_are_recovered() {
    let (node, model, expected) = node_serving_a_model(Layout::Kubernetes, Transport::Dev);
    let pod = Pod::start(&node.env, &model, &expected);
    let dev = mount_dev(&node.env.mount);

    // An outside umount (an operator's clean-up script, say).
    let status = Command::new("umount")
        .arg(&node.env.mount)
        .status()
        .unwrap();
    assert!(status.success());
    let log = node.log.clone();
    wait_for(
        "the mount back at its path",
        Duration::from_secs(30),
        || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("the mount was removed from outside")
                && std::fs::read_to_string("/proc/self/mountinfo")
                    .unwrap()
                    .lines()
                    .any(|l| l.split(' ').nth(4) == node.env.mount.to_str())
        },
    );
    assert_eq!(mount_dev(&node.env.mount), dev, "the same connection");
    read_all(&model, &expected);
    pod.wait_passes("the pod reads after the outside umount");
    let stats = pod.finish();
    assert_eq!(stats["failed_opens"], 0, "{stats}");
    assert_eq!(stats["failed_reads"], 0, "{stats}");
    assert_eq!(stats["wrong"], 0, "{stats}");

    // A fusectl abort: the connection is gone for everyone; the server mounts afresh.
    let conns = Path::new("/sys/fs/fuse/connections");
    if std::fs::read_dir(conns).unwrap().next().is_none() {
        let status = Command::new("mount")
            .args(["-t", "fusectl", "fusectl"])
            .arg(conns)
            .status()
            .unwrap();
        assert!(status.success(), "mounting fusectl");
    }
    let minor = libc::minor(dev);
    let before = node.log_text().matches("mounted afresh").count();
    std::fs::write(conns.join(minor.to_string()).join("abort"), b"1").unwrap();
    wait_for(
        "a fresh mount after the abort",
        Duration::from_secs(30),
        || node.log_text().matches("mounted afresh").count() > before,
    );
    // A new mount serves (the kernel may give it the freed device number and mount id again).
    read_all(&model, &expected);
    assert!(node
        .log_text()
        .contains("the FUSE connection ended; mounting afresh"));
}

/// A connection that negotiated FUSE over io_uring is resumed over io_uring: the successor
/// drives the rings the keeper polls, whose entries the previous process registered
/// (`modelfs_mount::takeover`, "io_uring").
#[test]
fn a_connection_served_over_io_uring_is_resumed_over_io_uring() {
    let (mut node, model, expected) = node_serving_a_model(Layout::Kubernetes, Transport::Uring);
    read_all(&model, &expected);
    let dev = mount_dev(&node.env.mount);
    for kill in [false, true] {
        let before = node.resumed();
        node.stop_server(kill);
        node.start_server(Path::new(BIN));
        wait_for("the resumed connection", Duration::from_secs(60), || {
            node.resumed() > before
        });
        read_all(&model, &expected);
        assert_eq!(mount_dev(&node.env.mount), dev, "the same connection");
    }
    assert_eq!(
        node.log_text()
            .matches("serving FUSE requests over io_uring")
            .count(),
        3,
        "the first server and both successors serve over the ring"
    );
}

/// The kernel function a task waiting for a FUSE answer sleeps in.
fn waits_for_fuse(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/wchan")).is_ok_and(|w| w == "request_wait_answer")
}

/// Over io_uring, after a SIGKILL, a request made while no mount server runs reaches an entry
/// of the rings the keeper polls (`modelfs_fuse_ring::kept`): the keeper's SQ thread copies it
/// into the entry's buffers and it waits there as a completion, never failing, until the
/// successor answers it. The reader here is pinned to CPU 0 and is the only user of the mount
/// there. (With rings of the mount server's own, requests that reached the dead process's
/// entries failed with `ECANCELED`, and one queued while its CPU's queue had no entry waited
/// until an entry of that queue committed: `modelfs_mount::takeover`, "io_uring".)
#[test]
fn a_request_queued_while_no_server_runs_is_answered_over_io_uring() {
    let (mut node, model, expected) = node_serving_a_model(Layout::Kubernetes, Transport::Uring);
    read_all(&model, &expected);
    let (rel, sha) = expected.iter().next().unwrap();
    let before = node.resumed();
    node.stop_server(true);
    let reader = Command::new("taskset")
        .args(["-c", "0", "sha256sum"])
        .arg(model.join(rel))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = reader.id();
    let mut reader = Some(reader);
    wait_for(
        "the reader waiting for an answer (not failing)",
        Duration::from_secs(30),
        || {
            if let Some(status) = reader.as_mut().unwrap().try_wait().unwrap() {
                let out = reader.take().unwrap().wait_with_output().unwrap();
                panic!(
                    "the request failed while no server ran ({status}): {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            waits_for_fuse(pid)
        },
    );
    let mut reader = reader.unwrap();
    node.start_server(Path::new(BIN));
    wait_for("the resumed connection", Duration::from_secs(60), || {
        node.resumed() > before
    });
    let mut status = None;
    wait_for(
        "the request made while no server ran answered",
        Duration::from_secs(30),
        || {
            status = reader.try_wait().unwrap();
            status.is_some()
        },
    );
    let out = reader.wait_with_output().unwrap();
    assert!(out.status.success(), "{:?}", out.status);
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.split(' ').next(), Some(sha.as_str()), "{rel}");
    assert!(
        node.log_text()
            .contains("a request delivered while no mount server ran waits in a kept ring"),
        "the successor found the request in a kept ring"
    );
}

/// The keeper is never upgraded and should never die; if it does, its SQ thread takes the
/// kept rings' commands with it (the kernel completes them with `ENOTCONN` on a connection
/// that lives on): each ring thread of the mount server registers an entry on a ring of its
/// own and the mount keeps serving on every CPU.
#[test]
fn the_mount_keeps_serving_over_io_uring_when_the_keeper_dies() {
    let (mut node, model, expected) = node_serving_a_model(Layout::Kubernetes, Transport::Uring);
    read_all(&model, &expected);
    let mut keeper = node.keeper.take().unwrap();
    keeper.kill().unwrap();
    keeper.wait().unwrap();
    // 8 FUSE threads spread over the CPUs: one ring entry each, each on a kept ring.
    let cpus = std::thread::available_parallelism().unwrap().get();
    let entries = cpus * 8usize.div_ceil(cpus);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while node
        .log_text()
        .matches("a failed FUSE ring thread serves again with a new ring")
        .count()
        < entries
    {
        assert!(
            std::time::Instant::now() < deadline,
            "not every ring thread is on a ring of its own; log:\n{}",
            node.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        node.log_text()
            .contains("the kept ring ended with the connection alive"),
        "the kept rings' commands ended with the keeper"
    );
    for cpu in 0..cpus {
        for (rel, sha) in &expected {
            let mut reader = Command::new("taskset")
                .args(["-c", &cpu.to_string(), "sha256sum"])
                .arg(model.join(rel))
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let mut status = None;
            wait_for("a read on each CPU", Duration::from_secs(30), || {
                status = reader.try_wait().unwrap();
                status.is_some()
            });
            let out = reader.wait_with_output().unwrap();
            assert!(out.status.success(), "cpu {cpu}: {:?}", out.status);
            let text = String::from_utf8(out.stdout).unwrap();
            assert_eq!(text.split(' ').next(), Some(sha.as_str()), "{rel}");
        }
    }
}
