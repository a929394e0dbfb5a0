//! The decision core: each model's lifecycle and what the records become when something
//! happens, with the disk work that needs. Pure: no I/O, no clock, no tasks, no random
//! numbers (time and jitter are arguments). Every rule of SPEC sections 3 and 4 lives here
//! (placement and single flight in [`placement`], the one path-conflict rule in [`paths`],
//! flips, hand-over, deletion, store splits, recovery and which stores are garbage below), and
//! so do each model's phase, its retries and their backoff, the losers of the path rule, the
//! refusals of the mount server and who waits for whom ([`machine`]).
//!
//! # One state, one transition
//! The state is one value, [`Machine`]: the records (with their own indexes), the index of
//! every model's paths ([`PathIndex`]) and each model's lifecycle bookkeeping (work phase,
//! pending retry, lost path, waits). The one entry point is [`Machine::step`]: an [`Event`]
//! and a [`Clock`] give the new state and the [`Effect`]s the executor
//! ([`super::Reconciler`]) runs, in order, on its own thread; outcomes come back as events (a
//! resolve's [`Event::ArtifactKnown`], a fetch's [`Event::Fetched`] or [`Event::Failed`], a
//! split's [`Event::SplitLinked`]). What only the world can tell comes in the event (an
//! artifact resolved, the disk's free space, which copies lack blobs, where a model's files
//! are and whether its node directory exists, whether its path lies in the cache view:
//! [`Observed`], the spec a finished resolve or fetch was started for); what the state tells
//! (path claims, work in flight for single flight, losers) the machine gathers itself.
//! Inside, a step applies the records-level rules ([`Fact`], `decide`) and then each model's
//! lifecycle to their effects (a failure schedules its retry, a lost path notes the loser, a
//! wait registers the waiter). Read-only questions (who is garbage, who is whose parent) are
//! plain functions over the records.
//!
//! # What happens to a model when X
//! A model is in one phase: *absent* (no record), *updating* (its spec needs work that has not
//! started), *resolving*, *waiting* (its artifact known, on another model's fetch of it or an
//! earlier model's resolve on its path), *fetching*, *serving* (`Ready`; also while a
//! periodic re-resolve runs), *failed* with a retry at a time (transient, refused by the
//! mount server: backoff doubling from the base; parked until the disk has room), *failed*
//! for good (until its spec changes), *loser* (failed, waiting for the path rule to clear it),
//! *invalid*, and *deleted* (its record gone; its store handed over or released). The
//! effects `Stop` (cancel its work) and `Remap` (rebuild the mapping at the end of the batch)
//! are implied where a row leaves work or changes what is served. Each row is a case of the
//! table test in `machine_tests.rs`.
//!
//! | phase | event | next phase | effects |
//! |---|---|---|---|
//! | absent | `Spec` | updating | `Start` (new) |
//! | updating | `Starting`, files elsewhere (`vendor://`, a node directory that exists) | serving, nothing mapped | as `NoFiles`, then `FilesElsewhere` |
//! | updating | `Starting`, files elsewhere, the node directory missing | as `Failed` (transient) | `Fail` |
//! | updating | `Starting`, its path in the cache view | failed (for good) | `Fail` (permanent) |
//! | updating | `Starting`, path clear (equal paths wait for the resolve) | updating | `Resolve` (a source that cannot be built: `Failed`) |
//! | updating | `Starting`, its path nests with an earlier model's | loser | `LosePath` |
//! | updating | `Resolving` | resolving | - |
//! | resolving, waiting | `ArtifactKnown`, an in-scope Ready holder (reuse) | serving | `Served`, `Remap` |
//! | resolving, waiting | `ArtifactKnown`, the artifact being fetched by another model | waiting | `Wait` |
//! | resolving | `ArtifactKnown`, an earlier model serves another artifact at its path | loser | `LosePath` |
//! | resolving, waiting | `ArtifactKnown`, nothing to reuse | fetching | `SaveRecords` (a new store), `Fetch` |
//! | resolving | `ArtifactKnown`, the fetch does not fit the disk budget | failed, parked | `Fail` (`Space`) |
//! | fetching | `Fetched` (its current work) | serving | `Served`, `Remap` |
//! | any | `Fetched` of a stale fetch | unchanged (the store records the artifact) | - |
//! | working | `WorkReported`, for its current work (the recorded fingerprint) | unchanged | `Current` (the executor handles the report) |
//! | any | `WorkReported`, stale (no work, or work for another spec) | unchanged | - (a stale fetch's artifact is recorded as data) |
//! | resolving, fetching | `Failed` (transient) | failed, retry at now + backoff | `Fail` (the reason says when) |
//! | resolving, fetching | `Failed` (permanent) | failed | `Fail` |
//! | fetching | `Failed` (disk full) | failed, parked | `Fail` |
//! | failed | `TimePassed`, retry due | failed | `Retry` (the executor sends `Spec`) |
//! | failed, retry due | `Spec` | failed (until `Starting`) | `Start` |
//! | failed, retry not due | `Spec` | failed | - |
//! | failed for good, after a restart | `Spec` | failed (until `Starting`) | `Start`, once |
//! | failed, parked | `SpaceFits` | failed, retry due now | - |
//! | serving | `Spec` unchanged | serving | - (`Start` if its path is now in the cache view) |
//! | any | `Spec` changed | updating | `Stop` (if working), `Start` |
//! | working | `Spec` unchanged | unchanged | - |
//! | serving, its source may change | `TimePassed`, not resolved for the refresh interval | serving | `Refresh` (the executor sends `Resolving`) |
//! | serving | `Resolving` (periodic) | serving, re-resolving | - |
//! | serving, re-resolving | `ArtifactKnown`, the artifact it serves | serving | `Stop` |
//! | serving, re-resolving | `ArtifactKnown`, a new artifact | fetching (still serving) | `Fetch` |
//! | serving, re-resolving or its fetch | `Failed` | serving | `Stop` (it only logs) |
//! | serving | `MountRefused` | failed, retry (the refusals counted across serving) | `Fail` (`MountRefused`), `Remap` |
//! | waiting | `WorkMoved` / `Failed` / `Served` of the model it waits on, then `WakeNext` | waiting | `Wake` (the executor sends `ArtifactKnown`) |
//! | loser | `SettlePaths`, the rule clears it | failed, retry due now | `Turn` (the executor sends `Spec`) |
//! | loser | `Spec` unchanged | loser | - |
//! | serving | `SettlePaths`, an earlier model now claims its path | loser | `LosePath`, `Remap` |
//! | any | `Deleted` | absent (deleted) | `Stop`, hand-over or release effects, `Remap` |
//! | any | `NoFiles` (`vendor://`, a node directory) | serving, nothing mapped | `Stop`, `Remap` |
//! | any | `Invalid` (a new reason) | invalid | `Stop`, `Invalid` |
//! | invalid | `Invalid` (the same reason) | invalid | - |

pub mod index;
pub mod machine;
#[cfg(test)]
mod machine_tests;
pub mod paths;
pub mod placement;
pub mod space;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::reconciler::records::{ModelPhase, ModelRecord, Records};
use modelfs_core::artifact::ArtifactId;
use modelfs_core::store::StoreId;
use modelfs_ome::{DownloadPolicy, ModelKey, MountPath};

pub use index::PathIndex;
pub use machine::{Clock, Event, Failure, Files, Machine, Observed, Phase, SpecSummary};
pub use paths::{path_verdicts, ClaimArtifact, ClaimKind, PathClaim, PathVerdict};
pub use placement::{in_scope, place, reuse_candidates, InFlight, Placement};
pub use space::Space;

/// What the actor does for a decision, in the order given, before the next event, so a
/// decision can rely on them (and on the records saved before them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Write the records now: a store directory is created next, and a crash must never leave
    /// a directory that no record names (garbage collection would rightly remove it).
    SaveRecords,
    /// Hard-link the blobs of `artifacts` from one store into a new one, then report the
    /// outcome ([`Event::SplitLinked`]).
    LinkStore(Split),
    /// Fetch the model's artifact into `store` (created if needed; blobs `seed` already holds
    /// are hard-linked from it), then report [`Event::Fetched`].
    Fetch {
        key: ModelKey,
        store: StoreId,
        seed: Option<StoreId>,
    },
    /// `key` waits, its artifact known, until `on`'s work moves on; then it is placed again.
    Wait {
        key: ModelKey,
        on: ModelKey,
        reason: WaitReason,
    },
    /// `key` lost the path rule: `Failed` with `reason` (naming the winner), its work stopped,
    /// waiting without retries until the rule clears it (with `artifact`, when known, it keeps
    /// competing for the path).
    LosePath {
        key: ModelKey,
        reason: String,
        artifact: Option<ArtifactId>,
    },
    /// `key` is served from `store` now (recorded): its work is done. `changed`: what it serves
    /// changed.
    Served {
        key: ModelKey,
        store: StoreId,
        changed: bool,
    },
    /// The records changed what is served: rebuild the mapping (once, at the end of the batch).
    Remap,
    /// `key` failed with `reason`; retried as `retry` says.
    Fail {
        key: ModelKey,
        reason: String,
        retry: RetryKind,
    },
    /// The records forgot that `store` holds `artifact` (its blobs are not all on disk).
    Forgotten {
        store: StoreId,
        artifact: ArtifactId,
    },
    /// The path rule clears `key`, which lost it before: it gets its turn (its spec is
    /// reconciled again at once).
    Turn { key: ModelKey },
    /// Stop `key`'s work in progress (cancel its resolve or fetch).
    Stop { key: ModelKey },
    /// `key`'s spec needs work (its record says what it asks; `new`: just created): the
    /// executor checks what only the world can tell (the source, a node directory) and
    /// starts the resolve, or places the served artifact again.
    Start { key: ModelKey, new: bool },
    /// `key`'s object is invalid: `Failed` with `reason` until it changes, unmapped.
    Invalid { key: ModelKey, reason: String },
    /// `key`'s retry is due: its spec is reconciled again.
    Retry { key: ModelKey },
    /// `key` is served and due for a periodic re-resolve (see [`Machine::with_refresh`]).
    Refresh { key: ModelKey },
    /// `key` waited for a model whose work moved on: it is placed again.
    Wake { key: ModelKey },
    /// `key`'s path is clear ([`Event::Starting`]): the executor resolves its source (or
    /// places the served artifact again when only the policy or path changed); a source that
    /// cannot be built is reported as [`Event::Failed`].
    Resolve { key: ModelKey },
    /// `key` is served without files of the mount ([`Files::Elsewhere`]): the executor reads
    /// its node directory's config again and wakes the models waiting for it.
    FilesElsewhere { key: ModelKey },
    /// The report of `key`'s work is for its current work ([`Event::WorkReported`]): the
    /// executor handles it (a stale one it only records as data, if a fetch completed).
    Current { key: ModelKey },
}

/// An event as the records-level rules see it: [`Machine::step`] adds to its [`Event`] what
/// the rules need of the rest of its state (work in flight, the path claims of the models whose
/// paths nest with the model's, which models work or lost the path rule).
#[derive(Clone, Debug)]
pub enum Fact {
    /// `key`'s artifact is known (resolved, or the served one when only the policy or path
    /// changed): place it (SPEC 3.1, 3.2; the path rule of section 4 first).
    ArtifactKnown {
        key: ModelKey,
        want: Want,
        in_flight: InFlight,
        /// Claims of the models whose paths nest with `want.path` (see [`claims`]).
        claims: Vec<PathClaim>,
        /// The disk as a fetch would find it (`None`: no budget is checked); see [`space`].
        space: Option<Space>,
    },
    /// A fetch into `store` completed with `artifact` verified. `want`: what the model's
    /// spec asks, when the fetch is still its work (a stale fetch is recorded as data, never
    /// served).
    Fetched {
        key: ModelKey,
        store: StoreId,
        artifact: ArtifactId,
        want: Option<Want>,
        claims: Vec<PathClaim>,
    },
    /// The model's object is gone (SPEC 3.3).
    Deleted { key: ModelKey },
    /// A model whose source carries no files (`vendor://`): Ready at once, nothing mapped.
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
    /// After a batch of events (and at start-up): the path rule over every claim of the state
    /// (see `settle_paths`). `working`: models with work in progress; `losers`: models
    /// waiting for the rule to clear them.
    SettlePaths {
        claims: Vec<PathClaim>,
        working: BTreeSet<ModelKey>,
        losers: BTreeSet<ModelKey>,
    },
    /// The mount server left the entries of these models out of the mapping, with its reason.
    /// `incomplete`: the (store, artifact) pairs they are served from whose blobs are not all
    /// on disk; `working`: those of them with a change in progress.
    MountRefused {
        refused: Vec<(ModelKey, String)>,
        incomplete: BTreeSet<(StoreId, ArtifactId)>,
        working: BTreeSet<ModelKey>,
    },
}

/// What a model's spec asks to serve once its artifact is known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Want {
    pub policy: DownloadPolicy,
    pub artifact: ArtifactId,
    /// Resolved revision, reported as `artifact.sha`.
    pub sha: String,
    pub path: MountPath,
    pub source: String,
    /// Digest of the spec's `parameters` (none when there are none).
    pub parameters: Option<String>,
}

/// What a decision changed and what the actor must do, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    pub effects: Vec<Effect>,
}

impl Decision {
    fn push(&mut self, e: Effect) {
        self.effects.push(e);
    }
}

/// What `event` does to the records (changed in place) and the effects that follow, in order,
/// before [`Machine::step`] adds each model's lifecycle (retries, losers, waits). Pure: no
/// I/O, no clock.
fn decide(records: &mut Records, event: &Fact) -> Decision {
    let mut d = Decision::default();
    match event {
        Fact::ArtifactKnown {
            key,
            want,
            in_flight,
            claims,
            space,
        } => {
            if let Some(stop) = path_rule(records, key, want, claims) {
                d.push(stop);
                return d;
            }
            match place(records, key, want.policy, &want.artifact, in_flight) {
                Placement::Serve(store) => serve_effects(records, key, store, want, &mut d),
                Placement::Wait(on) => d.push(Effect::Wait {
                    key: key.clone(),
                    on,
                    reason: WaitReason::SameArtifact,
                }),
                Placement::Fetch => {
                    // Admission (SPEC 12): a fetch that cannot fit is not started, and no
                    // store is allocated for it.
                    if let Some(space) = space.filter(|s| !s.fits()) {
                        d.push(Effect::Fail {
                            key: key.clone(),
                            reason: space::insufficient_reason(&space),
                            retry: RetryKind::Space {
                                needed: space.needed,
                            },
                        });
                        return d;
                    }
                    let target = fetch_target(records, key, &want.artifact);
                    d.effects.extend(target.effects);
                    d.push(Effect::Fetch {
                        key: key.clone(),
                        store: target.store,
                        seed: target.seed,
                    });
                }
            }
        }
        Fact::Fetched {
            key,
            store,
            artifact,
            want,
            claims,
        } => {
            // A complete, verified artifact is real data whether or not the model still
            // wants it: the store holds it (a waiter may map onto it).
            if let Some(mut s) = records.store_mut(store) {
                s.artifacts.insert(artifact.clone());
            }
            let Some(want) = want else {
                return d;
            };
            // The path rule again, atomically with the flip: an earlier model may have
            // claimed the path while this one was fetching.
            if let Some(stop) = path_rule(records, key, want, claims) {
                d.push(stop);
                return d;
            }
            serve_effects(records, key, store.clone(), want, &mut d);
        }
        Fact::Deleted { key } => {
            d.effects = delete(records, key);
            d.push(Effect::Remap);
        }
        Fact::NoFiles { key, source } => {
            d.effects = serve_without_files(records, key, source.clone());
            d.push(Effect::Remap);
        }
        Fact::SplitLinked { split, result } => finish_split(records, split, result.clone()),
        Fact::Recovered { incomplete } => {
            for (store, artifact) in recover(records, |a, s| {
                !incomplete.contains(&(s.clone(), a.clone()))
            }) {
                d.push(Effect::Forgotten { store, artifact });
            }
        }
        Fact::MountRefused {
            refused,
            incomplete,
            working,
        } => mount_refused(records, refused, incomplete, working, &mut d),
        Fact::SettlePaths {
            claims,
            working,
            losers,
        } => settle_paths(records, claims, working.clone(), losers.clone(), &mut d),
    }
    d
}

/// The path rule over the whole state: a served model that now loses (an earlier model
/// resolved to another artifact on its path, or records from before the rule hold two) is
/// unmapped and loses the path (its own store, and any child on it, is kept: getting its turn
/// back costs no download); a model whose work now loses stops; a loser the rule clears (the
/// model it lost to went away, moved or changed) gets its turn. Claims are judged in order,
/// each seeing the outcome of the ones before.
fn settle_paths(
    records: &mut Records,
    claims: &[PathClaim],
    mut working: BTreeSet<ModelKey>,
    mut losers: BTreeSet<ModelKey>,
    d: &mut Decision,
) {
    let verdicts = path_verdicts(claims);
    let mut turns = Vec::new();
    let mut remap = false;
    for (c, v) in claims.iter().zip(verdicts) {
        match (c.kind, v) {
            (ClaimKind::Served, PathVerdict::Conflict { reason, .. }) => {
                let Some(mut rec) = records.model_mut(&c.key) else {
                    continue;
                };
                let artifact = rec.artifact.clone();
                unmap(&mut rec);
                remap = true;
                tracing::warn!(model = %c.key, reason, "served model loses a path conflict; unmapped");
                if working.contains(&c.key) {
                    // A change in progress decides again (through the rule) when resolved.
                    rec.reason = Some(reason);
                } else {
                    drop(rec);
                    losers.insert(c.key.clone());
                    d.push(Effect::LosePath {
                        key: c.key.clone(),
                        reason,
                        artifact,
                    });
                }
            }
            (ClaimKind::Wanted, PathVerdict::Conflict { reason, .. }) => {
                if working.remove(&c.key) {
                    let artifact = match &c.artifact {
                        ClaimArtifact::Known(a) => Some(a.clone()),
                        _ => None,
                    };
                    losers.insert(c.key.clone());
                    d.push(Effect::LosePath {
                        key: c.key.clone(),
                        reason,
                        artifact,
                    });
                } else if losers.contains(&c.key) {
                    // Still losing, maybe to another model now: keep the reason current.
                    if let Some(mut rec) = records.model_mut(&c.key) {
                        rec.reason = Some(reason);
                    }
                }
            }
            (ClaimKind::Wanted, PathVerdict::Clear) if losers.contains(&c.key) => {
                turns.push(c.key.clone());
            }
            _ => {}
        }
    }
    if remap {
        d.push(Effect::Remap);
    }
    for key in turns {
        d.push(Effect::Turn { key });
    }
}

/// Why a model waits for another's work.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WaitReason {
    /// Single flight: the other fetches the same artifact.
    SameArtifact,
    /// The path rule: an earlier model on the same path is still resolving.
    EarlierOnPath,
}

/// The path rule for `key` serving `want`: `None` when clear, else the effect that stops it.
fn path_rule(
    records: &Records,
    key: &ModelKey,
    want: &Want,
    claims: &[PathClaim],
) -> Option<Effect> {
    let seq = records.models().get(key).map_or(u64::MAX, |r| r.seq);
    match verdict_for(
        claims.to_vec(),
        key,
        seq,
        &want.path,
        ClaimArtifact::Known(want.artifact.clone()),
    ) {
        PathVerdict::Clear => None,
        PathVerdict::Wait { on } => Some(Effect::Wait {
            key: key.clone(),
            on,
            reason: WaitReason::EarlierOnPath,
        }),
        PathVerdict::Conflict { reason, .. } => Some(Effect::LosePath {
            key: key.clone(),
            reason,
            artifact: Some(want.artifact.clone()),
        }),
    }
}

/// The flip: `key` is served from `store` (see [`serve`]).
fn serve_effects(
    records: &mut Records,
    key: &ModelKey,
    store: StoreId,
    want: &Want,
    d: &mut Decision,
) {
    let (changed, effects) = serve(
        records,
        key,
        Serve {
            store: store.clone(),
            artifact: want.artifact.clone(),
            sha: want.sha.clone(),
            path: want.path.to_string(),
            source: want.source.clone(),
            parameters: want.parameters.clone(),
        },
    );
    d.push(Effect::Served {
        key: key.clone(),
        store,
        changed,
    });
    d.effects.extend(effects);
    d.push(Effect::Remap);
}

/// The mount server refused to serve these models: each is unmapped and failed with the
/// server's reason (retried). A copy that really lacks blobs forgets the artifact, so the
/// retry fetches what is missing instead of being refused again, and every model served from
/// that copy fails with it. A model with a change in progress is only unmapped: the change
/// serves it anew.
fn mount_refused(
    records: &mut Records,
    refused: &[(ModelKey, String)],
    incomplete: &BTreeSet<(StoreId, ArtifactId)>,
    working: &BTreeSet<ModelKey>,
    d: &mut Decision,
) {
    let mut failed: BTreeMap<ModelKey, String> = BTreeMap::new();
    for (key, server_reason) in refused {
        let Some(rec) = records.models().get(key) else {
            continue;
        };
        let (Some(artifact), Some(store)) = (rec.artifact.clone(), rec.store.clone()) else {
            continue;
        };
        let reason = format!("the mount server refused to serve it: {server_reason}");
        if incomplete.contains(&(store.clone(), artifact.clone())) {
            if let Some(mut s) = records.store_mut(&store) {
                if s.artifacts.remove(&artifact) {
                    d.push(Effect::Forgotten {
                        store: store.clone(),
                        artifact: artifact.clone(),
                    });
                }
            }
            for user in records.users_of(&store) {
                if records.models()[user].artifact.as_ref() == Some(&artifact) {
                    failed.entry(user.clone()).or_insert_with(|| reason.clone());
                }
            }
        }
        failed.entry(key.clone()).or_insert(reason);
    }
    if failed.is_empty() {
        return;
    }
    for (key, reason) in failed {
        if let Some(mut rec) = records.model_mut(&key) {
            unmap(&mut rec);
        }
        if !working.contains(&key) {
            d.push(Effect::Fail {
                key,
                reason,
                retry: RetryKind::MountRefused,
            });
        }
    }
    d.push(Effect::Remap);
}

/// How a failure is retried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryKind {
    /// With backoff, counting attempts while the spec stays the same.
    Transient,
    /// Transient, counting the refusals of the mount server (serving the model in between
    /// does not reset the backoff).
    MountRefused,
    /// The fetch, which writes `needed` bytes, does not fit under the disk budget: what
    /// nothing serves is reclaimed, and it is retried as soon as it fits (see [`space`]).
    Space { needed: u64 },
    /// The fetch hit a full disk: retried as a [`RetryKind::Space`] refusal is, once `needed`
    /// bytes fit.
    DiskFull { needed: u64 },
    /// Not retried: the spec must change.
    Permanent,
}

/// Users of one store that move to a store of their own (see [`hand_over_or_release`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Split {
    pub from: StoreId,
    pub to: StoreId,
    /// The models that move, in key order; the first owns the new store.
    pub members: Vec<ModelKey>,
    /// What they serve: the blobs of these artifacts are linked.
    pub artifacts: BTreeSet<ArtifactId>,
}

/// The model leaves the mount: it serves nothing (its own store, if any, is kept, and so are
/// children served from it).
pub fn unmap(rec: &mut ModelRecord) {
    rec.artifact = None;
    rec.sha = None;
    rec.store = None;
    rec.served_path = None;
    rec.served_source = None;
    rec.served_parameters = None;
}

/// Where a model is served from, once a decision to serve it is made.
#[derive(Clone, Debug)]
pub struct Serve {
    pub store: StoreId,
    pub artifact: ArtifactId,
    /// Resolved revision reported as `artifact.sha`.
    pub sha: String,
    /// The spec's path, source and parameters digest, now served.
    pub path: String,
    pub source: String,
    pub parameters: Option<String>,
}

/// Records that `key` is served from `serve.store` (which holds the artifact complete): the
/// flip of SPEC section 3.2. If the model moved away from its own store (T-02, T-04), the
/// children of that store that the new store can serve move with it (no chains of parents)
/// and the old store is handed over or released. Returns whether what the model serves changed,
/// and the effects.
pub fn serve(records: &mut Records, key: &ModelKey, serve: Serve) -> (bool, Vec<Effect>) {
    let own = records.owned_store(key).cloned();
    let store = serve.store.clone();
    let changed = {
        let Some(mut rec) = records.model_mut(key) else {
            return (false, Vec::new());
        };
        let before = (
            rec.store.clone(),
            rec.artifact.clone(),
            rec.served_path.clone(),
        );
        rec.artifact = Some(serve.artifact);
        rec.sha = Some(serve.sha);
        rec.store = Some(store.clone());
        rec.served_path = Some(serve.path);
        rec.served_source = Some(serve.source);
        rec.served_parameters = serve.parameters;
        rec.phase = ModelPhase::Ready;
        rec.reason = None;
        before
            != (
                rec.store.clone(),
                rec.artifact.clone(),
                rec.served_path.clone(),
            )
    };
    // A reserved store that has no owner is adopted by its first user.
    if let Some(mut s) = records.store_mut(&store) {
        if s.owner.is_none() {
            s.owner = Some(key.clone());
            s.reserved = false;
            s.reserved_at = None;
        }
    }
    let mut effects = Vec::new();
    if let Some(own) = own.filter(|o| *o != store) {
        let target_artifacts = records
            .stores()
            .get(&store)
            .map(|s| s.artifacts.clone())
            .unwrap_or_default();
        let users: Vec<ModelKey> = records.users_of(&own).into_iter().cloned().collect();
        for u in users {
            let mut m = records.model_mut(&u).expect("user record");
            if m.artifact
                .as_ref()
                .is_some_and(|a| target_artifacts.contains(a))
            {
                m.store = Some(store.clone());
            }
        }
        effects = hand_over_or_release(records, &own, key, false);
    }
    prune_store_artifacts(records, &store);
    (changed, effects)
}

/// The owner `key` leaves `store`. Ownership passes to a remaining user, deterministically: the
/// smallest ClusterBaseModel key (in every user's reuse scope), else the smallest key. Users
/// outside the new owner's scope (BaseModels of other namespaces) get a store of their own per
/// namespace, made of hard links to the same blobs ([`Effect::LinkStore`]): no bytes move, and
/// no model is ever reported as the child of another tenant's model. With no user left the
/// store is released (reserved if the leaving owner carried the reserve label).
pub fn hand_over_or_release(
    records: &mut Records,
    store: &StoreId,
    key: &ModelKey,
    reserve: bool,
) -> Vec<Effect> {
    let users: Vec<ModelKey> = records
        .users_of(store)
        .into_iter()
        .filter(|u| *u != key)
        .cloned()
        .collect();
    let ns_of = |r: &Records, k: &ModelKey| r.models().get(k).and_then(|m| m.namespace.clone());
    let leaving_ns = ns_of(records, key);
    let next = users
        .iter()
        .find(|u| ns_of(records, u).is_none())
        .or_else(|| users.first())
        .cloned();
    let Some(next) = next else {
        // Where the leaving owner was served from this store: a reserved store keeps it.
        let placement = records.models().get(key).and_then(|m| {
            let path = m.served_path.clone()?;
            let artifact = m.artifact.clone()?;
            (m.store.as_ref() == Some(store))
                .then_some(crate::reconciler::records::ReservedPlacement { path, artifact })
        });
        if let Some(mut s) = records.store_mut(store) {
            s.owner = None;
            s.reserved = reserve;
            s.reserved_at = placement.filter(|_| reserve);
            s.last_owner_namespace = leaving_ns;
            tracing::info!(%store, reserved = reserve, "store released");
        }
        return Vec::new();
    };
    tracing::info!(%store, from = %key, to = %next, "store ownership passes to a child");
    if let Some(mut s) = records.store_mut(store) {
        s.owner = Some(next.clone());
    }
    let owner_ns = ns_of(records, &next);
    let mut groups: BTreeMap<String, Vec<ModelKey>> = BTreeMap::new();
    for u in users {
        if let Some(ns) = ns_of(records, &u) {
            if !in_scope(Some(&ns), owner_ns.as_deref()) {
                groups.entry(ns).or_default().push(u);
            }
        }
    }
    let mut effects = Vec::new();
    for (_, members) in groups {
        let split = begin_split(records, store, members);
        effects.push(Effect::SaveRecords);
        effects.push(Effect::LinkStore(split));
    }
    effects
}

/// Allocates the store that `members` (users of `from`, one namespace, in key order) move to;
/// they keep being served from `from` until [`finish_split`] reports the links made.
fn begin_split(records: &mut Records, from: &StoreId, members: Vec<ModelKey>) -> Split {
    let artifacts: BTreeSet<ArtifactId> = members
        .iter()
        .filter_map(|m| records.models().get(m).and_then(|r| r.artifact.clone()))
        .collect();
    let to = records.allocate_store(&members[0]);
    Split {
        from: from.clone(),
        to,
        members,
        artifacts,
    }
}

/// The outcome of an [`Effect::LinkStore`] ([`Fact::SplitLinked`]): the members move to their new store, or (it could
/// not be made) they stay where they are and the new store is released (garbage).
pub fn finish_split(records: &mut Records, split: &Split, linked: Result<(), String>) {
    match linked {
        Ok(()) => {
            if let Some(mut rec) = records.store_mut(&split.to) {
                rec.artifacts = split.artifacts.clone();
            }
            for m in &split.members {
                if let Some(mut r) = records.model_mut(m) {
                    r.store = Some(split.to.clone());
                }
            }
            tracing::info!(from = %split.from, to = %split.to, owner = %split.members[0], "out-of-scope children moved to their own store (hard links)");
        }
        Err(e) => {
            // They keep being served from the old store; only the reported parent is off.
            tracing::error!(store = %split.to, error = %e, "could not split a store by namespace");
            if let Some(mut rec) = records.store_mut(&split.to) {
                rec.owner = None;
            }
        }
    }
}

/// Forgets artifacts of a store that none of its users serves any more (an old revision): they
/// no longer qualify the store as a reuse holder of that artifact.
pub fn prune_store_artifacts(records: &mut Records, store: &StoreId) {
    let served: BTreeSet<ArtifactId> = records
        .users_of(store)
        .into_iter()
        .filter_map(|k| records.models().get(k).and_then(|m| m.artifact.clone()))
        .collect();
    if served.is_empty() {
        return;
    }
    if let Some(mut s) = records.store_mut(store) {
        s.artifacts.retain(|a| served.contains(a));
    }
}

/// The store to fetch into, and what to do first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FetchTarget {
    pub store: StoreId,
    /// A store to hard-link known blobs from (the model's previous store, handed to children).
    pub seed: Option<StoreId>,
    pub effects: Vec<Effect>,
}

/// The store to fetch `artifact` into for `key`. Normally the model's own store (blobs it
/// already has are kept, so a new revision fetches only changed files). But if other models
/// are served from that store with another artifact (children still on the old revision), the
/// store is handed to them now, no byte moving, and the new revision goes into a fresh store
/// seeded from the old one: a parent never holds a different artifact than its children.
pub fn fetch_target(records: &mut Records, key: &ModelKey, artifact: &ArtifactId) -> FetchTarget {
    let Some(own) = records.owned_store(key).cloned() else {
        let store = records.allocate_store(key);
        return FetchTarget {
            store,
            seed: None,
            effects: vec![Effect::SaveRecords],
        };
    };
    let split = records.users_of(&own).into_iter().any(|u| {
        u != key && records.models().get(u).and_then(|m| m.artifact.as_ref()) != Some(artifact)
    });
    if !split {
        return FetchTarget {
            store: own,
            seed: None,
            effects: Vec::new(),
        };
    }
    let mut effects = hand_over_or_release(records, &own, key, false);
    let store = records.allocate_store(key);
    effects.push(Effect::SaveRecords);
    tracing::info!(model = %key, old = %own, new = %store, "children keep the old revision's store; fetching into a new one");
    FetchTarget {
        store,
        seed: Some(own),
        effects,
    }
}

/// Deletion of `key` (SPEC section 3.3): its record goes; a store it owns passes to one of its
/// children (the others follow in the status, no bytes move) or, with no user left, is released
/// (kept as reserved under the reserve label, else garbage after the grace period).
pub fn delete(records: &mut Records, key: &ModelKey) -> Vec<Effect> {
    let own = records.owned_store(key).cloned();
    let reserve = records.models().get(key).is_some_and(|m| m.reserve);
    let effects = match own {
        Some(own) => hand_over_or_release(records, &own, key, reserve),
        None => Vec::new(),
    };
    records.remove_model(key);
    effects
}

/// A model that serves no files (`vendor://`): Ready at once, nothing mapped; a copy it owned
/// before is handed to its children or released.
pub fn serve_without_files(records: &mut Records, key: &ModelKey, source: String) -> Vec<Effect> {
    let mut effects = Vec::new();
    if let Some(own) = records.owned_store(key).cloned() {
        let reserve = records.models().get(key).is_some_and(|m| m.reserve);
        effects = hand_over_or_release(records, &own, key, reserve);
    }
    if let Some(mut rec) = records.model_mut(key) {
        unmap(&mut rec);
        rec.served_source = Some(source);
        rec.phase = ModelPhase::Ready;
        rec.reason = None;
    }
    effects
}

/// Makes records consistent with the disk after a crash. `complete(artifact, store)` says
/// whether every blob of the artifact is in the store. An incomplete artifact is forgotten by
/// its store; a placement on one is dropped (the model is `Updating` and fetched again;
/// verified blobs present are reused); a store whose owner record is gone loses its owner.
/// Returns the forgotten (store, artifact) pairs.
pub fn recover(
    records: &mut Records,
    mut complete: impl FnMut(&ArtifactId, &StoreId) -> bool,
) -> Vec<(StoreId, ArtifactId)> {
    let mut forgotten = Vec::new();
    let ids: Vec<StoreId> = records.stores().keys().cloned().collect();
    for id in &ids {
        let incomplete: Vec<ArtifactId> = records.stores()[id]
            .artifacts
            .iter()
            .filter(|a| !complete(a, id))
            .cloned()
            .collect();
        if incomplete.is_empty() {
            continue;
        }
        let mut store = records.store_mut(id).expect("store record");
        for a in incomplete {
            store.artifacts.remove(&a);
            forgotten.push((id.clone(), a));
        }
    }
    let stores = records.stores();
    let dropped: Vec<ModelKey> = records
        .models()
        .iter()
        .filter(|(_, rec)| match (&rec.artifact, &rec.store) {
            (Some(a), Some(s)) => !stores.get(s).is_some_and(|st| st.artifacts.contains(a)),
            (None, None) => false,
            _ => true,
        })
        .map(|(k, _)| k.clone())
        .collect();
    for key in &dropped {
        let mut rec = records.model_mut(key).expect("model record");
        unmap(&mut rec);
        rec.phase = ModelPhase::Updating;
    }
    // Owner records are removed atomically with the hand-over, so this only repairs
    // hand-edited records.
    let models = records.models();
    let orphaned: Vec<StoreId> = records
        .stores()
        .iter()
        .filter(|(_, s)| s.owner.as_ref().is_some_and(|o| !models.contains_key(o)))
        .map(|(id, _)| id.clone())
        .collect();
    for id in &orphaned {
        records.store_mut(id).expect("store record").owner = None;
    }
    forgotten
}

/// Stores that garbage collection may remove (SPEC section 3.3): no owner, not reserved, no
/// model served from them, and not `busy` (an open file, a mapping not yet retired, a fetch).
pub fn garbage_stores(records: &Records, busy: impl Fn(&StoreId) -> bool) -> Vec<StoreId> {
    records
        .stores()
        .iter()
        .filter(|(id, s)| {
            s.owner.is_none() && !s.reserved && records.user_count(id) == 0 && !busy(id)
        })
        .map(|(id, _)| id.clone())
        .collect()
}

/// The parent of `key` as reported (SPEC section 2): the owner of the store it is served from.
pub fn parent_of<'a>(records: &'a Records, key: &ModelKey) -> Option<&'a ModelKey> {
    let store = records.models().get(key)?.store.as_ref()?;
    records.stores().get(store)?.owner.as_ref()
}

/// The children of `key`: the other models served from the store it owns and is served from.
pub fn children_of<'a>(records: &'a Records, key: &ModelKey) -> Vec<&'a ModelKey> {
    let Some(own) = records.owned_store(key) else {
        return Vec::new();
    };
    if records.models().get(key).and_then(|m| m.store.as_ref()) != Some(own) {
        return Vec::new();
    }
    records
        .users_of(own)
        .into_iter()
        .filter(|u| *u != key)
        .collect()
}

/// The delay before retry number `attempts` of a transient failure: `base` doubling per
/// attempt up to `max`, scaled by `jitter` (0..1 maps to 50..100%; see [`crate::retry`]), so a
/// node full of failing models does not retry in lockstep.
pub fn retry_delay(base: Duration, max: Duration, attempts: u32, jitter: f64) -> Duration {
    // The first retry already waits twice `base`: `base` is the delay of a failure's own
    // attempt, which the model has had.
    crate::retry::Backoff::new(base, max).jittered(attempts.saturating_add(1), jitter)
}

/// What a model's work claims on its wanted path, as the reconciler knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wanted {
    /// Work is in progress for the model's spec (then a served claim on the spec's path does
    /// not settle it).
    pub working: bool,
    pub artifact: ClaimArtifact,
}

/// Every model's claims on paths below the mount, for [`path_verdicts`]: where it is served
/// (with the served artifact) and, if different, where its spec wants it (with the artifact of
/// its work, from `wanted`). Invalid models claim nothing.
pub fn claims<'a>(
    records: &Records,
    keys: impl IntoIterator<Item = &'a ModelKey>,
    wanted: impl Fn(&ModelKey) -> Wanted,
) -> Vec<PathClaim> {
    let mut out = Vec::new();
    for key in keys {
        let Some(rec) = records.models().get(key) else {
            continue;
        };
        if rec.fingerprint.starts_with("invalid:") {
            continue;
        }
        let served = match (&rec.artifact, &rec.store, &rec.served_path) {
            (Some(a), Some(_), Some(p)) => MountPath::from_relative(p)
                .ok()
                .map(|path| (path, a.clone())),
            _ => None,
        };
        let w = wanted(key);
        let wanted_path = MountPath::from_relative(&rec.path).ok();
        let settled = !w.working && served.as_ref().map(|s| &s.0) == wanted_path.as_ref();
        if let Some((path, artifact)) = served {
            out.push(PathClaim {
                key: key.clone(),
                seq: rec.seq,
                kind: ClaimKind::Served,
                path,
                artifact: ClaimArtifact::Known(artifact),
            });
        }
        if let Some(path) = wanted_path.filter(|_| !settled) {
            out.push(PathClaim {
                key: key.clone(),
                seq: rec.seq,
                kind: ClaimKind::Wanted,
                path,
                artifact: w.artifact,
            });
        }
    }
    out
}

/// The rule's verdict on `key` serving `artifact` at `path` (its wanted claim) against `others`
/// (the claims of the models it could conflict with; its own wanted claim among them is
/// replaced).
pub fn verdict_for(
    mut others: Vec<PathClaim>,
    key: &ModelKey,
    seq: u64,
    path: &MountPath,
    artifact: ClaimArtifact,
) -> PathVerdict {
    others.retain(|c| !(c.key == *key && c.kind == ClaimKind::Wanted));
    others.push(PathClaim {
        key: key.clone(),
        seq,
        kind: ClaimKind::Wanted,
        path: path.clone(),
        artifact,
    });
    path_verdicts(&others).pop().unwrap_or(PathVerdict::Clear)
}
