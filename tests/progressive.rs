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
use modelfs_devhub::hf::{FaultKind, HubFile};
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
