//! Property test of the policy state machine: the real reconciler and filesystem core (no FUSE),
//! random sequences of create / change policy / change revision / delete / crash, checked after
//! every step against the rules of SPEC section 3 (a small reference model of who may serve whom).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use modelfs_agent::metrics::Metrics;
use modelfs_agent::reconciler::{DesiredState, Reconciler, ReconcilerConfig, ReconcilerHandle};
use modelfs_agent::source::local::LocalSource;
use modelfs_core::store::StateDir;
use modelfs_mount::vfs::{FsCore, Kind, ROOT_INO};
use modelfs_ome::status::StatusDoc;
use modelfs_ome::{DownloadPolicy, ModelKey, ModelKind, ModelSpec, MountPath, SourceUri};
use proptest::prelude::*;

/// (namespace, name) of the models the tests play with: two cluster models, two BaseModels in
/// one namespace, one in another.
const MODELS: [(Option<&str>, &str); 5] = [
    (None, "c1"),
    (None, "c2"),
    (Some("ns-a"), "a1"),
    (Some("ns-a"), "a2"),
    (Some("ns-b"), "b1"),
];

#[derive(Clone, Debug)]
enum Op {
    /// Create or change model `model` to `policy` and revision `rev`; `crash` kills the daemon
    /// right after the change is handed over (mid-fetch or mid-flip).
    Put {
        model: usize,
        reuse: bool,
        rev: usize,
        crash: bool,
    },
    Delete {
        model: usize,
    },
    /// Kill and restart an idle daemon.
    Crash,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..MODELS.len(), any::<bool>(), 0..2usize, prop::bool::weighted(0.2))
            .prop_map(|(model, reuse, rev, crash)| Op::Put { model, reuse, rev, crash }),
        2 => (0..MODELS.len()).prop_map(|model| Op::Delete { model }),
        1 => Just(Op::Crash),
    ]
}

struct Life {
    runtime: tokio::runtime::Runtime,
    handle: ReconcilerHandle,
    fs: Arc<FsCore>,
    metrics: Arc<Metrics>,
}

impl Life {
    fn start(state: &Path) -> Life {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let fs = Arc::new(FsCore::new());
        let metrics = Arc::new(Metrics::new());
        let config = ReconcilerConfig {
            models_root_dir: PathBuf::from("/models"),
            gc_grace: Duration::ZERO,
            tick: Duration::from_millis(20),
            retry_base: Duration::from_millis(50),
            ..ReconcilerConfig::new(
                modelfs_agent::source::SourceConfig::new(
                    modelfs_agent::source::hf::HfConfig::default(),
                )
                .expect("HTTP clients"),
            )
        };
        let handle = {
            let _guard = runtime.enter();
            Reconciler::start(
                config,
                StateDir::open(state).unwrap(),
                fs.clone(),
                None,
                metrics.clone(),
            )
            .unwrap()
        };
        Life {
            runtime,
            handle,
            fs,
            metrics,
        }
    }

    /// As SIGKILL: tasks are dropped wherever they are; nothing is saved on the way out.
    fn crash(self) {
        self.runtime.shutdown_timeout(Duration::from_secs(10));
    }

    fn fetched_bytes(&self) -> f64 {
        self.metrics
            .encode()
            .lines()
            .filter(|l| l.starts_with("modelfs_fetched_bytes_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

fn key(i: usize) -> ModelKey {
    let (ns, name) = MODELS[i];
    let kind = if ns.is_some() {
        ModelKind::BaseModel
    } else {
        ModelKind::ClusterBaseModel
    };
    ModelKey::new(kind, ns, name).unwrap()
}

fn rel_path(i: usize) -> String {
    match MODELS[i] {
        (Some(ns), name) => format!("{ns}/{name}"),
        (None, name) => name.to_string(),
    }
}

fn spec(i: usize, reuse: bool, rev_dir: &Path) -> ModelSpec {
    let (ns, name) = MODELS[i];
    ModelSpec {
        key: key(i),
        kind: if ns.is_some() {
            ModelKind::BaseModel
        } else {
            ModelKind::ClusterBaseModel
        },
        name: name.to_string(),
        namespace: ns.map(str::to_string),
        source: SourceUri::Local {
            path: rev_dir.to_path_buf(),
        },
        policy: if reuse {
            DownloadPolicy::ReuseIfExists
        } else {
            DownloadPolicy::AlwaysDownload
        },
        path: MountPath::from_relative(&rel_path(i)).unwrap(),
        reserve_artifact: false,
        skip_config_parsing: false,
        serve_while_downloading: false,
        token_secret: None,
        parameters: BTreeMap::new(),
        labels: BTreeMap::new(),
        node_dir: None,
        shape: None,
    }
}

fn parent(doc: &StatusDoc, k: &str) -> String {
    doc[k].parent().unwrap_or_default().to_string()
}

fn namespace_of(k: &str) -> Option<&str> {
    k.split_once(".basemodel.").map(|(ns, _)| ns)
}

/// Reads every file of a model through the core and compares with the source directory. Every
/// lookup is forgotten afterwards, as the kernel does when it drops its cache entries (a held
/// lookup keeps an old slot, and so its store, in use).
fn verify_content(fs: &FsCore, rel: &str, src: &Path) -> Result<(), String> {
    let mut looked_up = Vec::new();
    let result = verify_content_inner(fs, rel, src, &mut looked_up);
    for ino in looked_up {
        fs.forget(ino, 1);
    }
    result
}

fn verify_content_inner(
    fs: &FsCore,
    rel: &str,
    src: &Path,
    looked_up: &mut Vec<u64>,
) -> Result<(), String> {
    let mut ino = ROOT_INO;
    for seg in rel.split('/') {
        ino = fs
            .lookup(ino, OsStr::new(seg))
            .map_err(|e| format!("{rel}: {e}"))?
            .ino;
        looked_up.push(ino);
    }
    let mut found = BTreeSet::new();
    let mut stack = vec![(ino, String::new())];
    while let Some((dir, prefix)) = stack.pop() {
        let mut entries = Vec::new();
        fs.readdir(dir, 2, |e| {
            entries.push(e);
            false
        })
        .map_err(|e| e.to_string())?;
        for e in entries {
            let p = if prefix.is_empty() {
                e.name.clone()
            } else {
                format!("{prefix}/{}", e.name)
            };
            let attr = fs
                .lookup(dir, OsStr::new(&e.name))
                .map_err(|err| format!("{p}: {err}"))?;
            looked_up.push(attr.ino);
            if attr.kind == Kind::Dir {
                stack.push((attr.ino, p));
                continue;
            }
            let (fh, _) = fs
                .open(attr.ino)
                .map_err(|err| format!("open {p}: {err}"))?;
            let data = fs
                .read(fh, 0, u32::MAX)
                .map_err(|err| format!("read {p}: {err}"))?;
            fs.release(fh);
            let want = std::fs::read(src.join(&p)).map_err(|err| format!("{p}: {err}"))?;
            if data != want {
                return Err(format!("{rel}/{p}: wrong bytes"));
            }
            found.insert(p);
        }
    }
    let mut want = BTreeSet::new();
    for e in std::fs::read_dir(src).unwrap().flatten() {
        want.insert(e.file_name().to_string_lossy().into_owned());
    }
    if found != want {
        return Err(format!("{rel}: files {found:?}, want {want:?}"));
    }
    Ok(())
}

fn stores_with_blobs(state: &Path) -> usize {
    std::fs::read_dir(state.join("stores"))
        .map(|rd| {
            rd.flatten()
                .filter(|e| {
                    std::fs::read_dir(e.path().join("blobs"))
                        .map(|mut r| r.next().is_some())
                        .unwrap_or(false)
                })
                .count()
        })
        .unwrap_or(0)
}

struct World {
    _dir: tempfile::TempDir,
    state: PathBuf,
    revs: Vec<PathBuf>,
    digests: Vec<String>,
    /// Model index -> (reuse, rev).
    desired: BTreeMap<usize, (bool, usize)>,
}

impl World {
    fn new() -> World {
        let dir = tempfile::tempdir().unwrap();
        let mut revs = Vec::new();
        let mut digests = Vec::new();
        for r in 0..2 {
            let d = dir.path().join(format!("rev{r}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("shared.bin"), vec![7u8; 300_000]).unwrap();
            std::fs::write(d.join("config.json"), format!("{{\"revision\": {r}}}")).unwrap();
            std::fs::write(
                d.join(format!("only-rev{r}.bin")),
                vec![r as u8; 100_000 + r],
            )
            .unwrap();
            let m = LocalSource::new(d.clone())
                .resolve(&AtomicBool::new(false))
                .unwrap();
            digests.push(m.id().to_string());
            revs.push(d);
        }
        let state = dir.path().join("state");
        World {
            _dir: dir,
            state,
            revs,
            digests,
            desired: BTreeMap::new(),
        }
    }

    fn desired_state(&self) -> DesiredState {
        let mut d = DesiredState::default();
        for (i, (reuse, rev)) in &self.desired {
            d.models
                .insert(key(*i), Ok(spec(*i, *reuse, &self.revs[*rev])));
        }
        d
    }

    /// Waits until every desired model is Ready with the right artifact, nothing else is
    /// listed, and garbage collection has caught up (one store per parent).
    fn settle(&self, life: &Life) -> Result<Arc<StatusDoc>, String> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let doc = life.handle.status();
            let ok_models = self.desired.iter().all(|(i, (reuse, rev))| {
                let policy = if *reuse {
                    "ReuseIfExists"
                } else {
                    "AlwaysDownload"
                };
                doc.get(key(*i).as_str()).is_some_and(|e| {
                    e.status == "Ready"
                        && e.policy == policy
                        && e.digest.as_deref() == Some(self.digests[*rev].as_str())
                })
            }) && doc.len() == self.desired.len();
            if ok_models {
                let parents: BTreeSet<String> = doc.keys().map(|k| parent(&doc, k)).collect();
                if stores_with_blobs(&self.state) == parents.len() {
                    return Ok(doc);
                }
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "did not settle: desired {:?}\nstatus {}\nstores with blobs {}",
                    self.desired,
                    serde_json::to_string_pretty(&*doc).unwrap(),
                    stores_with_blobs(&self.state)
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The rules of SPEC section 3 that hold in any settled state.
    fn check(&self, life: &Life, doc: &StatusDoc) -> Result<(), String> {
        for (i, (reuse, rev)) in &self.desired {
            let k = key(*i).to_string();
            let p = parent(doc, &k);
            if !reuse && p != k {
                return Err(format!("{k} is AlwaysDownload but served from {p}"));
            }
            if p != k {
                let pe = doc
                    .get(&p)
                    .ok_or(format!("{k}: parent {p} does not exist"))?;
                if parent(doc, &p) != p {
                    return Err(format!("chain: {k} -> {p} -> {}", parent(doc, &p)));
                }
                if pe.digest != doc[&k].digest {
                    return Err(format!("{k} and its parent {p} hold different artifacts"));
                }
                if let Some(pns) = namespace_of(&p) {
                    if namespace_of(&k) != Some(pns) {
                        return Err(format!("{k} reuses {p} outside its scope"));
                    }
                }
            }
            let kids: BTreeSet<String> = doc[&k]
                .config
                .artifact
                .children_paths
                .iter()
                .cloned()
                .collect();
            let want: BTreeSet<String> = doc
                .keys()
                .filter(|c| **c != k && parent(doc, c) == k)
                .map(|c| doc[c].path.clone())
                .collect();
            if kids != want {
                return Err(format!("{k}: childrenPaths {kids:?}, want {want:?}"));
            }
            verify_content(&life.fs, &rel_path(*i), &self.revs[*rev])?;
        }
        Ok(())
    }
}

fn holders_in_scope(doc: &StatusDoc, k: &str, digest: &str) -> bool {
    doc.iter().any(|(h, e)| {
        h != k
            && parent(doc, h) == *h
            && e.status == "Ready"
            && e.digest.as_deref() == Some(digest)
            && namespace_of(h).is_none_or(|hns| namespace_of(k) == Some(hns))
    })
}

fn run(ops: Vec<Op>) -> Result<(), String> {
    if std::env::var_os("MODELFS_TEST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter("modelfs=debug")
            .with_test_writer()
            .try_init();
    }
    let mut world = World::new();
    let mut life = Life::start(&world.state);
    life.handle.set_desired(world.desired_state());
    let mut doc = world.settle(&life)?;
    for op in ops {
        match op {
            Op::Put {
                model,
                reuse,
                rev,
                crash,
            } => {
                let k = key(model).to_string();
                // Placement runs when a model is created or its spec changes (SPEC section 3.1, section 3.2);
                // re-applying the same spec is no operation.
                let changed = world.desired.get(&model) != Some(&(reuse, rev));
                let expect_child =
                    changed && reuse && holders_in_scope(&doc, &k, &world.digests[rev]);
                world.desired.insert(model, (reuse, rev));
                life.handle.set_desired(world.desired_state());
                if crash {
                    std::thread::sleep(Duration::from_millis(5));
                    life.crash();
                    life = Life::start(&world.state);
                    life.handle.set_desired(world.desired_state());
                }
                doc = world.settle(&life)?;
                if expect_child && !crash && parent(&doc, &k) == k {
                    return Err(format!(
                        "{k}: ReuseIfExists with an in-scope holder, but downloaded its own copy"
                    ));
                }
            }
            Op::Delete { model } => {
                world.desired.remove(&model);
                life.handle.set_desired(world.desired_state());
                doc = world.settle(&life)?;
            }
            Op::Crash => {
                let before = doc.clone();
                life.crash();
                life = Life::start(&world.state);
                life.handle.set_desired(world.desired_state());
                doc = world.settle(&life)?;
                if life.fetched_bytes() != 0.0 {
                    return Err("an idle restart fetched data again".into());
                }
                for k in before.keys() {
                    if parent(&before, k) != parent(&doc, k) {
                        return Err(format!("{k}: parent changed across a restart"));
                    }
                }
            }
        }
        world.check(&life, &doc)?;
    }
    life.crash();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("MODELFS_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64),
        max_shrink_iters: 64,
        ..ProptestConfig::default()
    })]
    #[test]
    fn policy_state_machine_follows_the_rules(ops in prop::collection::vec(op(), 1..10)) {
        if let Err(e) = run(ops) {
            prop_assert!(false, "{}", e);
        }
    }
}

/// A model recorded Failed before a restart gets a fresh attempt after it: pending retries are
/// not durable, so without that it would stay Failed until its spec changed.
#[test]
fn a_failed_model_is_tried_again_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let src = dir.path().join("appears-later");
    let mut desired = DesiredState::default();
    desired.models.insert(key(0), Ok(spec(0, false, &src)));

    let life = Life::start(&state);
    life.handle.set_desired(desired.clone());
    let deadline = Instant::now() + Duration::from_secs(15);
    while life
        .handle
        .status()
        .get(key(0).as_str())
        .is_none_or(|e| e.status != "Failed")
    {
        assert!(Instant::now() < deadline, "never failed");
        std::thread::sleep(Duration::from_millis(20));
    }
    life.crash();

    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("weights.bin"), b"finally here").unwrap();
    let life = Life::start(&state);
    life.handle.set_desired(desired);
    let deadline = Instant::now() + Duration::from_secs(15);
    while life
        .handle
        .status()
        .get(key(0).as_str())
        .is_none_or(|e| e.status != "Ready")
    {
        assert!(
            Instant::now() < deadline,
            "not retried after restart: {:?}",
            life.handle.status().get(key(0).as_str())
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    verify_content(&life.fs, &rel_path(0), &src).unwrap();
    life.crash();
}
