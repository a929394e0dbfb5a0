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

use super::{decide, Effect, Event, PathIndex, RetryKind};
use crate::reconciler::records::{ModelPhase, ModelRecord, Records};
use modelfs_core::artifact::ArtifactId;
use modelfs_ome::{DownloadPolicy, ModelKey};

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
}

/// How far ahead the retry of a model refused for space is parked: never, in practice; the
/// disk check moves it to now once the model fits ([`Event::SpaceFits`]).
const SPACE_PARKED: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

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
        }
    }

    /// The one transition: what `event` at `clock` does to the state, and the effects the
    /// executor runs, in order (see the table in [`super`]).
    pub fn step(&mut self, event: Event, clock: Clock) -> Vec<Effect> {
        let mut pre = Vec::new();
        match &event {
            Event::Spec {
                key,
                spec,
                work,
                in_cache_view,
            } => return self.spec_seen(key, spec, work.as_deref(), *in_cache_view, clock),
            Event::Invalid {
                key,
                fingerprint,
                reason,
            } => return self.invalid(key, fingerprint, reason),
            Event::TimePassed => return self.retries_due(clock.now),
            Event::SpaceFits { keys } => {
                for key in keys {
                    if let Some(r) = self.life.retries.get_mut(key) {
                        r.at = clock.now;
                    }
                }
                return Vec::new();
            }
            Event::WorkMoved { key } => {
                self.work_moved(key);
                return Vec::new();
            }
            Event::WakeNext => {
                return self
                    .life
                    .to_wake
                    .pop_first()
                    .map(|key| Effect::Wake { key })
                    .into_iter()
                    .collect();
            }
            Event::Deleted { key } => {
                pre.push(Effect::Stop { key: key.clone() });
                self.life.retries.remove(key);
                self.life.refusals.remove(key);
                self.life.losers.remove(key);
            }
            Event::NoFiles { key, .. } => {
                pre.push(Effect::Stop { key: key.clone() });
                self.life.retries.remove(key);
            }
            _ => {}
        }
        let effects = decide(&mut self.records, &event).effects;
        pre.extend(effects);
        let out = self.lifecycle(pre, clock);
        if let Event::Deleted { key } | Event::NoFiles { key, .. } = &event {
            self.paths.update(&self.records, key);
            self.work_moved(key);
        }
        out
    }

    /// What the records' decision means for each model's lifecycle: retries scheduled or
    /// dropped, losers noted, waits registered. Returns the effects for the executor (a
    /// failure's reason says when it is retried).
    fn lifecycle(&mut self, effects: Vec<Effect>, clock: Clock) -> Vec<Effect> {
        let mut out = Vec::with_capacity(effects.len());
        for effect in effects {
            match effect {
                Effect::LosePath {
                    key,
                    reason,
                    artifact,
                } => {
                    let fingerprint = self.fingerprint(&key);
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
                    let reason = self.fail(&key, reason, retry, clock);
                    out.push(Effect::Fail { key, reason, retry });
                }
                Effect::Wait { key, on, reason } => {
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
                            },
                        );
                        out.push(Effect::Turn { key });
                    }
                }
                other => out.push(other),
            }
        }
        out
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
        work: Option<&str>,
        in_cache_view: bool,
        clock: Clock,
    ) -> Vec<Effect> {
        let fp = &spec.fingerprint;
        let mut out = Vec::new();
        if let Some(w) = work {
            if w == fp {
                return out;
            }
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
}
