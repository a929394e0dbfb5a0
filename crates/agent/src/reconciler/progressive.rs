//! Serving while downloading in the reconciler: which fetches are live and the pending
//! mapping entries they make (see [`crate::progressive`] and SPEC section 13).
//!
//! A fetch started while [`ReconcilerConfig::serve_while_downloading`] is on carries a
//! [`LiveFetch`]. Each time its state changes it sends [`Event::LiveChanged`], and the next
//! mapping shows the model's path with the complete listing and the files verified so far
//! (and so does the path of every model waiting on that fetch by single flight). A pending
//! entry is only added where nothing is served yet: a path that serves another artifact
//! keeps it until the new one is complete (flips stay atomic, SPEC section 3.2), and a path
//! that nests with a served one is left out (the path rule normally prevents it). When the
//! fetch completes, the same batch that records the artifact replaces the pending entry with
//! the complete one (same artifact id: same inodes); when it fails or is cancelled, the entry
//! leaves the mapping and the opens waiting there fail at once.
//!
//! An open waiting on a file (here, or in the mount server, which sends `wanted`) calls the
//! core's wanted hook; [`Live::hook`] finds the live fetch at that path and moves the file to
//! the front of its queue.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use super::{Event, Reconciler, Stage};
use crate::progressive::LiveFetch;
use modelfs_core::artifact::Manifest;
use modelfs_mount::vfs::{MountEntry, PendingFiles, WantedHook};
use modelfs_ome::{ModelKey, MountPath};

/// Equal paths, or one inside the other (segment-wise).
fn nests(a: &[String], b: &[String]) -> bool {
    let n = a.len().min(b.len());
    a[..n] == b[..n]
}

/// The live fetches, by model, and the pending entries of the last mapping, by path.
#[derive(Default)]
pub(super) struct Live {
    fetches: HashMap<ModelKey, Arc<LiveFetch>>,
    by_path: Arc<Mutex<HashMap<Vec<String>, Arc<LiveFetch>>>>,
}

impl Live {
    /// The core's wanted hook: an open waits on file `file` of `artifact` at `path`.
    pub(super) fn hook(&self) -> WantedHook {
        let by_path = self.by_path.clone();
        Box::new(move |path, artifact, file| {
            let live = by_path
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(path)
                .cloned();
            if let Some(live) = live.filter(|l| l.listing().id == *artifact) {
                live.want(file);
            }
        })
    }
}

impl Reconciler {
    /// The live fetch for a fetch of `manifest` by `key` starting now, if models are served
    /// while they download.
    pub(super) fn live_fetch(
        &mut self,
        key: &ModelKey,
        manifest: &Arc<Manifest>,
    ) -> Option<Arc<LiveFetch>> {
        if !self.config.serve_while_downloading {
            return None;
        }
        // Weak: the fetch's state must not keep the actor's queue open (see `sender`).
        let tx = self.sender().downgrade();
        let changed_key = key.clone();
        let live = LiveFetch::new(
            manifest.clone(),
            Box::new(move || {
                if let Some(tx) = tx.upgrade() {
                    let _ = tx.send(Event::LiveChanged(changed_key.clone()));
                }
            }),
        );
        self.live.fetches.insert(key.clone(), live.clone());
        Some(live)
    }

    /// Whether a live fetch is no longer running (the next mapping drops its entries).
    pub(super) fn live_ended(&self) -> bool {
        self.live
            .fetches
            .iter()
            .any(|(key, live)| !self.still_fetching(key, live))
    }

    fn still_fetching(&self, key: &ModelKey, live: &LiveFetch) -> bool {
        matches!(
            self.works.get(key).map(|w| &w.stage),
            Some(Stage::Fetching { artifact, .. }) if *artifact == live.listing().id
        )
    }

    /// Pending entries for the live fetches still running, at paths `entries` leaves free;
    /// appended to `entries`, their states returned by path.
    pub(super) fn pending_entries(
        &mut self,
        entries: &mut Vec<MountEntry>,
    ) -> HashMap<Vec<String>, Arc<PendingFiles>> {
        // Fetches that ended (completed, failed, cancelled) are no longer live.
        let ended: Vec<ModelKey> = self
            .live
            .fetches
            .iter()
            .filter(|(key, live)| !self.still_fetching(key, live))
            .map(|(key, _)| key.clone())
            .collect();
        for key in ended {
            self.live.fetches.remove(&key);
        }
        let mut pending = HashMap::new();
        let mut by_path = HashMap::new();
        let fetches: Vec<(ModelKey, Arc<LiveFetch>)> = self
            .live
            .fetches
            .iter()
            .map(|(k, l)| (k.clone(), l.clone()))
            .collect();
        for (fetcher, live) in fetches {
            let Some(Stage::Fetching { store, .. }) = self.works.get(&fetcher).map(|w| &w.stage)
            else {
                continue;
            };
            let store = store.clone();
            // Not created here: a store directory exists only once a saved record names it
            // (the fetch creates it; its first report comes after that).
            let Some(handle) = self.state.existing_store(&store) else {
                continue;
            };
            let handle = self.fs.store_handle(&store, handle);
            // The fetching model, then the models waiting on its fetch of the same artifact.
            let mut keys = vec![fetcher.clone()];
            keys.extend(self.waiting_on.get(&fetcher).into_iter().flatten().cloned());
            let states = Arc::new(live.pending());
            for key in keys {
                let Some(work) = self.works.get(&key) else {
                    continue;
                };
                let same_artifact = match &work.stage {
                    Stage::Fetching { artifact, .. } => *artifact == live.listing().id,
                    Stage::Waiting { manifest } => manifest.id() == live.listing().id,
                    Stage::Resolving => false,
                };
                if !same_artifact || work.refresh {
                    continue;
                }
                let path: &MountPath = &work.spec.path;
                let free = !entries.iter().any(|e| nests(&e.path, path.segments()))
                    && self.hf_cache_conflict(path).is_none();
                if !free {
                    continue;
                }
                let segments = path.segments().to_vec();
                entries.push(MountEntry {
                    path: segments.clone(),
                    artifact: live.listing(),
                    store: handle.clone(),
                });
                pending.insert(segments.clone(), states.clone());
                by_path.insert(segments, live.clone());
            }
        }
        *self
            .live
            .by_path
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = by_path;
        pending
    }
}
