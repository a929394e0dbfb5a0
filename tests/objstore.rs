//! s3://, gs://, az:// end to end: real object-store servers (moto, gcp-storage-emulator,
//! azurite, filled with the official clients), a real daemon, the mount read with sha256sum;
//! faults injected by the counting proxy between them.

mod common;
mod objstore_common;

use std::path::Path;
use std::time::Duration;

use common::{files_of, sh, Daemon, TestEnv};
use objstore_common::proxy::{Fault, FaultKind, Proxy};
use objstore_common::{Kind, ObjectServer};
use serde_json::Value;
use sha2::Digest;

const WAIT: Duration = Duration::from_secs(120);

/// `sha256sum` of every file below `dir`, as `<sha>  <relative path>` lines, sorted.
fn sha256sums(dir: &Path) -> String {
    sh(&format!(
        "cd {} && find . -type f -print0 | sort -z | xargs -0 sha256sum",
        dir.display()
    ))
}

fn model(name: &str, uri: &str, policy: &str, parameters: &[(&str, &str)]) -> String {
    let mut params = String::new();
    if !parameters.is_empty() {
        params.push_str("\n    parameters:");
        for (k, v) in parameters {
            params.push_str(&format!("\n      {k}: \"{v}\""));
        }
    }
    format!(
        "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: {name}\nspec:\n  storage:\n    storageUri: {uri}\n    downloadPolicy: {policy}{params}\n"
    )
}

fn start(env: &TestEnv, vars: &[(String, String)], extra: &[&str]) -> Daemon {
    let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    Daemon::start_with_env(env, extra, &vars)
}

/// The server's environment with the endpoint replaced by `endpoint` (a proxy in front).
fn env_via(server: &ObjectServer, endpoint: &str) -> Vec<(String, String)> {
    server
        .daemon_env()
        .into_iter()
        .map(|(k, v)| {
            let v = if v == server.endpoint() {
                endpoint.to_string()
            } else {
                v
            };
            (k, v)
        })
        .collect()
}

fn serves_a_model_equal_to_the_source(kind: Kind) {
    let server = ObjectServer::start(kind);
    let env = TestEnv::new();
    let src = env.dir("src");
    common::make_model_dir(&src, 21, 3 << 20);
    server.create_bucket("models");
    server.upload_dir("models", "org/m/", &src);
    // A neighbour whose name shares the prefix's text is not part of the model.
    server.put("models", "org/m-other/stray.bin", b"not mine");
    let d = start(&env, &server.daemon_env(), &["--hf-chunk-mib", "1"]);
    env.write_models(
        "m.yaml",
        &model("m", &server.uri("models", "org/m"), "AlwaysDownload", &[]),
    );
    let e = d.wait_model("clusterbasemodel.m", "Ready");
    assert_eq!(
        sha256sums(&env.mount.join("m")),
        sha256sums(&src),
        "{kind:?}"
    );
    assert_eq!(
        common::contents(&env.mount.join("m")),
        common::contents(&src)
    );
    assert!(
        e["config"]["artifact"]["sha"]
            .as_str()
            .is_some_and(|s| s.len() == 64),
        "{e}"
    );
}

#[test]
fn s3_model_is_ready_with_the_sources_bytes() {
    serves_a_model_equal_to_the_source(Kind::S3);
}

#[test]
fn azure_model_is_ready_with_the_sources_bytes() {
    serves_a_model_equal_to_the_source(Kind::Azure);
}

/// gcp-storage-emulator answers only the JSON API (its XML bucket listing is 501): gs:// lists,
/// reads metadata and downloads through the JSON API, so the same source works against it and
/// against Cloud Storage.
#[test]
fn gcs_model_is_ready_with_the_sources_bytes() {
    serves_a_model_equal_to_the_source(Kind::Gcs);
}

fn parent_of(e: &Value) -> String {
    let parents = e["config"]["artifact"]["parentPath"]
        .as_object()
        .expect("parentPath");
    assert_eq!(parents.len(), 1, "{e}");
    parents.keys().next().unwrap().clone()
}

/// Waits until `key` is Ready with parent `parent`.
fn wait_parent(d: &Daemon, key: &str, parent: &str) -> Value {
    let s = d.wait_until(
        &format!("{key} served from {parent}'s copy"),
        WAIT,
        |s: &Value| {
            s[key]["status"] == "Ready"
                && s[key]["config"]["artifact"]["parentPath"]
                    .as_object()
                    .is_some_and(|p| p.contains_key(parent))
        },
    );
    s[key].clone()
}

#[test]
fn reuse_and_the_four_policy_changes_on_an_object_store_source() {
    let server = ObjectServer::s3();
    let proxy = Proxy::reverse(&server.endpoint());
    let env = TestEnv::new();
    let src = env.dir("src");
    common::make_model_dir(&src, 22, 2 << 20);
    server.create_bucket("models");
    server.upload_dir("models", "shared/", &src);
    let uri = server.uri("models", "shared");
    let d = start(&env, &env_via(&server, &proxy.url()), &[]);
    let (a, b) = ("clusterbasemodel.a", "clusterbasemodel.b");
    let write = |pa: &str, pb: &str| {
        env.write_models(
            "ab.yaml",
            &format!(
                "{}---\n{}",
                model("a", &uri, pa, &[]),
                model("b", &uri, pb, &[])
            ),
        )
    };
    env.write_models("ab.yaml", &model("a", &uri, "AlwaysDownload", &[]));
    d.wait_model(a, "Ready");
    let one_copy = proxy.bytes_on("/models/shared/");
    assert!(one_copy > 0);
    write("AlwaysDownload", "ReuseIfExists");
    let eb = wait_parent(&d, b, a);
    assert_eq!(parent_of(&eb), a);
    assert_eq!(
        env.stores_with_blobs().len(),
        1,
        "ReuseIfExists keeps one store"
    );
    assert_eq!(sha256sums(&env.mount.join("b")), sha256sums(&src));

    // T-04, no other holder: a stays the parent of b.
    write("ReuseIfExists", "ReuseIfExists");
    // T-03: a parent going back to AlwaysDownload keeps serving its copy.
    write("AlwaysDownload", "ReuseIfExists");
    wait_parent(&d, a, a);
    wait_parent(&d, b, a);
    assert_eq!(env.stores_with_blobs().len(), 1);

    // T-01: the child asks for its own copy; it becomes its own parent.
    write("AlwaysDownload", "AlwaysDownload");
    wait_parent(&d, b, b);
    d.wait_until("two copies", WAIT, |_| env.stores_with_blobs().len() == 2);
    assert_eq!(sha256sums(&env.mount.join("b")), sha256sums(&src));

    // T-02: it gives its copy up again and maps onto a's; its copy is collected.
    write("AlwaysDownload", "ReuseIfExists");
    wait_parent(&d, b, a);
    d.wait_until("one copy again", WAIT, |_| {
        env.stores_with_blobs().len() == 1
    });
    assert_eq!(sha256sums(&env.mount.join("b")), sha256sums(&src));

    // Only the first download and b's own copy were fetched; reuse cost no object bytes.
    let fetched = proxy.bytes_on("/models/shared/");
    assert!(
        fetched <= 2 * one_copy + one_copy / 10,
        "fetched {fetched} for copies of {one_copy}"
    );
}

#[test]
fn throttling_and_server_errors_are_retried() {
    let server = ObjectServer::s3();
    let proxy = Proxy::reverse(&server.endpoint());
    let env = TestEnv::new();
    let src = env.dir("src");
    common::make_model_dir(&src, 23, 1 << 20);
    server.create_bucket("models");
    server.upload_dir("models", "t/", &src);
    use axum::http::Method;
    proxy.add_fault(Fault::new(FaultKind::S3SlowDown).times(2));
    proxy.add_fault(
        Fault::new(FaultKind::too_many_requests(1))
            .times(2)
            .on_method(Method::GET),
    );
    proxy.add_fault(
        Fault::new(FaultKind::status(500))
            .times(2)
            .on_path("/models/t/"),
    );
    proxy.add_fault(
        Fault::new(FaultKind::status(503))
            .times(1)
            .on_path("/models/t/"),
    );
    let d = start(
        &env,
        &env_via(&server, &proxy.url()),
        &["--hf-retry-base-ms", "50"],
    );
    env.write_models(
        "t.yaml",
        &model("t", &server.uri("models", "t"), "AlwaysDownload", &[]),
    );
    d.wait_model("clusterbasemodel.t", "Ready");
    assert_eq!(sha256sums(&env.mount.join("t")), sha256sums(&src));
    assert_eq!(
        proxy.faults_injected(),
        7,
        "every fault was met and survived"
    );
    assert!(
        d.log_text().contains("SlowDown"),
        "the server's code is logged"
    );
}

#[test]
fn truncated_bodies_never_reach_the_mount() {
    let server = ObjectServer::s3();
    let proxy = Proxy::reverse(&server.endpoint());
    let env = TestEnv::new();
    let src = env.dir("src");
    common::make_model_dir(&src, 24, 2 << 20);
    server.create_bucket("models");
    server.upload_dir("models", "cut/", &src);
    server.upload_dir("models", "lies/", &src);
    // A few cut answers are retried; a server that always cuts fails the model.
    proxy.add_fault(
        Fault::new(FaultKind::Truncate { after: 1000 })
            .times(3)
            .on_path("/models/cut/"),
    );
    proxy.add_fault(
        Fault::new(FaultKind::Truncate { after: 1000 })
            .times(1_000_000)
            .on_path("/models/lies/"),
    );
    let d = start(
        &env,
        &env_via(&server, &proxy.url()),
        &[
            "--hf-retry-base-ms",
            "20",
            "--hf-max-attempts",
            "3",
            "--pending-open-timeout-secs",
            "1",
        ],
    );
    env.write_models(
        "c.yaml",
        &format!(
            "{}---\n{}",
            model("cut", &server.uri("models", "cut"), "AlwaysDownload", &[]),
            model("lies", &server.uri("models", "lies"), "AlwaysDownload", &[])
        ),
    );
    d.wait_model("clusterbasemodel.cut", "Ready");
    assert_eq!(sha256sums(&env.mount.join("cut")), sha256sums(&src));
    d.wait_until("the cutting server's model retried", WAIT, |_| {
        proxy.faults_injected() >= 3 + 6
    });
    // Served while downloading (SPEC section 13) the listing may show while the fetch
    // retries, never an unverified byte: a file cut on every answer never opens (its open
    // waits past the 1 s deadline, or the model is gone), a small file the cut never reaches
    // may verify and then reads exactly its bytes.
    let lies = env.mount.join("lies");
    for (path, sha) in files_of(&src) {
        match std::fs::read(lies.join(&path)) {
            Ok(bytes) => {
                assert!(
                    bytes.len() <= 1000,
                    "{path}: a file cut on every answer was served"
                );
                assert_eq!(hex::encode(sha2::Sha256::digest(&bytes)), sha, "{path}");
            }
            Err(e) => assert!(
                matches!(e.raw_os_error(), Some(libc::ETIMEDOUT | libc::ENOENT)),
                "{path}: {e}"
            ),
        }
    }
    let s = d.status();
    assert_ne!(s["clusterbasemodel.lies"]["status"], "Ready", "{s}");
}

/// Issue 21, item 6: the S3 console's "create folder" leaves empty objects `m/` and
/// `m/sub/`; the model is served without them (it failed: "the object is the model's prefix
/// itself").
#[test]
fn s3_folder_markers_are_not_files_of_the_model() {
    let server = ObjectServer::s3();
    let env = TestEnv::new();
    let src = env.dir("src");
    common::make_model_dir(&src, 23, 1 << 20);
    server.create_bucket("models");
    server.put("models", "m/", b"");
    server.put("models", "m/weights/", b"");
    server.upload_dir("models", "m/", &src);
    assert!(
        server
            .list("models", "m/")
            .iter()
            .any(|o| o.key == "m/weights/"),
        "the markers are in the bucket"
    );
    let d = start(&env, &server.daemon_env(), &["--hf-chunk-mib", "1"]);
    env.write_models(
        "m.yaml",
        &model("m", &server.uri("models", "m"), "AlwaysDownload", &[]),
    );
    d.wait_model("clusterbasemodel.m", "Ready");
    assert_eq!(sha256sums(&env.mount.join("m")), sha256sums(&src));
    assert_eq!(
        common::contents(&env.mount.join("m")),
        common::contents(&src)
    );
}

/// Issue 21, item 7: S3 behind a proxy that drops `Range` (every GET answers 200 with the whole
/// object) becomes Ready, as `hf://` does: one whole download per file and attempt, never one
/// per range.
#[test]
fn s3_through_a_proxy_that_ignores_range_is_ready() {
    let server = ObjectServer::s3();
    let proxy = Proxy::reverse(&server.endpoint());
    let env = TestEnv::new();
    let src = env.dir("src");
    let data = common::bytes(29, 3 << 20);
    std::fs::write(src.join("model.safetensors"), &data).unwrap();
    std::fs::write(src.join("config.json"), b"{}").unwrap();
    server.create_bucket("models");
    server.upload_dir("models", "r/", &src);
    proxy.add_fault(
        Fault::new(FaultKind::IgnoreRange)
            .times(u64::MAX)
            .on_method(axum::http::Method::GET),
    );
    let d = start(
        &env,
        &env_via(&server, &proxy.url()),
        &["--hf-chunk-mib", "1", "--hf-retry-base-ms", "20"],
    );
    env.write_models(
        "r.yaml",
        &model("r", &server.uri("models", "r"), "AlwaysDownload", &[]),
    );
    d.wait_model("clusterbasemodel.r", "Ready");
    assert_eq!(sha256sums(&env.mount.join("r")), sha256sums(&src));
    let big = "/models/r/model.safetensors";
    let sent = proxy.bytes_on(big);
    assert!(
        sent >= data.len() as u64 && sent <= 2 * data.len() as u64,
        "one whole download (plus at most one refused whole answer), not one per range: {sent}"
    );
}

#[test]
fn a_broken_range_is_continued_from_its_first_missing_byte() {
    let server = ObjectServer::s3();
    let proxy = Proxy::reverse(&server.endpoint());
    let env = TestEnv::new();
    let src = env.dir("src");
    let data = common::bytes(28, 3 << 20);
    std::fs::write(src.join("model.safetensors"), &data).unwrap();
    server.create_bucket("models");
    server.upload_dir("models", "r/", &src);
    // The first answer for the file breaks off after 100,000 body bytes.
    let cut = 100_000u64;
    proxy.add_fault(
        Fault::new(FaultKind::Truncate { after: cut })
            .on_path("/models/r/model.safetensors")
            .on_method(axum::http::Method::GET),
    );
    let d = start(
        &env,
        &env_via(&server, &proxy.url()),
        &[
            "--hf-chunk-mib",
            "1",
            "--hf-range-streams",
            "1",
            "--hf-retry-base-ms",
            "20",
        ],
    );
    env.write_models(
        "r.yaml",
        &model("r", &server.uri("models", "r"), "AlwaysDownload", &[]),
    );
    d.wait_model("clusterbasemodel.r", "Ready");
    assert_eq!(sha256sums(&env.mount.join("r")), sha256sums(&src));
    let gets: Vec<_> = proxy
        .requests()
        .into_iter()
        .filter(|r| r.path.ends_with("model.safetensors") && r.method == axum::http::Method::GET)
        .collect();
    assert_eq!(gets[0].fault, Some(FaultKind::Truncate { after: cut }));
    assert_eq!(gets[0].range.as_deref(), Some("bytes=0-1048575"));
    assert_eq!(
        gets[1].range.as_deref(),
        Some(format!("bytes={cut}-1048575").as_str()),
        "the retry asks for the rest of the chunk only: {gets:#?}"
    );
    assert_eq!(
        proxy.bytes_on("/models/r/model.safetensors"),
        data.len() as u64,
        "no byte was sent twice"
    );
}

#[test]
fn sigkill_mid_download_resumes_with_ranges() {
    let server = ObjectServer::s3();
    let proxy = Proxy::reverse(&server.endpoint());
    let env = TestEnv::new();
    let src = env.dir("src");
    let big = common::bytes(25, 24 << 20);
    std::fs::write(src.join("model.safetensors"), &big).unwrap();
    server.create_bucket("models");
    server.upload_dir("models", "big/", &src);
    let vars = env_via(&server, &proxy.url());
    let flags = ["--hf-chunk-mib", "1", "--hf-range-streams", "1"];
    let d = start(&env, &vars, &flags);
    env.write_models(
        "big.yaml",
        &model("big", &server.uri("models", "big"), "AlwaysDownload", &[]),
    );
    // Some ranges arrive, then the server fails every request: the download waits in its
    // retries with a partial file on disk, and is killed there.
    proxy.wait_until("a few ranges", Duration::from_secs(120), |records| {
        records
            .iter()
            .filter(|r| r.path.contains("model.safetensors") && r.status == 206)
            .count()
            >= 4
    });
    proxy.add_fault(Fault::new(FaultKind::status(500)).times(1_000_000));
    d.wait_until("a partial file", WAIT, |_| {
        std::fs::read_dir(env.state.join("stores"))
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(|s| {
                std::fs::read_dir(s.path().join("tmp"))
                    .into_iter()
                    .flatten()
            })
            .flatten()
            .any(|e| e.metadata().is_ok_and(|m| m.len() >= 4 << 20))
    });
    d.kill9();
    proxy.clear_faults();
    proxy.reset_counts();
    sh(&format!(
        "umount -l {} 2>/dev/null || true",
        env.mount.display()
    ));
    let d = start(&env, &vars, &flags);
    d.wait_model("clusterbasemodel.big", "Ready");
    assert_eq!(sha256sums(&env.mount.join("big")), sha256sums(&src));
    let fetched = proxy.bytes_on("model.safetensors");
    assert!(
        fetched <= (big.len() as u64) - (4 << 20),
        "only the missing ranges are fetched again: {fetched} of {}",
        big.len()
    );
    let first = proxy
        .requests()
        .into_iter()
        .filter(|r| r.path.contains("model.safetensors") && r.method == axum::http::Method::GET)
        .find_map(|r| r.range)
        .expect("a ranged request");
    assert!(
        !first.starts_with("bytes=0-"),
        "resumed at an offset: {first}"
    );
    assert!(d.log_text().contains("resuming partial download"));
}

#[test]
fn wrong_credentials_fail_with_the_servers_reason_and_no_secret() {
    // Azurite checks shared-key signatures.
    let server = ObjectServer::azure();
    let env = TestEnv::new();
    let src = env.dir("src");
    common::make_model_dir(&src, 26, 1000);
    server.create_bucket("models");
    server.upload_dir("models", "m/", &src);
    let d = start(&env, &server.daemon_env(), &[]);
    // A well-formed but wrong account key, given as the model's own secret.
    let wrong = "V3JvbmdLZXlXcm9uZ0tleVdyb25nS2V5V3JvbmdLZXlXcm9uZ0tleVdyb25nS2V5V3Jvbmc=";
    env.write_models(
        "m.yaml",
        &model(
            "m",
            &server.uri("models", "m"),
            "AlwaysDownload",
            &[("token", wrong)],
        ),
    );
    let e = d.wait_model("clusterbasemodel.m", "Failed");
    let reason = e["reason"].as_str().unwrap();
    assert!(reason.contains("403"), "{reason}");
    assert!(
        reason.contains("AuthorizationFailure")
            || reason.contains("Authentication")
            || reason.contains("authoriz"),
        "the server's reason: {reason}"
    );
    assert!(!env.mount.join("m").exists());
    assert_no_secret(&env, &d, &[wrong]);
}

/// The secret must appear nowhere the daemon writes or serves.
fn assert_no_secret(env: &TestEnv, d: &Daemon, secrets: &[&str]) {
    let status_text = std::fs::read_to_string(env.state.join("status.json")).unwrap_or_default();
    let (_, http_status) = d.get("/v1/models");
    for (what, text) in [
        ("log", d.log_text()),
        ("status.json", status_text),
        ("/v1/models", http_status),
        ("metrics", d.metrics()),
    ] {
        for secret in secrets {
            assert!(!text.contains(secret), "a secret leaked into the {what}");
        }
    }
}

#[test]
fn s3_wrong_credentials_fail_with_the_servers_reason_and_no_secret() {
    // moto checks SigV4 signatures against its IAM users once authentication is required.
    let server = ObjectServer::s3();
    let env = TestEnv::new();
    let src = env.dir("src");
    common::make_model_dir(&src, 27, 1000);
    server.create_bucket("models");
    server.upload_dir("models", "m/", &src);
    let key: Value = serde_json::from_str(&server.client(&["iam-user", "reader"])).unwrap();
    let (id, secret) = (
        key["AccessKeyId"].as_str().unwrap(),
        key["SecretAccessKey"].as_str().unwrap(),
    );
    server.client(&["require-auth"]);
    // The daemon's environment names a key id that does not exist; each model brings its own.
    let d = start(&env, &server.daemon_env(), &[]);
    let wrong = "WrongSecretWrongSecretWrongSecret0123456";
    let uri = server.uri("models", "m");
    env.write_models(
        "m.yaml",
        &format!(
            "{}---\n{}",
            model(
                "wrong",
                &uri,
                "AlwaysDownload",
                &[("access_key_id", id), ("token", wrong)]
            ),
            model(
                "right",
                &uri,
                "AlwaysDownload",
                &[("access_key_id", id), ("token", secret)]
            ),
        ),
    );
    // The right key proves the server checks the signature and not something else.
    d.wait_model("clusterbasemodel.right", "Ready");
    assert_eq!(sha256sums(&env.mount.join("right")), sha256sums(&src));
    let e = d.wait_model("clusterbasemodel.wrong", "Failed");
    let reason = e["reason"].as_str().unwrap();
    assert!(reason.contains("403"), "{reason}");
    assert!(
        reason.contains("SignatureDoesNotMatch"),
        "the server's reason: {reason}"
    );
    assert!(!env.mount.join("wrong").exists());
    assert_no_secret(&env, &d, &[wrong, secret]);

    // A permanent failure is not retried by itself, but a change of the model's parameters
    // is a change of the model: fixing the key id restarts the work.
    let unknown_id = "AKIAIOSFODNN7EXAMPLE";
    let fix = |id: &str| {
        env.write_models(
            "fix.yaml",
            &model(
                "fix",
                &uri,
                "AlwaysDownload",
                &[("access_key_id", id), ("token", secret)],
            ),
        )
    };
    let failures = || {
        d.log_text()
            .lines()
            .filter(|l| l.contains("clusterbasemodel.fix") && l.contains("model failed"))
            .count()
    };
    fix(unknown_id);
    let e = d.wait_model("clusterbasemodel.fix", "Failed");
    let reason = e["reason"].as_str().unwrap();
    assert!(reason.contains("InvalidAccessKeyId"), "{reason}");
    // Another wrong id: the model tries again (and uses up the one fresh attempt a Failed
    // model gets when its object is seen again with an unchanged fingerprint).
    fix("AKIAI44QH8DHBEXAMPLE");
    d.wait_until("a second failure", WAIT, |_| failures() >= 2);
    fix(id);
    d.wait_model("clusterbasemodel.fix", "Ready");
    assert_eq!(sha256sums(&env.mount.join("fix")), sha256sums(&src));
    assert_no_secret(&env, &d, &[wrong, secret]);
}

#[test]
fn a_changed_endpoint_parameter_resolves_a_ready_model_again() {
    // Two S3 servers hold different bytes under the same bucket and prefix.
    let (one, two) = (ObjectServer::s3(), ObjectServer::s3());
    let env = TestEnv::new();
    let (src1, src2) = (env.dir("src1"), env.dir("src2"));
    common::make_model_dir(&src1, 29, 200_000);
    common::make_model_dir(&src2, 30, 300_000);
    for (server, src) in [(&one, &src1), (&two, &src2)] {
        server.create_bucket("models");
        server.upload_dir("models", "m/", src);
    }
    let d = start(&env, &one.daemon_env(), &[]);
    let write = |endpoint: &str| {
        env.write_models(
            "m.yaml",
            &model(
                "m",
                &one.uri("models", "m"),
                "AlwaysDownload",
                &[("endpoint", endpoint)],
            ),
        )
    };
    write(&one.endpoint());
    d.wait_model("clusterbasemodel.m", "Ready");
    assert_eq!(sha256sums(&env.mount.join("m")), sha256sums(&src1));
    // Same URI, another endpoint: a new resolve, the other server's bytes, then the flip.
    write(&two.endpoint());
    let want = sha256sums(&src2);
    d.wait_until("the second server's bytes", WAIT, |s: &Value| {
        s["clusterbasemodel.m"]["status"] == "Ready" && sha256sums(&env.mount.join("m")) == want
    });
}

#[test]
fn an_overwritten_object_becomes_a_new_artifact_at_the_next_resolve() {
    let server = ObjectServer::s3();
    let env = TestEnv::new();
    let src = env.dir("src");
    common::make_model_dir(&src, 31, 200_000);
    server.create_bucket("models");
    server.upload_dir("models", "live/", &src);
    let d = start(
        &env,
        &server.daemon_env(),
        &["--resolve-interval-secs", "1"],
    );
    let uri = server.uri("models", "live");
    env.write_models(
        "ab.yaml",
        &format!(
            "{}---\n{}",
            model("a", &uri, "AlwaysDownload", &[]),
            model("b", &uri, "ReuseIfExists", &[])
        ),
    );
    let old_sha = d.wait_model("clusterbasemodel.a", "Ready")["config"]["artifact"]["sha"].clone();
    wait_parent(&d, "clusterbasemodel.b", "clusterbasemodel.a");
    assert_eq!(sha256sums(&env.mount.join("a")), sha256sums(&src));

    // The object is overwritten in place: same key, new bytes, new ETag.
    let new_config = b"{\"model_type\": \"changed\"}".to_vec();
    server.put("models", "live/config.json", &new_config);
    std::fs::write(src.join("config.json"), &new_config).unwrap();
    let want = sha256sums(&src);
    for m in ["a", "b"] {
        d.wait_until(&format!("{m} serves the new object"), WAIT, |s: &Value| {
            s[format!("clusterbasemodel.{m}")]["status"] == "Ready"
                && s[format!("clusterbasemodel.{m}")]["config"]["artifact"]["sha"] != old_sha
                && sha256sums(&env.mount.join(m)) == want
        });
    }
    // Per policy: b maps onto a's new copy again, and the old copy goes.
    wait_parent(&d, "clusterbasemodel.b", "clusterbasemodel.a");
    d.wait_until("one copy", WAIT, |_| env.stores_with_blobs().len() == 1);
    assert!(d.log_text().contains("the source changed"));
}

#[test]
fn hostile_keys_are_refused_and_nothing_is_written_outside_the_state_dir() {
    let server = ObjectServer::s3();
    let env = TestEnv::new();
    server.create_bucket("models");
    let cases: [(&str, &[&str]); 3] = [
        ("dots", &["dots/ok.json", "dots/../../../../escaped.txt"]),
        ("empty", &["empty/a//b.txt"]),
        ("clash", &["clash/a", "clash/a/b"]),
    ];
    for (prefix, keys) in cases {
        for key in keys {
            server.put("models", key, b"hostile");
        }
        let _ = prefix;
    }
    let d = start(&env, &server.daemon_env(), &[]);
    let yaml: Vec<String> = cases
        .iter()
        .map(|(p, _)| model(p, &server.uri("models", p), "AlwaysDownload", &[]))
        .collect();
    env.write_models("h.yaml", &yaml.join("---\n"));
    for (prefix, _) in cases {
        let e = d.wait_model(&format!("clusterbasemodel.{prefix}"), "Failed");
        let reason = e["reason"].as_str().unwrap();
        assert!(
            reason.contains("segment")
                || reason.contains("both a file and a directory")
                || reason.contains("invalid"),
            "{prefix}: {reason}"
        );
        assert!(!env.mount.join(prefix).exists());
    }
    // Not into other mounts (-xdev): a write that escaped lands on the disk, and another
    // test's FUSE mount may be between two servers, its lookups waiting for the next.
    let escaped = sh(&format!(
        "find {} /tmp -xdev -maxdepth 8 -name escaped.txt -newer {} 2>/dev/null || true",
        env.root.path().display(),
        env.models.display()
    ));
    assert!(escaped.trim().is_empty(), "written outside: {escaped}");
}

/// What each store publishes about an object's bytes is checked end to end: a byte flipped on
/// the way (the answer otherwise perfect: status, length, headers) fails the download, and
/// nothing of it is served. `put` stores `data` as `m/w.bin` the way the case needs. With
/// `forward`, the daemon reaches the store through the proxy as a fleet reaches it through a
/// caching proxy (`--proxy-<scheme>`, the proxy overlay); else the proxy stands in for the
/// store's endpoint.
fn a_flipped_byte_fails_the_model(kind: Kind, forward: bool, put: impl Fn(&ObjectServer, &[u8])) {
    let server = ObjectServer::start(kind);
    let proxy = if forward {
        Proxy::forward()
    } else {
        Proxy::reverse(&server.endpoint())
    };
    let env = TestEnv::new();
    server.create_bucket("models");
    let data = common::bytes(41, (3 << 20) + 5);
    put(&server, &data);
    server.put("models", "m/config.json", b"{}");
    proxy.add_fault(
        Fault::new(FaultKind::Corrupt { at: 1000 })
            .times(1_000_000)
            .on_method(axum::http::Method::GET)
            .on_path("w.bin"),
    );
    let proxy_flag = format!("--proxy-{}", kind.scheme());
    let proxy_url = proxy.url();
    let d = if forward {
        start(
            &env,
            &server.daemon_env(),
            &["--hf-retry-base-ms", "20", &proxy_flag, &proxy_url],
        )
    } else {
        start(
            &env,
            &env_via(&server, &proxy.url()),
            &["--hf-retry-base-ms", "20"],
        )
    };
    env.write_models(
        "m.yaml",
        &model("m", &server.uri("models", "m"), "AlwaysDownload", &[]),
    );
    let e = d.wait_until("m failed or ready", WAIT, |doc| {
        let s = &doc["clusterbasemodel.m"]["status"];
        *s == "Failed" || *s == "Ready"
    })["clusterbasemodel.m"]
        .clone();
    let served = std::fs::read(env.mount.join("m/w.bin")).ok();
    assert_eq!(
        e["status"],
        "Failed",
        "{kind:?}: a corrupted object was served ({} bytes, equal to the object: {}): {e}",
        served.as_ref().map_or(0, |s| s.len()),
        served.as_deref() == Some(&data[..])
    );
    let reason = e["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("w.bin") && reason.contains("failed verification"),
        "{kind:?}: {reason}"
    );
    assert!(!env.mount.join("m").exists(), "{kind:?}: nothing is served");
    assert!(
        proxy.faults_injected() >= 3,
        "{kind:?}: every attempt was corrupted"
    );
}

/// S3 through a forward proxy: a single-part object's ETag is the MD5 of its bytes.
#[test]
fn s3_single_part_object_is_checked_by_its_etag_through_a_proxy() {
    a_flipped_byte_fails_the_model(Kind::S3, true, |s, data| s.put("models", "m/w.bin", data));
}

/// Azure: a blob uploaded in blocks (a multipart upload) with its Content-MD5 set, as azcopy
/// --put-md5 does.
#[test]
fn azure_blob_uploaded_in_blocks_is_checked_by_its_content_md5() {
    a_flipped_byte_fails_the_model(Kind::Azure, false, |s, data| {
        let file = tempfile::NamedTempFile::new_in(s.scratch()).unwrap();
        std::fs::write(file.path(), data).unwrap();
        s.client(&[
            "put-blocks",
            "models",
            "m/w.bin",
            file.path().to_str().unwrap(),
            "1",
        ]);
    });
}

/// S3 multipart objects are checked by what S3 publishes about them (a `HEAD` with
/// `ChecksumMode`, and one `HEAD ?partNumber=N` per part for the part sizes): a CRC32 whose
/// type moto does not say (full-object or composite), a composite SHA256, or without any
/// checksum the multipart ETag (the MD5 of the parts' MD5s). One part's bytes are corrupted
/// on the way once (a 1 MiB range inside part 2 of 3): each file is downloaded again and
/// served with the source's bytes. Corrupted on every attempt, the model fails with the
/// check's name. An SSE-KMS object without a checksum (its ETag is no MD5) is served and
/// reported as checked by size only.
#[test]
fn s3_multipart_objects_with_a_corrupted_part_are_refetched_or_failed() {
    let server = ObjectServer::s3();
    let proxy = Proxy::reverse(&server.endpoint());
    let env = TestEnv::new();
    server.create_bucket("models");
    let data = common::bytes(42, (11 << 20) + 3);
    let file = env.dir("src").join("w.bin");
    std::fs::write(&file, &data).unwrap();
    let uploads: [(&str, &[&str]); 5] = [
        ("crc", &["--checksum", "crc32"]),
        ("sha", &["--checksum", "sha256"]),
        ("etag", &["--checksum", "none"]),
        ("bad", &["--checksum", "none"]),
        ("kms", &["--checksum", "none", "--sse", "aws:kms"]),
    ];
    let mut yaml = String::new();
    for (name, flags) in uploads {
        let key = format!("{name}/w.bin");
        let mut args = vec!["--part-mib", "5"];
        args.extend_from_slice(flags);
        args.extend(["put", "models", &key, file.to_str().unwrap()]);
        server.client(&args);
        server.put("models", &format!("{name}/config.json"), b"{}");
        let etag = &server.list("models", &key)[0].etag;
        assert!(etag.ends_with("-3"), "{name}: a 3-part ETag: {etag}");
        yaml.push_str(&model(
            name,
            &server.uri("models", name),
            "AlwaysDownload",
            &[],
        ));
        yaml.push_str("---\n");
        // Bytes 6 MiB + 1000 (part 2) of the range starting at 6 MiB.
        let times = if name == "bad" { 1_000_000 } else { 1 };
        proxy.add_fault(
            Fault::new(FaultKind::Corrupt { at: 1000 })
                .times(times)
                .on_method(axum::http::Method::GET)
                .on_path(&key)
                .on_range_from(6 << 20),
        );
    }
    let d = start(
        &env,
        &env_via(&server, &proxy.url()),
        &["--hf-chunk-mib", "1", "--hf-retry-base-ms", "20"],
    );
    env.write_models("m.yaml", &yaml);
    for name in ["crc", "sha", "etag"] {
        let e = d.wait_model(&format!("clusterbasemodel.{name}"), "Ready");
        assert!(e.get("integrity").is_none(), "{name}: {e}");
        assert_eq!(
            std::fs::read(env.mount.join(name).join("w.bin")).unwrap(),
            data,
            "{name}"
        );
        let corrupted = proxy
            .requests()
            .iter()
            .filter(|r| r.path.contains(&format!("{name}/w.bin")) && r.fault.is_some())
            .count();
        assert_eq!(corrupted, 1, "{name}: one corrupted answer");
    }
    let kms = d.wait_model("clusterbasemodel.kms", "Ready");
    assert_eq!(kms["integrity"], "size-only", "{kms}");
    assert_eq!(kms["sizeOnlyFiles"], 1, "{kms}");
    let bad = d.wait_model("clusterbasemodel.bad", "Failed");
    let reason = bad["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("w.bin")
            && reason.contains("failed verification")
            && reason.contains("S3 multipart ETag md5:"),
        "{reason}"
    );
    assert!(!env.mount.join("bad").exists(), "nothing of it is served");
    let log = d.log_text();
    for check in [
        "S3 full-object checksum crc32:",
        "S3 composite checksum sha256:",
        "S3 multipart ETag md5:",
    ] {
        assert!(log.contains(check), "the log names {check}");
    }
    assert!(log.contains("checked by its size only"));
}
