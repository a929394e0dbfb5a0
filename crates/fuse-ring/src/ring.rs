//! The ring threads: one io_uring per thread, pinned to the CPU of the queue it serves. The
//! ring is the thread's own, or one a keeper process made and polls ([`crate::kept`]), whose
//! commands outlive this process.
//!
//! `unsafe` is confined to this module, [`crate::memory`] and [`crate::kept`], for what the
//! kernel ABI needs and no safe API offers: pushing SQEs whose buffers the kernel writes (a
//! slot of the shared mapping, which each thread's slot keeps mapped until after its ring is
//! dropped). The kernel touches a slot only between a command's submission and its
//! completion: request copies run as task work of the task that issued the entry's command
//! (this thread, or the keeper's SQ thread, which reaches the same file at the same address),
//! replies are read while `COMMIT_AND_FETCH` is issued. Also setting the SQE's `addr` and
//! `len` (the io-uring crate's `UringCmd80` has no setter for `len`), the passthrough backing
//! ioctls, and the mapping itself.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::abi::{self, FileAttr, InHeader, Statfs};
use crate::kept::{self, KeptRing, KeptRings};
use crate::memory::{adoption, Adoption, RingMemory, SlotMemory, SlotState};

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// Request payload bytes a handler sees (names, xattr names). Only writing operations carry
/// more, and they are refused whatever their data.
pub(crate) const REQUEST_PAYLOAD_MAX: usize = 4096;

/// A request taken from the ring.
pub struct Request<'a> {
    pub header: InHeader,
    /// The operation's fixed input structure (`fuse_open_in`, `fuse_read_in`, ...).
    pub op_in: &'a [u8],
    /// The rest of the input (a name), at most 4,096 bytes (only writing operations carry more,
    /// and they are refused whatever their data).
    pub payload: &'a [u8],
}

/// The answer to a [`Request`], written straight into the ring entry's payload buffer.
pub struct Reply<'a> {
    buf: &'a mut [u8],
    len: usize,
    /// Negative errno, 0 for success.
    error: i32,
}

impl Reply<'_> {
    pub fn error(&mut self, errno: i32) {
        self.error = -errno.abs();
        self.len = 0;
    }

    /// Success without data (`RELEASE`, `FLUSH`).
    pub fn empty(&mut self) {
        self.error = 0;
        self.len = 0;
    }

    pub fn entry(&mut self, ttl: Duration, attr: &FileAttr) {
        abi::encode_entry(self.buf, ttl, attr);
        self.ok(abi::ENTRY_OUT_LEN);
    }

    pub fn attr(&mut self, ttl: Duration, attr: &FileAttr) {
        abi::encode_attr_out(self.buf, ttl, attr);
        self.ok(abi::ATTR_OUT_LEN);
    }

    /// An open reply; `backing_id` is used only with [`abi::fopen::PASSTHROUGH`] in `flags`.
    pub fn open(&mut self, fh: u64, flags: u32, backing_id: u32) {
        abi::encode_open(self.buf, fh, flags, backing_id);
        self.ok(abi::OPEN_OUT_LEN);
    }

    pub fn statfs(&mut self, s: &Statfs) {
        abi::encode_statfs(self.buf, s);
        self.ok(abi::STATFS_OUT_LEN);
    }

    /// The size answer of `LISTXATTR`/`GETXATTR` asked with a zero-sized buffer.
    pub fn xattr_size(&mut self, size: u32) {
        self.buf[..abi::GETXATTR_OUT_LEN].fill(0);
        abi::put_u32(self.buf, 0, size);
        self.ok(abi::GETXATTR_OUT_LEN);
    }

    /// A reply of at most `size` bytes (`READ` data, a directory listing), written by `fill`
    /// into the payload buffer, which it sees cut to that size, together with the length so
    /// far (see [`abi::push_dirent`], [`abi::push_direntplus`]).
    pub fn fill(&mut self, size: u32, fill: impl FnOnce(&mut [u8], &mut usize)) {
        let limit = (size as usize).min(self.buf.len());
        let mut len = 0;
        fill(&mut self.buf[..limit], &mut len);
        self.ok(len.min(limit));
    }

    fn ok(&mut self, len: usize) {
        self.error = 0;
        self.len = len;
    }

    pub(crate) fn new(buf: &mut [u8]) -> Reply<'_> {
        Reply {
            buf,
            len: 0,
            error: 0,
        }
    }

    /// The reply's data length and its (negative) errno.
    pub(crate) fn outcome(&self) -> (usize, i32) {
        (self.len, self.error)
    }
}

/// Calls `handler` for `req`; a panic is logged with its reason and answered `EIO` (the
/// request still gets its one answer, and the transport thread lives on).
pub(crate) fn call_handler(handler: &dyn Handler, req: &Request<'_>, reply: &mut Reply<'_>) {
    if let Err(panic) = catch_unwind(AssertUnwindSafe(|| handler.handle(req, reply))) {
        let reason = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        tracing::error!(
            opcode = req.header.opcode,
            reason,
            "FUSE request handler panicked; answered EIO"
        );
        reply.error(libc::EIO);
    }
}

/// The filesystem side of the ring: answers one request (every request is answered: a handler
/// that sets nothing answers success without data).
pub trait Handler: Send + Sync + 'static {
    fn handle(&self, req: &Request<'_>, reply: &mut Reply<'_>);

    /// The kernel dropped `nlookup` references to `ino` (`FORGET`, each entry of a
    /// `BATCH_FORGET`): never answered. Only `/dev/fuse` carries them.
    fn forget(&self, _ino: u64, _nlookup: u64) {}
}

/// The CPUs the kernel may run a task on (`/sys/devices/system/cpu/possible`): the kernel makes
/// one queue per possible CPU and uses the ring only once every one has an entry.
pub fn possible_cpus() -> io::Result<usize> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    parse_cpu_list(text.trim()).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unreadable possible CPU list {text:?}"),
        )
    })
}

/// The number of CPUs in a list like `0-3,8-11`, if they are numbered from 0 without gaps (the
/// kernel names a queue by the CPU number, so gaps would leave queues unserved).
fn parse_cpu_list(list: &str) -> Option<usize> {
    let mut next = 0usize;
    for part in list.split(',') {
        let (lo, hi) = match part.split_once('-') {
            Some((lo, hi)) => (lo.parse::<usize>().ok()?, hi.parse::<usize>().ok()?),
            None => {
                let one = part.parse::<usize>().ok()?;
                (one, one)
            }
        };
        if lo != next || hi < lo {
            return None;
        }
        next = hi + 1;
    }
    (next > 0).then_some(next)
}

/// What a prepared thread needs to register and serve.
struct Start {
    dev: Arc<OwnedFd>,
    handler: Arc<dyn Handler>,
}

struct Worker {
    start: mpsc::Sender<Start>,
    registered: mpsc::Receiver<io::Result<()>>,
    thread: JoinHandle<()>,
}

/// Rings created and buffers allocated, before the mount: a connection asks the kernel for the
/// ring only if all of them exist.
pub struct PreparedRing {
    workers: Vec<Worker>,
    queues: usize,
}

/// Creates one ring per entry of `memory` (`per_queue` per possible CPU), each in its own
/// thread pinned to its queue's CPU. Fails if any ring cannot be created (io_uring disabled by
/// `kernel.io_uring_disabled`, a seccomp filter, memory limits), or if `memory` was laid out
/// for another number of CPUs: then the mount must not ask for the ring. With adopted memory
/// each thread first answers what its slot holds from the previous process
/// ([`crate::memory::adoption`]).
pub fn prepare(memory: Arc<RingMemory>) -> io::Result<PreparedRing> {
    prepare_with(memory, None)
}

/// As [`prepare`], over rings a keeper polls ([`crate::kept`]): one per slot of `memory`, in
/// slot order. With adopted memory each thread first reads where its predecessor left its
/// ring.
pub fn prepare_kept(memory: Arc<RingMemory>, rings: KeptRings) -> io::Result<PreparedRing> {
    if rings.fds.len() != memory.queues() * memory.per_queue() {
        return Err(io::Error::other(format!(
            "{} kept rings for {} ring buffers",
            rings.fds.len(),
            memory.queues() * memory.per_queue()
        )));
    }
    let mut attached = Vec::with_capacity(rings.fds.len());
    for fd in rings.fds {
        attached.push(KeptRing::attach(fd, rings.layout.clone())?);
    }
    prepare_with(memory, Some(attached))
}

fn prepare_with(memory: Arc<RingMemory>, kept: Option<Vec<KeptRing>>) -> io::Result<PreparedRing> {
    let mut kept = kept.map(|k| k.into_iter());
    let queues = possible_cpus()?;
    if memory.queues() != queues {
        return Err(io::Error::other(format!(
            "ring buffers laid out for {} CPUs, {queues} here",
            memory.queues()
        )));
    }
    let per_queue = memory.per_queue();
    let mut prepared = PreparedRing {
        workers: Vec::with_capacity(queues * per_queue),
        queues,
    };
    for qid in 0..queues {
        for n in 0..per_queue {
            let ring = kept.as_mut().and_then(|k| k.next());
            match spawn_worker(qid, n, qid * per_queue + n, memory.clone(), ring) {
                Ok(w) => prepared.workers.push(w),
                Err(e) => {
                    prepared.cancel();
                    return Err(e);
                }
            }
        }
    }
    Ok(prepared)
}

/// Starts the `n`th thread of queue `qid` (slot `index`) and waits until it has its ring.
fn spawn_worker(
    qid: usize,
    n: usize,
    index: usize,
    memory: Arc<RingMemory>,
    kept: Option<KeptRing>,
) -> io::Result<Worker> {
    let (start_tx, start_rx) = mpsc::channel::<Start>();
    let (reg_tx, reg_rx) = mpsc::channel::<io::Result<()>>();
    let (setup_tx, setup_rx) = mpsc::channel::<io::Result<()>>();
    let thread = std::thread::Builder::new()
        .name(format!("fuse-ring-{qid}.{n}"))
        .spawn(move || worker(qid, index, memory, kept, setup_tx, start_rx, reg_tx))?;
    let setup = setup_rx
        .recv()
        .unwrap_or_else(|_| Err(io::Error::other("ring thread ended during its setup")));
    if let Err(e) = setup {
        // The thread ends by itself after a failed setup.
        let _ = thread.join();
        return Err(e);
    }
    Ok(Worker {
        start: start_tx,
        registered: reg_rx,
        thread,
    })
}

impl PreparedRing {
    pub fn queues(&self) -> usize {
        self.queues
    }

    /// Ends the threads without registering (the connection did not get the ring).
    pub fn cancel(self) {
        for w in self.workers {
            drop(w.start);
            let _ = w.thread.join();
        }
    }

    /// Registers every entry on `dev` (the session's `/dev/fuse` descriptor, after `INIT`) and
    /// starts serving. Returns the running threads and whether every registration was accepted;
    /// if one was refused the kernel has turned the ring off for this connection and requests go
    /// to `/dev/fuse`, so the caller only logs it.
    pub fn start(
        self,
        dev: Arc<OwnedFd>,
        handler: Arc<dyn Handler>,
    ) -> (RunningRing, io::Result<()>) {
        for w in &self.workers {
            let _ = w.start.send(Start {
                dev: dev.clone(),
                handler: handler.clone(),
            });
        }
        // Every thread registers at once; their results are collected after.
        let mut outcome = Ok(());
        let mut threads = Vec::with_capacity(self.workers.len());
        for w in self.workers {
            let result = w
                .registered
                .recv()
                .unwrap_or_else(|_| Err(io::Error::other("ring thread ended before registering")));
            if let (Err(e), Ok(())) = (result, &outcome) {
                outcome = Err(e);
            }
            threads.push(w.thread);
        }
        (RunningRing { threads, dev }, outcome)
    }
}

/// The serving threads. They end on their own when the connection ends (unmount or abort).
pub struct RunningRing {
    threads: Vec<JoinHandle<()>>,
    dev: Arc<OwnedFd>,
}

impl RunningRing {
    /// The `/dev/fuse` descriptor the ring serves (for passthrough backing ids).
    pub fn dev(&self) -> &Arc<OwnedFd> {
        &self.dev
    }

    /// Waits for every thread to end (after the connection ended).
    pub fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// One entry's buffers (a slot of the shared [`RingMemory`]) and the iovecs that name them to
/// the kernel.
struct Slot {
    memory: SlotMemory,
    /// In the shared file (a keeper's SQ thread reads them at the same address).
    iov: *const libc::iovec,
}

impl Slot {
    fn new(memory: SlotMemory) -> Self {
        let iov = memory.write_iovecs();
        Self { memory, iov }
    }
}

type OwnRing = IoUring<squeue::Entry128, cqueue::Entry>;

/// The ring an entry's commands go through: one of this thread's own, or one a keeper polls
/// ([`crate::kept`]), whose commands outlive this process.
enum Ring {
    Own(OwnRing),
    Kept(KeptRing),
}

/// How a command names the connection: by this process's descriptor on its own ring, by the
/// fixed file 0 on a kept ring (whose SQ thread resolves descriptors in the keeper).
#[derive(Clone, Copy)]
enum Target {
    Fd(types::Fd),
    Fixed,
}

impl Ring {
    fn target(&self, dev: RawFd) -> Target {
        match self {
            Ring::Own(_) => Target::Fd(types::Fd(dev)),
            Ring::Kept(_) => Target::Fixed,
        }
    }

    /// # Safety
    /// Every buffer the entry points at must stay valid until the ring is dropped (for a kept
    /// ring: in the keeper's memory, which maps the same file at the same address).
    unsafe fn push(&mut self, entry: &squeue::Entry128) -> io::Result<()> {
        match self {
            // SAFETY: forwarded to the caller.
            Ring::Own(ring) => unsafe { push(ring, entry) },
            // SAFETY: forwarded to the caller.
            Ring::Kept(ring) => unsafe { ring.push(entry) },
        }
    }

    /// Submits what is queued; the first completion if the kernel answered at once (a
    /// refusal: an accepted command completes only when a request arrives).
    fn submit_and_peek(&mut self) -> io::Result<Option<i32>> {
        match self {
            Ring::Own(ring) => {
                ring.submit()?;
                Ok(ring.completion().next().map(|cqe| cqe.result()))
            }
            Ring::Kept(ring) => ring.settle(),
        }
    }

    /// Submits what is queued and waits for one completion; its result.
    fn wait_one(&mut self) -> io::Result<i32> {
        match self {
            Ring::Own(ring) => wait_one(ring),
            Ring::Kept(ring) => ring.wait_cqe(),
        }
    }
}

fn new_ring(entries: u32) -> io::Result<OwnRing> {
    // One issuer and task work run only when the thread waits: completions are delivered to the
    // thread as it asks for them, without interrupting it.
    IoUring::<squeue::Entry128, cqueue::Entry>::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(entries)
        .or_else(|_| IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(entries))
}

fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set).map_err(io::Error::from)
}

/// A thread's ring and the buffers its entry points at, with one owner: fields drop in
/// declaration order, so the ring (and with it every command the kernel may still write
/// through) goes before the buffers on every path out, early returns and unwinding included.
struct Entry {
    ring: Ring,
    slot: Slot,
}

impl Entry {
    fn new(memory: &Arc<RingMemory>, index: usize) -> io::Result<Self> {
        Ok(Self {
            ring: Ring::Own(new_ring(2)?),
            slot: Slot::new(memory.slot(index)),
        })
    }

    fn kept(memory: &Arc<RingMemory>, index: usize, ring: KeptRing) -> Self {
        Self {
            ring: Ring::Kept(ring),
            slot: Slot::new(memory.slot(index)),
        }
    }

    /// On a kept ring, first reads where the previous process left it ([`crate::kept`]): a
    /// completion it never took is handed to [`serve`] (a request delivered, untouched); a
    /// command the kernel holds needs nothing; a ring never used is registered. Otherwise the
    /// previous process took the last completion: its slot tells what to do
    /// ([`Self::take_over`]).
    fn resume(
        &mut self,
        dev: RawFd,
        qid: usize,
        handler: &dyn Handler,
        scratch: &mut Vec<u8>,
    ) -> io::Result<Option<i32>> {
        if let Ring::Kept(ring) = &mut self.ring {
            // A submission the previous process made may wait for a sleeping SQ thread.
            ring.wake()?;
            let (submitted, posted, taken) = ring.counters();
            match kept::left(submitted, posted, taken) {
                kept::Left::Completion => {
                    let first = ring.next_cqe();
                    tracing::info!(
                        qid,
                        "a request delivered while no mount server ran waits in a kept ring"
                    );
                    return Ok(first);
                }
                kept::Left::Pending => return Ok(None),
                kept::Left::Unused => return self.register(dev, qid),
                kept::Left::Slot => {}
            }
        }
        self.take_over(dev, qid, handler, scratch)
    }

    /// Answers what the slot holds from a previous process, if anything, and commits it from
    /// this ring, which makes the kernel's entry this thread's; otherwise (nothing held, or the
    /// kernel no longer knows the request) registers the entry afresh. The first completion
    /// if the kernel answered at once, as [`Self::register`].
    fn take_over(
        &mut self,
        dev: RawFd,
        qid: usize,
        handler: &dyn Handler,
        scratch: &mut Vec<u8>,
    ) -> io::Result<Option<i32>> {
        let (state, recorded) = self.slot.memory.state();
        let in_header = abi::u64_at(self.slot.memory.header(), 8);
        let unique = match adoption(state, recorded, in_header) {
            Adoption::Register => return self.register(dev, qid),
            Adoption::Commit(u) => u,
            Adoption::Restore(_) => {
                let (header, payload, save) = self.slot.memory.buffers();
                header.copy_from_slice(&save[..abi::RING_HEADER_LEN]);
                let len = (abi::u32_at(header, abi::RING_PAYLOAD_SZ) as usize)
                    .min(REQUEST_PAYLOAD_MAX)
                    .min(payload.len());
                payload[..len]
                    .copy_from_slice(&save[abi::RING_HEADER_LEN..abi::RING_HEADER_LEN + len]);
                answer(&mut self.slot, handler, scratch)
            }
            Adoption::Answer(_) => answer(&mut self.slot, handler, scratch),
        };
        let target = self.ring.target(dev);
        let commit = uring_cmd(target, CMD_COMMIT_AND_FETCH, qid, unique);
        // SAFETY: as for a registration: the slot outlives the ring.
        unsafe { self.ring.push(&commit) }?;
        let first = self.ring.submit_and_peek()?;
        match first {
            Some(result) if result < 0 => {
                // The kernel no longer holds that request (its answer was committed before
                // the previous process died).
                tracing::debug!(qid, unique, error = %io::Error::from_raw_os_error(-result), "nothing to take over in a ring slot");
                self.register(dev, qid)
            }
            early => {
                tracing::info!(
                    qid,
                    unique,
                    "answered a request the previous process had received over io_uring"
                );
                Ok(early)
            }
        }
    }

    /// Submits the entry's `REGISTER`; the result if the kernel answered at once (a refusal;
    /// an accepted registration completes only when a request arrives).
    fn register(&mut self, dev: RawFd, qid: usize) -> io::Result<Option<i32>> {
        let register = register_entry(self.ring.target(dev), qid, &self.slot);
        // SAFETY: the entry points at `slot`'s iovecs and buffers, which outlive `ring` (the
        // struct drops the ring first); the kernel uses them only inside this thread's
        // io_uring calls, or (a kept ring) in the keeper, which maps the same file at the
        // same address for as long as the ring lives.
        unsafe { self.ring.push(&register) }?;
        self.ring.submit_and_peek()
    }
}

/// Longest run of failed restarts before a ring thread gives up.
const RESTARTS_MAX: u32 = 10;

fn worker(
    qid: usize,
    index: usize,
    memory: Arc<RingMemory>,
    kept: Option<KeptRing>,
    setup: mpsc::Sender<io::Result<()>>,
    start: mpsc::Receiver<Start>,
    registered: mpsc::Sender<io::Result<()>>,
) {
    if let Err(e) = pin_to_cpu(qid) {
        // A possible CPU that is offline: its queue gets requests only once it comes online.
        tracing::debug!(qid, error = %e, "ring thread not pinned");
    }
    let made = match kept {
        Some(ring) => Ok(Entry::kept(&memory, index, ring)),
        None => Entry::new(&memory, index),
    };
    let mut entry = match made {
        Ok(e) => e,
        Err(e) => {
            let _ = setup.send(Err(e));
            return;
        }
    };
    let _ = setup.send(Ok(()));
    let Ok(Start { dev, handler }) = start.recv() else {
        return;
    };
    let fd = dev.as_raw_fd();
    if let Ring::Kept(ring) = &entry.ring {
        if let Err(e) = ring.register_dev(fd) {
            let _ = registered.send(Err(e));
            return;
        }
    }
    let first = if memory.adopted() {
        let mut scratch = Vec::with_capacity(REQUEST_PAYLOAD_MAX);
        entry.resume(fd, qid, &*handler, &mut scratch)
    } else {
        entry.register(fd, qid)
    };
    let early = match first {
        Ok(Some(result)) if result < 0 => {
            let _ = registered.send(Err(io::Error::from_raw_os_error(-result)));
            return;
        }
        Ok(early) => early,
        Err(e) => {
            let _ = registered.send(Err(e));
            return;
        }
    };
    let _ = registered.send(Ok(()));
    // The test hook fails the thread only while its entry holds no request.
    let mut outcome = if early.is_none() && fails_once_for_a_test(qid) {
        tracing::warn!(
            qid,
            "MODELFS_TEST_RING_FAIL: this FUSE ring thread fails once"
        );
        Served::Failed
    } else {
        serve(&mut entry, fd, qid, &*handler, early)
    };
    // A thread that ends for any other reason than the connection's end leaves its CPU's
    // queue with one entry fewer (a queue without entries holds that CPU's requests forever):
    // it starts again with a new ring and buffers, and registers a new entry on the queue.
    let mut entry = Some(entry);
    let mut restarts = 0;
    while outcome == Served::Failed && restarts < RESTARTS_MAX {
        restarts += 1;
        // The failed ring goes first (and its buffers after it, in that order): closing it
        // cancels the entry it had registered, so the kernel stops handing requests to a ring
        // nobody waits on while this thread backs off. A kept ring that failed (its keeper
        // gone) is replaced by one of this thread's own, as any other.
        drop(entry.take());
        std::thread::sleep(Duration::from_millis(20 << restarts.min(5)));
        let mut fresh = match Entry::new(&memory, index) {
            Ok(e) => e,
            Err(e) => {
                tracing::error!(qid, error = %e, restarts, "a new ring for a failed FUSE ring thread cannot be made");
                continue;
            }
        };
        // A request this thread had answered and not yet committed (a kept ring whose SQ
        // thread died with the commit unread) is committed from the new ring; otherwise the
        // new ring registers an entry.
        let mut scratch = Vec::with_capacity(REQUEST_PAYLOAD_MAX);
        match fresh.take_over(fd, qid, &*handler, &mut scratch) {
            Ok(Some(result)) if result < 0 => {
                let errno = -result;
                if connection_ended(errno) {
                    return;
                }
                tracing::error!(qid, error = %io::Error::from_raw_os_error(errno), restarts, "a restarted FUSE ring thread was refused");
            }
            Ok(early) => {
                tracing::warn!(
                    qid,
                    restarts,
                    "a failed FUSE ring thread serves again with a new ring"
                );
                outcome = serve(&mut fresh, fd, qid, &*handler, early);
                entry = Some(fresh);
                if outcome == Served::Failed {
                    continue;
                }
                restarts = 0;
            }
            Err(e) => {
                tracing::error!(qid, error = %e, restarts, "registering a restarted FUSE ring thread failed")
            }
        }
    }
    if outcome == Served::Failed {
        tracing::error!(
            qid,
            "a FUSE ring thread failed {RESTARTS_MAX} times in a row and ends"
        );
    }
}

/// Test hook, in debug builds only: `MODELFS_TEST_RING_FAIL=<qid>` makes the first ring
/// thread of queue `qid` to start serving fail once, as a thread whose ring broke would, so
/// tests can watch it restart and serve its CPU again.
#[cfg(debug_assertions)]
fn fails_once_for_a_test(qid: usize) -> bool {
    use std::sync::atomic::{AtomicBool, Ordering};
    static FIRED: AtomicBool = AtomicBool::new(false);
    std::env::var("MODELFS_TEST_RING_FAIL")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        == Some(qid)
        && !FIRED.swap(true, Ordering::SeqCst)
}

#[cfg(not(debug_assertions))]
fn fails_once_for_a_test(_qid: usize) -> bool {
    false
}

/// Why [`serve`] returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Served {
    /// The connection ended (unmount, abort, the ring going away).
    Ended,
    /// The thread could not go on with this ring.
    Failed,
}

/// The `REGISTER` command of `slot` for queue `qid`.
fn register_entry(fd: Target, qid: usize, slot: &Slot) -> squeue::Entry128 {
    with_addr_and_len(uring_cmd(fd, CMD_REGISTER, qid, 0), slot.iov as u64, 2)
}

/// Whether the connection behind `dev` still serves (`POLLERR` once it is unmounted everywhere
/// or aborted), without reading from it.
fn connection_alive(dev: RawFd) -> bool {
    // SAFETY: the descriptor is open for the duration of the call (the caller holds it).
    let dev = unsafe { std::os::fd::BorrowedFd::borrow_raw(dev) };
    let mut fds = [rustix::event::PollFd::new(
        &dev,
        rustix::event::PollFlags::empty(),
    )];
    let now = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match rustix::event::poll(&mut fds, Some(&now)) {
        Ok(n) if n > 0 => !fds[0]
            .revents()
            .intersects(rustix::event::PollFlags::ERR | rustix::event::PollFlags::HUP),
        _ => true,
    }
}

/// Whether a failed ring command means the connection is over (unmount, abort, the ring going
/// away), which ends the thread quietly.
fn connection_ended(errno: i32) -> bool {
    [
        libc::ENOTCONN,
        libc::ECONNABORTED,
        libc::ECANCELED,
        libc::ENODEV,
    ]
    .contains(&errno)
}

/// Answers requests until the connection ends. A command that fails for any other reason is a
/// bug (a commit the kernel cannot match, say); the thread logs it and registers its entry
/// again, so the CPU's queue keeps being served; if that fails too, the caller starts over with
/// a new ring.
fn serve(
    entry: &mut Entry,
    dev: RawFd,
    qid: usize,
    handler: &dyn Handler,
    mut ready: Option<i32>,
) -> Served {
    let Entry { ring, slot } = entry;
    let fd = ring.target(dev);
    let mut scratch = Vec::with_capacity(REQUEST_PAYLOAD_MAX);
    let mut failed_in_a_row = 0;
    loop {
        let result = match ready.take() {
            Some(r) => r,
            None => match ring.wait_one() {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(qid, error = %e, "FUSE ring wait failed");
                    return Served::Failed;
                }
            },
        };
        if result < 0 {
            let errno = -result;
            if connection_ended(errno) {
                if matches!(ring, Ring::Kept(_)) && connection_alive(dev) {
                    // The keeper's SQ thread is gone (the keeper died) and with it the
                    // entry's command; the connection is not.
                    tracing::warn!(qid, "the kept ring ended with the connection alive (the keeper is gone?); serving on a ring of this process");
                    return Served::Failed;
                }
                return Served::Ended;
            }
            let error = io::Error::from_raw_os_error(errno);
            failed_in_a_row += 1;
            if failed_in_a_row > 1 {
                tracing::error!(qid, %error, "FUSE ring registration failed again");
                return Served::Failed;
            }
            tracing::error!(qid, %error, "FUSE ring command failed; registering the entry again");
            let register = register_entry(fd, qid, slot);
            // SAFETY: as for the first registration: the slot outlives the ring.
            if let Err(e) = unsafe { ring.push(&register) } {
                tracing::error!(qid, error = %e, "FUSE ring submission failed");
                return Served::Failed;
            }
            continue;
        }
        failed_in_a_row = 0;
        let unique = answer(slot, handler, &mut scratch);
        let commit = uring_cmd(fd, CMD_COMMIT_AND_FETCH, qid, unique);
        // SAFETY: as for the registration: the slot outlives the ring.
        if let Err(e) = unsafe { ring.push(&commit) } {
            tracing::error!(qid, error = %e, "FUSE ring submission failed");
            return Served::Failed;
        }
    }
}

/// Submits what is queued and waits for one completion; its result.
fn wait_one(ring: &mut OwnRing) -> io::Result<i32> {
    loop {
        if let Some(cqe) = ring.completion().next() {
            return Ok(cqe.result());
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) => return Err(e),
        }
    }
}

/// Answers the request in `slot` and writes the reply header; returns the request's id. The
/// request is first copied to the slot's save area and the slot's control word records each
/// step, so a successor can tell an answer in progress from a complete one
/// ([`crate::memory::adoption`]).
fn answer(slot: &mut Slot, handler: &dyn Handler, scratch: &mut Vec<u8>) -> u64 {
    let (h, payload, save) = slot.memory.buffers();
    let header = InHeader::parse(&h[..abi::IN_HEADER_LEN]);
    let payload_len = (abi::u32_at(h, abi::RING_PAYLOAD_SZ) as usize)
        .min(payload.len())
        .min(REQUEST_PAYLOAD_MAX);
    save[..abi::RING_HEADER_LEN].copy_from_slice(h);
    save[abi::RING_HEADER_LEN..abi::RING_HEADER_LEN + payload_len]
        .copy_from_slice(&payload[..payload_len]);
    slot.memory.set_state(SlotState::Saved, header.unique);
    let (h, payload, _) = slot.memory.buffers();
    scratch.clear();
    scratch.extend_from_slice(&payload[..payload_len]);
    let mut op_in = [0u8; 128];
    op_in.copy_from_slice(&h[abi::RING_OP_IN..abi::RING_OP_IN + 128]);
    let req = Request {
        header,
        op_in: &op_in,
        payload: scratch,
    };
    let mut reply = Reply::new(payload);
    call_handler(handler, &req, &mut reply);
    let (len, error) = reply.outcome();
    abi::put_u32(h, 0, (abi::OUT_HEADER_LEN + len) as u32);
    abi::put_u32(h, 4, error as u32);
    abi::put_u64(h, 8, header.unique);
    abi::put_u32(h, abi::RING_PAYLOAD_SZ, len as u32);
    slot.memory.set_state(SlotState::Replied, header.unique);
    header.unique
}

/// A FUSE ring command (user data 0).
fn uring_cmd(fd: Target, cmd_op: u32, qid: usize, commit_id: u64) -> squeue::Entry128 {
    // struct fuse_uring_cmd_req: flags, commit_id, qid.
    let mut cmd = [0u8; 80];
    cmd[8..16].copy_from_slice(&commit_id.to_le_bytes());
    cmd[16..18].copy_from_slice(&(qid as u16).to_le_bytes());
    match fd {
        Target::Fd(fd) => opcode::UringCmd80::new(fd, cmd_op),
        Target::Fixed => opcode::UringCmd80::new(types::Fixed(0), cmd_op),
    }
    .cmd(cmd)
    .build()
    .user_data(0)
}

/// Sets the SQE's `addr` and `len` (the iovecs of a registration and their count);
/// `UringCmd80` has no setter for `len`.
fn with_addr_and_len(entry: squeue::Entry128, addr: u64, len: u32) -> squeue::Entry128 {
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    // SAFETY: `Entry128` is `repr(C)`: a `repr(C)` `io_uring_sqe` (integers and unions of
    // integers) and 64 bytes; every bit pattern is a valid value, so it round-trips through
    // bytes. `addr` is the `u64` at offset 16 and `len` the `u32` at offset 24 of
    // `struct io_uring_sqe`.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(entry) };
    raw[16..24].copy_from_slice(&addr.to_le_bytes());
    raw[24..28].copy_from_slice(&len.to_le_bytes());
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

/// # Safety
/// Every buffer the entry points at must stay valid until the ring is dropped.
unsafe fn push(ring: &mut OwnRing, entry: &squeue::Entry128) -> io::Result<()> {
    let mut sq = ring.submission();
    // SAFETY: forwarded to the caller.
    if unsafe { sq.push(entry) }.is_ok() {
        return Ok(());
    }
    drop(sq);
    // One entry per ring is ever in flight, so a full queue only holds unsubmitted entries.
    ring.submit()?;
    // SAFETY: forwarded to the caller.
    unsafe { ring.submission().push(entry) }
        .map_err(|_| io::Error::other("io_uring submission queue full"))
}

/// A passthrough backing file registered on a `/dev/fuse` descriptor
/// (`FUSE_DEV_IOC_BACKING_OPEN`); closed when dropped (`FUSE_DEV_IOC_BACKING_CLOSE`).
#[derive(Debug)]
pub struct BackingId {
    dev: Arc<OwnedFd>,
    id: u32,
}

/// `_IOW(229, 1, struct fuse_backing_map)`.
const FUSE_DEV_IOC_BACKING_OPEN: libc::c_ulong = 0x4010_e501;
/// `_IOW(229, 2, uint32_t)`.
const FUSE_DEV_IOC_BACKING_CLOSE: libc::c_ulong = 0x4004_e502;

#[repr(C)]
struct BackingMap {
    fd: i32,
    flags: u32,
    padding: u64,
}

impl BackingId {
    pub fn open(dev: &Arc<OwnedFd>, file: &impl AsRawFd) -> io::Result<Self> {
        let map = BackingMap {
            fd: file.as_raw_fd(),
            flags: 0,
            padding: 0,
        };
        // SAFETY: the ioctl reads a `struct fuse_backing_map` from a valid pointer and returns
        // the new id; both descriptors are open for the call.
        let id = unsafe {
            libc::ioctl(
                dev.as_raw_fd(),
                FUSE_DEV_IOC_BACKING_OPEN as _,
                &map as *const BackingMap,
            )
        };
        if id < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            dev: dev.clone(),
            id: id as u32,
        })
    }

    /// An id this connection already holds, registered by a process this one took the
    /// connection over from; closed when dropped, as one registered here.
    pub fn adopt(dev: &Arc<OwnedFd>, id: u32) -> Self {
        Self {
            dev: dev.clone(),
            id,
        }
    }

    pub fn id(&self) -> u32 {
        self.id
    }
}

impl Drop for BackingId {
    fn drop(&mut self) {
        // SAFETY: the ioctl reads a `u32` from a valid pointer.
        let rc = unsafe {
            libc::ioctl(
                self.dev.as_raw_fd(),
                FUSE_DEV_IOC_BACKING_CLOSE as _,
                &self.id as *const u32,
            )
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            // The connection may be gone already (unmount), which closed every id.
            if e.raw_os_error() != Some(libc::ENOTCONN) {
                tracing::debug!(id = self.id, error = %e, "closing a passthrough backing id failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_never_exceed_what_the_kernel_asked_for() {
        let mut buf = vec![0xaau8; 4096];
        let mut reply = Reply {
            buf: &mut buf,
            len: 0,
            error: 0,
        };
        reply.fill(10, |b, len| {
            assert_eq!(b.len(), 10, "a read sees only the size asked for");
            *len = 100;
        });
        assert_eq!((reply.len, reply.error), (10, 0), "cut to the read size");
        reply.fill(64, |b, len| {
            assert_eq!(b.len(), 64, "a listing sees only the size asked for");
            while abi::push_dirent(b, len, 1, 1, abi::DT_REG, b"name") {}
        });
        assert_eq!(reply.len, 64, "two 32-byte entries");
        reply.error(libc::ENOENT);
        assert_eq!(
            (reply.len, reply.error),
            (0, -libc::ENOENT),
            "an error carries no data"
        );
        reply.xattr_size(0);
        assert_eq!((reply.len, reply.error), (abi::GETXATTR_OUT_LEN, 0));
    }

    #[test]
    fn cpu_lists_count_cpus_numbered_from_zero() {
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list("0-1"), Some(2));
        assert_eq!(parse_cpu_list("0-3,4-7"), Some(8));
        assert_eq!(parse_cpu_list("0,1,2"), Some(3));
        assert_eq!(parse_cpu_list("0-3,8-11"), None, "a gap");
        assert_eq!(parse_cpu_list("1-3"), None, "not from 0");
        assert_eq!(parse_cpu_list(""), None);
    }

    #[test]
    fn a_registration_entry_carries_the_iovec_count_and_the_queue() {
        let e = with_addr_and_len(
            uring_cmd(Target::Fd(types::Fd(7)), CMD_REGISTER, 1, 0).user_data(9),
            0x1000,
            2,
        );
        // SAFETY: see `with_len`.
        let raw: [u8; 128] = unsafe { std::mem::transmute(e) };
        assert_eq!(raw[0], 46, "IORING_OP_URING_CMD");
        assert_eq!(i32::from_le_bytes(raw[4..8].try_into().unwrap()), 7, "fd");
        assert_eq!(
            u32::from_le_bytes(raw[8..12].try_into().unwrap()),
            CMD_REGISTER,
            "cmd_op"
        );
        assert_eq!(
            u64::from_le_bytes(raw[16..24].try_into().unwrap()),
            0x1000,
            "addr"
        );
        assert_eq!(
            u32::from_le_bytes(raw[24..28].try_into().unwrap()),
            2,
            "len"
        );
        assert_eq!(
            u64::from_le_bytes(raw[32..40].try_into().unwrap()),
            9,
            "user_data"
        );
        assert_eq!(
            u16::from_le_bytes(raw[48 + 16..48 + 18].try_into().unwrap()),
            1,
            "fuse_uring_cmd_req.qid"
        );
    }
}
