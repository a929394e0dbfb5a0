//! `local://<dir>`: import a directory from the node's disk.
//!
//! The directory is read twice: `resolve` hashes every file (the artifact identity must be known
//! before deciding whether to copy at all), and `fetch` copies each missing file while hashing it
//! again and checking the result against the first pass. The source may change at any time (it
//! is an ordinary directory); a file that changes between or during the passes fails the import
//! with a transient error and is retried, so the store never holds bytes that were not verified.
//!
//! # Import speed
//! Models of many small files cost system calls and journal commits, not bytes, so:
//! * Both passes work on up to [`IMPORT_WORKERS`] files at once (scoped threads inside the one
//!   blocking task of the resolve or fetch), with at most [`MAX_EXTRA_WORKERS`] such extra
//!   threads in the whole process (hundreds of models may resolve at once).
//! * A copy is written, hashed and verified in one pass over the bytes, with one read buffer per
//!   worker sized to the file (a 50-byte file costs one `read`, no 1 MiB allocation).
//! * Verified files are staged in `tmp/` unsynced and published in batches
//!   ([`modelfs_core::store::Store::publish`]: one `syncfs`, the renames into `blobs/`, one directory
//!   fsync) of at most [`BATCH_FILES`] files or [`BATCH_BYTES`] bytes, the last batch before the
//!   fetch returns. The reconciler records an artifact (and the model `Ready`) only after the
//!   fetch returned, so a crash at any point leaves a record that points at synced blobs or no
//!   record; the crash harness (`tests/crash.rs`) checks it with a model of a power cut.
//! * Hard links instead of copies, for files that count as **immutable**: owned by root and
//!   writable by nobody (no `w` bit in the mode), on the store's filesystem. Nobody but root can
//!   write such a file or make it writable again, and root (the operator who prepared the
//!   directory) is taken at their word: a read-only file is not written in place. Tools that
//!   update files (`cp`, `rsync`, `tar`, `huggingface_hub`) write a new file and rename it over
//!   the old name, which leaves the linked inode, and the store, untouched. The linked inode is
//!   verified after the link, like a copy (size and mtime unchanged over the hash). Any other
//!   file (an ordinary `0644` file, one owned by a user) is copied: its owner may change it in
//!   place at any time, and a linked blob would change with it under the mount.
//!
//! # What may be imported
//! The mount shows every file to every user (0444 on an `allow_other` mount), and the daemon
//! runs as root, so an import must not turn a private file into a public one or reach outside
//! the directory it was given. Each entry is checked before it is read, and each is permanent
//! (`Failed` with a reason naming the file, not retried until the spec changes):
//! * Only regular files and directories. A FIFO, socket or device is refused by its `lstat`
//!   type before anything opens it (opening a device can have effects), and again by `fstat`
//!   on what was opened: every open is `O_NONBLOCK | O_NOFOLLOW`, so a FIFO swapped in after
//!   the check is seen, not waited on forever.
//! * Symlinks are followed (as copies) only while they stay inside the source tree. The tree is
//!   the directory itself (its own path may contain symlinks: the operator named it), except
//!   for a Hugging Face cache snapshot (`models--<org>--<name>/snapshots/<commit>`), a tree of
//!   symlinks into the repository's `blobs/`: there the tree is the repository's cache directory.
//!   An entry is resolved with every symlink followed (`realpath`), the result must lie below
//!   the tree, and it is then opened with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` from
//!   the tree's descriptor, so a symlink swapped in after the check fails the open (a transient
//!   "changed" error) instead of being followed out.
//! * Files must be readable by others and directories below the root readable and searchable
//!   by others. Keeping a file's restriction through the mount would need per-file modes in
//!   the artifact, whose identity is content only (two models of the same bytes share a
//!   store), so the honest choice is to refuse the model with a reason. The root directory's
//!   own mode is not checked: a 0700 staging directory is how operators prepare an import.
//! * File names must be UTF-8 (a listing is UTF-8, as the mount's names are) and pass the same
//!   checks as every listing ([`validate_relative_path`]: no control characters and so on),
//!   checked during the walk so a bad name fails before anything is hashed.
//!
//! A read can still block where the kernel blocks it (a hung network filesystem); that work runs
//! on the blocking pool, which the daemon does not wait for at shutdown (see `cli`).

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs::File;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, Stat};
use rustix::io::Errno;
use sha2::{Digest, Sha256};

use super::{FetchContext, SourceError};
use crate::metrics::SourceScheme;
use modelfs_core::artifact::{
    validate_relative_path, EntryRef, FileDigest, Manifest, ManifestEntry, Sha256Digest,
};
use modelfs_core::store::{StagedBlob, StoreError};

const CHUNK: usize = 1 << 20;

#[derive(Clone, Debug)]
pub struct LocalSource {
    root: PathBuf,
}

fn io_err(path: &Path, source: impl Into<std::io::Error>) -> SourceError {
    SourceError::LocalIo {
        path: path.display().to_string(),
        source: source.into(),
    }
}

/// What an entry is, once checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    File,
    Dir,
}

/// The opened source tree: what every entry is resolved and opened against.
struct Tree {
    /// What symlinks may lead into: `root`, or a Hugging Face cache repository directory.
    boundary: PathBuf,
    boundary_fd: OwnedFd,
    /// The directory named by the URI (the symlinks of its own path resolved) relative to
    /// `boundary` (empty when they are the same).
    root_inside: PathBuf,
    /// Whether what is read will be published through the mount (an import): only then must
    /// every entry be readable by others, and does a bad entry fail the whole listing.
    published: bool,
}

/// The directory a Hugging Face cache snapshot's symlinks point into: for
/// `.../models--org--name/snapshots/<commit>` the repository's cache directory.
fn hf_cache_repository(root: &Path) -> Option<&Path> {
    let snapshots = root.parent()?;
    let repository = snapshots.parent()?;
    let name = repository.file_name()?.to_str()?;
    let is_repository = ["models--", "datasets--", "spaces--"]
        .iter()
        .any(|prefix| name.starts_with(prefix));
    (snapshots.file_name()? == "snapshots" && is_repository).then_some(repository)
}

/// A relative path for the `*at` calls: the empty path is the directory itself.
fn at_path(inside: &Path) -> &Path {
    if inside.as_os_str().is_empty() {
        Path::new(".")
    } else {
        inside
    }
}

/// What a file that is neither a regular file nor a directory is, in words.
fn special_file_kind(file_type: FileType) -> &'static str {
    match file_type {
        FileType::Fifo => "named pipe (FIFO)",
        FileType::Socket => "socket",
        FileType::CharacterDevice => "character device",
        FileType::BlockDevice => "block device",
        FileType::Symlink => "symlink",
        _ => "file of unknown type",
    }
}

/// Checks the type and mode of an entry (not the root) against what may be published.
/// With `published` false (a read that shows nothing to other users) the mode is not checked.
fn check_entry(listed: &Path, stat: &Stat, published: bool) -> Result<Kind, SourceError> {
    let path = || listed.display().to_string();
    let mode = stat.st_mode & 0o7777;
    let (kind, needed, what, fix) = match FileType::from_raw_mode(stat.st_mode) {
        FileType::RegularFile => (Kind::File, 0o004, "file", "chmod o+r"),
        FileType::Directory => (Kind::Dir, 0o005, "directory", "chmod o+rx"),
        other => {
            return Err(SourceError::LocalSpecialFile {
                path: path(),
                kind: special_file_kind(other),
            })
        }
    };
    if published && mode & needed != needed {
        return Err(SourceError::LocalNotPublic {
            path: path(),
            what,
            mode,
            fix,
        });
    }
    Ok(kind)
}

/// Paths through which a directory is named by an open descriptor: the models root under the
/// mount is reached as `/proc/self/fd/N/...` (see [`crate::adopt`]). Such a path must not be
/// resolved as a string (`realpath` would turn it back into the mounted path): the kernel opens
/// it, and everything below is resolved relative to that descriptor.
const DESCRIPTOR_PATHS: &str = "/proc/self/fd";

/// Why an entry could not be resolved inside its tree.
#[derive(Debug)]
enum Unresolved {
    /// A symlink leads out of the tree (to this target).
    Escape(PathBuf),
    /// Too many symlinks (a loop).
    Loop,
    Io(Errno),
}

/// Symlink hops allowed while resolving one entry, as the kernel's `MAXSYMLINKS`.
const MAX_SYMLINK_HOPS: u32 = 40;

/// Resolves `rel` (relative to the directory `boundary_fd`, whose path is `boundary`) the way
/// `realpath` would, but relative to the descriptor: every component is looked up with
/// `*at` calls on `boundary_fd`, symlinks are followed by reading them, `..` never climbs above
/// the boundary, and an absolute symlink target counts only when it names a path below
/// `boundary`. Returns the symlink-free path of the entry relative to the boundary.
fn resolve_beneath(
    boundary_fd: &OwnedFd,
    boundary: &Path,
    rel: &Path,
) -> Result<PathBuf, Unresolved> {
    use std::collections::VecDeque;
    use std::ffi::OsString;
    use std::path::Component;

    fn push_components(pending: &mut VecDeque<OsString>, path: &Path) {
        for component in path.components().rev() {
            match component {
                Component::Normal(name) => pending.push_front(name.to_owned()),
                Component::ParentDir => pending.push_front(OsString::from("..")),
                Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
            }
        }
    }

    let mut pending = VecDeque::new();
    push_components(&mut pending, rel);
    let mut resolved = PathBuf::new();
    let mut hops = 0;
    while let Some(name) = pending.pop_front() {
        if name == ".." {
            // `resolved` holds no symlink, so its parent is its lexical parent.
            if !resolved.pop() {
                // Name where the link leads, lexically: the boundary's parent and what is left.
                let mut target = boundary.parent().unwrap_or(boundary).to_path_buf();
                for rest in pending {
                    if rest == ".." {
                        target.pop();
                    } else {
                        target.push(rest);
                    }
                }
                return Err(Unresolved::Escape(target));
            }
            continue;
        }
        resolved.push(&name);
        let stat = rustix::fs::statat(boundary_fd, &resolved, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(Unresolved::Io)?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::Symlink {
            continue;
        }
        hops += 1;
        if hops > MAX_SYMLINK_HOPS {
            return Err(Unresolved::Loop);
        }
        let target =
            rustix::fs::readlinkat(boundary_fd, &resolved, Vec::new()).map_err(Unresolved::Io)?;
        let target = PathBuf::from(OsStr::from_bytes(target.as_bytes()));
        resolved.pop();
        if target.is_absolute() {
            let Ok(below) = target.strip_prefix(boundary) else {
                return Err(Unresolved::Escape(target));
            };
            resolved = PathBuf::new();
            push_components(&mut pending, below);
        } else {
            push_components(&mut pending, &target);
        }
    }
    Ok(resolved)
}

impl LocalSource {
    pub fn new(root: PathBuf) -> Self {
        Self { root }
    }

    /// [`Self::open_tree`] for a root named through a descriptor (see [`DESCRIPTOR_PATHS`]):
    /// the kernel resolves the path, and the opened directory is the tree.
    fn open_tree_through_descriptor(&self) -> Result<Tree, SourceError> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NONBLOCK;
        let boundary_fd = match rustix::fs::open(&self.root, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => {
                return Err(SourceError::LocalMissing {
                    path: self.root.display().to_string(),
                })
            }
            Err(Errno::NOTDIR) => {
                return Err(SourceError::LocalNotDirectory {
                    path: self.root.display().to_string(),
                })
            }
            Err(e) => return Err(io_err(&self.root, e)),
        };
        Ok(Tree {
            boundary: self.root.clone(),
            boundary_fd,
            root_inside: PathBuf::new(),
            published: true,
        })
    }

    fn open_tree(&self) -> Result<Tree, SourceError> {
        if self.root.starts_with(DESCRIPTOR_PATHS) {
            return self.open_tree_through_descriptor();
        }
        let root = match std::fs::canonicalize(&self.root) {
            Ok(root) => root,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(SourceError::LocalMissing {
                    path: self.root.display().to_string(),
                })
            }
            Err(e) => return Err(io_err(&self.root, e)),
        };
        let stat = rustix::fs::lstat(&root).map_err(|e| io_err(&root, e))?;
        match FileType::from_raw_mode(stat.st_mode) {
            FileType::Directory => {}
            FileType::RegularFile => {
                return Err(SourceError::LocalNotDirectory {
                    path: self.root.display().to_string(),
                })
            }
            other => {
                return Err(SourceError::LocalSpecialFile {
                    path: self.root.display().to_string(),
                    kind: special_file_kind(other),
                })
            }
        }
        let boundary = hf_cache_repository(&root).unwrap_or(&root).to_path_buf();
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let boundary_fd =
            rustix::fs::open(&boundary, flags, Mode::empty()).map_err(|e| io_err(&boundary, e))?;
        let root_inside = root
            .strip_prefix(&boundary)
            .expect("the boundary is the root or one of its ancestors")
            .to_path_buf();
        Ok(Tree {
            boundary,
            boundary_fd,
            root_inside,
            published: true,
        })
    }

    /// Resolves the listed entry `rel` with every symlink followed and checks what it is;
    /// returns its path relative to the tree's boundary. A symlink leading out of the tree is
    /// refused here.
    fn inspect(&self, tree: &Tree, rel: &str) -> Result<(PathBuf, Kind), SourceError> {
        let listed = self.root.join(rel);
        let inside = match resolve_beneath(
            &tree.boundary_fd,
            &tree.boundary,
            &tree.root_inside.join(rel),
        ) {
            Ok(inside) => inside,
            Err(Unresolved::Loop) => {
                return Err(SourceError::LocalLoop {
                    path: listed.display().to_string(),
                })
            }
            Err(Unresolved::Escape(target)) => {
                return Err(SourceError::LocalSymlinkEscape {
                    path: listed.display().to_string(),
                    target: target.display().to_string(),
                    tree: tree.boundary.display().to_string(),
                })
            }
            Err(Unresolved::Io(e)) => return Err(io_err(&listed, e)),
        };
        let inside = inside.as_path();
        let stat = rustix::fs::statat(
            &tree.boundary_fd,
            at_path(inside),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| io_err(&listed, e))?;
        let kind = check_entry(&listed, &stat, tree.published)?;
        Ok((inside.to_path_buf(), kind))
    }

    /// Opens `inside` (relative to the boundary, free of symlinks when it was resolved) without
    /// following any symlink, without leaving the tree and without blocking.
    fn open_beneath(
        &self,
        tree: &Tree,
        inside: &Path,
        listed: &Path,
        kind: Kind,
    ) -> Result<OwnedFd, SourceError> {
        let mut flags =
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY;
        if kind == Kind::Dir {
            flags |= OFlags::DIRECTORY;
        }
        let resolve =
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
        let changed = || SourceError::LocalChanged {
            path: listed.display().to_string(),
        };
        let opened = rustix::fs::openat2(
            &tree.boundary_fd,
            at_path(inside),
            flags,
            Mode::empty(),
            resolve,
        );
        let fd = match opened {
            Ok(fd) => fd,
            // A symlink appeared on the path after it was resolved, or a concurrent rename
            // made the kernel refuse to vouch for the resolution.
            Err(Errno::LOOP | Errno::XDEV | Errno::AGAIN | Errno::NOTDIR) => return Err(changed()),
            // Kernels before 5.6 or a seccomp filter: only the last component is protected.
            Err(Errno::NOSYS) => {
                rustix::fs::openat(&tree.boundary_fd, at_path(inside), flags, Mode::empty())
                    .map_err(|e| match e {
                        Errno::LOOP | Errno::NOTDIR => changed(),
                        e => io_err(listed, e),
                    })?
            }
            Err(e) => return Err(io_err(listed, e)),
        };
        // What was opened, not what the path named a moment ago.
        let stat = rustix::fs::fstat(&fd).map_err(|e| io_err(listed, e))?;
        if check_entry(listed, &stat, tree.published)? != kind {
            return Err(changed());
        }
        if kind == Kind::File {
            let flags = rustix::fs::fcntl_getfl(&fd).map_err(|e| io_err(listed, e))?;
            rustix::fs::fcntl_setfl(&fd, flags - OFlags::NONBLOCK)
                .map_err(|e| io_err(listed, e))?;
        }
        Ok(fd)
    }

    /// Opens the listed regular file `rel` for reading, checked as in the module docs.
    fn open_file(&self, tree: &Tree, rel: &str) -> Result<File, SourceError> {
        let listed = self.root.join(rel);
        let (inside, kind) = self.inspect(tree, rel)?;
        if kind != Kind::File {
            return Err(SourceError::LocalChanged {
                path: listed.display().to_string(),
            });
        }
        Ok(File::from(self.open_beneath(
            tree,
            &inside,
            &listed,
            Kind::File,
        )?))
    }

    /// Size and sha256 of one file; `buf` is the read buffer, grown as needed up to
    /// [`CHUNK`] (a small file needs no large buffer).
    fn hash_file(
        &self,
        tree: &Tree,
        rel: &str,
        cancel: &AtomicBool,
        buf: &mut Vec<u8>,
    ) -> Result<(u64, Sha256Digest), SourceError> {
        let path = self.root.join(rel);
        let mut f = self.open_file(tree, rel)?;
        let size = f.metadata().map_err(|e| io_err(&path, e))?.len();
        let want = size.saturating_add(1).min(CHUNK as u64) as usize;
        if buf.len() < want {
            buf.resize(want, 0);
        }
        let mut h = Sha256::new();
        let mut total = 0u64;
        loop {
            if cancel.load(Ordering::Relaxed) {
                return Err(SourceError::Cancelled);
            }
            let n = f.read(buf).map_err(|e| io_err(&path, e))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            total += n as u64;
        }
        Ok((total, Sha256Digest(h.finalize().into())))
    }

    /// Lists the directory `dir` (open, listed as `rel` below the root) into `out`, depth
    /// first. `chain` holds the directories being walked, to detect symlink loops.
    fn walk(
        &self,
        tree: &Tree,
        rel: &str,
        dir: OwnedFd,
        chain: &mut HashSet<(u64, u64)>,
        out: &mut Vec<String>,
        cancel: &AtomicBool,
    ) -> Result<(), SourceError> {
        let listed = self.root.join(rel);
        let stat = rustix::fs::fstat(&dir).map_err(|e| io_err(&listed, e))?;
        let id = (stat.st_dev, stat.st_ino);
        if !chain.insert(id) {
            return Err(SourceError::LocalLoop {
                path: listed.display().to_string(),
            });
        }
        let mut names = Vec::new();
        for entry in rustix::fs::Dir::new(dir).map_err(|e| io_err(&listed, e))? {
            let entry = entry.map_err(|e| io_err(&listed, e))?;
            let name = entry.file_name().to_bytes();
            if name != b"." && name != b".." {
                names.push(name.to_vec());
            }
        }
        names.sort();
        let result = self.walk_names(tree, rel, &listed, names, chain, out, cancel);
        // Also after a failure a lenient walk goes on with: this directory is no longer walked.
        chain.remove(&id);
        result
    }

    /// The entries `names` of the directory listed as `rel`, for [`Self::walk`]. For a tree
    /// that is not published ([`Tree::published`]) an entry that fails a check (a symlink out
    /// of the tree, a special file, a bad name, a loop, an unreadable directory) is left out
    /// instead of failing the listing: nothing of it is shown, and the rest stays usable.
    #[allow(clippy::too_many_arguments)]
    fn walk_names(
        &self,
        tree: &Tree,
        rel: &str,
        listed: &Path,
        names: Vec<Vec<u8>>,
        chain: &mut HashSet<(u64, u64)>,
        out: &mut Vec<String>,
        cancel: &AtomicBool,
    ) -> Result<(), SourceError> {
        for name in names {
            if cancel.load(Ordering::Relaxed) {
                return Err(SourceError::Cancelled);
            }
            let entry = (|| {
                let name = String::from_utf8(name).map_err(|e| SourceError::LocalBadName {
                    path: listed
                        .join(OsStr::from_bytes(e.as_bytes()))
                        .display()
                        .to_string(),
                    why: "is not valid UTF-8",
                })?;
                let child = if rel.is_empty() {
                    name
                } else {
                    format!("{rel}/{name}")
                };
                validate_relative_path(&child)?;
                match self.inspect(tree, &child)? {
                    (_, Kind::File) => out.push(child),
                    (inside, Kind::Dir) => {
                        let child_listed = self.root.join(&child);
                        let fd = self.open_beneath(tree, &inside, &child_listed, Kind::Dir)?;
                        self.walk(tree, &child, fd, chain, out, cancel)?;
                    }
                }
                Ok(())
            })();
            match entry {
                Err(SourceError::Cancelled) => return Err(SourceError::Cancelled),
                Err(e) if tree.published => return Err(e),
                Err(e) => tracing::debug!(error = %e, "entry left out of the listing"),
                Ok(()) => {}
            }
        }
        Ok(())
    }

    /// Every regular file below the root, as listed paths.
    fn files(&self, tree: &Tree, cancel: &AtomicBool) -> Result<Vec<String>, SourceError> {
        let flags = OFlags::RDONLY
            | OFlags::DIRECTORY
            | OFlags::NOFOLLOW
            | OFlags::NONBLOCK
            | OFlags::CLOEXEC;
        let root = rustix::fs::openat(
            &tree.boundary_fd,
            at_path(&tree.root_inside),
            flags,
            Mode::empty(),
        )
        .map_err(|e| io_err(&self.root, e))?;
        let mut out = Vec::new();
        self.walk(tree, "", root, &mut HashSet::new(), &mut out, cancel)?;
        Ok(out)
    }

    /// The directory's files for reading the model's config in place (a directory outside the
    /// models root, which nothing serves): the same checks as an import keep every read inside
    /// the tree and unblocked (symlinks only inside it, no special files, `O_NOFOLLOW` opens
    /// beneath the tree's descriptor), but entries that fail them are left out rather than
    /// failing the listing, and modes are not checked since nothing is shown to other users.
    /// How much of a file is read is bounded by the parser.
    pub fn config_files(&self, cancel: &AtomicBool) -> Result<ConfigFiles, SourceError> {
        let mut tree = self.open_tree()?;
        tree.published = false;
        let files = self.files(&tree, cancel)?;
        Ok(ConfigFiles {
            source: self.clone(),
            tree,
            files: files.into_iter().collect(),
        })
    }

    /// Lists and hashes the directory. The revision of a local artifact is its manifest digest.
    pub fn resolve(&self, cancel: &AtomicBool) -> Result<Manifest, SourceError> {
        let tree = self.open_tree()?;
        let files = self.files(&tree, cancel)?;
        let hashed: Vec<Mutex<Option<(u64, Sha256Digest)>>> =
            files.iter().map(|_| Mutex::new(None)).collect();
        let stop = AtomicBool::new(false);
        let failed = Mutex::new(None);
        run_workers(files.len(), |next| {
            let mut buf = Vec::new();
            while let Some(i) = next() {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                match self.hash_file(&tree, &files[i], cancel, &mut buf) {
                    Ok(done) => *hashed[i].lock().expect("poisoned") = Some(done),
                    Err(e) => {
                        stop.store(true, Ordering::Relaxed);
                        failed.lock().expect("poisoned").get_or_insert(e);
                        return;
                    }
                }
            }
        });
        if let Some(e) = failed.into_inner().expect("poisoned") {
            return Err(e);
        }
        let mut entries = Vec::with_capacity(files.len());
        for (rel, done) in files.into_iter().zip(hashed) {
            let (size, digest) = done
                .into_inner()
                .expect("poisoned")
                .expect("every file was hashed");
            entries.push(ManifestEntry {
                path: rel,
                size,
                digest: FileDigest::Sha256(digest.0),
            });
        }
        // The id covers the entries only, so the revision is set afterwards, without a second
        // validation and copy of every entry.
        let mut manifest = Manifest::new(String::new(), entries)?;
        manifest.revision = manifest.id().to_string();
        Ok(manifest)
    }

    /// Imports every entry the store lacks, verifying each against the manifest: several files
    /// at once, staged in `tmp/` and published in batches (see the module docs).
    pub fn fetch(
        &self,
        manifest: &Manifest,
        ctx: &FetchContext,
    ) -> Result<Vec<Sha256Digest>, SourceError> {
        let tree = self.open_tree()?;
        let entries = manifest.entries();
        let store_err = |source| SourceError::Store {
            path: ctx.store.root().display().to_string(),
            source,
        };
        let import = Import {
            claimed: Mutex::new(HashSet::new()),
            batch: Mutex::new(Batch::default()),
            stop: AtomicBool::new(false),
            failed: Mutex::new(None),
        };
        run_workers(entries.len(), |next| {
            let mut buf = Vec::new();
            while let Some(i) = next() {
                if import.stop.load(Ordering::Relaxed) {
                    return;
                }
                let entry = manifest.entry(i);
                let done = self
                    .import_entry(&tree, entry, ctx, &import, &mut buf)
                    .and_then(|staged| match staged {
                        Some(blob) => import.add(blob, &ctx.store).map_err(store_err),
                        None => Ok(()),
                    });
                if let Err(e) = done {
                    import.stop.store(true, Ordering::Relaxed);
                    import.failed.lock().expect("poisoned").get_or_insert(e);
                    return;
                }
                ctx.progress
                    .completed_bytes
                    .fetch_add(entry.size, Ordering::Relaxed);
                ctx.progress.completed_files.fetch_add(1, Ordering::Relaxed);
            }
        });
        // Staged blobs are verified: publish them even after an error, so a retry finds them.
        let rest = std::mem::take(&mut import.batch.lock().expect("poisoned").staged);
        let published = ctx.store.publish(rest);
        if let Some(e) = import.failed.into_inner().expect("poisoned") {
            return Err(e);
        }
        published.map_err(store_err)?;
        // Blobs taken from a seed store by hard links (`reuse_existing`) are renames to sync too.
        ctx.store.sync().map_err(store_err)?;
        Ok(entries
            .map(|entry| match entry.digest {
                FileDigest::Sha256(sha) => Sha256Digest(sha),
                FileDigest::GitSha1(_) | FileDigest::Object { .. } => {
                    unreachable!("local manifests carry sha256 digests")
                }
            })
            .collect())
    }

    /// Imports one entry: nothing when the store has its blob (or another entry of this fetch
    /// with the same bytes does it), else a staged blob, hard-linked or copied.
    fn import_entry(
        &self,
        tree: &Tree,
        entry: EntryRef<'_>,
        ctx: &FetchContext,
        import: &Import,
        buf: &mut Vec<u8>,
    ) -> Result<Option<StagedBlob>, SourceError> {
        ctx.check_cancelled()?;
        let FileDigest::Sha256(sha) = entry.digest else {
            unreachable!("local manifests carry sha256 digests");
        };
        if !import.claimed.lock().expect("poisoned").insert(sha) {
            return Ok(None);
        }
        if ctx.reuse_existing(entry)?.is_some() {
            return Ok(None);
        }
        let path = self.root.join(entry.path);
        let changed = || SourceError::LocalChanged {
            path: path.display().to_string(),
        };
        let store_err = |source| SourceError::Store {
            path: entry.path.to_string(),
            source,
        };
        let src = self.open_file(tree, entry.path)?;
        let stat = rustix::fs::fstat(&src).map_err(|e| io_err(&path, e))?;
        if is_immutable(&stat) {
            match ctx
                .store
                .stage_link(&src, entry.digest, entry.size, &ctx.cancel, buf)
            {
                Ok(Some(staged)) => {
                    ctx.metrics.local_linked_files.inc();
                    return Ok(Some(staged));
                }
                Ok(None) => {} // another filesystem: copied below
                Err(
                    modelfs_core::store::StoreError::SizeMismatch { .. }
                    | modelfs_core::store::StoreError::DigestMismatch { .. },
                ) => return Err(changed()),
                Err(other) => return Err(store_err(other)),
            }
        }
        let staged = self.copy_one(&src, &path, entry, ctx, buf)?;
        ctx.record_fetched(SourceScheme::Local, entry.size);
        Ok(Some(staged))
    }

    /// Copies one file into `tmp/`, hashing the bytes as they are written (one pass), and
    /// verifies them against the manifest.
    fn copy_one(
        &self,
        mut src: &File,
        path: &Path,
        entry: EntryRef<'_>,
        ctx: &FetchContext,
        buf: &mut Vec<u8>,
    ) -> Result<StagedBlob, SourceError> {
        let changed = || SourceError::LocalChanged {
            path: path.display().to_string(),
        };
        let store_err = |source| SourceError::Store {
            path: entry.path.to_string(),
            source,
        };
        let mut writer = ctx
            .store
            .writer(entry.digest, entry.size)
            .map_err(store_err)?;
        // One byte more than expected: a file that grew is seen by the first read.
        let want = entry.size.saturating_add(1).min(CHUNK as u64) as usize;
        if buf.len() < want {
            buf.resize(want, 0);
        }
        loop {
            if let Err(e) = ctx.check_cancelled() {
                writer.discard();
                return Err(e);
            }
            let n = match src.read(buf) {
                Ok(n) => n,
                Err(e) => {
                    writer.discard();
                    return Err(io_err(path, e));
                }
            };
            if n == 0 {
                break;
            }
            if let Err(e) = writer.write_all(&buf[..n]) {
                writer.discard();
                return Err(match e {
                    modelfs_core::store::StoreError::SizeMismatch { .. } => changed(),
                    other => store_err(other),
                });
            }
            // A short read of a regular file is its end: no further read to see 0.
            if writer.written() == entry.size && n < buf.len() {
                break;
            }
        }
        match writer.stage() {
            Ok(staged) => Ok(staged),
            Err(
                modelfs_core::store::StoreError::SizeMismatch { .. }
                | modelfs_core::store::StoreError::DigestMismatch { .. },
            ) => Err(changed()),
            Err(other) => Err(store_err(other)),
        }
    }
}

/// A directory's regular files as [`modelfs_ome::modelconfig::ModelFiles`], from
/// [`LocalSource::config_files`]: every open is checked again as an import's is.
pub struct ConfigFiles {
    source: LocalSource,
    tree: Tree,
    files: std::collections::BTreeSet<String>,
}

impl modelfs_ome::modelconfig::ModelFiles for ConfigFiles {
    fn paths(&self) -> Vec<String> {
        self.files.iter().cloned().collect()
    }

    fn open(&self, path: &str) -> std::io::Result<Box<dyn Read + '_>> {
        if !self.files.contains(path) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                path.to_string(),
            ));
        }
        match self.source.open_file(&self.tree, path) {
            Ok(file) => Ok(Box::new(file)),
            Err(SourceError::LocalIo { source, .. }) => Err(source),
            Err(e) => Err(std::io::Error::other(e.to_string())),
        }
    }

    fn exists(&self, path: &str) -> bool {
        self.files.contains(path)
    }
}

/// Whether a source file counts as immutable, so that it may enter the store as a hard link
/// instead of a copy (see the module docs): owned by root and writable by nobody.
fn is_immutable(stat: &Stat) -> bool {
    stat.st_uid == 0 && stat.st_mode & 0o222 == 0
}

/// Files of one model worked on at once. The work per small file is a handful of system calls
/// (open, read, create, write, rename) that overlap well; more workers than this only contend.
const IMPORT_WORKERS: usize = 4;

/// Staged blobs published together (one `syncfs`, one directory fsync) once either bound is
/// reached, so a crash loses at most one batch of work.
const BATCH_FILES: usize = 4096;
const BATCH_BYTES: u64 = 256 << 20;

/// Extra worker threads (beyond the calling thread of each resolve or fetch) that all
/// `local://` work of the process may use together. Many models resolve at once (each on its
/// own blocking thread), and each thread costs a stack and possibly an allocator arena: past
/// this budget a resolve or fetch works alone.
const MAX_EXTRA_WORKERS: usize = 6;

static EXTRA_WORKERS: AtomicUsize = AtomicUsize::new(0);

/// A share of [`MAX_EXTRA_WORKERS`], given back on drop.
struct ExtraWorkers(usize);

impl ExtraWorkers {
    fn take(wanted: usize) -> Self {
        let mut taken = 0;
        while taken < wanted {
            let in_use = EXTRA_WORKERS.load(Ordering::Relaxed);
            if in_use >= MAX_EXTRA_WORKERS {
                break;
            }
            if EXTRA_WORKERS
                .compare_exchange(in_use, in_use + 1, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                taken += 1;
            }
        }
        Self(taken)
    }
}

impl Drop for ExtraWorkers {
    fn drop(&mut self) {
        EXTRA_WORKERS.fetch_sub(self.0, Ordering::AcqRel);
    }
}

/// Runs `work` on up to [`IMPORT_WORKERS`] threads (the caller's thread is one of them, the
/// others come from the process-wide [`MAX_EXTRA_WORKERS`]); each call takes the indices below
/// `count` from the shared `next` until none is left.
fn run_workers(count: usize, work: impl Fn(&dyn Fn() -> Option<usize>) + Sync) {
    let cursor = AtomicUsize::new(0);
    let next = || {
        let i = cursor.fetch_add(1, Ordering::Relaxed);
        (i < count).then_some(i)
    };
    let extra = ExtraWorkers::take(IMPORT_WORKERS.min(count).saturating_sub(1));
    if extra.0 == 0 {
        return work(&next);
    }
    std::thread::scope(|scope| {
        for _ in 0..extra.0 {
            scope.spawn(|| work(&next));
        }
        work(&next);
    });
}

/// Shared state of one fetch's workers.
struct Import {
    /// Digests some worker has taken on (a manifest may list the same bytes several times).
    claimed: Mutex<HashSet<[u8; 32]>>,
    batch: Mutex<Batch>,
    stop: AtomicBool,
    failed: Mutex<Option<SourceError>>,
}

#[derive(Default)]
struct Batch {
    staged: Vec<StagedBlob>,
    bytes: u64,
}

impl Import {
    /// Adds a staged blob to the batch; a full batch is published by the worker that filled it.
    fn add(&self, blob: StagedBlob, store: &modelfs_core::store::Store) -> Result<(), StoreError> {
        let full = {
            let mut batch = self.batch.lock().expect("poisoned");
            batch.bytes += blob.size();
            batch.staged.push(blob);
            if batch.staged.len() >= BATCH_FILES || batch.bytes >= BATCH_BYTES {
                Some(std::mem::take(&mut *batch))
            } else {
                None
            }
        };
        match full {
            Some(batch) => store.publish(batch.staged),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{symlink, PermissionsExt};
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::source::{KnownBlobs, Progress};
    use modelfs_core::store::Store;

    fn write(path: &Path, data: &[u8], mode: u32) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, data).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    fn mkfifo(path: &Path) {
        rustix::fs::mknodat(
            rustix::fs::CWD,
            path,
            FileType::Fifo,
            Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
    }

    fn resolve(root: &Path) -> Result<Manifest, SourceError> {
        LocalSource::new(root.to_path_buf()).resolve(&AtomicBool::new(false))
    }

    fn paths(m: &Manifest) -> Vec<&str> {
        m.entries().map(|e| e.path).collect()
    }

    fn permanent(err: SourceError, want: &str) {
        assert!(!err.is_transient(), "{err} must not be retried");
        assert!(err.to_string().contains(want), "{err} should say {want:?}");
    }

    /// Runs `f` on a thread; a blocked call is a test failure after `limit`, and `unblock`
    /// then frees the thread.
    fn within<T: Send + 'static>(
        limit: Duration,
        f: impl FnOnce() -> T + Send + 'static,
        unblock: impl FnOnce(),
    ) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        match rx.recv_timeout(limit) {
            Ok(v) => v,
            Err(_) => {
                unblock();
                panic!("blocked for more than {limit:?}");
            }
        }
    }

    #[test]
    fn a_fifo_swapped_in_between_resolve_and_fetch_fails_with_a_reason_instead_of_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        write(&src.join("a.bin"), b"first", 0o644);
        write(&src.join("b.bin"), b"second", 0o644);
        let manifest = Arc::new(resolve(&src).unwrap());
        std::fs::remove_file(src.join("b.bin")).unwrap();
        mkfifo(&src.join("b.bin"));

        let ctx = FetchContext {
            store: Store::open(dir.path().join("store")).unwrap(),
            progress: Arc::new(Progress::for_manifest(&manifest)),
            cancel: Arc::new(AtomicBool::new(false)),
            metrics: Arc::new(crate::metrics::Metrics::new()),
            existing: Arc::new(KnownBlobs::default()),
            live: None,
        };
        let source = LocalSource::new(src.clone());
        let fifo = src.join("b.bin");
        let err = within(
            Duration::from_secs(20),
            move || source.fetch(&manifest, &ctx).unwrap_err(),
            // A writer releases a reader blocked in open(2).
            move || drop(std::fs::OpenOptions::new().write(true).open(fifo)),
        );
        assert!(
            matches!(err, SourceError::LocalSpecialFile { .. }),
            "{err:?}"
        );
        permanent(err, "b.bin is a named pipe (FIFO)");

        // Present from the start: refused by the walk, never opened.
        let err = within(Duration::from_secs(20), move || resolve(&src), || ()).unwrap_err();
        permanent(err, "b.bin is a named pipe (FIFO)");

        // The root itself must be a directory.
        let root_fifo = dir.path().join("root-fifo");
        mkfifo(&root_fifo);
        let err = within(Duration::from_secs(20), move || resolve(&root_fifo), || ()).unwrap_err();
        permanent(err, "root-fifo is a named pipe (FIFO)");
        write(&dir.path().join("file"), b"x", 0o644);
        permanent(
            resolve(&dir.path().join("file")).unwrap_err(),
            "is not a directory",
        );
    }

    #[test]
    fn symlinks_are_followed_inside_the_tree_and_refused_when_they_leave_it() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        write(&src.join("weights/model.bin"), b"weights", 0o644);
        write(&dir.path().join("secret"), b"outside", 0o644);
        symlink("weights/model.bin", src.join("alias.bin")).unwrap();
        symlink("weights", src.join("linked-dir")).unwrap();
        // An absolute symlink that stays inside is followed too.
        symlink(src.join("weights/model.bin"), src.join("absolute.bin")).unwrap();
        let m = resolve(&src).unwrap();
        assert_eq!(
            paths(&m),
            [
                "absolute.bin",
                "alias.bin",
                "linked-dir/model.bin",
                "weights/model.bin"
            ]
        );
        assert!(m.entries().all(|e| e.digest == m.entry(0).digest));

        symlink("../secret", src.join("escape")).unwrap();
        permanent(
            resolve(&src).unwrap_err(),
            "escape is a symlink that leads to",
        );
        std::fs::remove_file(src.join("escape")).unwrap();
        symlink("/", src.join("weights/root")).unwrap();
        let err = resolve(&src).unwrap_err();
        assert!(
            matches!(err, SourceError::LocalSymlinkEscape { .. }),
            "{err}"
        );
        std::fs::remove_file(src.join("weights/root")).unwrap();

        // A directory symlink back up the tree would list it forever.
        symlink("..", src.join("weights/up")).unwrap();
        permanent(resolve(&src).unwrap_err(), "symlink loop");
    }

    #[test]
    fn a_symlink_swapped_in_after_the_check_is_not_followed_out() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let outside = dir.path().join("outside");
        write(&src.join("sub/f"), b"inside", 0o644);
        write(&outside.join("f"), b"outside", 0o644);
        let source = LocalSource::new(src.clone());
        let tree = source.open_tree().unwrap();

        // The last component becomes a symlink.
        let (inside, kind) = source.inspect(&tree, "sub/f").unwrap();
        std::fs::remove_file(src.join("sub/f")).unwrap();
        symlink(outside.join("f"), src.join("sub/f")).unwrap();
        let err = source
            .open_beneath(&tree, &inside, &src.join("sub/f"), kind)
            .unwrap_err();
        assert!(matches!(err, SourceError::LocalChanged { .. }), "{err}");

        // A directory on the way becomes one.
        std::fs::remove_file(src.join("sub/f")).unwrap();
        write(&src.join("sub/f"), b"inside", 0o644);
        let (inside, kind) = source.inspect(&tree, "sub/f").unwrap();
        std::fs::rename(src.join("sub"), dir.path().join("old-sub")).unwrap();
        symlink(&outside, src.join("sub")).unwrap();
        let err = source
            .open_beneath(&tree, &inside, &src.join("sub/f"), kind)
            .unwrap_err();
        assert!(matches!(err, SourceError::LocalChanged { .. }), "{err}");
    }

    #[test]
    fn a_hugging_face_cache_snapshot_may_link_into_its_blobs() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("hub/models--org--tiny");
        write(&repo.join("blobs/abc"), b"{}", 0o644);
        write(&repo.join("refs/main"), b"0123", 0o644);
        let snapshot = repo.join("snapshots/0123");
        std::fs::create_dir_all(&snapshot).unwrap();
        symlink("../../blobs/abc", snapshot.join("config.json")).unwrap();
        assert_eq!(paths(&resolve(&snapshot).unwrap()), ["config.json"]);

        // Not past the repository, though.
        write(&dir.path().join("hub/other"), b"x", 0o644);
        symlink("../../../other", snapshot.join("other")).unwrap();
        permanent(
            resolve(&snapshot).unwrap_err(),
            "outside the source directory",
        );
    }

    #[test]
    fn files_and_directories_others_cannot_read_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        write(&src.join("public.bin"), b"ok", 0o444);
        // The root's own mode does not matter (a private staging directory is normal).
        std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o700)).unwrap();
        resolve(&src).unwrap();

        for (mode, shown) in [(0o600, "0600"), (0o000, "0000"), (0o640, "0640")] {
            write(&src.join("private.bin"), b"secret", mode);
            let err = resolve(&src).unwrap_err();
            assert!(matches!(err, SourceError::LocalNotPublic { .. }), "{err}");
            permanent(
                err,
                &format!("private.bin is not readable by other users (mode {shown})"),
            );
            std::fs::remove_file(src.join("private.bin")).unwrap();
        }
        write(&src.join("hidden/inner.bin"), b"secret", 0o644);
        std::fs::set_permissions(src.join("hidden"), std::fs::Permissions::from_mode(0o711))
            .unwrap();
        permanent(resolve(&src).unwrap_err(), "directory");
    }

    fn fetch_context(store: &Path, manifest: &Manifest) -> FetchContext {
        FetchContext {
            store: Store::open(store.to_path_buf()).unwrap(),
            progress: Arc::new(Progress::for_manifest(manifest)),
            cancel: Arc::new(AtomicBool::new(false)),
            metrics: Arc::new(crate::metrics::Metrics::new()),
            existing: Arc::new(KnownBlobs::default()),
            live: None,
        }
    }

    #[test]
    fn a_many_file_import_publishes_every_blob_once_with_duplicates_and_in_batches() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        // More files than one batch, a third of them duplicates of others, some empty.
        let count = BATCH_FILES + 700;
        for i in 0..count {
            let body = format!("file {}", i % (2 * count / 3)).repeat(i % 5);
            write(
                &src.join(format!("d{}/f{i}", i / 1000)),
                body.as_bytes(),
                0o644,
            );
        }
        let manifest = resolve(&src).unwrap();
        assert_eq!(manifest.entries().len(), count);
        let ctx = fetch_context(&dir.path().join("store"), &manifest);
        let blobs = LocalSource::new(src.clone())
            .fetch(&manifest, &ctx)
            .unwrap();
        for (entry, blob) in manifest.entries().zip(&blobs) {
            let bytes = std::fs::read(ctx.store.blob_path(blob)).unwrap();
            assert_eq!(bytes, std::fs::read(src.join(entry.path)).unwrap());
            assert_eq!(Sha256Digest::of(&bytes), *blob);
        }
        let unique: HashSet<_> = blobs.iter().collect();
        assert_eq!(ctx.store.blob_names().unwrap().len(), unique.len());
        assert!(ctx.store.partial_files().unwrap().is_empty());
        assert_eq!(
            ctx.progress.completed_files.load(Ordering::Relaxed),
            count as u64
        );
        assert_eq!(
            ctx.metrics.local_linked_files.get(),
            0,
            "0644 files are copied"
        );
    }

    #[test]
    fn read_only_root_owned_files_are_hard_linked_and_others_copied() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        write(&src.join("frozen.bin"), b"read-only for everyone", 0o444);
        write(
            &src.join("owner-writable.bin"),
            b"the owner may change it",
            0o644,
        );
        write(
            &src.join("group-writable.bin"),
            b"a group may change it",
            0o464,
        );
        let owner = std::fs::metadata(src.join("frozen.bin")).unwrap().uid();
        assert_eq!(owner, 0, "the tests run as root");
        let manifest = resolve(&src).unwrap();
        let ctx = fetch_context(&dir.path().join("store"), &manifest);
        let blobs = LocalSource::new(src.clone())
            .fetch(&manifest, &ctx)
            .unwrap();
        for (entry, blob) in manifest.entries().zip(&blobs) {
            let source = std::fs::metadata(src.join(entry.path)).unwrap();
            let stored = std::fs::metadata(ctx.store.blob_path(blob)).unwrap();
            let linked = entry.path == "frozen.bin";
            assert_eq!(source.ino() == stored.ino(), linked, "{}", entry.path);
            assert_eq!(
                std::fs::read(ctx.store.blob_path(blob)).unwrap(),
                std::fs::read(src.join(entry.path)).unwrap()
            );
        }
        assert_eq!(ctx.metrics.local_linked_files.get(), 1);
        assert!(ctx.store.partial_files().unwrap().is_empty());

        // A linked file that no longer has the resolved bytes is refused, and its link removed.
        std::fs::remove_dir_all(dir.path().join("store")).unwrap();
        std::fs::set_permissions(src.join("frozen.bin"), PermissionsExt::from_mode(0o644)).unwrap();
        std::fs::write(src.join("frozen.bin"), b"READ-ONLY FOR EVERYONE").unwrap();
        std::fs::set_permissions(src.join("frozen.bin"), PermissionsExt::from_mode(0o444)).unwrap();
        let ctx = fetch_context(&dir.path().join("store"), &manifest);
        let err = LocalSource::new(src.clone())
            .fetch(&manifest, &ctx)
            .unwrap_err();
        assert!(matches!(err, SourceError::LocalChanged { .. }), "{err}");
        assert!(err.is_transient());
        let linked_names = std::fs::read_dir(dir.path().join("store/tmp"))
            .unwrap()
            .filter(|e| e.as_ref().unwrap().metadata().unwrap().nlink() > 1)
            .count();
        assert_eq!(linked_names, 0, "the rejected link is removed");
        // Files verified before the error stopped the workers are published (a retry does not
        // copy them again); nothing else is.
        for name in ctx.store.blob_names().unwrap() {
            let bytes = std::fs::read(ctx.store.blob_path_by_name(&name)).unwrap();
            assert_eq!(Sha256Digest::of(&bytes).to_hex(), name);
            assert_ne!(bytes, b"READ-ONLY FOR EVERYONE");
        }
    }

    #[test]
    fn bad_file_names_are_permanent_errors() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        write(&src.join("ok.bin"), b"ok", 0o644);
        let bad = src.join(OsStr::from_bytes(b"latin1-\xe9.bin"));
        write(&bad, b"x", 0o644);
        let err = resolve(&src).unwrap_err();
        assert!(matches!(err, SourceError::LocalBadName { .. }), "{err}");
        permanent(err, "is not valid UTF-8");
        std::fs::remove_file(&bad).unwrap();

        write(&src.join("sub/new\nline.bin"), b"x", 0o644);
        permanent(resolve(&src).unwrap_err(), "control character");
    }

    /// Reading a config in place lists what an import would refuse by leaving it out (a
    /// symlink out of the tree, a FIFO, a bad name, a symlink loop), follows symlinks inside
    /// the tree, reads files others cannot read (nothing is shown to them), and never blocks on
    /// a FIFO swapped in after the listing.
    #[test]
    fn config_files_leave_out_what_an_import_refuses_and_never_block() {
        use modelfs_ome::modelconfig::ModelFiles;
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        write(&src.join("config.json"), b"{}", 0o600);
        write(&src.join("sub/deep.json"), b"deep", 0o644);
        write(&src.join("bad\nname"), b"x", 0o644);
        write(&dir.path().join("outside.json"), b"secret", 0o644);
        symlink(dir.path().join("outside.json"), src.join("escape.json")).unwrap();
        symlink("config.json", src.join("inside.json")).unwrap();
        std::fs::create_dir(src.join("loop")).unwrap();
        symlink("..", src.join("loop/up")).unwrap();
        mkfifo(&src.join("pipe"));
        assert!(resolve(&src).is_err(), "an import refuses this tree");

        let root = src.clone();
        let files = within(
            Duration::from_secs(10),
            move || {
                LocalSource::new(root)
                    .config_files(&AtomicBool::new(false))
                    .unwrap()
            },
            || {},
        );
        assert_eq!(
            files.paths(),
            ["config.json", "inside.json", "sub/deep.json"]
        );
        assert_eq!(files.read_limited("config.json", 10).unwrap(), b"{}");
        assert_eq!(files.read_limited("inside.json", 10).unwrap(), b"{}");
        assert!(files.open("escape.json").is_err());
        assert!(files.read_limited("sub/deep.json", 3).is_err(), "bounded");

        std::fs::remove_file(src.join("sub/deep.json")).unwrap();
        mkfifo(&src.join("sub/deep.json"));
        let fifo = src.join("sub/deep.json");
        let opened = within(
            Duration::from_secs(10),
            move || {
                files
                    .open("sub/deep.json")
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            },
            move || {
                // Frees a blocked open (the test fails anyway).
                let _ = std::fs::OpenOptions::new().write(true).open(fifo);
            },
        );
        assert!(opened.is_err(), "a FIFO is not read");

        let missing = LocalSource::new(dir.path().join("missing"))
            .config_files(&AtomicBool::new(false))
            .err()
            .unwrap();
        assert!(
            matches!(missing, SourceError::LocalMissing { .. }),
            "{missing}"
        );
    }
}
