//! Work in flight: each model's resolve or fetch, how it is cancelled, and how the executor
//! spawns it (tasks that report back with messages and never touch the records).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures_util::FutureExt;
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

use super::{Event, Reconciler};
use crate::source::{FetchContext, Progress, Source, SourceError};
use modelfs_core::artifact::{ArtifactId, Manifest};
use modelfs_core::store::StoreId;
use modelfs_ome::{ModelKey, ModelSpec};

use super::decide;

pub(super) enum Stage {
    Resolving,
    /// Artifact known; waiting for another model's fetch of it (single flight) or for an
    /// earlier model on the same path to resolve (path rule).
    Waiting {
        manifest: Arc<Manifest>,
    },
    /// Its artifact is being fetched; which artifact, into which store, is the core's
    /// [`decide::Phase::Fetching`].
    Fetching {
        progress: Arc<Progress>,
    },
}

pub(super) struct Work {
    pub(super) fingerprint: String,
    pub(super) spec: ModelSpec,
    pub(super) source: Source,
    pub(super) stage: Stage,
    pub(super) cancel: WorkCancel,
    /// A periodic re-resolve of a Ready model: the model stays Ready and served while it runs,
    /// and a failure only logs (the next interval tries again).
    pub(super) refresh: bool,
}

/// Every model's work in flight with what the executor needs to run it (the decision core
/// tracks the same work as phases: see [`decide::Phase`]; what a fetch fetches, and into
/// which store, is read from the core's phase, not kept here), and what work is spawned with.
pub(super) struct Works {
    map: BTreeMap<ModelKey, Work>,
    /// Node-wide fetch slots ([`super::ReconcilerConfig::max_concurrent_fetches`]).
    pub(super) fetch_slots: Arc<Semaphore>,
    /// Where workers report (weak: the actor alone must not keep its own queue open; see
    /// [`Reconciler::sender`]).
    pub(super) tx: mpsc::WeakUnboundedSender<Event>,
}

impl std::ops::Index<&ModelKey> for Works {
    type Output = Work;

    fn index(&self, key: &ModelKey) -> &Work {
        &self.map[key]
    }
}

impl Works {
    pub(super) fn new(fetch_slots: Arc<Semaphore>, tx: mpsc::WeakUnboundedSender<Event>) -> Self {
        Self {
            map: BTreeMap::new(),
            fetch_slots,
            tx,
        }
    }

    pub(super) fn get(&self, key: &ModelKey) -> Option<&Work> {
        self.map.get(key)
    }

    pub(super) fn contains_key(&self, key: &ModelKey) -> bool {
        self.map.contains_key(key)
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Work> {
        self.map.values()
    }

    /// Debug builds check the work against the core's phases.
    #[cfg(debug_assertions)]
    pub(super) fn iter(&self) -> impl Iterator<Item = (&ModelKey, &Work)> {
        self.map.iter()
    }

    /// Makes `work` `key`'s work (replacing any it had).
    pub(super) fn insert(&mut self, key: ModelKey, work: Work) {
        self.map.insert(key, work);
    }

    /// Removes `key`'s work (not cancelling it).
    pub(super) fn remove(&mut self, key: &ModelKey) -> Option<Work> {
        self.map.remove(key)
    }

    /// Moves `key`'s work to `stage`.
    pub(super) fn set_stage(&mut self, key: &ModelKey, stage: Stage) {
        if let Some(w) = self.map.get_mut(key) {
            w.stage = stage;
        }
    }
}

/// Cancellation of one piece of work: the token ends its task at once; the flag is what
/// blocking workers and the sources' loops poll.
#[derive(Clone, Default)]
pub(super) struct WorkCancel {
    token: CancellationToken,
    pub(super) flag: Arc<AtomicBool>,
}

impl WorkCancel {
    pub(super) fn cancel(&self) {
        self.flag.store(true, Ordering::Relaxed);
        self.token.cancel();
    }

    /// Runs `work` in a task that ends as soon as the work is cancelled (dropping the work's
    /// future and all it holds) and hands its result, or `Cancelled`, or a panic turned into a
    /// permanent error, to `report`.
    pub(super) fn spawn<T: Send + 'static>(
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

impl Reconciler {
    /// A sender for workers' reports. The handles and the ticker hold the strong senders; with
    /// all of them gone nothing can be reported to anyone, and a closed sender is as good.
    pub(super) fn sender(&self) -> mpsc::UnboundedSender<Event> {
        self.works
            .tx
            .upgrade()
            .unwrap_or_else(|| mpsc::unbounded_channel().0)
    }

    /// Makes resolving `spec` the model's work (replacing any work it had); returns the work's
    /// cancellation. `refresh`: a periodic re-resolve of a Ready model.
    pub(super) fn begin_resolving(
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
        self.works.insert(key.clone(), work);
        self.step(decide::Event::Resolving {
            key: key.clone(),
            source: spec.source.to_string(),
            refresh,
        });
        cancel
    }

    /// Resolves `source` under `cancel`; the result comes back as [`Event::Resolved`].
    pub(super) fn spawn_resolve(
        &self,
        key: &ModelKey,
        fp: String,
        source: Source,
        cancel: &WorkCancel,
    ) {
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

    /// Starts the fetch of `key`'s artifact (`manifest`) into `store`.
    pub(super) fn start_fetch(
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
        let progress = Arc::new(Progress::for_manifest(&manifest));
        let live = self.live_fetch(key, &store, &manifest);
        self.works.set_stage(
            key,
            Stage::Fetching {
                progress: progress.clone(),
            },
        );
        let existing =
            Arc::new(self.known_blobs(&[Some(store.clone()), seed.clone()], seed.as_ref()));
        let w = self.works.get(key).expect("work");
        let flag = w.cancel.flag.clone();
        let metrics = self.metrics.clone();
        let state = self.state.clone();
        let mut saves = self.saving.saves.subscribe();
        let store_id = store.clone();
        let store_name = store.to_string();
        let source = w.source.clone();
        let cancel = w.cancel.clone();
        let tx = self.sender();
        let slots = self.works.fetch_slots.clone();
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
    pub(super) fn adopt_from(&self, spec: &ModelSpec) -> Option<crate::adopt::AdoptFrom> {
        let under = self.config.sources.under_mount.clone()?;
        let local = match &spec.source {
            modelfs_ome::SourceUri::Local { path } => under.relative_of(path),
            _ => None,
        };
        let dir = local.unwrap_or_else(|| spec.path.segments().iter().collect());
        Some(crate::adopt::AdoptFrom { under, dir })
    }

    /// Source digest -> blob of the complete artifacts of `stores`.
    pub(super) fn known_blobs(
        &mut self,
        stores: &[Option<StoreId>],
        seed: Option<&StoreId>,
    ) -> crate::source::KnownBlobs {
        let mut known = HashMap::new();
        let ids: Vec<ArtifactId> = stores
            .iter()
            .flatten()
            .filter_map(|s| self.core.records.stores().get(s))
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

    /// Stops `key`'s work (its task ends at once) and wakes the models waiting for it.
    pub(super) fn cancel_work(&mut self, key: &ModelKey) {
        if let Some(w) = self.works.remove(key) {
            w.cancel.cancel();
        }
        self.work_changed(key);
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
