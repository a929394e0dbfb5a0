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
//!
//! # Restarts
//! Opens wait in the mount server, which keeps serving the last mapping while the agent is
//! away: a SIGKILL of the agent mid-fetch must not end them. But a restarted agent knows the
//! model's artifact only once its source resolved again, and a first mapping without the
//! pending entry would tell the mount server the model is gone (its waiting opens fail with
//! `ENOENT`). So each live fetch leaves a journal, `live/<store>.json` in the state
//! directory: the model, its path, the store and the manifest. It is written when the fetch
//! starts (not synced: a lost or torn journal only costs this continuity, never data) and
//! removed when the fetch ends. At start-up, before the first mapping, each journal whose
//! model still has that path and does not serve that artifact yet becomes a *resumed* entry:
//! the same listing (same artifact id: same slot and inodes in the mount) with the files the
//! store verified before the crash (blobs and aliases present: what the resumed fetch will
//! not download again), and for an `hf://` model its snapshot in the Hugging Face cache view
//! too (the source its record wants), so a reader of the view waits through the restart as
//! one at the model's path does. It stays while the model may still fetch that artifact (before the
//! first desired state; while it resolves; while it waits for that artifact), hands its
//! states and wanted files over to the model's new live fetch of the same artifact
//! ([`LiveFetch::take_over`]), and leaves the mapping otherwise (the model is gone, its path
//! moved, it resolved to another artifact): then its waiting opens fail at once, as for any
//! model that left. Nothing is served from a journal that the store does not hold verified.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use serde::{Deserialize, Serialize};

use super::decide::Phase;
use super::{Event, Reconciler, Stage};
use crate::progressive::LiveFetch;
use modelfs_core::artifact::Manifest;
use modelfs_core::store::{fsutil, StoreId};
use modelfs_mount::vfs::hf_cache::HfServed;
use modelfs_mount::vfs::{MountEntry, PendingFiles, WantedHook};
use modelfs_ome::{ModelKey, MountPath, SourceUri};

/// A live fetch's journal as written (module docs, "Restarts").
#[derive(Serialize)]
struct JournalOut<'a> {
    model: &'a ModelKey,
    path: &'a [String],
    store: &'a StoreId,
    manifest: &'a Manifest,
}

/// A live fetch's journal as read back.
#[derive(Deserialize)]
struct JournalIn {
    model: ModelKey,
    path: Vec<String>,
    store: StoreId,
    manifest: Manifest,
}

/// A running live fetch and the store it writes.
struct Running {
    live: Arc<LiveFetch>,
    store: StoreId,
}

/// A fetch a restart ended, shown as it was until the model's new fetch takes it over.
struct Resumed {
    live: Arc<LiveFetch>,
    store: StoreId,
    path: Vec<String>,
}

/// Equal paths, or one inside the other (segment-wise).
fn nests(a: &[String], b: &[String]) -> bool {
    let n = a.len().min(b.len());
    a[..n] == b[..n]
}

/// The live fetches, by model, and the pending entries of the last mapping, by path.
#[derive(Default)]
pub(super) struct Live {
    fetches: HashMap<ModelKey, Running>,
    resumed: HashMap<ModelKey, Resumed>,
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
            let listing = live.as_ref().map(|l| l.listing());
            if let (Some(live), Some(listing)) = (live, listing) {
                if listing.id == *artifact && file < listing.manifest.len() {
                    // Logged once per file, not per waiting open.
                    if live.want(file) {
                        let name = listing.manifest.entry(file).path;
                        tracing::info!(model = %path.join("/"), file = %name, "an open waits on a file: it is fetched next");
                    }
                }
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
        store: &StoreId,
        manifest: &Arc<Manifest>,
    ) -> Option<Arc<LiveFetch>> {
        if !self
            .works
            .get(key)
            .is_some_and(|w| self.serves_while_downloading(&w.spec))
        {
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
        if let Some(earlier) = self.live.resumed.remove(key) {
            if earlier.live.listing().id == manifest.id() {
                // Verified states name blobs of the earlier store: kept only in the same one.
                live.take_over(&earlier.live, earlier.store == *store);
            }
            if earlier.store != *store {
                self.remove_journal(&earlier.store);
            }
        }
        if let Some(work) = self.works.get(key) {
            self.write_journal(key, work.spec.path.segments(), store, manifest);
        }
        self.live.fetches.insert(
            key.clone(),
            Running {
                live: live.clone(),
                store: store.clone(),
            },
        );
        Some(live)
    }

    /// Whether `key` runs a fetch served while it downloads (a model that starts waiting on
    /// it is shown by the next mapping).
    pub(super) fn is_live(&self, key: &ModelKey) -> bool {
        self.live.fetches.contains_key(key)
    }

    /// Whether `spec` is served while it downloads: by default in standalone mode, by its
    /// annotation ([`modelfs_ome::model::SERVE_WHILE_DOWNLOADING_ANNOTATION`]) anywhere.
    pub(super) fn serves_while_downloading(&self, spec: &modelfs_ome::ModelSpec) -> bool {
        self.config.serve_while_downloading || spec.serve_while_downloading
    }

    /// How many files of the model at `path` verified, of how many, if the mapping serves it
    /// while it downloads (its pending entry, as the last mapping has it).
    pub(super) fn verified_counts(&self, path: &MountPath) -> Option<(usize, usize)> {
        let by_path = self
            .live
            .by_path
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        by_path.get(path.segments()).map(|l| l.counts())
    }

    fn journal_dir(&self) -> PathBuf {
        self.state.root().join("live")
    }

    fn journal_path(&self, store: &StoreId) -> PathBuf {
        self.journal_dir().join(format!("{store}.json"))
    }

    /// Writes the journal of a live fetch (module docs, "Restarts"): not synced, since a
    /// journal lost in a power cut only costs its waiting opens.
    fn write_journal(&self, key: &ModelKey, path: &[String], store: &StoreId, m: &Manifest) {
        let journal = JournalOut {
            model: key,
            path,
            store,
            manifest: m,
        };
        let target = self.journal_path(store);
        let tmp = self.journal_dir().join(format!(".{store}.json.tmp"));
        let written = serde_json::to_vec(&journal)
            .map_err(std::io::Error::other)
            .and_then(|bytes| {
                // Modes as every state file's, whatever the umask (only the agent reads it).
                fsutil::create_dirs(&self.journal_dir())?;
                fsutil::write_new(&tmp, &bytes, 0o600)?;
                std::fs::rename(&tmp, &target)
            });
        if let Err(e) = written {
            tracing::warn!(model = %key, %store, error = %e, "writing the journal of a fetch served while it downloads: a restart ends its waiting opens");
        }
    }

    fn remove_journal(&self, store: &StoreId) {
        match std::fs::remove_file(self.journal_path(store)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                tracing::warn!(%store, error = %e, "removing the journal of a fetch");
            }
            _ => {}
        }
    }

    /// At start-up, before the first mapping: the fetches a restart ended become resumed
    /// entries (module docs, "Restarts"). Journals that no longer fit the records go.
    pub(super) fn resume_live_fetches(&mut self) {
        let Ok(dir) = std::fs::read_dir(self.journal_dir()) else {
            return;
        };
        for entry in dir.flatten() {
            let file = entry.path();
            let Some(name) = file.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if name.starts_with('.') || !name.ends_with(".json") {
                let _ = std::fs::remove_file(&file);
                continue;
            }
            let journal = match std::fs::read(&file)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<JournalIn>(&b).map_err(|e| e.to_string()))
            {
                Ok(j) => j,
                Err(e) => {
                    tracing::warn!(file = %file.display(), error = %e, "unreadable journal of a fetch served while it downloaded; dropped");
                    let _ = std::fs::remove_file(&file);
                    continue;
                }
            };
            if name != format!("{}.json", journal.store) {
                let _ = std::fs::remove_file(&file);
                continue;
            }
            match self.resumed_from(journal) {
                Some((key, resumed)) => {
                    tracing::info!(model = %key, store = %resumed.store, verified = resumed.live.counts().0, files = resumed.live.counts().1, "serving the listing of a fetch a restart ended until it resumes");
                    self.live.resumed.insert(key, resumed);
                }
                None => {
                    let _ = std::fs::remove_file(&file);
                }
            }
        }
    }

    /// The resumed entry of `journal`, if its model still wants that path and does not serve
    /// that artifact already, and its store exists.
    fn resumed_from(&self, journal: JournalIn) -> Option<(ModelKey, Resumed)> {
        let record = self.core.records.models().get(&journal.model)?;
        let id = journal.manifest.id();
        if record.artifact.as_ref() == Some(&id)
            || record.path != journal.path.join("/")
            || MountPath::from_relative(&record.path).is_err()
            || !self.core.records.stores().contains_key(&journal.store)
        {
            return None;
        }
        let store = self.state.existing_store(&journal.store)?;
        let manifest = Arc::new(journal.manifest);
        let stored = crate::progressive::stored_files(&manifest, &store);
        let live = LiveFetch::new(manifest, Box::new(|| {}));
        live.verified_many(&stored);
        Some((
            journal.model,
            Resumed {
                live,
                store: journal.store,
                path: journal.path,
            },
        ))
    }

    /// Whether a resumed entry no longer stands for a fetch its model may still make (module
    /// docs, "Restarts").
    fn resumed_stale(&self, key: &ModelKey, resumed: &Resumed) -> bool {
        if self.live.fetches.contains_key(key) {
            return true;
        }
        let Some(record) = self.core.records.models().get(key) else {
            return true;
        };
        let id = resumed.live.listing().id.clone();
        if record.artifact.as_ref() == Some(&id) {
            return true;
        }
        if self.desired.is_none() {
            return false;
        }
        match self.works.get(key) {
            Some(w) if !w.refresh && w.spec.path.segments() == resumed.path.as_slice() => {
                match &w.stage {
                    Stage::Resolving => false,
                    Stage::Waiting { manifest } => manifest.id() != id,
                    // A fetch with no live state (its own entry, if any, replaces this one).
                    Stage::Fetching { .. } => true,
                }
            }
            _ => true,
        }
    }

    /// Whether a live fetch is no longer running (the next mapping drops its entries).
    pub(super) fn live_ended(&self) -> bool {
        self.live
            .fetches
            .iter()
            .any(|(key, r)| !self.still_fetching(key, &r.live))
            || self
                .live
                .resumed
                .iter()
                .any(|(key, r)| self.resumed_stale(key, r))
    }

    fn still_fetching(&self, key: &ModelKey, live: &LiveFetch) -> bool {
        matches!(
            self.core.phase(key),
            Some(Phase::Fetching { artifact, .. }) if *artifact == live.listing().id
        )
    }

    /// Pending entries for the live fetches still running, at paths `entries` leaves free;
    /// appended to `entries`, their states returned by path. With a Hugging Face cache view,
    /// each `hf://` one is added to `hf_served` too (the view shows its snapshot pending).
    pub(super) fn pending_entries(
        &mut self,
        entries: &mut Vec<MountEntry>,
        hf_served: &mut Vec<HfServed>,
    ) -> HashMap<Vec<String>, Arc<PendingFiles>> {
        self.drop_ended_live();
        let mut out = PendingOut {
            entries,
            hf_served,
            pending: HashMap::new(),
            by_path: HashMap::new(),
        };
        let fetches: Vec<(ModelKey, Arc<LiveFetch>)> = self
            .live
            .fetches
            .iter()
            .map(|(k, r)| (k.clone(), r.live.clone()))
            .collect();
        for (fetcher, live) in fetches {
            self.pending_of_fetch(&fetcher, &live, &mut out);
        }
        self.pending_of_resumed(&mut out);
        *self
            .live
            .by_path
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = out.by_path;
        out.pending
    }

    /// Forgets the live fetches that ended (completed, failed, cancelled) and the resumed
    /// entries gone stale, with their journals (a journal a running fetch still uses stays).
    fn drop_ended_live(&mut self) {
        let ended: Vec<ModelKey> = self
            .live
            .fetches
            .iter()
            .filter(|(key, r)| !self.still_fetching(key, &r.live))
            .map(|(key, _)| key.clone())
            .collect();
        for key in ended {
            if let Some(r) = self.live.fetches.remove(&key) {
                self.remove_journal(&r.store);
            }
        }
        let stale: Vec<ModelKey> = self
            .live
            .resumed
            .iter()
            .filter(|(key, r)| self.resumed_stale(key, r))
            .map(|(key, _)| key.clone())
            .collect();
        for key in stale {
            if let Some(r) = self.live.resumed.remove(&key) {
                if !self.live.fetches.values().any(|f| f.store == r.store) {
                    self.remove_journal(&r.store);
                }
            }
        }
    }

    /// The pending entries of `fetcher`'s live fetch: at its own path, and at the paths of
    /// the models waiting on it for the same artifact that are served while they download.
    fn pending_of_fetch(&self, fetcher: &ModelKey, live: &Arc<LiveFetch>, out: &mut PendingOut) {
        let Some(Phase::Fetching { store, .. }) = self.core.phase(fetcher) else {
            return;
        };
        // Not created here: a store directory exists only once a saved record names it
        // (the fetch creates it; its first report comes after that).
        let Some(handle) = self.state.existing_store(store) else {
            return;
        };
        let handle = self.fs.store_handle(store, handle);
        // The fetching model, then the models waiting on its fetch of the same artifact.
        let mut keys = vec![fetcher.clone()];
        keys.extend(self.core.waiters_of(fetcher).cloned());
        let states = Arc::new(live.pending());
        live.shown();
        for key in keys {
            let Some(work) = self.works.get(&key) else {
                continue;
            };
            let same_artifact = match (&work.stage, self.core.phase(&key)) {
                (Stage::Fetching { .. }, Some(Phase::Fetching { artifact, .. })) => {
                    *artifact == live.listing().id
                }
                (Stage::Waiting { manifest }, _) => manifest.id() == live.listing().id,
                _ => false,
            };
            // A model waiting on the fetch is shown only if it is served while it
            // downloads itself (Kubernetes: only models that opted in).
            if !same_artifact || work.refresh || !self.serves_while_downloading(&work.spec) {
                continue;
            }
            let path: &MountPath = &work.spec.path;
            let free = !out.entries.iter().any(|e| nests(&e.path, path.segments()))
                && self.hf_cache_conflict(path).is_none();
            if !free {
                continue;
            }
            let segments = path.segments().to_vec();
            out.entries.push(MountEntry {
                path: segments.clone(),
                artifact: live.listing(),
                store: handle.clone(),
            });
            out.pending.insert(segments.clone(), states.clone());
            out.by_path.insert(segments, live.clone());
            if let (Some(view), SourceUri::HuggingFace { repo, revision }) =
                (&self.hf_cache, &work.spec.source)
            {
                let listing = live.listing();
                let commit = listing.manifest.revision.clone();
                out.by_path
                    .insert(view.snapshot_path(repo, &commit), live.clone());
                out.hf_served.push(HfServed {
                    model: key.to_string(),
                    repo: repo.clone(),
                    revision: revision.clone(),
                    artifact: listing,
                    store: handle.clone(),
                    pending: Some(states.clone()),
                });
            }
        }
    }

    /// The pending entries of the fetches a restart ended (module docs, "Restarts").
    fn pending_of_resumed(&self, out: &mut PendingOut) {
        for (key, resumed) in &self.live.resumed {
            let Some(handle) = self.state.existing_store(&resumed.store) else {
                continue;
            };
            let free = !out.entries.iter().any(|e| nests(&e.path, &resumed.path))
                && MountPath::from_relative(&resumed.path.join("/"))
                    .is_ok_and(|p| self.hf_cache_conflict(&p).is_none());
            if !free {
                continue;
            }
            let handle = self.fs.store_handle(&resumed.store, handle);
            out.entries.push(MountEntry {
                path: resumed.path.clone(),
                artifact: resumed.live.listing(),
                store: handle.clone(),
            });
            let states = Arc::new(resumed.live.pending());
            out.pending.insert(resumed.path.clone(), states.clone());
            out.by_path
                .insert(resumed.path.clone(), resumed.live.clone());
            // The cache view shows the resumed snapshot as well, from the first mapping on:
            // a reader of the view waits through the restart as one at the model's path does.
            // The source is the one the model's record wants (the journal's manifest was
            // resolved from it; a model whose source changed resolves again, and its resumed
            // entry goes once that resolves to another artifact).
            let source = self
                .core
                .records
                .models()
                .get(key)
                .and_then(|r| SourceUri::parse(&r.source).ok());
            if let (Some(view), Some(SourceUri::HuggingFace { repo, revision })) =
                (&self.hf_cache, source)
            {
                let listing = resumed.live.listing();
                out.by_path.insert(
                    view.snapshot_path(&repo, &listing.manifest.revision),
                    resumed.live.clone(),
                );
                out.hf_served.push(HfServed {
                    model: key.to_string(),
                    repo,
                    revision,
                    artifact: listing,
                    store: handle,
                    pending: Some(states),
                });
            }
        }
    }
}

/// What [`Reconciler::pending_entries`] gathers: the mapping's entries and the cache view's
/// snapshots it appends to, the pending states by path, and the live fetches by path.
struct PendingOut<'a> {
    entries: &'a mut Vec<MountEntry>,
    hf_served: &'a mut Vec<HfServed>,
    pending: HashMap<Vec<String>, Arc<PendingFiles>>,
    by_path: HashMap<Vec<String>, Arc<LiveFetch>>,
}
