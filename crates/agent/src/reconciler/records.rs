//! The reconciler's durable records: which models exist, what each one serves, and which
//! stores exist and who owns them. They belong to the reconciler (policies, phases, ownership);
//! the store ([`modelfs_core::store`]) knows only blobs and store directories.
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

use modelfs_core::artifact::ArtifactId;
use modelfs_core::store::{fsutil, StoreId};
use modelfs_ome::{DownloadPolicy, ModelKey};

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
    /// Where a reserved store's last owner was served, and what: the directory stays at that
    /// path (read-only) until the store is reused or released, as OME keeps a reserved
    /// model's directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_at: Option<ReservedPlacement>,
}

/// The path (relative to the mount) and artifact a reserved store keeps serving.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ReservedPlacement {
    pub path: String,
    pub artifact: ArtifactId,
}

/// The records, with indexes kept in step with every change (see [`RecordsIndex`]): the fields
/// are private so that no change can bypass them. Mutable access goes through guards
/// ([`Records::model_mut`], [`Records::store_mut`]) that re-index what changed when dropped.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(from = "RecordsDoc")]
pub struct Records {
    pub format: u32,
    pub next_store_seq: u64,
    pub next_model_seq: u64,
    models: BTreeMap<ModelKey, ModelRecord>,
    stores: BTreeMap<StoreId, StoreRecord>,
    #[serde(skip_serializing)]
    index: RecordsIndex,
}

/// The document as stored: what [`Records`] is read from (its indexes are then built).
#[derive(Deserialize)]
struct RecordsDoc {
    format: u32,
    next_store_seq: u64,
    next_model_seq: u64,
    models: BTreeMap<ModelKey, ModelRecord>,
    stores: BTreeMap<StoreId, StoreRecord>,
}

impl From<RecordsDoc> for Records {
    fn from(d: RecordsDoc) -> Self {
        let index = RecordsIndex::build(&d.models, &d.stores);
        Records {
            format: d.format,
            next_store_seq: d.next_store_seq,
            next_model_seq: d.next_model_seq,
            models: d.models,
            stores: d.stores,
            index,
        }
    }
}

/// Equal records hold equal data (the indexes follow from it).
impl PartialEq for Records {
    fn eq(&self, other: &Self) -> bool {
        (
            self.format,
            self.next_store_seq,
            self.next_model_seq,
            &self.models,
            &self.stores,
        ) == (
            other.format,
            other.next_store_seq,
            other.next_model_seq,
            &other.models,
            &other.stores,
        )
    }
}

impl Eq for Records {}

/// What placement asks of the records, answered without scanning them: the users of a store,
/// the stores a model owns, the stores holding an artifact. A placement costs O(log n) plus
/// the size of its answer, not a pass over every record (thousands of models arrive at once).
/// Sets are never left empty, so two indexes of the same records are equal.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordsIndex {
    /// Models served from each store (`ModelRecord::store`).
    users: BTreeMap<StoreId, SmallSet<ModelKey>>,
    /// Stores each model owns (`StoreRecord::owner`); normally one.
    owned: BTreeMap<ModelKey, SmallSet<StoreId>>,
    /// Stores holding each artifact complete (`StoreRecord::artifacts`).
    holders: BTreeMap<ArtifactId, SmallSet<StoreId>>,
}

/// A set kept as a sorted vector of exactly its members. The indexes hold one set per store,
/// model or artifact, nearly all of one member: a `BTreeSet` allocates a node for eleven
/// (about 280 bytes for one 24-byte key), which at 10,000 models was megabytes of nodes.
/// Inserting and removing are O(n) in the set's size, which is that of a store's users.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SmallSet<T>(Vec<T>);

impl<T> Default for SmallSet<T> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<T: Ord> SmallSet<T> {
    /// Adds `v`; false if it was there.
    pub fn insert(&mut self, v: T) -> bool {
        match self.0.binary_search(&v) {
            Ok(_) => false,
            Err(i) => {
                self.0.insert(i, v);
                self.0.shrink_to_fit();
                true
            }
        }
    }

    /// Removes `v`; false if it was not there.
    pub fn remove(&mut self, v: &T) -> bool {
        match self.0.binary_search(v) {
            Ok(i) => {
                self.0.remove(i);
                self.0.shrink_to_fit();
                true
            }
            Err(_) => false,
        }
    }

    pub fn contains(&self, v: &T) -> bool {
        self.0.binary_search(v).is_ok()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The least member.
    pub fn first(&self) -> Option<&T> {
        self.0.first()
    }

    /// The members in order.
    pub fn iter(&self) -> std::slice::Iter<'_, T> {
        self.0.iter()
    }
}

impl<T> IntoIterator for SmallSet<T> {
    type Item = T;
    type IntoIter = std::vec::IntoIter<T>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<'a, T> IntoIterator for &'a SmallSet<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

fn index_add<K: Ord + Clone, V: Ord>(map: &mut BTreeMap<K, SmallSet<V>>, k: &K, v: V) {
    match map.get_mut(k) {
        Some(set) => {
            set.insert(v);
        }
        None => {
            let mut set = SmallSet::default();
            set.insert(v);
            map.insert(k.clone(), set);
        }
    }
}

fn index_remove<K: Ord, V: Ord>(map: &mut BTreeMap<K, SmallSet<V>>, k: &K, v: &V) {
    if let Some(set) = map.get_mut(k) {
        set.remove(v);
        if set.is_empty() {
            map.remove(k);
        }
    }
}

impl RecordsIndex {
    /// The indexes of `models` and `stores`, by a full scan (loading, and the tests' oracle).
    pub fn build(
        models: &BTreeMap<ModelKey, ModelRecord>,
        stores: &BTreeMap<StoreId, StoreRecord>,
    ) -> Self {
        let mut index = RecordsIndex::default();
        for (key, m) in models {
            index.add_model(key, m);
        }
        for (id, s) in stores {
            index.add_store(id, s);
        }
        index
    }

    fn add_model(&mut self, key: &ModelKey, m: &ModelRecord) {
        if let Some(s) = &m.store {
            index_add(&mut self.users, s, key.clone());
        }
    }

    fn remove_model(&mut self, key: &ModelKey, m: &ModelRecord) {
        if let Some(s) = &m.store {
            index_remove(&mut self.users, s, key);
        }
    }

    fn add_store(&mut self, id: &StoreId, s: &StoreRecord) {
        if let Some(o) = &s.owner {
            index_add(&mut self.owned, o, id.clone());
        }
        for a in &s.artifacts {
            index_add(&mut self.holders, a, id.clone());
        }
    }

    fn remove_store(&mut self, id: &StoreId, s: &StoreRecord) {
        if let Some(o) = &s.owner {
            index_remove(&mut self.owned, o, id);
        }
        for a in &s.artifacts {
            index_remove(&mut self.holders, a, id);
        }
    }
}

/// Mutable access to one model record; re-indexes its store when dropped.
pub struct ModelMut<'a> {
    key: &'a ModelKey,
    rec: &'a mut ModelRecord,
    old_store: Option<StoreId>,
    index: &'a mut RecordsIndex,
}

impl std::ops::Deref for ModelMut<'_> {
    type Target = ModelRecord;
    fn deref(&self) -> &ModelRecord {
        self.rec
    }
}

impl std::ops::DerefMut for ModelMut<'_> {
    fn deref_mut(&mut self) -> &mut ModelRecord {
        self.rec
    }
}

impl Drop for ModelMut<'_> {
    fn drop(&mut self) {
        if self.rec.store != self.old_store {
            if let Some(old) = &self.old_store {
                index_remove(&mut self.index.users, old, self.key);
            }
            if let Some(new) = &self.rec.store {
                index_add(&mut self.index.users, new, self.key.clone());
            }
        }
    }
}

/// Mutable access to one store record; re-indexes its owner and artifacts when dropped.
pub struct StoreMut<'a> {
    id: &'a StoreId,
    rec: &'a mut StoreRecord,
    old_owner: Option<ModelKey>,
    old_artifacts: BTreeSet<ArtifactId>,
    index: &'a mut RecordsIndex,
}

impl std::ops::Deref for StoreMut<'_> {
    type Target = StoreRecord;
    fn deref(&self) -> &StoreRecord {
        self.rec
    }
}

impl std::ops::DerefMut for StoreMut<'_> {
    fn deref_mut(&mut self) -> &mut StoreRecord {
        self.rec
    }
}

impl Drop for StoreMut<'_> {
    fn drop(&mut self) {
        if self.rec.owner != self.old_owner {
            if let Some(old) = &self.old_owner {
                index_remove(&mut self.index.owned, old, self.id);
            }
            if let Some(new) = &self.rec.owner {
                index_add(&mut self.index.owned, new, self.id.clone());
            }
        }
        if self.rec.artifacts != self.old_artifacts {
            for a in self.old_artifacts.difference(&self.rec.artifacts) {
                index_remove(&mut self.index.holders, a, self.id);
            }
            for a in self.rec.artifacts.difference(&self.old_artifacts) {
                index_add(&mut self.index.holders, a, self.id.clone());
            }
        }
    }
}

impl Default for Records {
    fn default() -> Self {
        Self {
            format: RECORDS_FORMAT,
            next_store_seq: 1,
            next_model_seq: 1,
            models: BTreeMap::new(),
            stores: BTreeMap::new(),
            index: RecordsIndex::default(),
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
        self.insert_store(
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

    /// Every model record, by key.
    pub fn models(&self) -> &BTreeMap<ModelKey, ModelRecord> {
        &self.models
    }

    /// Every store record, by id.
    pub fn stores(&self) -> &BTreeMap<StoreId, StoreRecord> {
        &self.stores
    }

    /// Changes one model record (indexes follow when the guard is dropped).
    pub fn model_mut(&mut self, key: &ModelKey) -> Option<ModelMut<'_>> {
        let (key, rec) = self.models.range_mut(key..=key).next()?;
        let old_store = rec.store.clone();
        Some(ModelMut {
            key,
            rec,
            old_store,
            index: &mut self.index,
        })
    }

    /// Changes one store record (indexes follow when the guard is dropped).
    pub fn store_mut(&mut self, id: &StoreId) -> Option<StoreMut<'_>> {
        let (id, rec) = self.stores.range_mut(id..=id).next()?;
        let old_owner = rec.owner.clone();
        let old_artifacts = rec.artifacts.clone();
        Some(StoreMut {
            id,
            rec,
            old_owner,
            old_artifacts,
            index: &mut self.index,
        })
    }

    /// Adds or replaces a model record.
    pub fn insert_model(&mut self, key: ModelKey, rec: ModelRecord) {
        if let Some(old) = self.models.remove(&key) {
            self.index.remove_model(&key, &old);
        }
        self.index.add_model(&key, &rec);
        self.models.insert(key, rec);
    }

    pub fn remove_model(&mut self, key: &ModelKey) -> Option<ModelRecord> {
        let rec = self.models.remove(key)?;
        self.index.remove_model(key, &rec);
        Some(rec)
    }

    /// Adds or replaces a store record.
    pub fn insert_store(&mut self, id: StoreId, rec: StoreRecord) {
        if let Some(old) = self.stores.remove(&id) {
            self.index.remove_store(&id, &old);
        }
        self.index.add_store(&id, &rec);
        self.stores.insert(id, rec);
    }

    pub fn remove_store(&mut self, id: &StoreId) -> Option<StoreRecord> {
        let rec = self.stores.remove(id)?;
        self.index.remove_store(id, &rec);
        Some(rec)
    }

    /// Models served from `store`, in key order.
    pub fn users_of(&self, store: &StoreId) -> Vec<&ModelKey> {
        self.index
            .users
            .get(store)
            .map(|u| u.iter().collect())
            .unwrap_or_default()
    }

    /// How many models are served from `store`.
    pub fn user_count(&self, store: &StoreId) -> usize {
        self.index.users.get(store).map_or(0, SmallSet::len)
    }

    /// The store a model owns, if any (the first in id order, should it own several).
    pub fn owned_store(&self, key: &ModelKey) -> Option<&StoreId> {
        self.index.owned.get(key)?.first()
    }

    /// Stores holding `artifact` complete, in id order.
    pub fn holders_of(&self, artifact: &ArtifactId) -> impl Iterator<Item = &StoreId> {
        self.index.holders.get(artifact).into_iter().flatten()
    }

    /// The indexes as maintained (tests compare them with [`RecordsIndex::build`]).
    pub fn index(&self) -> &RecordsIndex {
        &self.index
    }
}

#[cfg(test)]
mod proptests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_set_keeps_its_members_sorted_and_unique() {
        let mut set = SmallSet::default();
        assert!(set.insert(3) && set.insert(1) && set.insert(2));
        assert!(!set.insert(2));
        assert_eq!(set.iter().copied().collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!((set.len(), set.first()), (3, Some(&1)));
        assert!(set.contains(&2) && !set.contains(&4));
        assert!(set.remove(&1) && !set.remove(&1));
        assert_eq!(set.clone().into_iter().collect::<Vec<_>>(), [2, 3]);
        assert!(set.remove(&2) && set.remove(&3) && set.is_empty());
        assert_eq!(set, SmallSet::default());
    }

    #[test]
    fn save_load_round_trip_and_corruption_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("records.json");
        assert_eq!(Records::load(&path).unwrap(), Records::default());
        let mut r = Records::default();
        let key = ModelKey::new(modelfs_ome::ModelKind::ClusterBaseModel, None, "a").unwrap();
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

/// The indexes agree with a full scan after any sequence of changes (model and store records
/// added, replaced, changed through the guards, removed), and after a save and load.
#[cfg(test)]
mod index_proptests {
    use proptest::prelude::*;

    use super::*;
    use modelfs_core::artifact::Sha256Digest;
    use modelfs_ome::ModelKind;
    use modelfs_proptest_support::config;

    #[derive(Clone, Debug)]
    enum Op {
        InsertModel {
            key: u8,
            store: Option<u8>,
        },
        SetModelStore {
            key: u8,
            store: Option<u8>,
        },
        RemoveModel {
            key: u8,
        },
        AllocateStore {
            owner: u8,
        },
        InsertStore {
            id: u8,
            owner: Option<u8>,
            artifacts: Vec<u8>,
        },
        SetOwner {
            id: u8,
            owner: Option<u8>,
        },
        AddArtifact {
            id: u8,
            artifact: u8,
        },
        RemoveArtifact {
            id: u8,
            artifact: u8,
        },
        RemoveStore {
            id: u8,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        let k = 0u8..6;
        let s = 1u8..8;
        let a = 0u8..4;
        prop_oneof![
            (k.clone(), proptest::option::of(s.clone()))
                .prop_map(|(key, store)| Op::InsertModel { key, store }),
            (k.clone(), proptest::option::of(s.clone()))
                .prop_map(|(key, store)| Op::SetModelStore { key, store }),
            k.clone().prop_map(|key| Op::RemoveModel { key }),
            k.clone().prop_map(|owner| Op::AllocateStore { owner }),
            (
                s.clone(),
                proptest::option::of(k.clone()),
                proptest::collection::vec(a.clone(), 0..3)
            )
                .prop_map(|(id, owner, artifacts)| Op::InsertStore {
                    id,
                    owner,
                    artifacts
                }),
            (s.clone(), proptest::option::of(k)).prop_map(|(id, owner)| Op::SetOwner { id, owner }),
            (s.clone(), a.clone()).prop_map(|(id, artifact)| Op::AddArtifact { id, artifact }),
            (s.clone(), a).prop_map(|(id, artifact)| Op::RemoveArtifact { id, artifact }),
            s.prop_map(|id| Op::RemoveStore { id }),
        ]
    }

    fn key(n: u8) -> ModelKey {
        if n.is_multiple_of(2) {
            ModelKey::new(ModelKind::ClusterBaseModel, None, &format!("m{n}")).unwrap()
        } else {
            ModelKey::new(ModelKind::BaseModel, Some("ns"), &format!("m{n}")).unwrap()
        }
    }

    fn art(n: u8) -> ArtifactId {
        ArtifactId(Sha256Digest([n; 32]))
    }

    fn apply(r: &mut Records, op: &Op) {
        let store = |n: &u8| StoreId::from_seq(u64::from(*n));
        match op {
            Op::InsertModel { key: k, store: s } => {
                let seq = r.allocate_model_seq();
                let mut rec = ModelRecord::new(seq, format!("m{k}"), None, ModelPhase::Ready);
                rec.store = s.as_ref().map(store);
                r.insert_model(key(*k), rec);
            }
            Op::SetModelStore { key: k, store: s } => {
                if let Some(mut m) = r.model_mut(&key(*k)) {
                    m.store = s.as_ref().map(store);
                }
            }
            Op::RemoveModel { key: k } => {
                r.remove_model(&key(*k));
            }
            Op::AllocateStore { owner } => {
                r.allocate_store(&key(*owner));
            }
            Op::InsertStore {
                id,
                owner,
                artifacts,
            } => r.insert_store(
                store(id),
                StoreRecord {
                    owner: owner.map(key),
                    artifacts: artifacts.iter().map(|a| art(*a)).collect(),
                    ..Default::default()
                },
            ),
            Op::SetOwner { id, owner } => {
                if let Some(mut s) = r.store_mut(&store(id)) {
                    s.owner = owner.map(key);
                }
            }
            Op::AddArtifact { id, artifact } => {
                if let Some(mut s) = r.store_mut(&store(id)) {
                    s.artifacts.insert(art(*artifact));
                }
            }
            Op::RemoveArtifact { id, artifact } => {
                if let Some(mut s) = r.store_mut(&store(id)) {
                    s.artifacts.remove(&art(*artifact));
                }
            }
            Op::RemoveStore { id } => {
                r.remove_store(&store(id));
            }
        }
    }

    /// The answers of the indexed queries, computed by scanning every record.
    fn check_against_scan(r: &Records) {
        assert_eq!(r.index(), &RecordsIndex::build(r.models(), r.stores()));
        for n in 0..8u8 {
            let id = StoreId::from_seq(u64::from(n));
            let scanned: Vec<&ModelKey> = r
                .models()
                .iter()
                .filter(|(_, m)| m.store.as_ref() == Some(&id))
                .map(|(k, _)| k)
                .collect();
            assert_eq!(r.users_of(&id), scanned);
            assert_eq!(r.user_count(&id), scanned.len());
        }
        for n in 0..6u8 {
            let k = key(n);
            let scanned = r
                .stores()
                .iter()
                .find(|(_, s)| s.owner.as_ref() == Some(&k))
                .map(|(id, _)| id);
            assert_eq!(r.owned_store(&k), scanned);
        }
        for n in 0..4u8 {
            let a = art(n);
            let scanned: Vec<&StoreId> = r
                .stores()
                .iter()
                .filter(|(_, s)| s.artifacts.contains(&a))
                .map(|(id, _)| id)
                .collect();
            assert_eq!(r.holders_of(&a).collect::<Vec<_>>(), scanned);
        }
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn indexes_agree_with_a_full_scan(ops in proptest::collection::vec(op(), 0..60)) {
            let mut r = Records::default();
            for op in &ops {
                apply(&mut r, op);
                check_against_scan(&r);
            }
            let bytes = serde_json::to_vec(&r).unwrap();
            let loaded = Records::from_bytes(&bytes, "records.json".into()).unwrap();
            prop_assert_eq!(loaded.index(), r.index());
            prop_assert_eq!(loaded, r);
        }
    }
}
