//! The ring entries' buffers, in one shared mapping a successor process can map again at the
//! same address.
//!
//! # Why
//! The kernel keeps, for each ring entry, the user addresses of its header and payload buffers,
//! and reads an answer from them in whichever process commits it. A request delivered to a
//! process that then died stays with its entry (`FUSE_NOTIFY_RESEND` covers only `/dev/fuse`),
//! and its caller waits until the connection is aborted, unless someone commits an answer. A
//! successor that maps the same file at the same address sees the request where the kernel
//! put it, answers it there and commits it with `COMMIT_AND_FETCH` from its own ring; the entry
//! is then its own (the kernel copies later requests as task work of the committing thread,
//! into the same addresses). See the mount crate's `takeover` module for what this does not
//! cover.
//!
//! The memory file travels with the connection's descriptor (the keeper holds a duplicate),
//! like the journal: memory only, nothing written back to a disk.
//!
//! # Layout
//! A header page (magic, the mapping's address, queues, entries per queue, payload size, slot
//! size, and a tag naming the connection), then one slot per entry, `qid * per_queue + n`:
//! a control word (state and request id, written by the serving thread: [`SlotState`]), the
//! kernel's header buffer, the payload buffer, and a save area holding a copy of the request
//! while it is being answered (the answer overwrites the payload the request came in).

#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::abi;
use crate::ring::REQUEST_PAYLOAD_MAX;

const MAGIC: u64 = 0x7266_7366_6c65_646d; // "mdelfsfr"
const PAGE: usize = 4096;
/// Where a slot's registration iovecs are (after its control word): in the shared file, so a
/// keeper's SQ thread reads them at the same address (`crate::kept`).
const IOVECS_AT: usize = 16;
/// Where a slot's header buffer starts (after its control word and iovecs).
const HEADER_AT: usize = 64;
/// Bytes of a slot's save area: the kernel's header and a request's payload.
const SAVE_LEN: usize = (abi::RING_HEADER_LEN + REQUEST_PAYLOAD_MAX).div_ceil(PAGE) * PAGE;
/// Addresses tried for a file-backed mapping: far below the top-down area where the kernel
/// places mappings and far above a program's heap, so a successor finds them free.
const BASES: [usize; 4] = [
    0x3e00_0000_0000,
    0x3c00_0000_0000,
    0x3a00_0000_0000,
    0x3800_0000_0000,
];

/// What a slot's serving thread last did with a request (the control word's state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Nothing recorded.
    Idle,
    /// The request is copied to the save area; the answer is being written.
    Saved,
    /// The answer is complete in the buffers; the commit may or may not have been made.
    Replied,
}

impl SlotState {
    fn code(self) -> u32 {
        match self {
            SlotState::Idle => 0,
            SlotState::Saved => 1,
            SlotState::Replied => 2,
        }
    }

    fn from_code(code: u32) -> Self {
        match code {
            1 => SlotState::Saved,
            2 => SlotState::Replied,
            _ => SlotState::Idle,
        }
    }
}

/// What a successor does with a slot it took over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adoption {
    /// The answer to request `u` is complete in the buffers: commit it as it is.
    Commit(u64),
    /// Request `u` was being answered: restore it from the save area, answer, commit.
    Restore(u64),
    /// The buffers hold request `u`, delivered and not yet touched: answer, commit.
    Answer(u64),
    /// Nothing to answer: register the entry afresh.
    Register,
}

/// The decision for a slot from its control word and the request id in its header buffer
/// (bytes 8..16: the same place in a request's header and in an answer's). A commit of an id
/// the kernel no longer holds is refused (`ENOENT`) and the slot is registered instead, so a
/// wrong guess costs nothing; the only thing that must never happen is committing bytes that
/// are not the answer to the id committed, which the states rule out: the buffers change only
/// when the kernel delivers the next request, after a commit.
pub fn adoption(state: SlotState, recorded: u64, in_header: u64) -> Adoption {
    match state {
        SlotState::Saved if recorded != 0 => Adoption::Restore(recorded),
        SlotState::Replied if recorded != 0 && in_header == recorded => Adoption::Commit(recorded),
        _ if in_header != 0 && in_header != recorded => Adoption::Answer(in_header),
        _ => Adoption::Register,
    }
}

/// The shared mapping of every entry's buffers.
pub struct RingMemory {
    base: *mut u8,
    len: usize,
    file: OwnedFd,
    queues: usize,
    per_queue: usize,
    payload: usize,
    slot_size: usize,
    adopted: bool,
}

// SAFETY: the mapping lives as long as the value; slots are handed to one thread each, and the
// header page is written only through atomics.
unsafe impl Send for RingMemory {}
unsafe impl Sync for RingMemory {}

fn slot_size(payload: usize) -> usize {
    (PAGE + payload.div_ceil(PAGE) * PAGE) + SAVE_LEN
}

impl RingMemory {
    /// A new mapping for `queues * per_queue` entries of `payload` bytes, in a memory file
    /// ([`Self::file`]). With `fixed`, at one of a few fixed addresses a successor finds free
    /// ([`Self::adopt`]); else anywhere (nothing to take over).
    pub fn create(
        fixed: bool,
        queues: usize,
        per_queue: usize,
        payload: usize,
    ) -> io::Result<Arc<Self>> {
        let file = rustix::fs::memfd_create("modelfs-ring", rustix::fs::MemfdFlags::CLOEXEC)?;
        let slot_size = slot_size(payload);
        let len = PAGE + queues * per_queue * slot_size;
        rustix::fs::ftruncate(&file, len as u64)?;
        let base = if fixed {
            let mut mapped = Err(io::Error::other("no address tried"));
            for at in BASES {
                mapped = map(&file, len, Some(at));
                if mapped.is_ok() {
                    break;
                }
            }
            mapped?
        } else {
            map(&file, len, None)?
        };
        let memory = RingMemory {
            base,
            len,
            file,
            queues,
            per_queue,
            payload,
            slot_size,
            adopted: false,
        };
        let h = memory.header_words();
        h[1].store(base as u64, Ordering::Relaxed);
        h[2].store(queues as u64, Ordering::Relaxed);
        h[3].store(per_queue as u64, Ordering::Relaxed);
        h[4].store(payload as u64, Ordering::Relaxed);
        h[5].store(slot_size as u64, Ordering::Relaxed);
        h[6].store(0, Ordering::Relaxed);
        h[0].store(MAGIC, Ordering::Release);
        Ok(Arc::new(memory))
    }

    /// Maps the memory file a predecessor created ([`Self::file`]) at the address it used, if
    /// its tag is `tag` (the connection it served).
    pub fn adopt(file: OwnedFd, tag: u64) -> io::Result<Arc<Self>> {
        Self::map_existing(file, Some(tag))
    }

    /// Maps the memory file a mount server created at the address it uses, in the keeper
    /// that polls its rings (`crate::kept`): the kernel reaches the buffers through the
    /// keeper's memory. The keeper only holds the mapping; it never reads or writes it.
    pub fn map_for_keeper(file: OwnedFd) -> io::Result<Arc<Self>> {
        Self::map_existing(file, None)
    }

    fn map_existing(file: OwnedFd, tag: Option<u64>) -> io::Result<Arc<Self>> {
        let mut head = [0u8; 56];
        let got = rustix::io::pread(&file, &mut head, 0)?;
        let word = |i: usize| u64::from_le_bytes(head[i * 8..i * 8 + 8].try_into().unwrap());
        if got < head.len() || word(0) != MAGIC {
            return Err(io::Error::other("not ring buffers"));
        }
        if let Some(tag) = tag.filter(|&t| word(6) != t) {
            return Err(io::Error::other(format!(
                "the ring buffers belong to another connection ({} != {tag})",
                word(6)
            )));
        }
        let (at, queues, per_queue, payload, slot_size) = (
            word(1) as usize,
            word(2) as usize,
            word(3) as usize,
            word(4) as usize,
            word(5) as usize,
        );
        if slot_size != self::slot_size(payload) || queues == 0 || per_queue == 0 {
            return Err(io::Error::other(
                "the ring buffers are laid out by another version",
            ));
        }
        let len = PAGE + queues * per_queue * slot_size;
        if (rustix::fs::fstat(&file)?.st_size as usize) < len {
            return Err(io::Error::other(
                "the ring buffers are shorter than their layout",
            ));
        }
        let base = map(&file, len, Some(at))?;
        Ok(Arc::new(RingMemory {
            base,
            len,
            file,
            queues,
            per_queue,
            payload,
            slot_size,
            adopted: tag.is_some(),
        }))
    }

    /// The memory file, for a successor ([`Self::adopt`]).
    pub fn file(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Names the connection the buffers serve (its mount's device number), for [`Self::adopt`].
    pub fn set_tag(&self, tag: u64) {
        self.header_words()[6].store(tag, Ordering::Release);
    }

    pub fn queues(&self) -> usize {
        self.queues
    }

    pub fn per_queue(&self) -> usize {
        self.per_queue
    }

    pub fn payload(&self) -> usize {
        self.payload
    }

    /// Whether the slots hold a predecessor's entries.
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    fn header_words(&self) -> &[AtomicU64; 7] {
        // SAFETY: the first page is mapped, 8-byte aligned (page aligned), and only accessed
        // through these atomics.
        unsafe { &*(self.base as *const [AtomicU64; 7]) }
    }

    /// The `index`th slot's addresses. Each slot must be used by one thread at a time.
    pub(crate) fn slot(self: &Arc<Self>, index: usize) -> SlotMemory {
        assert!(index < self.queues * self.per_queue);
        // SAFETY: within the mapping (checked above).
        let start = unsafe { self.base.add(PAGE + index * self.slot_size) };
        SlotMemory {
            start,
            payload: self.payload,
            _memory: self.clone(),
        }
    }
}

impl Drop for RingMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `map` with this length; nothing refers to it once
        // the last slot (each holds an `Arc`) is gone.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// Maps `len` bytes of `file` shared, at `at` (and nowhere else) if given.
fn map(file: &OwnedFd, len: usize, at: Option<usize>) -> io::Result<*mut u8> {
    let (addr, flags) = match at {
        Some(a) => (
            a as *mut libc::c_void,
            libc::MAP_SHARED | libc::MAP_FIXED_NOREPLACE,
        ),
        None => (std::ptr::null_mut(), libc::MAP_SHARED),
    };
    // SAFETY: a new shared mapping of a file this process holds; with an address,
    // MAP_FIXED_NOREPLACE fails rather than replace anything mapped there.
    let p = unsafe {
        libc::mmap(
            addr,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        let e = io::Error::last_os_error();
        return Err(match (at, e.raw_os_error()) {
            (Some(a), Some(libc::EEXIST)) => io::Error::other(format!("{a:#x} is not free here")),
            _ => e,
        });
    }
    if let Some(a) = at {
        if p as usize != a {
            // A kernel without MAP_FIXED_NOREPLACE treats the address as a hint.
            // SAFETY: the mapping just made.
            unsafe { libc::munmap(p, len) };
            return Err(io::Error::other(format!("{a:#x} is not free here")));
        }
    }
    Ok(p.cast())
}

/// One slot's buffers inside a [`RingMemory`].
pub(crate) struct SlotMemory {
    start: *mut u8,
    payload: usize,
    _memory: Arc<RingMemory>,
}

// SAFETY: a slot is used by the one thread that owns it.
unsafe impl Send for SlotMemory {}

impl SlotMemory {
    fn control(&self) -> (&AtomicU32, &AtomicU64) {
        // SAFETY: the slot's first 16 bytes (page aligned), only accessed through atomics.
        unsafe {
            (
                &*(self.start as *const AtomicU32),
                &*(self.start.add(8) as *const AtomicU64),
            )
        }
    }

    pub(crate) fn state(&self) -> (SlotState, u64) {
        let (state, unique) = self.control();
        let s = SlotState::from_code(state.load(Ordering::Acquire));
        (s, unique.load(Ordering::Relaxed))
    }

    pub(crate) fn set_state(&self, state: SlotState, unique: u64) {
        let (s, u) = self.control();
        u.store(unique, Ordering::Relaxed);
        s.store(state.code(), Ordering::Release);
    }

    pub(crate) fn header_ptr(&self) -> *mut u8 {
        // SAFETY: within the slot.
        unsafe { self.start.add(HEADER_AT) }
    }

    pub(crate) fn payload_ptr(&self) -> *mut u8 {
        // SAFETY: within the slot.
        unsafe { self.start.add(PAGE) }
    }

    /// Writes the registration's two iovecs (header and payload buffer) into the slot; their
    /// address, for the `REGISTER` command.
    pub(crate) fn write_iovecs(&self) -> *const libc::iovec {
        const _: () = assert!(IOVECS_AT + 2 * std::mem::size_of::<libc::iovec>() <= HEADER_AT);
        let iov = [
            libc::iovec {
                iov_base: self.header_ptr().cast(),
                iov_len: abi::RING_HEADER_LEN,
            },
            libc::iovec {
                iov_base: self.payload_ptr().cast(),
                iov_len: self.payload,
            },
        ];
        // SAFETY: 32 bytes between the control word and the header buffer, 16-byte aligned
        // (the slot is page aligned), written only by the slot's thread.
        unsafe {
            let at = self.start.add(IOVECS_AT) as *mut [libc::iovec; 2];
            at.write(iov);
            at as *const libc::iovec
        }
    }

    pub(crate) fn header(&mut self) -> &mut [u8] {
        // SAFETY: `RING_HEADER_LEN` bytes after the control word, within the slot's first page;
        // the kernel writes them only while this thread waits in the ring.
        unsafe { std::slice::from_raw_parts_mut(self.header_ptr(), abi::RING_HEADER_LEN) }
    }

    pub(crate) fn buffers(&mut self) -> (&mut [u8], &mut [u8], &mut [u8]) {
        let payload_round = self.payload.div_ceil(PAGE) * PAGE;
        // SAFETY: three disjoint ranges of the slot: header, payload, save area.
        unsafe {
            (
                std::slice::from_raw_parts_mut(self.header_ptr(), abi::RING_HEADER_LEN),
                std::slice::from_raw_parts_mut(self.payload_ptr(), self.payload),
                std::slice::from_raw_parts_mut(self.start.add(PAGE + payload_round), SAVE_LEN),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_adopted_only_as_its_states_allow() {
        use Adoption::*;
        assert_eq!(adoption(SlotState::Idle, 0, 0), Register, "never used");
        assert_eq!(
            adoption(SlotState::Idle, 0, 7),
            Answer(7),
            "delivered, untouched"
        );
        assert_eq!(
            adoption(SlotState::Saved, 7, 7),
            Restore(7),
            "being answered"
        );
        assert_eq!(
            adoption(SlotState::Saved, 7, 1234),
            Restore(7),
            "the answer may have overwritten anything: the save area decides"
        );
        assert_eq!(adoption(SlotState::Replied, 7, 7), Commit(7), "answered");
        assert_eq!(
            adoption(SlotState::Replied, 7, 9),
            Answer(9),
            "committed, and the next request delivered"
        );
        assert_eq!(adoption(SlotState::Replied, 7, 0), Register);
    }

    #[test]
    fn a_successor_maps_the_buffers_at_the_same_address_and_sees_them() {
        let first = RingMemory::create(true, 2, 3, 8192).unwrap();
        first.set_tag(42);
        let mut slot = first.slot(4);
        slot.header()[8..16].copy_from_slice(&77u64.to_le_bytes());
        slot.set_state(SlotState::Replied, 77);
        let header_at = slot.header_ptr() as usize;
        let file = || first.file().try_clone_to_owned().unwrap();
        assert!(
            adopt_err(file(), 42).contains("is not free"),
            "the address is this process's own mapping"
        );
        assert!(adopt_err(file(), 41).contains("another connection"));
        let kept = file();
        drop(slot);
        drop(first);
        let second = RingMemory::adopt(kept, 42).unwrap();
        assert!(second.adopted());
        assert_eq!(
            (second.queues(), second.per_queue(), second.payload()),
            (2, 3, 8192)
        );
        let mut slot = second.slot(4);
        assert_eq!(slot.header_ptr() as usize, header_at, "the same address");
        assert_eq!(slot.state(), (SlotState::Replied, 77));
        assert_eq!(slot.header()[8..16], 77u64.to_le_bytes());
    }

    fn adopt_err(file: OwnedFd, tag: u64) -> String {
        match RingMemory::adopt(file, tag) {
            Ok(_) => "adopted".into(),
            Err(e) => e.to_string(),
        }
    }
}
