//! `oci://` models end to end: the real daemon lists and downloads from the OCI Object Storage
//! look-alike (in this process, verifying every request's signature), and serves the files
//! through its FUSE mount.

mod common;
mod oci_common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use modelfs_agent::source::oci::sign::{RequestToSign, SigningKey};
use modelfs_devhub::hf::{Fault, FaultKind, FaultTarget};
use modelfs_devhub::oci::{DevObject, InstanceIdentity, OciDev, OciDevConfig, RunningOciDev};
use oci_common::{ApiKey, TENANCY, USER};
use sha2::{Digest, Sha256};

const NS: &str = "devns";
const BUCKET: &str = "models";

struct TestOci {
    running: RunningOciDev,
    _rt: tokio::runtime::Runtime,
}

impl TestOci {
    fn start(page_size: usize) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let server = OciDev::new(OciDevConfig {
            page_size,
            ..OciDevConfig::default()
        });
        server.create_bucket(NS, BUCKET);
        let running = rt
            .block_on(server.serve("127.0.0.1:0".parse().unwrap()))
            .unwrap();
        Self { running, _rt: rt }
    }

    fn server(&self) -> &OciDev {
        &self.running.server
    }

    /// The same look-alike as the OKE proxymux, over TLS at `<loopback address>:12250`.
    fn start_proxymux(&self, dir: &Path) -> oci_common::Proxymux {
        oci_common::start_proxymux(&self.running.server, &self._rt, dir)
    }

    fn put_files(&self, prefix: &str, files: &Files) {
        for (path, data) in files {
            let object = if data.len() >= 2 << 20 {
                // Large files as multipart uploads with opc-meta-md5, as OME's uploader writes.
                DevObject::multipart(data.clone(), 1 << 20, true)
            } else {
                DevObject::new(data.clone())
            };
            self.server()
                .put_object(NS, BUCKET, &format!("{prefix}/{path}"), object);
        }
    }

    fn fault(&self, kind: FaultKind, count: u64, path: Option<&str>) {
        self.server().add_fault(Fault {
            kind,
            count,
            path: path.map(str::to_string),
            target: FaultTarget::File,
        });
    }
}

type Files = BTreeMap<String, Vec<u8>>;

fn model_files(seed: u64, large: usize) -> Files {
    let mut f = Files::new();
    f.insert("config.json".into(), bytes(seed, 700));
    f.insert("empty.txt".into(), Vec::new());
    f.insert("caf\u{e9}/na\u{ef}ve.txt".into(), bytes(seed + 1, 333));
    for i in 0..9 {
        f.insert(
            format!("tokenizer/part-{i}/vocab.txt"),
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

fn total(files: &Files) -> u64 {
    files.values().map(|v| v.len() as u64).sum()
}

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
    assert_eq!(got, want, "mount content differs from the bucket");
}

fn oci_model(name: &str, prefix: &str, policy: &str, extra_params: &str) -> String {
    format!(
        "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: {name}\nspec:\n  storage:\n    storageUri: oci://n/{NS}/b/{BUCKET}/o/{prefix}\n    downloadPolicy: {policy}\n    parameters:\n      auth: UserPrincipal\n      region: us-ashburn-1\n{extra_params}"
    )
}

fn start_daemon(env: &TestEnv, oci: &TestOci, config: Option<&Path>) -> Daemon {
    start_daemon_with(env, oci, config, &[])
}

fn start_daemon_with(
    env: &TestEnv,
    oci: &TestOci,
    config: Option<&Path>,
    vars: &[(&str, &str)],
) -> Daemon {
    let url = oci.running.url();
    let config = config
        .map(|c| c.display().to_string())
        .unwrap_or_else(|| env.root.path().join("no-config").display().to_string());
    Daemon::start_with_env(
        env,
        &[
            "--hf-chunk-mib",
            "1",
            "--hf-retry-base-ms",
            "20",
            "--hf-stall-timeout-secs",
            "2",
            "--hf-progress-log-secs",
            "1",
        ],
        &[
            &[
                ("MODELFS_OCI_ENDPOINT", url.as_str()),
                ("OCI_CONFIG_PATH", config.as_str()),
            ],
            vars,
        ]
        .concat(),
    )
}

#[test]
fn oci_model_is_ready_with_the_bucket_bytes_and_reuse_keeps_one_store() {
    let oci = TestOci::start(4);
    let mut files = model_files(1, 5 << 20);
    oci.put_files("llm/v1", &files);
    // A multipart upload without opc-meta-md5: checked by size only, as OME does.
    let bare = bytes(3, (2 << 20) + 17);
    oci.server().put_object(
        NS,
        BUCKET,
        "llm/v1/weights/extra.bin",
        DevObject::multipart(bare.clone(), 1 << 20, false),
    );
    files.insert("weights/extra.bin".into(), bare);
    // Beside the prefix, not under it: never part of the artifact.
    oci.server().put_object(
        NS,
        BUCKET,
        "llm/v1-other/x.bin",
        DevObject::new(bytes(5, 100)),
    );
    oci.server()
        .put_object(NS, BUCKET, "llm/v1.txt", DevObject::new(bytes(6, 100)));
    // The console's folder marker.
    oci.server()
        .put_object(NS, BUCKET, "llm/v1/tokenizer/", DevObject::new(Vec::new()));
    let env = TestEnv::new();
    let key = ApiKey::generate(&env.dir("keys"), "agent");
    key.register(oci.server());
    let config = key.config_file(&env.dir("keys"));
    let d = start_daemon(&env, &oci, Some(&config));

    env.write_models(
        "a.yaml",
        &oci_model("llm-a", "llm/v1", "AlwaysDownload", ""),
    );
    let a = d.wait_model("clusterbasemodel.llm-a", "Ready");
    assert_tree(&env.mount.join("llm-a"), &files);
    let stats = oci.server().stats();
    assert_eq!(
        stats.bytes_served,
        total(&files),
        "each object fetched once"
    );
    assert!(stats.list_requests >= 4, "paginated listing: {stats:?}");
    assert_eq!(stats.refused_signatures, 0);
    // Same bucket and prefix under ReuseIfExists: mapped onto llm-a's store, nothing fetched.
    env.write_models(
        "b.yaml",
        &oci_model("llm-b", "llm/v1/", "ReuseIfExists", ""),
    );
    let b = d.wait_model("clusterbasemodel.llm-b", "Ready");
    assert_tree(&env.mount.join("llm-b"), &files);
    assert_eq!(
        a["config"]["artifact"]["sha"],
        b["config"]["artifact"]["sha"]
    );
    assert_eq!(
        b["config"]["artifact"]["parentPath"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        ["clusterbasemodel.llm-a"]
    );
    assert_eq!(
        env.stores_with_blobs().len(),
        1,
        "one store for both models"
    );
    assert_eq!(oci.server().stats().bytes_served, total(&files));
    assert_eq!(
        d.metric("modelfs_fetched_bytes_total{scheme=\"Oci\"}"),
        total(&files) as f64
    );

    // T-01 on an object store: the child turns AlwaysDownload; it downloads its own copy and
    // becomes its own parent, llm-a drops it from its children.
    env.write_models(
        "b.yaml",
        &oci_model("llm-b", "llm/v1", "AlwaysDownload", ""),
    );
    d.wait_until("llm-b on its own copy", Duration::from_secs(60), |doc| {
        let b = &doc["clusterbasemodel.llm-b"];
        b["status"] == "Ready"
            && b["config"]["artifact"]["parentPath"]
                .as_object()
                .is_some_and(|p| p.contains_key("clusterbasemodel.llm-b"))
            && doc["clusterbasemodel.llm-a"]["config"]["artifact"]["childrenPaths"]
                .as_array()
                .is_none_or(|c| c.is_empty())
    });
    assert_tree(&env.mount.join("llm-b"), &files);
    assert_eq!(env.stores_with_blobs().len(), 2);
    assert_eq!(oci.server().stats().bytes_served, 2 * total(&files));
    env.remove_models("b.yaml");
    d.wait_gone("clusterbasemodel.llm-b");

    // A rewritten object makes a new artifact: a ReuseIfExists model resolved after the
    // rewrite is not mapped onto the old copy; it downloads the new content.
    let mut v2 = files.clone();
    v2.insert("config.json".into(), bytes(77, 701));
    oci.server().put_object(
        NS,
        BUCKET,
        "llm/v1/config.json",
        DevObject::new(v2["config.json"].clone()),
    );
    env.write_models("c.yaml", &oci_model("llm-c", "llm/v1", "ReuseIfExists", ""));
    let c = d.wait_model("clusterbasemodel.llm-c", "Ready");
    assert_ne!(
        c["config"]["artifact"]["sha"],
        a["config"]["artifact"]["sha"]
    );
    assert_tree(&env.mount.join("llm-c"), &v2);
    assert_tree(&env.mount.join("llm-a"), &files);
    assert!(c["config"]["artifact"]["parentPath"]
        .as_object()
        .unwrap()
        .contains_key("clusterbasemodel.llm-c"));
    assert_eq!(
        oci.server().stats().bytes_served,
        2 * total(&files) + total(&v2)
    );
}

/// A model in one of OME's legacy URI forms.
fn legacy_oci_model(name: &str, uri: &str, policy: &str) -> String {
    format!(
        "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: {name}\nspec:\n  storage:\n    storageUri: {uri}\n    downloadPolicy: {policy}\n    parameters:\n      auth: UserPrincipal\n"
    )
}

/// OME's legacy forms: `oci://<bucket>/<prefix>` asks the service for the namespace
/// (`GET /n/`), `oci://<ns>@<region>/<bucket>/<prefix>` names it; both name the same objects
/// as `oci://n/<ns>/b/<bucket>/o/<prefix>`, so a `ReuseIfExists` model in another form maps
/// onto the first copy and nothing is fetched twice.
#[test]
fn legacy_oci_forms_serve_the_same_objects_as_omes_form() {
    let oci = TestOci::start(1000);
    let files = model_files(21, 1 << 20);
    oci.put_files("legacy/v1", &files);
    let env = TestEnv::new();
    let key = ApiKey::generate(&env.dir("keys"), "agent");
    key.register(oci.server());
    let config = key.config_file(&env.dir("keys"));
    let d = start_daemon(&env, &oci, Some(&config));

    env.write_models(
        "a.yaml",
        &legacy_oci_model(
            "legacy-a",
            &format!("oci://{BUCKET}/legacy/v1"),
            "AlwaysDownload",
        ),
    );
    let a = d.wait_model("clusterbasemodel.legacy-a", "Ready");
    assert_tree(&env.mount.join("legacy-a"), &files);
    assert_eq!(oci.server().stats().bytes_served, total(&files));

    env.write_models(
        "b.yaml",
        &legacy_oci_model(
            "legacy-b",
            &format!("oci://{NS}@us-ashburn-1/{BUCKET}/legacy/v1"),
            "ReuseIfExists",
        ),
    );
    env.write_models(
        "c.yaml",
        &oci_model("legacy-c", "legacy/v1", "ReuseIfExists", ""),
    );
    for name in ["legacy-b", "legacy-c"] {
        let m = d.wait_model(&format!("clusterbasemodel.{name}"), "Ready");
        assert_tree(&env.mount.join(name), &files);
        assert_eq!(
            m["config"]["artifact"]["sha"], a["config"]["artifact"]["sha"],
            "{name} names the same objects"
        );
    }
    assert_eq!(
        env.stores_with_blobs().len(),
        1,
        "one store for the three forms"
    );
    assert_eq!(oci.server().stats().bytes_served, total(&files));

    // A bucket the tenancy does not have: the service's own reason.
    env.write_models(
        "d.yaml",
        &legacy_oci_model("legacy-d", "oci://nosuchbucket/x", "AlwaysDownload"),
    );
    let failed = d.wait_model("clusterbasemodel.legacy-d", "Failed");
    let reason = failed["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("nosuchbucket"), "{reason}");
}

#[test]
fn wrong_md5_and_truncated_bodies_never_reach_the_mount() {
    let oci = TestOci::start(1000);
    let files = model_files(2, 3 << 20);
    oci.put_files("flaky", &files);
    let liar = model_files(3, 1 << 20);
    oci.put_files("liar", &liar);
    // The liar's config.json reports the MD5 of other bytes.
    oci.server().put_object(
        NS,
        BUCKET,
        "liar/config.json",
        DevObject::new(liar["config.json"].clone()).with_reported_md5("AAAAAAAAAAAAAAAAAAAAAA=="),
    );
    // A multipart upload whose opc-meta-md5 is wrong: refused like a wrong MD5.
    let mut lying_multipart = DevObject::multipart(bytes(31, 3 << 20), 1 << 20, true);
    lying_multipart
        .meta
        .insert("md5".into(), "AAAAAAAAAAAAAAAAAAAAAA==".into());
    oci.server()
        .put_object(NS, BUCKET, "liar2/weights.bin", lying_multipart);
    let cut = model_files(4, 1 << 20);
    oci.put_files("cut", &cut);
    // Flaky: two truncated bodies, a 503 and a 429 on the shard, then good answers.
    oci.fault(
        FaultKind::Truncate { after: 100_000 },
        2,
        Some("flaky/weights/model-00001"),
    );
    oci.fault(
        FaultKind::Status {
            status: 503,
            retry_after: None,
        },
        1,
        Some("flaky/config"),
    );
    oci.fault(
        FaultKind::Status {
            status: 429,
            retry_after: Some(0),
        },
        1,
        Some("flaky/config"),
    );
    // Cut: the shard's body always stops short.
    oci.fault(
        FaultKind::Truncate { after: 1000 },
        1_000_000,
        Some("cut/weights/model-00001"),
    );
    let env = TestEnv::new();
    let key = ApiKey::generate(&env.dir("keys"), "agent");
    key.register(oci.server());
    let d = start_daemon(&env, &oci, Some(&key.config_file(&env.dir("keys"))));
    env.write_models(
        "flaky.yaml",
        &oci_model("flaky", "flaky", "AlwaysDownload", ""),
    );
    env.write_models(
        "liar.yaml",
        &oci_model("liar", "liar", "AlwaysDownload", ""),
    );
    env.write_models("cut.yaml", &oci_model("cut", "cut", "AlwaysDownload", ""));
    env.write_models(
        "liar2.yaml",
        &oci_model("liar2", "liar2", "AlwaysDownload", ""),
    );

    d.wait_model("clusterbasemodel.flaky", "Ready");
    assert_tree(&env.mount.join("flaky"), &files);
    let stats = oci.server().stats();
    assert!(
        stats.ranged_requests >= 2,
        "large files come as parallel ranges: {stats:?}"
    );

    let liar_entry = d.wait_model("clusterbasemodel.liar", "Failed");
    let reason = liar_entry["reason"].as_str().unwrap();
    assert!(
        reason.contains("config.json") && reason.contains("failed verification"),
        "{reason}"
    );
    assert!(
        !env.mount.join("liar").exists(),
        "a failed model is not served"
    );

    let e = d.wait_model("clusterbasemodel.liar2", "Failed");
    let reason = e["reason"].as_str().unwrap();
    assert!(
        reason.contains("weights.bin") && reason.contains("failed verification"),
        "{reason}"
    );
    assert!(!env.mount.join("liar2").exists());

    let cut_entry = d.wait_model("clusterbasemodel.cut", "Failed");
    let reason = cut_entry["reason"].as_str().unwrap();
    // The connection closes before the promised length on every attempt (a later retry of the
    // whole model may still succeed, so the reason says when).
    assert!(
        reason.contains("end of file before message length") && reason.contains("gave up after"),
        "{reason}"
    );
    assert!(!env.mount.join("cut").exists());
    // Nothing of either reached a blob: every blob on disk is a file of the good model.
    let good: std::collections::BTreeSet<String> = files
        .values()
        .map(|d| hex::encode(Sha256::digest(d)))
        .collect();
    for store in env.stores_with_blobs() {
        for blob in std::fs::read_dir(store.join("blobs")).unwrap().flatten() {
            let name = blob.file_name().to_string_lossy().into_owned();
            // A blob collected (the failed models' stores) between the listing and this read
            // is gone, not wrong.
            let bytes = match std::fs::read(blob.path()) {
                Ok(bytes) => bytes,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => panic!("reading {}: {e}", blob.path().display()),
            };
            assert_eq!(hex::encode(Sha256::digest(&bytes)), name);
            let is_good = good.contains(&name)
                || liar
                    .values()
                    .chain(cut.values())
                    .any(|d| hex::encode(Sha256::digest(d)) == name);
            assert!(is_good, "blob {name} holds bytes no object has");
        }
    }
}

#[test]
fn wrong_key_fails_with_the_servers_reason_and_no_secret_anywhere() {
    let oci = TestOci::start(1000);
    oci.put_files("m", &model_files(5, 1000));
    let env = TestEnv::new();
    let registered = ApiKey::generate(&env.dir("keys"), "registered");
    registered.register(oci.server());
    // The model's Secret names the registered key id but holds another private key.
    let other = ApiKey::generate(&env.dir("keys"), "other");
    let secret = format!(
        "[DEFAULT]\nuser={USER}\nfingerprint={}\ntenancy={TENANCY}\n{}",
        registered.fingerprint,
        other.private_pem()
    );
    let indented: String = secret.lines().map(|l| format!("        {l}\n")).collect();
    let d = start_daemon(&env, &oci, None);
    env.write_models(
        "m.yaml",
        &oci_model(
            "m",
            "m",
            "AlwaysDownload",
            &format!("      token: |\n{indented}"),
        ),
    );
    let e = d.wait_model("clusterbasemodel.m", "Failed");
    let reason = e["reason"].as_str().unwrap();
    assert!(
        reason.contains("401") && reason.contains("NotAuthenticated"),
        "the service's reason: {reason}"
    );
    assert!(oci.server().stats().refused_signatures >= 1);
    assert_eq!(oci.server().stats().bytes_served, 0);
    // Key material appears nowhere the daemon writes (the fingerprint may: it is public).
    let pem = other.private_pem();
    let body_lines: Vec<&str> = pem
        .lines()
        .filter(|l| !l.starts_with("-----") && l.len() > 20)
        .collect();
    let status = std::fs::read_to_string(env.state.join("status.json")).unwrap();
    let log = d.log_text();
    let (_, api) = d.get("/v1/models");
    for line in body_lines {
        assert!(!log.contains(line), "key material in the log");
        assert!(!status.contains(line), "key material in status.json");
        assert!(!api.contains(line), "key material in /v1/models");
    }

    // The right key in the Secret: the same model becomes Ready.
    let secret = secret.replace(&other.private_pem(), &registered.private_pem());
    let indented: String = secret.lines().map(|l| format!("        {l}\n")).collect();
    env.write_models(
        "m.yaml",
        &oci_model(
            "m",
            "m",
            "AlwaysDownload",
            &format!("      token: |\n{indented}"),
        ),
    );
    d.wait_model("clusterbasemodel.m", "Ready");
    assert_tree(&env.mount.join("m"), &model_files(5, 1000));
}

#[test]
fn hostile_object_names_are_refused_and_nothing_is_written() {
    let oci = TestOci::start(1000);
    let put = |name: &str| {
        oci.server()
            .put_object(NS, BUCKET, name, DevObject::new(bytes(9, 64)))
    };
    put("dots/ok.txt");
    put("dots/../escape.txt");
    put("abs/ok.txt");
    put("abs//etc/passwd");
    put("empty/a//b.txt");
    put("clash/a");
    put("clash/a/b");
    let env = TestEnv::new();
    let key = ApiKey::generate(&env.dir("keys"), "agent");
    key.register(oci.server());
    let d = start_daemon(&env, &oci, Some(&key.config_file(&env.dir("keys"))));
    let cases = [
        ("dots", "dot segment"),
        ("abs", "absolute path"),
        ("empty", "empty segment"),
        ("clash", "both a file and a directory"),
    ];
    for (name, _) in cases {
        env.write_models(
            &format!("{name}.yaml"),
            &oci_model(name, name, "AlwaysDownload", ""),
        );
    }
    for (name, why) in cases {
        let e = d.wait_model(&format!("clusterbasemodel.{name}"), "Failed");
        let reason = e["reason"].as_str().unwrap();
        assert!(reason.contains(why), "{name}: {reason}");
        assert!(!env.mount.join(name).exists());
    }
    assert_eq!(
        oci.server().stats().get_requests,
        0,
        "nothing was downloaded"
    );
    assert!(!env.root.path().join("escape.txt").exists());
    assert!(env.stores_with_blobs().is_empty());
}

#[test]
fn sigkill_mid_download_resumes_with_ranges() {
    let oci = TestOci::start(1000);
    let files = model_files(6, 24 << 20);
    oci.put_files("big", &files);
    oci.fault(
        FaultKind::Slow {
            bytes_per_sec: 2 << 20,
        },
        1_000_000,
        Some("big/weights/model-00001"),
    );
    let env = TestEnv::new();
    let key = ApiKey::generate(&env.dir("keys"), "agent");
    key.register(oci.server());
    let config = key.config_file(&env.dir("keys"));
    let d = start_daemon(&env, &oci, Some(&config));
    env.write_models("m.yaml", &oci_model("big", "big", "AlwaysDownload", ""));
    let size = total(&files);
    d.wait_until("a third downloaded", Duration::from_secs(60), |doc| {
        let p = &doc["clusterbasemodel.big"]["progress"];
        p["completedBytes"].as_u64().unwrap_or(0) > size / 3
    });
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
    let served_before = oci.server().stats().bytes_served;
    assert!(served_before < size);
    let ranged_before = oci.server().stats().ranged_requests;

    oci.server().clear_faults();
    sh(&format!(
        "umount -l {} 2>/dev/null || true",
        env.mount.display()
    ));
    let d = start_daemon(&env, &oci, Some(&config));
    d.wait_model("clusterbasemodel.big", "Ready");
    assert_tree(&env.mount.join("big"), &files);
    let stats = oci.server().stats();
    assert!(
        stats.ranged_requests > ranged_before,
        "the partial file resumed with Range: {stats:?}"
    );
    let after_restart = stats.bytes_served - served_before;
    assert!(
        after_restart < size,
        "the restart fetched only what was missing: {after_restart} of {size} bytes (before the kill {served_before})"
    );
    assert!(d.log_text().contains("resuming partial download"));
}

#[test]
fn unsigned_stale_and_unknown_requests_are_refused_as_the_service_does() {
    let oci = TestOci::start(1000);
    oci.put_files("m", &model_files(7, 10));
    let env = TestEnv::new();
    let key = ApiKey::generate(&env.dir("keys"), "k");
    key.register(oci.server());
    let signer = SigningKey::from_pem(key.key_id(), &key.private_pem()).unwrap();
    let url = oci.running.url();
    let host = url.trim_start_matches("http://").to_string();
    let path = format!("/n/{NS}/b/{BUCKET}/o?prefix=m%2F");
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let send = |date: String, signer: &SigningKey| {
        let headers = signer.sign(&RequestToSign {
            method: "GET",
            path_and_query: &path,
            host: &host,
            date: &date,
            body: None,
        });
        rt.block_on(async {
            let mut req = reqwest::Client::new().get(format!("{url}{path}"));
            for (k, v) in headers {
                req = req.header(k, v);
            }
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            let body: serde_json::Value = r.json().await.unwrap();
            (status, body)
        })
    };
    let now = httpdate::fmt_http_date(std::time::SystemTime::now());
    let (status, body) = send(now.clone(), &signer);
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["objects"].as_array().unwrap().len(),
        model_files(7, 10).len()
    );
    let stale = httpdate::fmt_http_date(std::time::SystemTime::now() - Duration::from_secs(600));
    let (status, body) = send(stale, &signer);
    assert_eq!(status, 401);
    assert_eq!(body["code"], "NotAuthenticated");
    assert!(
        body["message"].as_str().unwrap().contains("clock"),
        "{body}"
    );
    let stranger = SigningKey::from_pem(
        "ocid1.tenancy.oc1..x/ocid1.user.oc1..y/00:11",
        &key.private_pem(),
    )
    .unwrap();
    let (status, body) = send(now, &stranger);
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("NotAuthenticated"))
    );
    let (status, body) = rt.block_on(async {
        let r = reqwest::Client::new()
            .get(format!("{url}{path}"))
            .send()
            .await
            .unwrap();
        (
            r.status().as_u16(),
            r.json::<serde_json::Value>().await.unwrap(),
        )
    });
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("NotAuthenticated"))
    );
}

/// A self-signed certificate with OCI's instance subject (tenancy in `OU=opc-tenant:`) and its
/// key, PEM.
fn instance_certificate(dir: &Path, name: &str) -> (String, String) {
    std::fs::create_dir_all(dir).unwrap();
    let cert = dir.join(format!("{name}.crt"));
    let key = dir.join(format!("{name}.key"));
    sh(&format!(
        "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -keyout {} -out {} -subj \
         '/CN=ocid1.instance.oc1..inst/OU=opc-certtype:instance/OU=opc-compartment:ocid1.compartment.oc1..c/OU=opc-tenant:{TENANCY}' 2>/dev/null",
        key.display(),
        cert.display()
    ));
    (
        std::fs::read_to_string(cert).unwrap(),
        std::fs::read_to_string(key).unwrap(),
    )
}

#[test]
fn instance_principal_federates_through_the_metadata_and_auth_services() {
    let oci = TestOci::start(1000);
    let files = model_files(8, 1 << 20);
    oci.put_files("ip", &files);
    let env = TestEnv::new();
    let (cert_pem, key_pem) = instance_certificate(&env.dir("ip"), "leaf");
    let (intermediate_pem, other_key_pem) = instance_certificate(&env.dir("ip"), "intermediate");
    oci.server().set_instance_identity(InstanceIdentity {
        cert_pem: cert_pem.clone(),
        key_pem: key_pem.clone(),
        intermediate_pem: intermediate_pem.clone(),
        region: "us-ashburn-1".into(),
    });
    let url = oci.running.url();
    let metadata = format!("{url}/opc/v2");
    let vars = [
        ("MODELFS_OCI_METADATA_ENDPOINT", metadata.as_str()),
        ("MODELFS_OCI_AUTH_ENDPOINT", url.as_str()),
    ];
    let d = start_daemon_with(&env, &oci, None, &vars);
    // No parameters at all: OME's default auth (InstancePrincipal), the instance's region.
    env.write_models(
        "ip.yaml",
        &format!(
            "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: ip\nspec:\n  storage:\n    storageUri: oci://n/{NS}/b/{BUCKET}/o/ip\n"
        ),
    );
    d.wait_model("clusterbasemodel.ip", "Ready");
    assert_tree(&env.mount.join("ip"), &files);
    let stats = oci.server().stats();
    assert!(
        stats.federations >= 1 && stats.metadata_requests >= 4,
        "{stats:?}"
    );
    assert_eq!(stats.refused_signatures, 0);

    // The metadata service hands out a key that is not the certificate's: the auth service
    // refuses the exchange, and the model fails with its reason and no key material.
    oci.server().set_instance_identity(InstanceIdentity {
        cert_pem,
        key_pem: other_key_pem.clone(),
        intermediate_pem,
        region: "us-ashburn-1".into(),
    });
    env.write_models(
        "ip2.yaml",
        &format!(
            "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: ip2\nspec:\n  storage:\n    storageUri: oci://n/{NS}/b/{BUCKET}/o/ip\n    parameters:\n      auth: InstancePrincipal\n"
        ),
    );
    let e = d.wait_model("clusterbasemodel.ip2", "Failed");
    let reason = e["reason"].as_str().unwrap();
    assert!(
        reason.contains("401") && reason.contains("NotAuthenticated"),
        "{reason}"
    );
    let log = d.log_text();
    let status = std::fs::read_to_string(env.state.join("status.json")).unwrap();
    for line in other_key_pem
        .lines()
        .chain(key_pem.lines())
        .filter(|l| !l.starts_with("-----"))
    {
        assert!(
            !log.contains(line) && !status.contains(line),
            "key material leaked"
        );
    }
    assert!(!log.contains("devsession"), "session tokens are not logged");
}

#[test]
fn oke_workload_identity_exchanges_the_service_account_token_at_the_proxymux() {
    let oci = TestOci::start(1000);
    let files = model_files(9, 1 << 20);
    oci.put_files("oke", &files);
    let env = TestEnv::new();
    let sa = env.dir("serviceaccount");
    let proxymux = oci.start_proxymux(&sa);
    let token = oci_common::service_account_token("modelfs", 3600);
    oci.server().set_oke_service_account_token(&token);
    let token_path = sa.join("token");
    std::fs::write(&token_path, &token).unwrap();
    let token_path = token_path.display().to_string();
    let ca = proxymux.ca_path.display().to_string();
    // As in an OKE pod: the API server's address, the service account files (here at
    // overridden paths), the region; nothing else names the proxymux.
    let vars = [
        ("KUBERNETES_SERVICE_HOST", proxymux.host.as_str()),
        (
            "OCI_KUBERNETES_SERVICE_ACCOUNT_TOKEN_PATH",
            token_path.as_str(),
        ),
        ("OCI_KUBERNETES_SERVICE_ACCOUNT_CERT_PATH", ca.as_str()),
        ("OCI_RESOURCE_PRINCIPAL_REGION", "us-ashburn-1"),
    ];
    let d = start_daemon_with(&env, &oci, None, &vars);
    let model = |name: &str| {
        format!(
            "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: {name}\nspec:\n  storage:\n    storageUri: oci://n/{NS}/b/{BUCKET}/o/oke\n    downloadPolicy: AlwaysDownload\n    parameters:\n      auth: OkeWorkloadIdentity\n"
        )
    };
    env.write_models("oke.yaml", &model("oke"));
    d.wait_model("clusterbasemodel.oke", "Ready");
    assert_tree(&env.mount.join("oke"), &files);
    let stats = oci.server().stats();
    assert!(
        stats.oke_exchanges >= 2,
        "one per resolve and per fetch: {stats:?}"
    );
    assert_eq!(
        stats.oke_pod_keys, stats.oke_exchanges,
        "a fresh session key for every exchange"
    );
    assert_eq!(stats.refused_signatures, 0);
    assert_eq!(stats.bytes_served, total(&files));

    // The pod's token is replaced by another pod's (kubelet rewrites the file; it is read for
    // every exchange): the proxymux refuses it and the model fails with its reason.
    let wrong = oci_common::service_account_token("intruder", 3600);
    std::fs::write(&token_path, &wrong).unwrap();
    env.write_models("oke2.yaml", &model("oke2"));
    let e = d.wait_model("clusterbasemodel.oke2", "Failed");
    let reason = e["reason"].as_str().unwrap();
    assert!(
        reason.contains("401")
            && reason.contains("NotAuthenticated")
            && reason.contains("The service account token was not accepted"),
        "the proxymux's reason: {reason}"
    );
    assert!(
        reason.contains(&proxymux.host),
        "names the proxymux: {reason}"
    );
    assert!(oci.server().stats().refused_signatures >= 1);
    assert_eq!(oci.server().stats().bytes_served, total(&files));

    // No token text anywhere the daemon writes: service account tokens (whole, or their
    // signature part) and the session tokens the proxymux issued (JWTs: `ST$eyJ...`).
    let log = d.log_text();
    let status = std::fs::read_to_string(env.state.join("status.json")).unwrap();
    let (_, api) = d.get("/v1/models");
    let metrics = d.metrics();
    for (what, text) in [
        ("log", &log),
        ("status.json", &status),
        ("/v1/models", &api),
        ("/metrics", &metrics),
    ] {
        for secret in [&token, &wrong] {
            let signature = secret.rsplit('.').next().unwrap();
            assert!(
                !text.contains(secret.as_str()) && !text.contains(signature),
                "a service account token in {what}"
            );
        }
        assert!(!text.contains("ST$eyJ"), "a session token in {what}");
    }
}

/// An object rewritten while it is downloaded, with the same size, is never stitched from the
/// two versions: every range carries `If-Match` with the listed ETag, the ranges asked after
/// the rewrite are refused (412), the download stops, and the model is listed again and
/// served with the new version's bytes only. The object is a multipart upload without
/// `opc-meta-md5`, so no digest would catch a stitched file: the pinning is all there is,
/// and the status says the file was checked by its size only.
#[test]
fn an_object_rewritten_mid_download_is_never_stitched() {
    let oci = TestOci::start(1000);
    let v1 = bytes(61, 10 << 20);
    let v2 = bytes(62, 10 << 20);
    let name = "rw/weights.bin";
    oci.server().put_object(
        NS,
        BUCKET,
        name,
        DevObject::multipart(v1.clone(), 1 << 20, false),
    );
    oci.server()
        .put_object(NS, BUCKET, "rw/config.json", DevObject::new(b"{}".to_vec()));
    oci.fault(
        FaultKind::Slow {
            bytes_per_sec: 1 << 20,
        },
        1_000_000,
        Some(name),
    );
    let env = TestEnv::new();
    let key = ApiKey::generate(&env.dir("keys"), "agent");
    key.register(oci.server());
    let d = start_daemon(&env, &oci, Some(&key.config_file(&env.dir("keys"))));
    env.write_models("m.yaml", &oci_model("rw", "rw", "AlwaysDownload", ""));
    d.wait_until(
        "a part of the first version downloaded",
        Duration::from_secs(60),
        |doc| {
            doc["clusterbasemodel.rw"]["progress"]["completedBytes"]
                .as_u64()
                .unwrap_or(0)
                > 2 << 20
        },
    );
    oci.server().put_object(
        NS,
        BUCKET,
        name,
        DevObject::multipart(v2.clone(), 1 << 20, false),
    );
    oci.server().clear_faults();
    let e = d.wait_model("clusterbasemodel.rw", "Ready");
    let served = std::fs::read(env.mount.join("rw/weights.bin")).unwrap();
    // On a busy machine every range may have been asked before the rewrite: then the old
    // version is served whole, which is as right. Never a mix of the two.
    assert!(
        served == v2 || served == v1,
        "the served file is neither version: {} of {} bytes are the new version's",
        served.iter().zip(&v2).filter(|(a, b)| a == b).count(),
        v2.len()
    );
    if served == v2 {
        assert!(
            d.log_text().contains("changed since it was listed"),
            "the rewrite was seen as such"
        );
    }
    assert_eq!(e["integrity"], "size-only", "{e}");
    assert_eq!(e["sizeOnlyFiles"], 1, "{e}");
}

/// A partial file whose bytes changed on disk while the agent was down (a torn write, a bad
/// sector, a stray write) is not resumed as it is: the segments whose recorded CRC32C no
/// longer matches are downloaded again, so even an object checked by its size only is served
/// with the bucket's bytes.
#[test]
fn a_corrupted_partial_file_is_downloaded_again_not_served() {
    let oci = TestOci::start(1000);
    let data = bytes(63, 24 << 20);
    let name = "part/weights.bin";
    oci.server().put_object(
        NS,
        BUCKET,
        name,
        DevObject::multipart(data.clone(), 1 << 20, false),
    );
    oci.fault(
        FaultKind::Slow {
            bytes_per_sec: 2 << 20,
        },
        1_000_000,
        Some(name),
    );
    let env = TestEnv::new();
    let key = ApiKey::generate(&env.dir("keys"), "agent");
    key.register(oci.server());
    let config = key.config_file(&env.dir("keys"));
    let d = start_daemon(&env, &oci, Some(&config));
    env.write_models("m.yaml", &oci_model("part", "part", "AlwaysDownload", ""));
    d.wait_until("half downloaded", Duration::from_secs(60), |doc| {
        doc["clusterbasemodel.part"]["progress"]["completedBytes"]
            .as_u64()
            .unwrap_or(0)
            > 12 << 20
    });
    d.kill9();
    let partial: Vec<PathBuf> = std::fs::read_dir(env.state.join("stores"))
        .unwrap()
        .flatten()
        .flat_map(|s| std::fs::read_dir(s.path().join("tmp")).unwrap().flatten())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "part"))
        .collect();
    assert_eq!(partial.len(), 1, "{partial:?}");
    let len = std::fs::metadata(&partial[0]).unwrap().len();
    assert!(len > 8 << 20, "a large prefix to resume: {len}");
    // One byte of the prefix changes on disk.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&partial[0])
            .unwrap();
        f.write_all_at(&[data[100] ^ 0xff], 100).unwrap();
    }
    oci.server().clear_faults();
    sh(&format!(
        "umount -l {} 2>/dev/null || true",
        env.mount.display()
    ));
    let d = start_daemon(&env, &oci, Some(&config));
    d.wait_model("clusterbasemodel.part", "Ready");
    let served = std::fs::read(env.mount.join("part/weights.bin")).unwrap();
    assert!(served == data, "the served file has the bucket's bytes");
    assert!(
        d.log_text().contains("downloaded again"),
        "the damaged prefix was cut, not resumed"
    );
}
