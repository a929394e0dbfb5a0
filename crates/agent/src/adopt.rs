//! Adoption of the files an old model agent (OME's) left under the models root.
//!
//! The FUSE mount sits on the models root, so once it is mounted every path below it shows the
//! mount, and whatever OME's agent downloaded there would be hidden (not deleted) and downloaded
//! again. Instead, before mounting, the daemon opens the directory it is about to cover
//! ([`UnderMount::open`]) and keeps that descriptor for its whole life. Every later access to
//! the old files goes through it (`openat2` relative to it, or `/proc/self/fd/N/...` paths),
//! which reach the directory underneath the mount, not the mount.
//!
//! # What OME leaves there
//! OME's agent downloads a Hugging Face model straight into `spec.storage.path`
//! (`<path>/<file>`, no temporary names, no metadata files beside them; its chunk caches live
//! in `HF_HOME`, outside the models root). It considers a file already present when only its
//! *size* matches, so a copy it left can hold wrong bytes of the right size. A model reusing
//! another's copy (`ReuseIfExists`) is a directory symlink at the child's path pointing to the
//! parent's directory, written as a path relative to the child's parent directory
//! (`team-a/llama -> ../shared/llama`). `local://` models are never copied: OME serves them
//! from where they are.
//!
//! # Resolving old paths
//! [`UnderMount::resolve`] walks a relative path one component at a time, following symlinks
//! the way the kernel would (relative targets from the link's directory; absolute targets when
//! they name a path below the models root, by either name it is known under) but refusing any
//! that would leave the models root. The file is then opened with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS)` on the resolved path, so even a link swapped in after the walk cannot
//! lead outside.
//!
//! # Importing
//! [`import_into`] runs before a model's fetch into its own store: for every manifest entry the
//! store lacks, the old file at the same relative path is opened; if it is a regular file of the
//! manifest's size, it is hard-linked into the store (when only root can write it, see below)
//! and the linked inode is verified against the manifest digest (sha256 or git blob sha1)
//! before it is renamed into `blobs/` ([`modelfs_core::store::Store::import_file`]; a copy
//! across filesystems or of a file others may write). Files that are missing,
//! of another size or with another digest are simply left to the fetch, which downloads exactly
//! those. Adoption never fails a model: at worst it downloads what it could not adopt.
//!
//! # Who can change an adopted file
//! A hard link shares the inode: whoever can write the old file writes into the store's blob,
//! under the mount, while the model stays `Ready`. So only an inode that nobody but root could
//! ever have opened for writing is linked: owned by root and writable by neither its group nor
//! others (a POSIX ACL granting write shows in the group bits). Adoption then takes it over:
//! its write bits go (mode 0444, on every name it has, the old path included; the one change
//! adoption makes to the old tree) and that is checked again before the bytes are verified.
//! A user's file, or one its group or others may write, is copied instead: its owner could keep
//! another hard link to it, or a descriptor open for writing, and change it at any time. The
//! mount server holds every blob to the same rule when it serves it (`modelfs_mount`'s module
//! docs). What remains is root: a root process that held the old file open for writing from
//! before the takeover (OME's agent; the migration stops it first, `deploy/MIGRATION.md`), or
//! a second mount of the same filesystem through which root writes.
//!
//! Writes *during* verification are detected (size and mtime of the inode compared before and
//! after hashing; not ctime, which concurrent adopters of the same old file move by linking
//! it) and reject the file; a rejected file gets its mode back. A store on another filesystem
//! than the models root gets independent copies, with no shared inode at all. The same rules
//! apply to a `local://` source below the models root, which is imported this way.
//!
//! # One filesystem, two mounts
//! `link(2)` needs both ends reached through one mount. The descriptor of the covered
//! directory comes from the mount server and is on its mount of the models root; the agent's
//! own path of the state directory is on another mount whenever the two are separate volumes
//! (Kubernetes), even of one disk. [`UnderMount::link_root_for`] finds the state directory
//! through the covered directory's mount (the mount server's volume is their common parent),
//! and the stores link through it (`modelfs_core::store::StateDir::with_link_root`): the link
//! made there is the same directory entry the agent then verifies and renames by its own
//! paths. The agent does the linking, with descriptors the mount server hands it anyway: the
//! privileged server gains no operation.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};

use crate::source::{FetchContext, Source, SourceError};
use modelfs_core::artifact::{FileDigest, Manifest, Sha256Digest};
use modelfs_core::store::Store;
use modelfs_ome::ModelKey;

/// Most symlinks followed while resolving one path (the kernel's limit).
const MAX_SYMLINKS: usize = 40;

/// The directory underneath the mount, opened before mounting.
#[derive(Debug)]
pub struct UnderMount {
    dir: OwnedFd,
    /// Absolute names of the models root: where the daemon mounts it, and the host path that
    /// `spec.storage.path`, `local://` URIs and OME's absolute symlinks use.
    names: Vec<PathBuf>,
}

fn escape_error(what: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("{} leads outside the models root", what.display()),
    )
}

impl UnderMount {
    /// Opens `mount_dir` (which must not be mounted over yet). `models_root_dir` is the same
    /// directory as named in model objects (the host path), if it differs.
    pub fn open(mount_dir: &Path, models_root_dir: &Path) -> io::Result<Self> {
        let dir = rustix::fs::open(
            mount_dir,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let mut names = vec![mount_dir.to_path_buf()];
        if models_root_dir != mount_dir {
            names.push(models_root_dir.to_path_buf());
        }
        Ok(Self { dir, names })
    }

    /// The same, from a descriptor of the covered directory opened by another process (the
    /// mount server, which opens it before mounting and hands it to the agent).
    pub fn from_fd(dir: OwnedFd, mount_dir: &Path, models_root_dir: &Path) -> Self {
        let mut names = vec![mount_dir.to_path_buf()];
        if models_root_dir != mount_dir {
            names.push(models_root_dir.to_path_buf());
        }
        Self { dir, names }
    }

    /// Where the mount is, as this process names it.
    pub fn mount_dir(&self) -> &Path {
        &self.names[0]
    }

    /// The descriptor of the covered directory (to measure its filesystem and mount).
    pub fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.dir.as_fd()
    }

    /// The state directory `state` reached through the mount of the covered directory, when
    /// that is another mount of the state's filesystem than the one `state` names: the
    /// directory that adoption links into ([`modelfs_core::store::StateDir::with_link_root`]).
    /// `Ok(None)` when no link needs it (the state is on the covered directory's mount, or on
    /// another filesystem) or when it cannot be reached that way.
    ///
    /// Kubernetes gives each hostPath volume a mount of its own, so the agent's state
    /// directory and the mount server's models root are two mounts of one disk even when the
    /// state sits beside the models root, and `link(2)` refuses (`EXDEV`) what one filesystem
    /// could link. The mount server mounts their common parent as one volume: walking from
    /// the covered directory by the lexical path from the models root to the state directory
    /// (`../.modelfs-models`) then stays on that one mount. What is reached is used only if it
    /// is the state directory itself (same device and inode) and on the covered directory's
    /// mount; no symlink is followed on the way.
    pub fn link_root_for(&self, state: &Path) -> io::Result<Option<OwnedFd>> {
        use rustix::fs::StatxFlags;
        let flags = StatxFlags::MNT_ID | StatxFlags::BASIC_STATS;
        let here = rustix::fs::statx(&self.dir, "", AtFlags::EMPTY_PATH, flags)?;
        let there = rustix::fs::statx(rustix::fs::CWD, state, AtFlags::empty(), flags)?;
        let dev = |s: &rustix::fs::Statx| (s.stx_dev_major, s.stx_dev_minor);
        if here.stx_mnt_id == there.stx_mnt_id || dev(&here) != dev(&there) {
            return Ok(None);
        }
        let Some(rel) = lexical_path_between(&self.names[0], state) else {
            return Ok(None);
        };
        let dir = match rustix::fs::openat2(
            &self.dir,
            &rel,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
        ) {
            Ok(dir) => dir,
            Err(e) => {
                tracing::debug!(path = %rel.display(), error = %e, "the state directory is not reachable from the models root's mount");
                return Ok(None);
            }
        };
        let reached = rustix::fs::statx(&dir, "", AtFlags::EMPTY_PATH, flags)?;
        let same_dir = dev(&reached) == dev(&there) && reached.stx_ino == there.stx_ino;
        Ok((same_dir && reached.stx_mnt_id == here.stx_mnt_id).then_some(dir))
    }

    /// The size of the regular file at `rel` when adoption would hard-link it (owned by root,
    /// writable by neither group nor others; see the module docs); `None` otherwise. An
    /// estimate for the disk budget: the bytes are verified only when it is imported.
    pub fn linkable_size(&self, rel: &Path) -> Option<u64> {
        let real = self.resolve(rel).ok()?;
        let st = rustix::fs::statat(&self.dir, &real, AtFlags::SYMLINK_NOFOLLOW).ok()?;
        let regular = FileType::from_raw_mode(st.st_mode) == FileType::RegularFile;
        let only_root_writes = st.st_uid == 0 && st.st_mode & 0o022 == 0;
        (regular && only_root_writes).then_some(st.st_size as u64)
    }

    /// `/proc/self/fd/N/<rel>`: a path that reaches `rel` below the covered directory (for code
    /// that works with paths, such as the `local://` source).
    pub fn proc_path(&self, rel: &Path) -> PathBuf {
        let base = PathBuf::from(format!("/proc/self/fd/{}", self.dir.as_raw_fd()));
        if rel.as_os_str().is_empty() {
            base
        } else {
            base.join(rel)
        }
    }

    /// The part of absolute path `abs` below the models root, if it lies there (lexically; `..`
    /// is refused).
    pub fn relative_of(&self, abs: &Path) -> Option<PathBuf> {
        self.names.iter().find_map(|root| {
            let rel = abs.strip_prefix(root).ok()?;
            rel.components()
                .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
                .then(|| rel.to_path_buf())
        })
    }

    /// Resolves `rel` (relative to the models root) to a path below it that has no symlink in
    /// it, following symlinks as the kernel would but never outside the models root.
    pub fn resolve(&self, rel: &Path) -> io::Result<PathBuf> {
        let mut done: Vec<OsString> = Vec::new();
        let mut todo: Vec<OsString> = Vec::new();
        push_components(&mut todo, rel, rel)?;
        let mut links = 0usize;
        while let Some(name) = todo.pop() {
            if name == ".." {
                if done.pop().is_none() {
                    return Err(escape_error(rel));
                }
                continue;
            }
            done.push(name);
            let here: PathBuf = done.iter().collect();
            let stat = rustix::fs::statat(&self.dir, &here, AtFlags::SYMLINK_NOFOLLOW)?;
            if FileType::from_raw_mode(stat.st_mode) != FileType::Symlink {
                continue;
            }
            links += 1;
            if links > MAX_SYMLINKS {
                return Err(io::Error::from_raw_os_error(libc::ELOOP));
            }
            let target = PathBuf::from(OsString::from_vec(
                rustix::fs::readlinkat(&self.dir, &here, Vec::new())?.into_bytes(),
            ));
            done.pop();
            if target.is_absolute() {
                let inside = self.relative_of(&target).ok_or_else(|| escape_error(rel))?;
                done.clear();
                push_components(&mut todo, &inside, rel)?;
            } else {
                push_components(&mut todo, &target, rel)?;
            }
        }
        Ok(done.iter().collect())
    }

    /// Opens the regular file at `rel` (following symlinks within the models root). `None` when
    /// nothing is there; an error for anything else that is not a readable regular file.
    pub fn open_file(&self, rel: &Path) -> io::Result<Option<File>> {
        let real = match self.resolve(rel) {
            Ok(p) => p,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let fd = match rustix::fs::openat2(
            &self.dir,
            &real,
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOFOLLOW | OFlags::NONBLOCK,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
        ) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let file = File::from(fd);
        if !file.metadata()?.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a regular file", rel.display()),
            ));
        }
        Ok(Some(file))
    }
}

/// The relative path that leads from directory `from` to `to`, both absolute, by their names
/// alone (`..` up to their common ancestor, then down): `/raid/models` to
/// `/raid/.modelfs-models` is `../.modelfs-models`. `None` when either is not absolute or
/// holds `..`, or when `to` is `from` or below it.
fn lexical_path_between(from: &Path, to: &Path) -> Option<PathBuf> {
    let parts = |p: &Path| -> Option<Vec<OsString>> {
        if !p.is_absolute() {
            return None;
        }
        let mut out = Vec::new();
        for c in p.components() {
            match c {
                Component::Normal(n) => out.push(n.to_os_string()),
                Component::RootDir | Component::CurDir => {}
                Component::ParentDir | Component::Prefix(_) => return None,
            }
        }
        Some(out)
    };
    let (from, to) = (parts(from)?, parts(to)?);
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    if common == from.len() {
        return None;
    }
    let mut rel = PathBuf::new();
    for _ in common..from.len() {
        rel.push("..");
    }
    for name in &to[common..] {
        rel.push(name);
    }
    Some(rel)
}

/// Pushes the components of `path` onto the stack `todo` so that the first component is popped
/// first. `.` is dropped; an absolute path here is a bug of the caller.
fn push_components(todo: &mut Vec<OsString>, path: &Path, whole: &Path) -> io::Result<()> {
    let mut parts = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(n) => parts.push(n.to_os_string()),
            Component::ParentDir => parts.push(OsString::from("..")),
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => return Err(escape_error(whole)),
        }
    }
    todo.extend(parts.into_iter().rev());
    Ok(())
}

/// Where a model's old files are, below the models root.
#[derive(Clone, Debug)]
pub struct AdoptFrom {
    pub under: Arc<UnderMount>,
    /// Relative to the models root: the model's path, or its `local://` directory.
    pub dir: PathBuf,
}

/// What one adoption pass did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Adopted {
    /// Files imported by hard link.
    pub linked: usize,
    /// Files imported by copy (the store is on another filesystem).
    pub copied: usize,
    pub bytes: u64,
    /// Files present but not adopted (wrong size or digest, unreadable), with the reason; the
    /// fetch downloads them.
    pub rejected: Vec<(String, String)>,
}

/// Imports into `store` every entry of `manifest` that the store lacks and that `from` holds
/// with the manifest's size and digest. Errors other than cancellation are per file and end in
/// [`Adopted::rejected`]: the fetch that follows gets what was not adopted.
pub fn import_into(
    from: &AdoptFrom,
    manifest: &Manifest,
    store: &Store,
    cancel: &AtomicBool,
) -> Result<Adopted, Cancelled> {
    let mut out = Adopted::default();
    let mut seen: HashSet<FileDigest> = HashSet::new();
    for entry in manifest.entries() {
        if cancel.load(Ordering::Relaxed) {
            return Err(Cancelled);
        }
        if !seen.insert(entry.digest) {
            continue;
        }
        let present = match entry.digest {
            FileDigest::Sha256(d) => store.has_blob(&Sha256Digest(d), entry.size),
            FileDigest::GitSha1(_) | FileDigest::Object { .. } => {
                store.lookup_alias(&entry.digest, entry.size).is_some()
            }
        };
        // An old file can be taken only if its bytes can be checked.
        if present || !entry.digest.checks_content() {
            continue;
        }
        let file = match from.under.open_file(&from.dir.join(entry.path)) {
            Ok(Some(f)) => f,
            Ok(None) => continue,
            Err(e) => {
                out.rejected.push((entry.path.to_string(), e.to_string()));
                continue;
            }
        };
        match file.metadata() {
            Ok(m) if m.len() == entry.size => {}
            Ok(m) => {
                out.rejected.push((
                    entry.path.to_string(),
                    format!("size {} instead of {}", m.len(), entry.size),
                ));
                continue;
            }
            Err(e) => {
                out.rejected.push((entry.path.to_string(), e.to_string()));
                continue;
            }
        }
        match store.import_file(&file, entry.digest, entry.size, cancel) {
            Ok((_, linked)) => {
                if linked {
                    out.linked += 1;
                } else {
                    out.copied += 1;
                }
                out.bytes += entry.size;
            }
            Err(_) if cancel.load(Ordering::Relaxed) => return Err(Cancelled),
            Err(e) => out.rejected.push((entry.path.to_string(), e.to_string())),
        }
    }
    Ok(out)
}

/// The adoption pass was cancelled (the model's work was cancelled or the daemon stops).
#[derive(Debug)]
pub struct Cancelled;

/// A model's fetch into its own store: first adopts what `adopt` holds (if given), then lets
/// the source fetch whatever the store still lacks.
pub async fn fetch_adopting(
    key: &ModelKey,
    source: &Source,
    adopt: Option<AdoptFrom>,
    manifest: &Arc<Manifest>,
    ctx: FetchContext,
) -> Result<Vec<Sha256Digest>, SourceError> {
    if let Some(from) = adopt {
        let (store, cancel) = (ctx.store.clone(), ctx.cancel.clone());
        adopt_before_fetch(key, from, manifest.clone(), store, cancel)
            .await
            .map_err(|Cancelled| SourceError::Cancelled)?;
    }
    source.fetch(manifest.clone(), ctx).await
}

/// Runs [`import_into`] off the async runtime and logs what it did.
async fn adopt_before_fetch(
    key: &ModelKey,
    from: AdoptFrom,
    manifest: Arc<Manifest>,
    store: Store,
    cancel: Arc<AtomicBool>,
) -> Result<(), Cancelled> {
    let dir = from.dir.clone();
    let result =
        tokio::task::spawn_blocking(move || import_into(&from, &manifest, &store, &cancel))
            .await
            // A panic goes on to the model's task, which fails the model with its message
            // (a cancellation would be retried forever).
            .unwrap_or_else(|e| match e.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(_) => Err(Cancelled),
            })?;
    if result.linked + result.copied > 0 {
        tracing::info!(
            model = %key,
            from = %dir.display(),
            linked = result.linked,
            copied = result.copied,
            bytes = result.bytes,
            "adopted files left under the models root"
        );
    }
    for (path, reason) in &result.rejected {
        tracing::warn!(model = %key, from = %dir.display(), file = %path, %reason, "old file not adopted; it is fetched instead");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{symlink, MetadataExt};

    use sha2::{Digest, Sha256};

    use super::*;
    use modelfs_core::artifact::ManifestEntry;

    use modelfs_core::artifact::git_blob_sha1 as git_sha1;

    /// A models root known under two names (as mounted, and the host path in model objects).
    fn root() -> (tempfile::TempDir, PathBuf, UnderMount) {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir_all(root.join("shared/m/sub")).unwrap();
        std::fs::write(root.join("shared/m/sub/a.bin"), b"alpha").unwrap();
        std::fs::create_dir_all(tmp.path().join("outside")).unwrap();
        std::fs::write(tmp.path().join("outside/a.bin"), b"secret").unwrap();
        let under = UnderMount::open(&root, Path::new("/raid/models")).unwrap();
        (tmp, root, under)
    }

    #[test]
    fn symlinks_are_followed_within_the_root_only() {
        let (tmp, root, under) = root();
        std::fs::create_dir_all(root.join("team-a")).unwrap();
        symlink("../shared/m", root.join("team-a/m")).unwrap();
        symlink("/raid/models/shared/m", root.join("abs")).unwrap();
        symlink("../outside", root.join("up")).unwrap();
        symlink(tmp.path().join("outside"), root.join("abs-out")).unwrap();
        symlink("loop", root.join("loop")).unwrap();

        let p = |s: &str| PathBuf::from(s);
        assert_eq!(
            under.resolve(&p("team-a/m/sub/a.bin")).unwrap(),
            p("shared/m/sub/a.bin")
        );
        assert_eq!(
            under.resolve(&p("abs/sub/./a.bin")).unwrap(),
            p("shared/m/sub/a.bin")
        );
        assert_eq!(
            under.resolve(&p("shared/m/sub/../sub/a.bin")).unwrap(),
            p("shared/m/sub/a.bin")
        );
        for escaping in [
            "up/a.bin",
            "abs-out/a.bin",
            "../outside/a.bin",
            "shared/../../x",
        ] {
            let e = under.resolve(&p(escaping)).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{escaping}: {e}");
            assert!(under.open_file(&p(escaping)).is_err(), "{escaping}");
        }
        assert_eq!(
            under.resolve(&p("loop")).unwrap_err().raw_os_error(),
            Some(libc::ELOOP)
        );

        let mut f = under.open_file(&p("team-a/m/sub/a.bin")).unwrap().unwrap();
        let mut text = String::new();
        std::io::Read::read_to_string(&mut f, &mut text).unwrap();
        assert_eq!(text, "alpha");
        assert!(under.open_file(&p("team-a/m/missing")).unwrap().is_none());
        assert!(under.open_file(&p("nothing/here")).unwrap().is_none());
        assert!(under.open_file(&p("shared/m/sub")).is_err(), "a directory");

        assert_eq!(
            under.relative_of(Path::new("/raid/models/x/y")),
            Some(p("x/y"))
        );
        assert_eq!(under.relative_of(&root.join("x")), Some(p("x")));
        assert_eq!(under.relative_of(Path::new("/raid/models/../etc")), None);
        assert_eq!(under.relative_of(Path::new("/raid/other")), None);
    }

    #[test]
    fn the_path_from_the_models_root_to_the_state_is_lexical() {
        let between = |a: &str, b: &str| lexical_path_between(Path::new(a), Path::new(b));
        let p = |s: &str| Some(PathBuf::from(s));
        assert_eq!(
            between("/raid/models", "/raid/.modelfs-models"),
            p("../.modelfs-models")
        );
        assert_eq!(
            between("/mnt/data/models/", "/mnt/state/./m"),
            p("../../state/m")
        );
        assert_eq!(
            between("/raid/models", "/var/lib/modelfs"),
            p("../../var/lib/modelfs")
        );
        assert_eq!(between("/raid/models", "/raid/models/.state"), None);
        assert_eq!(between("/raid/models", "/raid/models"), None);
        assert_eq!(between("/raid/models", "/raid/x/../y"), None);
        assert_eq!(between("raid/models", "/raid/y"), None);
    }

    #[test]
    fn verified_files_are_hard_linked_and_others_left_to_the_fetch() {
        let (tmp, root, under) = root();
        let good = b"good weights".to_vec();
        let small = b"{\"small\": true}".to_vec();
        let bad = b"bad weights!".to_vec(); // same size as the manifest says, other bytes
        std::fs::write(root.join("shared/m/good.bin"), &good).unwrap();
        std::fs::write(root.join("shared/m/config.json"), &small).unwrap();
        std::fs::write(root.join("shared/m/bad.bin"), &bad).unwrap();
        std::fs::write(root.join("shared/m/short.bin"), b"abc").unwrap();
        let entry = |path: &str, size: usize, digest| ManifestEntry {
            path: path.into(),
            size: size as u64,
            digest,
        };
        let manifest = Manifest::new(
            "rev".into(),
            vec![
                entry(
                    "good.bin",
                    good.len(),
                    FileDigest::Sha256(Sha256::digest(&good).into()),
                ),
                entry(
                    "config.json",
                    small.len(),
                    FileDigest::GitSha1(git_sha1(&small)),
                ),
                entry(
                    "bad.bin",
                    bad.len(),
                    FileDigest::Sha256(Sha256::digest(b"other weight").into()),
                ),
                entry("short.bin", 10, FileDigest::Sha256([1; 32])),
                entry("missing.bin", 4, FileDigest::Sha256([2; 32])),
            ],
        )
        .unwrap();
        let store = Store::open(tmp.path().join("store")).unwrap();
        let from = AdoptFrom {
            under: Arc::new(under),
            dir: PathBuf::from("shared/m"),
        };
        let done = import_into(&from, &manifest, &store, &AtomicBool::new(false)).unwrap();
        assert_eq!((done.linked, done.copied), (2, 0));
        assert_eq!(done.bytes, (good.len() + small.len()) as u64);
        let rejected: Vec<&str> = done.rejected.iter().map(|r| r.0.as_str()).collect();
        assert_eq!(rejected, ["bad.bin", "short.bin"], "{:?}", done.rejected);

        let blob = store.blob_path(&Sha256Digest::of(&good));
        let old = root.join("shared/m/good.bin");
        assert_eq!(
            std::fs::metadata(&blob).unwrap().ino(),
            std::fs::metadata(&old).unwrap().ino()
        );
        let alias = store.lookup_alias(&FileDigest::GitSha1(git_sha1(&small)), small.len() as u64);
        assert_eq!(alias, Some(Sha256Digest::of(&small)));
        assert!(!store.blob_path(&Sha256Digest::of(&bad)).exists());
        assert!(
            store.partial_files().unwrap().is_empty(),
            "no leftovers in tmp/"
        );
        assert_eq!(
            std::fs::read(&old).unwrap(),
            good,
            "the old file's bytes are untouched"
        );
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
        assert_eq!(mode(&old), 0o444, "a linked file is taken over");
        assert_eq!(
            mode(&root.join("shared/m/bad.bin")),
            0o644,
            "a rejected file keeps its mode"
        );

        // A second pass finds everything it can adopt already present.
        let again = import_into(&from, &manifest, &store, &AtomicBool::new(false)).unwrap();
        assert_eq!((again.linked, again.copied), (0, 0));
    }

    /// A file someone other than root could write (a user's, a group-writable one) is copied,
    /// so writing it afterwards, through any name, does not reach the store; root's own
    /// read-write file is linked and loses its write bits.
    #[test]
    fn files_others_could_write_are_copied_and_linked_ones_taken_over() {
        use std::os::unix::fs::PermissionsExt;
        let (tmp, root, under) = root();
        let dir = root.join("shared/m");
        let files: Vec<(&str, Vec<u8>, Option<u32>, u32)> = vec![
            ("user.bin", b"user's weights".to_vec(), Some(65534), 0o644),
            ("group.bin", b"group-writable".to_vec(), None, 0o664),
            ("others.bin", b"world-writable".to_vec(), None, 0o646),
            ("root.bin", b"root's weights".to_vec(), None, 0o644),
        ];
        let mut entries = Vec::new();
        for (name, data, uid, mode) in &files {
            let path = dir.join(name);
            std::fs::write(&path, data).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(*mode)).unwrap();
            if let Some(uid) = uid {
                rustix::fs::chown(&path, Some(rustix::process::Uid::from_raw(*uid)), None).unwrap();
            }
            entries.push(ManifestEntry {
                path: (*name).into(),
                size: data.len() as u64,
                digest: FileDigest::Sha256(Sha256::digest(data).into()),
            });
        }
        let manifest = Manifest::new("rev".into(), entries).unwrap();
        let store = Store::open(tmp.path().join("store")).unwrap();
        let from = AdoptFrom {
            under: Arc::new(under),
            dir: PathBuf::from("shared/m"),
        };
        let done = import_into(&from, &manifest, &store, &AtomicBool::new(false)).unwrap();
        assert_eq!((done.linked, done.copied), (1, 3), "{:?}", done.rejected);
        for (name, data, uid, mode) in &files {
            let old = dir.join(name);
            let blob = store.blob_path(&Sha256Digest::of(data));
            let (o, b) = (
                std::fs::metadata(&old).unwrap(),
                std::fs::metadata(&blob).unwrap(),
            );
            assert_eq!((b.uid(), b.mode() & 0o7777), (0, 0o444), "{name}'s blob");
            if *name == "root.bin" {
                assert_eq!(o.ino(), b.ino(), "{name} is linked");
                assert_eq!(o.mode() & 0o7777, 0o444, "{name} is taken over");
                continue;
            }
            assert_ne!(o.ino(), b.ino(), "{name} is copied");
            assert_eq!(o.mode() & 0o7777, *mode, "{name} keeps its mode");
            assert_eq!(o.uid(), uid.unwrap_or(0), "{name} keeps its owner");
            // Its owner writes it in place: the store does not change.
            std::fs::write(&old, vec![b'X'; data.len()]).unwrap();
            assert_eq!(
                std::fs::read(&blob).unwrap(),
                *data,
                "{name}'s blob changed"
            );
            assert!(store.has_blob(&Sha256Digest::of(data), data.len() as u64));
        }
    }
}
