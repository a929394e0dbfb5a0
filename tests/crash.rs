//! Crash consistency (SPEC section 8.4): SIGKILL the daemon at random moments during imports, flips,
//! deletions and garbage collection, restart it, and check after every round that
//! * every Ready model serves exactly its artifact's bytes (section 8.1),
//! * no blob in use is missing and, after a GC pass, no store outlives its users (section 8.3),
//! * verified blobs were not written again (same inode before the crash and after recovery),
//! * the mount, status and records agree.
//!
//! Rounds: `MODELFS_CRASH_ROUNDS` (default 50); seed: `MODELFS_CRASH_SEED`.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use common::*;
use modelfs::source::local::LocalSource;

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
    let mut daemon = Daemon::start(&env, &[]);

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
        std::thread::sleep(Duration::from_millis(rng.below(250)));
        daemon.kill9();
        let before = blob_inodes(&env.state);

        daemon = Daemon::start(&env, &[]);
        let ctx = format!("round {round} (seed {seed}), desired {desired:?}");
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
}
