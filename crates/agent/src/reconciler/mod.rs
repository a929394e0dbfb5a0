//! The reconciler: the one place that decides. It owns the durable records and turns the
//! desired set of models (from the standalone directory or Kubernetes) into resolve and fetch
//! tasks, placements and mapping flips.
//!
//! # Model
//! A single actor handles one message at a time (desired state changed, a resolve or fetch
//! finished, the mount server refused entries, a timer tick), so decisions never race each
//! other and need no locks. For each, it builds a [`decide::Event`] (with what the decision
//! needs from outside the records: work in flight, the path claims of the models whose paths
//! nest with the model's, which copies lack blobs on disk), asks the pure decision core
//! `decide::decide(records, event)`, and executes the [`decide::Effect`]s of the answer in
//! order: save the records before a store directory exists, start a fetch, wait, lose a path,
//! fail with a retry, link a split store, rebuild the mapping. Outcomes come back as events
//! (a fetch's, a split's). The actor runs on a thread of its own (the runtime's blocking pool),
//! so its fsyncs, links and record writes never stall the async workers that serve HTTP,
//! Kubernetes watches and downloads. Slow work (hashing, copying, downloading) runs in spawned
//! tasks that report back with messages; they never touch the records.
//!
//! Still decided here rather than in the core: whether a spec change needs work at all
//! (fingerprints, the one fresh attempt after a restart, retries due) and the retry delays'
//! bookkeeping (their timers are the actor's).
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
//! manifest is reused), then [`decide::Event::ArtifactKnown`] (see [`decide::placement`]):
//! serve from an existing holder, wait for an in-flight fetch of the same artifact (single
//! flight), or fetch into the model's own store. Until the new placement is complete and
//! verified, the model keeps being served as before; then [`decide::Event::Fetched`] records
//! the new placement and the mapping flips in one swap. This one
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
//! of paths, [`Reconciler::related_keys`]); its reuse candidates, store users and owners come
//! from the records' own indexes ([`records::RecordsIndex`]), and single flight from an index
//! of work in flight by artifact and source; a model that waits is woken only by the model it
//! waits for ([`Reconciler::work_changed`]), not by every event; the whole-state passes (the
//! path rule over all claims, the mapping swap, saving the records, the status document) run
//! once per batch of up to `MAX_BATCH` queued events, not once per event, and no more often
//! than their own cost allows ([`FlushPacer`]): at 10,000 models a pass costs a noticeable
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
//! most [`FLUSH_DELAY_MAX`] plus one pass later; explicitly and at once where an action must
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

pub mod decide;
pub mod gc;
mod model_config;
mod persist;
mod progressive;
pub mod records;
mod space;
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

use crate::metrics::Metrics;
use crate::source::{FetchContext, Progress, Source, SourceConfig, SourceError};
use modelfs_core::artifact::{ArtifactId, Manifest, Sha256Digest, StoredArtifact};
use modelfs_core::store::{StateDir, StoreId};
use modelfs_mount::vfs::hf_cache::{HfCacheView, HfServed};
use modelfs_mount::vfs::{FsCore, MountEntry};
use modelfs_ome::status::StatusDoc;
use modelfs_ome::{ModelKey, ModelSpec, MountPath, SourceUri};
use records::{ModelPhase, ModelRecord, Records};

use decide::{ClaimArtifact, Effect, PathClaim, PathVerdict};

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

/// The whole-state passes after a batch (path rule, mapping, records, status: each O(models))
/// wait after each run for this many times what that run cost, so they take at most about a
/// fifth of the actor's time however fast events arrive (see [`FlushPacer`]).
const FLUSH_COST_RATIO: u32 = 4;

/// ... but never longer than this: the status and the mapping lag the records by at most this
/// plus one pass.
const FLUSH_DELAY_MAX: Duration = Duration::from_secs(1);

/// Longest time between two garbage collection passes when nothing changes.
const GC_BACKSTOP: Duration = Duration::from_secs(600);

/// Where mapping changes go (the mount side owns the trait: see [`modelfs_mount`]).
pub use modelfs_mount::MountSink;

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
    /// [`modelfs_mount::vfs::hf_cache`].
    pub hf_cache_dir: Option<MountPath>,
    /// How long a snapshot stays in the view after no model serves it.
    pub hf_cache_linger: Duration,
    /// How often a Ready model whose source can change under the same URI (an object-store
    /// prefix, a Hugging Face branch or tag) is resolved again; `None` (the default, as OME's
    /// agent, which reads a source only when the model object changes) never. See
    /// [`Reconciler::refresh_due`].
    pub resolve_interval: Option<Duration>,
    /// Serve a model while it downloads: its listing at once, each file once it verified
    /// ([`progressive`]). On in standalone mode; off by default.
    pub serve_while_downloading: bool,
    /// `--disk-budget`: fetches that do not fit are not started (`None`: no admission; see
    /// [`crate::disk`]).
    pub disk_budget: Option<crate::disk::DiskBudget>,
}

/// [`ReconcilerConfig::max_concurrent_fetches`] unless configured.
pub const DEFAULT_MAX_CONCURRENT_FETCHES: usize = 4;

impl ReconcilerConfig {
    /// The defaults around `sources` (which has none: building its HTTP clients can fail, and
    /// that is the caller's error to report).
    pub fn new(sources: SourceConfig) -> Self {
        Self {
            models_root_dir: PathBuf::from("/mnt/models"),
            gc_grace: Duration::from_secs(300),
            tick: Duration::from_secs(1),
            max_concurrent_fetches: DEFAULT_MAX_CONCURRENT_FETCHES,
            retry_base: Duration::from_secs(2),
            retry_max: Duration::from_secs(300),
            sources,
            hf_cache_dir: None,
            hf_cache_linger: Duration::from_secs(300),
            resolve_interval: None,
            serve_while_downloading: false,
            disk_budget: Some(crate::disk::DiskBudget::default()),
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
    /// The pacer's wake-up: deferred whole-state passes are due (see [`FlushPacer`]).
    Flush,
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
        /// Files of the artifact checked by their size only ([`Progress::size_only_files`]).
        size_only_files: u32,
    },
    Tick,
    /// The config files of a complete artifact were parsed.
    ConfigParsed {
        artifact: ArtifactId,
        outcome: modelfs_ome::modelconfig::Outcome,
    },
    /// The config of a model read in place was parsed ([`model_config`]).
    NodeDirConfigParsed {
        key: ModelKey,
        generation: u64,
        outcome: modelfs_ome::modelconfig::Outcome,
    },
    /// The mount server left these entries of the mapping out (a missing blob or store), with
    /// its reasons: the models served there are `Failed` and retried.
    MountRefused(Vec<modelfs_mount::protocol::RefusedEntry>),
    /// What the mount server serves changed (it confirmed a mapping, or it is away past the
    /// grace period): the status is published again.
    MountServing,
    /// A fetch served while it downloads verified or failed a file ([`progressive`]).
    LiveChanged(ModelKey),
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

/// Work in flight indexed the way single flight asks about it, so a placement looks only at the
/// models fetching its artifact or resolving its source, not at all work of the node. Kept in
/// step with every stage change ([`Reconciler::set_stage`], [`Reconciler::remove_work`]).
#[derive(Default)]
struct InFlightIndex {
    fetching: HashMap<ArtifactId, BTreeSet<ModelKey>>,
    resolving: HashMap<String, BTreeSet<ModelKey>>,
}

impl InFlightIndex {
    fn add(&mut self, key: &ModelKey, work: &Work) {
        match &work.stage {
            Stage::Resolving => self
                .resolving
                .entry(work.spec.source.to_string())
                .or_default()
                .insert(key.clone()),
            Stage::Fetching { artifact, .. } => self
                .fetching
                .entry(artifact.clone())
                .or_default()
                .insert(key.clone()),
            Stage::Waiting { .. } => false,
        };
    }

    fn remove(&mut self, key: &ModelKey, work: &Work) {
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
        match &work.stage {
            Stage::Resolving => take(&mut self.resolving, &work.spec.source.to_string(), key),
            Stage::Fetching { artifact, .. } => take(&mut self.fetching, artifact, key),
            Stage::Waiting { .. } => {}
        }
    }
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
    disk: Arc<ArcSwap<crate::disk::DiskState>>,
}

impl ReconcilerHandle {
    /// The disk as last measured (`/v1/disk`, `modelfs status`).
    pub fn disk(&self) -> Arc<crate::disk::DiskState> {
        self.disk.load_full()
    }

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
    // Only when filtered, so other models keep their fingerprints; a relabelled node (another
    // alias) selects other objects and needs a new resolve.
    if let Some(shape) = &spec.shape {
        h.update(b"shape\0");
        h.update(shape.as_bytes());
    }
    if let Some(dir) = &spec.node_dir {
        h.update(b"node_dir\0");
        h.update(dir.as_os_str().as_encoded_bytes());
    }
    hex::encode(&h.finalize()[..16])
}

/// Whether the same URI may name other content later: object-store prefixes (objects can be
/// overwritten, added or removed) and Hugging Face branches or tags (a commit cannot change).
fn source_may_change(source: &SourceUri) -> bool {
    match source {
        SourceUri::ObjectStore { .. } | SourceUri::Oci { .. } => true,
        SourceUri::HuggingFace { revision, .. } => !modelfs_ome::source::is_commit_hash(revision),
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

/// The record's `path`: the model's path relative to the mount, or for a model whose
/// directory lies outside the models root ([`ModelSpec::node_dir`]) that absolute directory
/// (never a mount path: the path index skips it, and the status shows it as it is).
fn recorded_path(spec: &ModelSpec) -> String {
    match &spec.node_dir {
        Some(dir) => dir.display().to_string(),
        None => spec.path.to_string(),
    }
}

/// What the records keep of everything besides the URI that selects a model's files: the
/// parameters' digest and, for a TensorRT-LLM model, the shape alias its objects are filtered
/// by, so that an artifact is reused only for the same selection (a relabelled node resolves
/// again). Without a shape it is [`parameters_digest`], so existing records keep matching.
fn selection_digest(spec: &ModelSpec) -> Option<String> {
    let Some(shape) = &spec.shape else {
        return parameters_digest(&spec.parameters);
    };
    let mut h = Sha256::new();
    h.update(parameters_digest(&spec.parameters).unwrap_or_default());
    h.update(b"\0shape\0");
    h.update(shape.as_bytes());
    Some(hex::encode(&h.finalize()[..16]))
}

pub struct Reconciler {
    config: ReconcilerConfig,
    state: StateDir,
    records: Records,
    /// Digest of the records as last saved (the whole document is not kept to compare with).
    saved: Option<Sha256Digest>,
    fs: Arc<FsCore>,
    mount: Option<Arc<dyn MountSink>>,
    metrics: Arc<Metrics>,
    desired: Option<DesiredState>,
    works: BTreeMap<ModelKey, Work>,
    retries: HashMap<ModelKey, Retry>,
    /// How often the mount server refused each model (with the fingerprint it had then).
    mount_refusals: HashMap<ModelKey, (String, u32)>,
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
    path_index: BTreeMap<Vec<String>, records::SmallSet<ModelKey>>,
    indexed_paths: HashMap<ModelKey, Vec<Vec<String>>>,
    /// Models waiting (single flight, or an earlier model resolving on the same path), by the
    /// model whose work they wait for: only its changes wake them.
    waiting_on: HashMap<ModelKey, BTreeSet<ModelKey>>,
    /// Waiters to decide again before the event ends.
    to_wake: BTreeSet<ModelKey>,
    /// Work in flight by what single flight asks about (see [`Reconciler::in_flight`]).
    in_flight_index: InFlightIndex,
    artifacts: HashMap<ArtifactId, Arc<StoredArtifact>>,
    /// What each served artifact's config files give (see [`model_config`]).
    model_configs: HashMap<ArtifactId, Arc<modelfs_ome::modelconfig::Outcome>>,
    model_configs_pending: std::collections::HashSet<ArtifactId>,
    /// What the config of each model read in place gives (see [`model_config`]).
    node_dir_configs: HashMap<ModelKey, model_config::NodeDirConfig>,
    gc_candidates: gc::Candidates,
    store_bytes: BTreeMap<StoreId, u64>,
    fetch_slots: Arc<Semaphore>,
    /// Where workers report (weak: the actor alone must not keep its own queue open; see
    /// [`Reconciler::sender`]).
    tx: mpsc::WeakUnboundedSender<Event>,
    status: Arc<ArcSwap<StatusDoc>>,
    status_changes: Arc<tokio::sync::watch::Sender<Arc<StatusDoc>>>,
    /// Digest of the status document last published.
    status_digest: Option<Sha256Digest>,
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
    records_writes: persist::FileWrites,
    status_writes: persist::FileWrites,
    /// The latest status document could not be written to `status.json` yet.
    status_file_stale: bool,
    /// Events changed the records or the status since the last whole-state passes.
    flush_pending: bool,
    /// Saves of the records attempted so far. A fetch into a store directory that does not
    /// exist yet waits for the save after its decision before creating it (the effect
    /// `SaveRecords`), so a crash never leaves a directory that no saved record names, and
    /// the fetches decided between two paced passes share one records write instead of
    /// costing one each (a write is O(models): at 10,000 models, one per fetch made the
    /// import quadratic).
    saves: tokio::sync::watch::Sender<u64>,
    /// A fetch waits for the next save (see `saves`).
    fetch_awaits_save: bool,
    flush_pacer: FlushPacer,
    /// Fetches served while they download ([`progressive`]).
    live: progressive::Live,
    /// The disk budget's bookkeeping (see [`space`]).
    disk: space::Disk,
}

/// When the whole-state passes may run again. Each pass over the state costs time proportional
/// to the number of models, and events arrive one by one while a node imports (a fetch
/// completing, a config parsed): run after every batch, the passes made an import of N models
/// cost O(N^2) (10,000 models: most of the actor's time went to rebuilding the mapping, the
/// records file and the status document). Paced by their own measured cost instead, they take
/// a bounded share of the time at any scale, and with few models (a pass of microseconds) they
/// still run after every batch. Decisions never wait for them (only a fetch into a new store
/// directory waits for the next records write: see `Reconciler::saves`): what is derived from
/// the records (the mapping, `records.json`, the status) lags, by at most [`FLUSH_DELAY_MAX`] plus
/// one pass, and all of it together, so the status never says Ready before the mapping serves
/// the model.
struct FlushPacer {
    /// Not before this instant.
    next: Instant,
    /// A wake-up for `next` is on its way.
    wake_pending: bool,
}

impl FlushPacer {
    fn new() -> Self {
        Self {
            next: Instant::now(),
            wake_pending: false,
        }
    }

    fn due(&self, now: Instant) -> bool {
        now >= self.next
    }

    /// A pass that started at `started` just ended.
    fn ran(&mut self, started: Instant) {
        let now = Instant::now();
        self.next = now + ((now - started) * FLUSH_COST_RATIO).min(FLUSH_DELAY_MAX);
    }
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
        let config_budget = config.disk_budget;
        let mut r = Reconciler {
            fetch_slots: Arc::new(Semaphore::new(config.max_concurrent_fetches.max(1))),
            config,
            state,
            records,
            saved: None,
            fs,
            mount,
            metrics,
            desired: None,
            works: BTreeMap::new(),
            retries: HashMap::new(),
            mount_refusals: HashMap::new(),
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
            in_flight_index: InFlightIndex::default(),
            artifacts: HashMap::new(),
            model_configs: HashMap::new(),
            model_configs_pending: std::collections::HashSet::new(),
            node_dir_configs: HashMap::new(),
            gc_candidates: gc::Candidates::default(),
            store_bytes: BTreeMap::new(),
            tx: tx.downgrade(),
            status: status.clone(),
            status_changes: status_changes.clone(),
            status_digest: None,
            ready: ready.clone(),
            alive: alive.clone(),
            last_gc: Instant::now(),
            hf_cache: None,
            gc_due: true,
            gc_usage_seen: 0,
            records_writes: persist::FileWrites::new("records.json"),
            status_writes: persist::FileWrites::new("status.json"),
            status_file_stale: false,
            flush_pending: false,
            saves: tokio::sync::watch::Sender::new(0),
            fetch_awaits_save: false,
            flush_pacer: FlushPacer::new(),
            live: progressive::Live::default(),
            disk: space::Disk::new(config_budget),
        };
        r.fs.set_wanted_hook(r.live.hook());
        r.hf_cache = r
            .config
            .hf_cache_dir
            .as_ref()
            .map(|d| HfCacheView::new(d.segments().to_vec(), r.config.hf_cache_linger));
        r.saved = serde_json::to_vec_pretty(&r.records)
            .ok()
            .map(|b| Sha256Digest::of(&b));
        if let Some(mount) = &r.mount {
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
        r.recover();
        r.resume_live_fetches();
        let keys: Vec<ModelKey> = r.records.models().keys().cloned().collect();
        for key in &keys {
            r.index_paths(key);
        }
        // Records written before the path rule was atomic may hold two served models that
        // conflict: the later one is unmapped and failed before anything is mounted.
        r.settle_paths();
        r.remap();
        r.refresh_store_bytes();
        r.report_placement();
        r.measure_disk(true);
        let disk = r.disk.shared.clone();
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
            disk,
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
            // Handle what is queued (up to MAX_BATCH events), then run the whole-state passes
            // once for all of them when the pacer allows: a burst of events (a node's models
            // arriving together) costs one mapping swap and one records write, not one each.
            let mut next = Some(first);
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
                    Event::Flush => self.flush_pacer.wake_pending = false,
                    other => self.flush_pending |= self.handle(other),
                }
                handled += 1;
                if handled < MAX_BATCH && !runtime_gone.load(Ordering::Acquire) {
                    next = rx.try_recv().ok();
                }
            }
            let pending = self.flush_pending
                || self.settle_due
                || self.remap_needed
                || self.desired_received.is_some();
            if !pending {
                // Only retries of writes that failed (a full disk), when their backoff is over.
                self.retry_failed_writes();
            } else if self.flush_pacer.due(Instant::now()) {
                self.flush();
            } else if !self.flush_pacer.wake_pending {
                self.flush_pacer.wake_pending = true;
                let tx = self.sender();
                let at = tokio::time::Instant::from_std(self.flush_pacer.next);
                tokio::runtime::Handle::current().spawn(async move {
                    tokio::time::sleep_until(at).await;
                    let _ = tx.send(Event::Flush);
                });
            }
            self.alive.store(now_secs(), Ordering::Relaxed);
        }
    }

    /// The whole-state passes: the path rule and the mapping ([`Reconciler::finish_batch`]),
    /// then the records and the status if anything changed. Paced by [`FlushPacer`].
    fn flush(&mut self) {
        let started = Instant::now();
        let changed = self.finish_batch() | std::mem::take(&mut self.flush_pending);
        if changed {
            // Records that failed to save wait for their backoff, unless a fetch waits for
            // the save to create its store directory.
            let awaited = std::mem::take(&mut self.fetch_awaits_save);
            if awaited || !self.records_writes.failing() || self.records_writes.due() {
                self.save();
            }
            self.publish();
        }
        self.flush_pacer.ran(started);
        self.metrics
            .state_pass_seconds
            .observe(started.elapsed().as_secs_f64());
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
                size_only_files,
            } => {
                let result = result.map(|blobs| (blobs, size_only_files));
                self.on_fetched(key, fingerprint, store, manifest, result);
                self.gc_due = true;
                true
            }
            Event::Tick => {
                let mut changed = self.space_tick();
                changed |= self.retry_due();
                self.refresh_due();
                self.request_node_dir_configs();
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
            Event::NodeDirConfigParsed {
                key,
                generation,
                outcome,
            } => self.on_node_dir_config_parsed(key, generation, outcome),
            Event::MountRefused(entries) => {
                self.gc_due = true;
                self.on_mount_refused(entries)
            }
            Event::MountServing => true,
            Event::LiveChanged(key) => {
                self.remap_needed |= self.works.contains_key(&key);
                false
            }
            Event::Shutdown(_) | Event::Panic(_) | Event::Flush => unreachable!("handled in run"),
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
        // A fetch served while it downloaded ended without recording anything (failed or
        // cancelled): its pending entry leaves the mapping.
        self.remap_needed |= self.live_ended();
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
            if !self.ready.load(Ordering::Relaxed) {
                // Ready (the Kubernetes status sink's first write waits for it) only once the
                // status of the first desired state is out: a sink woken in between wrote the
                // document the records alone made at start, where a model served while it
                // downloads says `Updating`, and its label flapped across a restart.
                self.publish();
                self.ready.store(true, Ordering::Relaxed);
            }
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
        if let Some(rec) = self.records.models().get(key) {
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

    /// Debug builds: the path index holds every path of every record, and the records'
    /// indexes agree with a full scan.
    #[cfg(debug_assertions)]
    fn check_path_index(&self) {
        assert_eq!(
            self.records.index(),
            &records::RecordsIndex::build(self.records.models(), self.records.stores()),
            "records index out of step"
        );
        let mut in_flight = InFlightIndex::default();
        for (k, w) in &self.works {
            in_flight.add(k, w);
        }
        assert_eq!(
            (&in_flight.fetching, &in_flight.resolving),
            (
                &self.in_flight_index.fetching,
                &self.in_flight_index.resolving
            ),
            "in-flight index out of step"
        );
        for (key, rec) in self.records.models() {
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
        for (key, rec) in self.records.models() {
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
        let token = self.token(key);
        let fp = fingerprint(spec, token.as_ref());
        if self
            .records
            .models()
            .get(key)
            .is_none_or(|r| r.fingerprint != fp)
        {
            return;
        }
        let source = match Source::for_uri(&spec.source, &self.config.sources, token, spec) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(model = %key, error = %e, "re-resolve skipped");
                return;
            }
        };
        tracing::info!(model = %key, source = %spec.source, "resolving again (periodic)");
        let cancel = self.begin_resolving(key, &fp, spec, &source, true);
        self.spawn_resolve(key, fp, source, &cancel);
    }

    /// Makes resolving `spec` the model's work (replacing any work it had); returns the work's
    /// cancellation. `refresh`: a periodic re-resolve of a Ready model.
    fn begin_resolving(
        &mut self,
        key: &ModelKey,
        fp: &str,
        spec: &ModelSpec,
        source: &Source,
        refresh: bool,
    ) -> WorkCancel {
        let cancel = WorkCancel::default();
        let work = Work {
            fingerprint: fp.to_string(),
            spec: spec.clone(),
            source: source.clone(),
            stage: Stage::Resolving,
            cancel: cancel.clone(),
            refresh,
        };
        self.remove_work(key);
        self.in_flight_index.add(key, &work);
        self.works.insert(key.clone(), work);
        cancel
    }

    /// Resolves `source` under `cancel`; the result comes back as [`Event::Resolved`].
    fn spawn_resolve(&self, key: &ModelKey, fp: String, source: Source, cancel: &WorkCancel) {
        let tx = self.sender();
        let key = key.clone();
        let flag = cancel.flag.clone();
        cancel.spawn(async move { source.resolve(flag).await }, move |result| {
            let _ = tx.send(Event::Resolved {
                key,
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
            .models()
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
            .models()
            .get(key)
            .is_some_and(|r| r.fingerprint == fp)
        {
            return false;
        }
        self.cancel_work(key);
        self.retries.remove(key);
        self.path_losers.remove(key);
        let seq = match self.records.models().get(key) {
            Some(r) => r.seq,
            None => self.records.allocate_model_seq(),
        };
        if !self.records.models().contains_key(key) {
            let rec = ModelRecord::new(
                seq,
                key.name().to_owned(),
                key.namespace().map(str::to_owned),
                ModelPhase::Failed,
            );
            self.records.insert_model(key.clone(), rec);
        }
        let mut rec = self.records.model_mut(key).expect("model record");
        tracing::warn!(model = %key, reason, "invalid model object");
        rec.fingerprint = fp;
        rec.phase = ModelPhase::Failed;
        rec.reason = Some(reason.to_string());
        // Unmapped (its path may be what is invalid) but its own store is kept: fixing the
        // object must not cost a download, and its children keep being served.
        decide::unmap(&mut rec);
        drop(rec);
        self.wake_waiters();
        true
    }

    /// The model's token as the desired state resolved it (Secret, `parameters.token`, or the
    /// environment).
    fn token(&self, key: &ModelKey) -> Option<crate::source::Token> {
        self.desired
            .as_ref()
            .and_then(|d| d.tokens.get(key))
            .cloned()
    }

    /// Starts work for a new or changed spec. Returns whether the records changed.
    fn ensure(&mut self, key: &ModelKey, spec: &ModelSpec) -> bool {
        let token = self.token(key);
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
        let mut is_new = false;
        match self.records.model_mut(key) {
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
            Some(mut rec) => {
                rec.fingerprint = fp.clone();
                rec.source = spec.source.to_string();
                rec.policy = spec.policy;
                rec.path = recorded_path(spec);
                rec.reserve = spec.reserve_artifact;
                rec.name = spec.name.clone();
                rec.namespace = spec.namespace.clone();
                rec.phase = ModelPhase::Updating;
                rec.reason = None;
                self.retries.remove(key);
            }
            None => is_new = true,
        }
        if is_new {
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
            rec.path = recorded_path(spec);
            rec.reserve = spec.reserve_artifact;
            self.records.insert_model(key.clone(), rec);
            tracing::info!(model = %key, source = %spec.source, policy = spec.policy.as_str(), "new model");
        }
        self.index_paths(key);
        if spec.source.is_vendor() || spec.node_dir.is_some() {
            if let (Some(dir), SourceUri::Local { .. }) = (&spec.node_dir, &spec.source) {
                // As OME's agent: the directory must exist (any other trouble shows when its
                // config is read); a missing one is retried as any source is.
                if let Err(e) = std::fs::metadata(dir) {
                    if e.kind() == std::io::ErrorKind::NotFound {
                        let error = crate::source::SourceError::NodeDirMissing {
                            path: dir.display().to_string(),
                        };
                        self.fail(key, &fp, &error);
                        return true;
                    }
                }
                self.node_dir_config_stale(key);
            }
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
        let source = match Source::for_uri(&spec.source, &self.config.sources, token, spec) {
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
        self.records.model_mut(key).expect("record").phase = ModelPhase::Updating;
        let rec = &self.records.models()[key];
        // Same source (and parameters) as the served artifact: only policy, path or label
        // changed. No resolve.
        let known = match (rec.artifact.clone(), rec.served_source.clone()) {
            (Some(a), Some(src))
                if src == spec.source.to_string()
                    && rec.served_parameters == selection_digest(spec) =>
            {
                self.artifact(&a)
            }
            _ => None,
        };
        let cancel = self.begin_resolving(key, &fp, spec, &source, false);
        if let Some(stored) = known {
            self.decide(key, stored.manifest.clone());
            return true;
        }
        self.spawn_resolve(key, fp, source, &cancel);
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
            Ok(m) if refresh && self.records.models()[&key].artifact.as_ref() == Some(&m.id()) => {
                tracing::debug!(model = %key, "resolved again: unchanged");
                self.remove_work(&key);
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

    /// The work in flight that single flight must respect for a placement of `artifact`
    /// resolved from `source`: from the index, not a pass over all work.
    fn in_flight(&self, source: &SourceUri, artifact: &ArtifactId) -> decide::InFlight {
        let mut out = decide::InFlight::default();
        for k in self
            .in_flight_index
            .fetching
            .get(artifact)
            .into_iter()
            .flatten()
        {
            out.fetching.insert(k.clone(), artifact.clone());
        }
        if let Some(keys) = self.in_flight_index.resolving.get(&source.to_string()) {
            out.resolving_same_source.extend(keys.iter().cloned());
        }
        out
    }

    /// Places `key`, its artifact known (the core's [`decide::Event::ArtifactKnown`]).
    fn decide(&mut self, key: &ModelKey, manifest: Arc<Manifest>) {
        let Some(work) = self.works.get(key) else {
            return;
        };
        let spec = work.spec.clone();
        let want = Self::want(&spec, &manifest);
        let space = self.space_for(key, &spec, &manifest);
        let event = decide::Event::ArtifactKnown {
            key: key.clone(),
            claims: self.related_claims(&want.path),
            in_flight: self.in_flight(&spec.source, &want.artifact),
            want,
            space,
        };
        self.apply_event(&event, Some(&manifest));
        self.admitted(key, space);
    }

    /// What `spec` asks to serve, `manifest` being its artifact.
    fn want(spec: &ModelSpec, manifest: &Manifest) -> decide::Want {
        decide::Want {
            policy: spec.policy,
            artifact: manifest.id(),
            sha: manifest.revision.clone(),
            path: spec.path.clone(),
            source: spec.source.to_string(),
            parameters: selection_digest(spec),
        }
    }

    /// Asks the core about `event` and executes its decision. `manifest`: the artifact of the
    /// model the event is about, when a fetch or a wait may follow.
    fn apply_event(&mut self, event: &decide::Event, manifest: Option<&Arc<Manifest>>) {
        let decision = decide::decide(&mut self.records, event);
        self.execute(decision.effects, manifest);
    }

    /// Starts the fetch of `key`'s artifact (`manifest`) into `store`.
    fn start_fetch(
        &mut self,
        key: &ModelKey,
        store: StoreId,
        seed: Option<StoreId>,
        manifest: Arc<Manifest>,
        after_save: Option<u64>,
    ) {
        let Some(work) = self.works.get(key) else {
            return;
        };
        let fp = work.fingerprint.clone();
        let spec = work.spec.clone();
        let artifact = manifest.id();
        let progress = Arc::new(Progress::for_manifest(&manifest));
        let live = self.live_fetch(key, &store, &manifest);
        self.set_stage(
            key,
            Stage::Fetching {
                artifact,
                store: store.clone(),
                progress: progress.clone(),
            },
        );
        let existing =
            Arc::new(self.known_blobs(&[Some(store.clone()), seed.clone()], seed.as_ref()));
        let w = self.works.get_mut(key).expect("work");
        let flag = w.cancel.flag.clone();
        let metrics = self.metrics.clone();
        let state = self.state.clone();
        let mut saves = self.saves.subscribe();
        let store_id = store.clone();
        let store_name = store.to_string();
        let source = w.source.clone();
        let cancel = w.cancel.clone();
        let tx = self.sender();
        let slots = self.fetch_slots.clone();
        let key2 = key.clone();
        let adopt = self.adopt_from(&spec);
        tracing::info!(model = %key, %store, bytes = manifest.total_size(), files = manifest.entries().len(), "fetching");
        let fetched = manifest.clone();
        let adopt_key = key2.clone();
        let counts = progress.clone();
        // The slot is taken inside the cancellable work: a cancelled fetch stops waiting
        // for one, and one that holds a slot drops it when its future is dropped.
        let work = async move {
            if let Some(n) = after_save {
                // The actor is gone when the sender is: nothing would record this fetch.
                saves
                    .wait_for(|done| *done >= n)
                    .await
                    .map_err(|_| SourceError::Cancelled)?;
            }
            let _slot = slots
                .acquire_owned()
                .await
                .map_err(|_| SourceError::Cancelled)?;
            // With the slot: a burst of fetches released by one records write must not ask
            // the blocking pool for a thread each (tokio starts up to 512).
            let handle = tokio::task::spawn_blocking(move || state.store(&store_id))
                .await
                .map_err(|_| SourceError::Cancelled)?
                .map_err(|e| SourceError::Store {
                    path: store_name,
                    source: modelfs_core::store::StoreError::io("creating store", e),
                })?;
            let ctx = FetchContext {
                store: handle,
                progress,
                cancel: flag,
                metrics,
                existing,
                live,
            };
            // Boxed: the fetch's own state is kilobytes, and every model decided at once
            // waits here for a slot (10,000 waiting fetches held 66 MB of it unboxed).
            Box::pin(crate::adopt::fetch_adopting(
                &adopt_key, &source, adopt, &fetched, ctx,
            ))
            .await
        };
        cancel.spawn(work, move |result| {
            let size_only_files = counts.size_only_files.load(Ordering::Relaxed);
            let _ = tx.send(Event::Fetched {
                key: key2,
                fingerprint: fp,
                store,
                manifest,
                result,
                size_only_files: u32::try_from(size_only_files).unwrap_or(u32::MAX),
            });
        });
    }

    /// Where a fetch of `spec` into its own store looks for files an old agent left under the
    /// models root (see [`crate::adopt`]): its `local://` directory when that lies below the
    /// root, else the model's own path (following OME's child symlinks).
    fn adopt_from(&self, spec: &ModelSpec) -> Option<crate::adopt::AdoptFrom> {
        let under = self.config.sources.under_mount.clone()?;
        let local = match &spec.source {
            modelfs_ome::SourceUri::Local { path } => under.relative_of(path),
            _ => None,
        };
        let dir = local.unwrap_or_else(|| spec.path.segments().iter().collect());
        Some(crate::adopt::AdoptFrom { under, dir })
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
            .filter_map(|s| self.records.stores().get(s))
            .flat_map(|s| s.artifacts.iter().cloned())
            .collect();
        for a in ids {
            if let Some(stored) = self.artifact(&a) {
                for (e, blob) in stored.files() {
                    known.insert(e.digest, blob);
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
        result: Result<(Vec<Sha256Digest>, u32), SourceError>,
    ) {
        let current = self.works.get(&key).is_some_and(|w| w.fingerprint == fp);
        match result {
            Ok((blobs, size_only_files)) => {
                // A complete, verified artifact is real data whether or not the model still
                // wants it: record it so that the store (and any waiter) can use it.
                let stored = match StoredArtifact::new(manifest.clone(), blobs, now_secs()) {
                    Ok(s) => s.with_size_only_files(size_only_files),
                    Err(e) => {
                        tracing::error!(model = %key, error = %e, "fetch returned an inconsistent artifact");
                        return;
                    }
                };
                if let Err(e) = self.state.save_artifact(&stored) {
                    let err = SourceError::Store {
                        path: "artifact record".into(),
                        source: modelfs_core::store::StoreError::io("saving artifact", e),
                    };
                    if current {
                        self.fail(&key, &fp, &err);
                    }
                    return;
                }
                let id = stored.id.clone();
                self.artifacts.insert(id.clone(), Arc::new(stored));
                let mut want = None;
                let mut claims = Vec::new();
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
                    claims = self.related_claims(&spec.path);
                    want = Some(Self::want(&spec, &manifest));
                }
                let event = decide::Event::Fetched {
                    key,
                    store: store.clone(),
                    artifact: id,
                    want,
                    claims,
                };
                self.apply_event(&event, Some(&manifest));
                self.update_store_bytes(&store);
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
        if self.works.contains_key(key) {
            self.set_stage(key, Stage::Waiting { manifest });
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

    /// Executes a decision's effects, in order (see [`decide::Effect`]). Runs on the actor's own
    /// thread, never on the async runtime's workers. `manifest`: the artifact of the model the
    /// decision is about (a fetch or a wait keeps it).
    fn execute(&mut self, effects: Vec<Effect>, manifest: Option<&Arc<Manifest>>) {
        // A save owed by `SaveRecords` before the directories of the next effects exist.
        let mut save_owed = false;
        for effect in effects {
            match effect {
                Effect::SaveRecords => {
                    // Fetches wait for the next paced save; anything else that creates a
                    // directory saves now.
                    save_owed = true;
                    self.flush_pending = true;
                }
                Effect::LinkStore(split) => {
                    if std::mem::take(&mut save_owed) {
                        self.save();
                    }
                    let result = self.link_store(&split);
                    self.apply_event(&decide::Event::SplitLinked { split, result }, None);
                }
                Effect::Fetch { key, store, seed } => match manifest {
                    Some(m) => {
                        let after_save = save_owed.then(|| *self.saves.borrow() + 1);
                        self.fetch_awaits_save |= save_owed;
                        self.start_fetch(&key, store, seed, m.clone(), after_save)
                    }
                    None => tracing::error!(model = %key, "a fetch decided without a manifest"),
                },
                Effect::Wait { key, on, reason } => {
                    match reason {
                        decide::WaitReason::SameArtifact => {
                            tracing::info!(model = %key, waits_for = %on, "same artifact is being fetched; waiting for it")
                        }
                        decide::WaitReason::EarlierOnPath => {
                            tracing::info!(model = %key, waits_for = %on, "an earlier model on the same path is resolving; waiting for it")
                        }
                    }
                    // Waiting on a fetch served while it downloads: served from it too.
                    self.remap_needed |= self.is_live(&on);
                    match manifest {
                        Some(m) => self.wait(&key, on, m.clone()),
                        None => tracing::error!(model = %key, "a wait decided without a manifest"),
                    }
                }
                Effect::LosePath {
                    key,
                    reason,
                    artifact,
                } => {
                    let fp = self.fingerprint_of(&key);
                    self.fail_conflict(&key, &fp, reason, artifact);
                }
                Effect::Served {
                    key,
                    store,
                    changed,
                } => {
                    self.remove_work(&key);
                    self.work_changed(&key);
                    self.retries.remove(&key);
                    if changed {
                        let artifact = self.records.models()[&key].artifact.clone();
                        tracing::info!(model = %key, %store, artifact = ?artifact, "mapping changed");
                    }
                    self.index_paths(&key);
                }
                Effect::Remap => self.remap_needed = true,
                Effect::Fail {
                    key,
                    reason,
                    retry: decide::RetryKind::Space { needed },
                } => {
                    let fp = self.fingerprint_of(&key);
                    self.index_paths(&key);
                    self.refuse_for_space(&key, &fp, reason, needed);
                    self.work_changed(&key);
                }
                Effect::Fail { key, reason, retry } => {
                    let fp = self.fingerprint_of(&key);
                    if retry == decide::RetryKind::MountRefused {
                        self.count_refusal(&key, &fp);
                    }
                    self.index_paths(&key);
                    self.fail_with(&key, &fp, reason, true);
                    self.work_changed(&key);
                }
                Effect::Forgotten { store, artifact } => {
                    tracing::warn!(%store, %artifact, "artifact incomplete on disk; will fetch again");
                }
                Effect::Turn { key } => self.take_turn(&key),
            }
        }
    }

    /// The fingerprint of `key`'s work, else of its record.
    fn fingerprint_of(&self, key: &ModelKey) -> String {
        match self.works.get(key) {
            Some(w) => w.fingerprint.clone(),
            None => self
                .records
                .models()
                .get(key)
                .map(|r| r.fingerprint.clone())
                .unwrap_or_default(),
        }
    }

    /// Counts one more refusal of `key` by the mount server: serving the model in between
    /// ends its retry, so the count keeps the backoff growing while the server refuses it.
    fn count_refusal(&mut self, key: &ModelKey, fp: &str) {
        let refusals = match self.mount_refusals.get(key) {
            Some((f, n)) if f == fp => n + 1,
            _ => 1,
        };
        self.mount_refusals
            .insert(key.clone(), (fp.to_string(), refusals));
        if refusals > 1 {
            self.retries.insert(
                key.clone(),
                Retry {
                    fingerprint: fp.to_string(),
                    attempts: refusals - 1,
                    at: Instant::now(),
                },
            );
        }
    }

    /// Makes `split.to` hold hard links to the blobs of `split.artifacts` in `split.from` (the
    /// store does the linking).
    fn link_store(&mut self, split: &decide::Split) -> Result<(), String> {
        let mut blobs = Vec::new();
        for a in &split.artifacts {
            let stored = self.artifact(a).ok_or("artifact record missing")?;
            blobs.extend(stored.blobs());
        }
        self.state
            .link_blobs(&split.from, &split.to, &blobs)
            .map_err(|e| e.to_string())
    }

    /// A `vendor://` model (its files come with the serving runtime), or a `local://` one whose
    /// directory lies outside the models root (the pod binds it from the node): as OME's agent
    /// does, nothing is fetched or mounted and the model is `Ready` at once. A copy it owned
    /// before (its source changed) is handed to its children or released.
    fn serve_without_files(&mut self, key: &ModelKey, spec: &ModelSpec) {
        self.cancel_work(key);
        self.retries.remove(key);
        let event = decide::Event::NoFiles {
            key: key.clone(),
            source: spec.source.to_string(),
        };
        self.apply_event(&event, None);
        tracing::info!(model = %key, source = %spec.source, node_dir = ?spec.node_dir, "files on the node or in the runtime: Ready with nothing served");
        self.wake_waiters();
    }

    fn delete(&mut self, key: &ModelKey) {
        self.cancel_work(key);
        self.retries.remove(key);
        self.mount_refusals.remove(key);
        self.path_losers.remove(key);
        tracing::info!(model = %key, "model deleted");
        self.apply_event(&decide::Event::Deleted { key: key.clone() }, None);
        self.index_paths(key);
        self.work_changed(key);
        self.wake_waiters();
    }

    fn cancel_work(&mut self, key: &ModelKey) {
        if let Some(w) = self.remove_work(key) {
            w.cancel.cancel();
        }
        self.work_changed(key);
    }

    /// Removes `key`'s work (not cancelling it) and its entries of the in-flight index.
    fn remove_work(&mut self, key: &ModelKey) -> Option<Work> {
        let w = self.works.remove(key)?;
        self.in_flight_index.remove(key, &w);
        Some(w)
    }

    /// Moves `key`'s work to `stage`, keeping the in-flight index in step.
    fn set_stage(&mut self, key: &ModelKey, stage: Stage) {
        if let Some(w) = self.works.get_mut(key) {
            self.in_flight_index.remove(key, w);
            w.stage = stage;
            self.in_flight_index.add(key, w);
        }
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
        if self.fail_disk_full(key, fp, err) {
            return;
        }
        self.fail_with(key, fp, err.to_string(), err.is_transient());
    }

    /// `key` is `Failed` with `reason`; a transient failure is retried with backoff (the
    /// reason says when), a permanent one waits for a change of the spec.
    fn fail_with(&mut self, key: &ModelKey, fp: &str, mut reason: String, transient: bool) {
        self.cancel_work(key);
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
                fastrand::f64(),
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
        if let Some(mut rec) = self.records.model_mut(key) {
            rec.phase = ModelPhase::Failed;
            rec.reason = Some(reason);
        }
    }

    /// The mount server refused to serve these mapping entries (module docs of
    /// [`modelfs_mount`]): the core fails the models served at the refused paths (see
    /// [`decide::Event::MountRefused`]); this finds them and asks the disk which of their
    /// copies lack blobs. Returns whether anything changed.
    fn on_mount_refused(&mut self, entries: Vec<modelfs_mount::protocol::RefusedEntry>) -> bool {
        let mut refused = Vec::new();
        let mut incomplete = BTreeSet::new();
        let mut working = BTreeSet::new();
        for entry in entries {
            let Some(keys) = self.path_index.get(&entry.path).cloned() else {
                continue;
            };
            for key in keys {
                let Some(rec) = self.records.models().get(&key) else {
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
                if self.works.contains_key(&key) {
                    working.insert(key.clone());
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
            working,
        };
        self.apply_event(&event, None);
        self.wake_waiters();
        true
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
        if let Some(mut rec) = self.records.model_mut(key) {
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
        modelfs_mount::vfs::hf_cache::path_conflict(path.segments(), dir.segments())
    }

    /// Fails `key` because its path lies in or around the cache view's directory. Not a path
    /// loser: no other model's change clears it, so it waits for its own spec (or a restart
    /// with other flags), like any permanent failure.
    fn fail_in_cache_view(&mut self, key: &ModelKey, reason: String) {
        self.cancel_work(key);
        self.retries.remove(key);
        if let Some(mut rec) = self.records.model_mut(key) {
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
        decide::claims(&self.records, self.records.models().keys(), |k| {
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
        let seq = self.records.models().get(key).map_or(u64::MAX, |r| r.seq);
        decide::verdict_for(self.related_claims(path), key, seq, path, artifact)
    }

    /// The claims of the models whose paths nest with `path` (see [`Reconciler::related_keys`]).
    fn related_claims(&self, path: &MountPath) -> Vec<PathClaim> {
        let related = self.related_keys(path.segments());
        decide::claims(&self.records, &related, |k| self.wanted_claim(k))
    }

    /// Applies the path rule to the whole state after an event (and at start-up): a served
    /// model that now loses (an earlier model resolved to another artifact on its path, or
    /// records from before this rule hold two) is unmapped and `Failed`; a model whose work
    /// now loses stops; a loser the rule clears (the model it lost to went away, moved or
    /// changed) gets its turn.
    fn settle_paths(&mut self) {
        let event = decide::Event::SettlePaths {
            claims: self.claims(),
            working: self.works.keys().cloned().collect(),
            losers: self.path_losers.keys().cloned().collect(),
        };
        self.apply_event(&event, None);
    }

    /// A model that lost the path rule gets its turn: its spec is reconciled again now.
    fn take_turn(&mut self, key: &ModelKey) {
        let Some(loser) = self.path_losers.remove(key) else {
            return;
        };
        let spec = self
            .desired
            .as_ref()
            .and_then(|d| d.models.get(key))
            .and_then(|m| m.as_ref().ok())
            .cloned();
        let Some(spec) = spec else {
            return;
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
        if self.ensure(key, &spec) {
            self.remap_needed = true;
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
        for (key, rec) in self.records.models() {
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
                let source = self.records.models()[&key].served_source.as_deref();
                if let Some(Ok(SourceUri::HuggingFace { repo, revision })) =
                    source.map(SourceUri::parse)
                {
                    hf_served.push(HfServed {
                        model: key.to_string(),
                        repo,
                        revision,
                        artifact: stored.clone(),
                        store: handle.clone(),
                        pending: None,
                    });
                }
            }
            entries.push(MountEntry {
                path: path.segments().to_vec(),
                artifact: stored,
                store: handle,
            });
        }
        // A reserved store keeps its last owner's directory (read-only) until it is reused or
        // released, as OME keeps a reserved model's directory. A served model's path wins, and
        // a path nested in or around a served one is left out (the fs layer refuses nesting).
        let reserved: Vec<(StoreId, records::ReservedPlacement)> = self
            .records
            .stores()
            .iter()
            .filter(|(_, s)| s.owner.is_none() && s.reserved)
            .filter_map(|(id, s)| Some((id.clone(), s.reserved_at.clone()?)))
            .collect();
        for (id, placement) in reserved {
            let Ok(path) = MountPath::from_relative(&placement.path) else {
                continue;
            };
            let segments = path.segments();
            if entries
                .iter()
                .any(|e| e.path.starts_with(segments) || segments.starts_with(&e.path))
                || self.hf_cache_conflict(&path).is_some()
            {
                continue;
            }
            let Some(stored) = self.artifact(&placement.artifact) else {
                continue;
            };
            match self.state.store(&id) {
                Ok(h) => entries.push(MountEntry {
                    path: segments.to_vec(),
                    artifact: stored,
                    store: self.fs.store_handle(&id, h),
                }),
                Err(e) => tracing::error!(store = %id, error = %e, "reserved store unusable"),
            }
        }
        // Models served while they download, at paths the served ones leave free (and in
        // the cache view, below).
        let mut pending = self.pending_entries(&mut entries, &mut hf_served);
        // The cache view joins the same snapshot: its refs and snapshots flip with the paths.
        let mut files = Vec::new();
        if let Some(view) = &mut self.hf_cache {
            let (snapshots, refs) = view.update(&hf_served, Instant::now());
            entries.extend(snapshots);
            pending.extend(view.pending());
            files = refs;
        }
        // `vendor://` models below the models root: an empty read-only directory at their
        // path, so a pod binding it (or creating it, as runtimes do) finds it, as on OME's
        // writable disk. Outside the root (`node_dir`) their record's path is absolute and
        // skipped here.
        let mut dirs: Vec<Vec<String>> = Vec::new();
        for rec in self.records.models().values() {
            if rec.phase != ModelPhase::Ready || rec.served_path.is_some() {
                continue;
            }
            let vendor = rec
                .served_source
                .as_deref()
                .and_then(|s| SourceUri::parse(s).ok())
                .is_some_and(|s| s.is_vendor());
            if let (true, Ok(path)) = (vendor, MountPath::from_relative(&rec.path)) {
                if self.hf_cache_conflict(&path).is_none() {
                    dirs.push(path.segments().to_vec());
                }
            }
        }
        dirs.sort();
        dirs.dedup();
        match self
            .fs
            .apply_with_pending(&entries, &files, &dirs, &pending)
        {
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
        let pairs: Vec<(StoreId, ArtifactId)> = self
            .records
            .stores()
            .iter()
            .flat_map(|(id, s)| s.artifacts.iter().map(|a| (id.clone(), a.clone())))
            .collect();
        let incomplete = pairs
            .into_iter()
            .filter(|(s, a)| !self.complete_in(a, s))
            .collect();
        self.apply_event(&decide::Event::Recovered { incomplete }, None);
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

    // ----- persistence and status ----------------------------------------------------------

    fn refresh_store_bytes(&mut self) {
        let ids: Vec<StoreId> = self.records.stores().keys().cloned().collect();
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
    crate::metrics::OmeModelLabels {
        model_type: key.kind().as_str().to_owned(),
        namespace: key.namespace().unwrap_or_default().to_owned(),
        name: key.name().to_owned(),
    }
}

#[cfg(test)]
mod tests;
