//! Running the decision core's effects: each [`decide::Effect`] becomes a cancelled task, a
//! started fetch, a linked store, a log line, a mapping rebuilt at the end of the batch.
//! Nothing here decides: the core's answer is carried out, and outcomes go back to it as
//! events.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use super::decide::{self, Clock, Effect, RetryKind};
use super::spec::ome_labels;
use super::{Reconciler, Stage};
use crate::source::SourceError;
use modelfs_core::artifact::Manifest;
use modelfs_ome::{ModelKey, MountPath};

impl Reconciler {
    /// One transition of the decision core, now (the jitter of a retry it schedules drawn
    /// here: the core draws nothing).
    pub(super) fn step(&mut self, event: decide::Event) -> Vec<Effect> {
        let clock = Clock {
            now: Instant::now(),
            jitter: fastrand::f64(),
        };
        self.core.step(event, clock)
    }

    /// Asks the core about `event` and executes its decision. `manifest`: the artifact of the
    /// model the event is about, when a fetch or a wait may follow.
    pub(super) fn apply_event(&mut self, event: decide::Event, manifest: Option<&Arc<Manifest>>) {
        let effects = self.step(event);
        self.execute(effects, manifest);
    }

    /// Executes a decision's effects, in order (see [`decide::Effect`]). Runs on the actor's own
    /// thread, never on the async runtime's workers. `manifest`: the artifact of the model the
    /// decision is about (a fetch or a wait keeps it).
    pub(super) fn execute(&mut self, effects: Vec<Effect>, manifest: Option<&Arc<Manifest>>) {
        // A save owed by `SaveRecords` before the directories of the next effects exist.
        let mut save_owed = false;
        for effect in effects {
            match effect {
                Effect::SaveRecords => {
                    // Fetches wait for the next paced save; anything else that creates a
                    // directory saves now.
                    save_owed = true;
                    self.batch.flush_pending = true;
                }
                Effect::LinkStore(split) => {
                    if std::mem::take(&mut save_owed) {
                        self.save();
                    }
                    let result = self.link_store(&split);
                    self.apply_event(decide::Event::SplitLinked { split, result }, None);
                }
                Effect::Fetch { key, store, seed } => match manifest {
                    Some(m) => {
                        let after_save = save_owed.then(|| *self.saving.saves.borrow() + 1);
                        self.saving.fetch_awaits_save |= save_owed;
                        self.start_fetch(&key, store, seed, m.clone(), after_save)
                    }
                    None => tracing::error!(model = %key, "a fetch decided without a manifest"),
                },
                Effect::Wait { key, on, reason } => self.wait(&key, on, reason, manifest),
                Effect::LosePath { key, reason, .. } => {
                    tracing::warn!(model = %key, reason, "path conflict");
                    self.cancel_work(&key);
                }
                Effect::Served {
                    key,
                    store,
                    changed,
                } => {
                    self.works.remove(&key);
                    if changed {
                        let artifact = self.core.records.models()[&key].artifact.clone();
                        tracing::info!(model = %key, %store, artifact = ?artifact, "mapping changed");
                    }
                }
                Effect::Remap => self.batch.remap_needed = true,
                Effect::Fail { key, reason, retry } => self.failed(&key, reason, retry),
                Effect::Forgotten { store, artifact } => {
                    tracing::warn!(%store, %artifact, "artifact incomplete on disk; will fetch again");
                }
                Effect::Turn { key } => {
                    tracing::info!(model = %key, "path conflict resolved; the model gets its turn");
                    self.batch.remap_needed |= self.reconcile_one(&key);
                }
                Effect::Retry { key } => self.batch.remap_needed |= self.reconcile_one(&key),
                Effect::Refresh { key } => self.start_refresh(&key),
                Effect::Stop { key } => self.cancel_work(&key),
                Effect::Start { key, new } => self.start_work(&key, new),
                Effect::Invalid { key, reason } => {
                    tracing::warn!(model = %key, reason, "invalid model object")
                }
                // A verdict for the handler that asked (see `Reconciler::report_current`).
                Effect::Current { .. } => {}
                Effect::Resolve { key } => self.resolve_desired(&key),
                Effect::FilesElsewhere { key } => self.files_elsewhere(&key),
                Effect::Wake { key } => {
                    let manifest = match self.works.get(&key).map(|w| &w.stage) {
                        Some(Stage::Waiting { manifest }) => manifest.clone(),
                        _ => continue,
                    };
                    self.decide(&key, manifest);
                }
            }
        }
    }

    /// `key` waits for `on`'s work (its fetch of the same artifact, or its resolve on the same
    /// path) with its own artifact (`manifest`) known.
    fn wait(
        &mut self,
        key: &ModelKey,
        on: ModelKey,
        reason: decide::WaitReason,
        manifest: Option<&Arc<Manifest>>,
    ) {
        match reason {
            decide::WaitReason::SameArtifact => {
                tracing::info!(model = %key, waits_for = %on, "same artifact is being fetched; waiting for it")
            }
            decide::WaitReason::EarlierOnPath => {
                tracing::info!(model = %key, waits_for = %on, "an earlier model on the same path is resolving; waiting for it")
            }
        }
        // Waiting on a fetch served while it downloads: served from it too.
        self.batch.remap_needed |= self.is_live(&on);
        match manifest {
            Some(m) if self.works.contains_key(key) => self.works.set_stage(
                key,
                Stage::Waiting {
                    manifest: m.clone(),
                },
            ),
            Some(_) => {}
            None => tracing::error!(model = %key, "a wait decided without a manifest"),
        }
    }

    /// `key` failed (the core recorded it and scheduled its retry): its work stops.
    fn failed(&mut self, key: &ModelKey, reason: String, retry: RetryKind) {
        match retry {
            RetryKind::Space { needed } => {
                self.metrics.disk.refused_fetches.inc();
                tracing::warn!(model = %key, reason, "fetch not started: it does not fit under the disk budget");
                self.wait_for_space(key, needed);
            }
            RetryKind::DiskFull { needed } => self.wait_for_space(key, needed),
            RetryKind::Transient | RetryKind::MountRefused | RetryKind::Permanent => {
                tracing::warn!(model = %key, reason, "model failed");
                self.cancel_work(key);
            }
        }
    }

    /// `key`'s work moved on: the models waiting for it are placed again at the next
    /// [`Reconciler::wake_waiters`].
    pub(super) fn work_changed(&mut self, key: &ModelKey) {
        self.step(decide::Event::WorkMoved { key: key.clone() });
    }

    /// Waiters whose model's work moved on are placed again, one by one: they map onto the
    /// result, keep waiting, or fetch themselves if it failed. Only those: an event costs its
    /// own waiters, not every waiter of the node.
    pub(super) fn wake_waiters(&mut self) {
        loop {
            let effects = self.step(decide::Event::WakeNext);
            if effects.is_empty() {
                return;
            }
            self.execute(effects, None);
        }
    }

    /// Makes `split.to` hold hard links to the blobs of `split.artifacts` in `split.from` (the
    /// store does the linking).
    pub(super) fn link_store(&mut self, split: &decide::Split) -> Result<(), String> {
        let mut blobs = Vec::new();
        for a in &split.artifacts {
            let stored = self.artifact(a).ok_or("artifact record missing")?;
            blobs.extend(stored.blobs());
        }
        self.state
            .link_blobs(&split.from, &split.to, &blobs)
            .map_err(|e| e.to_string())
    }

    /// `key`'s resolve or fetch failed with `err`. (A periodic re-resolve's failure only
    /// logs: the core keeps the model served.)
    pub(super) fn fail(&mut self, key: &ModelKey, err: &SourceError) {
        let (reason, retry) = self.failure_of(key, err);
        let event = decide::Event::Failed {
            key: key.clone(),
            reason,
            retry,
        };
        self.apply_event(event, None);
    }

    /// `err` as the core sees a failure of `key`'s work: its reason and how it is retried (a
    /// full disk waits for room). Counts it in the OME download metrics, unless the work is
    /// a periodic re-resolve.
    pub(super) fn failure_of(&mut self, key: &ModelKey, err: &SourceError) -> (String, RetryKind) {
        let refreshing = self.core.is_refreshing(key);
        if let (false, Some(outcome)) = (refreshing, err.ome_outcome()) {
            self.metrics.ome.record(ome_labels(key), outcome);
        }
        match (!refreshing).then(|| self.disk_full(key, err)).flatten() {
            Some((reason, needed)) => (reason, RetryKind::DiskFull { needed }),
            None if err.is_transient() => (err.to_string(), RetryKind::Transient),
            None => (err.to_string(), RetryKind::Permanent),
        }
    }

    /// The mount server refused to serve these mapping entries (module docs of
    /// [`modelfs_mount`]): the core fails the models served at the refused paths (see
    /// [`decide::Event::MountRefused`]); this finds them and asks the disk which of their
    /// copies lack blobs. Returns whether anything changed.
    pub(super) fn on_mount_refused(
        &mut self,
        entries: Vec<modelfs_mount::protocol::RefusedEntry>,
    ) -> bool {
        let mut refused = Vec::new();
        let mut incomplete = BTreeSet::new();
        for entry in entries {
            let Some(keys) = self.core.paths.at(&entry.path).cloned() else {
                continue;
            };
            for key in keys {
                let Some(rec) = self.core.records.models().get(&key) else {
                    continue;
                };
                let at_path = rec
                    .served_path
                    .as_deref()
                    .and_then(|p| MountPath::from_relative(p).ok())
                    .is_some_and(|p| p.segments() == entry.path.as_slice());
                let (Some(artifact), Some(store)) = (rec.artifact.clone(), rec.store.clone())
                else {
                    continue;
                };
                if !at_path {
                    continue;
                }
                if !self.complete_in(&artifact, &store) {
                    incomplete.insert((store, artifact));
                }
                refused.push((key, entry.reason.clone()));
            }
        }
        if refused.is_empty() {
            return false;
        }
        let event = decide::Event::MountRefused {
            refused,
            incomplete,
        };
        self.apply_event(event, None);
        self.wake_waiters();
        true
    }

    /// Why `path` cannot be a model path: it nests with the Hugging Face cache view.
    pub(super) fn hf_cache_conflict(&self, path: &MountPath) -> Option<String> {
        let dir = self.config.hf_cache_dir.as_ref()?;
        modelfs_mount::vfs::hf_cache::path_conflict(path.segments(), dir.segments())
    }
}
