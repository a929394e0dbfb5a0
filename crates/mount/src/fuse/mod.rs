//! The FUSE adapter: converts between `fuser` types and the filesystem core, maps errors to
//! errno, records metrics, and owns the two kernel-facing mechanisms the core cannot express:
//! passthrough backing files and cache invalidation.
//!
//! # Data path
//! With passthrough (Linux >= 6.9, `CAP_SYS_ADMIN`) `open` registers the blob's file descriptor
//! with the kernel and every read and mmap fault is served by the kernel from the blob file: the
//! daemon never sees a `read`. The kernel requires every open handle of one inode to use the same
//! backing id, so ids are cached per inode while any handle is open; the cache entry also holds
//! the [`OpenBlob`] it was created from, which keeps that blob's store in use even if later
//! handles were opened after a flip to another store (same bytes, other file).
//!
//! Without passthrough, `read` is a `pread` on the blob and opens return `FOPEN_KEEP_CACHE`:
//! a file's content never changes under its inode number (see `vfs`), so the page cache can stay
//! valid between opens. mmap works through the page cache in both modes.
//!
//! # Listings
//! Directories are listed with `READDIRPLUS` (asked for at `init`, without the kernel's
//! adaptive mode): each entry carries its attributes and entry/attribute TTLs as a `lookup`
//! reply would, so a tree walk that stats every file (`ls -l`, `du`, `find -printf %s`, a
//! loader listing a model) costs one request per directory buffer instead of one `LOOKUP` per
//! entry. The kernel takes a lookup reference on every entry it links from such a reply; the
//! core counts them so `forget` balances (see [`FsCore::readdirplus`]).
//!
//! # Requests the kernel is told not to send
//! A round trip costs tens of microseconds (two context switches, each usually a wakeup on the
//! other CPU), so answers that are the same for every inode are given once for the mount:
//! * `opendir` answers `ENOSYS`: no `OPENDIR`/`RELEASEDIR` at all, and the kernel caches every
//!   listing (as with `FOPEN_CACHE_DIR`). Synthesized directories, whose listings change with
//!   the mapping, are invalidated on every change and carry an mtime that moves with their
//!   listing (see [`FsCore`]'s mapping swap).
//! * `getxattr` answers `ENOSYS`: the kernel answers `EOPNOTSUPP` itself from then on (`ls -l`
//!   asks twice per entry); `listxattr` still answers the empty list.
//! * opens answer `FOPEN_NOFLUSH` (no `FLUSH` on close).
//!
//! What remains per file is `OPEN` (synchronous) and `RELEASE` (asynchronous): an open's reply
//! must carry the passthrough backing id, so FUSE's no-open mode (which would also drop them)
//! would send every read through the daemon. Backing ids stay registered per inode after the
//! last release (see `BackingCache`), so a reopen costs no registration.
//!
//! # Transports
//! Requests reach the daemon over `/dev/fuse` (`fuser`'s loop, `--fuse-threads` workers) or,
//! with `--fuse-transport auto|uring` on a kernel that offers it (Linux >= 6.14, `fuse` module
//! parameter `enable_uring`), over io_uring: one queue per CPU served by threads pinned to that
//! CPU ([`modelfs_fuse_ring`]), so a request and its reply wake no other CPU. On the reference
//! machine that more than halves a round trip (a `statfs`: 9 to 12 us against 25 to 33 us) and
//! takes an open + read 4 KiB + close from 10 to 15x native to 4.6 to 6.4x (BENCHMARKS.md). The ring
//! answers with the same `ModelFs` methods as the `fuser` handlers (`ring.rs` only encodes);
//! `FORGET` and `INTERRUPT` still come over `/dev/fuse`, as does everything if the kernel
//! refuses the ring's registration (then `auto` logs it and goes on, `uring` fails the mount).
//! Passthrough works the same over both: backing ids are per connection, registered through
//! whichever descriptor the open arrived on.
//!
//! # Invalidation
//! Mapping changes return kernel entries to invalidate. They are sent by a dedicated thread,
//! never from a request handler (a notification written while the kernel waits on the same
//! daemon for a reply could deadlock). Entries of removed models go as `notify_delete` (so the
//! kernel forgets their inodes once unused); when a batch reaches a slot's `Detach`, everything
//! before it has been delivered and the thread detaches the slot in the core.

mod mountpoint;
mod ring;

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fuser::{
    BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite,
    Request, SessionACL,
};

use crate::metrics::FuseMetrics;
use crate::vfs::{Attr, FsCore, FsError, Invalidation, Kind, OpenBlob};

pub use mountpoint::{clean_stale_mount, MountpointError};

/// How file data is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PassthroughMode {
    /// Use passthrough when the kernel grants it, read-through otherwise (per file).
    Auto,
    /// Refuse to mount without kernel passthrough support.
    Always,
    /// Always serve reads from the daemon.
    Never,
}

/// How requests reach the daemon.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FuseTransport {
    /// FUSE over io_uring when the kernel offers it (the `fuse` module parameter
    /// `enable_uring`, Linux >= 6.14) and io_uring works here; `/dev/fuse` otherwise.
    Auto,
    /// Refuse to mount without FUSE over io_uring.
    Uring,
    /// Always `/dev/fuse`.
    Dev,
}

#[derive(Clone, Debug)]
pub struct FuseConfig {
    pub passthrough: PassthroughMode,
    pub transport: FuseTransport,
    /// FUSE worker threads. Requests block on disk I/O (read-through) and metadata answers are
    /// microseconds, so a few more threads than cores keeps the queue moving.
    pub threads: usize,
    /// Kernel TTL for entries and attributes inside models. Contents of an inode never change,
    /// so this is long; flips invalidate what they replace.
    pub model_ttl: Duration,
    /// Kernel TTL for the synthesized directories above models. They are invalidated on every
    /// change too; the shorter TTL only bounds the damage of a lost notification.
    pub dir_ttl: Duration,
    /// Read-ahead of the mount's backing device info, in KiB. The kernel default (128) halves
    /// sequential read-through throughput compared to 1024 on the reference machine.
    pub read_ahead_kb: u32,
    /// Passthrough stacking depth: 1 when the blob store is on a plain filesystem, 2 when it is
    /// itself on a stacked one (overlayfs).
    pub max_stack_depth: u32,
}

impl Default for FuseConfig {
    fn default() -> Self {
        Self {
            passthrough: PassthroughMode::Auto,
            transport: FuseTransport::Auto,
            threads: 8,
            model_ttl: Duration::from_secs(24 * 3600),
            dir_ttl: Duration::from_secs(60),
            read_ahead_kb: 1024,
            max_stack_depth: 1,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error(transparent)]
    Mountpoint(#[from] MountpointError),
    #[error("mounting FUSE at {path}: {source}")]
    Mount { path: PathBuf, source: io::Error },
    #[error(
        "--passthrough always, but the kernel did not grant FUSE passthrough (needs Linux >= 6.9)"
    )]
    PassthroughUnavailable,
    #[error("--fuse-transport uring, but {0}")]
    RingUnavailable(String),
}

/// Most idle passthrough backing ids kept per mount (see [`BackingCache`]); fewer when the
/// process may open few files (a quarter of `RLIMIT_NOFILE`): each holds its blob open.
const IDLE_BACKING_LIMIT: usize = 4096;

/// The idle limit for this process: [`IDLE_BACKING_LIMIT`], or a quarter of the soft limit on
/// open files if that is lower.
fn idle_backing_limit() -> usize {
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    IDLE_BACKING_LIMIT.min(usize::try_from(soft / 4).unwrap_or(usize::MAX))
}

/// A registered passthrough backing file: through `fuser` for opens answered on `/dev/fuse`,
/// through the ring's descriptor for opens answered over io_uring (a connection uses one or
/// the other for all its opens; both are ids of the same connection).
enum Backing {
    Dev(BackingId),
    Ring(modelfs_fuse_ring::BackingId),
}

struct BackingEntry {
    id: Arc<Backing>,
    blob: Arc<OpenBlob>,
    handles: usize,
    /// Set while no handle is open: the entry's place in [`BackingCache::idle`].
    idle_since: Option<u64>,
}

/// Passthrough backing ids by inode. The kernel requires every open handle of one inode to use
/// the same id, so an entry lives while handles are open; after the last handle is released it
/// stays *idle* (at most `idle_limit`, the least recently released dropped first), so
/// the next open of the inode skips registering the blob with the kernel again (one ioctl on
/// open and one on release). An idle entry holds its blob open, and with it the blob's store,
/// which only the mapping may keep alive: an entry turns idle only while its blob is the one
/// the mapping serves (else it goes with its last handle), and idle entries are dropped
/// whenever the mapping changes (before the change's invalidations are sent, and again when a
/// retired slot is detached).
struct BackingCache {
    idle_limit: usize,
    by_ino: HashMap<u64, BackingEntry>,
    by_fh: HashMap<u64, u64>,
    /// Idle entries by release order: (sequence number -> inode).
    idle: std::collections::BTreeMap<u64, u64>,
    next_idle: u64,
}

impl BackingCache {
    fn new(idle_limit: usize) -> Self {
        Self {
            idle_limit,
            by_ino: HashMap::new(),
            by_fh: HashMap::new(),
            idle: std::collections::BTreeMap::new(),
            next_idle: 0,
        }
    }

    /// The id for a new handle `fh` of `ino`, if one is cached (open or idle).
    fn reuse(&mut self, ino: u64, fh: u64) -> Option<Arc<Backing>> {
        let entry = self.by_ino.get_mut(&ino)?;
        entry.handles += 1;
        if let Some(seq) = entry.idle_since.take() {
            self.idle.remove(&seq);
        }
        let id = entry.id.clone();
        self.by_fh.insert(fh, ino);
        Some(id)
    }

    fn insert(&mut self, ino: u64, fh: u64, id: Arc<Backing>, blob: Arc<OpenBlob>) {
        self.by_ino.insert(
            ino,
            BackingEntry {
                id,
                blob,
                handles: 1,
                idle_since: None,
            },
        );
        self.by_fh.insert(fh, ino);
    }

    /// Releases `fh`; its inode's entry turns idle with its last handle if `keep` says the
    /// blob is still the one served, else goes. Returns what the caller drops outside the lock
    /// (closing a backing id is an ioctl).
    fn release(&mut self, fh: u64, keep: impl Fn(&OpenBlob) -> bool) -> Vec<BackingEntry> {
        let Some(ino) = self.by_fh.remove(&fh) else {
            return Vec::new();
        };
        let mut evicted = Vec::new();
        if let Some(entry) = self.by_ino.get_mut(&ino) {
            entry.handles -= 1;
            if entry.handles == 0 {
                if keep(&entry.blob) {
                    let seq = self.next_idle;
                    self.next_idle += 1;
                    entry.idle_since = Some(seq);
                    self.idle.insert(seq, ino);
                } else {
                    evicted.extend(self.by_ino.remove(&ino));
                }
            }
        }
        while self.idle.len() > self.idle_limit {
            let Some((_, ino)) = self.idle.pop_first() else {
                break;
            };
            evicted.extend(self.by_ino.remove(&ino));
        }
        evicted
    }

    /// Drops every idle entry (the mapping changed); entries with open handles stay.
    fn drop_idle(&mut self) -> Vec<BackingEntry> {
        let idle = std::mem::take(&mut self.idle);
        idle.into_values()
            .filter_map(|ino| self.by_ino.remove(&ino))
            .collect()
    }
}

/// The adapter's state, shared by the `fuser` session and the ring threads (one clone each).
#[derive(Clone)]
struct ModelFs {
    core: Arc<FsCore>,
    metrics: Arc<FuseMetrics>,
    config: FuseConfig,
    /// Set in `init` when the kernel accepted passthrough; cleared when the daemon turns out to
    /// lack the privilege for it, so later opens skip the doomed attempt.
    passthrough: Arc<AtomicBool>,
    backing: Arc<Mutex<BackingCache>>,
    /// The payload size of the prepared ring when `init` should ask for FUSE over io_uring
    /// (0: do not ask); `ring_granted` says whether the kernel agreed.
    ring_payload: usize,
    ring_granted: Arc<AtomicBool>,
}

/// How an open is answered.
enum Opened {
    Passthrough { fh: u64, id: Arc<Backing> },
    ReadThrough { fh: u64 },
}

fn to_file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: a.mtime,
        mtime: a.mtime,
        ctime: a.mtime,
        crtime: a.mtime,
        kind: match a.kind {
            Kind::Dir => FileType::Directory,
            Kind::File => FileType::RegularFile,
        },
        perm: a.perm,
        nlink: a.nlink,
        uid: 0,
        gid: 0,
        rdev: 0,
        flags: 0,
        // Large buffers for stdio readers: one FUSE request carries at most 1 MiB.
        blksize: 1 << 20,
    }
}

fn file_type(kind: Kind) -> FileType {
    match kind {
        Kind::Dir => FileType::Directory,
        Kind::File => FileType::RegularFile,
    }
}

impl ModelFs {
    fn ttl(&self, a: &Attr) -> Duration {
        if a.immutable {
            self.config.model_ttl
        } else {
            self.config.dir_ttl
        }
    }

    fn fail(&self, op: &'static str, err: &FsError) -> Errno {
        self.metrics.error(op);
        if let FsError::Io { .. } = err {
            tracing::error!(op, error = %err, "filesystem I/O error");
        }
        Errno::from_i32(err.errno())
    }

    fn read_only(&self, op: &'static str) -> Errno {
        self.metrics.request(op);
        self.fail(op, &FsError::ReadOnly)
    }

    /// Opens `ino` for reading: a passthrough backing id when the kernel granted passthrough
    /// (registered with `register`, or the inode's cached one), else a read-through handle.
    fn open_file(
        &self,
        ino: u64,
        flags: i32,
        register: impl FnOnce(&std::fs::File) -> io::Result<Backing>,
    ) -> Result<Opened, Errno> {
        self.metrics.request("open");
        let writes = libc::O_WRONLY | libc::O_RDWR | libc::O_TRUNC | libc::O_APPEND;
        if flags & writes != 0 {
            return Err(self.fail("open", &FsError::ReadOnly));
        }
        let (fh, blob) = self.core.open(ino).map_err(|e| self.fail("open", &e))?;
        if self.passthrough.load(Ordering::Relaxed) {
            if let Some(id) = self.open_passthrough(fh, &blob, register) {
                self.metrics.passthrough_opens.inc();
                self.metrics.open_files.inc();
                return Ok(Opened::Passthrough { fh, id });
            }
            if self.config.passthrough == PassthroughMode::Always {
                self.core.release(fh);
                return Err(self.fail(
                    "open",
                    &FsError::Io {
                        context: "passthrough open".into(),
                        source: io::Error::from_raw_os_error(libc::EIO),
                    },
                ));
            }
            self.metrics.passthrough_fallbacks.inc();
        }
        self.metrics.read_through_opens.inc();
        self.metrics.open_files.inc();
        Ok(Opened::ReadThrough { fh })
    }

    fn open_passthrough(
        &self,
        fh: u64,
        blob: &Arc<OpenBlob>,
        register: impl FnOnce(&std::fs::File) -> io::Result<Backing>,
    ) -> Option<Arc<Backing>> {
        let mut cache = self.backing.lock().expect("backing lock");
        if let Some(id) = cache.reuse(blob.ino, fh) {
            self.metrics.backing_reuses.inc();
            return Some(id);
        }
        match register(&blob.file) {
            Ok(id) => {
                let id = Arc::new(id);
                cache.insert(blob.ino, fh, id.clone(), blob.clone());
                Some(id)
            }
            Err(e) => {
                if e.raw_os_error() == Some(libc::EPERM) {
                    tracing::warn!(
                        "passthrough needs CAP_SYS_ADMIN; serving reads from the daemon"
                    );
                    self.passthrough.store(false, Ordering::Relaxed);
                } else {
                    tracing::warn!(error = %e, ino = blob.ino, "passthrough open failed; serving this file from the daemon");
                }
                None
            }
        }
    }

    /// Releases a file handle (its backing id turns idle or goes, see [`BackingCache`]).
    fn release_file(&self, fh: u64) {
        self.metrics.request("release");
        let evicted = self
            .backing
            .lock()
            .expect("backing lock")
            .release(fh, |blob| self.core.still_serves(blob));
        drop(evicted);
        self.core.release(fh);
        self.metrics.open_files.dec();
    }
}

/// The `Filesystem` methods of operations that would write: each refused with `EROFS`
/// through `read_only`, whatever its arguments (listed by type, in the trait's order after the
/// request).
macro_rules! refuse_writes {
    ($($op:ident($($arg:ty),* $(,)?) -> $reply:ty;)*) => {
        $(
            fn $op(&self, _req: &Request, $(_: $arg,)* reply: $reply) {
                reply.error(self.read_only(stringify!($op)));
            }
        )*
    };
}

impl Filesystem for ModelFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        if self.config.passthrough != PassthroughMode::Never {
            let granted = config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                && config
                    .set_max_stack_depth(self.config.max_stack_depth)
                    .is_ok();
            self.passthrough.store(granted, Ordering::Relaxed);
            if !granted {
                tracing::warn!(
                    "kernel does not offer FUSE passthrough; reads go through the daemon"
                );
            }
        }
        let _ = config.set_max_readahead(self.config.read_ahead_kb.saturating_mul(1024));
        if self.ring_payload > 0 {
            // The largest request is then the ring's payload buffer: nothing is ever written, so
            // `max_write` only sizes buffers (the kernel takes max(max_write, max_pages) for
            // each ring entry).
            let _ = config.set_max_write(self.ring_payload as u32);
            let granted = config
                .add_capabilities(InitFlags::FUSE_OVER_IO_URING)
                .is_ok();
            self.ring_granted.store(granted, Ordering::Relaxed);
        }
        // Every listing with attributes (`READDIRPLUS`), without the kernel's adaptive mode
        // (`FUSE_READDIRPLUS_AUTO` would send plain `READDIR` after the first reply unless a
        // lookup happened in between, so `ls -l` of a large directory would pay one `LOOKUP` per
        // entry after the first buffer). Attributes here are answered from memory and are
        // immutable, so the extra bytes per entry are cheaper than any round trip.
        if config
            .add_capabilities(InitFlags::FUSE_DO_READDIRPLUS)
            .is_err()
        {
            tracing::warn!("kernel does not offer READDIRPLUS; tree walks look up every entry");
        }
        // Lookups and listings in one directory run in parallel (the handlers share nothing but
        // the mapping snapshot); without it the kernel serializes them per directory inode.
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        self.metrics.request("lookup");
        match self.core.lookup(parent.0, name) {
            Ok(a) => reply.entry(&self.ttl(&a), &to_file_attr(&a), Generation(0)),
            Err(e) => reply.error(self.fail("lookup", &e)),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.core.forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        self.metrics.request("getattr");
        match self.core.getattr(ino.0) {
            Ok(a) => reply.attr(&self.ttl(&a), &to_file_attr(&a)),
            Err(e) => reply.error(self.fail("getattr", &e)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let opened = self.open_file(ino.0, flags.0, |file| {
            reply.open_backing(file).map(Backing::Dev)
        });
        match opened {
            Ok(Opened::Passthrough { fh, id }) => match &*id {
                Backing::Dev(id) => {
                    reply.opened_passthrough(FileHandle(fh), FopenFlags::FOPEN_NOFLUSH, id)
                }
                // Only a connection served over io_uring registers through the ring, and all
                // its opens arrive there.
                Backing::Ring(_) => {
                    tracing::error!(
                        ino = ino.0,
                        "an open on /dev/fuse found a ring backing id; answered EIO"
                    );
                    self.release_file(fh);
                    reply.error(Errno::EIO);
                }
            },
            // Content never changes under an inode (keep the page cache between opens), and
            // nothing is ever written (no FLUSH round trip on close).
            Ok(Opened::ReadThrough { fh }) => reply.opened(
                FileHandle(fh),
                FopenFlags::FOPEN_KEEP_CACHE | FopenFlags::FOPEN_NOFLUSH,
            ),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.metrics.request("read");
        match self.core.read(fh.0, offset, size) {
            Ok(data) => {
                self.metrics.read_bytes.inc_by(data.len() as u64);
                reply.data(&data)
            }
            Err(e) => reply.error(self.fail("read", &e)),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.release_file(fh.0);
        reply.ok();
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Opens answer FOPEN_NOFLUSH, so the kernel should never send one; counted to show it.
        self.metrics.request("flush");
        reply.ok();
    }

    /// `ENOSYS`, which the kernel takes for the whole mount: it stops sending `OPENDIR` and
    /// `RELEASEDIR` (a synchronous round trip per directory visited: 2,101 for a `find` over
    /// 1,000 models) and opens every directory as if answered `FOPEN_KEEP_CACHE |
    /// FOPEN_CACHE_DIR`, i.e. keeps listings cached. Inside a model a listing never changes
    /// under an inode number. Synthesized directories change with the mapping: every change
    /// sends `inval_inode` for each one whose listing changed (which drops its cached listing)
    /// and moves its mtime (see `fs::stamp_synth_mtimes`).
    fn opendir(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        self.metrics.request("opendir");
        reply.error(Errno::ENOSYS);
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        self.metrics.request("readdir");
        let result = self.core.readdir(ino.0, offset, |e| {
            reply.add(INodeNo(e.ino), e.offset, file_type(e.kind), &e.name)
        });
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("readdir", &e)),
        }
    }

    /// Entries with their attributes: the kernel caches both, so `find`, `ls -l`, `du` and
    /// loaders that list a model send no `LOOKUP` per entry. The core counts one kernel
    /// reference per entry taken (balanced by `forget`).
    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        self.metrics.request("readdirplus");
        let result = self.core.readdirplus(ino.0, offset, |e, a| {
            reply.add(
                INodeNo(e.ino),
                e.offset,
                &e.name,
                &self.ttl(a),
                &to_file_attr(a),
                Generation(0),
            )
        });
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(self.fail("readdirplus", &e)),
        }
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.metrics.request("releasedir");
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        self.metrics.request("statfs");
        reply.statfs(0, 0, 0, 0, 0, 4096, 255, 4096);
    }

    // Everything that would modify the tree is refused. The mount is also read-only (`ro`), so
    // the kernel answers most of these itself; these handlers are the second line.

    // Every writing operation is refused with `EROFS` (counted, logged at debug level).
    refuse_writes! {
        setattr(
            INodeNo,
            Option<u32>,
            Option<u32>,
            Option<u32>,
            Option<u64>,
            Option<fuser::TimeOrNow>,
            Option<fuser::TimeOrNow>,
            Option<std::time::SystemTime>,
            Option<FileHandle>,
            Option<std::time::SystemTime>,
            Option<std::time::SystemTime>,
            Option<std::time::SystemTime>,
            Option<fuser::BsdFileFlags>
        ) -> ReplyAttr;
        mknod(INodeNo, &OsStr, u32, u32, u32) -> ReplyEntry;
        mkdir(INodeNo, &OsStr, u32, u32) -> ReplyEntry;
        unlink(INodeNo, &OsStr) -> ReplyEmpty;
        rmdir(INodeNo, &OsStr) -> ReplyEmpty;
        symlink(INodeNo, &OsStr, &Path) -> ReplyEntry;
        rename(INodeNo, &OsStr, INodeNo, &OsStr, fuser::RenameFlags) -> ReplyEmpty;
        link(INodeNo, INodeNo, &OsStr) -> ReplyEntry;
        write(
            INodeNo,
            FileHandle,
            u64,
            &[u8],
            fuser::WriteFlags,
            OpenFlags,
            Option<LockOwner>
        ) -> ReplyWrite;
        create(INodeNo, &OsStr, u32, u32, i32) -> ReplyCreate;
        setxattr(INodeNo, &OsStr, &[u8], i32, u32) -> ReplyEmpty;
        removexattr(INodeNo, &OsStr) -> ReplyEmpty;
        fallocate(INodeNo, FileHandle, u64, u64, i32) -> ReplyEmpty;
    }

    /// No entry has extended attributes, and asking for one by name is answered `ENOSYS` once
    /// for the whole mount: the kernel then stops sending `GETXATTR` and answers `EOPNOTSUPP`
    /// itself. Tools ask on every file (`ls -l` asks for the ACL and the SELinux label of each
    /// entry), and a per-file `ENODATA` cost one round trip each: 206,303 of them for `ls -lR`
    /// over 100,000 files, 16 s against 1 s natively. Listing names (`listxattr`, which
    /// `cp -a` and `rsync -X` ask first) still answers the empty list, so copies see a file
    /// without attributes rather than an error. Implemented here (rather than left to
    /// `fuser`'s default, which also answers `ENOSYS`) because the default logs a warning.
    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: fuser::ReplyXattr,
    ) {
        self.metrics.request("getxattr");
        reply.error(Errno::ENOSYS);
    }

    /// The empty list: its size is 0 whatever buffer was offered.
    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: fuser::ReplyXattr) {
        self.metrics.request("listxattr");
        match self.core.getattr(ino.0) {
            Ok(_) if size == 0 => reply.size(0),
            Ok(_) => reply.data(&[]),
            Err(e) => reply.error(self.fail("listxattr", &e)),
        }
    }
}

/// A live mount. Dropping it unmounts.
pub struct MountHandle {
    inner: Mutex<MountInner>,
    mountpoint: PathBuf,
    passthrough: Arc<AtomicBool>,
    uring: bool,
}

struct MountInner {
    session: Option<fuser::BackgroundSession>,
    ring: Option<modelfs_fuse_ring::RunningRing>,
    invalidations: Option<mpsc::Sender<Vec<Invalidation>>>,
    notifier_thread: Option<std::thread::JoinHandle<()>>,
}

impl MountHandle {
    /// Whether the kernel accepted passthrough (and the daemon may use it).
    pub fn passthrough_active(&self) -> bool {
        self.passthrough.load(Ordering::Relaxed)
    }

    /// Whether requests arrive over io_uring (see [`FuseTransport`]).
    pub fn uring_active(&self) -> bool {
        self.uring
    }

    /// Queues kernel cache invalidations (sent in order by the notifier thread). Called after
    /// every mapping change, also with an empty list: the notifier then drops idle passthrough
    /// backing ids, which would otherwise keep a replaced store's blobs open.
    pub fn invalidate(&self, list: Vec<Invalidation>) {
        let inner = self.inner.lock().expect("mount lock");
        if let Some(tx) = &inner.invalidations {
            let _ = tx.send(list);
        }
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Unmounts; if files are still open (busy), detaches lazily so the daemon never hangs on
    /// exit. Idempotent.
    pub fn unmount(&self) -> io::Result<()> {
        let (session, thread, ring) = {
            let mut inner = self.inner.lock().expect("mount lock");
            inner.invalidations.take();
            (
                inner.session.take(),
                inner.notifier_thread.take(),
                inner.ring.take(),
            )
        };
        if let Some(t) = thread {
            let _ = t.join();
        }
        let Some(session) = session else {
            return Ok(());
        };
        match session.umount_and_join() {
            Ok(()) => {
                // The unmount ended the connection, which ends every ring command.
                if let Some(ring) = ring {
                    ring.join();
                }
                Ok(())
            }
            Err(e) => {
                tracing::warn!(error = %e, "unmount failed; detaching the mount");
                mountpoint::detach(&self.mountpoint)
            }
        }
    }
}

impl Drop for MountHandle {
    fn drop(&mut self) {
        if let Err(e) = self.unmount() {
            tracing::error!(error = %e, mountpoint = %self.mountpoint.display(), "unmount failed");
        }
    }
}

/// Mounts the filesystem core at `mountpoint` (cleaning a stale mount left by a crashed daemon
/// first) and starts serving requests on `config.threads` threads.
pub fn mount(
    core: Arc<FsCore>,
    metrics: Arc<FuseMetrics>,
    mountpoint: &Path,
    config: FuseConfig,
) -> Result<MountHandle, MountError> {
    mountpoint::prepare(mountpoint)?;
    let passthrough = Arc::new(AtomicBool::new(false));
    let core_for_notifier = core.clone();
    let backing = Arc::new(Mutex::new(BackingCache::new(idle_backing_limit())));
    let prepared = prepare_ring(&config)?;
    let fs = ModelFs {
        core,
        metrics: metrics.clone(),
        config: config.clone(),
        passthrough: passthrough.clone(),
        backing: backing.clone(),
        ring_payload: prepared.as_ref().map_or(0, |(_, payload)| *payload),
        ring_granted: Arc::new(AtomicBool::new(false)),
    };
    let ring_fs = fs.clone();
    let mut fuse_config = fuser::Config::default();
    fuse_config.mount_options = vec![
        MountOption::RO,
        MountOption::FSName("modelfs".into()),
        MountOption::Subtype("modelfs".into()),
        MountOption::DefaultPermissions,
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoAtime,
    ];
    // Inference pods run as arbitrary users.
    fuse_config.acl = SessionACL::All;
    fuse_config.n_threads = Some(config.threads.max(1));
    fuse_config.clone_fd = true;
    let session =
        fuser::Session::new(fs, mountpoint, &fuse_config).map_err(|source| MountError::Mount {
            path: mountpoint.to_path_buf(),
            source,
        })?;
    let notifier = session.notifier();
    // `INIT` is answered: start the ring before `fuser`'s loop (the kernel holds requests until
    // every queue is registered or one registration fails).
    let ring = match prepared {
        Some((prepared, _)) => start_ring(prepared, &session, ring_fs, &config)?,
        None => None,
    };
    let session = session.spawn().map_err(|source| MountError::Mount {
        path: mountpoint.to_path_buf(),
        source,
    })?;
    let uring = ring.is_some();
    let handle = MountHandle {
        inner: Mutex::new(MountInner {
            session: Some(session),
            ring,
            invalidations: None,
            notifier_thread: None,
        }),
        mountpoint: mountpoint.to_path_buf(),
        passthrough: passthrough.clone(),
        uring,
    };
    if config.passthrough == PassthroughMode::Always && !passthrough.load(Ordering::Relaxed) {
        return Err(MountError::PassthroughUnavailable);
    }
    if let Err(e) = mountpoint::set_read_ahead(mountpoint, config.read_ahead_kb) {
        tracing::warn!(error = %e, "could not raise the mount's read-ahead");
    }
    let (tx, rx) = mpsc::channel::<Vec<Invalidation>>();
    let thread_metrics = metrics;
    let notify_core = core_for_notifier;
    let notifier_thread = Some(
        std::thread::Builder::new()
            .name("fuse-notify".into())
            .spawn(move || {
                let drop_idle_backing = || {
                    let dropped = backing.lock().expect("backing lock").drop_idle();
                    if !dropped.is_empty() {
                        drop(dropped);
                        // The blobs' stores may have lost their last user.
                        notify_core.note_use_ended();
                    }
                };
                for batch in rx {
                    drop_idle_backing();
                    for inv in batch {
                        let result = match &inv {
                            Invalidation::Delete {
                                parent,
                                child,
                                name,
                            } => {
                                notifier.delete(INodeNo(*parent), INodeNo(*child), OsStr::new(name))
                            }
                            Invalidation::Entry { parent, name } => {
                                notifier.inval_entry(INodeNo(*parent), OsStr::new(name))
                            }
                            Invalidation::Inode { ino } => {
                                notifier.inval_inode(INodeNo(*ino), 0, 0)
                            }
                            // Everything before it has been delivered.
                            Invalidation::Detach { slot } => {
                                notify_core.detach(*slot);
                                drop_idle_backing();
                                continue;
                            }
                        };
                        thread_metrics.kernel_invalidations.inc();
                        // ENOENT: the kernel never cached it (ENOTEMPTY: a directory whose
                        // children were looked up again meanwhile; its slot is detached anyway).
                        // Anything else is worth a line.
                        if let Err(e) = result {
                            if e.raw_os_error() != Some(libc::ENOENT) {
                                tracing::debug!(error = %e, ?inv, "kernel invalidation failed");
                            }
                        }
                    }
                }
            })
            .map_err(|source| MountError::Mount {
                path: mountpoint.to_path_buf(),
                source,
            })?,
    );
    {
        let mut inner = handle.inner.lock().expect("mount lock");
        inner.notifier_thread = notifier_thread;
        inner.invalidations = Some(tx);
    }
    Ok(handle)
}

/// The ring's threads and buffers, made before the mount so `init` asks for FUSE over io_uring
/// only if they exist; with the payload size each entry was given.
fn prepare_ring(
    config: &FuseConfig,
) -> Result<Option<(modelfs_fuse_ring::PreparedRing, usize)>, MountError> {
    if config.transport == FuseTransport::Dev {
        return Ok(None);
    }
    if !ring::kernel_offers_uring() {
        if config.transport == FuseTransport::Uring {
            return Err(MountError::RingUnavailable(
                "the kernel does not offer FUSE over io_uring (needs Linux >= 6.14 and the fuse \
                 module parameter enable_uring=1)"
                    .into(),
            ));
        }
        return Ok(None);
    }
    let payload = ring::payload_size(config.read_ahead_kb);
    let queues = modelfs_fuse_ring::possible_cpus().unwrap_or(1).max(1);
    let ring_config = modelfs_fuse_ring::RingConfig {
        threads_per_queue: config.threads.div_ceil(queues).max(1),
        payload_size: payload,
    };
    match modelfs_fuse_ring::prepare(&ring_config) {
        Ok(prepared) => Ok(Some((prepared, payload))),
        Err(e) if config.transport == FuseTransport::Uring => Err(MountError::RingUnavailable(
            format!("io_uring cannot be set up here: {e}"),
        )),
        Err(e) => {
            tracing::warn!(error = %e, "io_uring cannot be set up; serving FUSE over /dev/fuse");
            Ok(None)
        }
    }
}

/// Registers the prepared ring on the session's connection once `INIT` is answered. `None`
/// when requests stay on `/dev/fuse` (the kernel did not grant the ring, or refused a
/// registration), which `--fuse-transport uring` turns into an error.
fn start_ring(
    prepared: modelfs_fuse_ring::PreparedRing,
    session: &fuser::Session<ModelFs>,
    fs: ModelFs,
    config: &FuseConfig,
) -> Result<Option<modelfs_fuse_ring::RunningRing>, MountError> {
    let strict = config.transport == FuseTransport::Uring;
    if !fs.ring_granted.load(Ordering::Relaxed) {
        prepared.cancel();
        if strict {
            return Err(MountError::RingUnavailable(
                "the kernel did not grant FUSE_OVER_IO_URING at INIT".into(),
            ));
        }
        tracing::info!("the kernel did not grant FUSE over io_uring; serving over /dev/fuse");
        return Ok(None);
    }
    let queues = prepared.queues();
    let dev = match std::os::fd::AsFd::as_fd(session).try_clone_to_owned() {
        Ok(fd) => Arc::new(fd),
        Err(e) => {
            // The kernel holds every request until the ring is registered or refused, so a ring
            // that cannot start must still be refused: a registration on a descriptor that is
            // not the connection's cannot be made either, so fail the mount.
            return Err(MountError::RingUnavailable(format!(
                "duplicating the /dev/fuse descriptor failed: {e}"
            )));
        }
    };
    let handler = Arc::new(ring::RingFs::new(fs, dev.clone()));
    let (running, outcome) = prepared.start(dev, handler);
    match outcome {
        Ok(()) => {
            tracing::info!(
                queues,
                "serving FUSE requests over io_uring, one queue per CPU"
            );
            Ok(Some(running))
        }
        Err(e) if strict => Err(MountError::RingUnavailable(format!(
            "the kernel refused the ring's registration: {e}"
        ))),
        Err(e) => {
            tracing::warn!(error = %e, "the kernel refused the io_uring registration; serving FUSE over /dev/fuse");
            Ok(None)
        }
    }
}
