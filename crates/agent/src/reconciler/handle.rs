//! The handle the rest of the daemon holds (desired state in, status and liveness out) and the
//! messages the actor receives.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use tokio::sync::mpsc;

use super::DesiredState;
use crate::source::SourceError;
use modelfs_core::artifact::{ArtifactId, Manifest, Sha256Digest};
use modelfs_core::store::StoreId;
use modelfs_ome::status::StatusDoc;
use modelfs_ome::ModelKey;

pub(super) enum Event {
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
    /// The config of a model read in place was parsed ([`super::model_config`]).
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

/// Tells the actor that the runtime it spawns work on is shutting down (see `Reconciler::run`).
pub(super) struct RuntimeGone {
    pub(super) flag: Arc<AtomicBool>,
    pub(super) wake: mpsc::UnboundedSender<Event>,
}

impl Drop for RuntimeGone {
    fn drop(&mut self) {
        self.flag.store(true, Ordering::Release);
        let _ = self.wake.send(Event::Tick);
    }
}

/// Handle to the running reconciler.
#[derive(Clone)]
pub struct ReconcilerHandle {
    pub(super) tx: mpsc::UnboundedSender<Event>,
    /// Why the actor died (a panic), once it has.
    pub(super) died: tokio::sync::watch::Receiver<Option<String>>,
    pub(super) status: Arc<ArcSwap<StatusDoc>>,
    pub(super) ready: Arc<AtomicBool>,
    pub(super) alive: Arc<std::sync::atomic::AtomicU64>,
    pub(super) status_changes: Arc<tokio::sync::watch::Sender<Arc<StatusDoc>>>,
    pub(super) disk: Arc<ArcSwap<crate::disk::DiskState>>,
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

pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
