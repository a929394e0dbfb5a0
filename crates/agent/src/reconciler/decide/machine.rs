//! The per-model state machine: one state value ([`Machine`]: the records, their path index
//! and each model's lifecycle bookkeeping) and one transition function, [`Machine::step`].
//! See the transition table in the docs of [`super`].
//!
//! What the records alone do not say lives in [`Lifecycle`]: the pending retries with their
//! backoff (and why: a transient failure, a refusal of the mount server, a fetch that does not
//! fit), the losers of the path rule, who waits for whom (single flight, an earlier model on a
//! path), and which failed models had their one fresh attempt since the start. None of it is
//! durable: after a restart a failed model gets one attempt, and a loser meets the rule again.
//!
//! Time and chance are arguments ([`Clock`]): the machine never reads a clock or draws a
//! random number, so a sequence of events replays to the same state, and the tables and the
//! property test drive it at thousands of events a second.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use super::{
    claims, decide, verdict_for, ClaimArtifact, Effect, Fact, InFlight, PathClaim, PathIndex,
    PathVerdict, RetryKind, Space, Split, Want, Wanted,
};
use crate::reconciler::records::{ModelPhase, ModelRecord, Records};
use modelfs_core::artifact::ArtifactId;
use modelfs_core::store::StoreId;
use modelfs_ome::{DownloadPolicy, ModelKey, MountPath, SourceUri};

/// The time of an event, and the jitter (0..1) a retry scheduled by it uses.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    pub now: Instant,
    pub jitter: f64,
}

/// A pending retry of a failed model: due `at`, for the spec with `fingerprint`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retry {
    pub fingerprint: String,
    pub attempts: u32,
    pub at: Instant,
    /// Refused for space, or its fetch hit a full disk: parked until the disk has room
    /// ([`Event::SpaceFits`] makes it due), not timed.
    pub space: bool,
}

/// A model that lost a path conflict: it stays `Failed` until the rule clears it (the model it
/// lost to goes away or moves), then it gets its turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathLoser {
    pub fingerprint: String,
    /// What it would serve, when known: it keeps competing for the path with this artifact.
    pub artifact: Option<ArtifactId>,
}

/// What the records keep of a model's spec (see [`Event::Spec`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecSummary {
    pub fingerprint: String,
    pub name: String,
    pub namespace: Option<String>,
    pub source: String,
    pub policy: DownloadPolicy,
    /// The record's `path` (see `recorded_path`).
    pub path: String,
    pub reserve: bool,
}

/// What a model's work is doing. A model without work is served (`Ready`), failed (waiting
/// for a retry, a turn, or a change of its spec) or invalid: its record says which.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Its source is being resolved (`refresh`: a periodic re-resolve of a `Ready` model,
    /// which stays served meanwhile).
    Resolving { source: String, refresh: bool },
    /// Its artifact known, it waits for `on`'s work: a fetch of the same artifact (single
    /// flight) or a resolve of an earlier model on the same path.
    Waiting { artifact: ArtifactId, on: ModelKey },
    /// Its artifact is being fetched into `store`.
    Fetching {
        artifact: ArtifactId,
        store: StoreId,
    },
}

/// What happens to a model, as the executor reports it (see the transition table in
/// [`super`]).
#[derive(Clone, Debug)]
pub enum Event {
    /// The desired state names `key` with `spec` (new, changed, or seen again by a retry or a
    /// turn). `in_cache_view`: its path lies in or around the Hugging Face cache view's
    /// directory.
    Spec {
        key: ModelKey,
        spec: SpecSummary,
        in_cache_view: bool,
    },
    /// `key`'s object is invalid (`fingerprint` digests the reason).
    Invalid {
        key: ModelKey,
        fingerprint: String,
        reason: String,
    },
    /// Work for `key` is about to start at `path`, its artifact not known yet, with what the
    /// executor observed of the world for it ([`Observed`]). Nesting paths need no artifact
    /// to conflict, so the path rule is applied before any work.
    Starting {
        key: ModelKey,
        path: MountPath,
        observed: Observed,
    },
    /// `key`'s source is being resolved (`refresh`: periodically, while it stays served).
    Resolving {
        key: ModelKey,
        source: String,
        refresh: bool,
    },
    /// `key`'s artifact is known (resolved, or the served one when only the policy or path
    /// changed): place it (SPEC 3.1, 3.2; the path rule of section 4 first). `space`: the disk
    /// as a fetch would find it (`None`: no budget).
    ArtifactKnown {
        key: ModelKey,
        want: Want,
        space: Option<Space>,
    },
    /// A fetch into `store` completed with `artifact` verified. `want`: what the model's spec
    /// asks, when the fetch is still its work (a stale fetch is recorded as data, never
    /// served).
    Fetched {
        key: ModelKey,
        store: StoreId,
        artifact: ArtifactId,
        want: Option<Want>,
    },
    /// `key`'s work failed (a resolve, a fetch, a source that cannot be built, a directory
    /// missing, a path in the cache view, a full disk), retried as `retry` says.
    Failed {
        key: ModelKey,
        reason: String,
        retry: RetryKind,
    },
    /// The model's object is gone (SPEC 3.3).
    Deleted { key: ModelKey },
    /// A model whose files are not the mount's (`vendor://`, a node directory): `Ready` at
    /// once, nothing mapped.
    NoFiles { key: ModelKey, source: String },
    /// The outcome of an [`Effect::LinkStore`].
    SplitLinked {
        split: Split,
        result: Result<(), String>,
    },
    /// Start-up: the (store, artifact) pairs of the records whose blobs are not all on disk.
    Recovered {
        incomplete: BTreeSet<(StoreId, ArtifactId)>,
    },
    /// After a batch of events (and at start-up): the path rule over every claim.
    SettlePaths,
    /// The mount server left the entries of these models out of the mapping, with its reason.
    /// `incomplete`: the (store, artifact) pairs they are served from whose blobs are not all
    /// on disk.
    MountRefused {
        refused: Vec<(ModelKey, String)>,
        incomplete: BTreeSet<(StoreId, ArtifactId)>,
    },
    /// Time passed: the retries due now are reconciled again.
    TimePassed,
    /// The disk has room for these models refused for space: their retries are due now.
    SpaceFits { keys: Vec<ModelKey> },
    /// `key`'s work moved on (its resolve finished): the models waiting for it are woken.
    WorkMoved { key: ModelKey },
    /// The next woken waiter, if any ([`Effect::Wake`]).
    WakeNext,
    /// A resolve or fetch of `key` reported back; it was started for the spec with
    /// `fingerprint`. Current (the model still has work, for that spec): [`Effect::Current`],
    /// and the executor handles the report; stale (the work was stopped, replaced by work for
    /// a changed spec, or ended): nothing.
    WorkReported { key: ModelKey, fingerprint: String },
}

/// A failure as the executor observed it: the reason, and how it is retried (a property of
/// the error: transient or not).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub reason: String,
    pub retry: RetryKind,
}

/// Where a model's files come from, as its spec and the node say (see [`Observed`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Files {
    /// The mount serves them, from a store its source is fetched into.
    #[default]
    Mount,
    /// They are not the mount's (`vendor://`: the runtime brings them; a node directory: the
    /// pod binds it). `missing`: the node directory does not exist.
    Elsewhere { missing: Option<Failure> },
}

/// What only the world can tell about a model whose work is about to start
/// ([`Event::Starting`]); the machine decides what follows from it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// Its source as the record keeps it.
    pub source: String,
    pub files: Files,
    /// Why its path cannot be a model path (it nests with the cache view's directory, a
    /// property of the flags, not of another model).
    pub cache_view_conflict: Option<String>,
}

/// The bookkeeping of each model's lifecycle besides its record (module docs).
#[derive(Default)]
pub struct Lifecycle {
    retries: HashMap<ModelKey, Retry>,
    /// How often the mount server refused each model (with the fingerprint it had then).
    refusals: HashMap<ModelKey, (String, u32)>,
    /// Models that failed before this start and were given their one fresh attempt.
    attempted_since_start: HashSet<ModelKey>,
    losers: BTreeMap<ModelKey, PathLoser>,
    /// Models waiting (single flight, or an earlier model resolving on the same path), by the
    /// model whose work they wait for: only its changes wake them.
    waiting_on: HashMap<ModelKey, BTreeSet<ModelKey>>,
    /// Waiters to place again, in key order.
    to_wake: BTreeSet<ModelKey>,
    /// Each model's work in flight, and the same indexed the way single flight asks about it
    /// (by artifact fetched, by source resolved), so a placement looks only at the models
    /// fetching its artifact or resolving its source.
    phases: BTreeMap<ModelKey, Phase>,
    fetching: HashMap<ArtifactId, BTreeSet<ModelKey>>,
    resolving: HashMap<String, BTreeSet<ModelKey>>,
    /// Models whose work is a periodic re-resolve (and the fetch it may lead to): they stay
    /// served, and its failure only logs.
    refreshing: BTreeSet<ModelKey>,
    /// When each served model whose source may change was last resolved (or first seen
    /// served): see [`Machine::with_refresh`].
    resolved_at: HashMap<ModelKey, Instant>,
}

impl Lifecycle {
    fn set_phase(&mut self, key: &ModelKey, phase: Phase) {
        self.unindex(key);
        match &phase {
            Phase::Resolving { source, .. } => {
                self.resolving
                    .entry(source.clone())
                    .or_default()
                    .insert(key.clone());
            }
            Phase::Fetching { artifact, .. } => {
                self.fetching
                    .entry(artifact.clone())
                    .or_default()
                    .insert(key.clone());
            }
            Phase::Waiting { .. } => {}
        }
        self.phases.insert(key.clone(), phase);
    }

    /// `key`'s work ended.
    fn clear_phase(&mut self, key: &ModelKey) {
        self.unindex(key);
        self.refreshing.remove(key);
    }

    fn unindex(&mut self, key: &ModelKey) {
        fn take<K: std::hash::Hash + Eq>(
            map: &mut HashMap<K, BTreeSet<ModelKey>>,
            k: &K,
            key: &ModelKey,
        ) {
            if let Some(set) = map.get_mut(k) {
                set.remove(key);
                if set.is_empty() {
                    map.remove(k);
                }
            }
        }
        match self.phases.remove(key) {
            Some(Phase::Resolving { source, .. }) => take(&mut self.resolving, &source, key),
            Some(Phase::Fetching { artifact, .. }) => take(&mut self.fetching, &artifact, key),
            Some(Phase::Waiting { .. }) | None => {}
        }
    }
}

/// How far ahead the retry of a model refused for space is parked: never, in practice; the
/// disk check moves it to now once the model fits ([`Event::SpaceFits`]).
const SPACE_PARKED: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Whether the same URI may name other content later: object-store prefixes (objects can be
/// overwritten, added or removed) and Hugging Face branches or tags (a commit cannot change).
pub fn source_may_change(source: &SourceUri) -> bool {
    match source {
        SourceUri::ObjectStore { .. } | SourceUri::Oci { .. } => true,
        SourceUri::HuggingFace { revision, .. } => !modelfs_ome::source::is_commit_hash(revision),
        _ => false,
    }
}

/// The time a parked retry is due at: [`SPACE_PARKED`] after `now`, or as far as the clock
/// goes.
fn parked(now: Instant) -> Instant {
    let mut ahead = SPACE_PARKED;
    loop {
        if let Some(at) = now.checked_add(ahead) {
            return at;
        }
        ahead /= 2;
    }
}

/// The state the decision core owns, and its transition function.
pub struct Machine {
    pub records: Records,
    pub paths: PathIndex,
    life: Lifecycle,
    /// First retry delay of a transient failure and its cap (see [`super::retry_delay`]).
    retry_base: Duration,
    retry_max: Duration,
    /// How often a served model whose source may change is resolved again (`None`: never).
    refresh_every: Option<Duration>,
}

impl Machine {
    /// The machine over `records` (all of them indexed), with nothing pending.
    pub fn new(records: Records, retry_base: Duration, retry_max: Duration) -> Self {
        let mut paths = PathIndex::default();
        for key in records.models().keys() {
            paths.update(&records, key);
        }
        Self {
            records,
            paths,
            life: Lifecycle::default(),
            retry_base,
            retry_max,
            refresh_every: None,
        }
    }

    /// With `every`: a served model whose source can name other content under the same URI
    /// (object-store and OCI prefixes, Hugging Face branches and tags: [`source_may_change`])
    /// is resolved again once it has not been for `every` ([`Effect::Refresh`], when time
    /// passes).
    pub fn with_refresh(mut self, every: Option<Duration>) -> Self {
        self.refresh_every = every;
        self
    }

    /// The one transition: what `event` at `clock` does to the state, and the effects the
    /// executor runs, in order (see the table in [`super`]).
    pub fn step(&mut self, event: Event, clock: Clock) -> Vec<Effect> {
        match event {
            Event::Spec {
                key,
                spec,
                in_cache_view,
            } => self.spec_seen(&key, &spec, in_cache_view, clock),
            Event::Invalid {
                key,
                fingerprint,
                reason,
            } => self.invalid(&key, &fingerprint, &reason),
            Event::Starting {
                key,
                path,
                observed,
            } => self.starting(key, &path, observed, clock),
            Event::Resolving {
                key,
                source,
                refresh,
            } => {
                self.life
                    .set_phase(&key, Phase::Resolving { source, refresh });
                if refresh {
                    self.life.refreshing.insert(key);
                } else {
                    self.life.refreshing.remove(&key);
                }
                Vec::new()
            }
            Event::Failed { key, reason, .. } if self.life.refreshing.contains(&key) => {
                // The served artifact is still good: the model stays Ready.
                tracing::warn!(model = %key, error = reason, "re-resolving failed; still serving the artifact resolved before");
                self.refresh_ended(key)
            }
            Event::Failed { key, reason, retry } => {
                self.lifecycle(vec![Effect::Fail { key, reason, retry }], None, clock)
            }
            Event::TimePassed => {
                let mut out = self.retries_due(clock.now);
                out.extend(self.refreshes_due(clock.now));
                out
            }
            Event::SpaceFits { keys } => {
                for key in &keys {
                    if let Some(r) = self.life.retries.get_mut(key) {
                        r.at = clock.now;
                    }
                }
                Vec::new()
            }
            Event::WorkMoved { key } => {
                self.work_moved(&key);
                Vec::new()
            }
            Event::WorkReported { key, fingerprint } => self.work_reported(key, &fingerprint),
            Event::WakeNext => self
                .life
                .to_wake
                .pop_first()
                .map(|key| Effect::Wake { key })
                .into_iter()
                .collect(),
            Event::ArtifactKnown { key, .. } if self.refresh_unchanged(&event) => {
                tracing::debug!(model = %key, "resolved again: unchanged");
                self.refresh_ended(key)
            }
            Event::ArtifactKnown { key, want, space } => {
                let claims = self.related_claims(&want.path);
                let in_flight = self.in_flight(&want.source, &want.artifact);
                let artifact = want.artifact.clone();
                let fact = Fact::ArtifactKnown {
                    key,
                    want,
                    in_flight,
                    claims,
                    space,
                };
                let effects = decide(&mut self.records, &fact).effects;
                self.lifecycle(effects, Some(&artifact), clock)
            }
            Event::Fetched {
                key,
                store,
                artifact,
                want,
            } => {
                let claims = match &want {
                    Some(w) => self.related_claims(&w.path),
                    None => Vec::new(),
                };
                let wanted = want.as_ref().map(|w| w.artifact.clone());
                let fact = Fact::Fetched {
                    key,
                    store,
                    artifact,
                    want,
                    claims,
                };
                let effects = decide(&mut self.records, &fact).effects;
                self.lifecycle(effects, wanted.as_ref(), clock)
            }
            other => self.records_event(other, clock),
        }
    }

    /// The events that are the records' rules' alone (a deletion, a model without files, a
    /// split linked, recovery, the path rule over all, refusals), with what the machine knows
    /// added.
    fn records_event(&mut self, event: Event, clock: Clock) -> Vec<Effect> {
        let mut out = Vec::new();
        let fact = match event {
            Event::Deleted { key } => {
                out.push(Effect::Stop { key: key.clone() });
                self.life.retries.remove(&key);
                self.life.refusals.remove(&key);
                self.life.losers.remove(&key);
                Fact::Deleted { key }
            }
            Event::NoFiles { key, source } => {
                out.push(Effect::Stop { key: key.clone() });
                self.life.retries.remove(&key);
                Fact::NoFiles { key, source }
            }
            Event::SplitLinked { split, result } => Fact::SplitLinked { split, result },
            Event::Recovered { incomplete } => Fact::Recovered { incomplete },
            Event::SettlePaths => Fact::SettlePaths {
                claims: self.all_claims(),
                working: self.life.phases.keys().cloned().collect(),
                losers: self.life.losers.keys().cloned().collect(),
            },
            Event::MountRefused {
                refused,
                incomplete,
            } => {
                let working = refused
                    .iter()
                    .map(|(k, _)| k)
                    .filter(|k| self.life.phases.contains_key(*k))
                    .cloned()
                    .collect();
                Fact::MountRefused {
                    refused,
                    incomplete,
                    working,
                }
            }
            // Handled by `step`.
            other => unreachable!("not a records event: {other:?}"),
        };
        out.extend(decide(&mut self.records, &fact).effects);
        let out = self.lifecycle(out, None, clock);
        if let Fact::Deleted { key } | Fact::NoFiles { key, .. } = &fact {
            self.paths.update(&self.records, key);
            self.work_moved(key);
        }
        out
    }

    /// A periodic re-resolve found the artifact the model serves.
    fn refresh_unchanged(&self, event: &Event) -> bool {
        let Event::ArtifactKnown { key, want, .. } = event else {
            return false;
        };
        self.life.refreshing.contains(key)
            && self
                .records
                .models()
                .get(key)
                .and_then(|r| r.artifact.as_ref())
                == Some(&want.artifact)
    }

    /// A periodic re-resolve ends with the model served as before: its work stops.
    fn refresh_ended(&mut self, key: ModelKey) -> Vec<Effect> {
        self.life.clear_phase(&key);
        self.work_moved(&key);
        vec![Effect::Stop { key }]
    }

    /// The path rule for `key` about to start work at `path`: it loses at once to a model
    /// whose path nests with it; otherwise it is `Updating` (equal paths wait for its resolve).
    /// Work for `key` is about to start: files elsewhere are served without the mount (or
    /// fail while the node directory is missing), a path in the cache view fails for good,
    /// then the path rule; a clear path starts the resolve.
    fn starting(
        &mut self,
        key: ModelKey,
        path: &MountPath,
        observed: Observed,
        clock: Clock,
    ) -> Vec<Effect> {
        let Observed {
            source,
            files,
            cache_view_conflict,
        } = observed;
        let failed = |key: ModelKey, f: Failure| Event::Failed {
            key,
            reason: f.reason,
            retry: f.retry,
        };
        match files {
            Files::Elsewhere { missing: Some(f) } => return self.step(failed(key, f), clock),
            Files::Elsewhere { missing: None } => {
                let mut out = self.step(
                    Event::NoFiles {
                        key: key.clone(),
                        source,
                    },
                    clock,
                );
                out.push(Effect::FilesElsewhere { key });
                return out;
            }
            Files::Mount => {}
        }
        if let Some(reason) = cache_view_conflict {
            tracing::warn!(model = %key, reason, "path conflict with the cache view");
            let f = Failure {
                reason,
                retry: RetryKind::Permanent,
            };
            return self.step(failed(key, f), clock);
        }
        let out = self.path_rule_before_work(&key, path, clock);
        if out.is_empty() {
            vec![Effect::Resolve { key }]
        } else {
            out
        }
    }

    /// The path rule for `key`'s work about to start at `path`, its artifact not known.
    fn path_rule_before_work(
        &mut self,
        key: &ModelKey,
        path: &MountPath,
        clock: Clock,
    ) -> Vec<Effect> {
        let seq = self.records.models().get(key).map_or(u64::MAX, |r| r.seq);
        let claims = self.related_claims(path);
        match verdict_for(claims, key, seq, path, ClaimArtifact::Pending) {
            PathVerdict::Conflict { reason, .. } => {
                let lose = Effect::LosePath {
                    key: key.clone(),
                    reason,
                    artifact: None,
                };
                self.lifecycle(vec![lose], None, clock)
            }
            PathVerdict::Clear | PathVerdict::Wait { .. } => {
                if let Some(mut rec) = self.records.model_mut(key) {
                    rec.phase = ModelPhase::Updating;
                }
                Vec::new()
            }
        }
    }

    /// What `key`'s work claims on its wanted path: pending while resolving, known once
    /// resolved; a loser keeps the artifact it lost with.
    fn wanted(&self, key: &ModelKey) -> Wanted {
        let artifact = match self.life.phases.get(key) {
            Some(Phase::Resolving { .. }) => ClaimArtifact::Pending,
            Some(Phase::Waiting { artifact, .. } | Phase::Fetching { artifact, .. }) => {
                ClaimArtifact::Known(artifact.clone())
            }
            None => match self.loser_artifact(key) {
                Some(a) => ClaimArtifact::Known(a.clone()),
                None => ClaimArtifact::Unknown,
            },
        };
        Wanted {
            working: self.life.phases.contains_key(key),
            artifact,
        }
    }

    /// The claims of the models whose paths nest with `path` (the others cannot matter).
    fn related_claims(&self, path: &MountPath) -> Vec<PathClaim> {
        let related = self.paths.related(path.segments());
        claims(&self.records, &related, |k| self.wanted(k))
    }

    /// Every model's claims on paths below the mount.
    fn all_claims(&self) -> Vec<PathClaim> {
        claims(&self.records, self.records.models().keys(), |k| {
            self.wanted(k)
        })
    }

    /// The work in flight that single flight must respect for a placement of `artifact`
    /// resolved from `source`: from the index, not a pass over all work.
    fn in_flight(&self, source: &str, artifact: &ArtifactId) -> InFlight {
        let mut out = InFlight::default();
        for k in self.life.fetching.get(artifact).into_iter().flatten() {
            out.fetching.insert(k.clone(), artifact.clone());
        }
        if let Some(keys) = self.life.resolving.get(source) {
            out.resolving_same_source.extend(keys.iter().cloned());
        }
        out
    }

    /// What the records' decision means for each model's lifecycle: retries scheduled or
    /// dropped, losers noted, waits registered. Returns the effects for the executor (a
    /// failure's reason says when it is retried).
    /// `artifact`: the artifact of the model the event placed (a fetch or a wait is of it).
    fn lifecycle(
        &mut self,
        effects: Vec<Effect>,
        artifact: Option<&ArtifactId>,
        clock: Clock,
    ) -> Vec<Effect> {
        let mut out = Vec::with_capacity(effects.len());
        for effect in effects {
            match effect {
                Effect::LosePath {
                    key,
                    reason,
                    artifact,
                } => {
                    let fingerprint = self.fingerprint(&key);
                    self.life.clear_phase(&key);
                    self.life.retries.remove(&key);
                    self.life.losers.insert(
                        key.clone(),
                        PathLoser {
                            fingerprint,
                            artifact: artifact.clone(),
                        },
                    );
                    self.set_failed(&key, reason.clone());
                    self.work_moved(&key);
                    out.push(Effect::LosePath {
                        key,
                        reason,
                        artifact,
                    });
                }
                Effect::Served {
                    key,
                    store,
                    changed,
                } => {
                    self.life.clear_phase(&key);
                    self.life.retries.remove(&key);
                    self.work_moved(&key);
                    self.paths.update(&self.records, &key);
                    out.push(Effect::Served {
                        key,
                        store,
                        changed,
                    });
                }
                Effect::Fail { key, reason, retry } => {
                    self.life.clear_phase(&key);
                    let reason = self.fail(&key, reason, retry, clock);
                    out.push(Effect::Fail { key, reason, retry });
                }
                Effect::Wait { key, on, reason } => {
                    if let (Some(artifact), true) = (artifact, self.life.phases.contains_key(&key))
                    {
                        let phase = Phase::Waiting {
                            artifact: artifact.clone(),
                            on: on.clone(),
                        };
                        self.life.set_phase(&key, phase);
                    }
                    self.life
                        .waiting_on
                        .entry(on.clone())
                        .or_default()
                        .insert(key.clone());
                    out.push(Effect::Wait { key, on, reason });
                }
                Effect::Turn { key } => {
                    if let Some(loser) = self.life.losers.remove(&key) {
                        // Due at once: the executor reconciles its spec again now.
                        self.life.retries.insert(
                            key.clone(),
                            Retry {
                                fingerprint: loser.fingerprint,
                                attempts: 0,
                                at: clock.now,
                                space: false,
                            },
                        );
                        out.push(Effect::Turn { key });
                    }
                }
                Effect::Fetch { key, store, seed } => {
                    if let Some(artifact) = artifact {
                        let phase = Phase::Fetching {
                            artifact: artifact.clone(),
                            store: store.clone(),
                        };
                        self.life.set_phase(&key, phase);
                    }
                    out.push(Effect::Fetch { key, store, seed });
                }
                Effect::Stop { key } => {
                    self.life.clear_phase(&key);
                    out.push(Effect::Stop { key });
                }
                other => out.push(other),
            }
        }
        out
    }

    /// The verdict on a report of `key`'s work started for the spec with `fingerprint`. Work
    /// in progress is always for the recorded spec (a change updates the record first and
    /// stops the work), so the recorded fingerprint names it.
    fn work_reported(&self, key: ModelKey, fingerprint: &str) -> Vec<Effect> {
        if self.life.phases.contains_key(&key) && self.fingerprint(&key) == fingerprint {
            vec![Effect::Current { key }]
        } else {
            Vec::new()
        }
    }

    /// `key` is `Failed` with `reason`, retried as `retry` says; returns the reason as
    /// reported (a transient failure's says when it is retried).
    fn fail(
        &mut self,
        key: &ModelKey,
        mut reason: String,
        retry: RetryKind,
        clock: Clock,
    ) -> String {
        let fp = self.fingerprint(key);
        self.paths.update(&self.records, key);
        match retry {
            RetryKind::Space { .. } | RetryKind::DiskFull { .. } => {
                // Parked, not timed: the disk check makes it due once it fits.
                self.life.retries.insert(
                    key.clone(),
                    Retry {
                        fingerprint: fp,
                        attempts: 0,
                        at: parked(clock.now),
                        space: true,
                    },
                );
            }
            RetryKind::Permanent => {
                self.life.retries.remove(key);
            }
            RetryKind::Transient | RetryKind::MountRefused => {
                if retry == RetryKind::MountRefused {
                    self.count_refusal(key, &fp, clock.now);
                }
                let attempts = self
                    .life
                    .retries
                    .get(key)
                    .filter(|r| r.fingerprint == fp)
                    .map(|r| r.attempts + 1)
                    .unwrap_or(1);
                let delay =
                    super::retry_delay(self.retry_base, self.retry_max, attempts, clock.jitter);
                reason = format!("{reason} (retry {attempts} in {}s)", delay.as_secs().max(1));
                self.life.retries.insert(
                    key.clone(),
                    Retry {
                        fingerprint: fp,
                        attempts,
                        at: clock.now + delay,
                        space: false,
                    },
                );
            }
        }
        self.set_failed(key, reason.clone());
        self.work_moved(key);
        reason
    }

    /// Counts one more refusal of `key` by the mount server: serving the model in between
    /// ends its retry, so the count keeps the backoff growing while the server refuses it.
    fn count_refusal(&mut self, key: &ModelKey, fp: &str, now: Instant) {
        let refusals = match self.life.refusals.get(key) {
            Some((f, n)) if f == fp => n + 1,
            _ => 1,
        };
        self.life
            .refusals
            .insert(key.clone(), (fp.to_string(), refusals));
        if refusals > 1 {
            self.life.retries.insert(
                key.clone(),
                Retry {
                    fingerprint: fp.to_string(),
                    attempts: refusals - 1,
                    at: now,
                    space: false,
                },
            );
        }
    }

    fn set_failed(&mut self, key: &ModelKey, reason: String) {
        if let Some(mut rec) = self.records.model_mut(key) {
            rec.phase = ModelPhase::Failed;
            rec.reason = Some(reason);
        }
    }

    /// The fingerprint of `key`'s spec as recorded (work in progress always has it: a spec
    /// change updates the record before work starts).
    fn fingerprint(&self, key: &ModelKey) -> String {
        self.records
            .models()
            .get(key)
            .map(|r| r.fingerprint.clone())
            .unwrap_or_default()
    }

    /// `key`'s work moved on: the models waiting for it are placed again (one by one,
    /// [`Event::WakeNext`]).
    fn work_moved(&mut self, key: &ModelKey) {
        if let Some(waiters) = self.life.waiting_on.remove(key) {
            self.life.to_wake.extend(waiters);
        }
    }

    /// A spec seen (the desired state, a retry, a turn): whether it needs work, and the record
    /// made to say what it asks.
    fn spec_seen(
        &mut self,
        key: &ModelKey,
        spec: &SpecSummary,
        in_cache_view: bool,
        clock: Clock,
    ) -> Vec<Effect> {
        let fp = &spec.fingerprint;
        let mut out = Vec::new();
        if self.life.phases.contains_key(key) {
            // Work in progress is for the recorded spec (a change updates the record first).
            if self.fingerprint(key) == *fp {
                return out;
            }
            self.life.clear_phase(key);
            out.push(Effect::Stop { key: key.clone() });
            self.work_moved(key);
        }
        match self.life.losers.get(key) {
            // Its turn comes from the path rule, when it clears the model.
            Some(l) if l.fingerprint == *fp => return out,
            Some(_) => {
                self.life.losers.remove(key);
            }
            None => {}
        }
        let new = !self.records.models().contains_key(key);
        if new {
            let seq = self.records.allocate_model_seq();
            let mut rec = ModelRecord::new(
                seq,
                spec.name.clone(),
                spec.namespace.clone(),
                ModelPhase::Updating,
            );
            rec.fingerprint = fp.clone();
            rec.source = spec.source.clone();
            rec.policy = spec.policy;
            rec.path = spec.path.clone();
            rec.reserve = spec.reserve;
            self.records.insert_model(key.clone(), rec);
        } else if let Some(mut rec) = self.records.model_mut(key) {
            if rec.fingerprint == *fp {
                let again = match rec.phase {
                    // Served, but the view directory now covers its path (a changed flag).
                    ModelPhase::Ready => in_cache_view,
                    ModelPhase::Failed => match self.life.retries.get(key) {
                        Some(r) => r.fingerprint == *fp && r.at <= clock.now,
                        // Pending retries are not durable: a model recorded Failed before a
                        // restart gets one fresh attempt; a permanent failure then stays
                        // failed until its spec changes.
                        None => self.life.attempted_since_start.insert(key.clone()),
                    },
                    ModelPhase::Updating => true,
                };
                if !again {
                    return out;
                }
            } else {
                rec.fingerprint = fp.clone();
                rec.source = spec.source.clone();
                rec.policy = spec.policy;
                rec.path = spec.path.clone();
                rec.reserve = spec.reserve;
                rec.name = spec.name.clone();
                rec.namespace = spec.namespace.clone();
                rec.phase = ModelPhase::Updating;
                rec.reason = None;
                drop(rec);
                self.life.retries.remove(key);
            }
        }
        self.paths.update(&self.records, key);
        out.push(Effect::Start {
            key: key.clone(),
            new,
        });
        out
    }

    /// An object that cannot be a model: `Failed` with `reason` for good (until it changes),
    /// unmapped (its path may be what is invalid) but its own store kept: fixing the object
    /// must not cost a download, and its children keep being served.
    fn invalid(&mut self, key: &ModelKey, fingerprint: &str, reason: &str) -> Vec<Effect> {
        if self
            .records
            .models()
            .get(key)
            .is_some_and(|r| r.fingerprint == fingerprint)
        {
            return Vec::new();
        }
        self.life.clear_phase(key);
        self.work_moved(key);
        self.life.retries.remove(key);
        self.life.losers.remove(key);
        if !self.records.models().contains_key(key) {
            let seq = self.records.allocate_model_seq();
            let rec = ModelRecord::new(
                seq,
                key.name().to_owned(),
                key.namespace().map(str::to_owned),
                ModelPhase::Failed,
            );
            self.records.insert_model(key.clone(), rec);
        }
        let mut rec = self.records.model_mut(key).expect("model record");
        rec.fingerprint = fingerprint.to_string();
        rec.phase = ModelPhase::Failed;
        rec.reason = Some(reason.to_string());
        super::unmap(&mut rec);
        drop(rec);
        vec![
            Effect::Stop { key: key.clone() },
            Effect::Invalid {
                key: key.clone(),
                reason: reason.to_string(),
            },
        ]
    }

    /// The retries whose time has come, in key order.
    fn retries_due(&self, now: Instant) -> Vec<Effect> {
        let mut due: Vec<&ModelKey> = self
            .life
            .retries
            .iter()
            .filter(|(_, r)| r.at <= now)
            .map(|(k, _)| k)
            .collect();
        due.sort();
        due.into_iter()
            .map(|key| Effect::Retry { key: key.clone() })
            .collect()
    }

    /// The served models due for a periodic re-resolve (see [`Machine::with_refresh`]).
    fn refreshes_due(&mut self, now: Instant) -> Vec<Effect> {
        let Some(every) = self.refresh_every else {
            return Vec::new();
        };
        let mut due = Vec::new();
        for (key, rec) in self.records.models() {
            let ready = rec.phase == ModelPhase::Ready && rec.artifact.is_some();
            let may_change = || {
                SourceUri::parse(&rec.source)
                    .ok()
                    .is_some_and(|s| source_may_change(&s))
            };
            if !ready || self.life.phases.contains_key(key) || !may_change() {
                self.life.resolved_at.remove(key);
                continue;
            }
            let since = *self.life.resolved_at.entry(key.clone()).or_insert(now);
            if now.duration_since(since) >= every {
                due.push(key.clone());
            }
        }
        for key in &due {
            self.life.resolved_at.insert(key.clone(), now);
        }
        due.into_iter().map(|key| Effect::Refresh { key }).collect()
    }

    // ----- read-only questions --------------------------------------------------------------

    /// Models some other model waits for.
    pub fn waited_on(&self) -> impl Iterator<Item = &ModelKey> {
        self.life.waiting_on.keys()
    }

    /// The models waiting for `key`'s work.
    pub fn waiters_of(&self, key: &ModelKey) -> impl Iterator<Item = &ModelKey> {
        self.life.waiting_on.get(key).into_iter().flatten()
    }

    /// `key` lost the path rule and waits for it to clear.
    pub fn is_loser(&self, key: &ModelKey) -> bool {
        self.life.losers.contains_key(key)
    }

    /// The losers of the path rule.
    pub fn losers(&self) -> impl Iterator<Item = &ModelKey> {
        self.life.losers.keys()
    }

    /// The artifact `key` lost the path rule with, when known.
    pub fn loser_artifact(&self, key: &ModelKey) -> Option<&ArtifactId> {
        self.life.losers.get(key)?.artifact.as_ref()
    }

    /// `key`'s pending retry.
    pub fn retry_of(&self, key: &ModelKey) -> Option<&Retry> {
        self.life.retries.get(key)
    }

    /// `key` is `Failed` for space (refused by the budget, or its fetch hit a full disk) and
    /// parked until the disk has room: what the disk check looks at. Its retry made due by
    /// [`Event::SpaceFits`] keeps it so until the retry starts work.
    pub fn parked_for_space(&self, key: &ModelKey) -> bool {
        let failed = self
            .records
            .models()
            .get(key)
            .is_some_and(|r| r.phase == ModelPhase::Failed);
        failed && self.life.retries.get(key).is_some_and(|r| r.space)
    }

    /// What `key`'s work is doing, if it has work.
    pub fn phase(&self, key: &ModelKey) -> Option<&Phase> {
        self.life.phases.get(key)
    }

    /// `key`'s work is a periodic re-resolve (see [`Event::Resolving`]).
    pub fn is_refreshing(&self, key: &ModelKey) -> bool {
        self.life.refreshing.contains(key)
    }

    /// The models with work in progress.
    pub fn working(&self) -> impl Iterator<Item = (&ModelKey, &Phase)> {
        self.life.phases.iter()
    }
}
