//! The reconciler: the one place that decides. It owns the durable records and turns the
//! desired set of models (from the standalone directory or Kubernetes) into resolve and fetch
//! tasks, placements and mapping flips.
//!
//! # Model
//! A single actor handles one event at a time (desired state changed, a resolve or fetch
//! finished, a timer tick), so decisions never race each other and need no locks. It asks the
//! pure decision core ([`decide`]) what each event changes and executes the disk work that
//! needs ([`decide::Effect`]: records saved before a store directory exists, hard links of a
//! split store), in order. The actor runs on a thread of its own (the runtime's blocking pool),
//! so its fsyncs, links and record writes never stall the async workers that serve HTTP,
//! Kubernetes watches and downloads. Slow work (hashing, copying, downloading) runs in spawned
//! tasks that report back with events; they never touch the records.
//!
//! If the actor itself dies (a panic: a bug), nothing would decide any more and the mapping
//! would freeze: [`ReconcilerHandle::died`] resolves with the reason, and `modelfs serve` logs
//! it and exits non-zero so that it is restarted. At runtime shutdown without
//! [`ReconcilerHandle::shutdown`] (a test's simulated crash) the actor stops where it is,
//! saving nothing, as a killed process would.
//!
//! # Life of a model
//! `ensure` sees a new or changed spec (its *fingerprint* changed) and starts work: resolve the
//! source to a manifest (skipped when only the policy or path changed: the served artifact's
//! manifest is reused), then `decide` (see [`decide::placement`]): serve from an existing holder, wait
//! for an in-flight fetch of the same artifact (single flight), or fetch into the model's own
//! store. The rules themselves are pure functions in [`decide`]; this module runs them and
//! executes what they ask for. Until the new placement is complete and verified, the model keeps being served as
//! before; then `serve` records the new placement and the mapping flips in one swap. This one
//! path implements placement on create, source/revision changes and the four policy changes
//! T-01..T-04 of SPEC section 3.2.
//!
//! # Cancellation
//! Each piece of work carries a [`WorkCancel`]. Deleting or changing a model cancels it: the
//! task running its resolve or fetch ends at once (its future is dropped with everything it
//! holds: the node-wide fetch slot, HTTP connections, transfer slots), whatever it was waiting
//! for, so a hung source can never keep a slot from other models. Blocking workers (`local://`
//! copies) see the same cancellation as a flag and stop at their next check. A worker that
//! panics is a bug: the model is `Failed` with the panic message, not retried.
//! # Paths
//! One rule decides path conflicts ([`decide::path_verdicts`]): nesting paths, or equal paths
//! with different artifacts, and the later model (creation order, then key) loses. It is
//! applied where placement happens (before work starts, when the artifact is known, when a
//! fetch completes, right before the flip) and to the whole state after every batch of events
//! and at start-up, so whatever the order in which resolves and fetches finish, and whatever
//! older records say, the mapping never holds two conflicting models and a loser is never
//! `Ready`. A loser waits without retries until the rule clears it, then gets its turn.
//!
//! # Scale
//! Thousands of models arrive together (a node's first desired state, an import of a whole
//! directory), so no event may cost work proportional to the number of models times anything.
//! A placement's path check looks only at the models whose paths nest with its own (an index
//! of paths, [`Reconciler::related_keys`]); a model that waits is woken only by the model it
//! waits for ([`Reconciler::work_changed`]), not by every event; the whole-state passes (the
//! path rule over all claims, the mapping swap, saving the records, the status document) run
//! once per batch of up to `MAX_BATCH` queued events, not once per event.
//!
//! # Durability
//! Records are saved after every batch of events that changed them, always after the data
//! they point at is durable (blobs synced, artifact file written): a SIGKILL leaves a state
//! that start-up turns back into a consistent mapping by `stat`ing blobs, never re-hashing
//! them.
//!
//! # Hugging Face cache view
//! `remap` also derives the cache view ([`crate::fs::hf_cache`]) from the served `hf://` models
//! and hands it to the core in the same snapshot. A model path that nests with the view's
//! directory is a conflict ([`crate::fs::hf_cache::path_conflict`], checked with the other
//! path conflicts); lingering snapshots that expire trigger a `remap` on the tick.

pub mod decide;
pub mod gc;
mod model_config;
mod persist;
pub mod records;
mod status_doc;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use futures_util::FutureExt;
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::artifact::{ArtifactId, Manifest, Sha256Digest, StoredArtifact};
use crate::fs::hf_cache::{HfCacheView, HfServed};
use crate::fs::{FsCore, MountEntry};
use crate::manifest::{ModelKey, ModelSpec, MountPath, SourceUri};
use crate::metrics::Metrics;
use crate::source::{FetchContext, Progress, Source, SourceConfig, SourceError};
use crate::status::StatusDoc;
use crate::store::{StateDir, StoreId};
use records::{ModelPhase, ModelRecord, Records};

use decide::{ClaimArtifact, ClaimKind, Effect, PathClaim, PathVerdict, Placement};

/// A model that lost a path conflict: it stays `Failed` until the rule clears it (the model it
/// lost to goes away or moves), then it gets its turn. Not durable: after a restart the model
/// resolves once and meets the same rule.
struct PathLoser {
    fingerprint: String,
    /// What it would serve, when known: it keeps competing for the path with this artifact.
    artifact: Option<ArtifactId>,
}

/// Most events handled before the records are saved and the status published.
const MAX_BATCH: usize = 64;

/// Longest time between two garbage collection passes when nothing changes.
const GC_BACKSTOP: Duration = Duration::from_secs(600);

/// Where mapping changes go (the mount side owns the trait: see [`crate::mountserver`]).
pub use crate::mountserver::MountSink;

#[derive(Clone, Debug)]
pub struct ReconcilerConfig {
    /// Host directory the mount sits on; status paths are reported below it.
    pub models_root_dir: PathBuf,
    /// How long a store with no users stays on disk before garbage collection removes it. Long
    /// enough that a quick delete-and-recreate of a model (a typo fixed in a manifest) does not
    /// re-download it.
    pub gc_grace: Duration,
    /// How often garbage collection and retries run.
    pub tick: Duration,
    /// Node-wide limit on concurrent fetches (each fetch already parallelises internally).
    pub max_concurrent_fetches: usize,
    /// First retry delay after a transient failure; doubles per attempt up to `retry_max`.
    pub retry_base: Duration,
    pub retry_max: Duration,
    /// Source settings shared by all models (Hugging Face endpoint, default token, tuning).
    pub sources: SourceConfig,
    /// Directory of the Hugging Face cache view below the mount (`None`: no view); see
    /// [`crate::fs::hf_cache`].
    pub hf_cache_dir: Option<MountPath>,
    /// How long a snapshot stays in the view after no model serves it.
    pub hf_cache_linger: Duration,
    /// How often a Ready model whose source can change under the same URI (an object-store
    /// prefix, a Hugging Face branch or tag) is resolved again; `None` (the default, as OME's
    /// agent, which reads a source only when the model object changes) never. See
    /// [`Reconciler::refresh_due`].
    pub resolve_interval: Option<Duration>,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        Self {
            models_root_dir: PathBuf::from("/mnt/models"),
            gc_grace: Duration::from_secs(300),
            tick: Duration::from_secs(1),
            max_concurrent_fetches: 4,
            retry_base: Duration::from_secs(2),
            retry_max: Duration::from_secs(300),
            sources: SourceConfig::default(),
            hf_cache_dir: None,
            hf_cache_linger: Duration::from_secs(300),
            resolve_interval: None,
        }
    }
}

/// The desired set of models.
#[derive(Clone, Debug, Default)]
pub struct DesiredState {
    /// Valid specs, or why an object with this key is invalid.
    pub models: BTreeMap<ModelKey, Result<ModelSpec, String>>,
    /// Problems that cannot be keyed by a model (an unparseable file): shown in the status
    /// under their own key.
    pub errors: BTreeMap<String, String>,
    /// Source credentials per model, resolved by the producer of the desired state (standalone:
    /// `spec.storage.parameters.token`; Kubernetes: the Secret named by `spec.storage.key`).
    /// A model without an entry uses the daemon's default token, if any.
    pub tokens: BTreeMap<ModelKey, crate::source::Token>,
}

enum Event {
    Desired(DesiredState),
    Resolved {
        key: ModelKey,
        fingerprint: String,
        result: Result<Manifest, SourceError>,
    },
    Fetched {
        key: ModelKey,
        fingerprint: String,
        store: StoreId,
        manifest: Arc<Manifest>,
        result: Result<Vec<Sha256Digest>, SourceError>,
    },
    Tick,
    /// The config files of a complete artifact were parsed.
    ConfigParsed {
        artifact: ArtifactId,
        outcome: crate::modelconfig::Outcome,
    },
    Shutdown(tokio::sync::oneshot::Sender<()>),
    /// See [`ReconcilerHandle::inject_panic`].
    Panic(String),
}

enum Stage {
    Resolving,
    /// Artifact known; waiting for another model's fetch of it (single flight) or for an
    /// earlier model on the same path to resolve (path rule).
    Waiting {
        manifest: Arc<Manifest>,
    },
    Fetching {
        artifact: ArtifactId,
        store: StoreId,
        progress: Arc<Progress>,
    },
}

struct Work {
    fingerprint: String,
    spec: ModelSpec,
    source: Source,
    stage: Stage,
    cancel: WorkCancel,
    /// A periodic re-resolve of a Ready model: the model stays Ready and served while it runs,
    /// and a failure only logs (the next interval tries again).
    refresh: bool,
}

/// Cancellation of one piece of work: the token ends its task at once; the flag is what
/// blocking workers and the sources' loops poll.
#[derive(Clone, Default)]
struct WorkCancel {
    token: CancellationToken,
    flag: Arc<AtomicBool>,
}

impl WorkCancel {
    fn cancel(&self) {
        self.flag.store(true, Ordering::Relaxed);
        self.token.cancel();
    }

    /// Runs `work` in a task that ends as soon as the work is cancelled (dropping the work's
    /// future and all it holds) and hands its result, or `Cancelled`, or a panic turned into a
    /// permanent error, to `report`.
    fn spawn<T: Send + 'static>(
        &self,
        work: impl std::future::Future<Output = Result<T, SourceError>> + Send + 'static,
        report: impl FnOnce(Result<T, SourceError>) + Send + 'static,
    ) {
        let token = self.token.clone();
        tokio::spawn(async move {
            let work = std::panic::AssertUnwindSafe(work).catch_unwind();
            let result = tokio::select! {
                biased;
                _ = token.cancelled() => Err(SourceError::Cancelled),
                r = work => r.unwrap_or_else(|panic| Err(SourceError::from_panic(panic))),
            };
            report(result);
        });
    }
}

#[cfg(test)]
mod work_cancel_tests {
    use super::*;

    /// Runs `work` under `cancel` and returns the receiver of its report.
    fn spawn_reporting<T: Send + 'static>(
        cancel: &WorkCancel,
        work: impl std::future::Future<Output = Result<T, SourceError>> + Send + 'static,
    ) -> tokio::sync::oneshot::Receiver<Result<T, SourceError>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        cancel.spawn(work, move |r| {
            let _ = tx.send(r);
        });
        rx
    }

    #[tokio::test]
    async fn cancelling_ends_a_hung_task_and_frees_its_slot() {
        let slots = Arc::new(Semaphore::new(1));
        let cancel = WorkCancel::default();
        let held = slots.clone();
        let (started_tx, started) = tokio::sync::oneshot::channel();
        let done = spawn_reporting(&cancel, async move {
            let _slot = held.acquire_owned().await.unwrap();
            let _ = started_tx.send(());
            std::future::pending::<Result<(), SourceError>>().await
        });
        started.await.unwrap();
        assert_eq!(slots.available_permits(), 0);
        cancel.cancel();
        assert!(matches!(done.await.unwrap(), Err(SourceError::Cancelled)));
        assert!(
            cancel.flag.load(Ordering::Relaxed),
            "blocking workers see it too"
        );
        // The hung future was dropped with its slot: another model gets it.
        let _again = slots.try_acquire().expect("the slot is free");
    }

    #[tokio::test]
    async fn a_panicking_worker_is_a_permanent_failure_with_its_message() {
        let done = spawn_reporting(&WorkCancel::default(), async {
            if true {
                panic!("listing parser broke");
            }
            Ok::<(), SourceError>(())
        });
        let err = done.await.unwrap().unwrap_err();
        assert!(!err.is_transient(), "{err}");
        assert!(err.to_string().contains("listing parser broke"), "{err}");
    }
}

/// Tells the actor that the runtime it spawns work on is shutting down (see `Reconciler::run`).
struct RuntimeGone {
    flag: Arc<AtomicBool>,
    wake: mpsc::UnboundedSender<Event>,
}

impl Drop for RuntimeGone {
    fn drop(&mut self) {
        self.flag.store(true, Ordering::Release);
        let _ = self.wake.send(Event::Tick);
    }
}

struct Retry {
    fingerprint: String,
    attempts: u32,
    at: Instant,
}

/// Handle to the running reconciler.
#[derive(Clone)]
pub struct ReconcilerHandle {
    tx: mpsc::UnboundedSender<Event>,
    /// Why the actor died (a panic), once it has.
    died: tokio::sync::watch::Receiver<Option<String>>,
    status: Arc<ArcSwap<StatusDoc>>,
    ready: Arc<AtomicBool>,
    alive: Arc<std::sync::atomic::AtomicU64>,
    status_changes: Arc<tokio::sync::watch::Sender<Arc<StatusDoc>>>,
}

impl ReconcilerHandle {
    /// A receiver that is notified whenever the status document changes (its value is the
    /// latest document).
    pub fn subscribe_status(&self) -> tokio::sync::watch::Receiver<Arc<StatusDoc>> {
        self.status_changes.subscribe()
    }

    pub fn set_desired(&self, desired: DesiredState) {
        let _ = self.tx.send(Event::Desired(desired));
    }

    pub fn status(&self) -> Arc<StatusDoc> {
        self.status.load_full()
    }

    /// True once the first desired state has been reconciled.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// Seconds since the actor last finished an event (liveness).
    pub fn seconds_since_heartbeat(&self) -> u64 {
        now_secs().saturating_sub(self.alive.load(Ordering::Relaxed))
    }

    /// Resolves, with the reason, if the actor died (it panicked: a bug). Nothing decides any
    /// more after that, so the process must end and be restarted; pending forever otherwise.
    pub async fn died(&self) -> String {
        let mut died = self.died.clone();
        let reason = match died.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or_default(),
            Err(_) => std::future::pending().await,
        };
        reason
    }

    /// Makes the actor panic, as a bug would (tests of [`ReconcilerHandle::died`]).
    #[doc(hidden)]
    pub fn inject_panic(&self, message: &str) {
        let _ = self.tx.send(Event::Panic(message.to_string()));
    }

    /// Stops all work at a safe point (fetches end between chunks; partial files stay for
    /// resume) and saves the records.
    pub async fn shutdown(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(Event::Shutdown(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// What decides whether a spec change needs work. A new token counts: a model that failed for
/// lack of access must try again when it gets one. So do `parameters` (auth mode, region,
/// endpoint, key id, ...): they change where and how the source is read. They enter the hash
/// only when present, so models without parameters keep the fingerprint they had; the record
/// holds only the truncated hash, never a parameter's value.
pub fn fingerprint(spec: &ModelSpec, token: Option<&crate::source::Token>) -> String {
    let mut h = Sha256::new();
    for part in [
        token.map(|t| t.digest()).unwrap_or_default(),
        spec.source.to_string(),
        spec.policy.as_str().to_string(),
        spec.path.to_string(),
        spec.reserve_artifact.to_string(),
        spec.token_secret.clone().unwrap_or_default(),
        spec.token_secret_entry().to_string(),
    ] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    if let Some(p) = parameters_digest(&spec.parameters) {
        h.update(b"parameters\0");
        h.update(p.as_bytes());
    }
    hex::encode(&h.finalize()[..16])
}

/// Whether the same URI may name other content later: object-store prefixes (objects can be
/// overwritten, added or removed) and Hugging Face branches or tags (a commit cannot change).
fn source_may_change(source: &SourceUri) -> bool {
    match source {
        SourceUri::ObjectStore { .. } | SourceUri::Oci { .. } => true,
        SourceUri::HuggingFace { revision, .. } => {
            !crate::manifest::source::is_commit_hash(revision)
        }
        _ => false,
    }
}

/// A digest of `spec.storage.parameters` (`None` when there are none): what the records keep
/// of them, never their values.
pub fn parameters_digest(parameters: &BTreeMap<String, String>) -> Option<String> {
    if parameters.is_empty() {
        return None;
    }
    let mut h = Sha256::new();
    for (k, v) in parameters {
        h.update(k.as_bytes());
        h.update([0]);
        h.update(v.as_bytes());
        h.update([0]);
    }
    Some(hex::encode(&h.finalize()[..16]))
}

pub struct Reconciler {
    config: ReconcilerConfig,
    state: StateDir,
    records: Records,
    saved: Vec<u8>,
    fs: Arc<FsCore>,
    mount: Option<Arc<dyn MountSink>>,
    metrics: Arc<Metrics>,
    desired: Option<DesiredState>,
    works: BTreeMap<ModelKey, Work>,
    retries: HashMap<ModelKey, Retry>,
    /// Models that failed before this start and were given their one fresh attempt.
    attempted_since_start: std::collections::HashSet<ModelKey>,
    /// When each Ready model was last resolved (or first seen Ready): see
    /// [`Reconciler::refresh_due`].
    resolved_at: HashMap<ModelKey, Instant>,
    path_losers: BTreeMap<ModelKey, PathLoser>,
    /// The records changed what is served; the mapping is rebuilt once at the end of the batch
    /// of events, after the path rule has been applied (so it never sees a conflict).
    remap_needed: bool,
    /// Claims may have changed in this batch: the path rule runs over the state at its end.
    settle_due: bool,
    /// The first desired state of this batch: when it arrived and the mapping's generation then.
    desired_received: Option<(Instant, u64)>,
    /// Every model's wanted and served paths, by path (see [`Reconciler::index_paths`]).
    path_index: BTreeMap<Vec<String>, BTreeSet<ModelKey>>,
    indexed_paths: HashMap<ModelKey, Vec<Vec<String>>>,
    /// Models waiting (single flight, or an earlier model resolving on the same path), by the
    /// model whose work they wait for: only its changes wake them.
    waiting_on: HashMap<ModelKey, BTreeSet<ModelKey>>,
    /// Waiters to decide again before the event ends.
    to_wake: BTreeSet<ModelKey>,
    artifacts: HashMap<ArtifactId, Arc<StoredArtifact>>,
    /// What each served artifact's config files give (see [`model_config`]).
    model_configs: HashMap<ArtifactId, Arc<crate::modelconfig::Outcome>>,
    model_configs_pending: std::collections::HashSet<ArtifactId>,
    gc_candidates: gc::Candidates,
    store_bytes: BTreeMap<StoreId, u64>,
    fetch_slots: Arc<Semaphore>,
    /// Where workers report (weak: the actor alone must not keep its own queue open; see
    /// [`Reconciler::sender`]).
    tx: mpsc::WeakUnboundedSender<Event>,
    status: Arc<ArcSwap<StatusDoc>>,
    status_changes: Arc<tokio::sync::watch::Sender<Arc<StatusDoc>>>,
    status_bytes: Vec<u8>,
    ready: Arc<AtomicBool>,
    alive: Arc<std::sync::atomic::AtomicU64>,
    last_gc: Instant,
    hf_cache: Option<HfCacheView>,
    /// Something changed since the last garbage collection pass (records, mapping, fetches).
    gc_due: bool,
    /// `FsCore::usage_epoch` at the last pass: uses ended since then may have made garbage.
    gc_usage_seen: u64,
    /// Failing writes of `records.json` / `status.json` (a full disk): retried with backoff,
    /// reported once when they start failing and once when they work again.
    records_writes: persist::Backoff,
    status_writes: persist::Backoff,
    /// The latest status document could not be written to `status.json` yet.
    status_file_stale: bool,
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
        let status = Arc::new(ArcSwap::from_pointee(StatusDoc::new()));
        let ready = Arc::new(AtomicBool::new(false));
        let status_changes = Arc::new(tokio::sync::watch::Sender::new(Arc::new(StatusDoc::new())));
        let alive = Arc::new(std::sync::atomic::AtomicU64::new(now_secs()));
        let mut r = Reconciler {
            fetch_slots: Arc::new(Semaphore::new(config.max_concurrent_fetches.max(1))),
            config,
            state,
            records,
            saved: Vec::new(),
            fs,
            mount,
            metrics,
            desired: None,
            works: BTreeMap::new(),
            retries: HashMap::new(),
            attempted_since_start: std::collections::HashSet::new(),
            resolved_at: HashMap::new(),
            path_losers: BTreeMap::new(),
            remap_needed: false,
            settle_due: false,
            desired_received: None,
            path_index: BTreeMap::new(),
            indexed_paths: HashMap::new(),
            waiting_on: HashMap::new(),
            to_wake: BTreeSet::new(),
            artifacts: HashMap::new(),
            model_configs: HashMap::new(),
            model_configs_pending: std::collections::HashSet::new(),
            gc_candidates: gc::Candidates::default(),
            store_bytes: BTreeMap::new(),
            tx: tx.downgrade(),
            status: status.clone(),
            status_changes: status_changes.clone(),
            status_bytes: Vec::new(),
            ready: ready.clone(),
            alive: alive.clone(),
            last_gc: Instant::now(),
            hf_cache: None,
            gc_due: true,
            gc_usage_seen: 0,
            records_writes: persist::Backoff::new("records.json"),
            status_writes: persist::Backoff::new("status.json"),
            status_file_stale: false,
        };
        r.hf_cache = r
            .config
            .hf_cache_dir
            .as_ref()
            .map(|d| HfCacheView::new(d.segments().to_vec(), r.config.hf_cache_linger));
        r.saved = serde_json::to_vec_pretty(&r.records).unwrap_or_default();
        r.recover();
        let keys: Vec<ModelKey> = r.records.models.keys().cloned().collect();
        for key in &keys {
            r.index_paths(key);
        }
        // Records written before the path rule was atomic may hold two served models that
        // conflict: the later one is unmapped and failed before anything is mounted.
        r.settle_paths();
        r.remap();
        r.refresh_store_bytes();
        r.save();
        r.publish();
        let tick = r.config.tick;
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
        let actor = tokio::task::spawn_blocking(move || r.run(rx, stopped));
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
        Ok(ReconcilerHandle {
            tx,
            died,
            status,
            ready,
            alive,
            status_changes,
        })
    }

    /// A sender for workers' reports. The handles and the ticker hold the strong senders; with
    /// all of them gone nothing can be reported to anyone, and a closed sender is as good.
    fn sender(&self) -> mpsc::UnboundedSender<Event> {
        self.tx
            .upgrade()
            .unwrap_or_else(|| mpsc::unbounded_channel().0)
    }

    /// The actor's loop, on a blocking-pool thread: it may block on disk work.
    fn run(mut self, mut rx: mpsc::UnboundedReceiver<Event>, runtime_gone: Arc<AtomicBool>) {
        while let Some(first) = rx.blocking_recv() {
            if runtime_gone.load(Ordering::Acquire) {
                return;
            }
            // Handle what is queued (up to MAX_BATCH events) before saving and publishing once:
            // a burst of events (a node's models arriving together) costs one records write,
            // not one each, while a steady stream still publishes every MAX_BATCH events.
            let mut next = Some(first);
            let mut changed = false;
            let mut handled = 0;
            while let Some(event) = next.take() {
                match event {
                    Event::Shutdown(done) => {
                        // The batch's decisions are applied before stopping.
                        self.finish_batch();
                        self.shut_down();
                        let _ = done.send(());
                        return;
                    }
                    Event::Panic(message) => panic!("{message}"),
                    other => changed |= self.handle(other),
                }
                handled += 1;
                if handled < MAX_BATCH && !runtime_gone.load(Ordering::Acquire) {
                    next = rx.try_recv().ok();
                }
            }
            changed |= self.finish_batch();
            if changed {
                // Records that failed to save wait for their backoff (the explicit saves that
                // must precede a directory's creation do not).
                if !self.records_writes.failing() || self.records_writes.due() {
                    self.save();
                }
                self.publish();
            } else {
                // Only retries of writes that failed (a full disk), when their backoff is over.
                self.retry_failed_writes();
            }
            self.alive.store(now_secs(), Ordering::Relaxed);
        }
    }

    /// Stops all work at a safe point and saves.
    fn shut_down(&mut self) {
        for w in self.works.values() {
            w.cancel.cancel();
        }
        // Fetch tasks end at once; wait (bounded) until all have let go of their slots. Partial
        // files are a verified-on-resume prefix whatever the point.
        let all = self.config.max_concurrent_fetches.max(1) as u32;
        let slots = self.fetch_slots.clone();
        let _ = tokio::runtime::Handle::current().block_on(tokio::time::timeout(
            Duration::from_secs(10),
            slots.acquire_many_owned(all),
        ));
        self.save();
        self.publish();
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
                self.gc_due = true;
                true
            }
            Event::Resolved {
                key,
                fingerprint,
                result,
            } => {
                self.on_resolved(key, fingerprint, result);
                self.gc_due = true;
                true
            }
            Event::Fetched {
                key,
                fingerprint,
                store,
                manifest,
                result,
            } => {
                self.on_fetched(key, fingerprint, store, manifest, result);
                self.gc_due = true;
                true
            }
            Event::Tick => {
                let mut changed = self.retry_due();
                self.refresh_due();
                // Waiters whose model's work ended without a wake-up (a safety net: every
                // end of work wakes its waiters).
                let stale: Vec<ModelKey> = self
                    .waiting_on
                    .keys()
                    .filter(|k| !self.works.contains_key(*k))
                    .cloned()
                    .collect();
                for k in stale {
                    self.work_changed(&k);
                }
                self.wake_waiters();
                self.gc_due |= changed;
                // Download progress moves without events.
                changed |= self
                    .works
                    .values()
                    .any(|w| matches!(w.stage, Stage::Fetching { .. }));
                // Lingering cache-view snapshots that expired leave the mapping.
                if self
                    .hf_cache
                    .as_ref()
                    .is_some_and(|v| v.expired(Instant::now()))
                {
                    self.remap_needed = true;
                    self.gc_due = true;
                }
                // A pass every 5 ticks, or more often when the grace period is shorter, when
                // something may have become garbage (or garbage is waiting for its grace
                // period to end); else only every GC_BACKSTOP, for what ages without any
                // change (partial downloads abandoned by a crash).
                let gc_every =
                    (self.config.tick * 5).min(self.config.gc_grace.max(self.config.tick));
                let usage = self.fs.usage_epoch();
                let wanted = self.gc_due
                    || usage != self.gc_usage_seen
                    || !self.gc_candidates.is_empty()
                    || self.last_gc.elapsed() >= GC_BACKSTOP;
                if wanted && self.last_gc.elapsed() >= gc_every {
                    self.last_gc = Instant::now();
                    self.gc_due = false;
                    self.gc_usage_seen = usage;
                    changed |= self.gc();
                }
                changed
            }
            Event::ConfigParsed { artifact, outcome } => {
                self.on_config_parsed(artifact, outcome);
                true
            }
            Event::Shutdown(_) | Event::Panic(_) => unreachable!("handled in run"),
        };
        // A tick that changed nothing (the idle case) changed no claim either.
        self.settle_due |= !tick || self.remap_needed;
        changed |= self.remap_needed;
        if desired && self.desired_received.is_none() {
            self.desired_received = Some((received, generation));
        }
        changed
    }

    /// After a batch of events: the path rule over the whole state, the waiters it woke, then
    /// one mapping swap for all the batch's flips (a burst of fetches completing costs one
    /// swap, not one each). Returns whether the mapping changed.
    fn finish_batch(&mut self) -> bool {
        if std::mem::take(&mut self.settle_due) {
            self.settle_paths();
            self.wake_waiters();
        }
        let remapped = std::mem::take(&mut self.remap_needed);
        if remapped {
            self.remap();
        }
        if let Some((received, generation)) = self.desired_received.take() {
            if self.fs.generation() != generation {
                self.metrics
                    .mapping_update_seconds
                    .observe(received.elapsed().as_secs_f64());
            }
            self.ready.store(true, Ordering::Relaxed);
        }
        #[cfg(debug_assertions)]
        self.check_path_index();
        remapped
    }

    /// Indexes `key`'s wanted and served paths (after its record changed them or went away),
    /// so that the path rule for a path looks only at the models whose paths nest with it
    /// ([`Reconciler::related_keys`]), not at every model. The index may hold stale entries
    /// until the next call (harmless: claims come from the records), never miss a path.
    fn index_paths(&mut self, key: &ModelKey) {
        let mut new: Vec<Vec<String>> = Vec::new();
        if let Some(rec) = self.records.models.get(key) {
            for p in [Some(rec.path.as_str()), rec.served_path.as_deref()]
                .into_iter()
                .flatten()
            {
                if let Ok(path) = MountPath::from_relative(p) {
                    let segs = path.segments().to_vec();
                    if !new.contains(&segs) {
                        new.push(segs);
                    }
                }
            }
        }
        let old = self.indexed_paths.remove(key).unwrap_or_default();
        for p in old.iter().filter(|p| !new.contains(p)) {
            if let Some(keys) = self.path_index.get_mut(p) {
                keys.remove(key);
                if keys.is_empty() {
                    self.path_index.remove(p);
                }
            }
        }
        for p in &new {
            self.path_index
                .entry(p.clone())
                .or_default()
                .insert(key.clone());
        }
        if !new.is_empty() {
            self.indexed_paths.insert(key.clone(), new);
        }
    }

    /// The models whose claims can decide the rule's verdict at `path`: those at or below its
    /// topmost claimed ancestor (or itself). Paths that do not nest cannot conflict, so the
    /// rest of the state never matters. O(log n + related).
    fn related_keys(&self, path: &[String]) -> BTreeSet<ModelKey> {
        let root_len = (1..path.len())
            .find(|&n| self.path_index.contains_key(&path[..n]))
            .unwrap_or(path.len());
        let root = &path[..root_len];
        let mut out = BTreeSet::new();
        for (p, keys) in self.path_index.range(root.to_vec()..) {
            if !p.starts_with(root) {
                break;
            }
            out.extend(keys.iter().cloned());
        }
        out
    }

    /// Debug builds: the path index holds every path of every record.
    #[cfg(debug_assertions)]
    fn check_path_index(&self) {
        for (key, rec) in &self.records.models {
            for p in [Some(rec.path.as_str()), rec.served_path.as_deref()]
                .into_iter()
                .flatten()
            {
                if let Ok(path) = MountPath::from_relative(p) {
                    assert!(
                        self.path_index
                            .get(path.segments())
                            .is_some_and(|keys| keys.contains(key)),
                        "path index misses {key} at {p}"
                    );
                }
            }
        }
    }

    /// Retries whose time has come (transient failures, path conflicts re-checked). Only these
    /// models are looked at: the others cannot change without a new desired state.
    fn retry_due(&mut self) -> bool {
        let now = Instant::now();
        let Some(desired) = self.desired.as_ref() else {
            return false;
        };
        let due: Vec<(ModelKey, Result<ModelSpec, String>)> = self
            .retries
            .iter()
            .filter(|(_, r)| r.at <= now)
            .filter_map(|(k, _)| Some((k.clone(), desired.models.get(k)?.clone())))
            .collect();
        let mut changed = false;
        for (key, wanted) in due {
            changed |= match wanted {
                Ok(spec) => self.ensure(&key, &spec),
                Err(reason) => self.mark_invalid(&key, &reason),
            };
        }
        if changed {
            self.remap_needed = true;
        }
        changed
    }

    /// With `resolve_interval`: starts a re-resolve of every Ready model whose source can name
    /// other content under the same URI (`s3://`, `gs://`, `az://`, `oci://` prefixes, whose
    /// objects may be overwritten; `hf://` at a branch or tag) and that has not been resolved
    /// for an interval. The same artifact again ends the work quietly; a new one (a changed
    /// object has a new ETag or generation, so a new manifest) is fetched and flipped to as
    /// for a source change (SPEC 3.3), per the model's policy, while the old one stays served
    /// and the model stays Ready. A failed re-resolve or fetch only logs.
    fn refresh_due(&mut self) {
        let Some(interval) = self.config.resolve_interval else {
            return;
        };
        let Some(desired) = self.desired.as_ref() else {
            return;
        };
        let now = Instant::now();
        let mut due = Vec::new();
        for (key, rec) in &self.records.models {
            let Some(Ok(spec)) = desired.models.get(key) else {
                continue;
            };
            let ready = rec.phase == ModelPhase::Ready && rec.artifact.is_some();
            if !ready || self.works.contains_key(key) || !source_may_change(&spec.source) {
                self.resolved_at.remove(key);
                continue;
            }
            let since = *self.resolved_at.entry(key.clone()).or_insert(now);
            if now.duration_since(since) >= interval {
                due.push((key.clone(), spec.clone()));
            }
        }
        for (key, spec) in due {
            self.resolved_at.insert(key.clone(), now);
            self.start_refresh(&key, &spec);
        }
    }

    fn start_refresh(&mut self, key: &ModelKey, spec: &ModelSpec) {
        let token = self
            .desired
            .as_ref()
            .and_then(|d| d.tokens.get(key))
            .cloned();
        let fp = fingerprint(spec, token.as_ref());
        if self
            .records
            .models
            .get(key)
            .is_none_or(|r| r.fingerprint != fp)
        {
            return;
        }
        let source =
            match Source::for_uri(&spec.source, &self.config.sources, token, &spec.parameters) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(model = %key, error = %e, "re-resolve skipped");
                    return;
                }
            };
        tracing::info!(model = %key, source = %spec.source, "resolving again (periodic)");
        let cancel = WorkCancel::default();
        self.works.insert(
            key.clone(),
            Work {
                fingerprint: fp.clone(),
                spec: spec.clone(),
                source: source.clone(),
                stage: Stage::Resolving,
                cancel: cancel.clone(),
                refresh: true,
            },
        );
        let tx = self.sender();
        let key2 = key.clone();
        let flag = cancel.flag.clone();
        cancel.spawn(async move { source.resolve(flag).await }, move |result| {
            let _ = tx.send(Event::Resolved {
                key: key2,
                fingerprint: fp,
                result,
            });
        });
    }

    // ----- desired state -------------------------------------------------------------------

    fn reconcile_all(&mut self) {
        let Some(desired) = self.desired.clone() else {
            return;
        };
        let gone: Vec<ModelKey> = self
            .records
            .models
            .keys()
            .filter(|k| !desired.models.contains_key(*k))
            .cloned()
            .collect();
        let mut changed = false;
        for key in gone {
            self.delete(&key);
            changed = true;
        }
        for (key, wanted) in &desired.models {
            changed |= match wanted {
                Ok(spec) => self.ensure(key, spec),
                Err(reason) => self.mark_invalid(key, reason),
            };
        }
        if changed {
            self.remap_needed = true;
        }
    }

    fn mark_invalid(&mut self, key: &ModelKey, reason: &str) -> bool {
        let fp = format!(
            "invalid:{}",
            hex::encode(&Sha256::digest(reason.as_bytes())[..8])
        );
        if self
            .records
            .models
            .get(key)
            .is_some_and(|r| r.fingerprint == fp)
        {
            return false;
        }
        self.cancel_work(key);
        self.retries.remove(key);
        self.path_losers.remove(key);
        let seq = match self.records.models.get(key) {
            Some(r) => r.seq,
            None => self.records.allocate_model_seq(),
        };
        let (namespace, name) = split_key(key);
        let rec = self
            .records
            .models
            .entry(key.clone())
            .or_insert_with(|| ModelRecord::new(seq, name, namespace, ModelPhase::Failed));
        tracing::warn!(model = %key, reason, "invalid model object");
        rec.fingerprint = fp;
        rec.phase = ModelPhase::Failed;
        rec.reason = Some(reason.to_string());
        // Unmapped (its path may be what is invalid) but its own store is kept: fixing the
        // object must not cost a download, and its children keep being served.
        decide::unmap(rec);
        self.wake_waiters();
        true
    }

    /// Starts work for a new or changed spec. Returns whether the records changed.
    fn ensure(&mut self, key: &ModelKey, spec: &ModelSpec) -> bool {
        let token = self
            .desired
            .as_ref()
            .and_then(|d| d.tokens.get(key))
            .cloned();
        let fp = fingerprint(spec, token.as_ref());
        if let Some(w) = self.works.get(key) {
            if w.fingerprint == fp {
                return false;
            }
            self.cancel_work(key);
        }
        let now = Instant::now();
        let in_cache_view = self.hf_cache_conflict(&spec.path).is_some();
        match self.path_losers.get(key) {
            // Its turn comes from `settle_paths`, when the rule clears it.
            Some(l) if l.fingerprint == fp => return false,
            Some(_) => {
                self.path_losers.remove(key);
            }
            None => {}
        }
        match self.records.models.get_mut(key) {
            Some(rec) if rec.fingerprint == fp => match rec.phase {
                ModelPhase::Ready if !in_cache_view => return false,
                // Served, but the view directory now covers its path (a changed flag).
                ModelPhase::Ready => {}
                ModelPhase::Failed => match self.retries.get(key) {
                    Some(r) if r.fingerprint == fp && r.at <= now => {}
                    Some(_) => return false,
                    // Pending retries are not durable: a model recorded Failed before a
                    // restart gets one fresh attempt; a permanent failure then stays failed
                    // until its spec changes.
                    None if self.attempted_since_start.insert(key.clone()) => {}
                    None => return false,
                },
                ModelPhase::Updating => {}
            },
            Some(rec) => {
                rec.fingerprint = fp.clone();
                rec.source = spec.source.to_string();
                rec.policy = spec.policy;
                rec.path = spec.path.to_string();
                rec.reserve = spec.reserve_artifact;
                rec.name = spec.name.clone();
                rec.namespace = spec.namespace.clone();
                rec.phase = ModelPhase::Updating;
                rec.reason = None;
                self.retries.remove(key);
            }
            None => {
                let seq = self.records.allocate_model_seq();
                let mut rec = ModelRecord::new(
                    seq,
                    spec.name.clone(),
                    spec.namespace.clone(),
                    ModelPhase::Updating,
                );
                rec.fingerprint = fp.clone();
                rec.source = spec.source.to_string();
                rec.policy = spec.policy;
                rec.path = spec.path.to_string();
                rec.reserve = spec.reserve_artifact;
                self.records.models.insert(key.clone(), rec);
                tracing::info!(model = %key, source = %spec.source, policy = spec.policy.as_str(), "new model");
            }
        }
        self.index_paths(key);
        if spec.source.is_vendor() {
            self.serve_without_files(key, spec);
            return true;
        }
        // The cache view's directory is not a model path (a property of the flags, not of
        // another model): failed for good until the spec or the flag changes.
        if let Some(reason) = self.hf_cache_conflict(&spec.path) {
            self.fail_in_cache_view(key, reason);
            return true;
        }
        // Nesting needs no artifact: decided before any work. Equal paths wait for the resolve.
        if let PathVerdict::Conflict { reason, .. } =
            self.verdict_for(key, &spec.path, ClaimArtifact::Pending)
        {
            self.fail_conflict(key, &fp, reason, None);
            return true;
        }
        let source =
            match Source::for_uri(&spec.source, &self.config.sources, token, &spec.parameters) {
                Ok(s) => {
                    let (metrics, labels) = (self.metrics.clone(), ome_labels(key));
                    s.observe_throttling(crate::source::ThrottleObserver::new(move |waited| {
                        metrics
                            .ome
                            .rate_limit_wait
                            .get_or_create(&labels)
                            .observe(waited.as_secs_f64())
                    }))
                }
                Err(e) => {
                    self.fail(key, &fp, &e);
                    return true;
                }
            };
        self.records.models.get_mut(key).expect("record").phase = ModelPhase::Updating;
        let cancel = WorkCancel::default();
        let rec = &self.records.models[key];
        // Same source (and parameters) as the served artifact: only policy, path or label
        // changed. No resolve.
        let known = match (rec.artifact.clone(), rec.served_source.clone()) {
            (Some(a), Some(src))
                if src == spec.source.to_string()
                    && rec.served_parameters == parameters_digest(&spec.parameters) =>
            {
                self.artifact(&a)
            }
            _ => None,
        };
        self.works.insert(
            key.clone(),
            Work {
                fingerprint: fp.clone(),
                spec: spec.clone(),
                source: source.clone(),
                stage: Stage::Resolving,
                cancel: cancel.clone(),
                refresh: false,
            },
        );
        if let Some(stored) = known {
            self.decide(key, stored.manifest.clone());
            return true;
        }
        let tx = self.sender();
        let key2 = key.clone();
        let flag = cancel.flag.clone();
        cancel.spawn(async move { source.resolve(flag).await }, move |result| {
            let _ = tx.send(Event::Resolved {
                key: key2,
                fingerprint: fp,
                result,
            });
        });
        true
    }

    // ----- placement -----------------------------------------------------------------------

    fn on_resolved(&mut self, key: ModelKey, fp: String, result: Result<Manifest, SourceError>) {
        if self.works.get(&key).is_none_or(|w| w.fingerprint != fp) {
            return;
        }
        self.work_changed(&key);
        let refresh = self.works.get(&key).is_some_and(|w| w.refresh);
        match result {
            Ok(m) if refresh && self.records.models[&key].artifact.as_ref() == Some(&m.id()) => {
                tracing::debug!(model = %key, "resolved again: unchanged");
                self.works.remove(&key);
            }
            Ok(m) => {
                if refresh {
                    tracing::info!(model = %key, artifact = %m.id(), "the source changed; fetching the new artifact");
                }
                self.decide(&key, Arc::new(m))
            }
            Err(e) => self.fail(&key, &fp, &e),
        }
        // Waiters on this resolve now see a fetch (and keep waiting), a Ready holder, or a
        // failure (and fetch themselves).
        self.wake_waiters();
    }

    fn in_flight(&self, source: &SourceUri) -> decide::InFlight {
        let mut out = decide::InFlight::default();
        for (k, w) in &self.works {
            match &w.stage {
                Stage::Fetching { artifact, .. } => {
                    out.fetching.insert(k.clone(), artifact.clone());
                }
                Stage::Resolving if w.spec.source == *source => {
                    out.resolving_same_source.push(k.clone())
                }
                _ => {}
            }
        }
        out
    }

    fn decide(&mut self, key: &ModelKey, manifest: Arc<Manifest>) {
        let Some(work) = self.works.get(key) else {
            return;
        };
        let fp = work.fingerprint.clone();
        let spec = work.spec.clone();
        let artifact = manifest.id();
        match self.verdict_for(key, &spec.path, ClaimArtifact::Known(artifact.clone())) {
            PathVerdict::Clear => {}
            PathVerdict::Wait { on } => {
                tracing::info!(model = %key, waits_for = %on, path = %spec.path, "an earlier model on the same path is resolving; waiting for it");
                self.wait(key, on, manifest);
                return;
            }
            PathVerdict::Conflict { reason, .. } => {
                self.fail_conflict(key, &fp, reason, Some(artifact));
                return;
            }
        }
        let in_flight = self.in_flight(&spec.source);
        match decide::place(&self.records, key, spec.policy, &artifact, &in_flight) {
            Placement::Serve(store) => {
                self.serve(key, store, artifact, manifest.revision.clone(), &spec);
            }
            Placement::Wait(other) => {
                tracing::info!(model = %key, waits_for = %other, "same artifact is being fetched; waiting for it");
                self.wait(key, other, manifest);
            }
            Placement::Fetch => {
                let (store, seed) = self.fetch_target(key, &artifact);
                let handle = match self.state.store(&store) {
                    Ok(h) => h,
                    Err(e) => {
                        let err = SourceError::Store {
                            path: store.to_string(),
                            source: crate::store::StoreError::io("creating store", e),
                        };
                        self.fail(key, &fp, &err);
                        return;
                    }
                };
                let w = self.works.get_mut(key).expect("work");
                let progress = Arc::new(Progress::for_manifest(&manifest));
                w.stage = Stage::Fetching {
                    artifact,
                    store: store.clone(),
                    progress: progress.clone(),
                };
                let existing =
                    Arc::new(self.known_blobs(&[Some(store.clone()), seed.clone()], seed.as_ref()));
                let w = self.works.get_mut(key).expect("work");
                let ctx = FetchContext {
                    store: handle,
                    progress,
                    cancel: w.cancel.flag.clone(),
                    metrics: self.metrics.clone(),
                    existing,
                };
                let source = w.source.clone();
                let cancel = w.cancel.clone();
                let tx = self.sender();
                let slots = self.fetch_slots.clone();
                let key2 = key.clone();
                let adopt = self.adopt_from(&spec);
                tracing::info!(model = %key, %store, bytes = manifest.total_size(), files = manifest.entries().len(), "fetching");
                let fetched = manifest.clone();
                let adopt_key = key2.clone();
                // The slot is taken inside the cancellable work: a cancelled fetch stops waiting
                // for one, and one that holds a slot drops it when its future is dropped.
                let work = async move {
                    let _slot = slots
                        .acquire_owned()
                        .await
                        .map_err(|_| SourceError::Cancelled)?;
                    crate::adopt::fetch_adopting(&adopt_key, &source, adopt, &fetched, ctx).await
                };
                cancel.spawn(work, move |result| {
                    let _ = tx.send(Event::Fetched {
                        key: key2,
                        fingerprint: fp,
                        store,
                        manifest,
                        result,
                    });
                });
            }
        }
    }

    /// Where a fetch of `spec` into its own store looks for files an old agent left under the
    /// models root (see [`crate::adopt`]): its `local://` directory when that lies below the
    /// root, else the model's own path (following OME's child symlinks).
    fn adopt_from(&self, spec: &ModelSpec) -> Option<crate::adopt::AdoptFrom> {
        let under = self.config.sources.under_mount.clone()?;
        let local = match &spec.source {
            crate::manifest::SourceUri::Local { path } => under.relative_of(path),
            _ => None,
        };
        let dir = local.unwrap_or_else(|| spec.path.segments().iter().collect());
        Some(crate::adopt::AdoptFrom { under, dir })
    }

    /// The store to fetch `artifact` into for `key`, and a seed store to hard-link known blobs
    /// from (see [`decide::fetch_target`]).
    fn fetch_target(
        &mut self,
        key: &ModelKey,
        artifact: &ArtifactId,
    ) -> (StoreId, Option<StoreId>) {
        let target = decide::fetch_target(&mut self.records, key, artifact);
        self.execute(target.effects);
        (target.store, target.seed)
    }

    /// Source digest -> blob of the complete artifacts of `stores`.
    fn known_blobs(
        &mut self,
        stores: &[Option<StoreId>],
        seed: Option<&StoreId>,
    ) -> crate::source::KnownBlobs {
        let mut known = HashMap::new();
        let ids: Vec<ArtifactId> = stores
            .iter()
            .flatten()
            .filter_map(|s| self.records.stores.get(s))
            .flat_map(|s| s.artifacts.iter().cloned())
            .collect();
        for a in ids {
            if let Some(stored) = self.artifact(&a) {
                for (e, blob) in stored.files() {
                    known.insert(e.digest, *blob);
                }
            }
        }
        crate::source::KnownBlobs {
            known,
            seed: seed.and_then(|s| self.state.existing_store(s)),
        }
    }

    fn on_fetched(
        &mut self,
        key: ModelKey,
        fp: String,
        store: StoreId,
        manifest: Arc<Manifest>,
        result: Result<Vec<Sha256Digest>, SourceError>,
    ) {
        let current = self.works.get(&key).is_some_and(|w| w.fingerprint == fp);
        match result {
            Ok(blobs) => {
                // A complete, verified artifact is real data whether or not the model still
                // wants it: record it so that the store (and any waiter) can use it.
                let stored = match StoredArtifact::new(manifest.clone(), blobs, now_secs()) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::error!(model = %key, error = %e, "fetch returned an inconsistent artifact");
                        return;
                    }
                };
                if let Err(e) = self.state.save_artifact(&stored) {
                    let err = SourceError::Store {
                        path: "artifact record".into(),
                        source: crate::store::StoreError::io("saving artifact", e),
                    };
                    if current {
                        self.fail(&key, &fp, &err);
                    }
                    return;
                }
                let id = stored.id.clone();
                self.artifacts.insert(id.clone(), Arc::new(stored));
                if let Some(s) = self.records.stores.get_mut(&store) {
                    s.artifacts.insert(id.clone());
                }
                self.update_store_bytes(&store);
                if current {
                    let spec = self.works[&key].spec.clone();
                    if let Stage::Fetching { progress, .. } = &self.works[&key].stage {
                        self.metrics.ome.record(
                            ome_labels(&key),
                            crate::metrics::DownloadOutcome::Succeeded {
                                seconds: progress.started.elapsed().as_secs_f64(),
                                bytes: progress.fetched_bytes.load(Ordering::Relaxed),
                            },
                        );
                    }
                    tracing::info!(model = %key, %store, "fetch complete and verified");
                    // The path rule again, atomically with the flip: an earlier model may have
                    // claimed the path while this one was fetching.
                    match self.verdict_for(&key, &spec.path, ClaimArtifact::Known(id.clone())) {
                        PathVerdict::Clear => {
                            self.serve(&key, store, id, manifest.revision.clone(), &spec);
                        }
                        PathVerdict::Wait { on } => {
                            tracing::info!(model = %key, waits_for = %on, "fetched; an earlier model on the same path is resolving");
                            self.wait(&key, on, manifest);
                        }
                        PathVerdict::Conflict { reason, .. } => {
                            self.fail_conflict(&key, &fp, reason, Some(id))
                        }
                    }
                }
            }
            // A cancelled fetch of work that is still current was not cancelled by us (the task
            // died): fail it as transient so it is retried rather than stuck in Updating.
            Err(e) => {
                if current {
                    self.fail(&key, &fp, &e);
                }
            }
        }
        self.wake_waiters();
    }

    /// `key` waits for `on`'s work (its fetch of the same artifact, or its resolve on the same
    /// path) with its own artifact known.
    fn wait(&mut self, key: &ModelKey, on: ModelKey, manifest: Arc<Manifest>) {
        if let Some(w) = self.works.get_mut(key) {
            w.stage = Stage::Waiting { manifest };
            self.waiting_on.entry(on).or_default().insert(key.clone());
        }
    }

    /// `key`'s work moved on (resolved, fetched, failed, cancelled, served): the models waiting
    /// for it decide again at the next [`Reconciler::wake_waiters`].
    fn work_changed(&mut self, key: &ModelKey) {
        if let Some(waiters) = self.waiting_on.remove(key) {
            self.to_wake.extend(waiters);
        }
    }

    /// Waiters whose model's work moved on decide again: they map onto the result, keep
    /// waiting, or fetch themselves if it failed. Only those: an event costs its own waiters,
    /// not every waiter of the node.
    fn wake_waiters(&mut self) {
        while let Some(k) = self.to_wake.pop_first() {
            let manifest = match self.works.get(&k).map(|w| &w.stage) {
                Some(Stage::Waiting { manifest }) => manifest.clone(),
                _ => continue,
            };
            self.decide(&k, manifest);
        }
    }

    /// Records that `key` is served from `store` (which holds `artifact` complete), releasing
    /// or handing over the model's own store if it moved away from it (T-02, T-04; see
    /// [`decide::serve`]).
    fn serve(
        &mut self,
        key: &ModelKey,
        store: StoreId,
        artifact: ArtifactId,
        sha: String,
        spec: &ModelSpec,
    ) {
        self.works.remove(key);
        self.work_changed(key);
        self.retries.remove(key);
        let (changed, effects) = decide::serve(
            &mut self.records,
            key,
            decide::Serve {
                store: store.clone(),
                artifact: artifact.clone(),
                sha,
                path: spec.path.to_string(),
                source: spec.source.to_string(),
            },
        );
        if let Some(rec) = self.records.models.get_mut(key) {
            rec.served_parameters = parameters_digest(&spec.parameters);
        }
        if changed {
            tracing::info!(model = %key, %store, artifact = %artifact, "mapping changed");
        }
        self.execute(effects);
        self.index_paths(key);
        self.remap_needed = true;
    }

    /// Executes the disk work decisions asked for, in order (see [`decide::Effect`]). Runs on
    /// the actor's own thread, never on the async runtime's workers.
    fn execute(&mut self, effects: Vec<Effect>) {
        for effect in effects {
            match effect {
                Effect::SaveRecords => {
                    self.save();
                }
                Effect::LinkStore(split) => {
                    let linked = self.link_store(&split);
                    decide::finish_split(&mut self.records, &split, linked);
                }
            }
        }
    }

    /// Makes `split.to` hold hard links to the blobs of `split.artifacts` in `split.from` (the
    /// store does the linking).
    fn link_store(&mut self, split: &decide::Split) -> Result<(), String> {
        let mut blobs = Vec::new();
        for a in &split.artifacts {
            let stored = self.artifact(a).ok_or("artifact record missing")?;
            blobs.extend(stored.blobs.iter().copied());
        }
        self.state
            .link_blobs(&split.from, &split.to, &blobs)
            .map_err(|e| e.to_string())
    }

    /// A `vendor://` model: its files come with the serving runtime, so, as OME's agent does,
    /// nothing is fetched or mounted and the model is `Ready` at once. A copy it owned before
    /// (its source changed to vendor) is handed to its children or released.
    fn serve_without_files(&mut self, key: &ModelKey, spec: &ModelSpec) {
        self.cancel_work(key);
        self.retries.remove(key);
        let effects = decide::serve_without_files(&mut self.records, key, spec.source.to_string());
        self.execute(effects);
        tracing::info!(model = %key, source = %spec.source, "vendor model: Ready with no files");
        self.wake_waiters();
    }

    fn delete(&mut self, key: &ModelKey) {
        self.cancel_work(key);
        self.retries.remove(key);
        self.path_losers.remove(key);
        tracing::info!(model = %key, "model deleted");
        let effects = decide::delete(&mut self.records, key);
        self.execute(effects);
        self.index_paths(key);
        self.work_changed(key);
        self.wake_waiters();
    }

    fn cancel_work(&mut self, key: &ModelKey) {
        if let Some(w) = self.works.remove(key) {
            w.cancel.cancel();
        }
        self.work_changed(key);
    }

    fn fail(&mut self, key: &ModelKey, fp: &str, err: &SourceError) {
        if self
            .works
            .get(key)
            .is_some_and(|w| w.refresh && w.fingerprint == fp)
        {
            // The served artifact is still good: the model stays Ready.
            tracing::warn!(model = %key, error = %err, "re-resolving failed; still serving the artifact resolved before");
            self.cancel_work(key);
            self.work_changed(key);
            return;
        }
        if let Some(outcome) = err.ome_outcome() {
            self.metrics.ome.record(ome_labels(key), outcome);
        }
        self.cancel_work(key);
        let transient = err.is_transient();
        let mut reason = err.to_string();
        if transient {
            let attempts = self
                .retries
                .get(key)
                .filter(|r| r.fingerprint == fp)
                .map(|r| r.attempts + 1)
                .unwrap_or(1);
            let delay = decide::retry_delay(
                self.config.retry_base,
                self.config.retry_max,
                attempts,
                now_nanos_fraction(),
            );
            reason = format!("{reason} (retry {attempts} in {}s)", delay.as_secs().max(1));
            self.retries.insert(
                key.clone(),
                Retry {
                    fingerprint: fp.to_string(),
                    attempts,
                    at: Instant::now() + delay,
                },
            );
        } else {
            self.retries.remove(key);
        }
        tracing::warn!(model = %key, reason, "model failed");
        if let Some(rec) = self.records.models.get_mut(key) {
            rec.phase = ModelPhase::Failed;
            rec.reason = Some(reason);
        }
    }

    /// `key` lost the path rule: it is `Failed` with the reason (naming the model it lost to)
    /// and waits, without retries, until `settle_paths` finds the rule clear for it. What it
    /// served before (an old path or revision that did not conflict) stays served.
    fn fail_conflict(
        &mut self,
        key: &ModelKey,
        fp: &str,
        reason: String,
        artifact: Option<ArtifactId>,
    ) {
        self.cancel_work(key);
        self.retries.remove(key);
        self.path_losers.insert(
            key.clone(),
            PathLoser {
                fingerprint: fp.to_string(),
                artifact,
            },
        );
        if let Some(rec) = self.records.models.get_mut(key) {
            if rec.reason.as_deref() != Some(reason.as_str()) {
                tracing::warn!(model = %key, reason, "path conflict");
            }
            rec.phase = ModelPhase::Failed;
            rec.reason = Some(reason);
        }
    }

    /// Why `path` cannot be a model path: it nests with the Hugging Face cache view.
    fn hf_cache_conflict(&self, path: &MountPath) -> Option<String> {
        let dir = self.config.hf_cache_dir.as_ref()?;
        crate::fs::hf_cache::path_conflict(path.segments(), dir.segments())
    }

    /// Fails `key` because its path lies in or around the cache view's directory. Not a path
    /// loser: no other model's change clears it, so it waits for its own spec (or a restart
    /// with other flags), like any permanent failure.
    fn fail_in_cache_view(&mut self, key: &ModelKey, reason: String) {
        self.cancel_work(key);
        self.retries.remove(key);
        if let Some(rec) = self.records.models.get_mut(key) {
            if rec.reason.as_deref() != Some(reason.as_str()) {
                tracing::warn!(model = %key, reason, "path conflict with the cache view");
            }
            rec.phase = ModelPhase::Failed;
            rec.reason = Some(reason);
        }
    }

    /// What `key`'s work claims on its wanted path: pending while resolving, known once
    /// resolved; a loser keeps the artifact it lost with.
    fn wanted_claim(&self, key: &ModelKey) -> decide::Wanted {
        let artifact = match self.works.get(key).map(|w| &w.stage) {
            Some(Stage::Resolving) => Some(ClaimArtifact::Pending),
            Some(Stage::Waiting { manifest }) => Some(ClaimArtifact::Known(manifest.id())),
            Some(Stage::Fetching { artifact, .. }) => Some(ClaimArtifact::Known(artifact.clone())),
            None => None,
        };
        decide::Wanted {
            working: self.works.contains_key(key),
            artifact: artifact.unwrap_or_else(|| {
                match self.path_losers.get(key).and_then(|l| l.artifact.clone()) {
                    Some(a) => ClaimArtifact::Known(a),
                    None => ClaimArtifact::Unknown,
                }
            }),
        }
    }

    /// Every model's claims on paths below the mount (see [`decide::claims`]).
    fn claims(&self) -> Vec<PathClaim> {
        decide::claims(&self.records, self.records.models.keys(), |k| {
            self.wanted_claim(k)
        })
    }

    /// The rule's verdict on `key` serving `artifact` at `path` (its wanted claim), against the
    /// claims of the models whose paths nest with it (the others cannot matter).
    fn verdict_for(
        &self,
        key: &ModelKey,
        path: &MountPath,
        artifact: ClaimArtifact,
    ) -> PathVerdict {
        let seq = self.records.models.get(key).map_or(u64::MAX, |r| r.seq);
        let related = self.related_keys(path.segments());
        let claims = decide::claims(&self.records, &related, |k| self.wanted_claim(k));
        decide::verdict_for(claims, key, seq, path, artifact)
    }

    /// Applies the path rule to the whole state after an event (and at start-up): a served
    /// model that now loses (an earlier model resolved to another artifact on its path, or
    /// records from before this rule hold two) is unmapped and `Failed`; a model whose work
    /// now loses stops; a loser the rule clears (the model it lost to went away, moved or
    /// changed) gets its turn.
    fn settle_paths(&mut self) {
        let claims = self.claims();
        let verdicts = decide::path_verdicts(&claims);
        let mut turns = Vec::new();
        for (c, v) in claims.iter().zip(verdicts) {
            match (c.kind, v) {
                (ClaimKind::Served, PathVerdict::Conflict { reason, .. }) => {
                    let Some(rec) = self.records.models.get_mut(&c.key) else {
                        continue;
                    };
                    let fp = rec.fingerprint.clone();
                    let artifact = rec.artifact.clone();
                    // Unmapped; its own store (and any child on it) is kept, as for an invalid
                    // object: getting its turn back costs no download.
                    decide::unmap(rec);
                    tracing::warn!(model = %c.key, reason, "served model loses a path conflict; unmapped");
                    if self.works.contains_key(&c.key) {
                        // A change in progress decides again (through the rule) when resolved.
                        rec.reason = Some(reason);
                    } else {
                        self.fail_conflict(&c.key, &fp, reason, artifact);
                    }
                    self.remap_needed = true;
                }
                (ClaimKind::Wanted, PathVerdict::Conflict { reason, .. }) => {
                    if let Some(w) = self.works.get(&c.key) {
                        let fp = w.fingerprint.clone();
                        let artifact = match &c.artifact {
                            ClaimArtifact::Known(a) => Some(a.clone()),
                            _ => None,
                        };
                        self.fail_conflict(&c.key, &fp, reason, artifact);
                    } else if self.path_losers.contains_key(&c.key) {
                        // Still losing, maybe to another model now: keep the reason current.
                        if let Some(rec) = self.records.models.get_mut(&c.key) {
                            rec.reason = Some(reason);
                        }
                    }
                }
                (ClaimKind::Wanted, PathVerdict::Clear)
                    if self.path_losers.contains_key(&c.key) =>
                {
                    turns.push(c.key.clone());
                }
                _ => {}
            }
        }
        for key in turns {
            let Some(loser) = self.path_losers.remove(&key) else {
                continue;
            };
            let spec = self
                .desired
                .as_ref()
                .and_then(|d| d.models.get(&key))
                .and_then(|m| m.as_ref().ok())
                .cloned();
            let Some(spec) = spec else {
                continue;
            };
            tracing::info!(model = %key, "path conflict resolved; the model gets its turn");
            self.retries.insert(
                key.clone(),
                Retry {
                    fingerprint: loser.fingerprint,
                    attempts: 0,
                    at: Instant::now(),
                },
            );
            if self.ensure(&key, &spec) {
                self.remap_needed = true;
            }
        }
    }

    // ----- mapping -------------------------------------------------------------------------

    fn artifact(&mut self, id: &ArtifactId) -> Option<Arc<StoredArtifact>> {
        if let Some(a) = self.artifacts.get(id) {
            return Some(a.clone());
        }
        match self.state.load_artifact(id) {
            Ok(a) => {
                let a = Arc::new(a);
                self.artifacts.insert(id.clone(), a.clone());
                Some(a)
            }
            Err(e) => {
                tracing::error!(artifact = %id, error = %e, "artifact record unreadable");
                None
            }
        }
    }

    /// Builds the mount entries from the records and swaps the mapping. The path rule has run
    /// (`settle_paths`), so served paths never nest; models sharing a path serve the same
    /// artifact, and the earliest of them (by creation order, then key) supplies the store.
    fn remap(&mut self) {
        let mut served: Vec<(u64, ModelKey, MountPath, ArtifactId, StoreId)> = Vec::new();
        for (key, rec) in &self.records.models {
            let (Some(a), Some(s), Some(p)) = (&rec.artifact, &rec.store, &rec.served_path) else {
                continue;
            };
            let Ok(path) = MountPath::from_relative(p) else {
                continue;
            };
            served.push((rec.seq, key.clone(), path, a.clone(), s.clone()));
        }
        served.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        let mut entries: Vec<MountEntry> = Vec::with_capacity(served.len());
        let mut at: HashMap<MountPath, (ModelKey, ArtifactId)> = HashMap::new();
        let mut hf_served = Vec::new();
        for (_, key, path, artifact, store) in served {
            if self.hf_cache_conflict(&path).is_some() {
                continue;
            }
            if let Some((first, a)) = at.get(&path) {
                if *a != artifact {
                    // The rule guarantees this never happens; the fs layer would refuse the
                    // whole mapping, so say which models broke it.
                    tracing::error!(model = %key, other = %first, %path, "two served models with different artifacts on one path");
                } else {
                    continue;
                }
            }
            at.insert(path.clone(), (key.clone(), artifact.clone()));
            let Some(stored) = self.artifact(&artifact) else {
                continue;
            };
            let handle = match self.state.store(&store) {
                Ok(h) => self.fs.store_handle(&store, h),
                Err(e) => {
                    tracing::error!(%store, error = %e, "store directory unusable");
                    continue;
                }
            };
            if self.hf_cache.is_some() {
                let source = self.records.models[&key].served_source.as_deref();
                if let Some(Ok(SourceUri::HuggingFace { repo, revision })) =
                    source.map(SourceUri::parse)
                {
                    hf_served.push(HfServed {
                        model: key.to_string(),
                        repo,
                        revision,
                        artifact: stored.clone(),
                        store: handle.clone(),
                    });
                }
            }
            entries.push(MountEntry {
                path: path.segments().to_vec(),
                artifact: stored,
                store: handle,
            });
        }
        // The cache view joins the same snapshot: its refs and snapshots flip with the paths.
        let mut files = Vec::new();
        if let Some(view) = &mut self.hf_cache {
            let (snapshots, refs) = view.update(&hf_served, Instant::now());
            entries.extend(snapshots);
            files = refs;
        }
        match self.fs.apply_with_files(&entries, &files) {
            Ok(inv) => {
                self.metrics.mapping_changes.inc();
                match &self.mount {
                    Some(m) => m.invalidate(inv),
                    // No kernel to tell: retired slots stop pinning their stores now.
                    None => self.fs.detach_all(&inv),
                }
            }
            Err(e) => tracing::error!(error = %e, "mapping update refused"),
        }
    }

    // ----- start-up ------------------------------------------------------------------------

    /// Makes the records consistent with the disk after a crash: a placement whose artifact
    /// file or blobs are missing is dropped (the model is fetched again; verified blobs that are
    /// present are kept and not fetched again), and a store's artifact that is incomplete is
    /// forgotten. Only `stat`s: blobs under their final name were verified before the rename.
    fn recover(&mut self) {
        let mut records = std::mem::take(&mut self.records);
        let forgotten = decide::recover(&mut records, |a, s| self.complete_in(a, s));
        self.records = records;
        for (store, artifact) in forgotten {
            tracing::warn!(%store, %artifact, "artifact incomplete after restart; will fetch again");
        }
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
            .all(|(e, blob)| handle.has_blob(blob, e.size));
        complete
    }

    // ----- persistence and status ----------------------------------------------------------

    fn refresh_store_bytes(&mut self) {
        let ids: Vec<StoreId> = self.records.stores.keys().cloned().collect();
        self.store_bytes.clear();
        for id in ids {
            self.update_store_bytes(&id);
        }
    }

    fn update_store_bytes(&mut self, id: &StoreId) {
        let bytes = self
            .state
            .existing_store(id)
            .map(|s| s.disk_usage())
            .unwrap_or(0);
        self.store_bytes.insert(id.clone(), bytes);
        self.metrics
            .store_bytes
            .get_or_create(&crate::metrics::StoreLabel {
                store: id.to_string(),
            })
            .set(bytes as i64);
    }
}

/// The labels of OME's model-agent metrics for a model.
fn ome_labels(key: &ModelKey) -> crate::metrics::OmeModelLabels {
    let (namespace, name) = split_key(key);
    crate::metrics::OmeModelLabels {
        model_type: if namespace.is_some() {
            "BaseModel"
        } else {
            "ClusterBaseModel"
        }
        .to_owned(),
        namespace: namespace.unwrap_or_default(),
        name,
    }
}

/// `(namespace, name)` of an OME key.
fn split_key(key: &ModelKey) -> (Option<String>, String) {
    let s = key.as_str();
    if let Some(name) = s.strip_prefix("clusterbasemodel.") {
        return (None, name.to_string());
    }
    match s.split_once(".basemodel.") {
        Some((ns, name)) => (Some(ns.to_string()), name.to_string()),
        None => (None, s.to_string()),
    }
}

fn now_nanos_fraction() -> f64 {
    let n = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    f64::from(n % 1000) / 1000.0
}

#[cfg(test)]
mod tests;
