//! Crash consistency (SPEC section 8.4): SIGKILL the daemon at random moments during imports, flips,
//! deletions and garbage collection, restart it, and check after every round that
//! * every Ready model serves exactly its artifact's bytes (section 8.1),
//! * no blob in use is missing and, after a GC pass, no store outlives its users (section 8.3),
//! * verified blobs were not written again (same inode before the crash and after recovery),
//! * the mount, status and records agree.
//!
//! A SIGKILL loses no written byte (the page cache survives the process), so each crash is also
//! made a power cut: the daemon logs every store `syncfs` (`MODELFS_SYNC_LOG`, see
//! `modelfs_core::store::fsutil::log_syncfs`), and after the kill every store file written after the
//! latest logged sync began loses its bytes (zero-filled, size kept, the worst a filesystem may
//! show). The imports stage many small files and publish them in batches with one sync, so the
//! kills land between blob writes and the batched sync; no name in `blobs/` may hold lost bytes,
//! and every Ready model must still serve exactly its artifact.
//!
//! Rounds: `MODELFS_CRASH_ROUNDS` (default 50); seed: `MODELFS_CRASH_SEED`.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use common::*;
use modelfs_agent::source::local::LocalSource;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// (file name, YAML builder) of the models in play: two cluster models and two BaseModels.
const MODELS: [(&str, Option<&str>, &str); 4] = [
    ("c1.yaml", None, "c1"),
    ("c2.yaml", None, "c2"),
    ("a1.yaml", Some("ns-a"), "a1"),
    ("b1.yaml", Some("ns-b"), "b1"),
];

fn key(i: usize) -> String {
    match MODELS[i] {
        (_, Some(ns), name) => format!("{ns}.basemodel.{name}"),
        (_, None, name) => format!("clusterbasemodel.{name}"),
    }
}

fn mount_rel(i: usize) -> String {
    match MODELS[i] {
        (_, Some(ns), name) => format!("{ns}/{name}"),
        (_, None, name) => name.to_string(),
    }
}

fn yaml(i: usize, reuse: bool, src: &Path) -> String {
    let policy = if reuse {
        "ReuseIfExists"
    } else {
        "AlwaysDownload"
    };
    let uri = format!("local://{}", src.display());
    match MODELS[i] {
        (_, Some(ns), name) => base_model(ns, name, &uri, policy, None),
        (_, None, name) => cluster_model(name, &uri, policy, None),
    }
}

/// (store, blob name) -> inode of every blob on disk.
fn blob_inodes(state: &Path) -> BTreeMap<(String, String), u64> {
    let mut out = BTreeMap::new();
    let Ok(stores) = std::fs::read_dir(state.join("stores")) else {
        return out;
    };
    for s in stores.flatten() {
        let Ok(blobs) = std::fs::read_dir(s.path().join("blobs")) else {
            continue;
        };
        for b in blobs.flatten() {
            if let Ok(m) = b.metadata() {
                out.insert(
                    (
                        s.file_name().to_string_lossy().into_owned(),
                        b.file_name().to_string_lossy().into_owned(),
                    ),
                    m.ino(),
                );
            }
        }
    }
    out
}

/// Unix nanoseconds at which the latest completed store sync began (0: none yet).
fn last_sync_start(log: &Path) -> u128 {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("syncfs ")?.parse().ok())
        .max()
        .unwrap_or(0)
}

/// Simulates a power cut after a crash: every file of `blobs/` and `tmp/` of every store whose
/// bytes were written after the latest sync began (`mtime` at or after it) is zero-filled, size
/// kept. Hard-linked files (linked from blobs published earlier) are left alone. Returns the
/// zero-filled files (store, dir, name).
fn lose_unsynced_bytes(state: &Path, synced_before: u128) -> Vec<(String, String, String)> {
    let mut lost = Vec::new();
    let Ok(stores) = std::fs::read_dir(state.join("stores")) else {
        return lost;
    };
    for store in stores.flatten() {
        for dir in ["blobs", "tmp"] {
            let Ok(files) = std::fs::read_dir(store.path().join(dir)) else {
                continue;
            };
            for file in files.flatten() {
                let Ok(meta) = file.metadata() else { continue };
                let mtime = meta.mtime() as i128 * 1_000_000_000 + meta.mtime_nsec() as i128;
                if !meta.is_file()
                    || meta.nlink() > 1
                    || meta.len() == 0
                    || mtime < synced_before as i128
                {
                    continue;
                }
                std::fs::write(file.path(), vec![0u8; meta.len() as usize]).unwrap();
                lost.push((
                    store.file_name().to_string_lossy().into_owned(),
                    dir.to_string(),
                    file.file_name().to_string_lossy().into_owned(),
                ));
            }
        }
    }
    lost
}

/// Waits until some store's `tmp/` holds a file (an import is staging), at most `limit`.
fn wait_for_staged_files(state: &Path, limit: Duration) {
    let staging = || {
        std::fs::read_dir(state.join("stores")).is_ok_and(|stores| {
            stores.flatten().any(|s| {
                std::fs::read_dir(s.path().join("tmp")).is_ok_and(|mut t| t.next().is_some())
            })
        })
    };
    let deadline = std::time::Instant::now() + limit;
    while !staging() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Every blob of every store has the bytes its name (sha256) says (blobs removed meanwhile by
/// garbage collection are skipped).
fn assert_blobs_match_their_names(state: &Path, ctx: &str) {
    use sha2::{Digest, Sha256};
    for store in std::fs::read_dir(state.join("stores")).unwrap().flatten() {
        let Ok(blobs) = std::fs::read_dir(store.path().join("blobs")) else {
            continue;
        };
        for blob in blobs.flatten() {
            // Garbage collection may remove an unused blob meanwhile.
            let bytes = match std::fs::read(blob.path()) {
                Ok(bytes) => bytes,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => panic!("{ctx}: reading {}: {e}", blob.path().display()),
            };
            assert_eq!(
                hex::encode(Sha256::digest(&bytes)),
                blob.file_name().to_string_lossy(),
                "{ctx}: blob {} holds other bytes than its name says",
                blob.path().display()
            );
        }
    }
}

fn parent(doc: &serde_json::Value, k: &str) -> String {
    doc[k]["config"]["artifact"]["parentPath"]
        .as_object()
        .and_then(|o| o.keys().next().cloned())
        .unwrap_or_default()
}

#[test]
fn sigkill_at_random_moments_leaves_a_consistent_state() {
    let rounds: usize = std::env::var("MODELFS_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let seed: u64 = std::env::var("MODELFS_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_1234);
    eprintln!("crash harness: {rounds} rounds, seed {seed}");
    let mut rng = Rng(seed | 1);
    let env = TestEnv::new();
    // Three revisions sharing some files; big enough that imports take a few tens of ms.
    let revs: Vec<PathBuf> = (0..3)
        .map(|r| {
            let d = env.dir(&format!("rev{r}"));
            make_model_dir(&d, 40, 6 << 20);
            std::fs::write(d.join("config.json"), format!("{{\"rev\": {r}}}")).unwrap();
            // Many small files: the import stages them and publishes them in batches.
            for i in 0..400u64 {
                let sub = d.join(format!("small/{}", i / 100));
                std::fs::create_dir_all(&sub).unwrap();
                let shared = i % 3 != 0; // two thirds the same in every revision
                let seed = if shared {
                    7000 + i
                } else {
                    9000 + 1000 * r as u64 + i
                };
                std::fs::write(
                    sub.join(format!("{i}.txt")),
                    bytes(seed, 1 + (i as usize * 37) % 3000),
                )
                .unwrap();
            }
            std::fs::write(
                d.join(format!("rev{r}.bin")),
                bytes(r as u64 + 500, (r + 1) << 19),
            )
            .unwrap();
            d
        })
        .collect();
    let digests: Vec<String> = revs
        .iter()
        .map(|d| {
            LocalSource::new(d.clone())
                .resolve(&AtomicBool::new(false))
                .unwrap()
                .id()
                .to_string()
        })
        .collect();
    type Files = Vec<(String, u64, String)>;
    let expected: Vec<Files> = revs.iter().map(|d| contents(d)).collect();
    let mut desired: BTreeMap<usize, (bool, usize)> = BTreeMap::new();
    let sync_log = env.dir("sync-log").join("log");
    let sync_log_var = sync_log.to_str().unwrap().to_string();
    let start = || Daemon::start_with_env(&env, &[], &[("MODELFS_SYNC_LOG", &sync_log_var)]);
    let mut daemon = start();
    let mut rounds_with_lost_staged_bytes = 0;

    for round in 0..rounds {
        // One change, then a kill somewhere inside its handling (or after it, during GC).
        let i = rng.below(MODELS.len() as u64) as usize;
        if desired.contains_key(&i) && rng.below(4) == 0 {
            desired.remove(&i);
            env.remove_models(MODELS[i].0);
        } else {
            let (reuse, rev) = (rng.below(2) == 0, rng.below(3) as usize);
            desired.insert(i, (reuse, rev));
            env.write_models(MODELS[i].0, &yaml(i, reuse, &revs[rev]));
        }
        if rng.below(2) == 0 {
            // Into an import: once files are being staged (if this change imports anything).
            wait_for_staged_files(&env.state, Duration::from_secs(2));
            std::thread::sleep(Duration::from_millis(rng.below(300)));
        } else {
            std::thread::sleep(Duration::from_millis(rng.below(250)));
        }
        daemon.kill9();
        let ctx = format!("round {round} (seed {seed}), desired {desired:?}");
        let lost = lose_unsynced_bytes(&env.state, last_sync_start(&sync_log));
        let lost_published: Vec<_> = lost.iter().filter(|(_, dir, _)| dir == "blobs").collect();
        assert!(
            lost_published.is_empty(),
            "{ctx}: {} published blobs whose bytes were not synced, such as {:?}",
            lost_published.len(),
            &lost_published[..lost_published.len().min(3)]
        );
        if !lost.is_empty() {
            rounds_with_lost_staged_bytes += 1;
        }
        let before = blob_inodes(&env.state);

        daemon = start();
        let doc = daemon.wait_until(&format!("settled: {ctx}"), Duration::from_secs(60), |s| {
            let models_ok = desired.iter().all(|(i, (reuse, rev))| {
                let e = &s[key(*i)];
                e["status"] == "Ready"
                    && e["policy"]
                        == if *reuse {
                            "ReuseIfExists"
                        } else {
                            "AlwaysDownload"
                        }
                    && e["digest"] == digests[*rev].as_str()
            });
            models_ok && s.as_object().is_some_and(|o| o.len() == desired.len())
        });

        // section 8.1: every Ready model serves its artifact's bytes.
        for (i, (reuse, rev)) in &desired {
            let k = key(*i);
            let got: Files = contents(&env.mount.join(mount_rel(*i)));
            assert_eq!(got, expected[*rev], "{ctx}: {k} serves wrong content");
            let p = parent(&doc, &k);
            assert!(
                *reuse || p == k,
                "{ctx}: AlwaysDownload {k} served from {p}"
            );
            assert_eq!(parent(&doc, &p), p, "{ctx}: chain {k} -> {p}");
        }
        assert_blobs_match_their_names(&env.state, &ctx);
        // Verified blobs are never written again.
        let after = blob_inodes(&env.state);
        for (blob, ino) in &before {
            if let Some(now) = after.get(blob) {
                assert_eq!(
                    now, ino,
                    "{ctx}: blob {blob:?} was written again after the crash"
                );
            }
        }
        // section 8.3: after a GC pass, one store per parent and nothing else.
        let parents: std::collections::BTreeSet<String> =
            desired.keys().map(|i| parent(&doc, &key(*i))).collect();
        daemon.wait_until(
            &format!("garbage collected: {ctx}"),
            Duration::from_secs(30),
            |_| {
                env.stores_with_blobs().len() == parents.len()
                    && std::fs::read_dir(env.state.join("stores"))
                        .map(|r| r.count())
                        .unwrap_or(0)
                        == parents.len()
            },
        );
    }
    assert!(daemon.stop(), "clean shutdown after the last round");
    eprintln!(
        "crash harness: {rounds_with_lost_staged_bytes} of {rounds} crashes came between staged \
         writes and their sync"
    );
}
