//! Blob stores: content-addressed blobs per store, their linking and deletion, and the state
//! directory's files. The durable records (who owns which store, what each model serves) belong
//! to the reconciler (`modelfs_agent::reconciler::records`).
//!
//! Layout of `--state DIR`:
//!
//! ```text
//! records.json                 durable records (models, stores), replaced atomically
//! status.json                  the status document of GET /v1/models, replaced atomically
//! artifacts/<id>.json          complete artifacts (manifest + blob per entry), immutable
//! artifacts/<id>.modelconfig.json  fields derived from the artifact's config.json (cache)
//! stores/<store-id>/blobs/<sha256>
//! stores/<store-id>/tmp/<digest>.part
//! stores/<store-id>/aliases/gitsha1-<hex>   sha256 of the verified blob with that git digest
//! ```
//!
//! A store is the set of blobs downloaded by one model (its owner); ownership can pass to another
//! model without moving a byte, so a store is named by a sequence number, not by its owner.
//! Blobs are content-addressed by sha256 within a store and are immutable once renamed into
//! `blobs/`: a blob under its final name has been verified, which is why start-up only `stat`s
//! blobs and never re-hashes them. Partial downloads live in `tmp/` under the digest the source
//! vouched for, so a restarted download finds and resumes them.
//!
//! Durability order: blob fsync -> rename -> directory fsync -> artifact file -> records. A crash at
//! any point leaves either a record that points only at synced blobs, or blobs that no record
//! points at (garbage, swept later), never a record that points at a missing blob. Imports of
//! many files stage verified blobs in `tmp/` and replace the per-blob fsync by one `syncfs` per
//! batch before the renames ([`Store::publish`]): the same order, one journal commit per batch.

pub mod blob;
pub mod fsutil;

use std::fmt;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::artifact::{ArtifactId, Sha256Digest, StoredArtifact};

pub use blob::{BlobRefused, BlobWriter, StagedBlob, Store, StoreError};

/// Name of a store directory.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct StoreId(String);

impl StoreId {
    pub fn from_seq(seq: u64) -> Self {
        Self(format!("s{seq:08}"))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// Store directory names are only ever produced by [`StoreId::from_seq`].
    pub fn parse_dir_name(name: &str) -> Option<Self> {
        let digits = name.strip_prefix('s')?;
        (digits.len() >= 8 && digits.bytes().all(|b| b.is_ascii_digit()))
            .then(|| Self(name.to_string()))
    }
}

impl fmt::Display for StoreId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The `--state` directory.
#[derive(Clone, Debug)]
pub struct StateDir {
    root: PathBuf,
    /// `stores/`, opened without following links, when stores are reached beneath it
    /// ([`StateDir::anchored`]).
    stores: Option<Arc<OwnedFd>>,
    /// This directory reached through another mount of its filesystem, which stores link
    /// through ([`StateDir::with_link_root`]).
    link_root: Option<Arc<OwnedFd>>,
}

impl StateDir {
    pub fn open(root: &Path) -> io::Result<Self> {
        for sub in ["artifacts", "stores"] {
            fsutil::create_dirs(&root.join(sub))?;
        }
        Ok(Self {
            root: root.to_path_buf(),
            stores: None,
            link_root: None,
        })
    }

    /// The same state directory with `dir`, a descriptor of this very directory opened through
    /// another mount of its filesystem: stores link a file opened through that mount by way of
    /// `dir` when their own path cannot (`EXDEV`; see `Store::link_open_file`). The caller
    /// checks that `dir` is this directory.
    pub fn with_link_root(self, dir: OwnedFd) -> Self {
        Self {
            link_root: Some(Arc::new(dir)),
            ..self
        }
    }

    /// Whether stores link through another mount ([`StateDir::with_link_root`]).
    pub fn links_through_another_mount(&self) -> bool {
        self.link_root.is_some()
    }

    /// Sets the link root of [`StateDir::with_link_root`] on a store of this directory.
    fn linking(&self, store: Store, id: &StoreId) -> Store {
        match &self.link_root {
            Some(dir) => store.linking_via(dir.clone(), Path::new("stores").join(id.as_str())),
            None => store,
        }
    }

    /// The same state directory with `stores/` opened once, beneath the root (the path the
    /// operator gave) without following links: every store it hands out then opens and
    /// checks its blobs beneath that descriptor ([`Store::open_blob`]), and
    /// [`StateDir::existing_store`] creates nothing. What the mount server serves from: the
    /// agent writes the stores, and no link it plants there may lead the server elsewhere.
    pub fn anchored(self) -> io::Result<Self> {
        use rustix::fs::{Mode, OFlags, ResolveFlags};
        let root = rustix::fs::open(
            &self.root,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let stores = rustix::fs::openat2(
            &root,
            "stores",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
        )
        .map_err(|e| {
            io::Error::new(
                io::Error::from(e).kind(),
                format!(
                    "opening {} without following links: {e}",
                    self.stores_dir().display()
                ),
            )
        })?;
        Ok(Self {
            stores: Some(Arc::new(stores)),
            ..self
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn records_path(&self) -> PathBuf {
        self.root.join("records.json")
    }

    pub fn status_path(&self) -> PathBuf {
        self.root.join("status.json")
    }

    pub fn stores_dir(&self) -> PathBuf {
        self.root.join("stores")
    }

    pub fn store(&self, id: &StoreId) -> io::Result<Store> {
        Ok(self.linking(Store::open(self.stores_dir().join(id.as_str()))?, id))
    }

    /// Store `id` without looking at the disk (see [`Store::at`]).
    pub fn store_unchecked(&self, id: &StoreId) -> Store {
        match &self.stores {
            Some(fd) => Store::beneath(fd.clone(), &self.stores_dir(), id.as_str()),
            None => Store::at(self.stores_dir().join(id.as_str())),
        }
    }

    /// Opens a store only if its directory exists (used where creating it would be wrong).
    /// Anchored ([`StateDir::anchored`]): only a directory reached without following a link
    /// counts, and nothing is created in it.
    pub fn existing_store(&self, id: &StoreId) -> Option<Store> {
        if let Some(fd) = &self.stores {
            use rustix::fs::{Mode, OFlags, ResolveFlags};
            rustix::fs::openat2(
                &**fd,
                id.as_str(),
                OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
                ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
            )
            .ok()?;
            return Some(self.store_unchecked(id));
        }
        let dir = self.stores_dir().join(id.as_str());
        let store = dir.is_dir().then(|| Store::open(dir).ok()).flatten()?;
        Some(self.linking(store, id))
    }

    pub fn remove_store(&self, id: &StoreId) -> io::Result<()> {
        match std::fs::remove_dir_all(self.stores_dir().join(id.as_str())) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }

    /// Makes store `to` (created if needed) hold hard links to `blobs` of store `from`: a
    /// second store of the same bytes, no byte copied. Durable when it returns (the new
    /// directory entries are synced). A blob already in `to` is kept.
    pub fn link_blobs(
        &self,
        from: &StoreId,
        to: &StoreId,
        blobs: &[Sha256Digest],
    ) -> io::Result<()> {
        let src = self.existing_store(from).ok_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, format!("store {from} is missing"))
        })?;
        let dst = self.store(to)?;
        for blob in blobs {
            match std::fs::hard_link(src.blob_path(blob), dst.blob_path(blob)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("linking blob {blob}: {e}"),
                    ))
                }
            }
        }
        dst.sync().map_err(io::Error::other)
    }

    /// Removes one blob (by file name, as garbage collection lists them) from a store.
    pub fn remove_blob(&self, store: &StoreId, name: &str) -> io::Result<()> {
        if name.contains('/') || name.starts_with('.') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name:?} is not a blob name"),
            ));
        }
        let Some(s) = self.existing_store(store) else {
            return Ok(());
        };
        match std::fs::remove_file(s.blob_path_by_name(name)) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }

    /// Removes a partial download (a path [`Store::partial_files`] listed) of a store.
    pub fn remove_partial(&self, path: &Path) -> io::Result<()> {
        if !path.starts_with(self.stores_dir()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not in a store", path.display()),
            ));
        }
        match std::fs::remove_file(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }

    /// Removes a directory under `stores/` that is a store's by name but that no record names
    /// (left by a crash between its creation and the records that would name it).
    pub fn remove_store_dir(&self, name: &str) -> io::Result<()> {
        let Some(id) = StoreId::parse_dir_name(name) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name:?} is not a store directory"),
            ));
        };
        self.remove_store(&id)
    }

    /// Names of the store directories present on disk.
    pub fn store_dirs(&self) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(self.stores_dir())? {
            let entry = entry?;
            if let Some(name) = entry.file_name().to_str() {
                out.push(name.to_string());
            }
        }
        out.sort();
        Ok(out)
    }

    fn artifact_path(&self, id: &ArtifactId) -> PathBuf {
        self.root.join("artifacts").join(format!("{id}.json"))
    }

    /// Writes an artifact file if it does not exist yet. Artifact files are immutable: the id is
    /// the digest of the manifest, so an existing file already has the same content.
    pub fn save_artifact(&self, artifact: &StoredArtifact) -> io::Result<()> {
        let path = self.artifact_path(&artifact.id);
        if path.exists() {
            return Ok(());
        }
        let bytes = serde_json::to_vec(artifact).map_err(io::Error::other)?;
        fsutil::atomic_write(&path, &bytes)
    }

    pub fn load_artifact(&self, id: &ArtifactId) -> io::Result<StoredArtifact> {
        let bytes = std::fs::read(self.artifact_path(id))?;
        let artifact: StoredArtifact = serde_json::from_slice(&bytes)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if artifact.manifest.id() != *id || artifact.id != *id {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("artifact file {id} does not match its name"),
            ));
        }
        Ok(artifact)
    }

    fn model_config_path(&self, id: &ArtifactId) -> PathBuf {
        self.root
            .join("artifacts")
            .join(format!("{id}.modelconfig.json"))
    }

    /// Saves what was derived from an artifact's config files, so a restart does not parse
    /// them again. A cache: losing it only costs a new parse.
    pub fn save_model_config(&self, id: &ArtifactId, bytes: &[u8]) -> io::Result<()> {
        fsutil::atomic_write(&self.model_config_path(id), bytes)
    }

    pub fn load_model_config(&self, id: &ArtifactId) -> Option<Vec<u8>> {
        std::fs::read(self.model_config_path(id)).ok()
    }

    /// Removes an artifact file and what was derived from it.
    pub fn remove_artifact(&self, id: &ArtifactId) -> io::Result<()> {
        match std::fs::remove_file(self.model_config_path(id)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        match std::fs::remove_file(self.artifact_path(id)) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }

    /// Ids of the artifact files present on disk.
    pub fn artifact_ids(&self) -> io::Result<Vec<ArtifactId>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(self.root.join("artifacts"))? {
            let name = entry?.file_name();
            let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".json")) else {
                continue;
            };
            if let Ok(d) = stem.parse() {
                out.push(ArtifactId(d));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::{FileDigest, Manifest, ManifestEntry};

    #[test]
    fn linking_shares_the_inode_and_removal_stays_in_the_store() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        let (a, b) = (StoreId::from_seq(1), StoreId::from_seq(2));
        let blob = Sha256Digest([7; 32]);
        let src = state.store(&a).unwrap();
        std::fs::write(src.blob_path(&blob), b"bytes").unwrap();
        state.link_blobs(&a, &b, &[blob]).unwrap();
        state.link_blobs(&a, &b, &[blob]).unwrap();
        let dst = state.existing_store(&b).unwrap();
        let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
        assert_eq!(ino(&src.blob_path(&blob)), ino(&dst.blob_path(&blob)));
        let missing = state.link_blobs(&a, &b, &[Sha256Digest([8; 32])]);
        assert!(missing.unwrap_err().to_string().contains("linking blob"));
        assert!(state.remove_blob(&b, "../../x").is_err());
        state.remove_blob(&b, &blob.to_hex()).unwrap();
        state.remove_blob(&b, &blob.to_hex()).unwrap();
        assert!(!dst.blob_path(&blob).exists() && src.blob_path(&blob).exists());
        assert!(state
            .remove_partial(&dir.path().join("records.json"))
            .is_err());
        assert!(state.remove_store_dir("..").is_err());
        std::fs::create_dir_all(state.stores_dir().join("s00000009/blobs")).unwrap();
        state.remove_store_dir("s00000009").unwrap();
        assert_eq!(state.store_dirs().unwrap(), vec!["s00000001", "s00000002"]);
    }

    #[test]
    fn removing_an_artifact_removes_its_parsed_config_and_ids_ignore_it() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        let manifest = Manifest::new(
            "r".into(),
            vec![ManifestEntry {
                path: "config.json".into(),
                size: 2,
                digest: FileDigest::Sha256([1; 32]),
            }],
        )
        .unwrap();
        let artifact = StoredArtifact::new(manifest, vec![Sha256Digest([1; 32])], 0).unwrap();
        state.save_artifact(&artifact).unwrap();
        state.save_model_config(&artifact.id, b"{}").unwrap();
        assert_eq!(
            state.load_model_config(&artifact.id).as_deref(),
            Some(&b"{}"[..])
        );
        assert_eq!(state.artifact_ids().unwrap(), vec![artifact.id.clone()]);
        state.remove_artifact(&artifact.id).unwrap();
        assert_eq!(state.load_model_config(&artifact.id), None);
        assert!(state.artifact_ids().unwrap().is_empty());
        assert_eq!(
            std::fs::read_dir(dir.path().join("artifacts"))
                .unwrap()
                .count(),
            0
        );
    }
}
