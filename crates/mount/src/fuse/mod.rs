//! The FUSE adapter: converts between `fuser` types and the filesystem core, maps errors to
//! errno, records metrics, and owns the two kernel-facing mechanisms the core cannot express:
//! passthrough backing files and cache invalidation.
//!
//! # Data path
//! With passthrough (Linux >= 6.9, `CAP_SYS_ADMIN`) `open` registers the blob's file descriptor
//! with the kernel and every read and mmap fault is served by the kernel from the blob file: the
//! daemon never sees a `read`. The kernel requires every open handle of one inode to use the same
//! backing id, so ids are kept per inode in the core's handle table ([`crate::vfs::handles`])
//! while any handle is open, with the blob they were created from, which keeps that blob's
//! store in use even if later handles were opened after a flip to another store (same bytes,
//! other file). This adapter registers ids and records them in the journal; the table decides
//! when one is shared, kept idle or closed.
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
//! last release (see [`crate::vfs::handles`]), so a reopen costs no registration.
//!
//! # Transports
//! `fuser` mounts and answers `FUSE_INIT` (the negotiation: passthrough, READDIRPLUS, the
//! ring); from then on the project's own code serves the connection, so a fresh connection and
//! one resumed from a previous mount server process (see [`crate::takeover`]) are served the
//! same way. Requests reach the daemon over `/dev/fuse` ([`modelfs_fuse_ring::serve_dev`],
//! `--fuse-threads` workers) or, with `--fuse-transport auto|uring` on a kernel that offers it
//! (Linux >= 6.14, `fuse` module parameter `enable_uring`), over io_uring: one queue per CPU
//! served by threads pinned to that CPU ([`modelfs_fuse_ring`]), so a request and its reply
//! wake no other CPU. On the reference machine that more than halves a round trip (a
//! `statfs`: 9 to 12 us against 25 to 33 us) and takes an open + read 4 KiB + close from 10
//! to 15x native to 4.6 to 6.4x (BENCHMARKS.md). Both transports only decode and encode; one
//! answer layer decides ([`answers`]). `FORGET` and `INTERRUPT` still come over `/dev/fuse`,
//! as does everything if the kernel refuses the ring's registration (then `auto` logs it and
//! goes on, `uring` fails the mount). Passthrough backing ids are per connection, registered
//! through its descriptor. With a keeper the rings are the keeper's (`FuseConfig::ring_keeper`,
//! [`crate::takeover`], "io_uring"), so no request fails across a restart; a keeper that
//! cannot make them leaves `auto` on `/dev/fuse` (rings of this process would fail requests
//! across a restart) and `uring` on rings of this process.
//!
//! # What outlives the process
//! Inode numbers are stable (the persisted mapping gives the same numbers again); open file
//! handles and registered backing ids are recorded in a journal ([`journal`]) that travels
//! with the connection's descriptor, so a successor answers every handle the kernel still
//! holds and gives new opens of an inode the backing id its open handles use. Over io_uring
//! the entries' buffers travel too, so a successor answers what this process had received.
//!
//! # Invalidation
//! Mapping changes return kernel entries to invalidate. They are sent by a dedicated thread,
//! never from a request handler (a notification written while the kernel waits on the same
//! daemon for a reply could deadlock). Entries of removed models go as `notify_delete` (so the
//! kernel forgets their inodes once unused); when a batch reaches a slot's `Detach`, everything
//! before it has been delivered and the thread detaches the slot in the core.

mod answers;
pub mod journal;
mod mountpoint;

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use fuser::{Errno, Filesystem, InitFlags, KernelConfig, MountOption, Request, SessionACL};
use modelfs_fuse_ring::{BackingId, Ended, Notifier, RunningDev, RunningRing};
use serde::{Deserialize, Serialize};

use self::journal::{Entry, Journal};

use crate::metrics::FuseMetrics;
use crate::vfs::{Attr, Backing, FsCore, FsError, Invalidation, Mode, Unregistered};

pub use mountpoint::{
    clean_stale_mount, mount_info_dev, topmost_mount, MountLine, MountpointError,
};

/// How file data is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PassthroughMode {
    /// Use passthrough when the kernel grants it, read-through otherwise (per file).
    Auto,
    /// Refuse to mount without kernel passthrough support.
    Always,
    /// Always serve reads from the daemon.
    Never,
}

/// How requests reach the daemon.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    /// Map the io_uring entries' buffers at a fixed address (`modelfs_fuse_ring::memory`), so
    /// a successor can map them again and answer what this process had received and not
    /// answered (with a keeper).
    pub ring_takeover: bool,
    /// The keeper's socket (with `ring_takeover`): the rings are made and polled by the keeper
    /// (`modelfs_fuse_ring::kept`), so a request that reaches them while no mount server runs
    /// waits there for the next one instead of failing. A keeper that cannot (an older
    /// version, io_uring's SQPOLL refused) leaves this process its own rings, said in the log.
    pub ring_keeper: Option<PathBuf>,
    /// How long an open of a file not yet verified waits before it fails with `ETIMEDOUT`
    /// (serving while downloading, see [`crate::vfs::pending`]).
    pub pending_wait: Duration,
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
            ring_takeover: false,
            ring_keeper: None,
            pending_wait: crate::vfs::DEFAULT_PENDING_WAIT,
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

/// Most idle passthrough backing ids kept per mount (see [`crate::vfs::handles`]); fewer when the
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

/// The adapter's state, shared by the `fuser` session and the ring threads (one clone each).
#[derive(Clone)]
struct ModelFs {
    core: Arc<FsCore>,
    metrics: Arc<FuseMetrics>,
    config: FuseConfig,
    /// Set in `init` when the kernel accepted passthrough; cleared when the daemon turns out to
    /// lack the privilege for it, so later opens skip the doomed attempt.
    passthrough: Arc<AtomicBool>,
    /// The largest request or reply (`max_write` at `INIT`): the `/dev/fuse` threads' and the
    /// ring entries' buffers are this size.
    payload: usize,
    /// `init` asks for FUSE over io_uring (a ring is prepared); `ring_granted` says whether
    /// the kernel agreed.
    ask_ring: bool,
    ring_granted: Arc<AtomicBool>,
    /// Open handles and backing ids, for a successor (module docs).
    journal: Arc<Journal>,
    io_errors: Arc<LogLimit>,
}

/// The same I/O error of requests is logged at most once per [`LogLimit::INTERVAL`], with
/// the number of repeats left out since its last line: a loader retrying a file it cannot
/// read (a blob the server refuses, a failing disk) must not grow the log by a line per
/// request, while each distinct error still shows. Every error is counted in the metrics
/// (`modelfs_fuse_errors_total`).
#[derive(Default)]
struct LogLimit {
    /// By error text: when its last line was written, and the repeats left out since.
    seen: Mutex<HashMap<String, (std::time::Instant, u64)>>,
}

impl LogLimit {
    const INTERVAL: Duration = Duration::from_secs(10);
    /// Distinct errors remembered; beyond that the oldest memory is dropped wholesale.
    const KEEP: usize = 1024;

    /// `Some(repeats left out before this one)` if this error is to be logged now.
    fn admit(&self, error: &str, now: std::time::Instant) -> Option<u64> {
        let mut seen = lock(&self.seen);
        if let Some((last, left_out)) = seen.get_mut(error) {
            if now.duration_since(*last) < Self::INTERVAL {
                *left_out += 1;
                return None;
            }
            let repeats = *left_out;
            *last = now;
            *left_out = 0;
            return Some(repeats);
        }
        if seen.len() >= Self::KEEP {
            seen.clear();
        }
        seen.insert(error.to_string(), (now, 0));
        Some(0)
    }
}

/// A journal write failed: the successor of this process would not know of one handle or
/// backing id. Serving goes on; the failure is counted (`modelfs_fuse_errors_total{op="journal"}`)
/// and logged at most once per [`LogLimit::INTERVAL`] with the repeats left out (it needs
/// memory to be short, which fails every open alike). Returns whether a line was written.
fn journal_outcome(
    metrics: &FuseMetrics,
    limit: &LogLimit,
    result: io::Result<()>,
    now: std::time::Instant,
) -> bool {
    let Err(e) = result else {
        return false;
    };
    metrics.error("journal");
    let text = e.to_string();
    match limit.admit(&format!("journal: {text}"), now) {
        Some(left_out) => {
            tracing::error!(error = %text, left_out, "recording an open file for a successor failed");
            true
        }
        None => false,
    }
}

/// How an open is answered.
enum Opened {
    Passthrough { fh: u64, id: u32 },
    ReadThrough { fh: u64 },
}

impl Backing for BackingId {
    fn id(&self) -> u32 {
        BackingId::id(self)
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
            let text = err.to_string();
            if let Some(left_out) = self.io_errors.admit(&text, std::time::Instant::now()) {
                tracing::error!(op, error = %text, left_out, "filesystem I/O error");
            }
        }
        Errno::from_i32(err.errno())
    }

    fn read_only(&self, op: &'static str) -> Errno {
        self.metrics.request(op);
        self.fail(op, &FsError::ReadOnly)
    }

    /// Opens `ino` for reading: a passthrough backing id when the kernel granted passthrough
    /// (registered with `register`, or the inode's own one), else a read-through handle.
    fn open_file(
        &self,
        ino: u64,
        flags: i32,
        register: impl FnOnce(&std::fs::File) -> io::Result<BackingId>,
    ) -> Result<Opened, Errno> {
        self.metrics.request("open");
        let writes = libc::O_WRONLY | libc::O_RDWR | libc::O_TRUNC | libc::O_APPEND;
        if flags & writes != 0 {
            return Err(self.fail("open", &FsError::ReadOnly));
        }
        // One mode per inode (see `crate::vfs::handles`): the core asks for a registration
        // only for an inode that has none, and says whether read-through handles forbid one.
        let passthrough = self.passthrough.load(Ordering::Relaxed);
        let opened = self
            .core
            .open_with(ino, |blob, may_register| {
                if passthrough && may_register {
                    match register(&blob.file) {
                        Ok(id) => {
                            self.journaled(self.journal.backing_registered(blob.ino, id.id()));
                            return Ok(Some(Arc::new(id) as Arc<dyn Backing>));
                        }
                        Err(e) => {
                            if e.raw_os_error() == Some(libc::EPERM) {
                                tracing::warn!(
                                    "passthrough needs CAP_SYS_ADMIN; serving reads from the daemon"
                                );
                                self.passthrough.store(false, Ordering::Relaxed);
                            } else {
                                tracing::warn!(error = %e, ino, "passthrough open failed; serving this file from the daemon");
                            }
                        }
                    }
                }
                if passthrough && self.config.passthrough == PassthroughMode::Always {
                    return Err(FsError::Io {
                        context: "passthrough open".into(),
                        source: io::Error::from_raw_os_error(libc::EIO),
                    });
                }
                if passthrough {
                    self.metrics.passthrough_fallbacks.inc();
                }
                Ok(None)
            })
            .map_err(|e| self.fail("open", &e))?;
        self.journaled(self.journal.handle_opened(opened.fh, ino));
        self.metrics.open_files.inc();
        match opened.mode {
            Mode::Passthrough { backing, reused } => {
                if reused {
                    self.metrics.backing_reuses.inc();
                }
                self.metrics.passthrough_opens.inc();
                Ok(Opened::Passthrough {
                    fh: opened.fh,
                    id: backing.id(),
                })
            }
            Mode::ReadThrough => {
                self.metrics.read_through_opens.inc();
                Ok(Opened::ReadThrough { fh: opened.fh })
            }
        }
    }

    /// Releases a file handle (its backing id turns idle or goes, see [`crate::vfs::handles`]).
    fn release_file(&self, fh: u64) {
        self.metrics.request("release");
        let released = self.core.release(fh);
        if let Some(released) = released {
            self.closing(released.unregistered);
            self.metrics.open_files.dec();
        }
        self.journaled(self.journal.handle_released(fh));
    }
}

impl ModelFs {
    /// See [`journal_outcome`].
    fn journaled(&self, result: io::Result<()>) {
        journal_outcome(
            &self.metrics,
            &self.io_errors,
            result,
            std::time::Instant::now(),
        );
    }

    /// Closes backing ids that left the handle table, recording that first.
    fn closing(&self, gone: Vec<Unregistered>) {
        if gone.is_empty() {
            return;
        }
        for u in &gone {
            self.journaled(self.journal.backing_closed(u.ino));
        }
        drop(gone);
        // Their blobs' stores may have lost their last user.
        self.core.note_use_ended();
    }
}

/// `fuser` mounts and answers `FUSE_INIT`; its loop never runs (module docs), so `init` is
/// the only method it calls.
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
        // Nothing is ever written, so `max_write` only sizes the largest request, which every
        // transport buffer must hold (the kernel takes max(max_write, max_pages) for each ring
        // entry, and refuses a `/dev/fuse` read into a smaller buffer).
        let _ = config.set_max_write(self.payload as u32);
        if self.ask_ring {
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
}

/// What a successor needs to know of a connection besides its descriptors: what `INIT`
/// negotiated, and which mount it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Connection {
    /// The kernel granted passthrough (and the daemon may use it).
    pub passthrough: bool,
    /// The kernel granted FUSE over io_uring: requests wait in per-CPU queues until entries
    /// are registered, so a successor must register its own.
    pub uring: bool,
    /// The largest request or reply (`max_write` as negotiated, with the read-ahead).
    pub payload: usize,
    /// The mount's device number (`st_dev`), which tells this connection's mount from
    /// another one at the same path.
    pub dev: u64,
}

/// The descriptors of a connection that a process hands to its successor.
pub struct Handover {
    /// The connection's `/dev/fuse` descriptor.
    pub dev: OwnedFd,
    /// The journal's memory file ([`journal`]).
    pub journal: OwnedFd,
    /// The io_uring entries' buffers (`modelfs_fuse_ring::memory`), when requests come over
    /// io_uring.
    pub ring: Option<OwnedFd>,
    /// The rings the keeper polls, when requests come over them (a session taken from the
    /// keeper; a deposit only says so: the keeper has them).
    pub kept: Option<modelfs_fuse_ring::KeptRings>,
    pub connection: Connection,
}

/// A live mount: the connection and the threads serving it. Dropping it does not unmount (a
/// mount server that stops hands its connection on; see [`crate::takeover`]);
/// [`MountHandle::unmount`] does.
pub struct MountHandle {
    inner: Mutex<MountInner>,
    mountpoint: PathBuf,
    passthrough: Arc<AtomicBool>,
    dev: Arc<OwnedFd>,
    journal: Arc<Journal>,
    ring_memory: Option<Arc<modelfs_fuse_ring::RingMemory>>,
    /// Requests come over rings the keeper polls.
    kept_rings: bool,
    /// The connection to the keeper that made those rings (it keeps them for this mount's
    /// deposit while the connection is open).
    _kept_link: Option<OwnedFd>,
    connection: Connection,
    serving: RunningDev,
    resumed: bool,
}

struct MountInner {
    /// The ring's threads end by themselves with the connection.
    _ring: Option<RunningRing>,
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
        self.connection.uring
    }

    /// Whether requests come over rings the keeper polls (`modelfs_fuse_ring::kept`).
    pub fn kept_rings(&self) -> bool {
        self.kept_rings
    }

    /// Whether this process resumed a connection another one served.
    pub fn resumed(&self) -> bool {
        self.resumed
    }

    /// What `INIT` negotiated and which mount this is.
    pub fn connection(&self) -> &Connection {
        &self.connection
    }

    /// Records held in the journal (open handles and backing ids).
    pub fn journal_len(&self) -> usize {
        self.journal.len()
    }

    /// Duplicates of the connection's descriptors, for a successor.
    pub fn handover(&self) -> io::Result<Handover> {
        Ok(Handover {
            dev: self.dev.as_fd().try_clone_to_owned()?,
            journal: self.journal.file().try_clone_to_owned()?,
            ring: match &self.ring_memory {
                Some(m) => Some(m.file().try_clone_to_owned()?),
                None => None,
            },
            kept: None,
            connection: self.connection.clone(),
        })
    }

    /// Queues kernel cache invalidations (sent in order by the notifier thread). Called after
    /// every mapping change, also with an empty list: the notifier then drops idle passthrough
    /// backing ids, which would otherwise keep a replaced store's blobs open.
    pub fn invalidate(&self, list: Vec<Invalidation>) {
        let inner = lock(&self.inner);
        if let Some(tx) = &inner.invalidations {
            let _ = tx.send(list);
        }
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Waits up to `timeout` for the connection to end (unmounted everywhere or aborted: the
    /// `/dev/fuse` threads see `ENODEV`); why it ended.
    pub fn wait_ended(&self, timeout: Duration) -> Option<Ended> {
        self.serving.wait_ended(timeout)
    }

    /// Mounts this connection at the mountpoint again (after someone unmounted it there while
    /// other mount namespaces, the pods', kept it alive): the kernel reuses the connection's
    /// superblock, so new opens at the path and the pods' old ones reach the same inodes.
    pub fn mount_again(&self) -> io::Result<()> {
        let data = format!(
            "fd={},rootmode=40000,user_id=0,group_id=0,default_permissions,allow_other",
            self.dev.as_raw_fd()
        );
        let data = std::ffi::CString::new(data).map_err(io::Error::other)?;
        use rustix::mount::MountFlags;
        rustix::mount::mount(
            "modelfs",
            &self.mountpoint,
            "fuse",
            MountFlags::RDONLY | MountFlags::NODEV | MountFlags::NOSUID | MountFlags::NOATIME,
            Some(data.as_c_str()),
        )
        .map_err(io::Error::from)
    }

    /// Over io_uring, after a takeover: makes one request (a `statfs` of the mount) from a
    /// thread pinned to each CPU, in the background. A request made while no process served
    /// waits in its CPU's queue in the kernel, and new ring entries do not fetch it: the kernel
    /// hands a queued request to an entry only when an entry of that queue commits an answer
    /// (`fs/fuse/dev_uring.c`: registering makes an entry available, committing fetches the
    /// next). Without a request on that CPU the caller would wait until the mount is aborted;
    /// each answer here fetches the next queued request, and so on until the queue is empty.
    pub fn fetch_queued_ring_requests(&self) {
        if !self.connection.uring {
            return;
        }
        let cpus = modelfs_fuse_ring::possible_cpus().unwrap_or(1).max(1);
        for cpu in 0..cpus {
            let path = self.mountpoint.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("fuse-fetch-{cpu}"))
                .spawn(move || {
                    let mut set = rustix::thread::CpuSet::new();
                    set.set(cpu);
                    // An offline CPU makes no request, so nothing waits in its queue.
                    if let Err(e) = rustix::thread::sched_setaffinity(None, &set) {
                        tracing::debug!(cpu, error = %e, "not pinned; no request made there");
                        return;
                    }
                    if let Err(e) = rustix::fs::statfs(&path) {
                        tracing::warn!(cpu, error = %e, "the request that fetches queued FUSE requests failed");
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!(cpu, error = %e, "no thread to fetch queued FUSE requests");
            }
        }
    }

    /// Unmounts; if files are still open (busy), detaches lazily so the daemon never hangs on
    /// exit. Stops the notifier. Idempotent.
    pub fn unmount(&self) -> io::Result<()> {
        let thread = {
            let mut inner = lock(&self.inner);
            inner.invalidations.take();
            inner.notifier_thread.take()
        };
        if let Some(t) = thread {
            let _ = t.join();
        }
        match rustix::mount::unmount(&self.mountpoint, rustix::mount::UnmountFlags::empty()) {
            Ok(()) => Ok(()),
            // Not (or no longer) a mount point: nothing to do.
            Err(rustix::io::Errno::INVAL) => Ok(()),
            Err(e) => {
                tracing::warn!(error = %e, "unmount failed; detaching the mount");
                mountpoint::detach(&self.mountpoint)
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic elsewhere must not turn every later request into an error: the guarded state is
    // left consistent by every holder (no multi-step update spans a panic point).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The adapter state for a connection.
fn model_fs(
    core: Arc<FsCore>,
    metrics: Arc<FuseMetrics>,
    config: &FuseConfig,
    journal: Arc<Journal>,
    payload: usize,
    ask_ring: bool,
) -> ModelFs {
    core.attach_kernel(idle_backing_limit());
    ModelFs {
        core,
        metrics,
        config: config.clone(),
        passthrough: Arc::new(AtomicBool::new(false)),
        payload,
        ask_ring,
        ring_granted: Arc::new(AtomicBool::new(false)),
        journal,
        io_errors: Arc::new(LogLimit::default()),
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
    let mount_err = |source| MountError::Mount {
        path: mountpoint.to_path_buf(),
        source,
    };
    mountpoint::prepare(mountpoint)?;
    let journal = Arc::new(Journal::create().map_err(mount_err)?);
    let prepared = prepare_ring(&config, mountpoint)?;
    let fs = model_fs(
        core,
        metrics,
        &config,
        journal,
        answers::payload_size(config.read_ahead_kb),
        prepared.is_some(),
    );
    let (prepared, ring_memory, kept_link) = match prepared {
        Some(p) => (Some(p.ring), Some(p.memory), p.kept_link),
        None => (None, None, None),
    };
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
    let session = fuser::Session::new(fs.clone(), mountpoint, &fuse_config).map_err(mount_err)?;
    // `INIT` is answered. The session's own loop never runs and its drop would unmount: keep
    // a duplicate of its descriptor and let the session go without dropping it (its state is
    // a descriptor and the mount's path; the connection now belongs to this process's threads
    // and, through the handover, to its successors).
    let dev = std::os::fd::AsFd::as_fd(&session)
        .try_clone_to_owned()
        .map_err(mount_err)?;
    std::mem::forget(session);
    let dev = Arc::new(dev);
    if config.passthrough == PassthroughMode::Always && !fs.passthrough.load(Ordering::Relaxed) {
        let _ = rustix::mount::unmount(mountpoint, rustix::mount::UnmountFlags::DETACH);
        return Err(MountError::PassthroughUnavailable);
    }
    let ring = match prepared {
        Some(prepared) => start_ring(prepared, &dev, &fs, &config)?,
        None => None,
    };
    // Nothing here may touch the mount before its threads serve: a `stat` would wait for an
    // answer from this very thread. The device number comes from the mount table.
    let dev_number = mountpoint::mount_info_dev(mountpoint).ok_or_else(|| {
        mount_err(io::Error::other(
            "the new mount is missing from /proc/self/mountinfo",
        ))
    })?;
    if let Some(memory) = &ring_memory {
        memory.set_tag(dev_number);
    }
    let connection = Connection {
        passthrough: fs.passthrough.load(Ordering::Relaxed),
        uring: ring.is_some(),
        payload: fs.payload,
        dev: dev_number,
    };
    let ring_memory = ring_memory.filter(|_| ring.is_some());
    let kept_link = kept_link.filter(|_| ring.is_some());
    let handle = serve(
        fs,
        dev,
        ring,
        ring_memory,
        kept_link,
        connection,
        mountpoint,
        &config,
        false,
    )?;
    if let Err(e) = mountpoint::set_read_ahead(dev_number, config.read_ahead_kb) {
        tracing::warn!(error = %e, "could not raise the mount's read-ahead");
    }
    Ok(handle)
}

/// Serves a connection another process initialized and served (its [`Handover`]): restores
/// the open handles and backing ids of its journal, starts the transports `INIT` negotiated,
/// then asks the kernel to resend what the previous process read but never answered. The
/// mapping must already be in `core` (the persisted one), so every inode the kernel holds
/// resolves.
pub fn resume(
    core: Arc<FsCore>,
    metrics: Arc<FuseMetrics>,
    mountpoint: &Path,
    config: FuseConfig,
    handover: Handover,
) -> Result<MountHandle, MountError> {
    let mount_err = |source| MountError::Mount {
        path: mountpoint.to_path_buf(),
        source,
    };
    let (journal, entries) = Journal::adopt(handover.journal).map_err(mount_err)?;
    let connection = handover.connection;
    let fs = model_fs(
        core,
        metrics,
        &config,
        Arc::new(journal),
        connection.payload,
        connection.uring,
    );
    // Granted at INIT, and still wanted (a successor may be configured not to use it).
    fs.passthrough.store(
        connection.passthrough && config.passthrough != PassthroughMode::Never,
        Ordering::Relaxed,
    );
    let dev = Arc::new(handover.dev);
    restore(&fs, &dev, entries);
    let mut ring_memory = None;
    let kept = handover.kept.is_some();
    let ring = if connection.uring {
        // The connection's queues hold every request until entries are registered: a ring
        // that cannot be started here leaves the mount hung, so it fails the start (the
        // process exits and is restarted; the connection waits in the keeper).
        let prepared = match handover.kept {
            Some(rings) => {
                // The kept rings' entries point into these buffers, in the keeper's memory
                // as in this process's: no other buffers will do.
                let file = handover.ring.ok_or_else(|| {
                    MountError::RingUnavailable("kept rings came without their buffers".into())
                })?;
                let memory =
                    modelfs_fuse_ring::RingMemory::adopt(file, connection.dev).map_err(|e| {
                        MountError::RingUnavailable(format!("the kept rings' buffers: {e}"))
                    })?;
                ring_memory = Some(memory.clone());
                modelfs_fuse_ring::prepare_kept(memory, rings)
            }
            None => {
                let memory = ring_memory_to_resume(&config, &connection, handover.ring)
                    .map_err(|e| MountError::RingUnavailable(format!("io_uring buffers: {e}")))?;
                ring_memory = Some(memory.clone());
                modelfs_fuse_ring::prepare(memory)
            }
        }
        .map_err(|e| MountError::RingUnavailable(format!("io_uring cannot be set up: {e}")))?;
        fs.ring_granted.store(true, Ordering::Relaxed);
        let strict = FuseConfig {
            transport: FuseTransport::Uring,
            ..config.clone()
        };
        start_ring(prepared, &dev, &fs, &strict)?
    } else {
        None
    };
    let mut handle = serve(
        fs,
        dev,
        ring,
        ring_memory,
        None,
        connection,
        mountpoint,
        &config,
        true,
    )?;
    handle.kept_rings = kept && handle.connection.uring;
    Ok(handle)
}

/// Rebuilds the handle table from a predecessor's journal. A handle whose inode no longer
/// resolves (its model left the mapping before the restart) stays recorded: its reads fail,
/// its release clears it. A backing id is kept for its inode while it resolves, else closed
/// (open files keep their backing file; the id only names it for new opens). An inode's
/// handles without a backing id were read-through: they stay so (one mode per inode).
fn restore(fs: &ModelFs, dev: &Arc<OwnedFd>, entries: Vec<Entry>) {
    let mut inodes: HashMap<u64, (Vec<u64>, Option<u32>)> = HashMap::new();
    for e in entries {
        match e {
            Entry::Handle { fh, ino } => inodes.entry(ino).or_default().0.push(fh),
            Entry::Backing { ino, id } => inodes.entry(ino).or_default().1 = Some(id),
        }
    }
    let mut restored = 0usize;
    let mut lost = 0usize;
    for (ino, (fhs, id)) in inodes {
        let backing = id.map(|id| Arc::new(BackingId::adopt(dev, id)) as Arc<dyn Backing>);
        let outcome = fs.core.restore_inode(ino, &fhs, backing);
        restored += outcome.reopened;
        fs.metrics.open_files.inc_by(outcome.reopened as i64);
        for (fh, e) in &outcome.lost {
            lost += 1;
            tracing::warn!(fh, ino, error = %e, "an open file of the previous process cannot be reopened");
        }
        fs.closing(outcome.unregistered);
    }
    tracing::info!(
        restored,
        lost,
        "open files of the previous process restored"
    );
}

/// Starts the `/dev/fuse` threads and the notifier over a connection whose `INIT` is done.
#[allow(clippy::too_many_arguments)]
fn serve(
    fs: ModelFs,
    dev: Arc<OwnedFd>,
    ring: Option<RunningRing>,
    ring_memory: Option<Arc<modelfs_fuse_ring::RingMemory>>,
    kept_link: Option<OwnedFd>,
    connection: Connection,
    mountpoint: &Path,
    config: &FuseConfig,
    resumed: bool,
) -> Result<MountHandle, MountError> {
    let mount_err = |source| MountError::Mount {
        path: mountpoint.to_path_buf(),
        source,
    };
    // With the ring, /dev/fuse carries only FORGET and INTERRUPT.
    let threads = if ring.is_some() {
        1
    } else {
        config.threads.max(1)
    };
    let handler = Arc::new(answers::Answers::new(fs.clone(), dev.clone(), false));
    let serving = modelfs_fuse_ring::serve_dev(
        dev.clone(),
        handler,
        &modelfs_fuse_ring::DevConfig {
            threads,
            buffer_size: connection.payload + 4096,
        },
    )
    .map_err(mount_err)?;
    if resumed {
        // Everything the previous process read and never answered comes again, to these
        // threads (requests over io_uring are not covered: see `crate::takeover`).
        match Notifier::new(dev.clone()).resend() {
            Ok(()) => {}
            Err(e) => {
                tracing::warn!(error = %e, "the kernel refused FUSE_NOTIFY_RESEND (needs Linux >= 6.9); requests the previous process had read are not answered")
            }
        }
    }
    let notifier_thread = spawn_notifier(&fs, &dev).map_err(mount_err)?;
    Ok(MountHandle {
        inner: Mutex::new(MountInner {
            _ring: ring,
            invalidations: Some(notifier_thread.0),
            notifier_thread: Some(notifier_thread.1),
        }),
        mountpoint: mountpoint.to_path_buf(),
        passthrough: fs.passthrough.clone(),
        dev,
        journal: fs.journal.clone(),
        ring_memory,
        kept_rings: kept_link.is_some(),
        _kept_link: kept_link,
        connection,
        serving,
        resumed,
    })
}

type NotifierThread = (mpsc::Sender<Vec<Invalidation>>, std::thread::JoinHandle<()>);

/// The thread that sends kernel invalidations in order (module docs).
fn spawn_notifier(fs: &ModelFs, dev: &Arc<OwnedFd>) -> io::Result<NotifierThread> {
    let (tx, rx) = mpsc::channel::<Vec<Invalidation>>();
    let fs = fs.clone();
    let notifier = Notifier::new(dev.clone());
    let thread = std::thread::Builder::new()
        .name("fuse-notify".into())
        .spawn(move || {
            let drop_idle_backing = || fs.closing(fs.core.drop_idle_registrations());
            for batch in rx {
                drop_idle_backing();
                for inv in batch {
                    let result = match &inv {
                        Invalidation::Delete {
                            parent,
                            child,
                            name,
                        } => notifier.delete(*parent, *child, name.as_bytes()),
                        Invalidation::Entry { parent, name } => {
                            notifier.inval_entry(*parent, name.as_bytes())
                        }
                        Invalidation::Inode { ino } => notifier.inval_inode(*ino),
                        // Everything before it has been delivered.
                        Invalidation::Detach { slot } => {
                            fs.core.detach(*slot);
                            drop_idle_backing();
                            continue;
                        }
                    };
                    fs.metrics.kernel_invalidations.inc();
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
        })?;
    Ok((tx, thread))
}

/// The ring threads made before a mount, their buffers, and (rings a keeper polls) the
/// connection to the keeper that made them.
struct PreparedWithMemory {
    ring: modelfs_fuse_ring::PreparedRing,
    memory: Arc<modelfs_fuse_ring::RingMemory>,
    kept_link: Option<OwnedFd>,
}

/// New buffers for the ring entries: `config.threads` spread over one queue per possible CPU.
fn new_ring_memory(
    config: &FuseConfig,
    payload: usize,
) -> io::Result<Arc<modelfs_fuse_ring::RingMemory>> {
    let queues = modelfs_fuse_ring::possible_cpus()?;
    let per_queue = config.threads.div_ceil(queues).max(1);
    modelfs_fuse_ring::RingMemory::create(config.ring_takeover, queues, per_queue, payload)
}

/// The ring buffers of the process `connection` was taken over from, mapped where it had them,
/// so its entries' requests can be answered; new buffers if they cannot be had (then a request
/// it had received and not answered waits until the connection ends: said in the log).
fn ring_memory_to_resume(
    config: &FuseConfig,
    connection: &Connection,
    previous: Option<OwnedFd>,
) -> io::Result<Arc<modelfs_fuse_ring::RingMemory>> {
    match previous.map(|fd| modelfs_fuse_ring::RingMemory::adopt(fd, connection.dev)) {
        Some(Ok(m))
            if m.payload() == connection.payload
                && Some(m.queues()) == modelfs_fuse_ring::possible_cpus().ok() =>
        {
            return Ok(m)
        }
        Some(Ok(_)) => tracing::warn!(
            "the previous process's io_uring buffers are laid out for another size or CPU count; requests it had received and not answered are not answered"
        ),
        Some(Err(e)) => tracing::warn!(
            error = %e,
            "the previous process's io_uring buffers cannot be mapped; requests it had received and not answered are not answered"
        ),
        None => tracing::warn!(
            "the previous process left no io_uring buffers; requests it had received and not answered are not answered"
        ),
    }
    let memory = new_ring_memory(config, connection.payload)?;
    memory.set_tag(connection.dev);
    Ok(memory)
}

/// The ring's threads and buffers, made before the mount so `init` asks for FUSE over io_uring
/// only if they exist.
fn prepare_ring(
    config: &FuseConfig,
    mountpoint: &Path,
) -> Result<Option<PreparedWithMemory>, MountError> {
    if config.transport == FuseTransport::Dev {
        return Ok(None);
    }
    if !answers::kernel_offers_uring() {
        if config.transport == FuseTransport::Uring {
            return Err(MountError::RingUnavailable(
                "the kernel does not offer FUSE over io_uring (needs Linux >= 6.14 and the fuse \
                 module parameter enable_uring=1)"
                    .into(),
            ));
        }
        return Ok(None);
    }
    let payload = answers::payload_size(config.read_ahead_kb);
    let prepared = new_ring_memory(config, payload).and_then(|memory| {
        let kept = match (&config.ring_keeper, config.ring_takeover) {
            (Some(keeper), true) => match kept_rings(keeper, mountpoint, &memory) {
                Some(kept) => Some(kept),
                // With a keeper, rings of this process would fail requests across a restart
                // (`crate::takeover`, "io_uring"): `auto` keeps to /dev/fuse instead.
                None if config.transport == FuseTransport::Auto => return Ok(None),
                None => None,
            },
            _ => None,
        };
        let (ring, kept_link) = match kept {
            Some((rings, link)) => (
                modelfs_fuse_ring::prepare_kept(memory.clone(), rings)?,
                Some(link),
            ),
            None => {
                if config.ring_keeper.is_some() {
                    tracing::warn!("--fuse-transport uring: using io_uring rings of this process; requests that reach them while no mount server runs fail with ECANCELED");
                }
                (modelfs_fuse_ring::prepare(memory.clone())?, None)
            }
        };
        Ok(Some(PreparedWithMemory {
            ring,
            memory,
            kept_link,
        }))
    });
    match prepared {
        Ok(Some(prepared)) => Ok(Some(prepared)),
        Ok(None) => {
            tracing::info!("--fuse-transport auto with a keeper that does not poll io_uring rings: serving over /dev/fuse, which a restart resumes without losing a request");
            Ok(None)
        }
        Err(e) if config.transport == FuseTransport::Uring => Err(MountError::RingUnavailable(
            format!("io_uring cannot be set up here: {e}"),
        )),
        Err(e) => {
            tracing::warn!(error = %e, "io_uring cannot be set up; serving FUSE over /dev/fuse");
            Ok(None)
        }
    }
}

/// Rings from the keeper for `memory`'s slots; `None` (logged) if it cannot make them: this
/// process then makes its own, and a restart can fail requests that reach them
/// ([`crate::takeover`], "io_uring").
fn kept_rings(
    keeper: &Path,
    mountpoint: &Path,
    memory: &modelfs_fuse_ring::RingMemory,
) -> Option<(modelfs_fuse_ring::KeptRings, OwnedFd)> {
    let count = memory.queues() * memory.per_queue();
    match crate::takeover::make_kept_rings(keeper, mountpoint, memory.file(), count) {
        Ok(made) => {
            tracing::info!(count, "the keeper polls the io_uring rings");
            Some(made)
        }
        Err(e) => {
            tracing::warn!(error = %e, "the keeper does not poll io_uring rings");
            None
        }
    }
}

/// Registers the prepared ring on the connection once `INIT` is answered. `None` when
/// requests stay on `/dev/fuse` (the kernel did not grant the ring, or refused a
/// registration), which `--fuse-transport uring` turns into an error.
fn start_ring(
    prepared: modelfs_fuse_ring::PreparedRing,
    dev: &Arc<OwnedFd>,
    fs: &ModelFs,
    config: &FuseConfig,
) -> Result<Option<RunningRing>, MountError> {
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
    let handler = Arc::new(answers::Answers::new(fs.clone(), dev.clone(), true));
    let (running, outcome) = prepared.start(dev.clone(), handler);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_io_error_is_logged_once_per_interval_with_the_repeats_left_out() {
        let limit = LogLimit::default();
        let t0 = std::time::Instant::now();
        assert_eq!(limit.admit("a", t0), Some(0));
        for i in 1..1000 {
            assert_eq!(limit.admit("a", t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(limit.admit("b", t0), Some(0), "another error still shows");
        assert_eq!(limit.admit("a", t0 + LogLimit::INTERVAL), Some(999));
        assert_eq!(limit.admit("a", t0 + LogLimit::INTERVAL), None);
    }

    #[test]
    fn journal_write_failures_are_counted_and_logged_once_per_interval() {
        // A journal whose memory file refuses writes (sealed): every record fails.
        let file =
            rustix::fs::memfd_create("journal", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::fcntl_add_seals(&file, rustix::fs::SealFlags::WRITE).unwrap();
        let (journal, _) = Journal::adopt(file).unwrap();
        let metrics = FuseMetrics::new();
        let limit = LogLimit::default();
        let t0 = std::time::Instant::now();
        let logged = (0..1000u64)
            .filter(|fh| {
                let at = t0 + Duration::from_millis(*fh);
                journal_outcome(&metrics, &limit, journal.handle_opened(*fh, 1), at)
            })
            .count();
        assert_eq!(metrics.snapshot().get("fuse_errors/journal"), Some(&1000));
        assert_eq!(logged, 1, "one line for 1,000 failures within the interval");
        let later = t0 + LogLimit::INTERVAL + Duration::from_secs(1);
        assert!(journal_outcome(
            &metrics,
            &limit,
            journal.handle_released(0),
            later
        ));
        assert!(!journal_outcome(&metrics, &limit, Ok(()), later));
        assert_eq!(metrics.snapshot().get("fuse_errors/journal"), Some(&1001));
    }
}
