//! The mount server / agent split (issue 10 part 1), with real FUSE and real processes: the
//! agent is killed and upgraded under readers; the mount server is killed and serves its
//! persisted mapping alone; bad peers and bad mappings are refused with a reason.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{FileExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    cluster_model, files_of, http_get, make_model_dir, wait_for, TestEnv, Transport, UringParam,
    BIN,
};
use sha2::{Digest, Sha256};

/// Mount ID (first field of /proc/self/mountinfo) of the mount at `path`, if any.
fn mount_id(path: &Path) -> Option<u64> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let want = path.to_str().unwrap();
    info.lines()
        .filter(|l| l.split(' ').nth(4) == Some(want))
        .filter_map(|l| l.split(' ').next()?.parse().ok())
        .next_back()
}

/// The processes of one split deployment, started separately (as Kubernetes runs them).
struct Split {
    env: TestEnv,
    socket: PathBuf,
    /// The agent's address (it picks its port at each start: `--listen-addr-file`).
    listen: String,
    listen_file: PathBuf,
    log: PathBuf,
    server: Option<Child>,
    agent: Option<Child>,
    /// The mount server's `--fuse-transport`.
    transport: Transport,
    _uring: Option<UringParam>,
    /// The umask both processes start with (`None`: the test's own).
    umask: Option<&'static str>,
}

impl Split {
    /// A split daemon (server, then agent) with one `local://` AlwaysDownload model `name`
    /// (see [`model_source`]); returns its files, path -> sha256.
    fn serving_one_model(name: &str, seed: u64) -> (Self, BTreeMap<String, String>) {
        Self::serving_one_model_over(name, seed, Transport::Dev)
    }

    fn serving_one_model_over(
        name: &str,
        seed: u64,
        transport: Transport,
    ) -> (Self, BTreeMap<String, String>) {
        let mut split = Split::new();
        if transport == Transport::Uring {
            split._uring = Some(UringParam::acquire());
        }
        split.transport = transport;
        let (src, files) = model_source(&split.env, name, seed);
        split.env.write_models(
            &format!("{name}.yaml"),
            &cluster_model(
                name,
                &format!("local://{}", src.display()),
                "AlwaysDownload",
                None,
            ),
        );
        split.start_server();
        split.start_agent(Path::new(BIN));
        (split, files)
    }

    fn new() -> Self {
        let env = TestEnv::new();
        let socket = env.root.path().join("run").join("agent.sock");
        let log = env.root.path().join("split.log");
        Split {
            listen: String::new(),
            listen_file: env.root.path().join("agent.addr"),
            env,
            socket,
            log,
            server: None,
            agent: None,
            transport: Transport::Dev,
            _uring: None,
            umask: None,
        }
    }

    /// `bin`, started under `self.umask` when one is set.
    fn command(&self, bin: &Path) -> Command {
        match self.umask {
            None => Command::new(bin),
            Some(umask) => {
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("umask {umask}; exec \"$0\" \"$@\""))
                    .arg(bin);
                c
            }
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

    fn start_server(&mut self) {
        let started_before = self.log_text().matches("waiting for the agent").count();
        let log = self.log_file();
        let child = self
            .command(Path::new(BIN))
            .arg("mount-server")
            .arg("--mount")
            .arg(&self.env.mount)
            .arg("--state")
            .arg(&self.env.state)
            .arg("--mount-socket")
            .arg(&self.socket)
            .arg("--fuse-transport")
            .arg(self.transport.flag())
            .env("RUST_LOG", "info,modelfs=debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.server = Some(child);
        // Logged once mounted and listening.
        wait_for("the mount server", Duration::from_secs(30), || {
            self.log_text().matches("waiting for the agent").count() > started_before
        });
    }

    fn start_agent(&mut self, bin: &Path) {
        let _ = std::fs::remove_file(&self.listen_file);
        let log = self.log_file();
        let child = self
            .command(bin)
            .arg("agent")
            .arg("--mount")
            .arg(&self.env.mount)
            .arg("--state")
            .arg(&self.env.state)
            .arg("--models")
            .arg(&self.env.models)
            .arg("--listen")
            .arg(common::ANY_PORT)
            .arg("--listen-addr-file")
            .arg(&self.listen_file)
            .arg("--gc-grace-secs")
            .arg("1")
            .arg("--mount-socket")
            .arg(&self.socket)
            .env("RUST_LOG", "info,modelfs=debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.agent = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        self.listen = common::listen_addr(&self.listen_file, Duration::from_secs(30), || {
            self.log_text()
        });
        let listen = self.listen.clone();
        while Instant::now() < deadline {
            if let Some((200, _)) = http_get(&listen, "/readyz") {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("agent did not become ready; log:\n{}", self.log_text());
    }

    fn kill_agent(&mut self) {
        if let Some(mut c) = self.agent.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    /// SIGTERM, as a rolling update does.
    fn stop_agent(&mut self) {
        if let Some(mut c) = self.agent.take() {
            common::terminate(c.id());
            c.wait().unwrap();
        }
    }

    fn kill_server(&mut self) {
        if let Some(mut c) = self.server.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    fn status(&self) -> serde_json::Value {
        match http_get(&self.listen, "/v1/models") {
            Some((200, body)) => serde_json::from_str(&body).unwrap(),
            _ => serde_json::Value::Null,
        }
    }

    fn wait_ready(&self, key: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if self.status()[key]["status"] == "Ready" {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{key} never Ready; log:\n{}", self.log_text());
    }
}

impl Drop for Split {
    fn drop(&mut self) {
        self.kill_agent();
        self.kill_server();
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.env.mount)
            .status();
    }
}

/// A model directory with 20 small files and one larger one: path -> sha256.
fn model_source(env: &TestEnv, name: &str, seed: u64) -> (PathBuf, BTreeMap<String, String>) {
    let src = env.dir(name);
    make_model_dir(&src, seed, 300_000);
    for i in 0..20 {
        std::fs::write(
            src.join(format!("part-{i:02}.bin")),
            common::bytes(seed * 1000 + i, 1000 + (i as usize) * 37),
        )
        .unwrap();
    }
    let files = files_of(&src);
    (src, files)
}

/// Readers over the mount: fresh opens of random files, and long-held handles re-read from
/// the start, both checking bytes.
struct Readers {
    stop: Arc<AtomicBool>,
    opens: Arc<AtomicU64>,
    held_reads: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<Vec<String>>>,
}

impl Readers {
    fn start(files: Vec<(PathBuf, String)>) -> Readers {
        let stop = Arc::new(AtomicBool::new(false));
        let opens = Arc::new(AtomicU64::new(0));
        let held_reads = Arc::new(AtomicU64::new(0));
        let files = Arc::new(files);
        let mut threads = Vec::new();
        for t in 0..2u64 {
            let (stop, opens, files) = (stop.clone(), opens.clone(), files.clone());
            threads.push(std::thread::spawn(move || {
                let mut problems = Vec::new();
                let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ t;
                while !stop.load(Ordering::Relaxed) && problems.len() < 20 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let (path, sha) = &files[(x % files.len() as u64) as usize];
                    match std::fs::read(path) {
                        Ok(data) if hex::encode(Sha256::digest(&data)) == *sha => {}
                        Ok(_) => problems.push(format!("{}: wrong bytes", path.display())),
                        Err(e) => problems.push(format!("open {}: {e}", path.display())),
                    }
                    opens.fetch_add(1, Ordering::Relaxed);
                }
                problems
            }));
        }
        let held: Vec<(std::fs::File, PathBuf, String)> = files
            .iter()
            .map(|(p, sha)| (std::fs::File::open(p).unwrap(), p.clone(), sha.clone()))
            .collect();
        let (stop2, held_reads2) = (stop.clone(), held_reads.clone());
        threads.push(std::thread::spawn(move || {
            let mut problems = Vec::new();
            while !stop2.load(Ordering::Relaxed) && problems.len() < 20 {
                for (file, path, sha) in &held {
                    let len = file.metadata().map(|m| m.len()).unwrap_or(0) as usize;
                    let mut buf = vec![0u8; len];
                    match file.read_exact_at(&mut buf, 0) {
                        Ok(()) if hex::encode(Sha256::digest(&buf)) == *sha => {}
                        Ok(()) => problems.push(format!("held {}: wrong bytes", path.display())),
                        Err(e) => problems.push(format!("held {}: {e}", path.display())),
                    }
                    held_reads2.fetch_add(1, Ordering::Relaxed);
                }
            }
            problems
        }));
        Readers {
            stop,
            opens,
            held_reads,
            threads,
        }
    }

    /// Waits until both kinds of reader made progress past what they had done now.
    fn wait_progress(&self) {
        let (o, h) = (
            self.opens.load(Ordering::Relaxed),
            self.held_reads.load(Ordering::Relaxed),
        );
        wait_for("reader progress", Duration::from_secs(30), || {
            self.opens.load(Ordering::Relaxed) > o + 10
                && self.held_reads.load(Ordering::Relaxed) > h + 10
        });
    }

    fn finish(self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        let problems: Vec<String> = self
            .threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        assert!(problems.is_empty(), "readers saw problems: {problems:#?}");
        (
            self.opens.load(Ordering::Relaxed),
            self.held_reads.load(Ordering::Relaxed),
        )
    }
}

#[test]
fn agent_killed_50_times_and_upgraded_10_times_under_readers() {
    let mut split = Split::new();
    let mut all_files = Vec::new();
    let mut yaml = String::new();
    for (i, name) in ["alpha", "beta", "gamma"].iter().enumerate() {
        let (src, files) = model_source(&split.env, name, i as u64 + 1);
        yaml.push_str(&cluster_model(
            name,
            &format!("local://{}", src.display()),
            "AlwaysDownload",
            Some(&format!("models/{name}")),
        ));
        yaml.push_str("---\n");
        for (rel, sha) in files {
            all_files.push((split.env.mount.join("models").join(name).join(rel), sha));
        }
    }
    split.env.write_models("models.yaml", &yaml);
    // Two copies of the binary: an upgrade restarts the agent from the other file.
    let old_bin = split.env.root.path().join("modelfs-old");
    let new_bin = split.env.root.path().join("modelfs-new");
    std::fs::copy(BIN, &old_bin).unwrap();
    std::fs::copy(BIN, &new_bin).unwrap();
    split.start_server();
    split.start_agent(&old_bin);
    for name in ["alpha", "beta", "gamma"] {
        split.wait_ready(&format!("clusterbasemodel.{name}"));
    }
    let id = mount_id(&split.env.mount).expect("mounted");
    let readers = Readers::start(all_files);
    readers.wait_progress();

    let (late_src, late_files) = model_source(&split.env, "late", 9);
    for round in 0..50 {
        split.kill_agent();
        if round == 25 {
            // A model added while no agent runs appears once one is back.
            split.env.write_models(
                "late.yaml",
                &cluster_model(
                    "late",
                    &format!("local://{}", late_src.display()),
                    "AlwaysDownload",
                    Some("models/late"),
                ),
            );
        }
        readers.wait_progress();
        assert_eq!(mount_id(&split.env.mount), Some(id), "round {round}");
        split.start_agent(if round % 2 == 0 { &new_bin } else { &old_bin });
        assert_eq!(mount_id(&split.env.mount), Some(id), "round {round}");
    }
    split.wait_ready("clusterbasemodel.late");
    for (rel, sha) in &late_files {
        let data = std::fs::read(split.env.mount.join("models/late").join(rel)).unwrap();
        assert_eq!(hex::encode(Sha256::digest(&data)), *sha, "{rel}");
    }
    let connects_before = split.log_text().matches("agent connected").count();
    for round in 0..10 {
        // Upgrade: the old agent stops as in a rolling update, the other binary starts.
        split.stop_agent();
        readers.wait_progress();
        split.start_agent(if round % 2 == 0 { &new_bin } else { &old_bin });
        readers.wait_progress();
        assert_eq!(mount_id(&split.env.mount), Some(id), "upgrade {round}");
    }
    let (opens, held) = readers.finish();
    // Every agent start passed the protocol check.
    assert_eq!(
        split.log_text().matches("agent connected").count(),
        connects_before + 10
    );
    assert!(!split.log_text().contains("connection refused"));
    eprintln!("readers: {opens} fresh opens, {held} reads of held handles, no failure");
}

#[test]
fn mount_server_sigkill_remounts_the_persisted_mapping_without_the_agent() {
    mount_server_sigkill_remounts_over(Transport::Dev);
}

/// Over io_uring the dead server's ring goes with its connection: callers get `ENOTCONN`, not
/// a wait on queues nobody serves, and the restarted server registers a new ring.
#[test]
fn mount_server_sigkill_remounts_the_persisted_mapping_over_io_uring() {
    mount_server_sigkill_remounts_over(Transport::Uring);
}

fn mount_server_sigkill_remounts_over(transport: Transport) {
    let (mut split, files) = Split::serving_one_model_over("m", 3, transport);
    split.wait_ready("clusterbasemodel.m");
    split.kill_agent();
    split.kill_server();
    // The dead connection: ENOTCONN until a new server cleans it up. Over io_uring a request
    // made while the dead server's queues are torn down (the kernel does that after the
    // process exits) is ended with ECONNABORTED or ECANCELED instead.
    let err = std::fs::read_dir(&split.env.mount).unwrap_err();
    match transport {
        Transport::Dev => assert_eq!(err.raw_os_error(), Some(libc::ENOTCONN)),
        Transport::Uring => assert!(
            matches!(
                err.raw_os_error(),
                Some(libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED)
            ),
            "{err}"
        ),
    }
    // Files of the artifacts directory that the mapping does not name (a stray, the temporary
    // file of a write a crash cut short) are removed at start.
    let artifacts_dir = split.env.state.join("mount-server").join("artifacts");
    let named: Vec<PathBuf> = std::fs::read_dir(&artifacts_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(named.len(), 1, "{named:?}");
    let stray = artifacts_dir.join(format!("{}.json", "0".repeat(64)));
    std::fs::write(&stray, b"{}").unwrap();
    let cut_short = artifacts_dir.join(".x.json.tmp.1");
    std::fs::write(&cut_short, b"{").unwrap();
    split.start_server();
    assert!(!stray.exists(), "an artifact file no mapping names");
    assert!(!cut_short.exists(), "a temporary file");
    assert!(named[0].exists(), "the artifact the mapping names");
    // A fresh mount (the kernel may reuse the mount id of the one it replaced).
    assert!(mount_id(&split.env.mount).is_some());
    for (rel, sha) in &files {
        let data = std::fs::read(split.env.mount.join("m").join(rel)).unwrap();
        assert_eq!(hex::encode(Sha256::digest(&data)), *sha, "{rel}");
    }
    assert!(split
        .log_text()
        .contains("serving the persisted mapping models=1"));
    // Exactly one mount left at the path (the stale one was removed).
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let at = info
        .lines()
        .filter(|l| l.split(' ').nth(4) == split.env.mount.to_str())
        .count();
    assert_eq!(at, 1);
    let rings = split
        .log_text()
        .matches("serving FUSE requests over io_uring")
        .count();
    match transport {
        Transport::Dev => assert_eq!(rings, 0),
        Transport::Uring => assert_eq!(rings, 2, "the first server and the restarted one"),
    }
}

/// Deletes one blob from the stores behind the daemon's back (the last by name); returns its
/// path and digest.
fn remove_a_blob(split: &Split) -> (PathBuf, String) {
    let blobs: Vec<PathBuf> = std::fs::read_dir(split.env.state.join("stores"))
        .unwrap()
        .flat_map(|store| std::fs::read_dir(store.unwrap().path().join("blobs")).unwrap())
        .map(|b| b.unwrap().path())
        .collect();
    let missing = blobs.into_iter().max().expect("a blob in the stores");
    std::fs::remove_file(&missing).unwrap();
    let digest = missing.file_name().unwrap().to_str().unwrap().to_string();
    (missing, digest)
}

/// The persisted mapping is served at start without a look at its blobs (they were checked
/// when it was applied); they are checked once the mount answers, and an entry whose blob is
/// gone is then no longer served, with the reason logged, with no agent to send a mapping.
#[test]
fn a_persisted_entry_whose_blob_is_gone_is_dropped_after_the_restart() {
    let (mut split, _files) = Split::serving_one_model("m", 7);
    split.wait_ready("clusterbasemodel.m");
    split.kill_agent();
    split.kill_server();
    let (_, digest) = remove_a_blob(&split);
    split.start_server();
    wait_for(
        "the check of the persisted mapping",
        Duration::from_secs(30),
        || split.log_text().contains("persisted mapping checked"),
    );
    let log = split.log_text();
    assert!(
        log.contains("persisted mapping checked entries=1 broken=1"),
        "{log}"
    );
    let reason = log
        .lines()
        .find(|l| l.contains("no longer served"))
        .unwrap_or_else(|| panic!("no reason logged: {log}"));
    assert!(
        reason.contains(&digest) && reason.contains("missing from store"),
        "{reason}"
    );
    assert!(log.contains("mapping entry refused path=m"), "{log}");
    assert!(!split.env.mount.join("m").exists());
    // Persisted without it: the next start serves nothing and checks nothing.
    let state_dir = split.env.state.join("mount-server");
    let persisted: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state_dir.join("mapping.json")).unwrap()).unwrap();
    assert_eq!(persisted["mapping"]["entries"], serde_json::json!([]));
    assert_eq!(
        std::fs::read_dir(state_dir.join("artifacts"))
            .unwrap()
            .count(),
        0
    );
}

/// A mapping entry the mount server refuses (a blob deleted behind the daemon's back while the
/// server was down) is not only logged: the model is `Failed` with the server's reason in its
/// status, and the retry fetches what is missing, after which it is served again.
#[test]
fn a_refused_entry_is_failed_with_the_servers_reason_then_retried() {
    let (mut split, files) = Split::serving_one_model("m", 6);
    let key = "clusterbasemodel.m";
    split.wait_ready(key);
    // The agent stays up; the server goes, and one blob of the model's store with it.
    split.kill_server();
    let (missing, digest) = remove_a_blob(&split);
    split.start_server();
    // The server refuses the model (its persisted mapping, then the agent's) with the reason;
    // the status shows it.
    let mut seen = serde_json::Value::Null;
    wait_for(
        "the model Failed with the reason",
        Duration::from_secs(60),
        || {
            seen = split.status()[key].clone();
            seen["status"] == "Failed"
                && seen["reason"].as_str().is_some_and(|r| {
                    r.contains("mount server refused") && r.contains("missing from store")
                })
        },
    );
    let reason = seen["reason"].as_str().unwrap();
    assert!(reason.contains(&digest), "{reason}");
    assert!(reason.contains("retry 1 in"), "{reason}");
    // Retried: the missing blob is fetched again and the model is served.
    split.wait_ready(key);
    wait_for("the model in the mount", Duration::from_secs(30), || {
        split.env.mount.join("m").exists()
    });
    for (rel, sha) in &files {
        let data = std::fs::read(split.env.mount.join("m").join(rel)).unwrap();
        assert_eq!(hex::encode(Sha256::digest(&data)), *sha, "{rel}");
    }
    assert!(missing.exists(), "the missing blob was fetched again");
}

/// The blob file of `sha` (hex) in whichever store holds it.
fn blob_of(split: &Split, sha: &str) -> PathBuf {
    std::fs::read_dir(split.env.state.join("stores"))
        .unwrap()
        .map(|store| store.unwrap().path().join("blobs").join(sha))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("no blob {sha}"))
}

/// Opens and reads `path` on another thread; the error it ended with, or a panic if it has
/// not ended within 10 s (a FIFO planted as a blob hung the mount server's open before).
fn read_fails(path: PathBuf) -> std::io::Error {
    let (tx, rx) = std::sync::mpsc::channel();
    let shown = path.display().to_string();
    std::thread::spawn(move || {
        let _ = tx.send(std::fs::read(&path));
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(Ok(data)) => panic!(
            "{shown} was served: {:?}...",
            String::from_utf8_lossy(&data[..data.len().min(16)])
        ),
        Ok(Err(e)) => e,
        Err(_) => panic!("reading {shown} hangs"),
    }
}

/// What the (unprivileged) agent could plant in a store, in place of blobs the mount server
/// serves: a symbolic link to a root-only file of the same size, one to a file of another
/// size, a FIFO, and a hard link to a file a user owns and may write. None of them is served
/// (each open fails with EIO at once), nothing hangs, no log line tells the size of a file
/// outside the stores; after a restart the persisted entry is dropped for it. The other files
/// of the model keep reading.
#[test]
fn links_fifos_and_user_writable_links_planted_in_a_store_are_never_served() {
    use std::os::unix::fs::PermissionsExt;
    let (mut split, files) = Split::serving_one_model("m", 8);
    split.wait_ready("clusterbasemodel.m");
    let model = split.env.mount.join("m");
    let outside = split.env.dir("outside");
    let secret_of = |name: &str, size: usize| {
        let path = outside.join(name);
        std::fs::write(&path, vec![b'S'; size]).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path
    };
    let plant = |rel: &str, how: &dyn Fn(&Path, u64)| {
        let blob = blob_of(&split, &files[rel]);
        let size = std::fs::metadata(&blob).unwrap().len();
        std::fs::remove_file(&blob).unwrap();
        how(&blob, size);
    };
    plant("part-00.bin", &|blob, size| {
        std::os::unix::fs::symlink(secret_of("same-size", size as usize), blob).unwrap()
    });
    plant("part-01.bin", &|blob, _| {
        std::os::unix::fs::symlink(secret_of("other-size", 987_654), blob).unwrap()
    });
    plant("part-02.bin", &|blob, _| {
        rustix::fs::mknodat(
            rustix::fs::CWD,
            blob,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap()
    });
    plant("part-03.bin", &|blob, size| {
        let mine = outside.join("users-file");
        std::fs::write(&mine, vec![b'U'; size as usize]).unwrap();
        rustix::fs::chown(&mine, Some(rustix::process::Uid::from_raw(65534)), None).unwrap();
        std::fs::hard_link(&mine, blob).unwrap();
    });
    let planted = ["part-00.bin", "part-01.bin", "part-02.bin", "part-03.bin"];
    for rel in planted {
        let err = read_fails(model.join(rel));
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{rel}: {err}");
    }
    for (rel, sha) in files.iter().filter(|(r, _)| !planted.contains(&r.as_str())) {
        let data = std::fs::read(model.join(rel)).unwrap();
        assert_eq!(hex::encode(Sha256::digest(&data)), *sha, "{rel}");
    }
    let log = split.log_text();
    for reason in [
        "refused: a symbolic link is on its path",
        "refused: not a regular file",
        "refused: not owned by root",
    ] {
        assert!(log.contains(reason), "{reason}: {log}");
    }

    // A restart: the persisted mapping is served on trust, then checked: the entry is
    // dropped, without hanging on the FIFO.
    split.kill_agent();
    split.kill_server();
    split.start_server();
    wait_for(
        "the check of the persisted mapping",
        Duration::from_secs(30),
        || split.log_text().contains("persisted mapping checked"),
    );
    let log = split.log_text();
    assert!(
        log.contains("persisted mapping checked entries=1 broken=1"),
        "{log}"
    );
    let reason = log
        .lines()
        .find(|l| l.contains("no longer served"))
        .unwrap_or_else(|| panic!("no reason logged: {log}"));
    assert!(reason.contains("is refused: "), "{reason}");
    assert!(!model.exists());
    assert!(!log.contains("987654") && !log.contains("987 654"), "{log}");
}

/// Under umask 000 every file and directory the two processes create in the state directory
/// is still writable by root alone (before, a blob came out 0666: any user could rewrite what
/// every pod reads), blobs are 0444, and the mount server serves them.
#[test]
fn state_files_get_their_modes_whatever_the_umask() {
    let mut split = Split::new();
    split.umask = Some("000");
    let (src, files) = model_source(&split.env, "m", 9);
    split.env.write_models(
        "m.yaml",
        &cluster_model(
            "m",
            &format!("local://{}", src.display()),
            "AlwaysDownload",
            None,
        ),
    );
    split.start_server();
    split.start_agent(Path::new(BIN));
    split.wait_ready("clusterbasemodel.m");
    for (rel, sha) in &files {
        let data = std::fs::read(split.env.mount.join("m").join(rel)).unwrap();
        assert_eq!(hex::encode(Sha256::digest(&data)), *sha, "{rel}");
    }
    let mut seen = 0;
    let mut blobs = 0;
    let mut todo = vec![split.env.state.clone()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let mode = meta.permissions().mode() & 0o7777;
            if meta.file_type().is_socket() {
                continue;
            }
            assert_eq!(mode & 0o022, 0, "{} is {mode:o}", path.display());
            if meta.is_dir() {
                todo.push(path.clone());
            }
            if path.parent().and_then(Path::file_name) == Some("blobs".as_ref()) {
                assert_eq!(mode, 0o444, "{}", path.display());
                blobs += 1;
            }
            seen += 1;
        }
    }
    assert!(blobs >= files.len() - 1, "{blobs} blobs");
    assert!(seen > blobs + 5, "{seen} entries checked");
    let state = std::fs::metadata(&split.env.state)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(state & 0o022, 0, "the state directory is {state:o}");
}

/// Sends `hello` with a protocol version and returns the server's first line. The write may
/// find the connection closed already (a server refusing a connection beyond its cap answers
/// without reading): the answer is read all the same.
fn hello(socket: &Path, version: u32) -> String {
    let mut s = UnixStream::connect(socket).unwrap();
    let _ = writeln!(s, r#"{{"hello":{{"protocol":{version},"agent":"test"}}}}"#);
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    line
}

#[test]
fn bad_peers_and_bad_mappings_are_refused_with_a_reason() {
    use modelfs_agent::mount_client::{handshake, ConnectError};
    use modelfs_mount::protocol::{self, AgentMessage, ServerMessage, WireMapping};

    let (mut split, files) = Split::serving_one_model("good", 4);
    split.wait_ready("clusterbasemodel.good");
    let check_good = |split: &Split| {
        for (rel, sha) in &files {
            let data = std::fs::read(split.env.mount.join("good").join(rel)).unwrap();
            assert_eq!(hex::encode(Sha256::digest(&data)), *sha, "{rel}");
        }
    };

    // The socket is private to root.
    let dir_mode = std::fs::metadata(split.socket.parent().unwrap())
        .unwrap()
        .permissions()
        .mode();
    let sock_mode = std::fs::metadata(&split.socket)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!((dir_mode & 0o777, sock_mode & 0o777), (0o700, 0o600));

    // A wrong protocol version, with both versions in the reason.
    let answer = hello(&split.socket, 999);
    assert!(answer.contains("refused"), "{answer}");
    assert!(answer.contains("protocol version 999"), "{answer}");
    assert!(
        answer.contains(&format!("version {}", protocol::PROTOCOL_VERSION)),
        "{answer}"
    );
    // A newer agent that still speaks this server's version (its hello says the range) is
    // welcomed with the newest version both speak: the two DaemonSets upgrade independently.
    let (_stream, welcome, _) = handshake(&split.socket, 998).expect("a common version");
    assert!(!welcome.server.is_empty());
    // A range that does not reach this server's version is refused, naming both ranges.
    let mut s = UnixStream::connect(&split.socket).unwrap();
    writeln!(
        s,
        r#"{{"hello":{{"protocol":998,"protocol_min":990,"agent":"test"}}}}"#
    )
    .unwrap();
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer).unwrap();
    assert!(answer.contains("refused"), "{answer}");
    assert!(answer.contains("oldest 990"), "{answer}");
    assert!(matches!(
        handshake(&split.socket, 0),
        Err(ConnectError::Refused(r)) if r.contains("protocol version 0")
    ));
    check_good(&split);

    // A peer that is not root, even when the permissions were loosened by mistake.
    for dir in [split.env.root.path(), split.socket.parent().unwrap()] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::set_permissions(&split.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let script = format!(
        "import socket\ns=socket.socket(socket.AF_UNIX)\ns.connect({:?})\ntry:\n    s.sendall(b'{{\"hello\":{{\"protocol\":{},\"agent\":\"nobody\"}}}}\\n')\nexcept OSError:\n    pass\nprint(s.makefile().readline())",
        split.socket.to_str().unwrap(),
        protocol::PROTOCOL_VERSION
    );
    let out = Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(&script)
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let answer = String::from_utf8_lossy(&out.stdout);
    assert!(
        answer.contains("refused") && answer.contains("uid 65534") && answer.contains("not root"),
        "stdout {answer} stderr {}",
        String::from_utf8_lossy(&out.stderr)
    );
    check_good(&split);

    // A mapping naming a missing blob (and one naming a missing store): those entries are
    // refused with a reason; the good model keeps serving. The agent is stopped first so that
    // it does not send its own mapping again.
    split.kill_agent();
    let state_dir = split.env.state.join("mount-server");
    let persisted: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state_dir.join("mapping.json")).unwrap()).unwrap();
    let good_entry = persisted["mapping"]["entries"][0].clone();
    let artifact_id = good_entry["artifact"].as_str().unwrap();
    let artifact: modelfs_core::artifact::StoredArtifact = serde_json::from_slice(
        &std::fs::read(
            state_dir
                .join("artifacts")
                .join(format!("{artifact_id}.json")),
        )
        .unwrap(),
    )
    .unwrap();
    // A store that exists but lacks the blobs.
    std::fs::create_dir_all(split.env.state.join("stores/s99999999/blobs")).unwrap();
    let mut entries: Vec<serde_json::Value> = vec![good_entry.clone()];
    let mut broken = good_entry.clone();
    broken["path"] = serde_json::json!(["broken"]);
    broken["store"] = serde_json::json!("s99999999");
    entries.push(broken);
    let mut nostore = good_entry.clone();
    nostore["path"] = serde_json::json!(["nostore"]);
    nostore["store"] = serde_json::json!("s88888888");
    entries.push(nostore);
    let mapping: WireMapping =
        serde_json::from_value(serde_json::json!({"entries": entries, "files": []})).unwrap();
    // An agent that says so in its hello hears which artifacts the server holds, and need not
    // send their manifests; an older agent's hello gets no list (it reads its welcome with a
    // 64 KiB limit).
    let old_style = hello(&split.socket, protocol::PROTOCOL_VERSION);
    assert!(
        old_style.contains("welcome") && old_style.contains(r#""artifacts":[]"#),
        "{old_style}"
    );
    let (mut stream, welcome, rest) = handshake(&split.socket, protocol::PROTOCOL_VERSION).unwrap();
    assert_eq!(
        welcome.held,
        std::collections::HashSet::from([artifact.id.clone()])
    );
    protocol::write_message(
        &mut stream,
        &AgentMessage::Apply {
            seq: 1,
            artifacts: Vec::new(),
            mapping,
        },
    )
    .unwrap();
    let mut reader = BufReader::new(std::io::Cursor::new(rest).chain(stream.try_clone().unwrap()));
    let applied = loop {
        match protocol::read_message::<_, ServerMessage>(&mut reader, 1 << 30)
            .unwrap()
            .expect("an answer")
        {
            ServerMessage::Applied { refused, error, .. } => break (refused, error),
            _ => continue,
        }
    };
    assert_eq!(applied.1, None);
    let reasons: BTreeMap<String, String> = applied
        .0
        .iter()
        .map(|r| (r.path.join("/"), r.reason.clone()))
        .collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons["broken"].contains("missing from store s99999999"),
        "{reasons:?}"
    );
    assert!(reasons["nostore"].contains("does not exist"), "{reasons:?}");
    assert!(state_dir
        .join("artifacts")
        .join(format!("{artifact_id}.json"))
        .exists());
    check_good(&split);
    let listing: Vec<String> = std::fs::read_dir(&split.env.mount)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(listing, vec!["good".to_string()]);
}

#[test]
fn serve_runs_the_agent_as_a_supervised_child() {
    let env = TestEnv::new();
    let (src, files) = model_source(&env, "m", 5);
    env.write_models(
        "m.yaml",
        &cluster_model(
            "m",
            &format!("local://{}", src.display()),
            "AlwaysDownload",
            None,
        ),
    );
    let mut d = common::Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.m", "Ready");
    let id = mount_id(&env.mount).unwrap();
    let children = |pid: u32| -> Vec<u32> {
        let mut out = Vec::new();
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
            let text =
                std::fs::read_to_string(task.unwrap().path().join("children")).unwrap_or_default();
            out.extend(text.split_whitespace().map(|p| p.parse::<u32>().unwrap()));
        }
        out
    };
    let agent = children(d.pid());
    assert_eq!(agent.len(), 1, "one agent child");
    // The supervisor gives the agent its malloc settings (BENCHMARKS.md, memory).
    let environ = std::fs::read(format!("/proc/{}/environ", agent[0])).unwrap();
    let environ: Vec<&[u8]> = environ.split(|b| *b == 0).collect();
    for (name, value) in modelfs_mount::supervise::AGENT_MALLOC_ENV {
        let want = format!("{name}={value}");
        assert!(
            environ.contains(&want.as_bytes()),
            "{want} in the agent's environment"
        );
    }
    let pid = rustix::process::Pid::from_raw(agent[0] as i32).expect("a pid");
    d.follow_agent_restart(|d| {
        rustix::process::kill_process(pid, rustix::process::Signal::KILL)
            .expect("SIGKILL the agent");
        wait_for(
            "the agent's death in the log",
            Duration::from_secs(30),
            || {
                d.log_text()
                    .contains("agent died; restarting it reason=killed by signal 9 (SIGKILL)")
            },
        );
    });
    wait_for("a new agent", Duration::from_secs(30), || {
        let now = children(d.pid());
        now.len() == 1 && now != agent
    });
    d.wait_model("clusterbasemodel.m", "Ready");
    for (rel, sha) in &files {
        let data = std::fs::read(env.mount.join("m").join(rel)).unwrap();
        assert_eq!(hex::encode(Sha256::digest(&data)), *sha, "{rel}");
    }
    assert_eq!(mount_id(&env.mount), Some(id));
    // Ctrl-C (SIGINT) stops both and unmounts.
    let agent = children(d.pid());
    assert!(d.stop(), "clean exit");
    assert!(mount_id(&env.mount).is_none());
    assert!(
        !Path::new(&format!("/proc/{}", agent[0])).exists() || {
            // A zombie reaped by init shows no cmdline.
            std::fs::read(format!("/proc/{}/cmdline", agent[0]))
                .map(|c| c.is_empty())
                .unwrap_or(true)
        }
    );
}

/// The mount server serves at most `MAX_CONNECTIONS` agent connections at once (a thread
/// each): one more is told why and closed at once. Once connections end, a new one is served
/// again (its bad hello gets the protocol's reason, not the cap's). The agent's connection and
/// the mount are untouched throughout.
#[test]
fn connections_beyond_the_cap_are_refused_with_a_reason() {
    use modelfs_mount::server::MAX_CONNECTIONS;

    let (split, files) = Split::serving_one_model("good", 5);
    split.wait_ready("clusterbasemodel.good");
    let check_good = || {
        for (rel, sha) in &files {
            let data = std::fs::read(split.env.mount.join("good").join(rel)).unwrap();
            assert_eq!(hex::encode(Sha256::digest(&data)), *sha, "{rel}");
        }
    };
    // Connections that say nothing hold their thread until the hello deadline; the agent's
    // own connection may hold one more.
    let idle: Vec<UnixStream> = (0..MAX_CONNECTIONS)
        .map(|_| UnixStream::connect(&split.socket).unwrap())
        .collect();
    let answer = hello(&split.socket, 999);
    assert!(
        answer.contains("refused")
            && answer.contains("too many connections")
            && answer.contains(&format!("at most {MAX_CONNECTIONS}")),
        "{answer}"
    );
    check_good();
    drop(idle);
    // The ended connections' threads see the end and free their places.
    let deadline = Instant::now() + Duration::from_secs(30);
    let answer = loop {
        let answer = hello(&split.socket, 999);
        if !answer.contains("too many connections") || Instant::now() > deadline {
            break answer;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        answer.contains("refused") && answer.contains("protocol version 999"),
        "served again: {answer}"
    );
    check_good();
}
