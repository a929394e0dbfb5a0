//! The daemon against a hostile hub: requests that never answer, bodies that never come or stop
//! midway, 5xx answers whose body never arrives, pagination that never ends, a listing shorter
//! than its `Content-Length`, a server that ignores `Range`, and hung downloads that must not
//! keep the node's fetch slots once their models are deleted.

mod common;

use std::time::Duration;

use common::hub::*;
use common::*;
use modelfs_devhub::hf::{Fault, FaultKind, FaultTarget, HubFile};

/// Long enough to outlive any test: a request held this long never answers.
const FOREVER: u64 = 3600;

fn api_fault(hub: &TestHub, kind: FaultKind, path: &str) {
    hub.hub().add_fault(Fault {
        kind,
        count: 1_000_000,
        path: Some(path.to_string()),
        target: FaultTarget::Api,
    });
}

fn small_repo(hub: &TestHub, repo: &str, files: usize) {
    let files = (0..files)
        .map(|i| {
            (
                format!("f{i:03}.json"),
                HubFile::memory(bytes(i as u64 + 1, 100), false),
            )
        })
        .collect();
    hub.hub().add_commit(repo, &["main"], files);
}

/// A daemon with the test hub's flags, one of them set to `value`, and `extra` flags.
fn daemon_with(env: &TestEnv, hub: &TestHub, flag: &str, value: &str, extra: &[&str]) -> Daemon {
    let mut flags = hf_flags(hub);
    let i = flags
        .iter()
        .position(|f| f == flag)
        .expect("a test hub flag");
    flags[i + 1] = value.to_string();
    flags.extend(extra.iter().map(|s| s.to_string()));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    Daemon::start(env, &flags)
}

fn reason(entry: &serde_json::Value) -> String {
    entry["reason"].as_str().unwrap_or_default().to_string()
}

#[test]
fn hung_or_endless_metadata_requests_end_failed_with_a_reason() {
    let hub = TestHub::start(2);
    // (repo, the fault on its API requests, what the reason must say, permanent?)
    let cases: Vec<(&str, FaultKind, &str, &str, bool)> = vec![
        (
            "org/no-headers",
            FaultKind::StallHeaders { secs: FOREVER },
            "org/no-headers/revision",
            "no data received",
            false,
        ),
        (
            "org/no-body",
            FaultKind::StallBody { secs: FOREVER },
            "org/no-body/tree",
            "no data received",
            false,
        ),
        (
            "org/half-body",
            FaultKind::Stall { secs: FOREVER },
            "org/half-body/tree",
            "no data received",
            false,
        ),
        (
            "org/error-body",
            FaultKind::StatusStalledBody {
                status: 503,
                secs: FOREVER,
            },
            "org/error-body/revision",
            "HTTP 503",
            false,
        ),
        (
            "org/endless",
            FaultKind::EndlessPages,
            "org/endless/tree",
            "--hf-max-listing-pages",
            true,
        ),
        (
            "org/liar",
            FaultKind::LyingLength { extra: 100 },
            "org/liar/tree",
            "the body ended after",
            true,
        ),
    ];
    let mut yaml = Vec::new();
    for (repo, kind, path, _, _) in &cases {
        small_repo(&hub, repo, 3);
        api_fault(&hub, kind.clone(), path);
        let name = repo.trim_start_matches("org/");
        yaml.push(cluster_model(
            name,
            &format!("hf://{repo}"),
            "AlwaysDownload",
            None,
        ));
    }
    // More entries than the listing bound (with pages that end).
    small_repo(&hub, "org/huge", 30);
    yaml.push(cluster_model(
        "huge",
        "hf://org/huge",
        "AlwaysDownload",
        None,
    ));

    let env = TestEnv::new();
    let mut flags = hf_flags(&hub);
    flags.extend(
        [
            "--hf-max-attempts",
            "2",
            "--hf-max-listing-pages",
            "40",
            "--hf-max-listing-entries",
            "20",
        ]
        .map(String::from),
    );
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let d = Daemon::start(&env, &flags);
    env.write_models("m.yaml", &yaml.join("---\n"));

    for (repo, _, _, want, permanent) in &cases {
        let key = format!("clusterbasemodel.{}", repo.trim_start_matches("org/"));
        let e = d.wait_model(&key, "Failed");
        let r = reason(&e);
        assert!(r.contains(want), "{key}: {r}");
        assert_eq!(
            !r.contains("(retry"),
            *permanent,
            "{key}: permanent errors are not retried, transient ones are: {r}"
        );
    }
    let e = d.wait_model("clusterbasemodel.huge", "Failed");
    let r = reason(&e);
    assert!(
        r.contains("more than 20 entries") && r.contains("--hf-max-listing-entries"),
        "{r}"
    );
    assert!(!r.contains("(retry"), "{r}");
    assert_eq!(
        hub.hub().stats().file_requests,
        0,
        "nothing is downloaded for a listing that never completed"
    );
    // The endless listing stopped at its bound (40 pages, and 2 more at the one fresh attempt
    // a failed model does not get again): the request count stays far from unbounded.
    let api = hub.hub().stats().api_requests;
    assert!(api < 300, "{api} API requests");
}

#[test]
fn deleting_hung_downloads_frees_their_fetch_slots_at_once() {
    let hub = TestHub::start(1000);
    small_repo(&hub, "org/hung-a", 1);
    small_repo(&hub, "org/hung-b", 1);
    // Every file request hangs before its headers, and the stall watchdog is set beyond the
    // test's life: a hang no deadline catches, such as a hub trickling bytes.
    hub.fault(FaultKind::StallHeaders { secs: FOREVER }, 1_000_000, None);
    let env = TestEnv::new();
    let d = daemon_with(
        &env,
        &hub,
        "--hf-stall-timeout-secs",
        &FOREVER.to_string(),
        &["--max-concurrent-fetches", "2"],
    );
    env.write_models(
        "hung.yaml",
        &[
            cluster_model("hung-a", "hf://org/hung-a", "AlwaysDownload", None),
            cluster_model("hung-b", "hf://org/hung-b", "AlwaysDownload", None),
        ]
        .join("---\n"),
    );
    // Both downloads are in flight: each holds one of the two fetch slots.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while hub.hub().stats().file_requests < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the downloads did not start:\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let src = env.dir("src");
    make_model_dir(&src, 1, 4096);
    env.write_models(
        "local.yaml",
        &cluster_model(
            "local",
            &format!("local://{}", src.display()),
            "AlwaysDownload",
            None,
        ),
    );
    let e = d.wait_model("clusterbasemodel.local", "Updating");
    assert!(
        e.get("reason").is_none_or(|r| r.is_null()),
        "the import waits for a slot: {e}"
    );

    env.remove_models("hung.yaml");
    d.wait_gone("clusterbasemodel.hung-a");
    d.wait_gone("clusterbasemodel.hung-b");
    d.wait_model("clusterbasemodel.local", "Ready");
    assert_eq!(contents(&env.mount.join("local")), contents(&src));
}

#[test]
fn a_server_ignoring_range_serves_each_file_about_once() {
    let hub = TestHub::start(1000);
    let large = 12 << 20;
    let files = vec![
        (
            "model.safetensors".to_string(),
            HubFile::memory(bytes(7, large), true),
        ),
        (
            "config.json".to_string(),
            HubFile::memory(bytes(8, 700), false),
        ),
    ];
    hub.hub().add_commit("org/norange", &["main"], files);
    hub.hub().set_ignore_range(true);
    let env = TestEnv::new();
    // No stalls here: a generous watchdog, so that a loaded machine cannot cause a retry
    // (which would rightly download the file once more).
    let d = daemon_with(&env, &hub, "--hf-stall-timeout-secs", "30", &[]);
    env.write_models(
        "m.yaml",
        &cluster_model("norange", "hf://org/norange", "AlwaysDownload", None),
    );
    d.wait_model("clusterbasemodel.norange", "Ready");
    let got = std::fs::read(env.mount.join("norange/model.safetensors")).unwrap();
    assert!(got == bytes(7, large), "the served bytes differ");
    let served = hub.hub().stats().bytes_served;
    let size = (large + 700) as u64;
    // 1 MiB ranges: one whole-file answer per range would be about 6.5x the size.
    assert!(
        served <= size + size / 10,
        "served {served} bytes for {size} bytes of files"
    );
    assert!(d
        .log_text()
        .contains("the server ignores Range; reading the whole file from one answer"));
}

#[test]
fn file_requests_that_hang_are_retried_until_the_model_is_ready() {
    let hub = TestHub::start(1000);
    let large = 3 << 20;
    let files = vec![
        (
            "model.safetensors".to_string(),
            HubFile::memory(bytes(9, large), true),
        ),
        (
            "config.json".to_string(),
            HubFile::memory(bytes(10, 700), false),
        ),
    ];
    hub.hub().add_commit("org/hangs", &["main"], files);
    // One of each, in turn: no headers, no body, a 503 whose body never comes.
    hub.fault(FaultKind::StallHeaders { secs: FOREVER }, 1, None);
    hub.fault(FaultKind::StallBody { secs: FOREVER }, 1, None);
    hub.fault(
        FaultKind::StatusStalledBody {
            status: 503,
            secs: FOREVER,
        },
        1,
        None,
    );
    let env = TestEnv::new();
    let d = start_daemon(&env, &hub);
    env.write_models(
        "m.yaml",
        &cluster_model("hangs", "hf://org/hangs", "AlwaysDownload", None),
    );
    d.wait_model("clusterbasemodel.hangs", "Ready");
    assert_eq!(hub.hub().stats().faults_applied, 3);
    let got = std::fs::read(env.mount.join("hangs/model.safetensors")).unwrap();
    assert!(got == bytes(9, large), "the served bytes differ");

    // A server ignoring Range whose whole-file answer stops midway: the rest comes from a new
    // whole-file answer, from the offset reached.
    hub.hub().add_commit(
        "org/hangs-whole",
        &["main"],
        vec![(
            "model.safetensors".to_string(),
            HubFile::memory(bytes(11, 8 << 20), true),
        )],
    );
    hub.hub().set_ignore_range(true);
    hub.fault(FaultKind::Stall { secs: FOREVER }, 1, None);
    hub.fault(FaultKind::Truncate { after: 1 << 20 }, 1, None);
    let before = hub.hub().stats();
    env.write_models(
        "w.yaml",
        &cluster_model("whole", "hf://org/hangs-whole", "AlwaysDownload", None),
    );
    d.wait_model("clusterbasemodel.whole", "Ready");
    let got = std::fs::read(env.mount.join("whole/model.safetensors")).unwrap();
    assert!(got == bytes(11, 8 << 20), "the served bytes differ");
    let after = hub.hub().stats();
    assert_eq!(after.faults_applied - before.faults_applied, 2);
    // 8 ranges of 1 MiB; three attempts (stalled, cut, complete) of one answer each.
    assert!(
        after.file_requests - before.file_requests <= 4,
        "one answer per attempt, not one per range: {} requests",
        after.file_requests - before.file_requests
    );
    assert!(
        after.bytes_served - before.bytes_served < 2 * (8 << 20),
        "served {} bytes for an 8 MiB file",
        after.bytes_served - before.bytes_served
    );
}

#[test]
fn throttling_waits_and_final_verification_are_in_omes_metrics() {
    let hub = TestHub::start(1000);
    small_repo(&hub, "org/throttled", 3);
    // Two file downloads and one metadata request answered 429 with `Retry-After: 1`.
    hub.fault(
        FaultKind::Status {
            status: 429,
            retry_after: Some(1),
        },
        2,
        None,
    );
    api_fault_n(
        &hub,
        FaultKind::Status {
            status: 429,
            retry_after: Some(1),
        },
        1,
    );
    let env = TestEnv::new();
    let d = start_daemon(&env, &hub);
    env.write_models(
        "m.yaml",
        &cluster_model("throttled", "hf://org/throttled", "AlwaysDownload", None),
    );
    d.wait_model("clusterbasemodel.throttled", "Ready");
    assert_eq!(hub.hub().stats().faults_applied, 3);
    let labels = "{model_type=\"ClusterBaseModel\",namespace=\"\",name=\"throttled\"}";
    // One observation per wait, each the second the server asked for (or a little more).
    assert_eq!(
        d.metric(&format!(
            "model_agent_rate_limit_wait_seconds_count{labels}"
        )),
        3.0
    );
    let waited = d.metric(&format!("model_agent_rate_limit_wait_seconds_sum{labels}"));
    assert!(waited >= 3.0, "waited {waited} s in all");
    // The final verification pass ran for the completed fetch (OME's metric has no labels).
    assert!(d.metric("model_agent_verification_duration_seconds_count ") >= 1.0);
    let verified = d.metric(
        "model_agent_verifications_total{model_type=\"ClusterBaseModel\",namespace=\"\",name=\"throttled\",result=\"success\"}",
    );
    assert_eq!(verified, 1.0);
}

fn api_fault_n(hub: &TestHub, kind: FaultKind, count: u64) {
    hub.hub().add_fault(Fault {
        kind,
        count,
        path: None,
        target: FaultTarget::Api,
    });
}
