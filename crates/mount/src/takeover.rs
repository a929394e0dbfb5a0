//! Live takeover: the FUSE connection outlives every mount server process.
//!
//! # Why
//! OME's inference pods bind their model path without mount propagation, so a pod keeps the
//! mount instance it started with, and with it the FUSE connection behind it. If the process
//! serving that connection dies and a new one mounts afresh, every new open in every running
//! pod fails (`ENOTCONN`) until the pod is recreated. So no process that can crash or be
//! upgraded may own the connection alone.
//!
//! # The keeper
//! `modelfs keeper` is a process with one job: it holds a duplicate of each mount's
//! `/dev/fuse` descriptor, of its journal ([`crate::fuse::journal`]) and of the directory
//! underneath the mount, and hands them to whichever mount server asks. It parses nothing but
//! its own small messages, reads no request from the connection, and is never upgraded with
//! the mount server (its own DaemonSet on Kubernetes, `updateStrategy: OnDelete`; a detached
//! process of its own in standalone use, started by `modelfs serve`). While it holds the
//! descriptor the kernel keeps the connection, every inode and open file of it, and the
//! requests pods make queue up in the kernel until a server reads them.
//!
//! # A mount server's start
//! 1. Load the persisted mapping (the same inode numbers as before the restart).
//! 2. Ask the keeper for the session of its mountpoint ([`take`]). The keeper answers once
//!    the previous holder's link is closed (its process is gone: two processes must never
//!    serve one connection, they would share its journal). If the mount at the path is that
//!    session's (same device number), [`crate::fuse::resume`] serves it: no `INIT` (the kernel
//!    sends it once per connection), the journal's handles and backing ids restored, the
//!    transports `INIT` negotiated started again, then `FUSE_NOTIFY_RESEND` asks the kernel
//!    to queue again what the dead process had read and not answered. If the session is alive
//!    but nothing is mounted at the path (someone unmounted it while pods kept it), it is
//!    mounted there again.
//! 3. Otherwise (no keeper, no session, a dead connection) it mounts afresh.
//! 4. It deposits its session with the keeper and keeps a link open ([`Holder`]): if the
//!    keeper restarts, the session is deposited again; the link's end tells the keeper this
//!    holder is gone.
//!
//! # Stopping
//! `SIGTERM` hands on: the server exits and leaves the mount to its successor (the requests
//! it had read are resent to the successor). Unmounting is explicit: `modelfs unmount` (the
//! keeper tells the holder to unmount and exit, and drops its own descriptors), or Ctrl-C
//! (`SIGINT`) of a foreground server.
//!
//! # io_uring
//! A connection that negotiated FUSE over io_uring stays on the ring for good (the kernel
//! switches its input queue to the ring once every CPU's queue has an entry). What the kernel
//! (`fs/fuse/dev_uring.c`, Linux 6.18) does with ring entries, and how they outlive a mount
//! server:
//! * Every entry is at all times either *available* (its `REGISTER` or `COMMIT_AND_FETCH`
//!   waits for a request) or *in userspace* (it holds a request). There is no command that
//!   retires an entry.
//! * Copying a request into an available entry's buffers runs as task work of the task that
//!   issued the entry's command (`fuse_uring_send_in_task`); if that task is exiting or dead,
//!   the request ends with `ECANCELED` and its caller gets the error. With rings of its own, a
//!   mount server that dies leaves entries that fail, until its rings are torn down, the next
//!   request of each: about one failed `open` per SIGKILL under a busy pod (measured).
//! * So the keeper makes the rings ([`make_kept_rings`], `modelfs_fuse_ring::kept`): created
//!   with `IORING_SETUP_SQPOLL`, every command is issued by the ring's SQ thread (one per CPU,
//!   pinned to it, for that CPU's rings), a thread of the keeper's process that runs only in
//!   the kernel and that no mount server restart touches. The SQ thread resolves user addresses
//!   in the keeper's memory: the entries' buffers are a memory file
//!   (`modelfs_fuse_ring::memory`) the keeper maps at the address the server uses, and the
//!   server registers `/dev/fuse` as each ring's fixed file. The mount server maps the rings'
//!   queues, submits, wakes the SQ thread when it sleeps and waits for completions with
//!   `io_uring_enter`, which a ring without `SINGLE_ISSUER`/`DEFER_TASKRUN` allows any process.
//!   A request that arrives while no mount server runs is copied into an entry by the SQ thread
//!   and waits as a completion in the ring; the successor takes it from there.
//! * The kernel does not pass io_uring descriptors over `SCM_RIGHTS` (`scm_fp_copy` refuses
//!   them since the unix socket garbage collector stopped tracking rings): the keeper sends
//!   a pidfd of itself and its descriptor numbers, and the server copies the rings with
//!   `pidfd_getfd` (root over root; a node whose Yama `ptrace_scope` is 3 refuses, and the
//!   server falls back to rings of its own, logged).
//! * A successor reads where the dead process left each ring (`modelfs_fuse_ring::kept`):
//!   a completion it never took is a request to answer; a submission without its completion
//!   is a command the kernel holds; otherwise the dead process took the last completion, and
//!   the slot's control word tells a request not yet touched, one being answered (whose copy
//!   is kept) and a complete answer, which it commits. It registers no new entry, so the
//!   number of entries per queue stays what the first mount made.
//! * Fallbacks, each logged: a keeper that does not know the ring request (an older
//!   version) or cannot make SQPOLL rings (io_uring disabled for it, a seccomp profile) leaves
//!   the server rings of its own, with the `ECANCELED` window above; a successor then answers
//!   what the dead process had received through the buffers it finds in the keeper (a commit
//!   the kernel no longer knows is refused and the slot registered afresh), and makes one
//!   request on every CPU ([`crate::fuse::MountHandle::fetch_queued_ring_requests`]), because
//!   a request queued while a queue had no available entry is handed out only when an entry
//!   of that queue commits. A mount server that does not drive kept rings (an older version)
//!   makes the keeper close them at its take: their waiting commands are cancelled, requests
//!   already in their buffers are answered as above. If the keeper dies, its SQ thread takes
//!   the commands with it (`ENOTCONN` completions on a live connection): each ring thread
//!   registers an entry on a ring of its own and serves on.
//!
//! The SQ threads (one per CPU, pinned to it, polling that CPU's rings) cost CPU: each polls
//! for `KEPT_RING_IDLE_MS` after its last work before it sleeps, and their work is charged
//! to the keeper (on Kubernetes, the keeper pod's CPU).
//! BENCHMARKS.md ("Mount server takeover", "Over io_uring") has the figures.

use std::collections::HashMap;
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};
use serde::{Deserialize, Serialize};

use crate::fuse::{Connection, Handover};

/// The keeper's message format; a keeper refuses messages of another.
pub const KEEPER_PROTOCOL: u32 = 1;

/// Longest message (a session's description).
const MESSAGE_MAX: usize = 16 * 1024;

/// Descriptors one message carries at most: a session's four and the keeper's pidfd.
const FDS_MAX: usize = 5;

/// How long the keeper's SQ thread polls its rings after the last work before it sleeps (a
/// mount server wakes it when it submits to a sleeping thread).
const KEPT_RING_IDLE_MS: u32 = 1;

/// Most rings one session may ask the keeper for (entries per CPU times CPUs).
const KEPT_RINGS_MAX: usize = 4096;

/// What the keeper knows of a session besides its descriptors.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionMeta {
    pub mountpoint: PathBuf,
    pub connection: Connection,
    /// The version of the mount server that deposited it.
    pub server: String,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Request {
    /// With three descriptors: `/dev/fuse`, the journal, the directory under the mount.
    Deposit {
        protocol: u32,
        meta: SessionMeta,
        /// The session serves over the rings this keeper made for the mountpoint
        /// ([`Request::Rings`]): keep them with it.
        #[serde(default)]
        kept_rings: bool,
    },
    /// With one descriptor, the io_uring buffers (`modelfs_fuse_ring::memory`): make `count`
    /// rings polled by a thread of the keeper for the mount about to be made at `mountpoint`
    /// (`modelfs_fuse_ring::kept`). Kept for the next deposit of that mountpoint, or dropped
    /// when this connection closes first. A keeper that does not know the request refuses it.
    ///
    /// The kernel does not pass io_uring descriptors over `SCM_RIGHTS` (`scm_fp_copy` refuses
    /// them), so the keeper answers with a pidfd of itself and the rings' descriptor numbers
    /// in its table, and the mount server copies them with `pidfd_getfd` (root over root: the
    /// ptrace access check passes).
    Rings {
        protocol: u32,
        mountpoint: PathBuf,
        count: usize,
    },
    /// Waits up to `wait_ms` for the previous holder to be gone.
    Take {
        protocol: u32,
        mountpoint: PathBuf,
        wait_ms: u64,
        /// The taker accepts a fourth descriptor, the io_uring buffers (a taker that does not
        /// know them gets three).
        #[serde(default)]
        ring: bool,
        /// The taker drives kept rings (a pidfd of the keeper comes last with the session's
        /// descriptors, see [`Request::Rings`]). A taker that does not know them makes the
        /// keeper drop them.
        #[serde(default)]
        kept_rings: bool,
    },
    /// Drops the session; its holder is told to unmount and exit.
    Release {
        protocol: u32,
        mountpoint: PathBuf,
    },
    List {
        protocol: u32,
    },
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
enum Reply {
    Done,
    /// With the session's three descriptors.
    Session {
        meta: SessionMeta,
        holder_gone: bool,
        /// The session's kept rings (then the keeper's pidfd comes last).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kept_rings: Option<KeptRingsMeta>,
    },
    /// Rings made ([`Request::Rings`]), with the keeper's pidfd.
    Rings {
        rings: KeptRingsMeta,
    },
    NoSession,
    Sessions {
        sessions: Vec<SessionMeta>,
    },
    /// Sent unasked to a holder whose session was released.
    Stop,
    /// A release whose holder was told to unmount and exit.
    Stopping,
    Refused {
        reason: String,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    #[error("keeper socket {path}: {source}")]
    Unavailable { path: PathBuf, source: io::Error },
    #[error("keeper: {0}")]
    Protocol(String),
    #[error("keeper refused: {0}")]
    Refused(String),
    #[error("keeper: {0}")]
    Io(#[from] io::Error),
}

/// A session's kept rings: their descriptor numbers in the keeper, and how to map them.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct KeptRingsMeta {
    fds: Vec<i32>,
    layout: Vec<u32>,
}

fn send(sock: &OwnedFd, message: &impl Serialize, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let bytes = serde_json::to_vec(message).map_err(io::Error::other)?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_MAX))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("too many descriptors for one message"));
    }
    rustix::net::sendmsg(
        sock,
        &[IoSlice::new(&bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    Ok(())
}

/// One message and the descriptors that came with it; `None` at the end of the stream.
fn receive<T: for<'de> Deserialize<'de>>(sock: &OwnedFd) -> io::Result<Option<(T, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; MESSAGE_MAX];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_MAX))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        match rustix::net::recvmsg(
            sock,
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(got) => break got,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    if got.bytes == 0 {
        return Ok(None);
    }
    let message = serde_json::from_slice(&buf[..got.bytes])
        .map_err(|e| io::Error::other(format!("malformed keeper message: {e}")))?;
    Ok(Some((message, fds)))
}

fn connect(socket: &Path) -> Result<OwnedFd, KeeperError> {
    let unavailable = |source: io::Error| KeeperError::Unavailable {
        path: socket.to_path_buf(),
        source,
    };
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| unavailable(e.into()))?;
    let short = crate::sockpath::SocketPath::new(socket).map_err(unavailable)?;
    let addr = SocketAddrUnix::new(short.path()).map_err(|e| unavailable(e.into()))?;
    rustix::net::connect(&sock, &addr).map_err(|e| unavailable(e.into()))?;
    Ok(sock)
}

fn ask(sock: &OwnedFd, request: &Request) -> Result<(Reply, Vec<OwnedFd>), KeeperError> {
    send(sock, request, &[])?;
    match receive::<Reply>(sock)? {
        Some((Reply::Refused { reason }, _)) => Err(KeeperError::Refused(reason)),
        Some(reply) => Ok(reply),
        None => Err(KeeperError::Protocol(
            "the keeper closed the connection".into(),
        )),
    }
}

/// Whether a keeper answers at `socket`.
pub fn keeper_running(socket: &Path) -> bool {
    connect(socket)
        .and_then(|s| {
            ask(
                &s,
                &Request::List {
                    protocol: KEEPER_PROTOCOL,
                },
            )
        })
        .is_ok()
}

/// A session taken from the keeper.
pub struct Taken {
    pub meta: SessionMeta,
    pub handover: Handover,
    /// The directory underneath the mount.
    pub under: OwnedFd,
}

/// Asks the keeper for the session of `mountpoint`, waiting up to `wait` for its previous
/// holder to be gone. `Ok(None)`: no session there. An error if the holder is still there
/// after `wait` (a second server must not serve the same connection).
pub fn take(
    socket: &Path,
    mountpoint: &Path,
    wait: Duration,
) -> Result<Option<Taken>, KeeperError> {
    let sock = connect(socket)?;
    let (reply, mut fds) = ask(
        &sock,
        &Request::Take {
            protocol: KEEPER_PROTOCOL,
            mountpoint: mountpoint.to_path_buf(),
            wait_ms: wait.as_millis() as u64,
            ring: true,
            kept_rings: true,
        },
    )?;
    match reply {
        Reply::NoSession => Ok(None),
        Reply::Session {
            meta,
            holder_gone,
            kept_rings,
        } => {
            if !holder_gone {
                return Err(KeeperError::Refused(format!(
                    "another mount server still serves {} (it did not exit within {} s)",
                    mountpoint.display(),
                    wait.as_secs()
                )));
            }
            let keeper = match kept_rings {
                Some(_) => fds.pop(),
                None => None,
            };
            if fds.len() != 3 && fds.len() != 4 {
                return Err(KeeperError::Protocol(format!(
                    "a session came with {} descriptors, not 3 or 4",
                    fds.len()
                )));
            }
            let ring = (fds.len() == 4).then(|| fds.pop().expect("4 descriptors"));
            let under = fds.pop().expect("3 descriptors");
            let journal = fds.pop().expect("3 descriptors");
            let dev = fds.pop().expect("3 descriptors");
            let kept = match (kept_rings, keeper) {
                (Some(k), Some(keeper)) => Some(fetch_rings(&keeper, &k)?),
                _ => None,
            };
            Ok(Some(Taken {
                handover: Handover {
                    dev,
                    journal,
                    ring,
                    kept,
                    connection: meta.connection.clone(),
                },
                meta,
                under,
            }))
        }
        other => Err(KeeperError::Protocol(format!("unexpected reply {other:?}"))),
    }
}

/// Copies the keeper's ring descriptors named in `meta` through `keeper` (its pidfd), each
/// checked to be an io_uring.
fn fetch_rings(
    keeper: &OwnedFd,
    meta: &KeptRingsMeta,
) -> Result<modelfs_fuse_ring::KeptRings, KeeperError> {
    let layout = modelfs_fuse_ring::RingLayout::from_words(&meta.layout)
        .map_err(|e| KeeperError::Protocol(e.to_string()))?;
    let mut fds = Vec::with_capacity(meta.fds.len());
    for &number in &meta.fds {
        let fd =
            rustix::process::pidfd_getfd(keeper, number, rustix::process::PidfdGetfdFlags::empty())
                .map_err(|e| {
                    KeeperError::Io(io::Error::other(format!(
                        "copying the keeper's ring descriptor {number} (pidfd_getfd): {e}"
                    )))
                })?;
        let what = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
        if what.as_os_str() != "anon_inode:[io_uring]" {
            return Err(KeeperError::Protocol(format!(
                "the keeper's descriptor {number} is {}, not a ring",
                what.display()
            )));
        }
        fds.push(fd);
    }
    Ok(modelfs_fuse_ring::KeptRings { fds, layout })
}

/// What a keeper sends for its rings: their numbers in its descriptor table and its pidfd.
fn rings_meta(rings: &[OwnedFd], layout: &[u32]) -> io::Result<(KeptRingsMeta, OwnedFd)> {
    let pidfd = rustix::process::pidfd_open(
        rustix::process::getpid(),
        rustix::process::PidfdFlags::empty(),
    )?;
    Ok((
        KeptRingsMeta {
            fds: rings.iter().map(|f| f.as_raw_fd()).collect(),
            layout: layout.to_vec(),
        },
        pidfd,
    ))
}

/// Rings a keeper polls, made for the mount about to be made at `mountpoint`, whose entries'
/// buffers are `memory` (`count` slots): see `modelfs_fuse_ring::kept`. The connection comes
/// back with them: the keeper keeps the rings for the mountpoint's next deposit while it is
/// open, and drops them if it closes first (the mount failed). A keeper of a version before
/// kept rings refuses.
pub fn make_kept_rings(
    socket: &Path,
    mountpoint: &Path,
    memory: BorrowedFd<'_>,
    count: usize,
) -> Result<(modelfs_fuse_ring::KeptRings, OwnedFd), KeeperError> {
    let sock = connect(socket)?;
    send(
        &sock,
        &Request::Rings {
            protocol: KEEPER_PROTOCOL,
            mountpoint: mountpoint.to_path_buf(),
            count,
        },
        &[memory],
    )?;
    match receive::<Reply>(&sock)? {
        Some((Reply::Rings { rings }, mut fds)) if fds.len() == 1 => {
            let kept = fetch_rings(&fds.remove(0), &rings)?;
            if kept.fds.len() != count {
                return Err(KeeperError::Protocol(format!(
                    "{} rings made, {count} asked",
                    kept.fds.len()
                )));
            }
            Ok((kept, sock))
        }
        Some((Reply::Refused { reason }, _)) => Err(KeeperError::Refused(reason)),
        Some((other, _)) => Err(KeeperError::Protocol(format!("unexpected reply {other:?}"))),
        None => Err(KeeperError::Protocol(
            "the keeper closed the connection".into(),
        )),
    }
}

/// What a release did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Released {
    /// The keeper held no session for the mount.
    Nothing,
    /// Dropped; no mount server served it.
    Dropped,
    /// Dropped, and the mount server serving it was told to unmount and exit.
    HolderStopping,
}

/// Drops the session of `mountpoint` from the keeper; its holder (if any) is told to unmount
/// and exit.
pub fn release(socket: &Path, mountpoint: &Path) -> Result<Released, KeeperError> {
    let sock = connect(socket)?;
    let (reply, _) = ask(
        &sock,
        &Request::Release {
            protocol: KEEPER_PROTOCOL,
            mountpoint: mountpoint.to_path_buf(),
        },
    )?;
    Ok(match reply {
        Reply::Stopping => Released::HolderStopping,
        Reply::Done => Released::Dropped,
        _ => Released::Nothing,
    })
}

/// What a holder deposits.
pub struct Deposit {
    pub meta: SessionMeta,
    pub dev: OwnedFd,
    pub journal: OwnedFd,
    pub under: OwnedFd,
    /// The io_uring buffers (`modelfs_fuse_ring::memory`), if requests come over io_uring.
    pub ring: Option<OwnedFd>,
    /// Requests come over rings the keeper polls ([`make_kept_rings`]).
    pub kept_rings: bool,
}

/// What a holder's link reports.
#[derive(Debug, PartialEq, Eq)]
pub enum HolderEvent {
    /// The session was released (`modelfs unmount`): unmount and exit.
    Stop,
}

/// A mount server's link to the keeper: deposits its session and deposits it again whenever
/// the keeper comes back; the link's end tells the keeper the holder is gone.
pub struct Holder {
    shared: Arc<HolderShared>,
}

struct HolderShared {
    socket: PathBuf,
    deposit: Mutex<Option<Arc<Deposit>>>,
    /// Bumped when the deposit changes (a fresh mount after the connection died).
    generation: Mutex<u64>,
    deposited: Mutex<u64>,
    deposited_cv: Condvar,
}

/// How often a holder retries a keeper that is away.
const RECONNECT: Duration = Duration::from_millis(250);

impl Holder {
    /// Starts the link thread; `on_event` is called from it.
    pub fn start(
        socket: PathBuf,
        deposit: Deposit,
        on_event: impl Fn(HolderEvent) + Send + 'static,
    ) -> io::Result<Self> {
        let shared = Arc::new(HolderShared {
            socket,
            deposit: Mutex::new(Some(Arc::new(deposit))),
            generation: Mutex::new(1),
            deposited: Mutex::new(0),
            deposited_cv: Condvar::new(),
        });
        let thread_shared = shared.clone();
        std::thread::Builder::new()
            .name("keeper-link".into())
            .spawn(move || thread_shared.run(&on_event))?;
        Ok(Self { shared })
    }

    /// Replaces the deposited session (a new connection).
    pub fn replace(&self, deposit: Deposit) {
        *lock(&self.shared.deposit) = Some(Arc::new(deposit));
        *lock(&self.shared.generation) += 1;
    }

    /// Ends the link without a word to the keeper (the session is being released).
    pub fn close(&self) {
        *lock(&self.shared.deposit) = None;
        *lock(&self.shared.generation) += 1;
    }

    /// Waits up to `timeout` until the current session is deposited; whether it is.
    pub fn wait_deposited(&self, timeout: Duration) -> bool {
        let want = *lock(&self.shared.generation);
        let deadline = Instant::now() + timeout;
        let mut got = lock(&self.shared.deposited);
        while *got < want {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            got = self
                .shared
                .deposited_cv
                .wait_timeout(got, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl HolderShared {
    fn run(&self, on_event: &dyn Fn(HolderEvent)) {
        let mut warned = false;
        let mut old_keeper = false;
        loop {
            let generation = *lock(&self.generation);
            let Some(deposit) = lock(&self.deposit).clone() else {
                return;
            };
            let sock = match connect(&self.socket) {
                Ok(s) => s,
                Err(e) => {
                    if !warned {
                        tracing::warn!(error = %e, "no keeper: the mount will not survive this process until one runs");
                        warned = true;
                    }
                    std::thread::sleep(RECONNECT);
                    continue;
                }
            };
            let request = Request::Deposit {
                protocol: KEEPER_PROTOCOL,
                meta: deposit.meta.clone(),
                kept_rings: deposit.kept_rings,
            };
            let mut fds = vec![
                deposit.dev.as_fd(),
                deposit.journal.as_fd(),
                deposit.under.as_fd(),
            ];
            if let (Some(ring), false) = (&deposit.ring, old_keeper) {
                fds.push(ring.as_fd());
            }
            let outcome = send(&sock, &request, &fds).and_then(|_| receive::<Reply>(&sock));
            match outcome {
                Ok(Some((Reply::Done, _))) => {}
                Ok(Some((Reply::Refused { .. }, _))) if fds.len() == 4 => {
                    // A keeper of a version before the io_uring buffers: it keeps the
                    // session, and a successor cannot answer what this process received.
                    tracing::warn!("the keeper takes no io_uring buffers; depositing without them");
                    old_keeper = true;
                    continue;
                }
                Ok(Some((Reply::Refused { reason }, _))) => {
                    tracing::error!(reason, "the keeper refused the session");
                    std::thread::sleep(RECONNECT * 4);
                    continue;
                }
                other => {
                    tracing::warn!(?other, "depositing the session with the keeper failed");
                    std::thread::sleep(RECONNECT);
                    continue;
                }
            }
            if warned {
                tracing::info!("the keeper holds the mount again");
                warned = false;
            }
            *lock(&self.deposited) = generation;
            self.deposited_cv.notify_all();
            // Wait for the keeper to go away, to say stop, or for a new deposit.
            loop {
                let readable = wait_readable(&sock, Duration::from_millis(200));
                if readable {
                    match receive::<Reply>(&sock) {
                        Ok(Some((Reply::Stop, _))) => {
                            // A holder that closed its link is releasing the session itself.
                            if lock(&self.deposit).is_some() {
                                on_event(HolderEvent::Stop);
                            }
                            return;
                        }
                        Ok(Some(_)) => continue,
                        Ok(None) | Err(_) => {
                            tracing::warn!("the keeper went away; depositing the session again once it is back");
                            break;
                        }
                    }
                }
                if *lock(&self.generation) != generation {
                    break;
                }
            }
        }
    }
}

fn wait_readable(sock: &OwnedFd, timeout: Duration) -> bool {
    let mut fds = [rustix::event::PollFd::new(
        sock,
        rustix::event::PollFlags::IN,
    )];
    let ts = rustix::event::Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    matches!(rustix::event::poll(&mut fds, Some(&ts)), Ok(n) if n > 0)
}

// ---------------------------------------------------------------------------------------
// The keeper process.

/// Rings the keeper polls for one connection, and the mapping of their buffers the kernel
/// uses through the keeper's memory (`modelfs_fuse_ring::kept`). Fields drop in order: the
/// rings go before the buffers.
struct Kept {
    rings: Vec<OwnedFd>,
    layout: Vec<u32>,
    _memory: Arc<modelfs_fuse_ring::RingMemory>,
}

struct Held {
    meta: SessionMeta,
    dev: OwnedFd,
    journal: OwnedFd,
    under: OwnedFd,
    ring: Option<OwnedFd>,
    kept: Option<Kept>,
    /// The connection of the process that deposited it, while open.
    holder: Option<u64>,
}

#[derive(Default)]
struct KeeperState {
    sessions: HashMap<PathBuf, Held>,
    /// Rings made for a mount not yet deposited, by mountpoint, with the client connection
    /// that asked (they are dropped when it closes).
    prepared: HashMap<PathBuf, (u64, Kept)>,
    /// Open client connections (a holder's link gets `Stop` through it).
    links: HashMap<u64, Arc<OwnedFd>>,
    ever_held: bool,
}

struct Keeper {
    state: Mutex<KeeperState>,
    changed: Condvar,
}

/// Options of `modelfs keeper`.
#[derive(Clone, Debug)]
pub struct KeeperConfig {
    pub socket: PathBuf,
    /// Exit once no session is held any more (standalone use: the keeper `modelfs serve`
    /// starts), or after a minute if none was ever deposited.
    pub exit_when_empty: bool,
    /// Start a new session first: a Ctrl-C or a kill of the process group of the server that
    /// started it does not reach it.
    pub detach: bool,
}

/// Detaches the mount at `path` (lazily: open files keep working until closed).
pub fn detach_mount(path: &Path) -> io::Result<()> {
    rustix::mount::unmount(path, rustix::mount::UnmountFlags::DETACH).map_err(io::Error::from)
}

/// Binds the keeper's socket: its directory is created 0700 if missing (an existing one keeps
/// its mode), a stale socket nobody answers on is replaced, anything else at the path is an
/// error.
fn bind(path: &Path) -> anyhow::Result<OwnedFd> {
    use anyhow::Context;
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .context("the keeper socket path has no directory")?;
    if !parent.exists() {
        std::fs::create_dir_all(parent)?;
        std::fs::set_permissions(parent, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if keeper_running(path) {
                anyhow::bail!("a keeper already answers on {}", path.display());
            }
            std::fs::remove_file(path)?;
        }
        Ok(_) => anyhow::bail!("{} exists and is not a socket", path.display()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let short = crate::sockpath::SocketPath::new(path)?;
    rustix::net::bind(&sock, &SocketAddrUnix::new(short.path())?)
        .with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    rustix::net::listen(&sock, 16)?;
    Ok(sock)
}

/// Runs the keeper until it is told to exit (never, unless `exit_when_empty`).
pub fn run_keeper(config: KeeperConfig) -> anyhow::Result<()> {
    if config.detach {
        let _ = rustix::process::setsid();
    }
    let listener = bind(&config.socket)?;
    tracing::info!(socket = %config.socket.display(), "keeper listening");
    let keeper = Arc::new(Keeper {
        state: Mutex::new(KeeperState::default()),
        changed: Condvar::new(),
    });
    let watch = keeper.clone();
    std::thread::Builder::new()
        .name("keeper-watch".into())
        .spawn(move || watch.watch_connections())?;
    let started = Instant::now();
    let mut next_link = 1u64;
    loop {
        if config.exit_when_empty {
            let st = lock(&keeper.state);
            let empty = st.sessions.is_empty();
            if empty && (st.ever_held || started.elapsed() > Duration::from_secs(60)) {
                tracing::info!("no session left to keep; the keeper exits");
                return Ok(());
            }
        }
        let mut fds = [rustix::event::PollFd::new(
            &listener,
            rustix::event::PollFlags::IN,
        )];
        let ts = rustix::event::Timespec {
            tv_sec: 1,
            tv_nsec: 0,
        };
        match rustix::event::poll(&mut fds, Some(&ts)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(e.into()),
        }
        let sock = match rustix::net::accept_with(&listener, SocketFlags::CLOEXEC) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                continue;
            }
        };
        match rustix::net::sockopt::socket_peercred(&sock) {
            Ok(cred) if cred.uid.is_root() => {}
            Ok(cred) => {
                tracing::warn!(
                    uid = cred.uid.as_raw(),
                    "refused a keeper client that is not root"
                );
                let _ = send(
                    &sock,
                    &Reply::Refused {
                        reason: "only root may talk to the keeper".into(),
                    },
                    &[],
                );
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "keeper client credentials unreadable");
                continue;
            }
        }
        let id = next_link;
        next_link += 1;
        let sock = Arc::new(sock);
        lock(&keeper.state).links.insert(id, sock.clone());
        let k = keeper.clone();
        std::thread::Builder::new()
            .name(format!("keeper-client-{id}"))
            .spawn(move || {
                k.serve_client(id, &sock);
                k.client_gone(id);
            })?;
    }
}

impl Keeper {
    fn serve_client(&self, id: u64, sock: &OwnedFd) {
        loop {
            let (request, mut fds) = match receive::<Request>(sock) {
                Ok(Some(r)) => r,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "keeper client sent a bad message");
                    let _ = send(
                        sock,
                        &Reply::Refused {
                            reason: e.to_string(),
                        },
                        &[],
                    );
                    return;
                }
            };
            let protocol = match &request {
                Request::Deposit { protocol, .. }
                | Request::Rings { protocol, .. }
                | Request::Take { protocol, .. }
                | Request::Release { protocol, .. }
                | Request::List { protocol } => *protocol,
            };
            if protocol != KEEPER_PROTOCOL {
                let _ = send(
                    sock,
                    &Reply::Refused {
                        reason: format!(
                            "keeper protocol {protocol} asked, this keeper speaks {KEEPER_PROTOCOL}"
                        ),
                    },
                    &[],
                );
                return;
            }
            let result = match request {
                Request::Deposit {
                    meta, kept_rings, ..
                } => {
                    if !(fds.len() == 3 || fds.len() == 4) || !is_fuse_device(&fds[0]) {
                        send(
                            sock,
                            &Reply::Refused {
                                reason: "a deposit carries /dev/fuse, the journal, the directory under the mount and maybe the io_uring buffers".into(),
                            },
                            &[],
                        )
                    } else {
                        let ring = (fds.len() == 4).then(|| fds.pop().expect("4"));
                        let under = fds.pop().expect("3");
                        let journal = fds.pop().expect("3");
                        let dev = fds.pop().expect("3");
                        tracing::info!(mountpoint = %meta.mountpoint.display(), server = %meta.server, kept_rings, "session deposited");
                        let mut st = lock(&self.state);
                        st.ever_held = true;
                        // The rings made for this mount, or (a successor depositing what it
                        // took) the ones the session already has.
                        let kept = if kept_rings {
                            let made = st.prepared.remove(&meta.mountpoint).map(|(_, k)| k);
                            made.or_else(|| {
                                st.sessions
                                    .get_mut(&meta.mountpoint)
                                    .filter(|h| h.meta.connection.dev == meta.connection.dev)
                                    .and_then(|h| h.kept.take())
                            })
                        } else {
                            None
                        };
                        if kept_rings && kept.is_none() {
                            tracing::warn!(mountpoint = %meta.mountpoint.display(), "a deposit names kept rings this keeper does not have (it restarted?)");
                        }
                        st.sessions.insert(
                            meta.mountpoint.clone(),
                            Held {
                                meta,
                                dev,
                                journal,
                                under,
                                ring,
                                kept,
                                holder: Some(id),
                            },
                        );
                        drop(st);
                        self.changed.notify_all();
                        send(sock, &Reply::Done, &[])
                    }
                }
                Request::Rings {
                    mountpoint, count, ..
                } => self.make_rings(sock, id, mountpoint, count, fds),
                Request::Take {
                    mountpoint,
                    wait_ms,
                    ring,
                    kept_rings,
                    ..
                } => self.take(
                    sock,
                    id,
                    &mountpoint,
                    Duration::from_millis(wait_ms),
                    ring,
                    kept_rings,
                ),
                Request::Release { mountpoint, .. } => {
                    let held = lock(&self.state).sessions.remove(&mountpoint);
                    match held {
                        Some(held) => {
                            tracing::info!(mountpoint = %mountpoint.display(), "session released");
                            let mut stopping = false;
                            if let Some(holder) = held.holder.filter(|&h| h != id) {
                                let link = lock(&self.state).links.get(&holder).cloned();
                                if let Some(link) = link {
                                    stopping = send(&link, &Reply::Stop, &[]).is_ok();
                                }
                            }
                            drop(held);
                            self.changed.notify_all();
                            let reply = if stopping {
                                Reply::Stopping
                            } else {
                                Reply::Done
                            };
                            send(sock, &reply, &[])
                        }
                        None => send(sock, &Reply::NoSession, &[]),
                    }
                }
                Request::List { .. } => {
                    let sessions = lock(&self.state)
                        .sessions
                        .values()
                        .map(|h| h.meta.clone())
                        .collect();
                    send(sock, &Reply::Sessions { sessions }, &[])
                }
            };
            if result.is_err() {
                return;
            }
        }
    }

    /// Makes the rings of [`Request::Rings`]: maps the buffers (`fds`: their memory file) where
    /// the mount server has them, creates the rings, answers with them and keeps them for the
    /// mountpoint's next deposit.
    fn make_rings(
        &self,
        sock: &OwnedFd,
        id: u64,
        mountpoint: PathBuf,
        count: usize,
        mut fds: Vec<OwnedFd>,
    ) -> io::Result<()> {
        let refuse = |reason: String| {
            tracing::warn!(mountpoint = %mountpoint.display(), reason, "no kept rings");
            send(sock, &Reply::Refused { reason }, &[])
        };
        if fds.len() != 1 || count == 0 || count > KEPT_RINGS_MAX {
            return refuse(format!(
                "a ring request carries the ring buffers and asks 1 to {KEPT_RINGS_MAX} rings"
            ));
        }
        // An earlier attempt for the same mount goes first (its buffers may sit at the
        // address the new ones use).
        lock(&self.state).prepared.remove(&mountpoint);
        let memory = match modelfs_fuse_ring::RingMemory::map_for_keeper(fds.remove(0)) {
            Ok(m) => m,
            Err(e) => return refuse(format!("the ring buffers cannot be mapped here: {e}")),
        };
        if memory.queues() * memory.per_queue() != count {
            return refuse(format!(
                "{count} rings asked for {} ring buffers",
                memory.queues() * memory.per_queue()
            ));
        }
        let made = match modelfs_fuse_ring::create_kept_rings(
            memory.queues(),
            memory.per_queue(),
            KEPT_RING_IDLE_MS,
        ) {
            Ok(m) => m,
            Err(e) => return refuse(format!("io_uring with SQPOLL cannot be set up here: {e}")),
        };
        let layout = made.layout.to_words();
        let (rings, pidfd) = rings_meta(&made.fds, &layout)?;
        send(sock, &Reply::Rings { rings }, &[pidfd.as_fd()])?;
        tracing::info!(mountpoint = %mountpoint.display(), count, "made io_uring rings polled here");
        lock(&self.state).prepared.insert(
            mountpoint,
            (
                id,
                Kept {
                    rings: made.fds,
                    layout,
                    _memory: memory,
                },
            ),
        );
        Ok(())
    }

    fn take(
        &self,
        sock: &OwnedFd,
        id: u64,
        mountpoint: &Path,
        wait: Duration,
        with_ring: bool,
        with_kept: bool,
    ) -> io::Result<()> {
        let deadline = Instant::now() + wait.min(Duration::from_secs(60));
        let mut st = lock(&self.state);
        loop {
            let Some(held) = st.sessions.get_mut(mountpoint) else {
                drop(st);
                return send(sock, &Reply::NoSession, &[]);
            };
            let holder_gone = match held.holder {
                None => true,
                Some(h) => h == id,
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if holder_gone || left.is_zero() {
                if holder_gone && !with_kept && held.kept.is_some() {
                    // A mount server of a version before kept rings registers entries of its
                    // own: the kept ones would take requests nobody reads. Closing the rings
                    // cancels their waiting commands; requests already delivered to them stay
                    // in their buffers, which the taker answers through its own ring.
                    tracing::warn!(mountpoint = %mountpoint.display(), "the taker does not drive kept rings; dropping them");
                    held.kept = None;
                }
                let kept = match held.kept.as_ref().filter(|_| holder_gone && with_kept) {
                    Some(k) => Some(rings_meta(&k.rings, &k.layout)?),
                    None => None,
                };
                let mut fds = vec![held.dev.as_fd(), held.journal.as_fd(), held.under.as_fd()];
                if let (Some(ring), true) = (&held.ring, with_ring) {
                    fds.push(ring.as_fd());
                }
                if let Some((_, pidfd)) = &kept {
                    fds.push(pidfd.as_fd());
                }
                let reply = Reply::Session {
                    meta: held.meta.clone(),
                    holder_gone,
                    kept_rings: kept.as_ref().map(|(m, _)| m.clone()),
                };
                return send(sock, &reply, &fds);
            }
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn client_gone(&self, id: u64) {
        let mut st = lock(&self.state);
        st.links.remove(&id);
        st.prepared.retain(|_, (asker, _)| *asker != id);
        for held in st.sessions.values_mut() {
            if held.holder == Some(id) {
                tracing::info!(mountpoint = %held.meta.mountpoint.display(), "the holder of a session is gone; keeping it for the next");
                held.holder = None;
            }
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Drops sessions whose connection died (aborted, or unmounted everywhere): `/dev/fuse`
    /// then polls `POLLERR`. Nothing else is read from the connection.
    fn watch_connections(&self) {
        loop {
            std::thread::sleep(Duration::from_millis(500));
            let mut st = lock(&self.state);
            let dead: Vec<PathBuf> = st
                .sessions
                .iter()
                .filter(|(_, h)| connection_dead(&h.dev))
                .map(|(p, _)| p.clone())
                .collect();
            for p in dead {
                tracing::info!(mountpoint = %p.display(), "the connection of a session ended; dropped");
                st.sessions.remove(&p);
            }
            drop(st);
            self.changed.notify_all();
        }
    }
}

fn is_fuse_device(fd: &OwnedFd) -> bool {
    // /dev/fuse is character device 10:229.
    rustix::fs::fstat(fd).is_ok_and(|st| {
        rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::CharacterDevice
            && rustix::fs::major(st.st_rdev) == 10
            && rustix::fs::minor(st.st_rdev) == 229
    })
}

/// Whether a `/dev/fuse` descriptor's connection is gone (`POLLERR`, without reading).
pub fn connection_dead(dev: &OwnedFd) -> bool {
    let mut fds = [rustix::event::PollFd::new(
        dev,
        rustix::event::PollFlags::empty(),
    )];
    let ts = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match rustix::event::poll(&mut fds, Some(&ts)) {
        Ok(n) if n > 0 => fds[0]
            .revents()
            .intersects(rustix::event::PollFlags::ERR | rustix::event::PollFlags::HUP),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// io_uring descriptors cannot cross a unix socket; they are copied from the keeper with
    /// `pidfd_getfd` (here the "keeper" is this process).
    #[test]
    fn kept_rings_are_copied_from_the_keeper_by_number() {
        let made = modelfs_fuse_ring::create_kept_rings(1, 3, KEPT_RING_IDLE_MS).unwrap();
        let layout = made.layout.to_words();
        let (meta, pidfd) = rings_meta(&made.fds, &layout).unwrap();
        let got = fetch_rings(&pidfd, &meta).unwrap();
        assert_eq!(got.layout, made.layout);
        assert_eq!(got.fds.len(), 3);
        for (copy, original) in got.fds.iter().zip(&made.fds) {
            assert!(
                modelfs_fuse_ring::kept::same_open_file(copy.as_fd(), original.as_fd()).unwrap(),
                "the copy is the keeper's ring"
            );
        }
        // A number that is not a ring is refused.
        let not_a_ring = KeptRingsMeta {
            fds: vec![pidfd.as_raw_fd()],
            layout,
        };
        let err = fetch_rings(&pidfd, &not_a_ring).err().unwrap().to_string();
        assert!(err.contains("not a ring"), "{err}");
    }
}
