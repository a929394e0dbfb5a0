//! The disk budget end to end (SPEC section 12), with the state directory on a small tmpfs:
//! a fetch that cannot fit is refused with the reason and starts by itself when space is
//! freed; under pressure what nothing serves is reclaimed in order (never an open store); a
//! disk that another writer fills during a fetch fails it with the same reason, keeps the
//! served models serving, and the fetch is retried once space returns.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::hub::*;
use common::*;
use modelfs_agent::reconciler::decide::space::human_bytes;
use modelfs_devhub::hf::{FaultKind, HubFile};
use serde_json::Value;

fn uri(p: &Path) -> String {
    format!("local://{}", p.display())
}

/// A tmpfs of `size` on `dir`, unmounted (lazily) when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        sh(&format!(
            "mount -t tmpfs -o size={size} modelfs-test-tmpfs '{}'",
            dir.display()
        ));
        Tmpfs(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

fn disk(d: &Daemon) -> Value {
    let (code, body) = d.get("/v1/disk");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Another writer: fills `path` with `n` real bytes (tmpfs allocates only written pages).
fn fill(path: &Path, n: u64) {
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![0x5au8; 1 << 16];
    let mut left = n;
    while left > 0 {
        let k = left.min(chunk.len() as u64) as usize;
        if f.write_all(&chunk[..k]).is_err() {
            break;
        }
        left -= k as u64;
    }
    let _ = f.sync_all();
}

/// Fills the disk until `keep` bytes are left available (by statvfs).
fn fill_leaving(dir: &Path, name: &str, keep: u64) -> PathBuf {
    let v = rustix::fs::statvfs(dir).unwrap();
    let avail = v.f_bavail * v.f_frsize;
    let path = dir.join(name);
    fill(&path, avail.saturating_sub(keep));
    path
}

fn tree_size(dir: &Path) -> u64 {
    files_of_sizes(dir).values().sum()
}

fn files_of_sizes(dir: &Path) -> std::collections::BTreeMap<String, u64> {
    tree(dir)
        .into_iter()
        .filter(|(_, (is_dir, ..))| !is_dir)
        .map(|(p, (_, size, ..))| (p, size))
        .collect()
}

/// The store each model is served from, from the records.
fn stores_of(env: &TestEnv) -> std::collections::BTreeMap<String, String> {
    let text = std::fs::read_to_string(env.state.join("records.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["models"]
        .as_object()
        .unwrap()
        .iter()
        .filter_map(|(k, m)| Some((k.clone(), m["store"].as_str()?.to_string())))
        .collect()
}

fn store_dir(env: &TestEnv, store: &str) -> PathBuf {
    env.state.join("stores").join(store)
}

#[test]
fn a_fetch_that_cannot_fit_is_refused_with_the_reason_and_starts_when_space_is_freed() {
    let env = TestEnv::new();
    let _tmpfs = Tmpfs::mount(&env.state, "16m");
    let src = env.dir("big");
    make_model_dir(&src, 1, 3 << 20);
    let needed = tree_size(&src);
    let d = Daemon::start(&env, &["--disk-budget", "100%"]);
    d.wait_ready();
    assert_eq!(disk(&d)["budget"], "100%");

    // Another writer leaves 1 MiB.
    let filler = fill_leaving(&env.state, "filler", 1 << 20);
    env.write_models(
        "big.yaml",
        &cluster_model("big", &uri(&src), "AlwaysDownload", None),
    );
    let e = d.wait_model("clusterbasemodel.big", "Failed");
    let reason = e["reason"].as_str().unwrap();
    assert!(
        reason.starts_with(&format!(
            "InsufficientStorage: needs {}, ",
            human_bytes(needed)
        )),
        "{reason}"
    );
    assert!(reason.ends_with("free under the budget"), "{reason}");
    // Not started: no store holds a byte of it, nothing is at its path.
    assert!(
        env.stores_with_blobs().is_empty(),
        "{:?}",
        env.stores_with_blobs()
    );
    assert!(!env.mount.join("big").exists());
    assert!(d.metric("modelfs_disk_refused_fetches_total") >= 1.0);
    d.wait_until("the shortfall is reported", Duration::from_secs(10), |_| {
        disk(&d)["shortfall_bytes"].as_u64().unwrap() > 0
            && d.metric("modelfs_disk_shortfall_bytes") > 0.0
    });
    // `modelfs status` shows the reason and the disk line.
    let out = std::process::Command::new(BIN)
        .args(["status", "--listen", &d.listen])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("InsufficientStorage"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("disk: ") && l.contains("free under the budget (100%")),
        "{text}"
    );
    // Offline (`--state`), the same line from the state the daemon saved, the refusal in it.
    let out = std::process::Command::new(BIN)
        .args(["status", "--state"])
        .arg(&env.state)
        .output()
        .unwrap();
    let offline = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{offline}");
    assert!(offline.contains("InsufficientStorage"), "{offline}");
    assert!(
        offline.lines().any(|l| l.starts_with("disk: ")
            && l.contains("free under the budget (100%")
            && l.contains("; a refused fetch lacks ")),
        "{offline}"
    );

    // While refused, every tick checks the disk again, and only the disk: the model stays
    // `Failed` with its reason (never `Updating` in between), its source is not resolved and
    // refused again, so nothing is written or reported again.
    let refusals = d.metric("modelfs_disk_refused_fetches_total");
    let checks = d.metric("modelfs_disk_space_checks_total");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut polls = 0;
    while d.metric("modelfs_disk_space_checks_total") < checks + 5.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the refused model was not checked again; log:\n{}",
            d.log_text()
        );
        let (code, body) = d.get("/v1/models");
        assert_eq!(code, 200, "{body}");
        let doc: Value = serde_json::from_str(&body).unwrap();
        let m = &doc["clusterbasemodel.big"];
        assert_eq!(m["status"], "Failed", "left Failed while refused: {doc:#}");
        assert_eq!(m["reason"].as_str(), Some(reason), "{doc:#}");
        polls += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(polls > 0);
    assert_eq!(
        d.metric("modelfs_disk_refused_fetches_total"),
        refusals,
        "re-checks refused the model again (its source resolved again)"
    );
    assert!(!env.mount.join("big").exists());

    // Space appears: the model starts by itself (no change to its manifest).
    std::fs::remove_file(&filler).unwrap();
    d.wait_model("clusterbasemodel.big", "Ready");
    assert_eq!(contents(&env.mount.join("big")), contents(&src));
    // Measured at every tick: the store's bytes count, nothing lacks any more.
    d.wait_until("the disk measured again", Duration::from_secs(10), |_| {
        let after = disk(&d);
        after["shortfall_bytes"] == 0 && after["stores_bytes"].as_u64().unwrap() >= needed
    });
    assert_eq!(d.metric("modelfs_disk_shortfall_bytes"), 0.0);
    assert!(d.metric("modelfs_disk_used_bytes") >= needed as f64);
}

#[test]
fn under_pressure_unserved_stores_go_oldest_first_reserved_last_and_never_an_open_one() {
    let env = TestEnv::new();
    let _tmpfs = Tmpfs::mount(&env.state, "32m");
    let mut srcs = std::collections::BTreeMap::new();
    for (i, name) in ["a", "b", "r", "s"].iter().enumerate() {
        let dir = env.dir(name);
        make_model_dir(&dir, 10 + i as u64, 2 << 20);
        srcs.insert(*name, dir);
    }
    let d = Daemon::start(&env, &["--disk-budget", "100%", "--gc-grace-secs", "3600"]);
    for name in ["a", "b", "s"] {
        env.write_models(
            &format!("{name}.yaml"),
            &cluster_model(name, &uri(&srcs[name]), "AlwaysDownload", None),
        );
    }
    let reserved = cluster_model("r", &uri(&srcs["r"]), "AlwaysDownload", None).replace(
        "metadata:\n  name: r\n",
        "metadata:\n  name: r\n  labels:\n    models.ome/reserve-model-artifact: \"TRUE\"\n",
    );
    env.write_models("r.yaml", &reserved);
    for name in ["a", "b", "r", "s"] {
        d.wait_model(&format!("clusterbasemodel.{name}"), "Ready");
    }
    d.wait_until("records saved", Duration::from_secs(10), |_| {
        stores_of(&env).len() == 4
    });
    let store = stores_of(&env);
    let store = |name: &str| store[&format!("clusterbasemodel.{name}")].clone();
    // A reader keeps a file of b open across b's deletion: its store is in use.
    let held = std::fs::File::open(env.mount.join("b/config.json")).unwrap();

    // The reserved store first (the oldest release), then a, then b, each seen by a pass.
    for name in ["r", "a", "b"] {
        let before = d.gc_passes();
        env.remove_models(&format!("{name}.yaml"));
        d.wait_gone(&format!("clusterbasemodel.{name}"));
        d.wait_until("a collection pass", Duration::from_secs(30), |_| {
            d.gc_passes() > before
        });
    }
    for name in ["a", "b", "r"] {
        assert!(
            store_dir(&env, &store(name)).exists(),
            "{name} kept in grace"
        );
    }

    // A new model needs more than a's store frees: with b open, the reserved store goes too.
    let n = env.dir("n");
    make_model_dir(&n, 20, 3 << 20);
    let needed = tree_size(&n);
    let a_bytes = tree_size(&srcs["a"]);
    let filler = fill_leaving(&env.state, "filler", 1 << 20);
    assert!(
        needed > a_bytes + (1 << 20),
        "the test needs a shortfall above a's store"
    );
    env.write_models(
        "n.yaml",
        &cluster_model("n", &uri(&n), "AlwaysDownload", None),
    );
    d.wait_model("clusterbasemodel.n", "Ready");
    assert_eq!(contents(&env.mount.join("n")), contents(&n));
    assert!(
        !store_dir(&env, &store("a")).exists(),
        "a (in grace) was reclaimed"
    );
    assert!(
        !store_dir(&env, &store("r")).exists(),
        "the reserved store was reclaimed"
    );
    assert!(
        store_dir(&env, &store("b")).exists(),
        "an open store never goes"
    );
    assert!(
        store_dir(&env, &store("s")).exists(),
        "a served store never goes"
    );
    assert_eq!(d.metric("modelfs_disk_reclaimed_stores_total"), 2.0);
    let log = d.log_text();
    let reclaimed: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("reclaimed under disk pressure"))
        .collect();
    assert_eq!(reclaimed.len(), 2, "{log}");
    assert!(reclaimed[0].contains(&store("a")), "a first: {reclaimed:?}");
    assert!(reclaimed[1].contains(&store("r")), "then r: {reclaimed:?}");
    // The open file still reads; the served model is whole.
    let mut got = Vec::new();
    std::io::Read::read_to_end(&mut &held, &mut got).unwrap();
    assert_eq!(got, std::fs::read(srcs["b"].join("config.json")).unwrap());
    assert_eq!(contents(&env.mount.join("s")), contents(&srcs["s"]));
    drop(held);
    std::fs::remove_file(filler).unwrap();
}

#[test]
fn a_disk_filled_by_another_writer_fails_the_fetch_keeps_serving_and_retries() {
    let hub = TestHub::start(1000);
    let mut files = Vec::new();
    files.push((
        "config.json".to_string(),
        HubFile::memory(bytes(1, 700), false),
    ));
    let big = bytes(2, 12 << 20);
    files.push((
        "model.safetensors".to_string(),
        HubFile::memory(big.clone(), true),
    ));
    hub.hub().add_commit("org/big", &["main"], files);
    // Slow enough that the disk can be filled while the fetch runs.
    hub.fault(
        FaultKind::Slow {
            bytes_per_sec: 512 << 10,
        },
        1000,
        Some("model.safetensors"),
    );

    let env = TestEnv::new();
    let _tmpfs = Tmpfs::mount(&env.state, "40m");
    let small = env.dir("small");
    make_model_dir(&small, 3, 1 << 20);
    env.write_models(
        "small.yaml",
        &cluster_model("small", &uri(&small), "AlwaysDownload", None),
    );
    let mut flags = hf_flags(&hub);
    flags.extend(["--disk-budget".to_string(), "100%".to_string()]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let d = Daemon::start(&env, &flags);
    d.wait_model("clusterbasemodel.small", "Ready");
    let reader = std::fs::File::open(env.mount.join("small/config.json")).unwrap();

    env.write_models(
        "big.yaml",
        "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: big\nspec:\n  storage:\n    storageUri: hf://org/big\n    downloadPolicy: AlwaysDownload\n",
    );
    // Admitted and writing.
    d.wait_until("the fetch writes", Duration::from_secs(30), |s| {
        s["clusterbasemodel.big"]["progress"]["completedBytes"]
            .as_u64()
            .is_some_and(|b| b > 0)
    });
    // Another writer fills the disk.
    let filler = fill_leaving(&env.state, "filler", 0);
    let e = d.wait_model("clusterbasemodel.big", "Failed");
    let reason = e["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("InsufficientStorage: the disk filled during the fetch"),
        "{reason}"
    );
    assert!(d.metric("modelfs_disk_full_fetches_total") >= 1.0);
    // Everything served is still served, through new opens and the open file alike.
    assert_eq!(d.status()["clusterbasemodel.small"]["status"], "Ready");
    assert_eq!(contents(&env.mount.join("small")), contents(&small));
    let mut got = Vec::new();
    std::io::Read::read_to_end(&mut &reader, &mut got).unwrap();
    assert_eq!(got, std::fs::read(small.join("config.json")).unwrap());
    // The probes Kubernetes acts on stay green; /healthz names the full disk for an operator.
    assert_eq!(d.get("/livez").0, 200);
    assert_eq!(d.get("/readyz").0, 200);
    let (code, body) = d.get("/healthz");
    assert!(
        code == 200 || body.contains("No space left on device"),
        "{code} {body}"
    );

    // Space returns: the fetch is retried by itself and completes.
    hub.hub().clear_faults();
    std::fs::remove_file(&filler).unwrap();
    d.wait_until("big Ready", Duration::from_secs(90), |s| {
        s["clusterbasemodel.big"]["status"] == "Ready"
    });
    assert_eq!(
        std::fs::read(env.mount.join("big/model.safetensors")).unwrap(),
        big
    );
}

/// Without `--state`, the stores go beside the mount on its filesystem
/// (`<parent>/.modelfs-<name>`), and the daemon says the placement links at start.
#[test]
fn the_state_defaults_to_beside_the_models_root() {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 7, 100_000);
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&src), "AlwaysDownload", None),
    );
    let listen_file = env.root.path().join("default-state.addr");
    let log = env.root.path().join("default-state.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let mut child = std::process::Command::new(BIN)
        .args([
            "serve",
            "--no-keeper",
            "--fuse-transport",
            "dev",
            "--listen",
            ANY_PORT,
        ])
        .arg("--listen-addr-file")
        .arg(&listen_file)
        .arg("--mount")
        .arg(&env.mount)
        .arg("--models")
        .arg(&env.models)
        .stdin(std::process::Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .spawn()
        .unwrap();
    let listen = listen_addr(&listen_file, Duration::from_secs(30), || {
        std::fs::read_to_string(&log).unwrap_or_default()
    });
    let ready = || {
        http_get(&listen, "/v1/models")
            .and_then(|(_, body)| serde_json::from_str::<Value>(&body).ok())
            .is_some_and(|v| v["clusterbasemodel.m"]["status"] == "Ready")
    };
    wait_for("m Ready", Duration::from_secs(60), ready);
    let state = env.root.path().join(".modelfs-mnt");
    let (_, body) = http_get(&listen, "/v1/disk").unwrap();
    let d: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(d["state_dir"], state.display().to_string());
    assert_eq!(d["budget"], "90%");
    let blobs = sh(&format!(
        "find '{}' -path '*/blobs/*' -type f | wc -l",
        state.join("stores").display()
    ));
    assert!(blobs.trim().parse::<u32>().unwrap() > 0, "{blobs}");
    assert_eq!(contents(&env.mount.join("m")), contents(&src));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("the store and the models root are on one filesystem and one mount"),
        "{text}"
    );
    interrupt(child.id());
    let _ = child.wait();
}

/// A model moved to a new revision keeps the old one's blobs for the grace period; under
/// pressure they go first, and the model keeps serving the new revision.
#[test]
fn under_pressure_the_blobs_of_a_retired_revision_go_before_their_grace_period() {
    let env = TestEnv::new();
    let _tmpfs = Tmpfs::mount(&env.state, "24m");
    let v1 = env.dir("v1");
    make_model_dir(&v1, 1, 3 << 20);
    let v2 = env.dir("v2");
    make_model_dir(&v2, 2, 3 << 20);
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&v1), "AlwaysDownload", None),
    );
    let d = Daemon::start(&env, &["--disk-budget", "100%", "--gc-grace-secs", "3600"]);
    d.wait_model("clusterbasemodel.m", "Ready");
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&v2), "AlwaysDownload", None),
    );
    d.wait_until("v2 served", Duration::from_secs(30), |_| {
        contents(&env.mount.join("m")) == contents(&v2)
    });
    let blobs = || {
        sh(&format!(
            "find '{}' -path '*/blobs/*' -type f | wc -l",
            env.state.join("stores").display()
        ))
        .trim()
        .parse::<usize>()
        .unwrap()
    };
    let distinct = |dir: &Path| {
        tree(dir)
            .values()
            .filter(|v| !v.0)
            .map(|v| v.3.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    };
    // Both revisions are on disk: the old one waits out its grace period.
    assert!(blobs() > distinct(&v2), "{} blobs", blobs());

    let n = env.dir("n");
    make_model_dir(&n, 3, 2 << 20);
    let filler = fill_leaving(&env.state, "filler", 1 << 20);
    env.write_models(
        "n.yaml",
        &cluster_model("n", &uri(&n), "AlwaysDownload", None),
    );
    d.wait_model("clusterbasemodel.n", "Ready");
    assert_eq!(contents(&env.mount.join("n")), contents(&n));
    assert_eq!(contents(&env.mount.join("m")), contents(&v2));
    assert_eq!(d.status()["clusterbasemodel.m"]["status"], "Ready");
    // What is left: the blobs of m's current revision and of n.
    assert_eq!(blobs(), distinct(&v2) + distinct(&n));
    assert!(d
        .log_text()
        .contains("reclaimed the blobs of retired revisions under disk pressure"));
    std::fs::remove_file(filler).unwrap();
}
