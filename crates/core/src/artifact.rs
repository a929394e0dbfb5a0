//! Artifacts: what a source resolves to.
//!
//! An artifact is a list of files (relative path, size, content digest) plus the revision the
//! source resolved to. Its identity is the *manifest digest*: sha256 over the canonical,
//! path-sorted list of `(path, size, file digest)`. Two models hold "the same artifact" exactly
//! when their manifest digests are equal, so two revisions of one repository can never be
//! confused, and two sources with identical content (a `local://` copy of a Hugging Face
//! snapshot) are recognised as one.
//!
//! A file digest is what the source vouches for before any byte is downloaded: sha256 for local
//! files and Hugging Face LFS files, the git blob sha1 for small Hugging Face files, and for an
//! object of an object store its identity (location, size, ETag or version id) plus its MD5 when
//! the store publishes one ([`FileDigest::Object`]). Blobs in a
//! store are always named by sha256, computed while the bytes are written, so a
//! [`StoredArtifact`] records the sha256 of every entry once the artifact is complete.
//!
//! Entry paths are validated here, once, for every source: a hostile listing (absolute paths,
//! `..`, NUL and control characters, duplicates, a file and a directory of the same name,
//! absurd sizes) is rejected before anything touches the disk.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Largest single file accepted from a listing: 16 TiB. Real checkpoints shard far below this;
/// anything larger is a lying server, not a model.
pub const MAX_FILE_SIZE: u64 = 1 << 44;
/// Most entries accepted in one artifact. The largest public repositories have tens of thousands.
pub const MAX_ENTRIES: usize = 1_000_000;
/// Longest relative path accepted (Linux PATH_MAX).
pub const MAX_PATH_LEN: usize = 4096;

/// A sha256 digest.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Sha256Digest(pub [u8; 32]);

impl Sha256Digest {
    pub fn of(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.to_hex())
    }
}

impl FromStr for Sha256Digest {
    type Err = ArtifactError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out)
            .map_err(|_| ArtifactError::BadDigest(s.chars().take(80).collect()))?;
        Ok(Self(out))
    }
}

impl Serialize for Sha256Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for Sha256Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The digest a source vouches for, checked when the bytes arrive.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum FileDigest {
    Sha256([u8; 32]),
    /// `sha1("blob <len>\0" + bytes)`, what git (and so the Hugging Face hub) uses for small files.
    GitSha1([u8; 20]),
    /// An object of an object store, which vouches for no sha256 before the download:
    /// `identity` is [`object_identity`] of its location, size and ETag or version id (so a
    /// changed object is a new file, and the artifact a new artifact), `md5` the MD5 of its
    /// bytes when the store publishes one (an S3 single-part ETag, GCS `md5Hash`, Azure
    /// `Content-MD5`, OCI `opc-content-md5`), checked when the bytes arrive. Without it only
    /// the size is checked, and every range is requested for that one version (`If-Match`).
    Object {
        identity: [u8; 32],
        md5: Option<[u8; 16]>,
    },
}

/// The identity of one object version: sha256 over `scheme://container/key`, size, and the ETag
/// or version id the store reported. The location is part of it so that two buckets never
/// count as one artifact on the strength of an ETag alone (a weak or MD5-based tag).
pub fn object_identity(location: &str, size: u64, version: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    for part in [location, &size.to_string(), version] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    h.finalize().into()
}

impl FileDigest {
    /// A file name stem for store work files of this digest (`sha256-<hex>`, `gitsha1-<hex>`,
    /// `object-<hex of the identity>`).
    pub fn file_stem(&self) -> String {
        match self {
            FileDigest::Sha256(d) => format!("sha256-{}", hex::encode(d)),
            FileDigest::GitSha1(d) => format!("gitsha1-{}", hex::encode(d)),
            FileDigest::Object { identity, .. } => format!("object-{}", hex::encode(identity)),
        }
    }

    /// Whether the bytes of a file can be checked against this digest (adopting an old file
    /// needs that; a download also has the object's version and size).
    pub fn checks_content(&self) -> bool {
        !matches!(self, FileDigest::Object { md5: None, .. })
    }
}

impl fmt::Display for FileDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FileDigest::Sha256(d) => write!(f, "sha256:{}", hex::encode(d)),
            FileDigest::GitSha1(d) => write!(f, "gitsha1:{}", hex::encode(d)),
            FileDigest::Object { identity, md5 } => {
                write!(f, "object:{}", hex::encode(identity))?;
                match md5 {
                    Some(m) => write!(f, ":md5:{}", hex::encode(m)),
                    None => Ok(()),
                }
            }
        }
    }
}

impl FromStr for FileDigest {
    type Err = ArtifactError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ArtifactError::BadDigest(s.chars().take(80).collect());
        if let Some(h) = s.strip_prefix("sha256:") {
            let mut out = [0u8; 32];
            hex::decode_to_slice(h, &mut out).map_err(|_| bad())?;
            Ok(FileDigest::Sha256(out))
        } else if let Some(h) = s.strip_prefix("gitsha1:") {
            let mut out = [0u8; 20];
            hex::decode_to_slice(h, &mut out).map_err(|_| bad())?;
            Ok(FileDigest::GitSha1(out))
        } else if let Some(rest) = s.strip_prefix("object:") {
            let (id, md5) = match rest.split_once(":md5:") {
                Some((id, md5)) => (id, Some(md5)),
                None => (rest, None),
            };
            let mut identity = [0u8; 32];
            hex::decode_to_slice(id, &mut identity).map_err(|_| bad())?;
            let md5 = match md5 {
                Some(m) => {
                    let mut out = [0u8; 16];
                    hex::decode_to_slice(m, &mut out).map_err(|_| bad())?;
                    Some(out)
                }
                None => None,
            };
            Ok(FileDigest::Object { identity, md5 })
        } else {
            Err(bad())
        }
    }
}

impl Serialize for FileDigest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for FileDigest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The identity of an artifact: the hex sha256 of its canonical manifest.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ArtifactId(pub Sha256Digest);

impl fmt::Display for ArtifactId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.to_hex())
    }
}

/// One file of an artifact.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Relative, '/'-separated, validated by [`Manifest::new`].
    pub path: String,
    pub size: u64,
    pub digest: FileDigest,
}

/// A validated, path-sorted list of files plus the revision it was resolved at.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// Resolved revision: a 40-hex commit for Hugging Face, the manifest digest for local sources.
    pub revision: String,
    entries: Vec<ManifestEntry>,
    /// The digest, computed once: it is O(files) and asked for on every placement decision.
    #[serde(skip)]
    id: std::sync::OnceLock<ArtifactId>,
}

impl PartialEq for Manifest {
    fn eq(&self, other: &Self) -> bool {
        self.revision == other.revision && self.entries == other.entries
    }
}

impl Eq for Manifest {}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArtifactError {
    #[error("file listing has an invalid path {path:?}: {why}")]
    BadPath { path: String, why: &'static str },
    #[error("file listing names {path:?} twice")]
    Duplicate { path: String },
    #[error("file listing has both a file and a directory named {path:?}")]
    FileDirClash { path: String },
    #[error("file listing gives {path:?} an absurd size of {size} bytes")]
    AbsurdSize { path: String, size: u64 },
    #[error("file listing has {count} entries, more than the limit of {MAX_ENTRIES}")]
    TooManyEntries { count: usize },
    #[error("invalid digest {0:?}")]
    BadDigest(String),
    #[error("stored artifact lists {blobs} blobs for {entries} entries")]
    BlobCountMismatch { entries: usize, blobs: usize },
}

/// Checks one relative path of a listing. Rejects everything that could escape a directory or
/// confuse a path join: absolute paths, `.`/`..`, empty segments, NUL and other control
/// characters, backslashes (a Windows separator in a listing is either an attack or a bug), and
/// over-long names.
pub fn validate_relative_path(path: &str) -> Result<(), ArtifactError> {
    let bad = |why| ArtifactError::BadPath {
        path: path.chars().take(200).collect(),
        why,
    };
    if path.is_empty() {
        return Err(bad("empty path"));
    }
    if path.len() > MAX_PATH_LEN {
        return Err(bad("path longer than 4096 bytes"));
    }
    if path.starts_with('/') {
        return Err(bad("absolute path"));
    }
    if path.contains('\0') {
        return Err(bad("NUL byte"));
    }
    if path.contains('\\') {
        return Err(bad("backslash"));
    }
    // As for spec.storage.path: a newline or escape sequence in a name forges log lines and
    // terminal output, and no model needs one.
    if path.chars().any(char::is_control) {
        return Err(bad("control character in a name"));
    }
    for segment in path.split('/') {
        match segment {
            "" => return Err(bad("empty segment")),
            "." | ".." => return Err(bad("dot segment")),
            s if s.len() > 255 => return Err(bad("name longer than 255 bytes")),
            _ => {}
        }
    }
    Ok(())
}

impl Manifest {
    /// Validates and canonicalises (sorts) a listing.
    pub fn new(revision: String, mut entries: Vec<ManifestEntry>) -> Result<Self, ArtifactError> {
        if entries.len() > MAX_ENTRIES {
            return Err(ArtifactError::TooManyEntries {
                count: entries.len(),
            });
        }
        for e in &entries {
            validate_relative_path(&e.path)?;
            if e.size > MAX_FILE_SIZE {
                return Err(ArtifactError::AbsurdSize {
                    path: e.path.clone(),
                    size: e.size,
                });
            }
        }
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        let mut files = BTreeSet::new();
        for pair in entries.windows(2) {
            if pair[0].path == pair[1].path {
                return Err(ArtifactError::Duplicate {
                    path: pair[0].path.clone(),
                });
            }
        }
        for e in &entries {
            files.insert(e.path.as_str());
        }
        // A file "a" and a file "a/b" would need "a" to be both a file and a directory.
        for e in &entries {
            let mut prefix_end = 0;
            while let Some(pos) = e.path[prefix_end..].find('/') {
                let dir = &e.path[..prefix_end + pos];
                if files.contains(dir) {
                    return Err(ArtifactError::FileDirClash {
                        path: dir.to_string(),
                    });
                }
                prefix_end += pos + 1;
            }
        }
        // Kept for as long as the artifact is served: no growth slack (a listing parsed
        // from JSON or collected from a walk carries up to half its length again).
        entries.shrink_to_fit();
        Ok(Self {
            revision,
            entries,
            id: std::sync::OnceLock::new(),
        })
    }

    pub fn entries(&self) -> &[ManifestEntry] {
        &self.entries
    }

    /// The revision and the entries, to validate them again without a copy.
    pub fn into_parts(self) -> (String, Vec<ManifestEntry>) {
        (self.revision, self.entries)
    }

    pub fn total_size(&self) -> u64 {
        self.entries.iter().map(|e| e.size).sum()
    }

    /// sha256 over the canonical list of (path, size, digest). The revision is not part of it:
    /// identical content is the same artifact whatever it was called.
    pub fn id(&self) -> ArtifactId {
        self.id.get_or_init(|| self.compute_id()).clone()
    }

    fn compute_id(&self) -> ArtifactId {
        let mut h = Sha256::new();
        h.update(b"modelfs-manifest-v1\n");
        for e in &self.entries {
            h.update(e.path.as_bytes());
            h.update([0]);
            h.update(e.size.to_string().as_bytes());
            h.update([0]);
            h.update(e.digest.to_string().as_bytes());
            h.update(b"\n");
        }
        ArtifactId(Sha256Digest(h.finalize().into()))
    }
}

/// A complete artifact as held by a store: the manifest and, for each entry, the sha256 of the
/// blob that holds its bytes. Written once when the artifact first becomes complete and never
/// changed, so it is safe to share between models and to cache forever.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct StoredArtifact {
    pub id: ArtifactId,
    /// Shared: placement decisions hand it around without copying 10,000 entries.
    pub manifest: Arc<Manifest>,
    /// Parallel to `manifest.entries()`.
    pub blobs: Vec<Sha256Digest>,
    /// When the artifact first became complete, seconds since the epoch: the mtime the mount shows.
    pub completed_at: u64,
}

impl StoredArtifact {
    pub fn new(
        manifest: impl Into<Arc<Manifest>>,
        mut blobs: Vec<Sha256Digest>,
        completed_at: u64,
    ) -> Result<Self, ArtifactError> {
        let manifest = manifest.into();
        blobs.shrink_to_fit();
        if blobs.len() != manifest.entries().len() {
            return Err(ArtifactError::BlobCountMismatch {
                entries: manifest.entries().len(),
                blobs: blobs.len(),
            });
        }
        Ok(Self {
            id: manifest.id(),
            manifest,
            blobs,
            completed_at,
        })
    }

    /// Drops the growth slack of a freshly parsed artifact (JSON arrays are read into
    /// doubling vectors) before it is kept for as long as it is served.
    pub fn shrink_to_fit(&mut self) {
        if let Some(manifest) = Arc::get_mut(&mut self.manifest) {
            manifest.entries.shrink_to_fit();
        }
        self.blobs.shrink_to_fit();
    }

    pub fn files(&self) -> impl Iterator<Item = (&ManifestEntry, &Sha256Digest)> {
        self.manifest.entries().iter().zip(self.blobs.iter())
    }
}

/// The git blob sha1 of `bytes` (`sha1("blob <len>\0" + bytes)`), as test data (also for the
/// tests of the crates above this one).
pub fn git_blob_sha1(bytes: &[u8]) -> [u8; 20] {
    use sha1::{Digest as _, Sha1};
    let mut h = Sha1::new();
    h.update(format!("blob {}\0", bytes.len()).as_bytes());
    h.update(bytes);
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(path: &str, size: u64) -> ManifestEntry {
        ManifestEntry {
            path: path.into(),
            size,
            digest: FileDigest::Sha256([size as u8; 32]),
        }
    }

    #[test]
    fn id_ignores_order_and_revision_but_not_content() {
        let a = Manifest::new("r1".into(), vec![entry("b", 1), entry("a/x", 2)]).unwrap();
        let b = Manifest::new("r2".into(), vec![entry("a/x", 2), entry("b", 1)]).unwrap();
        assert_eq!(a.id(), b.id());
        let c = Manifest::new("r1".into(), vec![entry("b", 1), entry("a/x", 3)]).unwrap();
        assert_ne!(a.id(), c.id());
        let d = Manifest::new("r1".into(), vec![entry("b", 1), entry("a/y", 2)]).unwrap();
        assert_ne!(a.id(), d.id());
    }

    #[test]
    fn hostile_listings_are_rejected() {
        let cases: Vec<(Vec<ManifestEntry>, &str)> = vec![
            (vec![entry("/etc/passwd", 1)], "absolute"),
            (vec![entry("a/../../x", 1)], "dot"),
            (vec![entry("./x", 1)], "dot"),
            (vec![entry("a//b", 1)], "empty segment"),
            (vec![entry("a\0b", 1)], "NUL"),
            (vec![entry("a/b\nc", 1)], "control character"),
            (vec![entry("\u{1b}[31mred", 1)], "control character"),
            (vec![entry("del\u{7f}", 1)], "control character"),
            (vec![entry("c1\u{85}", 1)], "control character"),
            (vec![entry("a\\..\\b", 1)], "backslash"),
            (vec![entry("", 1)], "empty path"),
            (vec![entry("x", 1), entry("x", 2)], "twice"),
            (
                vec![entry("x", 1), entry("x/y", 2)],
                "both a file and a directory",
            ),
            (vec![entry("x", u64::MAX)], "absurd size"),
            (vec![entry(&"n".repeat(256), 1)], "255"),
        ];
        for (entries, want) in cases {
            let err = Manifest::new("r".into(), entries.clone()).unwrap_err();
            assert!(
                err.to_string().contains(want),
                "{entries:?}: {err} should mention {want}"
            );
        }
    }

    #[test]
    fn digests_round_trip() {
        for s in [
            format!("sha256:{}", "ab".repeat(32)),
            format!("gitsha1:{}", "cd".repeat(20)),
            format!("object:{}", "ef".repeat(32)),
            format!("object:{}:md5:{}", "ef".repeat(32), "01".repeat(16)),
        ] {
            let d: FileDigest = s.parse().unwrap();
            assert_eq!(d.to_string(), s);
        }
        assert!("sha256:zz".parse::<FileDigest>().is_err());
        assert!("md5:00".parse::<FileDigest>().is_err());
    }
}
