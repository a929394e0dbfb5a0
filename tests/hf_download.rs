//! `hf://` models end to end: the real daemon downloads from the loopback hub (in this process)
//! and serves the files through its FUSE mount.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::hub::*;
use common::*;
use modelfs_devhub::hf::{Fault, FaultKind, FaultTarget, HubFile};
use sha2::{Digest, Sha256};

const TOKEN: &str = "hf_TestTokenDoNotLog_8c1f2e";

/// Path -> content of a generated repository.
type Files = BTreeMap<String, Vec<u8>>;

/// Nested directories, more entries than a page, LFS and plain files, an empty file,
/// non-ASCII names, and one large LFS file.
fn repo_files(seed: u64, large: usize) -> Files {
    let mut f = Files::new();
    f.insert("config.json".into(), bytes(seed, 700));
    f.insert("empty.txt".into(), Vec::new());
    // Identical content under several names (downloaded once, served under each).
    f.insert("tokenizer/empty-too.txt".into(), Vec::new());
    f.insert("config-copy.json".into(), bytes(seed, 700));
    f.insert(
        "caf\u{e9}/na\u{ef}ve \u{65e5}\u{672c}.txt".into(),
        bytes(seed + 1, 333),
    );
    for i in 0..14 {
        f.insert(
            format!("tokenizer/part-{i:02}/vocab.txt"),
            bytes(seed + 10 + i, 100 + 97 * i as usize),
        );
    }
    f.insert(
        "weights/model-00001-of-00002.safetensors".into(),
        bytes(seed + 50, large),
    );
    f.insert(
        "weights/model-00002-of-00002.safetensors".into(),
        bytes(seed + 51, large / 5 + 3),
    );
    f
}

fn hub_files(files: &Files) -> Vec<(String, HubFile)> {
    files
        .iter()
        .map(|(p, d)| {
            let lfs = p.ends_with(".safetensors") || d.len() > (1 << 20);
            (p.clone(), HubFile::memory(d.clone(), lfs))
        })
        .collect()
}

fn total(files: &Files) -> u64 {
    files.values().map(|v| v.len() as u64).sum()
}

/// Bytes a client must download: identical files count once.
fn unique_total(files: &Files) -> u64 {
    let unique: std::collections::BTreeSet<&Vec<u8>> = files.values().collect();
    unique.iter().map(|v| v.len() as u64).sum()
}

/// Checks that `dir` holds exactly `files`, byte for byte.
fn assert_tree(dir: &Path, files: &Files) {
    let got: BTreeMap<String, String> = tree(dir)
        .into_iter()
        .filter(|(_, (is_dir, ..))| !is_dir)
        .map(|(p, (_, _, _, sha))| (p, sha))
        .collect();
    let want: BTreeMap<String, String> = files
        .iter()
        .map(|(p, d)| (p.clone(), hex::encode(Sha256::digest(d))))
        .collect();
    assert_eq!(got, want, "mount content differs from the repository");
}

fn hf_model(name: &str, uri: &str, policy: &str, token: Option<&str>) -> String {
    let params = token
        .map(|t| format!("\n    parameters:\n      token: {t}"))
        .unwrap_or_default();
    format!(
        "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: {name}\nspec:\n  storage:\n    storageUri: {uri}\n    downloadPolicy: {policy}{params}\n"
    )
}

#[test]
fn repo_downloads_byte_identical_and_a_new_revision_fetches_only_changes() {
    let hub = TestHub::start(5);
    let v1 = repo_files(1, 5 << 20);
    let commit1 = hub.hub().add_commit("org/llm", &["main"], hub_files(&v1));
    let mut v2 = v1.clone();
    v2.insert("config.json".into(), bytes(99, 701));
    v2.insert("tokenizer/added.txt".into(), bytes(98, 4321));
    let changed = 701 + 4321;
    hub.hub().add_commit("org/llm", &["v2"], hub_files(&v2));

    let env = TestEnv::new();
    let d = start_daemon(&env, &hub);
    env.write_models(
        "m.yaml",
        &hf_model("llm", "hf://org/llm", "AlwaysDownload", Some(TOKEN)),
    );
    let e = d.wait_model("clusterbasemodel.llm", "Ready");
    assert_eq!(e["config"]["artifact"]["sha"], commit1);
    assert_tree(&env.mount.join("llm"), &v1);
    let stats = hub.hub().stats();
    assert_eq!(
        stats.bytes_served,
        unique_total(&v1),
        "every distinct file served exactly once"
    );
    assert!(
        stats.authorized_requests > 0,
        "the model's token is sent to the hub"
    );
    assert_eq!(
        stats.cdn_requests_with_auth, 0,
        "the token must not follow a redirect to another host"
    );
    assert!(d.metric("modelfs_fetched_bytes_total") >= unique_total(&v1) as f64);

    env.write_models(
        "m.yaml",
        &hf_model("llm", "hf://org/llm@v2", "AlwaysDownload", Some(TOKEN)),
    );
    d.wait_until("revision v2 served", Duration::from_secs(60), |doc| {
        doc["clusterbasemodel.llm"]["status"] == "Ready"
            && doc["clusterbasemodel.llm"]["config"]["artifact"]["sha"] != commit1
    });
    assert_tree(&env.mount.join("llm"), &v2);
    assert_eq!(
        hub.hub().stats().bytes_served - stats.bytes_served,
        changed,
        "a new revision downloads only the changed files"
    );
    let log = d.log_text();
    assert!(
        log.contains("download progress"),
        "progress lines are logged"
    );
    assert!(!log.contains(TOKEN), "the token leaked into the log");
    let status = std::fs::read_to_string(env.state.join("status.json")).unwrap();
    assert!(!status.contains(TOKEN), "the token leaked into status.json");
}

#[test]
fn sigkill_mid_download_resumes_with_range() {
    let hub = TestHub::start(1000);
    let files = repo_files(2, 24 << 20);
    hub.hub()
        .add_commit("org/big", &["main"], hub_files(&files));
    // 1 MiB/s per request: with 4 ranges in flight the large file takes about 6 s.
    hub.fault(
        FaultKind::Slow {
            bytes_per_sec: 1 << 20,
        },
        1_000_000,
        Some("00001"),
    );

    let env = TestEnv::new();
    let d = start_daemon(&env, &hub);
    env.write_models(
        "m.yaml",
        &hf_model("big", "hf://org/big", "AlwaysDownload", None),
    );
    let size = total(&files);
    let doc = d.wait_until("a third downloaded", Duration::from_secs(60), |doc| {
        let p = &doc["clusterbasemodel.big"]["progress"];
        p["completedBytes"].as_u64().unwrap_or(0) > size / 3
    });
    let p = &doc["clusterbasemodel.big"]["progress"];
    assert_eq!(p["phase"], "downloading");
    assert_eq!(p["totalBytes"].as_u64(), Some(size));
    assert_eq!(p["totalFiles"].as_u64(), Some(files.len() as u64));
    assert!(p["speedBytesPerSec"].as_u64().unwrap() > 0);
    let table = sh(&format!("{BIN} status --listen {}", d.listen));
    assert!(table.contains('%'), "modelfs status shows percent: {table}");
    d.kill9();
    let parts: Vec<u64> = std::fs::read_dir(env.state.join("stores"))
        .unwrap()
        .flatten()
        .flat_map(|s| std::fs::read_dir(s.path().join("tmp")).unwrap().flatten())
        .map(|e| e.metadata().unwrap().len())
        .collect();
    assert!(
        parts.iter().any(|&l| l > 0),
        "a partial file survives SIGKILL: {parts:?}"
    );
    let served_before = hub.hub().stats().bytes_served;
    assert!(served_before < size);

    hub.hub().clear_faults();
    sh(&format!(
        "umount -l {} 2>/dev/null || true",
        env.mount.display()
    ));
    let d = start_daemon(&env, &hub);
    d.wait_model("clusterbasemodel.big", "Ready");
    assert_tree(&env.mount.join("big"), &files);
    let served = hub.hub().stats().bytes_served;
    assert!(
        served < 2 * size,
        "only missing ranges are fetched again: served {served} for a repo of {size}"
    );
    assert!(d.log_text().contains("resuming partial download"));
}

#[test]
fn wrong_bytes_are_retried_or_fail_never_served() {
    let hub = TestHub::start(1000);
    let a = repo_files(3, 3 << 20);
    let b = repo_files(4, 2 << 20);
    hub.hub().add_commit("org/flaky", &["main"], hub_files(&a));
    hub.hub().add_commit("org/liar", &["main"], hub_files(&b));
    // One corrupt answer for the flaky repo's shard; the liar's config is always wrong.
    hub.fault(FaultKind::Corrupt, 1, Some("00001-of-00002"));
    let env = TestEnv::new();
    let d = start_daemon(&env, &hub);
    env.write_models(
        "flaky.yaml",
        &hf_model("flaky", "hf://org/flaky", "AlwaysDownload", None),
    );
    d.wait_model("clusterbasemodel.flaky", "Ready");
    assert_tree(&env.mount.join("flaky"), &a);
    assert!(hub.hub().stats().faults_applied >= 1);

    hub.fault(FaultKind::Corrupt, 1_000_000, Some("config"));
    env.write_models(
        "liar.yaml",
        &hf_model("liar", "hf://org/liar", "AlwaysDownload", None),
    );
    let e = d.wait_model("clusterbasemodel.liar", "Failed");
    let reason = e["reason"].as_str().unwrap();
    assert!(
        reason.contains("config") && reason.contains("verification"),
        "{reason}"
    );
    assert!(
        !env.mount.join("liar").exists(),
        "a failed model is not visible"
    );
}

#[test]
fn storms_of_429_500_resets_and_stalls_are_survived() {
    let hub = TestHub::start(4);
    let files = repo_files(5, 6 << 20);
    hub.hub()
        .add_commit("org/storm", &["main"], hub_files(&files));
    hub.fault(
        FaultKind::Status {
            status: 500,
            retry_after: None,
        },
        10,
        None,
    );
    hub.fault(
        FaultKind::Status {
            status: 429,
            retry_after: Some(1),
        },
        4,
        None,
    );
    hub.fault(FaultKind::Truncate { after: 1000 }, 4, None);
    hub.fault(FaultKind::Stall { secs: 5 }, 2, Some("00001"));
    hub.hub().add_fault(Fault {
        kind: FaultKind::Status {
            status: 503,
            retry_after: None,
        },
        count: 3,
        path: None,
        target: FaultTarget::Api,
    });
    let env = TestEnv::new();
    let d = start_daemon(&env, &hub);
    env.write_models(
        "m.yaml",
        &hf_model("storm", "hf://org/storm", "AlwaysDownload", None),
    );
    d.wait_model("clusterbasemodel.storm", "Ready");
    assert_tree(&env.mount.join("storm"), &files);
    assert_eq!(hub.hub().stats().faults_applied, 10 + 4 + 4 + 2 + 3);
    assert!(
        d.log_text().contains("no data received"),
        "the stall watchdog fired"
    );
}

#[test]
fn gated_repo_fails_without_token_and_succeeds_with_it() {
    let hub = TestHub::start(1000);
    let files = repo_files(6, 1 << 20);
    hub.hub()
        .add_commit("org/gated", &["main"], hub_files(&files));
    hub.hub().set_gated("org/gated", TOKEN);
    let env = TestEnv::new();
    let d = start_daemon(&env, &hub);
    env.write_models(
        "m.yaml",
        &hf_model("g", "hf://org/gated", "AlwaysDownload", None),
    );
    let e = d.wait_model("clusterbasemodel.g", "Failed");
    let reason = e["reason"].as_str().unwrap();
    assert!(
        reason.contains("401") && reason.contains("GatedRepo"),
        "{reason}"
    );
    assert!(
        reason.contains("token"),
        "the reason says what to do: {reason}"
    );

    env.write_models(
        "m.yaml",
        &hf_model("g", "hf://org/gated", "AlwaysDownload", Some("hf_wrong")),
    );
    let e = d.wait_until("403", Duration::from_secs(30), |doc| {
        doc["clusterbasemodel.g"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("403"))
    });
    assert_eq!(e["clusterbasemodel.g"]["status"], "Failed");

    env.write_models(
        "m.yaml",
        &hf_model("g", "hf://org/gated", "AlwaysDownload", Some(TOKEN)),
    );
    d.wait_model("clusterbasemodel.g", "Ready");
    assert_tree(&env.mount.join("g"), &files);
    assert_eq!(hub.hub().stats().cdn_requests_with_auth, 0);
    let log = d.log_text();
    assert!(
        !log.contains(TOKEN) && !log.contains("hf_wrong"),
        "a token leaked into the log"
    );
    d.stop();

    // The daemon's default token (HF_TOKEN) serves models that bring none.
    let env = TestEnv::new();
    let flags = hf_flags(&hub);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let d = Daemon::start_with_env(&env, &flags, &[("HF_TOKEN", TOKEN)]);
    env.write_models(
        "m.yaml",
        &hf_model("g", "hf://org/gated", "AlwaysDownload", None),
    );
    d.wait_model("clusterbasemodel.g", "Ready");
    assert!(!d.log_text().contains(TOKEN));
}

#[test]
fn revisions_never_share_a_store_and_one_commit_is_downloaded_once() {
    let hub = TestHub::start(1000);
    let v1 = repo_files(7, 2 << 20);
    let v2 = repo_files(8, 2 << 20);
    let c1 = hub
        .hub()
        .add_commit("org/rev", &["main", "v1"], hub_files(&v1));
    hub.hub().add_commit("org/rev", &["v2"], hub_files(&v2));
    let env = TestEnv::new();
    let d = start_daemon(&env, &hub);
    env.write_models(
        "a.yaml",
        &[
            hf_model("at-v1", "hf://org/rev@v1", "ReuseIfExists", None),
            hf_model("at-v2", "hf://org/rev@v2", "ReuseIfExists", None),
        ]
        .join("---\n"),
    );
    d.wait_model("clusterbasemodel.at-v1", "Ready");
    d.wait_model("clusterbasemodel.at-v2", "Ready");
    assert_eq!(
        env.stores_with_blobs().len(),
        2,
        "two revisions, two stores"
    );
    assert_tree(&env.mount.join("at-v1"), &v1);
    assert_tree(&env.mount.join("at-v2"), &v2);
    let served = hub.hub().stats().bytes_served;
    assert_eq!(served, unique_total(&v1) + unique_total(&v2));

    // `main` and the commit itself resolve to the commit of v1: mapped, not downloaded.
    env.write_models(
        "b.yaml",
        &[
            hf_model("at-main", "hf://org/rev", "ReuseIfExists", None),
            hf_model(
                "at-commit",
                &format!("hf://org/rev@{c1}"),
                "ReuseIfExists",
                None,
            ),
        ]
        .join("---\n"),
    );
    for k in ["clusterbasemodel.at-main", "clusterbasemodel.at-commit"] {
        let e = d.wait_model(k, "Ready");
        assert_eq!(e["config"]["artifact"]["sha"], c1);
        assert!(
            e["config"]["artifact"]["parentPath"]
                .as_object()
                .unwrap()
                .contains_key("clusterbasemodel.at-v1"),
            "{e}"
        );
    }
    assert_tree(&env.mount.join("at-commit"), &v1);
    assert_eq!(env.stores_with_blobs().len(), 2);
    assert_eq!(
        hub.hub().stats().bytes_served,
        served,
        "the same commit is served once"
    );
}

#[test]
fn hostile_listings_fail_with_a_reason() {
    let hub = TestHub::start(1000);
    let ok = || HubFile::memory(b"x".to_vec(), false);
    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        ("org/dots", vec!["a/../../escape"], "dot segment"),
        ("org/abs", vec!["/etc/passwd"], "absolute"),
        ("org/clash", vec!["a", "a/b"], "both a file and a directory"),
    ];
    let env = TestEnv::new();
    let d = start_daemon(&env, &hub);
    let mut yaml = Vec::new();
    for (repo, files, _) in &cases {
        hub.hub().add_commit(
            repo,
            &["main"],
            files.iter().map(|p| (p.to_string(), ok())).collect(),
        );
        let name = repo.trim_start_matches("org/");
        yaml.push(hf_model(
            name,
            &format!("hf://{repo}"),
            "AlwaysDownload",
            None,
        ));
    }
    env.write_models("m.yaml", &yaml.join("---\n"));
    for (repo, _, want) in &cases {
        let key = format!("clusterbasemodel.{}", repo.trim_start_matches("org/"));
        let e = d.wait_model(&key, "Failed");
        let reason = e["reason"].as_str().unwrap();
        assert!(reason.contains(want), "{key}: {reason}");
    }
    assert_eq!(
        hub.hub().stats().file_requests,
        0,
        "nothing is downloaded from a hostile listing"
    );
    assert!(!env.root.path().join("escape").exists());
}

/// A range that arrives slower than the minimum rate is aborted and asked again, instead of
/// holding the download for as long as the server trickles bytes (each within the stall
/// timeout); the model becomes Ready with the right bytes.
#[test]
fn a_trickling_range_is_aborted_and_asked_again() {
    let hub = TestHub::start(1000);
    let files = repo_files(7, 2 << 20);
    hub.hub()
        .add_commit("org/slow", &["main"], hub_files(&files));
    // 64 KiB/s: a 1 MiB range would take 16 s; the minimum (512 KiB/s after a grace of the
    // 3 s stall timeout) gives it 5 s.
    hub.fault(
        FaultKind::Slow {
            bytes_per_sec: 64 << 10,
        },
        1,
        Some("00001"),
    );
    let env = TestEnv::new();
    let mut flags = hf_flags(&hub);
    let stall = flags
        .iter()
        .position(|f| f == "--hf-stall-timeout-secs")
        .unwrap();
    flags[stall + 1] = "3".into();
    flags.extend(["--hf-min-range-kib-per-sec".into(), "512".into()]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let d = Daemon::start(&env, &flags);
    env.write_models(
        "m.yaml",
        &hf_model("slow", "hf://org/slow", "AlwaysDownload", None),
    );
    d.wait_model("clusterbasemodel.slow", "Ready");
    assert_tree(&env.mount.join("slow"), &files);
    assert!(
        d.log_text().contains("slower than the minimum"),
        "the trickling range was aborted"
    );
}

/// A node-wide range data budget far below what the downloads would hold at once (1 MiB for
/// several files of parallel 1 MiB ranges) slows them down but never deadlocks them: the
/// ranges of each file get their share in the order the writer needs them.
#[test]
fn a_small_download_buffer_budget_still_completes() {
    let hub = TestHub::start(1000);
    let files = repo_files(8, 9 << 20);
    hub.hub()
        .add_commit("org/tight", &["main"], hub_files(&files));
    let env = TestEnv::new();
    let mut flags = hf_flags(&hub);
    flags.extend(["--hf-download-buffer-mib".into(), "1".into()]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let d = Daemon::start(&env, &flags);
    env.write_models(
        "m.yaml",
        &hf_model("tight", "hf://org/tight", "AlwaysDownload", None),
    );
    d.wait_model("clusterbasemodel.tight", "Ready");
    assert_tree(&env.mount.join("tight"), &files);
    assert_eq!(hub.hub().stats().bytes_served, unique_total(&files));
}
