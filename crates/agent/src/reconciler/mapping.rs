//! Building the mapping from the records: the served models (and the cache view derived from
//! them), reserved stores at their last owner's path, models served while they download, and
//! the empty directories of `vendor://` models, swapped into the filesystem core in one
//! snapshot.

use std::collections::HashMap;
use std::time::Instant;

use super::records::{self, ModelPhase};
use super::Reconciler;
use modelfs_core::artifact::ArtifactId;
use modelfs_core::store::StoreId;
use modelfs_mount::vfs::hf_cache::HfServed;
use modelfs_mount::vfs::MountEntry;
use modelfs_ome::{ModelKey, MountPath, SourceUri};

impl Reconciler {
    /// Builds the mount entries from the records and swaps the mapping. The path rule has run
    /// (`settle_paths`), so served paths never nest; models sharing a path serve the same
    /// artifact, and the earliest of them (by creation order, then key) supplies the store.
    pub(super) fn remap(&mut self) {
        let (mut entries, mut hf_served) = self.served_entries();
        self.reserved_entries(&mut entries);
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
        let dirs = self.vendor_dirs();
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

    /// The entries of the served models, and what the cache view derives from them. Models
    /// sharing a path serve the same artifact; the earliest of them (by creation order, then
    /// key) supplies the store.
    fn served_entries(&mut self) -> (Vec<MountEntry>, Vec<HfServed>) {
        let mut served: Vec<(u64, ModelKey, MountPath, ArtifactId, StoreId)> = Vec::new();
        for (key, rec) in self.core.records.models() {
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
                let source = self.core.records.models()[&key].served_source.as_deref();
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
        (entries, hf_served)
    }

    /// A reserved store keeps its last owner's directory (read-only) until it is reused or
    /// released, as OME keeps a reserved model's directory. A served model's path wins, and a
    /// path nested in or around a served one is left out (the fs layer refuses nesting).
    fn reserved_entries(&mut self, entries: &mut Vec<MountEntry>) {
        let reserved: Vec<(StoreId, records::ReservedPlacement)> = self
            .core
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
    }

    /// `vendor://` models below the models root: an empty read-only directory at their path,
    /// so a pod binding it (or creating it, as runtimes do) finds it, as on OME's writable
    /// disk. Outside the root (`node_dir`) their record's path is absolute and skipped here.
    fn vendor_dirs(&self) -> Vec<Vec<String>> {
        let mut dirs: Vec<Vec<String>> = Vec::new();
        for rec in self.core.records.models().values() {
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
        dirs
    }
}
