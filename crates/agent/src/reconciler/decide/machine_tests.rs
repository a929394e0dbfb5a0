//! Tests of the state machine ([`Machine::step`]): one table with a case per row of the
//! transition table in the module docs of [`super`], and a property test that drives the
//! machine with random event sequences (a small executor answering its effects at once) and
//! checks the invariants of SPEC section 8 that the decisions carry after every step.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::tests::{art, key};
use super::*;
use crate::reconciler::records::{ModelPhase, Records, RecordsIndex};
use modelfs_ome::DownloadPolicy::{self, AlwaysDownload as Always, ReuseIfExists as Reuse};

const BASE: Duration = Duration::from_secs(2);
const MAX: Duration = Duration::from_secs(300);

/// A machine and its clock; `jitter` 1.0 gives the longest delays, so the tables read whole
/// numbers.
struct Rig {
    m: Machine,
    t0: Instant,
    now: Instant,
}

impl Rig {
    fn new() -> Self {
        let t0 = Instant::now();
        Self {
            m: Machine::new(Records::default(), BASE, MAX),
            t0,
            now: t0,
        }
    }

    fn clock(&self) -> Clock {
        Clock {
            now: self.now,
            jitter: 1.0,
        }
    }

    fn step(&mut self, event: Event) -> Vec<Effect> {
        let clock = self.clock();
        self.m.step(event, clock)
    }

    /// The spec of model `name` (served at its name unless `path`), as the executor reports
    /// it.
    fn put(&mut self, name: &str, path: &str, policy: DownloadPolicy, rev: u8) -> Vec<Effect> {
        let event = Event::Spec {
            key: key(name),
            spec: summary(name, path, policy, rev),
            in_cache_view: false,
        };
        self.step(event)
    }

    /// `name`'s work failed with a transient error (an HTTP 503).
    fn fail_transient(&mut self, name: &str) -> Vec<Effect> {
        self.step(Event::Failed {
            key: key(name),
            reason: "503".into(),
            retry: RetryKind::Transient,
        })
    }

    /// `put`, then what the executor does for `Start`: the path rule before work, then a
    /// resolve.
    fn start(&mut self, name: &str, path: &str, policy: DownloadPolicy, rev: u8) -> Vec<Effect> {
        let mut out = self.put(name, path, policy, rev);
        if out.iter().any(|e| matches!(e, Effect::Start { .. })) {
            out.extend(self.step(Event::Starting {
                key: key(name),
                path: MountPath::from_relative(path).unwrap(),
                observed: Observed::default(),
            }));
            if !out.iter().any(|e| matches!(e, Effect::LosePath { .. })) {
                self.step(Event::Resolving {
                    key: key(name),
                    source: source(name),
                    refresh: false,
                });
            }
        }
        out
    }

    fn known(&mut self, name: &str, path: &str, policy: DownloadPolicy, a: u8) -> Vec<Effect> {
        let event = Event::ArtifactKnown {
            key: key(name),
            want: want(name, path, policy, a),
            space: None,
        };
        self.step(event)
    }

    /// The fetch of `name`'s artifact `a` into `store` completed.
    fn fetched(&mut self, name: &str, path: &str, policy: DownloadPolicy, a: u8) -> Vec<Effect> {
        let Some(Phase::Fetching { store, .. }) = self.m.phase(&key(name)).cloned() else {
            panic!("{name} is not fetching");
        };
        let event = Event::Fetched {
            key: key(name),
            store,
            artifact: art(a),
            want: Some(want(name, path, policy, a)),
        };
        self.step(event)
    }

    /// A model served from its own store (created, resolved, fetched).
    fn serving(&mut self, name: &str, path: &str, policy: DownloadPolicy, a: u8) {
        self.start(name, path, policy, a);
        self.known(name, path, policy, a);
        self.fetched(name, path, policy, a);
        assert_eq!(self.state(name), "serving", "setup of {name}");
    }

    /// The model's lifecycle state as the table writes it.
    fn state(&self, name: &str) -> String {
        let k = key(name);
        let Some(rec) = self.m.records.models().get(&k) else {
            return "absent".into();
        };
        match self.m.phase(&k) {
            Some(Phase::Resolving { refresh: true, .. }) => return "serving, re-resolving".into(),
            Some(Phase::Resolving { .. }) => return "resolving".into(),
            Some(Phase::Waiting { on, .. }) => return format!("waiting on {}", short(on)),
            Some(Phase::Fetching { .. }) => return "fetching".into(),
            None => {}
        }
        match rec.phase {
            ModelPhase::Ready => "serving".into(),
            ModelPhase::Updating => "updating".into(),
            ModelPhase::Failed if rec.fingerprint.starts_with("invalid:") => "invalid".into(),
            ModelPhase::Failed if self.m.is_loser(&k) => "loser".into(),
            ModelPhase::Failed => match self.m.retry_of(&k) {
                Some(r) if r.at > self.now + Duration::from_secs(3600 * 24 * 365) => {
                    "failed, parked".into()
                }
                Some(r) => format!(
                    "failed, retry {} at +{}s",
                    r.attempts,
                    r.at.duration_since(self.t0).as_secs()
                ),
                None => "failed".into(),
            },
        }
    }
}

fn short(k: &ModelKey) -> String {
    k.as_str()
        .strip_prefix("clusterbasemodel.")
        .unwrap_or(k.as_str())
        .to_string()
}

fn source(name: &str) -> String {
    format!("hf://org/{name}")
}

fn summary(name: &str, path: &str, policy: DownloadPolicy, rev: u8) -> SpecSummary {
    SpecSummary {
        fingerprint: format!("{name}:{path}:{}:{rev}", policy.as_str()),
        name: name.to_string(),
        namespace: None,
        source: source(name),
        policy,
        path: path.to_string(),
        reserve: false,
    }
}

fn want(name: &str, path: &str, policy: DownloadPolicy, a: u8) -> Want {
    Want {
        policy,
        artifact: art(a),
        sha: format!("rev{a}"),
        path: MountPath::from_relative(path).unwrap(),
        source: source(name),
        parameters: None,
    }
}

/// Effects as the table writes them (store ids and reasons shortened).
fn effects_text(effects: &[Effect]) -> String {
    let texts: Vec<String> = effects
        .iter()
        .map(|e| match e {
            Effect::SaveRecords => "save".into(),
            Effect::LinkStore(_) => "link".into(),
            Effect::Fetch { key, .. } => format!("fetch {}", short(key)),
            Effect::Wait { key, on, .. } => format!("{} waits for {}", short(key), short(on)),
            Effect::LosePath { key, .. } => format!("{} loses the path", short(key)),
            Effect::Served { key, .. } => format!("{} served", short(key)),
            Effect::Remap => "remap".into(),
            Effect::Fail { key, retry, .. } => format!("{} fails {retry:?}", short(key)),
            Effect::Forgotten { .. } => "forgotten".into(),
            Effect::Turn { key } => format!("{} turn", short(key)),
            Effect::Stop { key } => format!("{} stops", short(key)),
            Effect::Start { key, new } => {
                format!("{} starts{}", short(key), if *new { " (new)" } else { "" })
            }
            Effect::Invalid { key, .. } => format!("{} invalid", short(key)),
            Effect::Retry { key } => format!("{} retries", short(key)),
            Effect::Refresh { key } => format!("{} refreshes", short(key)),
            Effect::Wake { key } => format!("{} wakes", short(key)),
            Effect::Current { key } => format!("{} current", short(key)),
            Effect::Resolve { key } => format!("{} resolves", short(key)),
            Effect::FilesElsewhere { key } => format!("{} files elsewhere", short(key)),
        })
        .collect();
    texts.join(", ")
}

/// One row of the transition table: `setup` brings model `m` (and others) to the row's phase,
/// `event` is the row's event; after it, `m` is in `then` and the effects are `effects`.
struct Row {
    row: &'static str,
    setup: fn(&mut Rig),
    event: fn(&mut Rig) -> Vec<Effect>,
    then: &'static str,
    effects: &'static str,
}

/// The disk check's question: which models are parked for space. A refusal parks the model
/// until a retry made due by `SpaceFits` starts work; another failure, a fetch that fails on a
/// full disk, and a change of spec each answer it anew.
#[test]
fn parked_for_space_follows_the_retry_not_the_reason() {
    let mut r = Rig::new();
    let m = key("m");
    let refuse = |r: &mut Rig| {
        r.step(Event::ArtifactKnown {
            key: key("m"),
            want: want("m", "m", Always, 1),
            space: Some(Space {
                free: 10,
                needed: 20,
            }),
        })
    };
    r.start("m", "m", Always, 1);
    assert!(!r.m.parked_for_space(&m), "resolving");
    refuse(&mut r);
    assert!(r.m.parked_for_space(&m), "refused for space");
    r.step(Event::SpaceFits {
        keys: vec![m.clone()],
    });
    assert!(r.m.parked_for_space(&m), "due, its retry not started yet");
    let retries = r.step(Event::TimePassed);
    assert_eq!(effects_text(&retries), "m retries");
    r.start("m", "m", Always, 1);
    assert!(!r.m.parked_for_space(&m), "its retry resolves");
    r.step(Event::Failed {
        key: m.clone(),
        reason: "InsufficientStorage: only the text says so".into(),
        retry: RetryKind::Transient,
    });
    assert!(
        !r.m.parked_for_space(&m),
        "a transient failure, whatever its reason says"
    );
    r.now += Duration::from_secs(60);
    r.start("m", "m", Always, 1);
    r.known("m", "m", Always, 1);
    r.step(Event::Failed {
        key: m.clone(),
        reason: "disk full".into(),
        retry: RetryKind::DiskFull { needed: 5 },
    });
    assert!(r.m.parked_for_space(&m), "its fetch hit a full disk");
    r.start("m", "m", Always, 2);
    assert!(!r.m.parked_for_space(&m), "its spec changed");
}

#[test]
fn transition_table() {
    let rows = [
        Row {
            row: "absent + Spec",
            setup: |_| {},
            event: |r| r.put("m", "m", Always, 1),
            then: "updating",
            effects: "m starts (new)",
        },
        Row {
            row: "updating + Starting (path clear)",
            setup: |r| {
                r.put("m", "m", Always, 1);
            },
            event: |r| {
                r.step(Event::Starting {
                    key: key("m"),
                    path: MountPath::from_relative("m").unwrap(),
                    observed: Observed::default(),
                })
            },
            then: "updating",
            effects: "m resolves",
        },
        Row {
            row: "updating + Starting (nests with an earlier model)",
            setup: |r| {
                r.serving("a", "a", Always, 1);
                r.put("m", "a/m", Always, 2);
            },
            event: |r| {
                r.step(Event::Starting {
                    key: key("m"),
                    path: MountPath::from_relative("a/m").unwrap(),
                    observed: Observed::default(),
                })
            },
            then: "loser",
            effects: "m loses the path",
        },
        Row {
            row: "updating + Starting (files elsewhere)",
            setup: |r| {
                r.put("m", "m", Always, 1);
            },
            event: |r| {
                r.step(Event::Starting {
                    key: key("m"),
                    path: MountPath::from_relative("m").unwrap(),
                    observed: Observed {
                        source: "vendor://x".into(),
                        files: Files::Elsewhere { missing: None },
                        cache_view_conflict: None,
                    },
                })
            },
            then: "serving",
            effects: "m stops, remap, m files elsewhere",
        },
        Row {
            row: "updating + Starting (files elsewhere, the node directory missing)",
            setup: |r| {
                r.put("m", "m", Always, 1);
            },
            event: |r| {
                let missing = Failure {
                    reason: "node directory missing".into(),
                    retry: RetryKind::Transient,
                };
                r.step(Event::Starting {
                    key: key("m"),
                    path: MountPath::from_relative("m").unwrap(),
                    observed: Observed {
                        source: "local:///node/m".into(),
                        files: Files::Elsewhere {
                            missing: Some(missing),
                        },
                        // Files elsewhere come first: the cache view does not matter.
                        cache_view_conflict: Some("in the cache view".into()),
                    },
                })
            },
            then: "failed, retry 1 at +4s",
            effects: "m fails Transient",
        },
        Row {
            row: "updating + Starting (its path in the cache view)",
            setup: |r| {
                r.put("m", "m", Always, 1);
            },
            event: |r| {
                r.step(Event::Starting {
                    key: key("m"),
                    path: MountPath::from_relative("m").unwrap(),
                    observed: Observed {
                        source: source("m"),
                        files: Files::Mount,
                        cache_view_conflict: Some("in the cache view".into()),
                    },
                })
            },
            then: "failed",
            effects: "m fails Permanent",
        },
        Row {
            row: "updating + Resolving",
            setup: |r| {
                r.put("m", "m", Always, 1);
            },
            event: |r| {
                r.step(Event::Resolving {
                    key: key("m"),
                    source: source("m"),
                    refresh: false,
                })
            },
            then: "resolving",
            effects: "",
        },
        Row {
            row: "resolving + ArtifactKnown (no holder)",
            setup: |r| {
                r.start("m", "m", Always, 1);
            },
            event: |r| r.known("m", "m", Always, 1),
            then: "fetching",
            effects: "save, fetch m",
        },
        Row {
            row: "resolving + ArtifactKnown (a Ready holder in scope, reuse)",
            setup: |r| {
                r.serving("a", "a", Always, 1);
                r.start("m", "m", Reuse, 1);
            },
            event: |r| r.known("m", "m", Reuse, 1),
            then: "serving",
            effects: "m served, remap",
        },
        Row {
            row: "resolving + ArtifactKnown (the same artifact being fetched)",
            setup: |r| {
                r.start("a", "a", Always, 1);
                r.known("a", "a", Always, 1);
                r.start("m", "m", Reuse, 1);
            },
            event: |r| r.known("m", "m", Reuse, 1),
            then: "waiting on a",
            effects: "m waits for a",
        },
        Row {
            row: "resolving + ArtifactKnown (an earlier model serves another artifact there)",
            setup: |r| {
                r.serving("a", "p", Always, 1);
                r.start("m", "p", Always, 2);
            },
            event: |r| r.known("m", "p", Always, 2),
            then: "loser",
            effects: "m loses the path",
        },
        Row {
            row: "resolving + ArtifactKnown (does not fit the disk budget)",
            setup: |r| {
                r.start("m", "m", Always, 1);
            },
            event: |r| {
                r.step(Event::ArtifactKnown {
                    key: key("m"),
                    want: want("m", "m", Always, 1),
                    space: Some(Space {
                        free: 10,
                        needed: 20,
                    }),
                })
            },
            then: "failed, parked",
            effects: "m fails Space { needed: 20 }",
        },
        Row {
            row: "fetching + Fetched",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.known("m", "m", Always, 1);
            },
            event: |r| r.fetched("m", "m", Always, 1),
            then: "serving",
            effects: "m served, remap",
        },
        Row {
            row: "fetching + Fetched of a stale fetch",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.known("m", "m", Always, 1);
            },
            event: |r| {
                let Some(Phase::Fetching { store, .. }) = r.m.phase(&key("m")).cloned() else {
                    panic!("not fetching");
                };
                r.step(Event::Fetched {
                    key: key("m"),
                    store,
                    artifact: art(1),
                    want: None,
                })
            },
            then: "fetching",
            effects: "",
        },
        Row {
            row: "fetching + WorkReported (its current work)",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.known("m", "m", Always, 1);
            },
            event: |r| {
                let fingerprint = summary("m", "m", Always, 1).fingerprint;
                r.step(Event::WorkReported {
                    key: key("m"),
                    fingerprint,
                })
            },
            then: "fetching",
            effects: "m current",
        },
        Row {
            row: "resolving + WorkReported (stale: work for the spec before a change)",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.start("m", "m", Always, 2);
            },
            event: |r| {
                let fingerprint = summary("m", "m", Always, 1).fingerprint;
                r.step(Event::WorkReported {
                    key: key("m"),
                    fingerprint,
                })
            },
            then: "resolving",
            effects: "",
        },
        Row {
            row: "failed + WorkReported (stale: the work ended)",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.step(Event::Failed {
                    key: key("m"),
                    reason: "gone".into(),
                    retry: RetryKind::Permanent,
                });
            },
            event: |r| {
                let fingerprint = summary("m", "m", Always, 1).fingerprint;
                r.step(Event::WorkReported {
                    key: key("m"),
                    fingerprint,
                })
            },
            then: "failed",
            effects: "",
        },
        Row {
            row: "fetching + Failed (transient)",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.known("m", "m", Always, 1);
            },
            event: |r| r.fail_transient("m"),
            then: "failed, retry 1 at +4s",
            effects: "m fails Transient",
        },
        Row {
            row: "failed + Failed again (backoff doubles)",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.fail_transient("m");
                r.now += Duration::from_secs(4);
                r.start("m", "m", Always, 1);
            },
            event: |r| r.fail_transient("m"),
            then: "failed, retry 2 at +12s",
            effects: "m fails Transient",
        },
        Row {
            row: "resolving + Failed (permanent)",
            setup: |r| {
                r.start("m", "m", Always, 1);
            },
            event: |r| {
                r.step(Event::Failed {
                    key: key("m"),
                    reason: "401".into(),
                    retry: RetryKind::Permanent,
                })
            },
            then: "failed",
            effects: "m fails Permanent",
        },
        Row {
            row: "fetching + Failed (disk full)",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.known("m", "m", Always, 1);
            },
            event: |r| {
                r.step(Event::Failed {
                    key: key("m"),
                    reason: "full".into(),
                    retry: RetryKind::DiskFull { needed: 5 },
                })
            },
            then: "failed, parked",
            effects: "m fails DiskFull { needed: 5 }",
        },
        Row {
            row: "failed + TimePassed (not due)",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.fail_transient("m");
                r.now += Duration::from_secs(3);
            },
            event: |r| r.step(Event::TimePassed),
            then: "failed, retry 1 at +4s",
            effects: "",
        },
        Row {
            row: "failed + TimePassed (due)",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.fail_transient("m");
                r.now += Duration::from_secs(4);
            },
            event: |r| r.step(Event::TimePassed),
            then: "failed, retry 1 at +4s",
            effects: "m retries",
        },
        Row {
            row: "failed + Spec (retry due)",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.fail_transient("m");
                r.now += Duration::from_secs(4);
            },
            event: |r| r.put("m", "m", Always, 1),
            then: "failed, retry 1 at +4s",
            effects: "m starts",
        },
        Row {
            row: "failed + Spec (retry not due)",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.fail_transient("m");
            },
            event: |r| r.put("m", "m", Always, 1),
            then: "failed, retry 1 at +4s",
            effects: "",
        },
        Row {
            row: "failed (permanent) + Spec: one fresh attempt after a restart",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.step(Event::Failed {
                    key: key("m"),
                    reason: "401".into(),
                    retry: RetryKind::Permanent,
                });
                let records = r.m.records.clone();
                r.m = Machine::new(records, BASE, MAX);
            },
            event: |r| r.put("m", "m", Always, 1),
            then: "failed",
            effects: "m starts",
        },
        Row {
            row: "failed (permanent) + Spec: only one",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.step(Event::Failed {
                    key: key("m"),
                    reason: "401".into(),
                    retry: RetryKind::Permanent,
                });
                let records = r.m.records.clone();
                r.m = Machine::new(records, BASE, MAX);
                r.start("m", "m", Always, 1);
                r.step(Event::Failed {
                    key: key("m"),
                    reason: "401".into(),
                    retry: RetryKind::Permanent,
                });
            },
            event: |r| r.put("m", "m", Always, 1),
            then: "failed",
            effects: "",
        },
        Row {
            row: "failed (parked) + SpaceFits",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.known("m", "m", Always, 1);
                r.step(Event::Failed {
                    key: key("m"),
                    reason: "full".into(),
                    retry: RetryKind::DiskFull { needed: 5 },
                });
            },
            event: |r| {
                let mut out = r.step(Event::SpaceFits {
                    keys: vec![key("m")],
                });
                out.extend(r.step(Event::TimePassed));
                out
            },
            then: "failed, retry 0 at +0s",
            effects: "m retries",
        },
        Row {
            row: "serving + Spec (unchanged)",
            setup: |r| r.serving("m", "m", Always, 1),
            event: |r| r.put("m", "m", Always, 1),
            then: "serving",
            effects: "",
        },
        Row {
            row: "serving + Spec (its path now in the cache view)",
            setup: |r| r.serving("m", "m", Always, 1),
            event: |r| {
                r.step(Event::Spec {
                    key: key("m"),
                    spec: summary("m", "m", Always, 1),
                    in_cache_view: true,
                })
            },
            then: "serving",
            effects: "m starts",
        },
        Row {
            row: "serving + Spec (changed)",
            setup: |r| r.serving("m", "m", Always, 1),
            event: |r| r.put("m", "m", Always, 2),
            then: "updating",
            effects: "m starts",
        },
        Row {
            row: "fetching + Spec (changed)",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.known("m", "m", Always, 1);
            },
            event: |r| r.put("m", "m", Always, 2),
            then: "updating",
            effects: "m stops, m starts",
        },
        Row {
            row: "fetching + Spec (unchanged)",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.known("m", "m", Always, 1);
            },
            event: |r| r.put("m", "m", Always, 1),
            then: "fetching",
            effects: "",
        },
        Row {
            row: "serving + TimePassed (its source may change, resolved an interval ago)",
            setup: |r| {
                r.m = Machine::new(Records::default(), BASE, MAX)
                    .with_refresh(Some(Duration::from_secs(60)));
                r.serving("m", "m", Always, 1);
                r.step(Event::TimePassed);
                r.now += Duration::from_secs(60);
            },
            event: |r| r.step(Event::TimePassed),
            then: "serving",
            effects: "m refreshes",
        },
        Row {
            row: "serving + TimePassed (within the refresh interval)",
            setup: |r| {
                r.m = Machine::new(Records::default(), BASE, MAX)
                    .with_refresh(Some(Duration::from_secs(60)));
                r.serving("m", "m", Always, 1);
                r.step(Event::TimePassed);
                r.now += Duration::from_secs(59);
            },
            event: |r| r.step(Event::TimePassed),
            then: "serving",
            effects: "",
        },
        Row {
            row: "serving + Resolving (periodic)",
            setup: |r| r.serving("m", "m", Always, 1),
            event: |r| {
                r.step(Event::Resolving {
                    key: key("m"),
                    source: source("m"),
                    refresh: true,
                })
            },
            then: "serving, re-resolving",
            effects: "",
        },
        Row {
            row: "serving, re-resolving + ArtifactKnown (the same artifact)",
            setup: |r| {
                r.serving("m", "m", Always, 1);
                r.step(Event::Resolving {
                    key: key("m"),
                    source: source("m"),
                    refresh: true,
                });
            },
            event: |r| r.known("m", "m", Always, 1),
            then: "serving",
            effects: "m stops",
        },
        Row {
            row: "serving, re-resolving + ArtifactKnown (a new artifact)",
            setup: |r| {
                r.serving("m", "m", Always, 1);
                r.step(Event::Resolving {
                    key: key("m"),
                    source: source("m"),
                    refresh: true,
                });
            },
            event: |r| r.known("m", "m", Always, 2),
            then: "fetching",
            effects: "fetch m",
        },
        Row {
            row: "serving, re-resolving + Failed",
            setup: |r| {
                r.serving("m", "m", Always, 1);
                r.step(Event::Resolving {
                    key: key("m"),
                    source: source("m"),
                    refresh: true,
                });
            },
            event: |r| r.fail_transient("m"),
            then: "serving",
            effects: "m stops",
        },
        Row {
            row: "serving + MountRefused (first refusal)",
            setup: |r| r.serving("m", "m", Always, 1),
            event: |r| {
                r.step(Event::MountRefused {
                    refused: vec![(key("m"), "blob missing".into())],
                    incomplete: BTreeSet::new(),
                })
            },
            then: "failed, retry 1 at +4s",
            effects: "m fails MountRefused, remap",
        },
        Row {
            row: "serving + MountRefused (again: the count keeps the backoff growing)",
            setup: |r| {
                r.serving("m", "m", Always, 1);
                r.step(Event::MountRefused {
                    refused: vec![(key("m"), "blob missing".into())],
                    incomplete: BTreeSet::new(),
                });
                r.now += Duration::from_secs(4);
                r.start("m", "m", Always, 1);
                r.known("m", "m", Always, 1);
                assert_eq!(r.state("m"), "serving");
            },
            event: |r| {
                r.step(Event::MountRefused {
                    refused: vec![(key("m"), "blob missing".into())],
                    incomplete: BTreeSet::new(),
                })
            },
            then: "failed, retry 2 at +12s",
            effects: "m fails MountRefused, remap",
        },
        Row {
            row: "waiting + WorkMoved + WakeNext",
            setup: |r| {
                r.start("a", "a", Always, 1);
                r.known("a", "a", Always, 1);
                r.start("m", "m", Reuse, 1);
                r.known("m", "m", Reuse, 1);
                r.fail_transient("a");
            },
            event: |r| r.step(Event::WakeNext),
            then: "waiting on a",
            effects: "m wakes",
        },
        Row {
            row: "waiting + ArtifactKnown after its wake-up (the fetcher failed)",
            setup: |r| {
                r.start("a", "a", Always, 1);
                r.known("a", "a", Always, 1);
                r.start("m", "m", Reuse, 1);
                r.known("m", "m", Reuse, 1);
                r.fail_transient("a");
                r.step(Event::WakeNext);
            },
            event: |r| r.known("m", "m", Reuse, 1),
            then: "fetching",
            effects: "save, fetch m",
        },
        Row {
            row: "loser + SettlePaths (the winner went away)",
            setup: |r| {
                r.serving("a", "a", Always, 1);
                r.start("m", "a/m", Always, 2);
                r.step(Event::Deleted { key: key("a") });
            },
            event: |r| r.step(Event::SettlePaths),
            then: "failed, retry 0 at +0s",
            effects: "m turn",
        },
        Row {
            row: "loser + Spec (unchanged: waits for its turn)",
            setup: |r| {
                r.serving("a", "a", Always, 1);
                r.start("m", "a/m", Always, 2);
            },
            event: |r| r.put("m", "a/m", Always, 2),
            then: "loser",
            effects: "",
        },
        Row {
            row: "serving + SettlePaths (an earlier model resolved another artifact there)",
            setup: |r| {
                r.serving("a", "x", Always, 1);
                r.serving("m", "p", Always, 2);
                r.start("a", "p", Always, 1);
                r.known("a", "p", Always, 1);
            },
            event: |r| r.step(Event::SettlePaths),
            then: "loser",
            effects: "m loses the path, remap",
        },
        Row {
            row: "fetching + Deleted",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.known("m", "m", Always, 1);
            },
            event: |r| r.step(Event::Deleted { key: key("m") }),
            then: "absent",
            effects: "m stops, remap",
        },
        Row {
            row: "resolving + NoFiles",
            setup: |r| {
                r.start("m", "m", Always, 1);
            },
            event: |r| {
                r.step(Event::NoFiles {
                    key: key("m"),
                    source: "vendor://x".into(),
                })
            },
            then: "serving",
            effects: "m stops, remap",
        },
        Row {
            row: "fetching + Invalid",
            setup: |r| {
                r.start("m", "m", Always, 1);
                r.known("m", "m", Always, 1);
            },
            event: |r| {
                r.step(Event::Invalid {
                    key: key("m"),
                    fingerprint: "invalid:x".into(),
                    reason: "bad path".into(),
                })
            },
            then: "invalid",
            effects: "m stops, m invalid",
        },
        Row {
            row: "invalid + Invalid (the same reason)",
            setup: |r| {
                r.step(Event::Invalid {
                    key: key("m"),
                    fingerprint: "invalid:x".into(),
                    reason: "bad path".into(),
                });
            },
            event: |r| {
                r.step(Event::Invalid {
                    key: key("m"),
                    fingerprint: "invalid:x".into(),
                    reason: "bad path".into(),
                })
            },
            then: "invalid",
            effects: "",
        },
    ];
    let mut failures = Vec::new();
    for row in &rows {
        let mut r = Rig::new();
        (row.setup)(&mut r);
        let effects = effects_text(&(row.event)(&mut r));
        let then = r.state("m");
        if (then.as_str(), effects.as_str()) != (row.then, row.effects) {
            failures.push(format!(
                "{}: got `{then}` with [{effects}], want `{}` with [{}]",
                row.row, row.then, row.effects
            ));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn a_failure_reason_says_when_it_is_retried() {
    let mut r = Rig::new();
    r.start("m", "m", Always, 1);
    let effects = r.step(Event::Failed {
        key: key("m"),
        reason: "HTTP 503".into(),
        retry: RetryKind::Transient,
    });
    let reason = &r.m.records.models()[&key("m")].reason;
    assert_eq!(reason.as_deref(), Some("HTTP 503 (retry 1 in 4s)"));
    assert!(
        matches!(&effects[..], [Effect::Fail { reason, .. }] if reason == "HTTP 503 (retry 1 in 4s)")
    );
}

// ----- property test ---------------------------------------------------------------------------

/// Models of the property test, with the paths they may take: equal paths (`p`), nesting
/// ones (`p` and `p/q`) and separate ones.
const NAMES: [&str; 5] = ["m0", "m1", "m2", "m3", "m4"];
const PATHS: [&str; 4] = ["p", "p/q", "r", "p"];

#[derive(Clone, Debug)]
enum Op {
    /// Create or change a model (its policy, revision, path).
    Put {
        model: usize,
        reuse: bool,
        rev: u8,
        path: usize,
    },
    Delete {
        model: usize,
    },
    /// The resolve of a model that is resolving completes (with the artifact of its revision).
    Resolve {
        model: usize,
    },
    /// A fetch in progress completes.
    FetchDone {
        model: usize,
    },
    /// A resolve or fetch in progress fails (transiently or for good).
    FetchFailed {
        model: usize,
        transient: bool,
    },
    /// The mount server refuses a served model.
    Refused {
        model: usize,
    },
    /// The daemon restarts: only the records survive.
    Restart,
    /// Time passes, and the retries due run.
    Wait {
        seconds: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let model = 0..NAMES.len();
    prop_oneof![
        5 => (model.clone(), any::<bool>(), 1..3u8, 0..PATHS.len())
            .prop_map(|(model, reuse, rev, path)| Op::Put { model, reuse, rev, path }),
        1 => model.clone().prop_map(|model| Op::Delete { model }),
        4 => model.clone().prop_map(|model| Op::Resolve { model }),
        4 => model.clone().prop_map(|model| Op::FetchDone { model }),
        1 => (model.clone(), any::<bool>())
            .prop_map(|(model, transient)| Op::FetchFailed { model, transient }),
        1 => model.prop_map(|model| Op::Refused { model }),
        1 => Just(Op::Restart),
        2 => (1..400u64).prop_map(|seconds| Op::Wait { seconds }),
    ]
}

/// The executor of the property test: the desired specs, and the machine's effects answered
/// at once (a `Start` resolves, a split links, a wake-up places again), as the actor does.
struct World {
    rig: Rig,
    /// Desired (spec, revision) by model name.
    desired: BTreeMap<&'static str, (SpecSummary, u8)>,
}

impl World {
    fn spec_of(&self, name: &str) -> Option<(SpecSummary, u8)> {
        self.desired.get(name).cloned()
    }

    fn want_of(&self, name: &str) -> Option<Want> {
        let (spec, rev) = self.spec_of(name)?;
        Some(want(name, &spec.path, spec.policy, rev))
    }

    fn reconcile(&mut self, name: &str) {
        let Some((spec, _)) = self.spec_of(name) else {
            return;
        };
        let event = Event::Spec {
            key: key(name),
            spec,
            in_cache_view: false,
        };
        let effects = self.rig.step(event);
        self.run(effects);
    }

    /// Runs effects as the executor does, feeding outcomes back.
    fn run(&mut self, effects: Vec<Effect>) {
        for effect in effects {
            match effect {
                Effect::Start { key: k, .. } => {
                    let name = name_of(&k);
                    let Some((spec, _)) = self.spec_of(name) else {
                        continue;
                    };
                    let path = MountPath::from_relative(&spec.path).unwrap();
                    let more = self.rig.step(Event::Starting {
                        key: k.clone(),
                        path,
                        observed: Observed::default(),
                    });
                    if more.iter().any(|e| matches!(e, Effect::Resolve { .. })) {
                        self.rig.step(Event::Resolving {
                            key: k,
                            source: spec.source,
                            refresh: false,
                        });
                    }
                    self.run(more);
                }
                Effect::LinkStore(split) => {
                    let more = self.rig.step(Event::SplitLinked {
                        split,
                        result: Ok(()),
                    });
                    self.run(more);
                }
                Effect::Retry { key: k } | Effect::Turn { key: k } => self.reconcile(name_of(&k)),
                Effect::Wake { key: k } => {
                    if matches!(self.rig.m.phase(&k), Some(Phase::Waiting { .. })) {
                        let name = name_of(&k);
                        if let Some(want) = self.want_of(name) {
                            let more = self.rig.step(Event::ArtifactKnown {
                                key: k,
                                want,
                                space: None,
                            });
                            self.run(more);
                        }
                    }
                }
                _ => {}
            }
        }
    }

    /// The end of a batch, as the actor's passes: waiters woken, the path rule over all.
    fn settle(&mut self) {
        loop {
            let effects = self.rig.step(Event::WakeNext);
            if effects.is_empty() {
                break;
            }
            self.run(effects);
        }
        let effects = self.rig.step(Event::SettlePaths);
        self.run(effects);
        loop {
            let effects = self.rig.step(Event::WakeNext);
            if effects.is_empty() {
                break;
            }
            self.run(effects);
        }
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Put {
                model,
                reuse,
                rev,
                path,
            } => {
                let name = NAMES[model];
                let policy = if reuse { Reuse } else { Always };
                self.desired
                    .insert(name, (summary(name, PATHS[path], policy, rev), rev));
                self.reconcile(name);
            }
            Op::Delete { model } => {
                let name = NAMES[model];
                if self.desired.remove(name).is_some() {
                    let effects = self.rig.step(Event::Deleted { key: key(name) });
                    self.run(effects);
                }
            }
            Op::Resolve { model } => {
                let name = NAMES[model];
                let resolving =
                    matches!(self.rig.m.phase(&key(name)), Some(Phase::Resolving { .. }));
                if let (true, Some(want)) = (resolving, self.want_of(name)) {
                    self.rig.step(Event::WorkMoved { key: key(name) });
                    let effects = self.rig.step(Event::ArtifactKnown {
                        key: key(name),
                        want,
                        space: None,
                    });
                    self.run(effects);
                }
            }
            Op::FetchDone { model } => {
                let name = NAMES[model];
                if let Some(Phase::Fetching { store, artifact }) =
                    self.rig.m.phase(&key(name)).cloned()
                {
                    let want = self.want_of(name).filter(|w| w.artifact == artifact);
                    let effects = self.rig.step(Event::Fetched {
                        key: key(name),
                        store,
                        artifact,
                        want,
                    });
                    self.run(effects);
                }
            }
            Op::FetchFailed { model, transient } => {
                let name = NAMES[model];
                if self.rig.m.phase(&key(name)).is_some() {
                    let retry = if transient {
                        RetryKind::Transient
                    } else {
                        RetryKind::Permanent
                    };
                    let effects = self.rig.step(Event::Failed {
                        key: key(name),
                        reason: "failed".into(),
                        retry,
                    });
                    self.run(effects);
                }
            }
            Op::Refused { model } => {
                let name = NAMES[model];
                let served = self
                    .rig
                    .m
                    .records
                    .models()
                    .get(&key(name))
                    .is_some_and(|r| {
                        r.served_path.is_some() && r.artifact.is_some() && r.store.is_some()
                    });
                if served {
                    let effects = self.rig.step(Event::MountRefused {
                        refused: vec![(key(name), "blob missing".into())],
                        incomplete: BTreeSet::new(),
                    });
                    self.run(effects);
                }
            }
            Op::Restart => {
                let records = self.rig.m.records.clone();
                self.rig.m = Machine::new(records, BASE, MAX);
                let effects = self.rig.step(Event::Recovered {
                    incomplete: BTreeSet::new(),
                });
                self.run(effects);
                self.settle();
                let names: Vec<&'static str> = self.desired.keys().copied().collect();
                for name in names {
                    self.reconcile(name);
                }
            }
            Op::Wait { seconds } => {
                self.rig.now += Duration::from_secs(seconds);
                let effects = self.rig.step(Event::TimePassed);
                self.run(effects);
            }
        }
        self.settle();
    }
}

fn name_of(k: &ModelKey) -> &'static str {
    NAMES
        .iter()
        .find(|n| key(n) == *k)
        .expect("a model of the test")
}

/// The invariants every state must hold (SPEC section 8 as far as decisions carry it).
fn check(m: &Machine) -> Result<(), String> {
    let records = &m.records;
    let served: Vec<(&ModelKey, MountPath, &ArtifactId)> = records
        .models()
        .iter()
        .filter_map(|(k, r)| {
            let path = MountPath::from_relative(r.served_path.as_deref()?).ok()?;
            Some((k, path, r.artifact.as_ref()?))
        })
        .collect();
    // Never two conflicting models mapped (section 4).
    for (i, (k1, p1, a1)) in served.iter().enumerate() {
        for (k2, p2, a2) in &served[i + 1..] {
            let (s1, s2) = (p1.segments(), p2.segments());
            let nest = s1 != s2 && (s1.starts_with(s2) || s2.starts_with(s1));
            if nest || (s1 == s2 && a1 != a2) {
                return Err(format!("{k1} and {k2} conflict at {p1} / {p2}"));
            }
        }
    }
    let garbage = garbage_stores(records, |_| false);
    for (k, r) in records.models() {
        // A loser is never Ready.
        if m.is_loser(k) && r.phase == ModelPhase::Ready {
            return Err(format!("{k} lost the path rule but is Ready"));
        }
        // Nothing is mapped without a complete placement: its store holds its artifact.
        if let (Some(store), Some(artifact)) = (&r.store, &r.artifact) {
            let complete = records
                .stores()
                .get(store)
                .is_some_and(|s| s.artifacts.contains(artifact));
            if !complete {
                return Err(format!(
                    "{k} is served from {store}, which lacks its artifact"
                ));
            }
            // A store that is mapped is never garbage.
            if garbage.contains(store) {
                return Err(format!("{store} serves {k} but is garbage"));
            }
        }
        if r.phase == ModelPhase::Ready && r.artifact.is_some() && r.served_path.is_none() {
            return Err(format!("{k} is Ready with an artifact but no path"));
        }
        // A served model has no retry pending, and its work (if any) is for its spec.
        if r.phase == ModelPhase::Ready && m.retry_of(k).is_some() {
            return Err(format!("{k} is Ready with a retry pending"));
        }
    }
    for (k, phase) in m.working() {
        if !records.models().contains_key(k) {
            return Err(format!("{k} works without a record"));
        }
        if let Phase::Fetching { store, .. } = phase {
            if !records.stores().contains_key(store) {
                return Err(format!("{k} fetches into {store}, which no record names"));
            }
        }
    }
    if records.index() != &RecordsIndex::build(records.models(), records.stores()) {
        return Err("records index out of step".into());
    }
    m.paths.check(records);
    Ok(())
}

fn cases() -> ProptestConfig {
    let fuzz = modelfs_proptest_support::config();
    ProptestConfig {
        cases: fuzz.cases.max(2048),
        ..fuzz
    }
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn random_event_sequences_keep_the_invariants(ops in prop::collection::vec(op(), 1..40)) {
        let mut world = World {
            rig: Rig::new(),
            desired: BTreeMap::new(),
        };
        for (i, op) in ops.iter().enumerate() {
            world.apply(op);
            if let Err(e) = check(&world.rig.m) {
                return Err(TestCaseError::fail(format!("after step {i} ({op:?}): {e}")));
            }
        }
        // Quiescence: with every fetch completing and time passing, every desired model ends
        // served or failed, and nothing is left waiting.
        for _ in 0..6 {
            for model in 0..NAMES.len() {
                world.apply(&Op::Resolve { model });
                world.apply(&Op::FetchDone { model });
            }
            world.apply(&Op::Wait { seconds: 400 });
        }
        for (name, _) in world.desired.clone() {
            let k = key(name);
            prop_assert!(
                !matches!(world.rig.m.phase(&k), Some(Phase::Waiting { .. })),
                "{name} still waits: {:?}", world.rig.m.phase(&k)
            );
        }
        check(&world.rig.m).map_err(TestCaseError::fail)?;
    }
}
