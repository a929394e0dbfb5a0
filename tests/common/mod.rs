//! Test harness: runs the real `modelfs` binary against temporary directories, with a real
//! FUSE mount, and talks to it over its HTTP endpoint on 127.0.0.1.
#![allow(dead_code)]

pub mod hub;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use sha2::{Digest, Sha256};

pub const BIN: &str = env!("CARGO_BIN_EXE_modelfs");

/// Temporary directories of one daemon: mount, state, models.
pub struct TestEnv {
    pub root: tempfile::TempDir,
    pub mount: PathBuf,
    pub state: PathBuf,
    pub models: PathBuf,
}

/// A test's mount may outlive its daemon (the keeper holds the connection, see
/// `tests/takeover.rs`): end it for good before the directories go, or removing them would walk
/// into a mount nobody serves.
impl Drop for TestEnv {
    fn drop(&mut self) {
        if self.state.exists() {
            let _ = Command::new(BIN)
                .arg("unmount")
                .arg("--mount")
                .arg(&self.mount)
                .arg("--state")
                .arg(&self.state)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

impl TestEnv {
    pub fn new() -> Self {
        let root = tempfile::Builder::new()
            .prefix("modelfs-test-")
            .tempdir()
            .unwrap();
        let mount = root.path().join("mnt");
        let state = root.path().join("state");
        let models = root.path().join("models");
        std::fs::create_dir_all(&models).unwrap();
        Self {
            root,
            mount,
            state,
            models,
        }
    }

    /// A directory for test source data.
    pub fn dir(&self, name: &str) -> PathBuf {
        let d = self.root.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Writes a manifest file atomically (write + rename), as an operator's tool would.
    /// `modelfs serve` on this environment's mount, state and models, listening on `listen`.
    pub fn serve_command(&self, listen: &str) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.arg("serve")
            .arg("--mount")
            .arg(&self.mount)
            .arg("--state")
            .arg(&self.state)
            .arg("--models")
            .arg(&self.models)
            .arg("--listen")
            .arg(listen);
        cmd
    }

    pub fn write_models(&self, file: &str, yaml: &str) {
        let tmp = self.models.join(format!(".{file}.tmp"));
        std::fs::write(&tmp, yaml).unwrap();
        std::fs::rename(&tmp, self.models.join(file)).unwrap();
    }

    pub fn remove_models(&self, file: &str) {
        std::fs::remove_file(self.models.join(file)).unwrap();
    }

    /// Store directories that hold at least one blob.
    pub fn stores_with_blobs(&self) -> Vec<PathBuf> {
        let Ok(rd) = std::fs::read_dir(self.state.join("stores")) else {
            return Vec::new();
        };
        let mut out: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                std::fs::read_dir(p.join("blobs"))
                    .map(|mut r| r.next().is_some())
                    .unwrap_or(false)
            })
            .collect();
        out.sort();
        out
    }
}

/// The `--listen` address of test daemons: a port the system picks when the agent binds it,
/// which the agent names in its `--listen-addr-file` ([`listen_addr`]). (A port probed here and
/// released for the daemon to bind later could be taken by another process in between.)
pub const ANY_PORT: &str = "127.0.0.1:0";

/// Waits until `file` (an agent's `--listen-addr-file`) names the address it listens on;
/// panics after `timeout` with `log()`.
pub fn listen_addr(file: &Path, timeout: Duration, log: impl Fn() -> String) -> String {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        if let Ok(addr) = text.trim().parse::<std::net::SocketAddr>() {
            return addr.to_string();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!(
        "no address in {} after {timeout:?}; log:\n{}",
        file.display(),
        log()
    );
}

/// A loopback port where nothing listens and, while this lives, nothing can start to: a TCP
/// socket bound there without `listen`, so connections are refused (a dead proxy, say).
pub struct DeadPort {
    _socket: std::os::fd::OwnedFd,
    pub addr: std::net::SocketAddr,
}

impl DeadPort {
    pub fn bind() -> Self {
        use rustix::net::{AddressFamily, SocketType};
        let socket = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
        let any = std::net::SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 0);
        rustix::net::bind(&socket, &any).unwrap();
        let bound =
            std::net::SocketAddrV4::try_from(rustix::net::getsockname(&socket).unwrap()).unwrap();
        DeadPort {
            _socket: socket,
            addr: bound.into(),
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// A number no other call in this test process gets (names of log and scratch files).
pub fn unique() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A running daemon. Dropping it kills the process and detaches the mount.
pub struct Daemon {
    child: Option<Child>,
    pub mount: PathBuf,
    pub state: PathBuf,
    pub listen: String,
    /// The agent's `--listen-addr-file`.
    listen_file: PathBuf,
    pub log: PathBuf,
    /// Keeps the kernel offering FUSE over io_uring while this daemon runs.
    _uring: Option<UringParam>,
}

/// How a test daemon's FUSE requests reach it (`--fuse-transport`). Tests name one: `Dev`
/// unless they say otherwise, so that which path a test covers never depends on another test
/// having switched the kernel's `enable_uring` parameter on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Dev,
    Uring,
}

impl Transport {
    pub fn flag(self) -> &'static str {
        match self {
            Transport::Dev => "dev",
            Transport::Uring => "uring",
        }
    }

    /// Waits until the daemon has counted a request made now, then checks that requests came
    /// over the transport the test asked for (`modelfs_fuse_uring_requests_total`).
    pub fn assert_served(self, d: &Daemon) {
        let uring = counters_after_marker(d, &d.mount, "modelfs_fuse_uring_requests_total");
        match self {
            Transport::Dev => assert_eq!(uring, 0.0, "requests over io_uring: {}", d.metrics()),
            Transport::Uring => assert!(uring > 0.0, "no request over io_uring: {}", d.metrics()),
        }
    }
}

/// The `fuse` module parameter `enable_uring`, switched on while any holder lives in this test
/// process (tests run in parallel threads) and restored after the last one.
pub struct UringParam;

const URING_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";
static URING_HOLDERS: std::sync::Mutex<(usize, String)> = std::sync::Mutex::new((0, String::new()));

impl UringParam {
    pub fn acquire() -> Self {
        let mut holders = URING_HOLDERS.lock().unwrap();
        if holders.0 == 0 {
            // This project's test machines run Linux >= 6.14 built with FUSE over io_uring.
            holders.1 = std::fs::read_to_string(URING_PARAM)
                .unwrap_or_else(|e| panic!("{URING_PARAM}: {e} (needs Linux >= 6.14)"))
                .trim()
                .to_string();
            std::fs::write(URING_PARAM, "Y").unwrap();
        }
        holders.0 += 1;
        UringParam
    }
}

impl Drop for UringParam {
    fn drop(&mut self) {
        let mut holders = URING_HOLDERS.lock().unwrap();
        holders.0 -= 1;
        if holders.0 == 0 {
            let _ = std::fs::write(URING_PARAM, &holders.1);
        }
    }
}

impl Daemon {
    /// Starts `modelfs serve` with a 1 s GC grace (tests watch collection happen; `extra` may
    /// set another) and waits for the HTTP endpoint.
    pub fn start(env: &TestEnv, extra: &[&str]) -> Daemon {
        Self::start_with_env(env, extra, &[])
    }

    /// Starts `modelfs serve` over `transport` (see [`Transport`]).
    pub fn start_over(env: &TestEnv, transport: Transport, extra: &[&str]) -> Daemon {
        let mut args = vec!["--fuse-transport", transport.flag()];
        args.extend_from_slice(extra);
        Self::start_with_env(env, &args, &[])
    }

    pub fn start_with_env(env: &TestEnv, extra: &[&str], vars: &[(&str, &str)]) -> Daemon {
        let uring = extra
            .windows(2)
            .any(|w| w == ["--fuse-transport", "uring"] || w == ["--fuse-transport", "auto"])
            .then(UringParam::acquire);
        let transport: &[&str] = if extra.contains(&"--fuse-transport") {
            &[]
        } else {
            &["--fuse-transport", "dev"]
        };
        let n = unique();
        let listen_file = env.root.path().join(format!("daemon-{n}.addr"));
        let log = env.root.path().join(format!("daemon-{n}.log"));
        let log_file = std::fs::File::create(&log).unwrap();
        // A test may choose its own grace period (a flag given twice is an error).
        let grace: &[&str] = if extra.contains(&"--gc-grace-secs") {
            &[]
        } else {
            &["--gc-grace-secs", "1"]
        };
        let mut cmd = env.serve_command(ANY_PORT);
        cmd.arg("--listen-addr-file")
            .arg(&listen_file)
            .args(grace)
            .args(transport)
            .args(extra)
            .env("RUST_LOG", "info,modelfs=debug")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file);
        for (k, v) in vars {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn modelfs");
        let mut d = Daemon {
            child: Some(child),
            mount: env.mount.clone(),
            state: env.state.clone(),
            listen: String::new(),
            listen_file,
            log,
            _uring: uring,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        d.listen = listen_addr(&d.listen_file, Duration::from_secs(30), || d.log_text());
        while Instant::now() < deadline {
            if d.try_get("/healthz").is_some() {
                return d;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("daemon did not come up; log:\n{}", d.log_text());
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Runs `restart`, which makes the daemon start a new agent, and takes the new agent's
    /// address: it picks its port anew.
    pub fn follow_agent_restart(&mut self, restart: impl FnOnce(&Daemon)) {
        let _ = std::fs::remove_file(&self.listen_file);
        restart(self);
        self.listen = listen_addr(&self.listen_file, Duration::from_secs(30), || {
            self.log_text()
        });
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    fn try_get(&self, path: &str) -> Option<(u16, String)> {
        http_get(&self.listen, path)
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        self.try_get(path)
            .unwrap_or_else(|| panic!("GET {path} failed; log:\n{}", self.log_text()))
    }

    pub fn status(&self) -> Value {
        let (code, body) = self.get("/v1/models");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    /// Polls the status document until `pred` holds (or panics with the last document and log).
    pub fn wait_until(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + timeout;
        let mut last = Value::Null;
        while Instant::now() < deadline {
            if let Some((200, body)) = self.try_get("/v1/models") {
                last = serde_json::from_str(&body).unwrap_or(Value::Null);
                if pred(&last) {
                    return last;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "timed out waiting for {what}; last status:\n{}\nlog:\n{}",
            serde_json::to_string_pretty(&last).unwrap(),
            self.log_text()
        );
    }

    /// Waits until model `key` has status `want` and returns its entry.
    /// Waits until `/readyz` answers 200: the first desired state is applied to the mapping,
    /// which may come after the status (loaded from the records at start) says Ready.
    pub fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some((200, _)) = self.try_get("/readyz") {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("/readyz never answered 200; log:\n{}", self.log_text());
    }

    pub fn wait_model(&self, key: &str, want: &str) -> Value {
        let doc = self.wait_until(&format!("{key} {want}"), Duration::from_secs(60), |d| {
            d[key]["status"] == want
        });
        doc[key].clone()
    }

    /// Waits until garbage collection has looked at the current state and settled: a pass that
    /// started after this call has completed and nothing is waiting out its grace period (so
    /// whatever collection would remove is gone). Opening and closing `touch` (a file in the
    /// mount) ends a use of a store, which makes the daemon run a pass.
    pub fn wait_gc_settled(&self, touch: &Path) {
        let before = self.gc_passes();
        drop(std::fs::File::open(touch).expect("opening a file in the mount"));
        self.wait_gc_settled_since(before);
    }

    /// Garbage-collection passes completed so far.
    pub fn gc_passes(&self) -> f64 {
        self.metric("modelfs_gc_passes_total")
    }

    /// Waits until a pass after the first `before` passes has completed and nothing is waiting
    /// out its grace period.
    pub fn wait_gc_settled_since(&self, before: f64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if self.metric("modelfs_gc_passes_total") > before
                && self.metric("modelfs_gc_pending ") == 0.0
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "garbage collection did not settle\nmetrics:\n{}\nlog:\n{}",
            self.metrics(),
            self.log_text()
        );
    }

    pub fn wait_gone(&self, key: &str) {
        self.wait_until(&format!("{key} gone"), Duration::from_secs(30), |d| {
            d.get(key).is_none()
        });
    }

    pub fn metrics(&self) -> String {
        self.get("/metrics").1
    }

    /// Sum of the samples of a metric whose line starts with `prefix` (name plus optional
    /// label selector), 0 if absent.
    pub fn metric(&self, prefix: &str) -> f64 {
        self.metrics()
            .lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// SIGKILL: no clean-up at all, as in a crash (the dead mount stays for the next daemon).
    pub fn kill9(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.mount = PathBuf::new();
    }

    /// SIGTERM (a hand-on: the keeper keeps the mount for the next daemon on this state) and
    /// wait for the exit; returns whether it exited successfully. The mount stays; the
    /// environment ends it when it goes.
    pub fn hand_on(mut self) -> bool {
        let Some(mut c) = self.child.take() else {
            return false;
        };
        self.mount = PathBuf::new();
        terminate(c.id());
        c.wait().map(|s| s.success()).unwrap_or(false)
    }

    /// SIGINT (Ctrl-C: the end of the mount) and wait for a clean exit; returns whether it
    /// exited successfully. (SIGTERM hands the mount on instead: see `tests/takeover.rs`.)
    pub fn stop(mut self) -> bool {
        let Some(mut c) = self.child.take() else {
            return false;
        };
        interrupt(c.id());
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = c.try_wait() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
        false
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if !self.mount.as_os_str().is_empty() {
            let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
        }
    }
}

/// Minimal HTTP/1.0 GET over loopback (no client library needed for tests).
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let code = head.split(' ').nth(1)?.parse().ok()?;
    Some((code, body.to_string()))
}

/// YAML of a ClusterBaseModel.
pub fn cluster_model(name: &str, uri: &str, policy: &str, path: Option<&str>) -> String {
    let path = path.map(|p| format!("\n    path: {p}")).unwrap_or_default();
    format!(
        "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: {name}\nspec:\n  storage:\n    storageUri: {uri}\n    downloadPolicy: {policy}{path}\n"
    )
}

/// YAML of a BaseModel.
pub fn base_model(ns: &str, name: &str, uri: &str, policy: &str, path: Option<&str>) -> String {
    let path = path.map(|p| format!("\n    path: {p}")).unwrap_or_default();
    format!(
        "apiVersion: ome.io/v1beta1\nkind: BaseModel\nmetadata:\n  name: {name}\n  namespace: {ns}\nspec:\n  storage:\n    storageUri: {uri}\n    downloadPolicy: {policy}{path}\n"
    )
}

/// Deterministic pseudo-random bytes (xorshift), so failures are reproducible.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A source tree with nested directories, an empty file, a non-ASCII name and one larger file.
pub fn make_model_dir(dir: &Path, seed: u64, large: usize) {
    let files: Vec<(String, usize)> = vec![
        ("config.json".into(), 512),
        ("tokenizer/tokenizer.json".into(), 20_000),
        ("tokenizer/vocab/merges.txt".into(), 7_777),
        ("empty.txt".into(), 0),
        ("caf\u{e9}/r\u{e9}sum\u{e9}.md".into(), 300),
        ("weights/model-00001-of-00002.safetensors".into(), large),
        (
            "weights/model-00002-of-00002.safetensors".into(),
            large / 3 + 1,
        ),
    ];
    for (i, (p, len)) in files.iter().enumerate() {
        let path = dir.join(p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, bytes(seed * 100 + i as u64, *len)).unwrap();
    }
}

/// Every entry below `dir`: relative path -> (is_dir, size, mode bits, sha256 of content).
pub fn tree(dir: &Path) -> std::collections::BTreeMap<String, (bool, u64, u32, String)> {
    let mut out = std::collections::BTreeMap::new();
    fn walk(
        base: &Path,
        dir: &Path,
        out: &mut std::collections::BTreeMap<String, (bool, u64, u32, String)>,
    ) {
        let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().flatten().collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let p = e.path();
            let rel = p.strip_prefix(base).unwrap().to_string_lossy().into_owned();
            let m = std::fs::metadata(&p).unwrap();
            if m.is_dir() {
                out.insert(
                    rel,
                    (true, 0, m.permissions().mode() & 0o7777, String::new()),
                );
                walk(base, &p, out);
            } else {
                let data = std::fs::read(&p).unwrap();
                out.insert(
                    rel,
                    (
                        false,
                        m.len(),
                        m.permissions().mode() & 0o7777,
                        hex::encode(Sha256::digest(&data)),
                    ),
                );
            }
        }
    }
    walk(dir, dir, &mut out);
    out
}

/// Relative path, size and sha256 of every file and directory below `dir` (what two trees must
/// share to hold the same model).
pub fn contents(dir: &Path) -> Vec<(String, u64, String)> {
    tree(dir).into_iter().map(|(k, v)| (k, v.1, v.3)).collect()
}

/// The Python interpreter with `safetensors`, `numpy` and `huggingface_hub` (created by
/// `.ci/run` / `scripts/test`). Missing is a test failure, not a skip.
pub fn python() -> PathBuf {
    let p = std::env::var_os("MODELFS_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python"));
    assert!(
        p.exists(),
        "Python for real-client tests not found at {} (run scripts/test, or set MODELFS_TEST_PYTHON)",
        p.display()
    );
    p
}

/// Runs a shell command and returns stdout; panics on failure.
pub fn sh(cmd: &str) -> String {
    let out = Command::new("bash").arg("-c").arg(cmd).output().unwrap();
    assert!(
        out.status.success(),
        "`{cmd}` failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Readers that loop over every file of some model directories, checking names and bytes,
/// until stopped. Any error, missing file or wrong byte is counted.
pub struct Readers {
    stop: Arc<AtomicBool>,
    passes: Arc<AtomicU64>,
    threads: Vec<JoinHandle<Vec<String>>>,
}

impl Readers {
    pub fn start(dirs: &[PathBuf], want: &BTreeMap<String, String>) -> Readers {
        let stop = Arc::new(AtomicBool::new(false));
        let passes = Arc::new(AtomicU64::new(0));
        let threads = dirs
            .iter()
            .cloned()
            .map(|dir| {
                let (stop, passes, want) = (stop.clone(), passes.clone(), want.clone());
                std::thread::spawn(move || {
                    let mut problems = Vec::new();
                    while !stop.load(Ordering::Relaxed) && problems.len() < 20 {
                        for (rel, sha) in &want {
                            match std::fs::read(dir.join(rel)) {
                                Ok(data) => {
                                    if hex::encode(Sha256::digest(&data)) != *sha {
                                        problems
                                            .push(format!("{}/{rel}: wrong bytes", dir.display()));
                                    }
                                }
                                Err(e) => problems.push(format!("{}/{rel}: {e}", dir.display())),
                            }
                        }
                        passes.fetch_add(1, Ordering::Relaxed);
                    }
                    problems
                })
            })
            .collect();
        Readers {
            stop,
            passes,
            threads,
        }
    }

    /// Stops the readers and asserts they saw nothing wrong (and did read something).
    pub fn finish(self) {
        std::thread::sleep(Duration::from_millis(300));
        self.stop.store(true, Ordering::Relaxed);
        let problems: Vec<String> = self
            .threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        assert!(problems.is_empty(), "readers saw problems: {problems:#?}");
        assert!(
            self.passes.load(Ordering::Relaxed) > 0,
            "readers never completed a pass"
        );
    }
}

/// Relative path -> sha256 of every file below `src`.
pub fn files_of(src: &Path) -> BTreeMap<String, String> {
    tree(src)
        .into_iter()
        .filter(|(_, v)| !v.0)
        .map(|(k, v)| (k, v.3))
        .collect()
}

/// Polls `pred` every 10 ms until it holds; panics naming `what` after `timeout`.
pub fn wait_for(what: &str, timeout: Duration, mut pred: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if pred() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("timed out waiting for {what}");
}

/// SIGINT to a child process of this test.
pub fn interrupt(pid: u32) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
    }
}

/// SIGTERM to a child process of this test.
pub fn terminate(pid: u32) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
}

/// The daemon's counter `metric` once it includes every request made so far: the mount server
/// reports its FUSE counters to the agent from time to time, so a `statfs` is sent as a marker
/// and its count waited for (counters are reported as one snapshot).
pub fn counters_after_marker(d: &Daemon, mount: &Path, metric: &str) -> f64 {
    let statfs = r#"modelfs_fuse_requests_total{op="statfs"}"#;
    let marker = d.metric(statfs);
    sh(&format!("stat -f {} >/dev/null", mount.display()));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while d.metric(statfs) <= marker {
        assert!(
            std::time::Instant::now() < deadline,
            "the statfs marker never reached the metrics"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    d.metric(metric)
}

/// The pid of the one child of `pid` (the agent `modelfs serve` supervises).
pub fn only_child(pid: u32) -> Option<u32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let text = std::fs::read_to_string(task.ok()?.path().join("children")).unwrap_or_default();
        out.extend(
            text.split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok()),
        );
    }
    (out.len() == 1).then(|| out[0])
}
