//! One store: content-addressed blobs plus the partial files of downloads in progress.
//!
//! # Resumed downloads
//! A partial file is trusted only as far as it can be re-verified. Beside each partial file
//! `tmp/<digest>.part` the writer appends to `tmp/<digest>.part.sums` one line per segment
//! of at least [`SEGMENT`] bytes it wrote (`<end offset> <crc32c>`). A resumed writer
//! ([`Store::resume_writer`]) reads the partial file back segment by segment and keeps the
//! longest prefix whose every segment has its recorded CRC; bytes past it (a segment written
//! but not recorded before a crash, a segment whose bytes changed on disk) are cut off and
//! downloaded again. The CRC is against accidents (torn writes, bad sectors, a stray write
//! into `tmp/`): whoever can write the partial file can write its sums too, and the final
//! digest check on commit stays what vouches for the bytes. For an object whose store
//! publishes no digest (size only) the sums are all that stands between a damaged partial
//! file and a served blob. A partial file without sums (written by an older version) is
//! downloaded again from its start.

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};

use md5::Md5;
use sha1::Sha1;
use sha2::{Digest, Sha256};

use crate::artifact::{FileDigest, Sha256Digest};

/// A checksum the source published for a file's bytes besides its digest (a CRC32C, the MD5
/// of each part of a multipart upload, ...): fed every byte in order, the resumed prefix
/// included, and checked when the blob is committed. A mismatch fails the commit like a
/// digest mismatch.
pub trait ContentCheck: Send {
    /// The next bytes of the file.
    fn update(&mut self, bytes: &[u8]);
    /// Whether all bytes fed match what the source published; on a mismatch, the published
    /// and the computed value (for the error message).
    fn finish(&mut self) -> Result<(), (String, String)>;
}

/// The mark after the blob's name in an alias file of a blob checked by its size only.
const SIZE_ONLY: &str = "size-only";

/// Least number of bytes between two records of the resume sums (see the module docs): a
/// crash loses at most this much plus one write beyond the last verified byte. A record is
/// 20 bytes: a 10 GB file has 200 KB of them.
pub const SEGMENT: u64 = 1 << 20;

/// The CRC of the resume sums (CRC32C: hardware-accelerated, so the extra pass is cheap).
fn segment_crc() -> crc_fast::Digest {
    crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi)
}

use super::fsutil;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    #[error("disk full while {context}")]
    DiskFull { context: String },
    #[error("size mismatch: expected {expected} bytes, got {actual}")]
    SizeMismatch { expected: u64, actual: u64 },
    #[error("digest mismatch: expected {expected}, got {actual}")]
    DigestMismatch { expected: String, actual: String },
}

impl StoreError {
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        let context = context.into();
        if source.raw_os_error() == Some(libc::ENOSPC)
            || source.raw_os_error() == Some(libc::EDQUOT)
        {
            StoreError::DiskFull { context }
        } else {
            StoreError::Io { context, source }
        }
    }
}

/// Why a blob is not served (see [`Store::open_blob`]). The messages describe the entry in the
/// store only: never the size, owner or type of whatever a planted link would have led to.
#[derive(Debug, thiserror::Error)]
pub enum BlobRefused {
    #[error("missing")]
    Missing,
    #[error("refused: a symbolic link is on its path")]
    Link,
    #[error("refused: not a regular file")]
    NotRegular,
    #[error("refused: its size is not its manifest entry's")]
    WrongSize,
    #[error("refused: not owned by root")]
    NotOwned,
    #[error("refused: writable by its group or others")]
    Writable,
    #[error("refused: {0}")]
    Io(#[source] io::Error),
}

/// One store directory.
#[derive(Clone, Debug)]
pub struct Store {
    root: PathBuf,
    /// The `stores/` directory this store is in, opened without following links (see
    /// [`super::StateDir::anchored`]): blobs are then opened beneath it, so no link the agent
    /// plants on the way (the store's directory, `blobs/`, the blob) is followed. `None`: the
    /// store's own directory is opened by its path at each open (a caller that trusts it).
    beneath: Option<Arc<OwnedFd>>,
    /// The same store directory reached through another mount of its filesystem (see
    /// [`super::StateDir::with_link_root`]): a file opened through that mount is linked into
    /// `tmp/` there when a link by the store's own path fails with `EXDEV`.
    link_via: Option<LinkVia>,
}

/// A store's directory reached through another mount: the state directory's descriptor on
/// that mount and the store's path below it.
#[derive(Clone, Debug)]
struct LinkVia {
    state: Arc<OwnedFd>,
    rel: PathBuf,
}

impl Store {
    pub fn open(root: PathBuf) -> io::Result<Self> {
        fsutil::create_dirs(&root.join("blobs"))?;
        fsutil::create_dirs(&root.join("tmp"))?;
        Ok(Self {
            root,
            beneath: None,
            link_via: None,
        })
    }

    /// The store at `root` without looking at the disk (no directory is created): for a
    /// caller that knows it was there and checks its blobs later (the mount server serving its
    /// persisted mapping at start).
    pub fn at(root: PathBuf) -> Self {
        Self {
            root,
            beneath: None,
            link_via: None,
        }
    }

    /// The store named `name` in the directory `stores` (opened without following links);
    /// its blobs are opened beneath that descriptor. Nothing is created.
    pub(super) fn beneath(stores: Arc<OwnedFd>, stores_path: &Path, name: &str) -> Self {
        Self {
            root: stores_path.join(name),
            beneath: Some(stores),
            link_via: None,
        }
    }

    /// The same store, linking through `state` (the state directory opened through another
    /// mount of its filesystem) where its own path cannot link; `rel` is the store's path
    /// below the state directory.
    pub(super) fn linking_via(self, state: Arc<OwnedFd>, rel: PathBuf) -> Self {
        Self {
            link_via: Some(LinkVia { state, rel }),
            ..self
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Path of a blob by file name (garbage collection walks names, not digests).
    pub fn blob_path_by_name(&self, name: &str) -> PathBuf {
        self.root.join("blobs").join(name)
    }

    /// Partial downloads present in `tmp/`.
    pub fn partial_files(&self) -> io::Result<Vec<PathBuf>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(self.root.join("tmp"))? {
            out.push(entry?.path());
        }
        Ok(out)
    }

    pub fn blob_path(&self, digest: &Sha256Digest) -> PathBuf {
        self.root.join("blobs").join(digest.to_hex())
    }

    /// A blob under its final name was verified before the rename, so presence with the right
    /// size is proof enough; no re-hash. Presence means what [`Store::check_blob`] accepts: a
    /// blob the mount server would refuse is not there (and is fetched or adopted again).
    pub fn has_blob(&self, digest: &Sha256Digest, size: u64) -> bool {
        self.check_blob(digest, size).is_ok()
    }

    /// Whether the blob may be served, without opening it for reading (see
    /// [`Store::open_blob`]): a path lookup beneath the store and one `fstat`.
    pub fn check_blob(&self, digest: &Sha256Digest, size: u64) -> Result<(), BlobRefused> {
        self.inspect_blob(digest, size).map(drop)
    }

    /// Opens a blob for serving. The rules, which the mount server relies on (it runs with
    /// privileges in a directory the agent writes; see `modelfs_mount`'s module docs):
    /// * the path is resolved beneath the store's descriptor with `openat2(RESOLVE_BENEATH |
    ///   RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` and `O_NOFOLLOW`: a symbolic link
    ///   anywhere on it fails the open, it is never followed;
    /// * the blob is first opened `O_PATH` (which runs no driver's open and never waits on a
    ///   FIFO) and must be a regular file of the manifest's size; only then is that same inode
    ///   opened for reading (through `/proc/self/fd`, which names the inode, not a path);
    /// * it must be owned by root (or this process's user) and writable by neither its group
    ///   nor others: nobody but root can then change its bytes, whatever other names (hard
    ///   links) it has.
    pub fn open_blob(&self, digest: &Sha256Digest, size: u64) -> Result<File, BlobRefused> {
        let fd = self.inspect_blob(digest, size)?;
        let file = rustix::fs::open(
            format!("/proc/self/fd/{}", fd.as_raw_fd()),
            OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| BlobRefused::Io(e.into()))?;
        Ok(File::from(file))
    }

    /// The blob opened `O_PATH` after the checks of [`Store::open_blob`].
    fn inspect_blob(&self, digest: &Sha256Digest, size: u64) -> Result<OwnedFd, BlobRefused> {
        let hex = digest.to_hex();
        let dir_fd;
        let (dir, rel) = match &self.beneath {
            Some(stores) => {
                let name = self
                    .root
                    .file_name()
                    .ok_or(BlobRefused::Missing)?
                    .to_string_lossy();
                (&**stores, format!("{name}/blobs/{hex}"))
            }
            None => {
                dir_fd = match rustix::fs::open(
                    &self.root,
                    OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                    Mode::empty(),
                ) {
                    Ok(fd) => fd,
                    Err(e) if e == rustix::io::Errno::NOENT || e == rustix::io::Errno::NOTDIR => {
                        return Err(BlobRefused::Missing)
                    }
                    Err(e) => return Err(BlobRefused::Io(e.into())),
                };
                (&dir_fd, format!("blobs/{hex}"))
            }
        };
        let fd = match rustix::fs::openat2(
            dir,
            &rel,
            OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
        ) {
            Ok(fd) => fd,
            Err(e) if e == rustix::io::Errno::NOENT || e == rustix::io::Errno::NOTDIR => {
                return Err(BlobRefused::Missing)
            }
            Err(e) if e == rustix::io::Errno::LOOP => return Err(BlobRefused::Link),
            Err(e) => return Err(BlobRefused::Io(e.into())),
        };
        let stat = rustix::fs::fstat(&fd).map_err(|e| BlobRefused::Io(e.into()))?;
        check_servable(&stat, size)?;
        Ok(fd)
    }

    /// Links the inode of the open `file` as `tmp/<name>` (replacing any earlier one);
    /// `None` when that needs a copy (`EXDEV`). /proc/self/fd/N names exactly the inode that
    /// was opened (and checked where it was opened); following it links that inode, wherever
    /// its path points by now.
    ///
    /// `link(2)` needs both ends reached through one mount, not just one filesystem: a file
    /// opened through the mount server's mount of the models root cannot be linked into the
    /// store by the agent's path of it when that is a mount of its own (two hostPath volumes
    /// of one disk). The store's directory reached through the file's mount
    /// ([`Store::linking_via`]) is then the link's target: the same directory, so the link
    /// appears at `tmp/<name>` by the store's own path too.
    fn link_open_file(&self, file: &File, name: String) -> Result<Option<PathBuf>, StoreError> {
        let tmp = self.root.join("tmp").join(&name);
        let _ = std::fs::remove_file(&tmp);
        let proc_path = format!("/proc/self/fd/{}", file.as_raw_fd());
        let cwd = rustix::fs::CWD;
        let follow = rustix::fs::AtFlags::SYMLINK_FOLLOW;
        let failed = |e: rustix::io::Errno| {
            StoreError::io(format!("linking into {}", tmp.display()), e.into())
        };
        match rustix::fs::linkat(cwd, &proc_path, cwd, &tmp, follow) {
            Ok(()) => return Ok(Some(tmp)),
            Err(rustix::io::Errno::XDEV) => {}
            Err(e) => return Err(failed(e)),
        }
        let Some(via) = &self.link_via else {
            return Ok(None);
        };
        let there = via.rel.join("tmp").join(&name);
        match rustix::fs::linkat(cwd, &proc_path, &*via.state, &there, follow) {
            Ok(()) => Ok(Some(tmp)),
            Err(rustix::io::Errno::XDEV) => Ok(None),
            Err(e) => Err(failed(e)),
        }
    }

    /// Where the partial download of a file with this source digest lives.
    pub fn partial_path(&self, digest: &FileDigest) -> PathBuf {
        self.root
            .join("tmp")
            .join(format!("{}.part", digest.file_stem()))
    }

    /// Starts writing a blob from scratch (any partial file is discarded).
    pub fn writer(&self, expected: FileDigest, size: u64) -> Result<BlobWriter, StoreError> {
        self.writer_checked(expected, size, None)
    }

    fn writer_checked(
        &self,
        expected: FileDigest,
        size: u64,
        check: Option<Box<dyn ContentCheck>>,
    ) -> Result<BlobWriter, StoreError> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.partial_path(&expected);
        let _ = std::fs::remove_file(&path);
        // Root's alone while written, whatever the umask; 0444 once verified (`finish`).
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| StoreError::io(format!("creating {}", path.display()), e))?;
        // Sums of an earlier attempt would vouch for bytes this one has not written.
        let _ = std::fs::remove_file(sums_path(&path));
        Ok(BlobWriter::new(
            self.clone(),
            path,
            file,
            expected,
            size,
            check,
        ))
    }

    /// Continues a partial download: the prefix on disk that its resume sums vouch for is
    /// hashed again (the hash state is not persisted) and writing continues at its end; any
    /// bytes after it are cut off (see the module docs). A partial file longer than the
    /// expected size is discarded.
    pub fn resume_writer(&self, expected: FileDigest, size: u64) -> Result<BlobWriter, StoreError> {
        self.resume_writer_checked(expected, size, None)
    }

    /// [`Store::resume_writer`] with a published checksum that the blob must also match.
    pub fn resume_writer_checked(
        &self,
        expected: FileDigest,
        size: u64,
        check: Option<Box<dyn ContentCheck>>,
    ) -> Result<BlobWriter, StoreError> {
        let path = self.partial_path(&expected);
        let file = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return self.writer_checked(expected, size, check)
            }
            Err(e) => return Err(StoreError::io(format!("opening {}", path.display()), e)),
        };
        let have = file
            .metadata()
            .map_err(|e| StoreError::io(format!("stat {}", path.display()), e))?
            .len();
        if have > size {
            drop(file);
            return self.writer_checked(expected, size, check);
        }
        let sums = read_sums(&sums_path(&path));
        let mut writer = BlobWriter::new(
            self.clone(),
            path.clone(),
            file.try_clone().map_err(|e| StoreError::io("dup", e))?,
            expected,
            size,
            check,
        );
        let read_err = |e| StoreError::io(format!("reading {}", path.display()), e);
        let mut buf = vec![0u8; 1 << 20];
        let mut kept = Vec::new();
        let mut at = 0u64;
        // Each recorded segment is read twice: once for its CRC, then (only if it matches)
        // into the digests, so no byte that failed its CRC reaches them. The second read
        // comes from the page cache.
        for &(end, crc) in &sums {
            if end <= at || end > have {
                break;
            }
            let mut segment = segment_crc();
            let mut off = at;
            while off < end {
                let want = (end - off).min(buf.len() as u64) as usize;
                file.read_exact_at(&mut buf[..want], off)
                    .map_err(read_err)?;
                segment.update(&buf[..want]);
                off += want as u64;
            }
            if segment.finalize() as u32 != crc {
                break;
            }
            let mut off = at;
            while off < end {
                let want = (end - off).min(buf.len() as u64) as usize;
                file.read_exact_at(&mut buf[..want], off)
                    .map_err(read_err)?;
                writer.hash_resumed(&buf[..want]);
                off += want as u64;
            }
            kept.push((end, crc));
            at = end;
        }
        if at < have {
            tracing::warn!(
                path = %path.display(),
                verified_bytes = at,
                discarded_bytes = have - at,
                "resuming a partial download: bytes its sums do not vouch for are downloaded again"
            );
            file.set_len(at)
                .map_err(|e| StoreError::io(format!("truncating {}", path.display()), e))?;
        }
        writer.rewrite_sums(&kept)?;
        writer
            .file
            .seek(SeekFrom::Start(writer.written))
            .map_err(|e| StoreError::io(format!("seeking {}", path.display()), e))?;
        Ok(writer)
    }

    /// The blob whose bytes have the source digest `digest`, if this store verified such a blob
    /// before. Sources that vouch for a non-sha256 digest (git blob sha1 for small Hugging Face
    /// files) use it to skip files they already downloaded. An alias is written only after the
    /// blob verified, and is trusted only while the blob is present with the right size.
    pub fn lookup_alias(&self, digest: &FileDigest, size: u64) -> Option<Sha256Digest> {
        self.lookup_alias_checked(digest, size).map(|(sha, _)| sha)
    }

    /// [`Store::lookup_alias`], and whether the blob was checked by its size only when it was
    /// downloaded ([`Store::record_alias_size_only`]).
    pub fn lookup_alias_checked(
        &self,
        digest: &FileDigest,
        size: u64,
    ) -> Option<(Sha256Digest, bool)> {
        if let FileDigest::Sha256(_) = digest {
            return None;
        }
        let text = std::fs::read_to_string(self.alias_path(digest)).ok()?;
        let mut words = text.split_whitespace();
        let sha: Sha256Digest = words.next()?.parse().ok()?;
        let size_only = words.next() == Some(SIZE_ONLY);
        self.has_blob(&sha, size).then_some((sha, size_only))
    }

    /// [`Store::record_alias`] of a blob that was checked by its size only.
    pub fn record_alias_size_only(
        &self,
        digest: &FileDigest,
        sha256: &Sha256Digest,
    ) -> Result<(), StoreError> {
        self.write_alias(digest, &format!("{} {SIZE_ONLY}", sha256.to_hex()))
    }

    /// Records that the blob `sha256` has the source digest `digest` (see [`Store::lookup_alias`]).
    /// Not fsynced: a lost or torn alias only costs a download.
    pub fn record_alias(
        &self,
        digest: &FileDigest,
        sha256: &Sha256Digest,
    ) -> Result<(), StoreError> {
        self.write_alias(digest, &sha256.to_hex())
    }

    fn write_alias(&self, digest: &FileDigest, text: &str) -> Result<(), StoreError> {
        if let FileDigest::Sha256(_) = digest {
            return Ok(());
        }
        let path = self.alias_path(digest);
        let dir = self.root.join("aliases");
        fsutil::create_dirs(&dir)
            .map_err(|e| StoreError::io(format!("creating {}", dir.display()), e))?;
        fsutil::write_new(&path, text.as_bytes(), 0o644)
            .map_err(|e| StoreError::io(format!("writing {}", path.display()), e))
    }

    fn alias_path(&self, digest: &FileDigest) -> PathBuf {
        let name = match digest {
            FileDigest::Sha256(d) => format!("sha256-{}", hex::encode(d)),
            FileDigest::GitSha1(d) => format!("gitsha1-{}", hex::encode(d)),
            FileDigest::Object { identity, .. } => format!("object-{}", hex::encode(identity)),
        };
        self.root.join("aliases").join(name)
    }

    /// Bytes already present in the partial file of `digest` (0 if none).
    pub fn partial_len(&self, digest: &FileDigest) -> u64 {
        std::fs::metadata(self.partial_path(digest))
            .map(|m| m.len())
            .unwrap_or(0)
    }

    /// Makes a batch of staged blobs durable and visible, in the order that keeps the store's
    /// promise (a name in `blobs/` is verified bytes that are on disk): one `syncfs` of the
    /// store's filesystem writes the bytes of every staged blob (one journal commit instead of
    /// one per file), then each is renamed into `blobs/`, then one fsync of `blobs/` makes the
    /// renames durable. A crash before the end leaves staged files in `tmp/` (written again by
    /// the next import, or swept as abandoned partials) and possibly some renamed blobs whose
    /// bytes were synced before their rename; never a name in `blobs/` for unsynced bytes.
    ///
    /// `syncfs` also writes whatever else is dirty on that filesystem; on a disk busy with a
    /// large download a batch waits for those pages too (they are written soon anyway).
    pub fn publish(&self, staged: Vec<StagedBlob>) -> Result<(), StoreError> {
        if staged.is_empty() {
            return Ok(());
        }
        let sync_err = |e: io::Error| StoreError::io(format!("syncing {}", self.root.display()), e);
        let root = File::open(&self.root).map_err(sync_err)?;
        let started = std::time::SystemTime::now();
        rustix::fs::syncfs(&root).map_err(|e| sync_err(e.into()))?;
        fsutil::log_syncfs(started);
        for blob in &staged {
            self.rename_into_blobs(blob)?;
        }
        self.sync()
    }

    fn rename_into_blobs(&self, staged: &StagedBlob) -> Result<(), StoreError> {
        let final_path = self.blob_path(&staged.sha256);
        std::fs::rename(&staged.tmp, &final_path)
            .map_err(|e| StoreError::io(format!("publishing {}", final_path.display()), e))
    }

    /// Makes renames into `blobs/` durable. Call once after a batch of commits, before a record
    /// points at the new blobs.
    pub fn sync(&self) -> Result<(), StoreError> {
        fsutil::sync_dir(&self.root.join("blobs"))
            .map_err(|e| StoreError::io(format!("syncing {}", self.root.display()), e))
    }

    /// Names (sha256) of the blobs present.
    pub fn blob_names(&self) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(self.root.join("blobs"))? {
            if let Some(n) = entry?.file_name().to_str() {
                out.push(n.to_string());
            }
        }
        Ok(out)
    }

    pub fn disk_usage(&self) -> u64 {
        fsutil::disk_usage(&self.root)
    }
}

impl Store {
    /// Imports an existing file (one an old agent left under the models root) as a blob
    /// without copying it: a hard link into `tmp/`, the inode taken over (its write bits
    /// removed), then the bytes of that inode are verified against `expected`, then renamed
    /// into `blobs/`. Linking before verifying means the inode that was verified is the one
    /// that enters the store; the inode's size and modification times are compared before and
    /// after hashing, so a write during the check rejects the file.
    ///
    /// Only an inode that nobody but root could ever have opened for writing is linked: owned
    /// by root and writable by neither its group nor others (a POSIX ACL granting write shows
    /// in the group bits). Its owner write bit is then taken away too, and the result checked
    /// again before the hash (owner root, no write bit at all): from then on no name of the
    /// inode lets anyone but root write it, and nobody but root could hold a descriptor open
    /// for writing from before (permissions are checked at open). Any other file (a user's, a
    /// group-writable one) is copied: its owner, through any hard link they kept or any
    /// descriptor they hold open, can change it at any time, and a linked blob would change
    /// with it under the mount. Across filesystems (`EXDEV`) the bytes are copied too, and
    /// verified like a download. Returns the blob and whether it was hard-linked (`false`:
    /// copied). The source file's bytes, name and place are never changed; a linked one loses
    /// its write bits (its mode is the one change adoption makes to the old tree).
    pub fn import_file(
        &self,
        file: &File,
        expected: FileDigest,
        size: u64,
        cancel: &AtomicBool,
    ) -> Result<(Sha256Digest, bool), StoreError> {
        let stat_err = |e| StoreError::io("stat of an adopted file", e);
        let linkable = only_root_writes(&file.metadata().map_err(stat_err)?);
        let tmp = if linkable {
            self.link_open_file(file, format!("adopt-{}", expected.file_stem()))?
        } else {
            None
        };
        let Some(tmp) = tmp else {
            let sha = self.copy_in(file, expected, size, cancel)?;
            return Ok((sha, false));
        };
        let mode = file.metadata().map_err(stat_err)?.mode();
        let verified = (|| {
            take_over(file)?;
            // Taken after the link and the mode change, which change the inode's ctime.
            let before = file.metadata().map_err(stat_err)?;
            if !only_root_writes(&before) || before.mode() & 0o222 != 0 {
                return Err(StoreError::io(
                    "adopting a file",
                    io::Error::other("its owner or mode changed while it was taken over"),
                ));
            }
            let sha = verify_file(file, &expected, size, cancel, &mut Vec::new())?;
            let after = file.metadata().map_err(stat_err)?;
            // Size and mtime, not ctime: ctime also moves when another model adopts the same
            // old file at the same time (links, renames of its links), which is no change of
            // the bytes. A writer moves mtime; one that resets it afterwards is out of scope
            // (see `modelfs_agent::adopt`).
            let stamp = |m: &std::fs::Metadata| (m.len(), m.mtime(), m.mtime_nsec());
            let changed = stamp(&before) != stamp(&after);
            if changed {
                return Err(StoreError::io(
                    "adopting a file",
                    io::Error::other("the file changed while it was being verified"),
                ));
            }
            file.sync_all()
                .map_err(|e| StoreError::io(format!("syncing {}", tmp.display()), e))?;
            Ok(sha)
        })();
        let sha = match verified {
            Ok(sha) => sha,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                // Not adopted: the old file keeps the mode it had.
                let _ = rustix::fs::fchmod(file, Mode::from_raw_mode(mode & 0o7777));
                return Err(e);
            }
        };
        let final_path = self.blob_path(&sha);
        std::fs::rename(&tmp, &final_path)
            .map_err(|e| StoreError::io(format!("publishing {}", final_path.display()), e))?;
        self.record_alias(&expected, &sha)?;
        Ok((sha, true))
    }

    /// Stages `file` (open for reading, a `local://` source file that may be linked, see
    /// `modelfs_agent::source::local`) as a blob without copying it: a hard link into `tmp/`, then the
    /// bytes of the linked inode are verified against `expected` with its size and
    /// modification time unchanged over the check, as [`Store::import_file`] does. Returns
    /// `None` when the file is on another filesystem (`EXDEV`: copy it instead). Nothing is
    /// synced: [`Store::publish`] does that for the batch. `buf` is the read buffer.
    pub fn stage_link(
        &self,
        file: &File,
        expected: FileDigest,
        size: u64,
        cancel: &AtomicBool,
        buf: &mut Vec<u8>,
    ) -> Result<Option<StagedBlob>, StoreError> {
        // The caller links only root's read-only files; a file anyone else may write is never
        // linked, whatever the caller decided (see `import_file`).
        let stat = file
            .metadata()
            .map_err(|e| StoreError::io("stat of a linked file", e))?;
        if !only_root_writes(&stat) || stat.mode() & 0o222 != 0 {
            return Ok(None);
        }
        let Some(tmp) = self.link_open_file(file, format!("link-{}", expected.file_stem()))? else {
            return Ok(None);
        };
        let verified = (|| {
            let stat_err = |e| StoreError::io("stat of a linked file", e);
            let stamp = |m: &std::fs::Metadata| (m.len(), m.mtime(), m.mtime_nsec());
            let before = file.metadata().map_err(stat_err)?;
            let sha = verify_file(file, &expected, size, cancel, buf)?;
            let after = file.metadata().map_err(stat_err)?;
            if stamp(&before) != stamp(&after) {
                return Err(StoreError::SizeMismatch {
                    expected: size,
                    actual: after.len(),
                });
            }
            Ok(sha)
        })();
        match verified {
            Ok(sha256) => Ok(Some(StagedBlob { tmp, sha256, size })),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Copies `file` into the store through a [`BlobWriter`] (verified on commit).
    fn copy_in(
        &self,
        file: &File,
        expected: FileDigest,
        size: u64,
        cancel: &AtomicBool,
    ) -> Result<Sha256Digest, StoreError> {
        let mut writer = self.writer(expected, size)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut offset = 0u64;
        loop {
            if cancel.load(Ordering::Relaxed) {
                writer.discard();
                return Err(cancelled());
            }
            let n = match file.read_at(&mut buf, offset) {
                Ok(n) => n,
                Err(e) => {
                    writer.discard();
                    return Err(StoreError::io("reading an adopted file", e));
                }
            };
            if n == 0 {
                break;
            }
            if let Err(e) = writer.write_all(&buf[..n]) {
                writer.discard();
                return Err(e);
            }
            offset += n as u64;
        }
        let sha = writer.commit()?;
        self.record_alias(&expected, &sha)?;
        Ok(sha)
    }
}

/// Whether only root can write the file: owned by root, writable by neither its group nor
/// others. The rule a blob must meet to be served (`check_servable`) and an old file to be
/// linked rather than copied.
fn only_root_writes(m: &std::fs::Metadata) -> bool {
    m.uid() == 0 && m.mode() & 0o022 == 0
}

/// Takes the write bits of an adopted inode away (it is root's already): every name it has,
/// the old agent's path included, is read-only from now on. Mode 0444 and no set-id bits.
fn take_over(file: &File) -> Result<(), StoreError> {
    rustix::fs::fchmod(file, Mode::from_raw_mode(0o444))
        .map_err(|e| StoreError::io("taking an adopted file over (chmod 0444)", e.into()))
}

fn cancelled() -> StoreError {
    StoreError::io(
        "adopting a file",
        io::Error::from(io::ErrorKind::Interrupted),
    )
}

/// The rules of [`Store::open_blob`] on the `fstat` of what was opened.
fn check_servable(stat: &rustix::fs::Stat, size: u64) -> Result<(), BlobRefused> {
    match FileType::from_raw_mode(stat.st_mode) {
        FileType::RegularFile => {}
        FileType::Symlink => return Err(BlobRefused::Link),
        _ => return Err(BlobRefused::NotRegular),
    }
    if stat.st_size as u64 != size {
        return Err(BlobRefused::WrongSize);
    }
    if stat.st_uid != 0 && stat.st_uid != rustix::process::geteuid().as_raw() {
        return Err(BlobRefused::NotOwned);
    }
    if stat.st_mode & 0o022 != 0 {
        return Err(BlobRefused::Writable);
    }
    Ok(())
}

/// Hashes `file` from its start and checks it has exactly `size` bytes with digest `expected`
/// (sha256, or git blob sha1 over `"blob <size>\0"` and the bytes). Returns its sha256.
/// `buf` is grown as needed up to 1 MiB (a small file needs no large buffer).
fn verify_file(
    file: &File,
    expected: &FileDigest,
    size: u64,
    cancel: &AtomicBool,
    buf: &mut Vec<u8>,
) -> Result<Sha256Digest, StoreError> {
    let mut sha256 = Sha256::new();
    let mut git_sha1 = match expected {
        FileDigest::GitSha1(_) => {
            let mut h = Sha1::new();
            h.update(format!("blob {size}\0").as_bytes());
            Some(h)
        }
        FileDigest::Sha256(_) | FileDigest::Object { .. } => None,
    };
    let mut md5 = object_md5(expected);
    // One byte more than expected, so that a file that grew is seen without another read.
    let want = (size.saturating_add(1)).min(1 << 20) as usize;
    if buf.len() < want {
        buf.resize(want, 0);
    }
    let mut offset = 0u64;
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(cancelled());
        }
        let n = file
            .read_at(buf, offset)
            .map_err(|e| StoreError::io("reading an adopted file", e))?;
        if n == 0 {
            break;
        }
        sha256.update(&buf[..n]);
        if let Some(h) = &mut git_sha1 {
            h.update(&buf[..n]);
        }
        if let Some(h) = &mut md5 {
            h.update(&buf[..n]);
        }
        offset += n as u64;
        // A short read of a regular file is its end: no further read to see 0.
        if offset > size || (offset == size && n < buf.len()) {
            break;
        }
    }
    if offset != size {
        return Err(StoreError::SizeMismatch {
            expected: size,
            actual: offset,
        });
    }
    let sha = Sha256Digest(sha256.finalize().into());
    let (ok, actual) = match (expected, git_sha1) {
        (FileDigest::Sha256(want), _) => (*want == sha.0, FileDigest::Sha256(sha.0)),
        (FileDigest::GitSha1(want), Some(h)) => {
            let got: [u8; 20] = h.finalize().into();
            (*want == got, FileDigest::GitSha1(got))
        }
        (FileDigest::GitSha1(_), None) => unreachable!("a git digest always has its hasher"),
        (FileDigest::Object { .. }, _) => object_md5_matches(expected, md5),
    };
    if !ok {
        return Err(StoreError::DigestMismatch {
            expected: expected.to_string(),
            actual: actual.to_string(),
        });
    }
    Ok(sha)
}

/// The MD5 hasher of an object whose store published the MD5 of its bytes.
fn object_md5(expected: &FileDigest) -> Option<Md5> {
    match expected {
        FileDigest::Object { md5: Some(_), .. } => Some(Md5::new()),
        _ => None,
    }
}

/// Whether the bytes hashed into `md5` match the object digest `expected` (one without an MD5
/// matches any bytes of the right size, which the caller checked), and the digest they have.
fn object_md5_matches(expected: &FileDigest, md5: Option<Md5>) -> (bool, FileDigest) {
    let FileDigest::Object {
        identity,
        md5: want,
    } = *expected
    else {
        unreachable!("only object digests carry an MD5")
    };
    let got: Option<[u8; 16]> = md5.map(|h| h.finalize().into());
    let ok = match (want, got) {
        (Some(want), Some(got)) => want == got,
        (None, _) => true,
        (Some(_), None) => false,
    };
    (ok, FileDigest::Object { identity, md5: got })
}

/// The resume sums beside the partial file `part` (see the module docs).
fn sums_path(part: &Path) -> PathBuf {
    let mut name = part.as_os_str().to_owned();
    name.push(".sums");
    PathBuf::from(name)
}

/// The segments recorded in a sums file, `(end offset, crc32c)` in order; parsing stops at
/// the first malformed line (a torn last append).
fn read_sums(path: &Path) -> Vec<(u64, u32)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut out = Vec::new();
    for line in text.split_inclusive('\n') {
        let Some(line) = line.strip_suffix('\n') else {
            break;
        };
        let parsed = line.split_once(' ').and_then(|(end, crc)| {
            Some((end.parse::<u64>().ok()?, u32::from_str_radix(crc, 16).ok()?))
        });
        match parsed {
            Some(entry) => out.push(entry),
            None => break,
        }
    }
    out
}

/// Largest write [`BlobWriter`] hands the kernel at once. Copying into the page cache cost about
/// five times the CPU per byte in 8 MiB writes as in 256 KiB ones (ext4, 2 GiB from the same
/// buffers; 64 KiB writes cost twice as much as 256 KiB in system calls): a piece of this size
/// is still in the CPU's cache while the kernel copies it and while it is hashed. See
/// `BENCHMARKS.md`, "Object-store download (S3)".
pub const WRITE_PIECE: usize = 256 << 10;

/// Most buffers gathered into one `writev` (Linux refuses more than 1,024).
const MAX_WRITE_PARTS: usize = 512;

/// Streams one blob into `tmp/`, hashing as it goes; [`BlobWriter::commit`] verifies size and
/// digest and only then renames the file into `blobs/`.
pub struct BlobWriter {
    store: Store,
    path: PathBuf,
    file: File,
    expected: FileDigest,
    size: u64,
    written: u64,
    sha256: Sha256,
    git_sha1: Option<Sha1>,
    md5: Option<Md5>,
    check: Option<Box<dyn ContentCheck>>,
    /// The resume sums: appended to as segments complete.
    sums: Option<File>,
    /// CRC of the bytes written since the last recorded segment, and their count.
    segment: crc_fast::Digest,
    segment_len: u64,
}

impl BlobWriter {
    fn new(
        store: Store,
        path: PathBuf,
        file: File,
        expected: FileDigest,
        size: u64,
        check: Option<Box<dyn ContentCheck>>,
    ) -> Self {
        let git_sha1 = match expected {
            FileDigest::GitSha1(_) => {
                let mut h = Sha1::new();
                h.update(format!("blob {size}\0").as_bytes());
                Some(h)
            }
            FileDigest::Sha256(_) | FileDigest::Object { .. } => None,
        };
        Self {
            store,
            path,
            file,
            expected,
            size,
            written: 0,
            sha256: Sha256::new(),
            git_sha1,
            md5: object_md5(&expected),
            check,
            sums: None,
            segment: segment_crc(),
            segment_len: 0,
        }
    }

    /// Bytes of a resumed prefix (already verified by their segment CRC).
    fn hash_resumed(&mut self, buf: &[u8]) {
        self.sha256.update(buf);
        if let Some(h) = &mut self.git_sha1 {
            h.update(buf);
        }
        if let Some(h) = &mut self.md5 {
            h.update(buf);
        }
        if let Some(c) = &mut self.check {
            c.update(buf);
        }
        self.written += buf.len() as u64;
    }

    /// Bytes just written.
    fn hash(&mut self, buf: &[u8]) {
        self.hash_resumed(buf);
        self.segment.update(buf);
        self.segment_len += buf.len() as u64;
    }

    /// Replaces the resume sums with `kept` (the segments of the prefix on disk) and opens
    /// them for appending.
    fn rewrite_sums(&mut self, kept: &[(u64, u32)]) -> Result<(), StoreError> {
        let path = sums_path(&self.path);
        let text: String = kept
            .iter()
            .map(|(end, crc)| format!("{end} {crc:08x}\n"))
            .collect();
        let err = |e| StoreError::io(format!("writing {}", path.display()), e);
        std::fs::write(&path, text).map_err(err)?;
        self.sums = Some(OpenOptions::new().append(true).open(&path).map_err(err)?);
        Ok(())
    }

    /// Records the bytes written since the last record, however few, so that a later resume
    /// keeps them: for a download that stops without a crash (an attempt that failed, a
    /// cancelled fetch) and leaves its partial file.
    pub fn checkpoint(&mut self) -> Result<(), StoreError> {
        self.record(0)
    }

    /// Records the segment written since the last record once it is long enough. Not
    /// synced: a record whose bytes did not reach the disk fails its CRC on resume.
    fn record_segment(&mut self) -> Result<(), StoreError> {
        self.record(SEGMENT)
    }

    fn record(&mut self, at_least: u64) -> Result<(), StoreError> {
        if self.segment_len < at_least.max(1) {
            return Ok(());
        }
        let crc = self.segment.finalize_reset() as u32;
        self.segment_len = 0;
        let path = sums_path(&self.path);
        let err = |e| StoreError::io(format!("writing {}", path.display()), e);
        let sums = match &mut self.sums {
            Some(f) => f,
            None => self.sums.insert(
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .map_err(err)?,
            ),
        };
        let line = format!("{} {crc:08x}\n", self.written);
        sums.write_all(line.as_bytes()).map_err(err)
    }

    pub fn written(&self) -> u64 {
        self.written
    }

    pub fn expected_size(&self) -> u64 {
        self.size
    }

    pub fn write_all(&mut self, buf: &[u8]) -> Result<(), StoreError> {
        self.write_parts(&[buf])
    }

    /// Writes `parts` in order, as if they were one buffer: gathered into writes of at most
    /// [`WRITE_PIECE`] bytes (one `writev` of several small parts, a large part in slices),
    /// each hashed right after it is written, while its bytes are still in the CPU's cache.
    /// A download hands over the network's buffers as they came, without first copying them
    /// into one.
    pub fn write_parts(&mut self, parts: &[&[u8]]) -> Result<(), StoreError> {
        let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
        if self.written + total > self.size {
            return Err(StoreError::SizeMismatch {
                expected: self.size,
                actual: self.written + total,
            });
        }
        let mut batch: Vec<&[u8]> = Vec::new();
        let mut batch_len = 0;
        for part in parts {
            for piece in part.chunks(WRITE_PIECE) {
                if batch_len + piece.len() > WRITE_PIECE || batch.len() == MAX_WRITE_PARTS {
                    self.write_batch(&batch)?;
                    batch.clear();
                    batch_len = 0;
                }
                batch.push(piece);
                batch_len += piece.len();
            }
        }
        if !batch.is_empty() {
            self.write_batch(&batch)?;
        }
        self.record_segment()
    }

    fn write_batch(&mut self, batch: &[&[u8]]) -> Result<(), StoreError> {
        let err = |e| StoreError::io(format!("writing {}", self.path.display()), e);
        let mut slices: Vec<IoSlice<'_>> = batch.iter().map(|b| IoSlice::new(b)).collect();
        let mut rest = &mut slices[..];
        while !rest.is_empty() {
            match self.file.write_vectored(rest) {
                Ok(0) => return Err(err(io::ErrorKind::WriteZero.into())),
                Ok(n) => IoSlice::advance_slices(&mut rest, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(err(e)),
            }
        }
        for piece in batch {
            self.hash(piece);
        }
        Ok(())
    }

    /// Discards the partial file (after a digest mismatch the bytes are worthless).
    pub fn discard(self) {
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_file(sums_path(&self.path));
    }

    /// Verifies and publishes the blob. On a mismatch the partial file is removed, so a retry
    /// starts from scratch instead of resuming corrupt bytes.
    pub fn commit(self) -> Result<Sha256Digest, StoreError> {
        let (store, file, staged) = self.finish()?;
        file.sync_all()
            .map_err(|e| StoreError::io(format!("syncing {}", staged.tmp.display()), e))?;
        store.rename_into_blobs(&staged)?;
        Ok(staged.sha256)
    }

    /// Verifies the blob but leaves it in `tmp/`, neither synced nor published: a batch of
    /// staged blobs becomes durable and visible together through [`Store::publish`].
    pub fn stage(self) -> Result<StagedBlob, StoreError> {
        self.finish().map(|(_, _, staged)| staged)
    }

    fn finish(mut self) -> Result<(Store, File, StagedBlob), StoreError> {
        if self.written != self.size {
            let err = StoreError::SizeMismatch {
                expected: self.size,
                actual: self.written,
            };
            self.discard();
            return Err(err);
        }
        let sha256 = Sha256Digest(self.sha256.clone().finalize().into());
        let ok = match (&self.expected, &self.git_sha1) {
            (FileDigest::Sha256(want), _) => *want == sha256.0,
            (FileDigest::GitSha1(want), Some(h)) => {
                let got: [u8; 20] = h.clone().finalize().into();
                *want == got
            }
            (FileDigest::GitSha1(_), None) => false,
            (FileDigest::Object { .. }, _) => {
                object_md5_matches(&self.expected, self.md5.clone()).0
            }
        };
        let published = match (&mut self.check, ok) {
            (Some(check), true) => check.finish().err(),
            _ => None,
        };
        if let Some((expected, actual)) = published {
            let err = StoreError::DigestMismatch { expected, actual };
            self.discard();
            return Err(err);
        }
        if !ok {
            let actual = match (&self.git_sha1, &self.md5) {
                (Some(h), _) => FileDigest::GitSha1(h.clone().finalize().into()).to_string(),
                (None, Some(_)) => object_md5_matches(&self.expected, self.md5.clone())
                    .1
                    .to_string(),
                (None, None) => FileDigest::Sha256(sha256.0).to_string(),
            };
            let err = StoreError::DigestMismatch {
                expected: self.expected.to_string(),
                actual,
            };
            self.discard();
            return Err(err);
        }
        // A blob is read-only for everyone, whatever the umask was: the mount server serves
        // only blobs nobody but root can write (`Store::open_blob`).
        if let Err(e) = rustix::fs::fchmod(&self.file, Mode::from_raw_mode(0o444)) {
            let err = StoreError::io(format!("chmod {}", self.path.display()), e.into());
            self.discard();
            return Err(err);
        }
        drop(self.sums.take());
        let _ = std::fs::remove_file(sums_path(&self.path));
        let staged = StagedBlob {
            tmp: self.path,
            sha256,
            size: self.size,
        };
        Ok((self.store, self.file, staged))
    }
}

/// A verified blob still in `tmp/`: its bytes are not known to be on disk yet and its name in
/// `blobs/` does not exist yet (see [`Store::publish`]).
#[derive(Debug)]
pub struct StagedBlob {
    tmp: PathBuf,
    sha256: Sha256Digest,
    size: u64,
}

impl StagedBlob {
    pub fn sha256(&self) -> Sha256Digest {
        self.sha256
    }

    pub fn size(&self) -> u64 {
        self.size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    use crate::artifact::git_blob_sha1 as git_sha1;

    /// The rules the mount server serves blobs by (`Store::open_blob`), on an anchored state
    /// directory: links on the path (the blob, `blobs/`, the store's directory) are refused and
    /// not followed, a FIFO is refused without blocking, a blob of the wrong size or one a
    /// user could write is refused, and no refusal tells anything about what a link led to.
    #[test]
    fn served_blobs_are_regular_root_files_reached_without_links() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let state = super::super::StateDir::open(dir.path()).unwrap();
        let id = super::super::StoreId::from_seq(1);
        let writer_side = state.store(&id).unwrap();
        let data = b"the served bytes";
        let sha = Sha256Digest::of(data);
        let size = data.len() as u64;
        let mut w = writer_side.writer(FileDigest::Sha256(sha.0), size).unwrap();
        w.write_all(data).unwrap();
        w.commit().unwrap();
        let blob = writer_side.blob_path(&sha);
        assert_eq!(
            std::fs::metadata(&blob).unwrap().permissions().mode() & 0o7777,
            0o444,
            "a published blob is read-only for everyone"
        );
        let served = state.clone().anchored().unwrap();
        let store = served.store_unchecked(&id);
        let mut read = String::new();
        store
            .open_blob(&sha, size)
            .unwrap()
            .read_to_string(&mut read)
            .unwrap();
        assert_eq!(read.as_bytes(), data);

        // A root-only file elsewhere, of another size: never opened, its size never told.
        let secret = dir.path().join("secret");
        std::fs::write(&secret, vec![b's'; 987_654]).unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        let refused = |want: &str| {
            let err = store.open_blob(&sha, size).unwrap_err();
            let text = err.to_string();
            assert!(text.contains(want), "{text}");
            assert!(!text.contains("987"), "{text}");
            assert!(!store.has_blob(&sha, size));
            assert!(store.check_blob(&sha, size).is_err());
        };
        let moved = dir.path().join("moved");
        std::fs::rename(&blob, &moved).unwrap();
        std::os::unix::fs::symlink(&secret, &blob).unwrap();
        refused("symbolic link");
        std::fs::remove_file(&blob).unwrap();

        rustix::fs::mkfifoat(rustix::fs::CWD, &blob, Mode::from_raw_mode(0o644)).unwrap();
        let started = std::time::Instant::now();
        refused("not a regular file");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        std::fs::remove_file(&blob).unwrap();

        std::fs::write(&blob, b"short").unwrap();
        std::fs::set_permissions(&blob, std::fs::Permissions::from_mode(0o444)).unwrap();
        refused("size");
        std::fs::remove_file(&blob).unwrap();

        std::fs::rename(&moved, &blob).unwrap();
        for (mode, want) in [(0o664, "writable"), (0o646, "writable")] {
            std::fs::set_permissions(&blob, std::fs::Permissions::from_mode(mode)).unwrap();
            refused(want);
        }
        std::fs::set_permissions(&blob, std::fs::Permissions::from_mode(0o644)).unwrap();
        store.open_blob(&sha, size).unwrap();
        rustix::fs::chown(&blob, Some(rustix::process::Uid::from_raw(65534)), None).unwrap();
        refused("not owned by root");
        rustix::fs::chown(&blob, Some(rustix::process::Uid::from_raw(0)), None).unwrap();
        store.open_blob(&sha, size).unwrap();

        // Links above the blob: `blobs/`, then the store's own directory.
        let stores = dir.path().join("stores");
        let real_blobs = dir.path().join("real-blobs");
        std::fs::rename(stores.join("s00000001/blobs"), &real_blobs).unwrap();
        std::os::unix::fs::symlink(&real_blobs, stores.join("s00000001/blobs")).unwrap();
        refused("symbolic link");
        std::fs::remove_file(stores.join("s00000001/blobs")).unwrap();
        std::fs::rename(&real_blobs, stores.join("s00000001/blobs")).unwrap();
        let real_store = dir.path().join("real-store");
        std::fs::rename(stores.join("s00000001"), &real_store).unwrap();
        std::os::unix::fs::symlink(&real_store, stores.join("s00000001")).unwrap();
        refused("symbolic link");
        assert!(
            served.existing_store(&id).is_none(),
            "a linked store directory is no store"
        );
        // The same store reached by its own path trusts that path (the agent's own view).
        assert!(Store::at(stores.join("s00000001"))
            .open_blob(&sha, size)
            .is_ok());

        // `stores/` itself a link: the anchored state directory is refused.
        std::fs::remove_file(stores.join("s00000001")).unwrap();
        std::fs::rename(&stores, dir.path().join("real-stores")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("real-stores"), &stores).unwrap();
        assert!(state.anchored().is_err());
    }

    #[test]
    fn objects_are_checked_by_their_md5_when_the_store_gives_one() {
        use md5::{Digest as _, Md5};
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("s")).unwrap();
        let data = b"object bytes";
        let md5: [u8; 16] = Md5::digest(data).into();
        let object = |md5| FileDigest::Object {
            identity: [7; 32],
            md5,
        };
        let mut w = store
            .writer(object(Some([0; 16])), data.len() as u64)
            .unwrap();
        w.write_all(data).unwrap();
        let err = w.commit().unwrap_err();
        assert!(matches!(err, StoreError::DigestMismatch { .. }), "{err}");
        assert!(err.to_string().contains(&hex::encode(md5)), "{err}");
        assert!(!store.has_blob(&Sha256Digest::of(data), data.len() as u64));

        // Resumed: the prefix on disk is hashed again.
        let mut w = store.writer(object(Some(md5)), data.len() as u64).unwrap();
        w.write_all(&data[..5]).unwrap();
        w.checkpoint().unwrap();
        drop(w);
        let mut w = store
            .resume_writer(object(Some(md5)), data.len() as u64)
            .unwrap();
        assert_eq!(w.written(), 5);
        w.write_all(&data[5..]).unwrap();
        assert_eq!(w.commit().unwrap(), Sha256Digest::of(data));

        // No MD5 published: the size is all there is to check.
        let mut w = store.writer(object(None), data.len() as u64).unwrap();
        w.write_all(&data[..4]).unwrap();
        assert!(matches!(w.commit(), Err(StoreError::SizeMismatch { .. })));
    }

    #[test]
    fn parts_are_written_in_order_in_pieces_of_any_size() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("s")).unwrap();
        // Larger than a write piece, thousands of tiny parts (more than one writev takes),
        // empty parts, and parts that straddle piece boundaries.
        let data: Vec<u8> = (0..3 * WRITE_PIECE + 12_345)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let mut parts: Vec<&[u8]> = Vec::new();
        let (big, rest) = data.split_at(WRITE_PIECE + 7);
        parts.push(big);
        parts.push(&[]);
        let (tiny, rest) = rest.split_at(3_000);
        parts.extend(tiny.chunks(1));
        let (mid, rest) = rest.split_at(WRITE_PIECE / 2 + 1);
        parts.extend(mid.chunks(1000));
        parts.push(rest);
        let want = Sha256Digest::of(&data);
        let mut w = store
            .writer(FileDigest::Sha256(want.0), data.len() as u64)
            .unwrap();
        w.write_parts(&parts[..2000]).unwrap();
        w.write_parts(&parts[2000..]).unwrap();
        assert_eq!(w.written(), data.len() as u64);
        assert_eq!(w.commit().unwrap(), want);
        assert_eq!(std::fs::read(store.blob_path(&want)).unwrap(), data);

        // Too many bytes in total: refused before any is written.
        let mut w = store
            .writer(FileDigest::Sha256(want.0), data.len() as u64)
            .unwrap();
        let err = w.write_parts(&[&data, b"x"]).unwrap_err();
        assert!(matches!(err, StoreError::SizeMismatch { .. }), "{err}");
        assert_eq!(w.written(), 0);
    }

    #[test]
    fn verified_blob_is_published_and_wrong_bytes_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("s")).unwrap();
        let data = b"hello world";
        let want = Sha256Digest::of(data);

        let mut w = store
            .writer(FileDigest::Sha256(want.0), data.len() as u64)
            .unwrap();
        w.write_all(data).unwrap();
        assert_eq!(w.commit().unwrap(), want);
        assert!(store.has_blob(&want, data.len() as u64));

        let mut w = store
            .writer(FileDigest::Sha256([7; 32]), data.len() as u64)
            .unwrap();
        w.write_all(data).unwrap();
        assert!(matches!(w.commit(), Err(StoreError::DigestMismatch { .. })));
        assert!(!store.partial_path(&FileDigest::Sha256([7; 32])).exists());

        let mut w = store
            .writer(FileDigest::GitSha1(git_sha1(data)), data.len() as u64)
            .unwrap();
        w.write_all(data).unwrap();
        assert_eq!(w.commit().unwrap(), want);

        let mut w = store.writer(FileDigest::Sha256(want.0), 3).unwrap();
        assert!(matches!(
            w.write_all(data),
            Err(StoreError::SizeMismatch { .. })
        ));
    }

    /// A resumed download keeps only the prefix its sums vouch for: a segment whose bytes
    /// changed on disk and everything after it, and bytes written after the last record, are
    /// cut off and written again, so an object checked by its size only still ends with the
    /// right bytes. A partial file without sums starts over.
    #[test]
    fn resume_keeps_only_the_prefix_its_sums_vouch_for() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("s")).unwrap();
        let data: Vec<u8> = (0..(10u32 << 20) + 77).map(|i| (i % 253) as u8).collect();
        let size = data.len() as u64;
        // Size only: nothing but the sums can tell damaged bytes.
        let digest = FileDigest::Object {
            identity: [3; 32],
            md5: None,
        };
        let write_partial = |upto: usize| {
            let mut w = store.writer(digest, size).unwrap();
            for part in data[..upto].chunks(1 << 20) {
                w.write_parts(&[part]).unwrap();
            }
            drop(w); // a crash: the partial file and its sums stay
        };
        // Nine recorded segments and half a megabyte after the last record.
        write_partial((9 << 20) + (1 << 19));
        let part = store.partial_path(&digest);
        // One byte of the second segment changes on disk.
        let f = OpenOptions::new().write(true).open(&part).unwrap();
        f.write_all_at(&[data[5 << 20] ^ 0xff], 5 << 20).unwrap();
        drop(f);
        let mut w = store.resume_writer(digest, size).unwrap();
        assert_eq!(
            w.written(),
            5 << 20,
            "the segments before the damaged one are kept"
        );
        assert_eq!(std::fs::metadata(&part).unwrap().len(), 5 << 20);
        w.write_all(&data[5 << 20..]).unwrap();
        let sha = w.commit().unwrap();
        assert_eq!(std::fs::read(store.blob_path(&sha)).unwrap(), data);
        assert!(
            !sums_path(&part).exists(),
            "a committed blob leaves no sums"
        );

        // Intact: the recorded segments are kept, the unrecorded tail is cut.
        write_partial((9 << 20) + (1 << 19));
        let w = store.resume_writer(digest, size).unwrap();
        assert_eq!(w.written(), 9 << 20);
        drop(w);
        // Without sums nothing is trusted.
        std::fs::remove_file(sums_path(&part)).unwrap();
        let w = store.resume_writer(digest, size).unwrap();
        assert_eq!(w.written(), 0);
        assert_eq!(std::fs::metadata(&part).unwrap().len(), 0);
    }

    /// A published checksum is checked on commit over every byte, the resumed prefix
    /// included.
    #[test]
    fn published_checks_see_the_resumed_prefix() {
        struct Sum {
            want: u64,
            got: u64,
        }
        impl ContentCheck for Sum {
            fn update(&mut self, bytes: &[u8]) {
                self.got += bytes.iter().map(|b| u64::from(*b)).sum::<u64>();
            }
            fn finish(&mut self) -> Result<(), (String, String)> {
                if self.got == self.want {
                    Ok(())
                } else {
                    Err((self.want.to_string(), self.got.to_string()))
                }
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("s")).unwrap();
        let data: Vec<u8> = (0..(6u32 << 20)).map(|i| (i % 251) as u8).collect();
        let want: u64 = data.iter().map(|b| u64::from(*b)).sum();
        let digest = FileDigest::Object {
            identity: [4; 32],
            md5: None,
        };
        let size = data.len() as u64;
        let check = |want| Some(Box::new(Sum { want, got: 0 }) as Box<dyn ContentCheck>);
        let mut w = store.writer_checked(digest, size, check(want)).unwrap();
        w.write_parts(&[&data[..5 << 20]]).unwrap();
        drop(w);
        let mut w = store
            .resume_writer_checked(digest, size, check(want))
            .unwrap();
        assert_eq!(w.written(), 5 << 20);
        w.write_all(&data[5 << 20..]).unwrap();
        w.commit().unwrap();

        let mut w = store.writer_checked(digest, size, check(want + 1)).unwrap();
        w.write_all(&data).unwrap();
        let err = w.commit().unwrap_err();
        assert!(matches!(err, StoreError::DigestMismatch { .. }), "{err}");
        assert!(!store.partial_path(&digest).exists());
    }

    #[test]
    fn resume_continues_where_the_partial_file_ends() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("s")).unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let digest = FileDigest::GitSha1(git_sha1(&data));
        let mut w = store.writer(digest, data.len() as u64).unwrap();
        w.write_all(&data[..123_457]).unwrap();
        w.checkpoint().unwrap();
        drop(w); // an attempt that stopped: the partial file stays
        assert_eq!(store.partial_len(&digest), 123_457);
        let mut w = store.resume_writer(digest, data.len() as u64).unwrap();
        assert_eq!(w.written(), 123_457);
        w.write_all(&data[123_457..]).unwrap();
        let sha = w.commit().unwrap();
        assert_eq!(std::fs::read(store.blob_path(&sha)).unwrap(), data);
    }
}
