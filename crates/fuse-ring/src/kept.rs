//! Rings a keeper process creates and a mount server drives: the ring commands belong to a
//! task that outlives every mount server.
//!
//! # Why
//! The kernel copies a request into a ring entry's buffers as task work of the task that issued
//! the entry's last command (`fs/fuse/dev_uring.c`, `fuse_uring_send_in_task`); when that task
//! has exited the request ends with `ECANCELED`. With rings of its own, a mount server that
//! dies leaves entries that keep taking requests and failing them until its rings are torn
//! down. Here the keeper (the mount crate's `takeover` module) creates the rings with
//! `IORING_SETUP_SQPOLL`: every command is issued by the ring's SQ thread, a thread of the
//! keeper, and a request that reaches an entry while no mount server runs is copied into its
//! buffers and waits as a completion in the ring for the next server.
//!
//! # What each side does
//! * The keeper ([`create_kept_rings`]) creates the rings (`SQPOLL | SQE128`, one SQ thread per
//!   CPU through `ATTACH_WQ`, pinned to it with `SQ_AFF` so a request and its answer stay on
//!   the caller's CPU, and a short idle time so the threads sleep when there is no work) and maps the entries' buffers ([`crate::RingMemory::map_for_keeper`]) at the address
//!   the server chose: the SQ thread resolves every user address (the registration's iovecs,
//!   the headers and payloads) in the keeper's memory.
//! * A mount server maps each ring's queues from its descriptor ([`KeptRing::attach`]), registers
//!   `/dev/fuse` as the ring's fixed file 0 (the SQ thread resolves plain descriptor numbers in
//!   the keeper's table, where the server's numbers mean nothing), writes submissions, wakes
//!   the SQ thread when it sleeps, and waits for completions with `io_uring_enter`. A ring
//!   without `SINGLE_ISSUER` or `DEFER_TASKRUN` lets any process do that.
//! * A successor reads where the dead process left each ring: a completion it never took is a
//!   request delivered and untouched; a submission without its completion is a command the
//!   kernel holds; neither means the dead process took the last completion and its slot's
//!   control word tells how far it got (`crate::memory::adoption`).
//!
//! Every command yields exactly one completion and each ring carries one command at a time, so
//! the three counters (submissions, completions posted, completions taken) say it all.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use io_uring::squeue;

const SETUP_SQPOLL: u32 = 1 << 1;
const SETUP_SQ_AFF: u32 = 1 << 2;
const SETUP_ATTACH_WQ: u32 = 1 << 5;
const SETUP_SQE128: u32 = 1 << 10;
const FEAT_SINGLE_MMAP: u32 = 1 << 0;
const OFF_SQ_RING: libc::off_t = 0;
const OFF_SQES: libc::off_t = 0x1000_0000;
const SQ_NEED_WAKEUP: u32 = 1 << 0;
const ENTER_GETEVENTS: libc::c_uint = 1 << 0;
const ENTER_SQ_WAKEUP: libc::c_uint = 1 << 1;
const ENTER_EXT_ARG: libc::c_uint = 1 << 3;
/// Longest wait for a completion before the ring is checked for a dead SQ thread: a command
/// submitted just as it died is never read, and nothing else would end the wait.
const WAIT_SLICE: Duration = Duration::from_secs(1);
const REGISTER_FILES: libc::c_uint = 2;
const SQE_LEN: usize = 128;
const CQE_LEN: usize = 16;
/// Submission slots per ring: one command is in flight at a time.
const RING_ENTRIES: u32 = 2;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SqOffsets {
    head: u32,
    tail: u32,
    ring_mask: u32,
    ring_entries: u32,
    flags: u32,
    dropped: u32,
    array: u32,
    resv1: u32,
    user_addr: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CqOffsets {
    head: u32,
    tail: u32,
    ring_mask: u32,
    ring_entries: u32,
    overflow: u32,
    cqes: u32,
    flags: u32,
    resv1: u32,
    user_addr: u64,
}

/// `struct io_uring_params`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Params {
    sq_entries: u32,
    cq_entries: u32,
    flags: u32,
    sq_thread_cpu: u32,
    sq_thread_idle: u32,
    features: u32,
    wq_fd: u32,
    resv: [u32; 3],
    sq_off: SqOffsets,
    cq_off: CqOffsets,
}

const _: () = assert!(std::mem::size_of::<Params>() == 120);

/// What a process needs to map a kept ring's queues: the numbers `io_uring_setup` answered
/// (the same for every ring of a set).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingLayout {
    sq_entries: u32,
    cq_entries: u32,
    features: u32,
    /// head, tail, ring_mask, ring_entries, flags, dropped, array.
    sq: [u32; 7],
    /// head, tail, ring_mask, ring_entries, overflow, cqes, flags.
    cq: [u32; 7],
}

impl RingLayout {
    fn of(p: &Params) -> Self {
        let s = &p.sq_off;
        let c = &p.cq_off;
        Self {
            sq_entries: p.sq_entries,
            cq_entries: p.cq_entries,
            features: p.features,
            sq: [
                s.head,
                s.tail,
                s.ring_mask,
                s.ring_entries,
                s.flags,
                s.dropped,
                s.array,
            ],
            cq: [
                c.head,
                c.tail,
                c.ring_mask,
                c.ring_entries,
                c.overflow,
                c.cqes,
                c.flags,
            ],
        }
    }

    /// The layout as numbers, for a message.
    pub fn to_words(&self) -> Vec<u32> {
        let mut w = vec![self.sq_entries, self.cq_entries, self.features];
        w.extend_from_slice(&self.sq);
        w.extend_from_slice(&self.cq);
        w
    }

    /// The layout from [`Self::to_words`]; an error for anything a ring could not have.
    pub fn from_words(w: &[u32]) -> io::Result<Self> {
        let bad = |what: &str| io::Error::other(format!("a kept ring's layout: {what}"));
        if w.len() != 17 {
            return Err(bad("wrong length"));
        }
        let l = Self {
            sq_entries: w[0],
            cq_entries: w[1],
            features: w[2],
            sq: w[3..10].try_into().expect("7"),
            cq: w[10..17].try_into().expect("7"),
        };
        let pow2 = |n: u32| n > 0 && n.is_power_of_two() && n <= 4096;
        if !pow2(l.sq_entries) || !pow2(l.cq_entries) {
            return Err(bad("queue sizes"));
        }
        // Every offset names a 4-byte word inside the first pages of its mapping.
        if l.sq
            .iter()
            .chain(l.cq.iter())
            .any(|&o| o % 4 != 0 || o > 1 << 20)
        {
            return Err(bad("offsets"));
        }
        Ok(l)
    }

    fn sq_ring_len(&self) -> usize {
        self.sq[6] as usize + self.sq_entries as usize * 4
    }

    fn cq_ring_len(&self) -> usize {
        self.cq[5] as usize + self.cq_entries as usize * CQE_LEN
    }
}

/// Rings created for a keeper, and their layout.
pub struct KeptRings {
    pub fds: Vec<OwnedFd>,
    pub layout: RingLayout,
}

fn setup(params: &mut Params) -> io::Result<OwnedFd> {
    // SAFETY: io_uring_setup reads and writes the 120-byte params structure it is given.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_io_uring_setup,
            RING_ENTRIES as libc::c_long,
            params as *mut Params,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor this process owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Creates `queues * per_queue` rings in slot order (`qid * per_queue + n`), the rings of
/// each queue polled by one SQ thread of this process (the keeper) pinned to the queue's CPU,
/// so a request and its answer stay on the caller's CPU as with rings of the server's own (a
/// CPU the keeper may not run on gets an SQ thread that is not pinned). The threads sleep
/// after `idle_ms` without work.
pub fn create_kept_rings(queues: usize, per_queue: usize, idle_ms: u32) -> io::Result<KeptRings> {
    let count = queues * per_queue;
    let mut fds: Vec<OwnedFd> = Vec::with_capacity(count);
    let mut layout: Option<RingLayout> = None;
    for i in 0..count {
        let base = Params {
            flags: SETUP_SQPOLL | SETUP_SQE128,
            sq_thread_idle: idle_ms,
            ..Params::default()
        };
        let (fd, params) = if i % per_queue == 0 {
            let mut pinned = Params {
                flags: base.flags | SETUP_SQ_AFF,
                sq_thread_cpu: (i / per_queue) as u32,
                ..base
            };
            match setup(&mut pinned) {
                Ok(fd) => (fd, pinned),
                // Offline, or outside the keeper's cpuset.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    let mut unpinned = base;
                    (setup(&mut unpinned)?, unpinned)
                }
                Err(e) => return Err(e),
            }
        } else {
            let mut attached = Params {
                flags: base.flags | SETUP_ATTACH_WQ,
                wq_fd: fds[i - i % per_queue].as_raw_fd() as u32,
                ..base
            };
            (setup(&mut attached)?, attached)
        };
        if params.features & FEAT_SINGLE_MMAP == 0 {
            return Err(io::Error::other(
                "the kernel maps io_uring queues separately (before Linux 5.4)",
            ));
        }
        let this = RingLayout::of(&params);
        match &layout {
            Some(l) if *l != this => {
                return Err(io::Error::other(
                    "kept rings came out with different layouts",
                ))
            }
            Some(_) => {}
            None => layout = Some(this),
        }
        fds.push(fd);
    }
    Ok(KeptRings {
        fds,
        layout: layout.ok_or_else(|| io::Error::other("no ring asked for"))?,
    })
}

/// `struct io_uring_getevents_arg`.
#[repr(C)]
struct GeteventsArg {
    sigmask: u64,
    sigmask_sz: u32,
    min_wait_usec: u32,
    ts: u64,
}

/// `struct __kernel_timespec`.
#[repr(C)]
struct KernelTimespec {
    sec: i64,
    nsec: i64,
}

/// `io_uring_enter` submitting nothing: waits for `min_complete` completions (at most
/// `timeout`, then `ETIME`) or wakes the SQ thread, as `flags` say. On a ring whose SQ thread
/// is gone the kernel answers `EOWNERDEAD`.
fn enter(
    fd: RawFd,
    min_complete: u32,
    flags: libc::c_uint,
    timeout: Option<Duration>,
) -> io::Result<()> {
    let ts = timeout.map(|t| KernelTimespec {
        sec: t.as_secs() as i64,
        nsec: i64::from(t.subsec_nanos()),
    });
    let arg = ts.as_ref().map(|ts| GeteventsArg {
        sigmask: 0,
        sigmask_sz: 0,
        min_wait_usec: 0,
        ts: ts as *const KernelTimespec as u64,
    });
    let (flags, argp, argsz) = match &arg {
        Some(a) => (
            flags | ENTER_EXT_ARG,
            a as *const GeteventsArg as *const libc::c_void,
            std::mem::size_of::<GeteventsArg>(),
        ),
        None => (flags, std::ptr::null(), 0),
    };
    // SAFETY: the argument structure (if any) and the timespec it points to live until the
    // call returns.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_io_uring_enter,
            fd,
            0 as libc::c_uint,
            min_complete as libc::c_uint,
            flags,
            argp,
            argsz as libc::size_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(fd: &OwnedFd, len: usize, offset: libc::off_t) -> io::Result<Self> {
        // SAFETY: a shared mapping of the ring's queues, as io_uring defines them.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                offset,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { ptr: p.cast(), len })
    }

    fn word(&self, offset: u32) -> &AtomicU32 {
        assert!(offset as usize + 4 <= self.len);
        // SAFETY: within the mapping, 4-byte aligned (checked in `RingLayout::from_words`),
        // and the kernel shares these words only through atomic accesses.
        unsafe { &*(self.ptr.add(offset as usize) as *const AtomicU32) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A kept ring as a mount server drives it.
pub(crate) struct KeptRing {
    fd: OwnedFd,
    layout: RingLayout,
    rings: Mapping,
    sqes: Mapping,
}

// SAFETY: the mappings are used by the one thread that owns the ring.
unsafe impl Send for KeptRing {}

impl KeptRing {
    /// Maps the queues of the ring `fd` (a descriptor from the keeper).
    pub(crate) fn attach(fd: OwnedFd, layout: RingLayout) -> io::Result<Self> {
        // One mapping holds both queues (FEAT_SINGLE_MMAP, checked when the keeper made it).
        let len = layout.sq_ring_len().max(layout.cq_ring_len());
        let rings = Mapping::new(&fd, len, OFF_SQ_RING)?;
        let sqes = Mapping::new(&fd, layout.sq_entries as usize * SQE_LEN, OFF_SQES)?;
        Ok(Self {
            fd,
            layout,
            rings,
            sqes,
        })
    }

    /// Registers `dev` as the ring's fixed file 0. A ring whose files a predecessor registered
    /// (`EBUSY`) already has it: the same open `/dev/fuse` file, which the keeper holds.
    pub(crate) fn register_dev(&self, dev: RawFd) -> io::Result<()> {
        let fds = [dev];
        // SAFETY: the kernel reads one descriptor number from the array.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_io_uring_register,
                self.fd.as_raw_fd(),
                REGISTER_FILES,
                fds.as_ptr(),
                1 as libc::c_uint,
            )
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EBUSY) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Submissions made (by any process), completions posted, completions taken.
    pub(crate) fn counters(&self) -> (u32, u32, u32) {
        (
            self.rings.word(self.layout.sq[1]).load(Ordering::Acquire),
            self.rings.word(self.layout.cq[1]).load(Ordering::Acquire),
            self.rings.word(self.layout.cq[0]).load(Ordering::Acquire),
        )
    }

    /// Wakes the SQ thread if it sleeps (a submission may wait for it).
    pub(crate) fn wake(&self) -> io::Result<()> {
        fence(Ordering::SeqCst);
        let flags = self.rings.word(self.layout.sq[4]).load(Ordering::Relaxed);
        if flags & SQ_NEED_WAKEUP != 0 {
            enter(self.fd.as_raw_fd(), 0, ENTER_SQ_WAKEUP, None)?;
        }
        Ok(())
    }

    /// Queues `entry` for the SQ thread and wakes it if it sleeps.
    ///
    /// # Safety
    /// Every buffer the entry points at must be mapped at the same address in the keeper's
    /// memory for as long as the kernel may use it.
    pub(crate) unsafe fn push(&mut self, entry: &squeue::Entry128) -> io::Result<()> {
        let tail_word = self.rings.word(self.layout.sq[1]);
        let head_word = self.rings.word(self.layout.sq[0]);
        let tail = tail_word.load(Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(5);
        while tail.wrapping_sub(head_word.load(Ordering::Acquire)) >= self.layout.sq_entries {
            // One command per ring: a full queue holds submissions the SQ thread has not read.
            self.wake()?;
            if Instant::now() > deadline {
                return Err(io::Error::other(
                    "the kept ring's submission queue stays full",
                ));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        let mask = self.rings.word(self.layout.sq[2]).load(Ordering::Relaxed);
        let index = tail & mask;
        // SAFETY: `Entry128` is 128 plain bytes (see `ring::with_len`); the slot is inside the
        // SQE mapping (index <= mask < sq_entries) and not read by the kernel until the tail
        // moves past it.
        unsafe {
            let raw: [u8; SQE_LEN] = std::mem::transmute(entry.clone());
            std::ptr::copy_nonoverlapping(
                raw.as_ptr(),
                self.sqes.ptr.add(index as usize * SQE_LEN),
                SQE_LEN,
            );
        }
        self.rings
            .word(self.layout.sq[6] + index * 4)
            .store(index, Ordering::Relaxed);
        tail_word.store(tail.wrapping_add(1), Ordering::Release);
        self.wake()
    }

    /// The next completion's result, if one is posted.
    pub(crate) fn next_cqe(&mut self) -> Option<i32> {
        let head_word = self.rings.word(self.layout.cq[0]);
        let head = head_word.load(Ordering::Relaxed);
        let tail = self.rings.word(self.layout.cq[1]).load(Ordering::Acquire);
        if head == tail {
            return None;
        }
        let mask = self.rings.word(self.layout.cq[2]).load(Ordering::Relaxed);
        let at = self.layout.cq[5] + (head & mask) * CQE_LEN as u32 + 8;
        let res = self.rings.word(at).load(Ordering::Relaxed) as i32;
        head_word.store(head.wrapping_add(1), Ordering::Release);
        Some(res)
    }

    /// Waits for the next completion; its result. An error (`EOWNERDEAD`) once the keeper's SQ
    /// thread is gone.
    pub(crate) fn wait_cqe(&mut self) -> io::Result<i32> {
        loop {
            if let Some(res) = self.next_cqe() {
                return Ok(res);
            }
            match enter(self.fd.as_raw_fd(), 1, ENTER_GETEVENTS, Some(WAIT_SLICE)) {
                Ok(()) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::ETIME)) => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits until the SQ thread has read every submission (a command refused at once has its
    /// completion posted by then); the next completion, if any.
    pub(crate) fn settle(&mut self) -> io::Result<Option<i32>> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let head = self.rings.word(self.layout.sq[0]).load(Ordering::Acquire);
            let tail = self.rings.word(self.layout.sq[1]).load(Ordering::Acquire);
            if head == tail {
                return Ok(self.next_cqe());
            }
            self.wake()?;
            if Instant::now() > deadline {
                return Err(io::Error::other(
                    "the keeper's SQ thread does not read its rings",
                ));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Where a successor finds a kept ring, from its counters (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Left {
    /// A completion nobody took: take it (a request delivered and untouched, or an error).
    Completion,
    /// A command the kernel holds: wait for its completion.
    Pending,
    /// Never used: register the entry.
    Unused,
    /// The previous process took the last completion and submitted nothing since: its slot
    /// tells how far it got.
    Slot,
}

/// The decision from a ring's counters: submissions made, completions posted, completions
/// taken (each ring carries one command at a time and each command completes once).
pub(crate) fn left(submitted: u32, posted: u32, taken: u32) -> Left {
    if posted != taken {
        Left::Completion
    } else if submitted != posted {
        Left::Pending
    } else if submitted == 0 {
        Left::Unused
    } else {
        Left::Slot
    }
}

/// Whether two descriptors of this process name the same open file (`kcmp`): a copy of a
/// kept ring is the keeper's ring.
pub fn same_open_file(a: BorrowedFd<'_>, b: BorrowedFd<'_>) -> io::Result<bool> {
    const KCMP_FILE: libc::c_long = 0;
    let pid = std::process::id() as libc::c_long;
    // SAFETY: kcmp reads no memory: it compares two descriptors' files.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            pid,
            pid,
            KCMP_FILE,
            a.as_raw_fd() as libc::c_long,
            b.as_raw_fd() as libc::c_long,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_successor_reads_a_kept_ring_from_its_counters() {
        assert_eq!(left(0, 0, 0), Left::Unused, "never used");
        assert_eq!(left(1, 0, 0), Left::Pending, "registered, no request yet");
        assert_eq!(
            left(1, 1, 0),
            Left::Completion,
            "delivered while no server ran"
        );
        assert_eq!(left(1, 1, 1), Left::Slot, "taken, not yet committed");
        assert_eq!(
            left(2, 1, 1),
            Left::Pending,
            "committed, waiting for the next"
        );
        assert_eq!(
            left(0, u32::MAX, u32::MAX),
            Left::Pending,
            "the counters wrap: one command after 2^32 - 1"
        );
        assert_eq!(left(5, 5, 4), Left::Completion);
    }

    #[test]
    fn a_layout_survives_its_words_and_nonsense_is_refused() {
        let l = RingLayout {
            sq_entries: 2,
            cq_entries: 4,
            features: 1,
            sq: [0, 4, 8, 12, 16, 20, 64],
            cq: [128, 132, 136, 140, 144, 160, 148],
        };
        assert_eq!(RingLayout::from_words(&l.to_words()).unwrap(), l);
        let mut w = l.to_words();
        w[0] = 3;
        assert!(RingLayout::from_words(&w).is_err(), "not a power of two");
        let mut w = l.to_words();
        w[5] = 6;
        assert!(RingLayout::from_words(&w).is_err(), "unaligned offset");
        assert!(RingLayout::from_words(&w[..16]).is_err(), "short");
    }
}
