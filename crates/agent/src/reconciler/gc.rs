//! Garbage collection: mark and sweep over stores, blobs, partial files and artifact records.
//!
//! *Mark*: a store is live while it has an owner, is reserved, serves a model, receives a fetch,
//! or the filesystem core reports a use (mapping, a retired slot the kernel has not been told
//! about yet, open file: see `FsCore::store_in_use`). Inodes the kernel still caches do not
//! count: once told, the core answers them `ESTALE`. Inside a live store, a blob is live while an artifact the store
//! holds lists it, or the core may still read it (`FsCore::blob_uses`: an old revision that
//! an open file or a process's working directory still references).
//!
//! *Sweep*: what is garbage is removed only after it has been garbage for the whole grace period,
//! observed continuously by the daemon (a quick delete-and-recreate of a model costs nothing).
//! Leftovers of crashes are swept too: store directories no record names, partial downloads
//! nobody resumes (older than `partial_max_age` in a store no fetch writes into), and artifact
//! records no store holds.
//!
//! Which stores are garbage is decided by [`super::decide::garbage_stores`]; [`plan`] adds what
//! the disk holds and computes the garbage without touching anything; the daemon and `modelfs gc` execute
//! it.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use super::records::Records;
use super::{decide, Reconciler};
use modelfs_core::artifact::{ArtifactId, Sha256Digest, StoredArtifact};
use modelfs_core::store::{StateDir, StoreId};
use modelfs_mount::vfs::BlobUses;

/// How the garbage collector learns about uses that the records do not show.
pub trait Usage {
    /// The filesystem core or a fetch uses the store.
    fn store_busy(&self, store: &StoreId) -> bool;
    /// A fetch is writing into the store (its fresh blobs and partials are not garbage).
    fn fetching_into(&self, store: &StoreId) -> bool;
    /// Blobs of the store the mount may still read.
    fn blobs_in_use(&self, store: &StoreId) -> HashSet<Sha256Digest>;
    /// A complete artifact record (from a cache where there is one).
    fn artifact(&self, id: &ArtifactId) -> Option<Arc<StoredArtifact>>;
}

/// What is garbage now.
#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct GcPlan {
    /// Whole stores: no owner, not reserved, unused.
    pub stores: Vec<StoreId>,
    /// Store directories without a record (a crash between record and directory clean-up).
    pub orphan_store_dirs: Vec<String>,
    /// Blobs of live stores that nothing references (an old revision, a cancelled fetch).
    pub blobs: Vec<(StoreId, String)>,
    /// Partial downloads nobody will resume.
    pub partials: Vec<PathBuf>,
    /// Artifact records no store holds.
    pub artifacts: Vec<ArtifactId>,
    /// Bytes the plan frees on disk.
    pub bytes: u64,
}

fn file_bytes(p: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p)
        .map(|m| m.blocks() * 512)
        .unwrap_or(0)
}

/// Computes the garbage. Reads directories and artifact records; changes nothing.
pub fn plan(
    records: &Records,
    state: &StateDir,
    usage: &dyn Usage,
    partial_max_age: Duration,
) -> GcPlan {
    let mut out = GcPlan::default();
    let garbage: BTreeSet<StoreId> =
        super::decide::garbage_stores(records, |id| usage.store_busy(id))
            .into_iter()
            .collect();
    for (id, s) in records.stores() {
        if garbage.contains(id) {
            out.stores.push(id.clone());
            out.bytes += state
                .existing_store(id)
                .map(|st| st.disk_usage())
                .unwrap_or(0);
            continue;
        }
        let Some(store) = state.existing_store(id) else {
            continue;
        };
        if usage.fetching_into(id) {
            continue;
        }
        let mut live: HashSet<Sha256Digest> = usage.blobs_in_use(id);
        for a in &s.artifacts {
            match usage.artifact(a) {
                Some(art) => live.extend(art.blobs()),
                // Unreadable artifact record: sweep nothing of this store rather than guess.
                None => live.extend(
                    store
                        .blob_names()
                        .unwrap_or_default()
                        .iter()
                        .filter_map(|n| n.parse::<Sha256Digest>().ok()),
                ),
            }
        }
        for name in store.blob_names().unwrap_or_default() {
            let keep = name
                .parse::<Sha256Digest>()
                .is_ok_and(|d| live.contains(&d));
            if !keep {
                out.bytes += file_bytes(&store.blob_path_by_name(&name));
                out.blobs.push((id.clone(), name));
            }
        }
        for p in store.partial_files().unwrap_or_default() {
            let old = std::fs::metadata(&p)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| SystemTime::now().duration_since(t).ok())
                .is_some_and(|age| age >= partial_max_age);
            if old {
                out.bytes += file_bytes(&p);
                out.partials.push(p);
            }
        }
    }
    if let Ok(dirs) = state.store_dirs() {
        for dir in dirs {
            if StoreId::parse_dir_name(&dir).is_some_and(|id| !records.stores().contains_key(&id)) {
                out.bytes +=
                    modelfs_core::store::fsutil::disk_usage(&state.stores_dir().join(&dir));
                out.orphan_store_dirs.push(dir);
            }
        }
    }
    let held: BTreeSet<&ArtifactId> = records
        .stores()
        .iter()
        .filter(|(id, _)| !out.stores.contains(id))
        .flat_map(|(_, s)| s.artifacts.iter())
        .chain(
            records
                .models()
                .values()
                .filter_map(|m| m.artifact.as_ref()),
        )
        .collect();
    for a in state.artifact_ids().unwrap_or_default() {
        if !held.contains(&a) {
            out.artifacts.push(a);
        }
    }
    out
}

/// Removes what `plan` found. Records are updated by the caller (stores removed here must be
/// dropped from the records and saved before the next plan).
pub fn execute(state: &StateDir, plan: &GcPlan) -> Vec<String> {
    let mut errors = Vec::new();
    for id in &plan.stores {
        if let Err(e) = state.remove_store(id) {
            errors.push(format!("store {id}: {e}"));
        }
    }
    for dir in &plan.orphan_store_dirs {
        if let Err(e) = state.remove_store_dir(dir) {
            errors.push(format!("orphan store {dir}: {e}"));
        }
    }
    for (id, name) in &plan.blobs {
        if let Err(e) = state.remove_blob(id, name) {
            errors.push(format!("blob {id}/{name}: {e}"));
        }
    }
    for p in &plan.partials {
        if let Err(e) = state.remove_partial(p) {
            errors.push(format!("partial {}: {e}", p.display()));
        }
    }
    for a in &plan.artifacts {
        if let Err(e) = state.remove_artifact(a) {
            errors.push(format!("artifact {a}: {e}"));
        }
    }
    errors
}

struct DaemonUsage<'a> {
    reconciler: &'a Reconciler,
    /// Computed once per pass (one walk over the slots); each store's set is built when
    /// that store is looked at.
    blob_uses: BlobUses,
    /// Stores fetches write into, computed once per pass (not once per store).
    fetching: HashSet<StoreId>,
}

impl Usage for DaemonUsage<'_> {
    fn store_busy(&self, id: &StoreId) -> bool {
        self.reconciler.fs.store_in_use(id) || self.fetching_into(id)
    }

    fn fetching_into(&self, id: &StoreId) -> bool {
        self.fetching.contains(id)
    }

    fn blobs_in_use(&self, id: &StoreId) -> HashSet<Sha256Digest> {
        self.blob_uses.of(id)
    }

    fn artifact(&self, id: &ArtifactId) -> Option<Arc<StoredArtifact>> {
        match self.reconciler.known.artifacts.get(id) {
            Some(a) => Some(a.clone()),
            None => self.reconciler.state.load_artifact(id).ok().map(Arc::new),
        }
    }
}

/// Garbage seen in consecutive passes, with the time it was first seen.
#[derive(Default)]
pub(super) struct Candidates {
    first_seen: BTreeMap<String, Instant>,
}

impl Candidates {
    /// No garbage is waiting for its grace period to end.
    pub(super) fn is_empty(&self) -> bool {
        self.first_seen.is_empty()
    }

    /// When `tag` (`store:<id>`, ...) was first seen as garbage, if it is waiting.
    pub(super) fn first_seen(&self, tag: &str) -> Option<Instant> {
        self.first_seen.get(tag).copied()
    }
}

/// The retired blobs of one store that stays (see [`Reconciler::retired_blobs`]).
pub(super) struct RetiredBlobs {
    pub(super) names: Vec<String>,
    pub(super) bytes: u64,
    /// When the oldest of them was first seen as garbage (`None`: not yet by any pass).
    pub(super) since: Option<Instant>,
}

impl Reconciler {
    /// The blobs of stores that stay which nothing references any more (retired revisions),
    /// by store, with their bytes: what the next passes would sweep after the grace period,
    /// for the disk budget to take earlier. Blobs an open file may read, and stores a fetch
    /// writes into, are left out (as [`plan`] does).
    pub(super) fn retired_blobs(&self) -> BTreeMap<StoreId, RetiredBlobs> {
        let usage = DaemonUsage {
            reconciler: self,
            blob_uses: self.fs.blob_uses(),
            fetching: self.fetching_stores(),
        };
        let found = plan(&self.core.records, &self.state, &usage, Duration::MAX);
        let mut out: BTreeMap<StoreId, RetiredBlobs> = BTreeMap::new();
        for (id, name) in found.blobs {
            let bytes = self
                .state
                .existing_store(&id)
                .map_or(0, |s| file_bytes(&s.blob_path_by_name(&name)));
            let seen = self
                .gc
                .candidates
                .first_seen
                .get(&format!("blob:{id}/{name}"))
                .copied();
            let entry = out.entry(id).or_insert(RetiredBlobs {
                names: Vec::new(),
                bytes: 0,
                since: None,
            });
            entry.bytes += bytes;
            entry.names.push(name);
            entry.since = match (entry.since, seen) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        out
    }

    /// The stores a fetch writes into: never removed, nor their blobs.
    pub(super) fn fetching_stores(&self) -> HashSet<StoreId> {
        self.core
            .working()
            .filter_map(|(_, phase)| match phase {
                decide::Phase::Fetching { store, .. } => Some(store.clone()),
                _ => None,
            })
            .collect()
    }

    /// Drops a store's record, its byte count and its metric (before its directory goes:
    /// records are saved first, see the callers).
    pub(super) fn forget_store(&mut self, id: &StoreId) {
        self.core.records.remove_store(id);
        self.known.store_bytes.remove(id);
        self.metrics
            .store_bytes
            .remove(&crate::metrics::StoreLabel {
                store: id.to_string(),
            });
    }

    /// Removes retired blobs of `store` (found by [`Self::retired_blobs`]).
    pub(super) fn remove_retired_blobs(&mut self, store: &StoreId, names: &[String]) {
        for name in names {
            if let Err(e) = self.state.remove_blob(store, name) {
                tracing::warn!(%store, blob = name, error = %e, "could not remove a retired blob");
            }
        }
        self.update_store_bytes(store);
    }

    /// One pass; returns whether it removed anything.
    pub(super) fn gc(&mut self) -> bool {
        let removed = self.gc_pass();
        self.metrics
            .gc_pending
            .set(self.gc.candidates.first_seen.len() as i64);
        self.metrics.gc_passes.inc();
        removed
    }

    fn gc_pass(&mut self) -> bool {
        let now = Instant::now();
        let partial_max_age = self.config.gc_grace.max(Duration::from_secs(3600));
        let usage = DaemonUsage {
            reconciler: self,
            blob_uses: self.fs.blob_uses(),
            fetching: self.fetching_stores(),
        };
        let found = plan(&self.core.records, &self.state, &usage, partial_max_age);
        // Only what has been garbage for the whole grace period goes.
        let grace = self.config.gc_grace;
        let mut seen = std::mem::take(&mut self.gc.candidates.first_seen);
        let mut still = BTreeMap::new();
        let mut due = |tag: String| -> bool {
            let since = seen.remove(&tag).unwrap_or(now);
            let ripe = now.duration_since(since) >= grace;
            if !ripe {
                still.insert(tag, since);
            }
            ripe
        };
        let ripe = GcPlan {
            stores: found
                .stores
                .into_iter()
                .filter(|s| due(format!("store:{s}")))
                .collect(),
            orphan_store_dirs: found
                .orphan_store_dirs
                .into_iter()
                .filter(|d| due(format!("dir:{d}")))
                .collect(),
            blobs: found
                .blobs
                .into_iter()
                .filter(|(s, b)| due(format!("blob:{s}/{b}")))
                .collect(),
            partials: found.partials,
            artifacts: found
                .artifacts
                .into_iter()
                .filter(|a| due(format!("artifact:{a}")))
                .collect(),
            bytes: 0,
        };
        self.gc.candidates.first_seen = still;
        if ripe == GcPlan::default() {
            return false;
        }
        for id in &ripe.stores {
            self.forget_store(id);
        }
        // Records first: a store directory is removed only after no record names it. If they
        // cannot be saved (a full disk), nothing is removed: the next pass tries again.
        if !self.save() {
            return false;
        }
        for e in execute(&self.state, &ripe) {
            tracing::warn!(error = %e, "garbage collection could not remove an item");
        }
        for a in &ripe.artifacts {
            self.known.artifacts.remove(a);
            self.known.model_configs.remove(a);
        }
        let touched: BTreeSet<StoreId> = ripe.blobs.iter().map(|(s, _)| s.clone()).collect();
        for s in &touched {
            self.update_store_bytes(s);
        }
        tracing::info!(
            stores = ripe.stores.len(),
            orphan_dirs = ripe.orphan_store_dirs.len(),
            blobs = ripe.blobs.len(),
            partials = ripe.partials.len(),
            artifacts = ripe.artifacts.len(),
            "garbage collected"
        );
        true
    }
}
