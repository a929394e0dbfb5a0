//! Blob stores and the daemon's durable records.
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
pub mod records;

#[cfg(test)]
mod proptests;

use std::io;
use std::path::{Path, PathBuf};

use crate::artifact::{ArtifactId, StoredArtifact};

pub use blob::{BlobWriter, StagedBlob, Store, StoreError};
pub use records::{ModelPhase, ModelRecord, Records, StoreId, StoreRecord};

/// The `--state` directory.
#[derive(Clone, Debug)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    pub fn open(root: &Path) -> io::Result<Self> {
        for sub in ["artifacts", "stores"] {
            std::fs::create_dir_all(root.join(sub))?;
        }
        Ok(Self {
            root: root.to_path_buf(),
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
        Store::open(self.stores_dir().join(id.as_str()))
    }

    /// Opens a store only if its directory exists (used where creating it would be wrong).
    pub fn existing_store(&self, id: &StoreId) -> Option<Store> {
        let dir = self.stores_dir().join(id.as_str());
        dir.is_dir().then(|| Store::open(dir).ok()).flatten()
    }

    pub fn remove_store(&self, id: &StoreId) -> io::Result<()> {
        match std::fs::remove_dir_all(self.stores_dir().join(id.as_str())) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
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
    use crate::artifact::{FileDigest, Manifest, ManifestEntry, Sha256Digest};

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
