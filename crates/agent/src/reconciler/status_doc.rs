//! The status document built from the records (SPEC section 6.1, section 6.3). Parent and children are
//! derived from the placements every time, never stored, so they cannot go stale: the parent of
//! a model is the owner of the store it is served from, and a parent's children are the other
//! models served from its store.

use std::sync::atomic::Ordering;
use std::time::SystemTime;

use super::records::{ModelPhase, ModelRecord};
use super::{Reconciler, Stage};
use modelfs_ome::status::{rfc3339, ModelStatus, ProgressStatus, StatusDoc};
use modelfs_ome::{ModelKey, MountPath};

impl Reconciler {
    fn abs_path(&self, rel: &str) -> String {
        self.config
            .models_root_dir
            .join(rel)
            .to_string_lossy()
            .into_owned()
    }

    /// Why the mount side does not serve the model at `served_path` (relative), if it does not.
    fn not_served(&self, served_path: Option<&str>) -> Option<&'static str> {
        let mount = self.mount.as_ref()?;
        let path = MountPath::from_relative(served_path?).ok()?;
        mount.not_serving(path.segments())
    }

    /// A model the mapping serves while it downloads (SPEC section 13): its reason says how
    /// many files verified; one that opted in by annotation is `Ready` once the mount server
    /// confirmed its listing (OME then schedules its pods, whose opens of files not yet
    /// verified wait), while its `progress` goes on as OME's.
    fn fill_served_while_downloading(&self, key: &modelfs_ome::ModelKey, e: &mut ModelStatus) {
        let Some(work) = self.works.get(key) else {
            return;
        };
        let Some((verified, total)) = self.verified_counts(&work.spec.path) else {
            return;
        };
        e.reason = Some(format!(
            "served while downloading: {verified}/{total} files verified"
        ));
        let served = self
            .mount
            .as_ref()
            .is_none_or(|m| m.not_serving(work.spec.path.segments()).is_none());
        if work.spec.serve_while_downloading && served {
            e.status = ModelPhase::Ready.as_str().to_string();
        }
    }

    pub(super) fn status_doc(&self) -> StatusDoc {
        let mut doc = StatusDoc::new();
        // An entry equal to the published one is that one (see `StatusDoc`): the new document
        // then shares it, and the old one's copy is freed with the old document.
        let previous = self.publishing.status.load();
        let mut insert = |key: String, e: ModelStatus| {
            let e = match previous.get(&key) {
                Some(old) if **old == e => old.clone(),
                _ => std::sync::Arc::new(e),
            };
            doc.insert(key, e);
        };
        // Owners and users come from the records' indexes, so the document costs
        // O(models log models), not O(models x stores) (it is rebuilt on every change).
        for (key, rec) in self.core.records.models() {
            let mut e = ModelStatus {
                name: rec.name.clone(),
                status: rec.phase.as_str().to_string(),
                // A model whose object was never accepted has no policy (the record's is only
                // a default): shown as none rather than as `AlwaysDownload`.
                policy: if rec.source.is_empty() {
                    String::new()
                } else {
                    rec.policy.as_str().to_string()
                },
                path: if rec.path.is_empty() {
                    String::new()
                } else {
                    self.abs_path(&rec.path)
                },
                reason: rec.reason.clone(),
                source: rec.source.clone(),
                digest: rec.artifact.as_ref().map(|a| a.to_string()),
                ..Default::default()
            };
            e.config.artifact.sha = rec.sha.clone().unwrap_or_default();
            // What vouches for the served bytes: said only where it is less than a digest or
            // checksum of every file.
            if let Some(a) = rec
                .artifact
                .as_ref()
                .and_then(|a| self.known.artifacts.get(a))
            {
                if a.size_only_files > 0 {
                    e.integrity = Some("size-only".into());
                    e.size_only_files = Some(a.size_only_files);
                }
            }
            self.fill_placement(key, rec, &mut e);
            self.fill_progress(key, &mut e);
            e.shape = self
                .desired
                .as_ref()
                .and_then(|d| d.models.get(key))
                .and_then(|spec| spec.as_ref().ok())
                .and_then(|spec| spec.shape.clone());
            self.fill_model_config(key, &mut e);
            if rec.phase == ModelPhase::Ready {
                // Ready only while the mount server serves it (`mount_client` module docs).
                if let Some(why) = self.not_served(rec.served_path.as_deref()) {
                    e.status = ModelPhase::Updating.as_str().to_string();
                    e.reason = Some(why.to_string());
                }
            }
            if rec.phase == ModelPhase::Updating {
                self.fill_served_while_downloading(key, &mut e);
            }
            if rec.phase == ModelPhase::Failed && e.reason.is_none() {
                e.reason = Some("failed".into());
            }
            insert(key.to_string(), e);
        }
        if let Some(desired) = &self.desired {
            for (what, reason) in &desired.errors {
                insert(
                    what.clone(),
                    ModelStatus {
                        name: what.clone(),
                        status: "Failed".into(),
                        reason: Some(reason.clone()),
                        ..Default::default()
                    },
                );
            }
        }
        doc
    }

    /// Who the model's store belongs to (its parent), and for an owner serving its own store
    /// the paths of its children and the store's bytes.
    fn fill_placement(&self, key: &ModelKey, rec: &ModelRecord, e: &mut ModelStatus) {
        if let Some(store) = &rec.store {
            if let Some(owner) = self
                .core
                .records
                .stores()
                .get(store)
                .and_then(|s| s.owner.as_ref())
            {
                let owner_path = self
                    .core
                    .records
                    .models()
                    .get(owner)
                    .and_then(|o| o.served_path.clone())
                    .map(|p| self.abs_path(&p))
                    .unwrap_or_default();
                e.config
                    .artifact
                    .parent_path
                    .insert(owner.to_string(), owner_path);
            }
        }
        if let Some(own) = self.core.records.owned_store(key) {
            e.bytes_on_disk = self.known.store_bytes.get(own).copied().unwrap_or(0);
            if rec.store.as_ref() == Some(own) {
                e.config.artifact.children_paths = self
                    .core
                    .records
                    .users_of(own)
                    .into_iter()
                    .filter(|u| *u != key)
                    .filter_map(|u| self.core.records.models()[u].served_path.clone())
                    .map(|p| self.abs_path(&p))
                    .collect();
            }
        }
    }

    /// OME's phases: `scanning` while the file list is fetched, `downloading`, then
    /// `finalizing` once every byte is in (last verifications, commit).
    fn fill_progress(&self, key: &ModelKey, e: &mut ModelStatus) {
        if let Some(w) = self.works.get(key) {
            // OME's phases: `scanning` while the file list is fetched, `downloading`, then
            // `finalizing` once every byte is in (last verifications, commit).
            match &w.stage {
                Stage::Resolving => {
                    e.progress = Some(ProgressStatus {
                        phase: "scanning".into(),
                        last_updated: rfc3339(SystemTime::now()),
                        ..Default::default()
                    });
                }
                Stage::Fetching { progress, .. } => {
                    let total_bytes = progress.total_bytes.load(Ordering::Relaxed);
                    let completed_bytes = progress.completed_bytes.load(Ordering::Relaxed);
                    e.progress = Some(ProgressStatus {
                        phase: if completed_bytes >= total_bytes {
                            "finalizing"
                        } else {
                            "downloading"
                        }
                        .into(),
                        total_bytes,
                        completed_bytes,
                        total_files: progress.total_files.load(Ordering::Relaxed),
                        completed_files: progress.completed_files.load(Ordering::Relaxed),
                        speed_bytes_per_sec: progress.bytes_per_sec(),
                        last_updated: rfc3339(SystemTime::now()),
                    });
                }
                Stage::Waiting { .. } => {}
            }
        }
    }
}
