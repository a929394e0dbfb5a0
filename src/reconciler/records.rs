//! The reconciler's durable records: which models exist, what each one serves, and which
//! stores exist and who owns them. They belong to the reconciler (policies, phases, ownership);
//! the store ([`crate::store`]) knows only blobs and store directories.
//!
//! Kept as one JSON document replaced atomically (write, fsync, rename, fsync directory) rather
//! than in an embedded database. The document is small (a few hundred bytes per model: file lists
//! live in the immutable `artifacts/` files, not here), it changes only on state transitions of
//! models (not per downloaded byte), and a whole-document replace gives all-or-nothing updates of
//! several records at once (a flip that re-points a parent and its children) with no extra
//! dependency, no compaction and no recovery code beyond "read the file". A SIGKILL at any moment
//! leaves either the previous or the next document.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::artifact::ArtifactId;
use crate::manifest::{DownloadPolicy, ModelKey};
use crate::store::{fsutil, StoreId};

/// Version of the records format; bumped on incompatible changes.
pub const RECORDS_FORMAT: u32 = 1;

#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub enum ModelPhase {
    Updating,
    Ready,
    Failed,
}

impl ModelPhase {
    pub fn as_str(&self) -> &'static str {
        match self {
            ModelPhase::Updating => "Updating",
            ModelPhase::Ready => "Ready",
            ModelPhase::Failed => "Failed",
        }
    }
}

#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ModelRecord {
    /// Creation order: the later of two conflicting models is the one that fails.
    pub seq: u64,
    pub name: String,
    /// `Some` for a BaseModel: reuse scope (a BaseModel may reuse its own namespace's stores).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Digest of the spec fields that decide what the model serves; a change means "reconcile".
    pub fingerprint: String,
    pub source: String,
    pub policy: DownloadPolicy,
    /// Path below the mount, '/'-separated.
    pub path: String,
    pub reserve: bool,
    pub phase: ModelPhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The artifact the mount serves for this model (set only once it is complete).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<ArtifactId>,
    /// Resolved revision of `artifact` (commit or manifest digest), reported as `artifact.sha`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha: Option<String>,
    /// The store the model is served from. Its owner is the model's parent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<StoreId>,
    /// The path the mount serves `artifact` at (the spec's path once the change is applied).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_path: Option<String>,
    /// The source `artifact` was resolved from: a policy-only change needs no new resolve.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_source: Option<String>,
    /// Digest of the `parameters` `artifact` was resolved with (none when there were none): a
    /// changed endpoint, region or auth mode resolves again even if the source is the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_parameters: Option<String>,
}

impl ModelRecord {
    /// A model that serves nothing yet.
    pub fn new(seq: u64, name: String, namespace: Option<String>, phase: ModelPhase) -> Self {
        Self {
            seq,
            name,
            namespace,
            fingerprint: String::new(),
            source: String::new(),
            policy: DownloadPolicy::AlwaysDownload,
            path: String::new(),
            reserve: false,
            phase,
            reason: None,
            artifact: None,
            sha: None,
            store: None,
            served_path: None,
            served_source: None,
            served_parameters: None,
        }
    }
}

#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct StoreRecord {
    /// The model the store belongs to; `None` once the owner is gone (kept only if reserved or
    /// still in use, otherwise garbage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<ModelKey>,
    /// Artifacts complete in this store.
    pub artifacts: BTreeSet<ArtifactId>,
    /// Kept after its owner's deletion because of the reserve label.
    #[serde(default)]
    pub reserved: bool,
    /// Namespace of the last owner (`None`: a ClusterBaseModel), for the reuse scope of a
    /// reserved store that has no owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_owner_namespace: Option<String>,
}

#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Records {
    pub format: u32,
    pub next_store_seq: u64,
    pub next_model_seq: u64,
    pub models: BTreeMap<ModelKey, ModelRecord>,
    pub stores: BTreeMap<StoreId, StoreRecord>,
}

impl Default for Records {
    fn default() -> Self {
        Self {
            format: RECORDS_FORMAT,
            next_store_seq: 1,
            next_model_seq: 1,
            models: BTreeMap::new(),
            stores: BTreeMap::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RecordsError {
    #[error("reading {path}: {source}")]
    Read { path: String, source: io::Error },
    #[error(
        "{path} is not a valid records file ({source}); move it away to start from an empty state"
    )]
    Corrupt {
        path: String,
        source: serde_json::Error,
    },
    #[error("{path} has records format {found}, this build understands {RECORDS_FORMAT}")]
    Format { path: String, found: u32 },
    #[error("writing {path}: {source}")]
    Write { path: String, source: io::Error },
}

impl Records {
    /// Loads the records; a missing file is an empty state. A corrupt file is an error, never
    /// silently replaced: it would lose every store's ownership.
    pub fn load(path: &Path) -> Result<Self, RecordsError> {
        let display = path.display().to_string();
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(source) => {
                return Err(RecordsError::Read {
                    path: display,
                    source,
                })
            }
        };
        Self::from_bytes(&bytes, display)
    }

    /// Parses the content of a records file (`display` names it in errors).
    pub fn from_bytes(bytes: &[u8], display: String) -> Result<Self, RecordsError> {
        let records: Records =
            serde_json::from_slice(bytes).map_err(|source| RecordsError::Corrupt {
                path: display.clone(),
                source,
            })?;
        if records.format != RECORDS_FORMAT {
            return Err(RecordsError::Format {
                path: display,
                found: records.format,
            });
        }
        Ok(records)
    }

    pub fn save(&self, path: &Path) -> Result<(), RecordsError> {
        let bytes = serde_json::to_vec_pretty(self).expect("records serialize");
        fsutil::atomic_write(path, &bytes).map_err(|source| RecordsError::Write {
            path: path.display().to_string(),
            source,
        })
    }

    pub fn allocate_store(&mut self, owner: &ModelKey) -> StoreId {
        let id = StoreId::from_seq(self.next_store_seq);
        self.next_store_seq += 1;
        self.stores.insert(
            id.clone(),
            StoreRecord {
                owner: Some(owner.clone()),
                ..Default::default()
            },
        );
        id
    }

    pub fn allocate_model_seq(&mut self) -> u64 {
        let seq = self.next_model_seq;
        self.next_model_seq += 1;
        seq
    }

    /// Models served from `store`, in key order.
    pub fn users_of(&self, store: &StoreId) -> Vec<&ModelKey> {
        self.models
            .iter()
            .filter(|(_, m)| m.store.as_ref() == Some(store))
            .map(|(k, _)| k)
            .collect()
    }

    /// The store a model owns, if any.
    pub fn owned_store(&self, key: &ModelKey) -> Option<&StoreId> {
        self.stores
            .iter()
            .find(|(_, s)| s.owner.as_ref() == Some(key))
            .map(|(id, _)| id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn save_load_round_trip_and_corruption_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("records.json");
        assert_eq!(Records::load(&path).unwrap(), Records::default());
        let mut r = Records::default();
        let key = ModelKey::new(crate::manifest::ModelKind::ClusterBaseModel, None, "a").unwrap();
        let id = r.allocate_store(&key);
        assert_eq!(id.as_str(), "s00000001");
        assert_eq!(StoreId::parse_dir_name("s00000001"), Some(id.clone()));
        assert_eq!(StoreId::parse_dir_name("junk"), None);
        r.save(&path).unwrap();
        assert_eq!(Records::load(&path).unwrap(), r);
        std::fs::write(&path, b"{not json").unwrap();
        let err = Records::load(&path).unwrap_err().to_string();
        assert!(err.contains("not a valid records file"), "{err}");
    }
}
