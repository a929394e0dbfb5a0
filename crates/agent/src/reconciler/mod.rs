//! The reconciler: turns the desired set of models (from the standalone directory or
//! Kubernetes) into resolve and fetch tasks, placements and mapping flips. It is split in two:
//! the decision core ([`decide`]), which owns the durable records and every model's lifecycle
//! and decides everything, and the executor here, which decides nothing.
//!
//! # The split
//! The core is one state value, [`decide::Machine`] (the records, their path index, each
//! model's work phase, pending retry, lost path and waits), with one pure transition,
//! [`decide::Machine::step`]: an event and the time give the new state and a list of
//! [`decide::Effect`]s. What happens to a model when something happens is its transition
//! table (module docs of [`decide`]). The executor is a single actor that handles one message
//! at a time (desired state changed, a resolve or fetch finished, the mount server refused
//! entries, a timer tick), so steps never race each other and need no locks. For each it
//! reports an event to the core with what only the world can tell (an artifact resolved, the
//! disk's free space, which copies lack blobs, whether a node directory exists, whether a path
//! lies in the cache view, which spec a finished resolve or fetch was started for), and runs the effects of the answer in order:
//! save the records before a store directory exists, start or stop a resolve or fetch, link a
//! split store, log a failure, rebuild the mapping at the end of the batch. Outcomes come back
//! as events (a fetch's, a split's, a failure's). Its modules:
//! * `handle`, `config`: what the rest of the daemon holds and configures;
//! * `models`: the handlers of what happens to a model (a spec, a retry, a resolve or fetch
//!   finishing, a deletion), each a step of the core;
//! * `execute`: running effects, and failures reported back as events;
//! * `work`: work in flight, its cancellation and the tasks that run it;
//! * `passes`, `mapping`: the actor's loop, the whole-state passes after a batch (the path
//!   rule, the mapping swap, records and status) and the tick;
//! * `persist`, `status_doc`, `gc`, `space`, `progressive`, `model_config`: records and status
//!   files, the status document, garbage collection, the disk budget, serving while
//!   downloading, model configs.
//!
//! The actor runs on a thread of its own (the runtime's blocking pool), so its fsyncs, links
//! and record writes never stall the async workers that serve HTTP, Kubernetes watches and
//! downloads. Slow work (hashing, copying, downloading) runs in spawned tasks that report back
//! with messages; they never touch the records. Time enters the core only as an argument (a
//! retry's jitter too), so the core's tables and its property test replay exactly.
//!
//! If the actor itself dies (a panic: a bug), nothing would decide any more and the mapping
//! would freeze: [`ReconcilerHandle::died`] resolves with the reason, and `modelfs serve` logs
//! it and exits non-zero so that it is restarted. At runtime shutdown without
//! [`ReconcilerHandle::shutdown`] (a test's simulated crash) the actor stops where it is,
//! saving nothing, as a killed process would.
//!
//! # Life of a model
//! The core sees a new or changed spec (its *fingerprint* changed: [`decide::Event::Spec`])
//! and work starts: resolve the source to a manifest (skipped when only the policy or path
//! changed: the served artifact's manifest is reused), then [`decide::Event::ArtifactKnown`]
//! (see [`decide::placement`]):
//! serve from an existing holder, wait for an in-flight fetch of the same artifact (single
//! flight), or fetch into the model's own store. Until the new placement is complete and
//! verified, the model keeps being served as before; then [`decide::Event::Fetched`] records
//! the new placement and the mapping flips in one swap. This one
//! path implements placement on create, source/revision changes and the four policy changes
//! T-01..T-04 of SPEC section 3.2.
//!
//! # Cancellation
//! Each piece of work carries a `WorkCancel` (see `work`). Deleting or changing a model cancels it: the
//! task running its resolve or fetch ends at once (its future is dropped with everything it
//! holds: the node-wide fetch slot, HTTP connections, transfer slots), whatever it was waiting
//! for, so a hung source can never keep a slot from other models. Blocking workers (`local://`
//! copies) see the same cancellation as a flag and stop at their next check. A worker that
//! panics is a bug: the model is `Failed` with the panic message, not retried.
//!
//! # Paths
//! One rule decides path conflicts ([`decide::path_verdicts`]): nesting paths, or equal paths
//! with different artifacts, and the later model (creation order, then key) loses. It is
//! applied where placement happens (before work starts, when the artifact is known, when a
//! fetch completes, right before the flip) and to the whole state in the passes that follow
//! batches of events (paced: see "Scale") and at start-up, always before the mapping is
//! rebuilt, so whatever the order in which resolves and fetches finish, and whatever
//! older records say, the mapping never holds two conflicting models and a loser is never
//! `Ready`. A loser waits without retries until the rule clears it, then gets its turn.
//!
//! # Scale
//! Thousands of models arrive together (a node's first desired state, an import of a whole
//! directory), so no event may cost work proportional to the number of models times anything.
//! A placement's path check looks only at the models whose paths nest with its own (an index
//! of paths, [`decide::PathIndex`]); its reuse candidates, store users and owners come from
//! the records' own indexes ([`records::RecordsIndex`]), and single flight from the core's
//! index of work in flight by artifact and source; a model that waits is woken only by the
//! model it waits for ([`decide::Event::WakeNext`]), not by every event; the whole-state passes (the
//! path rule over all claims, the mapping swap, saving the records, the status document) run
//! once per batch of up to `MAX_BATCH` queued events, not once per event, and no more often
//! than their own cost allows (`passes::FlushPacer`): at 10,000 models a pass costs a noticeable
//! fraction of a second, and running one after each fetch completing made an import quadratic.
//!
//! # Mount server refusals
//! The mount server checks each entry of a mapping (store present, blobs present with their
//! sizes) and leaves out what it cannot serve, with a reason. Those reasons come back as a
//! message ([`MountSink::on_refused`]): the models served there are unmapped and `Failed` with
//! the server's reason (in the local status and OME's ConfigMap alike) and retried with the
//! usual backoff; a copy that really lacks blobs forgets the artifact, so the retry fetches
//! what is missing.
//!
//! # Durability
//! Records are saved by the whole-state passes after the events that changed them (paced: at
//! most `passes::FLUSH_DELAY_MAX` plus one pass later; explicitly and at once where an action must
//! follow them, such as creating a store directory or collecting garbage), always after the
//! data they point at is durable (blobs synced, artifact file written): a SIGKILL leaves a state
//! that start-up turns back into a consistent mapping by `stat`ing blobs, never re-hashing
//! them.
//!
//! # Hugging Face cache view
//! `remap` also derives the cache view ([`modelfs_mount::vfs::hf_cache`]) from the served `hf://` models
//! and hands it to the core in the same snapshot. A model path that nests with the view's
//! directory is a conflict ([`modelfs_mount::vfs::hf_cache::path_conflict`], checked with the other
//! path conflicts); lingering snapshots that expire trigger a `remap` on the tick.

mod config;
pub mod decide;
mod execute;
pub mod gc;
mod handle;
mod mapping;
mod model_config;
mod models;
mod passes;
mod persist;
mod progressive;
pub mod records;
mod space;
mod spec;
mod status_doc;
mod work;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use tokio::sync::{mpsc, Semaphore};

use crate::metrics::Metrics;
use crate::source::SourceError;
use modelfs_core::artifact::{ArtifactId, Sha256Digest, StoredArtifact};
use modelfs_core::store::{StateDir, StoreId};
use modelfs_mount::vfs::hf_cache::HfCacheView;
use modelfs_mount::vfs::FsCore;
use modelfs_ome::status::StatusDoc;
use modelfs_ome::ModelKey;
use records::Records;

pub use config::{DesiredState, ReconcilerConfig, DEFAULT_MAX_CONCURRENT_FETCHES};
pub use handle::ReconcilerHandle;
/// Where mapping changes go (the mount side owns the trait: see [`modelfs_mount`]).
pub use modelfs_mount::MountSink;
pub use spec::{fingerprint, parameters_digest};

use handle::{now_secs, Event, RuntimeGone};
use passes::Batch;
use work::{Stage, Works};

/// The executor: the decision core's state and everything that runs its effects. Fields are
/// grouped by what they serve; each group documents its own.
pub struct Reconciler {
    config: ReconcilerConfig,
    state: StateDir,
    /// The decision core's state: the records, their path index, each model's lifecycle.
    core: decide::Machine,
    fs: Arc<FsCore>,
    mount: Option<Arc<dyn MountSink>>,
    metrics: Arc<Metrics>,
    desired: Option<DesiredState>,
    works: Works,
    known: Known,
    batch: Batch,
    saving: Saving,
    publishing: Publishing,
    gc: GcState,
    hf_cache: Option<HfCacheView>,
    /// Fetches served while they download ([`progressive`]).
    live: progressive::Live,
    /// The disk budget's bookkeeping (see [`space`]).
    disk: space::Disk,
}

/// What the executor has read from disk and keeps: artifact files, what their configs give,
/// the bytes of each store.
#[derive(Default)]
struct Known {
    artifacts: HashMap<ArtifactId, Arc<StoredArtifact>>,
    /// What each served artifact's config files give (see [`model_config`]).
    model_configs: HashMap<ArtifactId, Arc<modelfs_ome::modelconfig::Outcome>>,
    model_configs_pending: HashSet<ArtifactId>,
    /// What the config of each model read in place gives (see [`model_config`]).
    node_dir_configs: HashMap<ModelKey, model_config::NodeDirConfig>,
    store_bytes: BTreeMap<StoreId, u64>,
}

/// Saving the records.
struct Saving {
    /// Digest of the records as last saved (the whole document is not kept to compare with).
    saved: Option<Sha256Digest>,
    /// Failing writes of `records.json` (a full disk): retried with backoff, reported once
    /// when they start failing and once when they work again.
    records_writes: persist::FileWrites,
    /// Saves of the records attempted so far. A fetch into a store directory that does not
    /// exist yet waits for the save after its decision before creating it (the effect
    /// `SaveRecords`), so a crash never leaves a directory that no saved record names, and
    /// the fetches decided between two paced passes share one records write instead of
    /// costing one each (a write is O(models): at 10,000 models, one per fetch made the
    /// import quadratic).
    saves: tokio::sync::watch::Sender<u64>,
    /// A fetch waits for the next save (see `saves`).
    fetch_awaits_save: bool,
}

/// Publishing the status (memory, `status.json`, subscribers) and liveness.
struct Publishing {
    status: Arc<ArcSwap<StatusDoc>>,
    changes: Arc<tokio::sync::watch::Sender<Arc<StatusDoc>>>,
    /// Digest of the status document last published.
    digest: Option<Sha256Digest>,
    /// Failing writes of `status.json` (see [`Saving::records_writes`]).
    writes: persist::FileWrites,
    /// The latest status document could not be written to `status.json` yet.
    file_stale: bool,
    ready: Arc<AtomicBool>,
    alive: Arc<AtomicU64>,
}

/// Garbage collection's pacing and its candidates.
struct GcState {
    candidates: gc::Candidates,
    last: Instant,
    /// Something changed since the last garbage collection pass (records, mapping, fetches).
    due: bool,
    /// `FsCore::usage_epoch` at the last pass: uses ended since then may have made garbage.
    usage_seen: u64,
}

impl Reconciler {
    /// Loads the records, drops placements whose data is missing (so they are fetched again),
    /// mounts every model that is still complete, and starts the actor.
    pub fn start(
        config: ReconcilerConfig,
        state: StateDir,
        fs: Arc<FsCore>,
        mount: Option<Arc<dyn MountSink>>,
        metrics: Arc<Metrics>,
    ) -> Result<ReconcilerHandle, records::RecordsError> {
        let records = Records::load(&state.records_path())?;
        let (tx, rx) = mpsc::unbounded_channel();
        let publishing = Publishing {
            status: Arc::new(ArcSwap::from_pointee(StatusDoc::new())),
            changes: Arc::new(tokio::sync::watch::Sender::new(Arc::new(StatusDoc::new()))),
            digest: None,
            writes: persist::FileWrites::new("status.json"),
            file_stale: false,
            ready: Arc::new(AtomicBool::new(false)),
            alive: Arc::new(AtomicU64::new(now_secs())),
        };
        let saved = serde_json::to_vec_pretty(&records)
            .ok()
            .map(|b| Sha256Digest::of(&b));
        let hf_cache = config
            .hf_cache_dir
            .as_ref()
            .map(|d| HfCacheView::new(d.segments().to_vec(), config.hf_cache_linger));
        let mut r = Reconciler {
            works: Works::new(
                Arc::new(Semaphore::new(config.max_concurrent_fetches.max(1))),
                tx.downgrade(),
            ),
            core: decide::Machine::new(records, config.retry_base, config.retry_max)
                .with_refresh(config.resolve_interval),
            disk: space::Disk::new(config.disk_budget),
            config,
            state,
            fs,
            mount,
            metrics,
            desired: None,
            known: Known::default(),
            batch: Batch::new(),
            saving: Saving {
                saved,
                records_writes: persist::FileWrites::new("records.json"),
                saves: tokio::sync::watch::Sender::new(0),
                fetch_awaits_save: false,
            },
            publishing,
            gc: GcState {
                candidates: gc::Candidates::default(),
                last: Instant::now(),
                due: true,
                usage_seen: 0,
            },
            hf_cache,
            live: progressive::Live::default(),
        };
        r.fs.set_wanted_hook(r.live.hook());
        r.listen_to_mount(&tx);
        r.recover();
        r.resume_live_fetches();
        // Records written before the path rule was atomic may hold two served models that
        // conflict: the later one is unmapped and failed before anything is mounted.
        r.settle_paths();
        r.remap();
        r.refresh_store_bytes();
        r.report_placement();
        r.measure_disk(true);
        r.save();
        r.publish();
        Ok(r.spawn_actor(tx, rx))
    }

    /// The mount server's reports (refusals, what it serves) come to the actor as messages.
    fn listen_to_mount(&self, tx: &mpsc::UnboundedSender<Event>) {
        let Some(mount) = &self.mount else {
            return;
        };
        // Weak: the listener must not keep the actor's queue open (see `sender`).
        let reports = tx.downgrade();
        mount.on_refused(Box::new(move |entries| {
            if let Some(tx) = reports.upgrade() {
                let _ = tx.send(Event::MountRefused(entries));
            }
        }));
        let reports = tx.downgrade();
        mount.on_serving_changed(Box::new(move || {
            if let Some(tx) = reports.upgrade() {
                let _ = tx.send(Event::MountServing);
            }
        }));
    }

    /// Starts the ticker and the actor's thread; the handle reports the actor's death.
    fn spawn_actor(
        self,
        tx: mpsc::UnboundedSender<Event>,
        rx: mpsc::UnboundedReceiver<Event>,
    ) -> ReconcilerHandle {
        let disk = self.disk.shared.clone();
        let publishing = (
            self.publishing.status.clone(),
            self.publishing.ready.clone(),
            self.publishing.alive.clone(),
            self.publishing.changes.clone(),
        );
        let tick = self.config.tick;
        let ticker = tx.clone();
        // Dropped with the ticker task: when the runtime shuts down under the actor (no
        // `shutdown` first), the actor stops at once, saving nothing (see `run`).
        let runtime_gone = RuntimeGone {
            flag: Arc::new(AtomicBool::new(false)),
            wake: tx.clone(),
        };
        let stopped = runtime_gone.flag.clone();
        tokio::spawn(async move {
            let _runtime_gone = runtime_gone;
            let mut interval = tokio::time::interval(tick);
            loop {
                interval.tick().await;
                if ticker.send(Event::Tick).is_err() {
                    break;
                }
            }
        });
        let (died_tx, died) = tokio::sync::watch::channel(None);
        let actor = tokio::task::spawn_blocking(move || self.run(rx, stopped));
        // The actor's handle is kept: its death is a reason for the process to end.
        tokio::spawn(async move {
            if let Err(e) = actor.await {
                let reason = match e.try_into_panic() {
                    Ok(panic) => SourceError::from_panic(panic).to_string(),
                    Err(e) => e.to_string(),
                };
                tracing::error!(reason, "the reconciler died; nothing decides any more");
                let _ = died_tx.send(Some(reason));
            }
        });
        let (status, ready, alive, status_changes) = publishing;
        ReconcilerHandle {
            tx,
            died,
            status,
            ready,
            alive,
            status_changes,
            disk,
        }
    }

    /// Handles one event; returns whether the records or the status may have changed (then
    /// they are saved and published). An idle tick changes nothing and costs next to nothing:
    /// no work proportional to the number of models happens without a change.
    fn handle(&mut self, event: Event) -> bool {
        let received = Instant::now();
        let generation = self.fs.generation();
        let desired = matches!(event, Event::Desired(_));
        let tick = matches!(event, Event::Tick);
        let mut changed = match event {
            Event::Desired(d) => {
                self.desired = Some(d);
                self.reconcile_all();
                self.gc.due = true;
                true
            }
            Event::Resolved {
                key,
                fingerprint,
                result,
            } => {
                self.on_resolved(key, fingerprint, result);
                self.gc.due = true;
                true
            }
            Event::Fetched {
                key,
                fingerprint,
                store,
                manifest,
                result,
                size_only_files,
            } => {
                let result = result.map(|blobs| (blobs, size_only_files));
                self.on_fetched(key, fingerprint, store, manifest, result);
                self.gc.due = true;
                true
            }
            Event::Tick => self.on_tick(),
            Event::ConfigParsed { artifact, outcome } => {
                self.on_config_parsed(artifact, outcome);
                true
            }
            Event::NodeDirConfigParsed {
                key,
                generation,
                outcome,
            } => self.on_node_dir_config_parsed(key, generation, outcome),
            Event::MountRefused(entries) => {
                self.gc.due = true;
                self.on_mount_refused(entries)
            }
            Event::MountServing => true,
            Event::LiveChanged(key) => {
                self.batch.remap_needed |= self.works.contains_key(&key);
                false
            }
            Event::Shutdown(_) | Event::Panic(_) | Event::Flush => unreachable!("handled in run"),
        };
        // A tick that changed nothing (the idle case) changed no claim either.
        self.batch.settle_due |= !tick || self.batch.remap_needed;
        changed |= self.batch.remap_needed;
        if desired && self.batch.desired_received.is_none() {
            self.batch.desired_received = Some((received, generation));
        }
        changed
    }

    fn artifact(&mut self, id: &ArtifactId) -> Option<Arc<StoredArtifact>> {
        if let Some(a) = self.known.artifacts.get(id) {
            return Some(a.clone());
        }
        match self.state.load_artifact(id) {
            Ok(a) => {
                let a = Arc::new(a);
                self.known.artifacts.insert(id.clone(), a.clone());
                Some(a)
            }
            Err(e) => {
                tracing::error!(artifact = %id, error = %e, "artifact record unreadable");
                None
            }
        }
    }

    /// Makes the records consistent with the disk after a crash: a placement whose artifact
    /// file or blobs are missing is dropped (the model is fetched again; verified blobs that are
    /// present are kept and not fetched again), and a store's artifact that is incomplete is
    /// forgotten. Only `stat`s: blobs under their final name were verified before the rename.
    fn recover(&mut self) {
        let pairs: Vec<(StoreId, ArtifactId)> = self
            .core
            .records
            .stores()
            .iter()
            .flat_map(|(id, s)| s.artifacts.iter().map(|a| (id.clone(), a.clone())))
            .collect();
        let incomplete = pairs
            .into_iter()
            .filter(|(s, a)| !self.complete_in(a, s))
            .collect();
        self.apply_event(decide::Event::Recovered { incomplete }, None);
    }

    fn complete_in(&mut self, artifact: &ArtifactId, store: &StoreId) -> bool {
        let Some(stored) = self.artifact(artifact) else {
            return false;
        };
        let Some(handle) = self.state.existing_store(store) else {
            return false;
        };
        let complete = stored
            .files()
            .all(|(e, blob)| handle.has_blob(&blob, e.size));
        complete
    }
}

#[cfg(test)]
mod tests;
