//! Garbage collection of stores.
//!
//! A store is garbage when it has no owner, is not reserved, no model is served from it, no
//! fetch writes into it, and the filesystem core reports no use (no mapping, no retained slot,
//! no open file: see `FsCore::store_in_use`). It is removed only after it has been garbage for
//! the whole grace period, observed continuously. Leftovers of crashes are swept too: store
//! directories no record names, and artifact files no store holds.

use std::collections::BTreeSet;
use std::time::Instant;

use super::{Reconciler, Stage};
use crate::artifact::ArtifactId;
use crate::store::StoreId;

impl Reconciler {
    fn store_busy(&self, id: &StoreId) -> bool {
        !self.records.users_of(id).is_empty()
            || self.fs.store_in_use(id)
            || self
                .works
                .values()
                .any(|w| matches!(&w.stage, Stage::Fetching { store, .. } if store == id))
    }

    pub(super) fn gc(&mut self) {
        let now = Instant::now();
        let ids: Vec<StoreId> = self.records.stores.keys().cloned().collect();
        for id in ids {
            let s = &self.records.stores[&id];
            let garbage = s.owner.is_none() && !s.reserved && !self.store_busy(&id);
            if !garbage {
                self.released.remove(&id);
                continue;
            }
            let since = *self.released.entry(id.clone()).or_insert(now);
            if now.duration_since(since) < self.config.gc_grace {
                continue;
            }
            match self.state.remove_store(&id) {
                Ok(()) => {
                    tracing::info!(store = %id, "garbage store removed");
                    self.records.stores.remove(&id);
                    self.released.remove(&id);
                    self.store_bytes.remove(&id);
                    self.metrics
                        .store_bytes
                        .remove(&crate::metrics::StoreLabel {
                            store: id.to_string(),
                        });
                }
                Err(e) => tracing::warn!(store = %id, error = %e, "removing garbage store failed"),
            }
        }
        // Records first: a directory whose record was saved is never mistaken for an orphan.
        self.save();
        if let Ok(dirs) = self.state.store_dirs() {
            for dir in dirs {
                let Some(id) = StoreId::parse_dir_name(&dir) else {
                    continue;
                };
                if !self.records.stores.contains_key(&id) {
                    tracing::info!(store = %id, "removing store directory without a record");
                    if let Err(e) = self.state.remove_store(&id) {
                        tracing::warn!(store = %id, error = %e, "removing orphan store failed");
                    }
                }
            }
        }
        let held: BTreeSet<ArtifactId> = self
            .records
            .stores
            .values()
            .flat_map(|s| s.artifacts.iter().cloned())
            .chain(
                self.records
                    .models
                    .values()
                    .filter_map(|m| m.artifact.clone()),
            )
            .collect();
        if let Ok(ids) = self.state.artifact_ids() {
            for a in ids {
                if !held.contains(&a) {
                    let _ = self.state.remove_artifact(&a);
                    self.artifacts.remove(&a);
                }
            }
        }
    }
}
