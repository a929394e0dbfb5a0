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
//!
//! # Memory
//! Both processes of a node hold the manifest of every artifact they serve for as long as they
//! serve it (100,000 files at 1,000 models of 100), so a [`Manifest`] is packed rather than a
//! list of entries: all paths in one string with a `u32` end offset each, the sizes in one
//! array, and the digests' bytes back to back with one `u32` each for their kind (two bits)
//! and offset. No entry has an allocation of its own and the arrays are boxed (no growth
//! slack): 16 bytes per entry plus its path and its digest (32 bytes for a sha256), against
//! about 150 for a `Vec` of [`ManifestEntry`] (a path `String` of 24 bytes and its own
//! allocation, a 50-byte [`FileDigest`], padding). [`Manifest::entries`] and
//! [`Manifest::get`] hand out [`EntryRef`]s, copies of the size and digest with the path
//! borrowed; [`Manifest::position`] finds a path by binary search, the entries being in path
//! order.
//!
//! A [`StoredArtifact`]'s blob of an entry is the sha256 of its bytes, which is the entry's
//! own file digest whenever that is a sha256 (local files, Hugging Face LFS files: the
//! download checks it). Only the other blobs are stored, with their entries' indices; an
//! artifact whose entries all have other digests (git sha1, object store) stores every blob,
//! without indices. A local artifact thus holds no blob digest at all.
//!
//! Serialized (artifact files, the mount server's persisted mapping, the socket protocol) both
//! keep the JSON form of a list of entries and of a blob list, byte for byte; reading packs
//! the entries one at a time.

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

/// One file of an artifact, owned: what a source lists, what [`Manifest::new`] takes, and the
/// JSON form of one entry. A [`Manifest`] does not keep these (see "Memory" above); it hands
/// out [`EntryRef`]s.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Relative, '/'-separated, validated by [`Manifest::new`].
    pub path: String,
    pub size: u64,
    pub digest: FileDigest,
}

/// One file of a [`Manifest`], read out of its packed storage: the path is borrowed, the size
/// and digest copied. Serializes exactly as a [`ManifestEntry`].
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize)]
#[serde(rename = "ManifestEntry")]
pub struct EntryRef<'a> {
    pub path: &'a str,
    pub size: u64,
    pub digest: FileDigest,
}

impl EntryRef<'_> {
    /// An owned copy, for code that keeps an entry beyond its manifest's borrow.
    pub fn to_entry(&self) -> ManifestEntry {
        ManifestEntry {
            path: self.path.to_string(),
            size: self.size,
            digest: self.digest,
        }
    }
}

/// The kind of a packed digest, in the top bits of its word in `Manifest::digest_at`.
const KIND_SHIFT: u32 = 30;
const AT_MASK: u32 = (1 << KIND_SHIFT) - 1;
const KIND_SHA256: u32 = 0;
const KIND_GITSHA1: u32 = 1;
const KIND_OBJECT: u32 = 2;
const KIND_OBJECT_MD5: u32 = 3;

/// A validated, path-sorted list of files plus the revision it was resolved at, packed (see
/// "Memory" in the module docs).
#[derive(Clone)]
pub struct Manifest {
    /// Resolved revision: a 40-hex commit for Hugging Face, the manifest digest for local sources.
    pub revision: String,
    /// Every entry's path, back to back, in entry order.
    paths: Box<str>,
    /// Where each entry's path ends in `paths` (it starts where the previous one ends).
    path_ends: Box<[u32]>,
    sizes: Box<[u64]>,
    /// Each entry's digest: its kind (`KIND_*`) in the top two bits, below them the offset of
    /// its bytes in `digests`.
    digest_at: Box<[u32]>,
    /// Every entry's digest bytes, back to back: 32 for a sha256, 20 for a git sha1, 32 for an
    /// object's identity followed by 16 for its MD5 when it has one.
    digests: Box<[u8]>,
    /// The digest, computed once: it is O(files) and asked for on every placement decision.
    id: std::sync::OnceLock<ArtifactId>,
}

/// Equal entries pack to equal arrays, so comparing the arrays compares the entries.
impl PartialEq for Manifest {
    fn eq(&self, other: &Self) -> bool {
        self.revision == other.revision
            && self.paths == other.paths
            && self.path_ends == other.path_ends
            && self.sizes == other.sizes
            && self.digest_at == other.digest_at
            && self.digests == other.digests
    }
}

impl Eq for Manifest {}

impl fmt::Debug for Manifest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        struct List<'a>(&'a Manifest);
        impl fmt::Debug for List<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_list().entries(self.0.entries()).finish()
            }
        }
        f.debug_struct("Manifest")
            .field("revision", &self.revision)
            .field("entries", &List(self))
            .finish()
    }
}

/// Entries being packed into a [`Manifest`]'s arrays, in the order they are pushed.
#[derive(Default)]
struct Packer {
    paths: String,
    path_ends: Vec<u32>,
    sizes: Vec<u64>,
    digest_at: Vec<u32>,
    digests: Vec<u8>,
}

fn digest_len(d: &FileDigest) -> usize {
    match d {
        FileDigest::Sha256(_) => 32,
        FileDigest::GitSha1(_) => 20,
        FileDigest::Object { md5: None, .. } => 32,
        FileDigest::Object { md5: Some(_), .. } => 48,
    }
}

impl Packer {
    /// Room for exactly `entries`, so that boxing the arrays does not copy them.
    fn for_entries(entries: &[ManifestEntry]) -> Self {
        let n = entries.len();
        Self {
            paths: String::with_capacity(entries.iter().map(|e| e.path.len()).sum()),
            path_ends: Vec::with_capacity(n),
            sizes: Vec::with_capacity(n),
            digest_at: Vec::with_capacity(n),
            digests: Vec::with_capacity(entries.iter().map(|e| digest_len(&e.digest)).sum()),
        }
    }

    /// Fails only past the offsets' range, which a validated listing cannot reach
    /// ([`MAX_ENTRIES`] paths of [`MAX_PATH_LEN`] bytes fit in a `u32`).
    fn push(&mut self, path: &str, size: u64, digest: &FileDigest) -> Result<(), &'static str> {
        let at = u32::try_from(self.digests.len())
            .ok()
            .filter(|at| *at <= AT_MASK)
            .ok_or("manifest digests exceed 1 GiB")?;
        let end = u32::try_from(self.paths.len() + path.len())
            .map_err(|_| "manifest paths exceed 4 GiB")?;
        let kind = match digest {
            FileDigest::Sha256(d) => {
                self.digests.extend_from_slice(d);
                KIND_SHA256
            }
            FileDigest::GitSha1(d) => {
                self.digests.extend_from_slice(d);
                KIND_GITSHA1
            }
            FileDigest::Object { identity, md5 } => {
                self.digests.extend_from_slice(identity);
                match md5 {
                    Some(m) => {
                        self.digests.extend_from_slice(m);
                        KIND_OBJECT_MD5
                    }
                    None => KIND_OBJECT,
                }
            }
        };
        self.paths.push_str(path);
        self.path_ends.push(end);
        self.sizes.push(size);
        self.digest_at.push(kind << KIND_SHIFT | at);
        Ok(())
    }

    /// Boxed: no growth slack stays for as long as the manifest is served.
    fn finish(self, revision: String) -> Manifest {
        Manifest {
            revision,
            paths: self.paths.into_boxed_str(),
            path_ends: self.path_ends.into_boxed_slice(),
            sizes: self.sizes.into_boxed_slice(),
            digest_at: self.digest_at.into_boxed_slice(),
            digests: self.digests.into_boxed_slice(),
            id: std::sync::OnceLock::new(),
        }
    }
}

/// The entries of a [`Manifest`], in order.
#[derive(Clone)]
pub struct Entries<'a> {
    manifest: &'a Manifest,
    range: std::ops::Range<usize>,
}

impl<'a> Iterator for Entries<'a> {
    type Item = EntryRef<'a>;
    fn next(&mut self) -> Option<EntryRef<'a>> {
        let i = self.range.next()?;
        Some(self.manifest.entry(i))
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        self.range.size_hint()
    }
    fn nth(&mut self, n: usize) -> Option<EntryRef<'a>> {
        let i = self.range.nth(n)?;
        Some(self.manifest.entry(i))
    }
}

impl ExactSizeIterator for Entries<'_> {}

impl DoubleEndedIterator for Entries<'_> {
    fn next_back(&mut self) -> Option<Self::Item> {
        let i = self.range.next_back()?;
        Some(self.manifest.entry(i))
    }
}

impl std::iter::FusedIterator for Entries<'_> {}

impl<'a> IntoIterator for &'a Manifest {
    type Item = EntryRef<'a>;
    type IntoIter = Entries<'a>;
    fn into_iter(self) -> Entries<'a> {
        self.entries()
    }
}

/// Serializes what a fresh iterator from the closure yields as a sequence, without collecting
/// it first (the packed manifest and blob list have no `Vec` to hand to serde).
struct Seq<F>(F);

impl<F, I> Serialize for Seq<F>
where
    F: Fn() -> I,
    I: IntoIterator,
    I::Item: Serialize,
{
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq((self.0)())
    }
}

impl Serialize for Manifest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("Manifest", 2)?;
        st.serialize_field("revision", &self.revision)?;
        st.serialize_field("entries", &Seq(|| self.entries()))?;
        st.end()
    }
}

/// The JSON entries of a manifest, packed one at a time as they are read: a manifest read from
/// a file or the socket never exists as a list of separately allocated entries.
struct PackedEntries(Packer);

impl<'de> Deserialize<'de> for PackedEntries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = PackedEntries;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of manifest entries")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<PackedEntries, A::Error> {
                let mut packer = Packer::default();
                while let Some(e) = seq.next_element::<ManifestEntry>()? {
                    packer
                        .push(&e.path, e.size, &e.digest)
                        .map_err(serde::de::Error::custom)?;
                }
                Ok(PackedEntries(packer))
            }
        }
        d.deserialize_seq(Visitor)
    }
}

impl<'de> Deserialize<'de> for Manifest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(rename = "Manifest")]
        struct Wire {
            revision: String,
            entries: PackedEntries,
        }
        let Wire { revision, entries } = Wire::deserialize(d)?;
        Ok(entries.0.finish(revision))
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArtifactError {
    #[error("file listing has an invalid path {path:?}: {why}")]
    BadPath { path: String, why: &'static str },
    #[error("file listing names {path:?} twice")]
    Duplicate { path: String },
    #[error("manifest is not in path order at {path:?}")]
    Unsorted { path: String },
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
    // Bidirectional controls make a listed name read as another one (`evil\u{202e}nib.exe`
    // shows as `evilexe.bin`); no model file needs one.
    if path.chars().any(is_bidi_control) {
        return Err(bad("bidirectional control character in a name"));
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

/// The Unicode bidirectional formatting characters: embeddings and overrides (U+202A-U+202E),
/// isolates (U+2066-U+2069) and the marks (U+200E, U+200F, U+061C).
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}' | '\u{061c}')
}

/// Checks one entry's path and size.
fn check_entry(path: &str, size: u64) -> Result<(), ArtifactError> {
    validate_relative_path(path)?;
    if size > MAX_FILE_SIZE {
        return Err(ArtifactError::AbsurdSize {
            path: path.to_string(),
            size,
        });
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
            check_entry(&e.path, e.size)?;
        }
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        let mut packer = Packer::for_entries(&entries);
        for e in &entries {
            packer
                .push(&e.path, e.size, &e.digest)
                .expect("a validated listing fits the packed offsets");
        }
        drop(entries);
        let manifest = packer.finish(revision);
        manifest.check_order()?;
        Ok(manifest)
    }

    /// Validates a manifest that arrived from outside (the socket, a persisted file) as
    /// [`Manifest::new`] validates a listing, in place. Its entries must already be in order:
    /// whoever sent them had them from [`Manifest::new`], and blobs sent alongside are
    /// parallel to that order, so a list out of order is refused rather than sorted.
    pub fn validate(&self) -> Result<(), ArtifactError> {
        if self.len() > MAX_ENTRIES {
            return Err(ArtifactError::TooManyEntries { count: self.len() });
        }
        for e in self.entries() {
            check_entry(e.path, e.size)?;
        }
        self.check_order()
    }

    /// Paths strictly ascending (so no duplicates), and no file that is also a directory.
    fn check_order(&self) -> Result<(), ArtifactError> {
        for i in 1..self.len() {
            let (a, b) = (self.path(i - 1), self.path(i));
            match a.cmp(b) {
                std::cmp::Ordering::Less => {}
                std::cmp::Ordering::Equal => {
                    return Err(ArtifactError::Duplicate {
                        path: a.to_string(),
                    })
                }
                std::cmp::Ordering::Greater => {
                    return Err(ArtifactError::Unsorted {
                        path: b.to_string(),
                    })
                }
            }
        }
        // A file "a" and a file "a/b" would need "a" to be both a file and a directory.
        for i in 0..self.len() {
            let path = self.path(i);
            let mut prefix_end = 0;
            while let Some(pos) = path[prefix_end..].find('/') {
                let dir = &path[..prefix_end + pos];
                if self.position(dir).is_some() {
                    return Err(ArtifactError::FileDirClash {
                        path: dir.to_string(),
                    });
                }
                prefix_end += pos + 1;
            }
        }
        Ok(())
    }

    /// The entries, in path order.
    pub fn entries(&self) -> Entries<'_> {
        Entries {
            manifest: self,
            range: 0..self.len(),
        }
    }

    pub fn len(&self) -> usize {
        self.path_ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.path_ends.is_empty()
    }

    pub fn get(&self, i: usize) -> Option<EntryRef<'_>> {
        (i < self.len()).then(|| self.entry(i))
    }

    /// Entry `i`; panics past the end, as indexing a slice does.
    pub fn entry(&self, i: usize) -> EntryRef<'_> {
        EntryRef {
            path: self.path(i),
            size: self.sizes[i],
            digest: self.digest(i),
        }
    }

    /// The path of entry `i`.
    pub fn path(&self, i: usize) -> &str {
        let start = match i {
            0 => 0,
            _ => self.path_ends[i - 1] as usize,
        };
        &self.paths[start..self.path_ends[i] as usize]
    }

    /// The digest of entry `i`.
    pub fn digest(&self, i: usize) -> FileDigest {
        let word = self.digest_at[i];
        let bytes = &self.digests[(word & AT_MASK) as usize..];
        let array =
            |from: usize| -> [u8; 32] { bytes[from..from + 32].try_into().expect("32 bytes") };
        match word >> KIND_SHIFT {
            KIND_SHA256 => FileDigest::Sha256(array(0)),
            KIND_GITSHA1 => FileDigest::GitSha1(bytes[..20].try_into().expect("20 bytes")),
            KIND_OBJECT => FileDigest::Object {
                identity: array(0),
                md5: None,
            },
            _ => FileDigest::Object {
                identity: array(0),
                md5: Some(bytes[32..48].try_into().expect("16 bytes")),
            },
        }
    }

    /// The sha256 file digest of entry `i`, if that is its kind of digest.
    fn sha256(&self, i: usize) -> Option<&[u8; 32]> {
        let word = self.digest_at[i];
        (word >> KIND_SHIFT == KIND_SHA256).then(|| {
            let at = (word & AT_MASK) as usize;
            self.digests[at..at + 32].try_into().expect("32 bytes")
        })
    }

    /// The index of the entry at `path`: a binary search, the entries being in path order.
    pub fn position(&self, path: &str) -> Option<usize> {
        crate::search_sorted(0..self.len(), |i| self.path(i).cmp(path))
    }

    pub fn total_size(&self) -> u64 {
        self.sizes.iter().sum()
    }

    /// Bytes of heap the entries take (not the revision): what holding this manifest costs.
    pub fn heap_bytes(&self) -> usize {
        self.paths.len()
            + std::mem::size_of_val::<[u32]>(&self.path_ends)
            + std::mem::size_of_val::<[u64]>(&self.sizes)
            + std::mem::size_of_val::<[u32]>(&self.digest_at)
            + self.digests.len()
    }

    /// sha256 over the canonical list of (path, size, digest). The revision is not part of it:
    /// identical content is the same artifact whatever it was called.
    pub fn id(&self) -> ArtifactId {
        self.id.get_or_init(|| self.compute_id()).clone()
    }

    fn compute_id(&self) -> ArtifactId {
        let mut h = Sha256::new();
        h.update(b"modelfs-manifest-v1\n");
        for e in self.entries() {
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
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct StoredArtifact {
    pub id: ArtifactId,
    /// Shared: placement decisions hand it around without copying 10,000 entries.
    pub manifest: Arc<Manifest>,
    /// One blob per entry ([`StoredArtifact::blob`]).
    blobs: Blobs,
    /// When the artifact first became complete, seconds since the epoch: the mtime the mount shows.
    pub completed_at: u64,
    /// Files whose bytes could be checked by their size only when they were downloaded (their
    /// store published no digest or checksum): the status says `integrity: size-only`.
    pub size_only_files: u32,
}

/// The blob of every entry, stored only where it is not the entry's own sha256 file digest
/// (see "Memory" in the module docs).
#[derive(Clone, PartialEq, Eq, Debug)]
struct Blobs {
    /// The entries whose blob is in `other`, ascending. Empty when `other` holds the blob of
    /// every entry (then `other[i]` is entry `i`'s).
    at: Box<[u32]>,
    other: Box<[Sha256Digest]>,
}

impl Blobs {
    fn new(manifest: &Manifest, blobs: Vec<Sha256Digest>) -> Result<Self, ArtifactError> {
        if blobs.len() != manifest.len() {
            return Err(ArtifactError::BlobCountMismatch {
                entries: manifest.len(),
                blobs: blobs.len(),
            });
        }
        let at: Vec<u32> = (0..blobs.len())
            .filter(|&i| manifest.sha256(i) != Some(&blobs[i].0))
            .map(|i| i as u32)
            .collect();
        Ok(if at.len() == blobs.len() {
            Self {
                at: Box::default(),
                other: blobs.into_boxed_slice(),
            }
        } else {
            Self {
                other: at.iter().map(|&i| blobs[i as usize]).collect(),
                at: at.into_boxed_slice(),
            }
        })
    }

    fn get(&self, manifest: &Manifest, i: usize) -> Sha256Digest {
        if self.other.len() == manifest.len() {
            return self.other[i];
        }
        match self.at.binary_search(&(i as u32)) {
            Ok(k) => self.other[k],
            Err(_) => Sha256Digest(
                *manifest
                    .sha256(i)
                    .expect("an entry without a stored blob has a sha256 digest"),
            ),
        }
    }
}

impl StoredArtifact {
    /// `blobs` is parallel to `manifest.entries()`.
    pub fn new(
        manifest: impl Into<Arc<Manifest>>,
        blobs: Vec<Sha256Digest>,
        completed_at: u64,
    ) -> Result<Self, ArtifactError> {
        let manifest = manifest.into();
        let blobs = Blobs::new(&manifest, blobs)?;
        Ok(Self {
            id: manifest.id(),
            manifest,
            blobs,
            completed_at,
            size_only_files: 0,
        })
    }

    /// The same artifact, with `n` files checked by their size only.
    pub fn with_size_only_files(self, n: u32) -> Self {
        Self {
            size_only_files: n,
            ..self
        }
    }

    /// The blob of entry `i`; panics past the end.
    pub fn blob(&self, i: usize) -> Sha256Digest {
        self.blobs.get(&self.manifest, i)
    }

    /// The blob of every entry, in entry order.
    pub fn blobs(&self) -> impl ExactSizeIterator<Item = Sha256Digest> + '_ {
        (0..self.manifest.len()).map(|i| self.blob(i))
    }

    pub fn files(&self) -> impl ExactSizeIterator<Item = (EntryRef<'_>, Sha256Digest)> + '_ {
        self.manifest
            .entries()
            .enumerate()
            .map(|(i, e)| (e, self.blob(i)))
    }

    /// Bytes of heap the artifact takes, its manifest included.
    pub fn heap_bytes(&self) -> usize {
        self.manifest.heap_bytes()
            + std::mem::size_of_val::<[u32]>(&self.blobs.at)
            + std::mem::size_of_val::<[Sha256Digest]>(&self.blobs.other)
    }
}

impl Serialize for StoredArtifact {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("StoredArtifact", 5)?;
        st.serialize_field("id", &self.id)?;
        st.serialize_field("manifest", &*self.manifest)?;
        st.serialize_field("blobs", &Seq(|| self.blobs()))?;
        st.serialize_field("completed_at", &self.completed_at)?;
        // Absent when zero, so the form of every fully verified artifact is unchanged.
        if self.size_only_files > 0 {
            st.serialize_field("size_only_files", &self.size_only_files)?;
        } else {
            st.skip_field("size_only_files")?;
        }
        st.end()
    }
}

impl<'de> Deserialize<'de> for StoredArtifact {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(rename = "StoredArtifact")]
        struct Wire {
            id: ArtifactId,
            manifest: Manifest,
            blobs: Vec<Sha256Digest>,
            completed_at: u64,
            #[serde(default)]
            size_only_files: u32,
        }
        let Wire {
            id,
            manifest,
            blobs,
            completed_at,
            size_only_files,
        } = Wire::deserialize(d)?;
        // The id is kept as read: whoever loads an artifact checks it against the manifest.
        let blobs = Blobs::new(&manifest, blobs).map_err(serde::de::Error::custom)?;
        Ok(Self {
            id,
            manifest: Arc::new(manifest),
            blobs,
            completed_at,
            size_only_files,
        })
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
            (
                vec![entry("evil\u{202e}nib.exe", 1)],
                "bidirectional control",
            ),
            (vec![entry("dir\u{2066}/a", 1)], "bidirectional control"),
            (vec![entry("mark\u{200f}", 1)], "bidirectional control"),
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

    /// Every kind of digest, in an order [`Manifest::new`] sorts, and the blobs parallel to
    /// the sorted order: config.json, tok\u{e9}n/vocab.txt, weights 1, weights 2 (whose blob is
    /// its own sha256 file digest).
    fn sample() -> StoredArtifact {
        let m = Manifest::new(
            "rev-1".into(),
            vec![
                ManifestEntry {
                    path: "weights/model-00002.safetensors".into(),
                    size: 1 << 40,
                    digest: FileDigest::Sha256([0xab; 32]),
                },
                ManifestEntry {
                    path: "config.json".into(),
                    size: 512,
                    digest: FileDigest::GitSha1([0x12; 20]),
                },
                ManifestEntry {
                    path: "weights/model-00001.safetensors".into(),
                    size: 0,
                    digest: FileDigest::Object {
                        identity: [0x34; 32],
                        md5: Some([0x56; 16]),
                    },
                },
                ManifestEntry {
                    path: "tok\u{e9}n/vocab.txt".into(),
                    size: 7,
                    digest: FileDigest::Object {
                        identity: [0x78; 32],
                        md5: None,
                    },
                },
            ],
        )
        .unwrap();
        let blobs = [[1; 32], [3; 32], [2; 32], [0xab; 32]].map(Sha256Digest);
        StoredArtifact::new(m, blobs.to_vec(), 1_700_000_000).unwrap()
    }

    /// The JSON of [`sample`] as written by the build before manifests were packed (a list of
    /// entry structs and a list of blobs): artifact files, persisted mappings and the socket
    /// protocol keep exactly this form.
    const SAMPLE_JSON: &str = concat!(
        r#"{"id":"1ba34bc0ee822ede98bd1dade1af769765b9808ecd33e4c6a120e9070aa16c88","#,
        r#""manifest":{"revision":"rev-1","entries":["#,
        r#"{"path":"config.json","size":512,"digest":"gitsha1:1212121212121212121212121212121212121212"},"#,
        "{\"path\":\"tok\u{e9}n/vocab.txt\",",
        r#""size":7,"digest":"object:7878787878787878787878787878787878787878787878787878787878787878"},"#,
        r#"{"path":"weights/model-00001.safetensors","size":0,"#,
        r#""digest":"object:3434343434343434343434343434343434343434343434343434343434343434:md5:56565656565656565656565656565656"},"#,
        r#"{"path":"weights/model-00002.safetensors","size":1099511627776,"#,
        r#""digest":"sha256:abababababababababababababababababababababababababababababababab"}]},"#,
        r#""blobs":["0101010101010101010101010101010101010101010101010101010101010101","#,
        r#""0303030303030303030303030303030303030303030303030303030303030303","#,
        r#""0202020202020202020202020202020202020202020202020202020202020202","#,
        r#""abababababababababababababababababababababababababababababababab"],"#,
        r#""completed_at":1700000000}"#
    );

    #[test]
    fn the_id_is_the_one_computed_before_manifests_were_packed() {
        // Computed by the build before this representation: a changed id would make every
        // existing store fetch its artifacts again.
        assert_eq!(
            sample().id.to_string(),
            "1ba34bc0ee822ede98bd1dade1af769765b9808ecd33e4c6a120e9070aa16c88"
        );
        assert_eq!(sample().manifest.id(), sample().id);
    }

    #[test]
    fn json_is_the_old_format_and_round_trips() {
        let a = sample();
        assert_eq!(serde_json::to_string(&a).unwrap(), SAMPLE_JSON);
        let back: StoredArtifact = serde_json::from_str(SAMPLE_JSON).unwrap();
        assert_eq!(back, a);
        assert_eq!(serde_json::to_string(&back).unwrap(), SAMPLE_JSON);
        let blobs: Vec<String> = back.blobs().map(|b| b.to_hex()).collect();
        assert_eq!(
            blobs,
            ["01", "03", "02", "ab"].map(|b| b.repeat(32)).to_vec()
        );
        // A manifest alone, and an entry alone, have the old form too.
        let m: serde_json::Value = serde_json::from_str(SAMPLE_JSON).unwrap();
        assert_eq!(serde_json::to_value(&*a.manifest).unwrap(), m["manifest"]);
        assert_eq!(
            serde_json::to_value(a.manifest.entry(0)).unwrap(),
            serde_json::to_value(a.manifest.entry(0).to_entry()).unwrap()
        );
        // A blob list that does not match the entries is refused when read.
        let short = SAMPLE_JSON.replace(
            r#""0101010101010101010101010101010101010101010101010101010101010101","#,
            "",
        );
        let err = serde_json::from_str::<StoredArtifact>(&short).unwrap_err();
        assert!(err.to_string().contains("3 blobs for 4 entries"), "{err}");
    }

    #[test]
    fn packed_entries_read_back_as_listed() {
        let a = sample();
        let m = &a.manifest;
        assert_eq!(m.len(), 4);
        assert!(!m.is_empty());
        let listed: Vec<(&str, u64)> = m.entries().map(|e| (e.path, e.size)).collect();
        assert_eq!(
            listed,
            [
                ("config.json", 512),
                ("tok\u{e9}n/vocab.txt", 7),
                ("weights/model-00001.safetensors", 0),
                ("weights/model-00002.safetensors", 1 << 40),
            ]
        );
        assert_eq!(m.entry(0).digest, FileDigest::GitSha1([0x12; 20]));
        assert_eq!(
            m.entry(2).digest,
            FileDigest::Object {
                identity: [0x34; 32],
                md5: Some([0x56; 16])
            }
        );
        assert_eq!(m.entries().next_back(), m.get(3));
        assert_eq!(m.entries().nth(1), m.get(1));
        assert_eq!(m.entries().len(), 4);
        assert_eq!(m.get(4), None);
        for (i, e) in m.entries().enumerate() {
            assert_eq!(m.position(e.path), Some(i));
        }
        for missing in [
            "",
            "a",
            "config.jso",
            "weights",
            "weights/model-00003.safetensors",
            "z",
        ] {
            assert_eq!(m.position(missing), None, "{missing}");
        }
        assert_eq!(m.total_size(), (1 << 40) + 512 + 7);
        let files: Vec<Sha256Digest> = a.files().map(|(_, b)| b).collect();
        assert_eq!(files, a.blobs().collect::<Vec<_>>());
        assert_eq!(a.blob(3), Sha256Digest([0xab; 32]));
    }

    #[test]
    fn a_blob_equal_to_its_sha256_file_digest_is_not_stored_twice() {
        let n = 1000usize;
        let entries: Vec<ManifestEntry> = (0..n)
            .map(|i| ManifestEntry {
                path: format!("sub/f{i:06}.txt"),
                size: i as u64,
                digest: FileDigest::Sha256(Sha256Digest::of(&i.to_le_bytes()).0),
            })
            .collect();
        let m = Manifest::new("r".into(), entries.clone()).unwrap();
        let paths: usize = entries.iter().map(|e| e.path.len()).sum();
        // 16 bytes of offsets and size per entry, its path, its 32-byte digest.
        assert_eq!(m.heap_bytes(), paths + n * (16 + 32));
        let same: Vec<Sha256Digest> = m
            .entries()
            .map(|e| match e.digest {
                FileDigest::Sha256(d) => Sha256Digest(d),
                _ => unreachable!(),
            })
            .collect();
        let a = StoredArtifact::new(m.clone(), same.clone(), 0).unwrap();
        assert_eq!(a.heap_bytes(), m.heap_bytes());
        assert_eq!(a.blobs().collect::<Vec<_>>(), same);
        // One blob that is not its entry's digest is stored with its index; the others are not.
        let mut odd = same.clone();
        odd[500] = Sha256Digest([7; 32]);
        let b = StoredArtifact::new(m.clone(), odd.clone(), 0).unwrap();
        assert_eq!(b.heap_bytes(), m.heap_bytes() + 4 + 32);
        assert_eq!(b.blobs().collect::<Vec<_>>(), odd);
        let back: StoredArtifact =
            serde_json::from_str(&serde_json::to_string(&b).unwrap()).unwrap();
        assert_eq!(back, b);
        assert_ne!(back, a);
        // Entries with other digests store every blob, without indices.
        let git = Manifest::new(
            "r".into(),
            entries
                .iter()
                .map(|e| ManifestEntry {
                    digest: FileDigest::GitSha1([1; 20]),
                    ..e.clone()
                })
                .collect(),
        )
        .unwrap();
        let c = StoredArtifact::new(git.clone(), same.clone(), 0).unwrap();
        assert_eq!(c.heap_bytes(), git.heap_bytes() + n * 32);
        assert_eq!(c.blobs().collect::<Vec<_>>(), same);
    }

    #[test]
    fn a_manifest_read_from_outside_is_validated_in_place() {
        let a = sample();
        let json = serde_json::to_string(&*a.manifest).unwrap();
        let m: Manifest = serde_json::from_str(&json).unwrap();
        m.validate().unwrap();
        assert_eq!(m, *a.manifest);
        let cases = [
            (json.replace("config.json", "../config.json"), "dot segment"),
            (
                json.replace("\"size\":7", "\"size\":18446744073709551615"),
                "absurd size",
            ),
            (json.replace("config.json", "zzz"), "not in path order"),
            (json.replace("model-00001", "model-00002"), "twice"),
            (
                json.replace("config.json", "tok\u{e9}n"),
                "both a file and a directory",
            ),
        ];
        for (bad, want) in cases {
            let m: Manifest = serde_json::from_str(&bad).unwrap();
            let err = m.validate().unwrap_err().to_string();
            assert!(err.contains(want), "{bad}: {err} should mention {want}");
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
