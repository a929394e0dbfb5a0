//! Serving while downloading: a model whose listing is mounted before every file verified.
//!
//! # Model
//! A mapping entry may carry [`PendingFiles`]: one state per manifest entry, either the
//! verified blob that holds the entry's bytes or "waiting". The entry's artifact then serves
//! the listing only (names, sizes, the tree and its inode numbers); the bytes of a file come
//! from its [`PendingFile::Verified`] blob, never from the artifact. The agent builds that
//! artifact before every blob is known (a file checked by git sha1 has no sha256 until it is
//! downloaded), so its blobs are not trusted for reading while the entry is pending, and the
//! one that completes the model replaces it under the same artifact id (same slot, same inode
//! numbers: a loader that walked the directory keeps its inodes).
//!
//! # Invariant: no byte before its file verified
//! An open of a waiting file opens nothing at all: it waits until a later mapping names the
//! file verified (then it opens that blob, as any open does) or gives up. The only way to a
//! descriptor is through a `Verified` state or a complete entry, so no byte of an unverified
//! file can be served whatever the interleaving of mapping changes and opens.
//!
//! # Waiting
//! Every mapping swap bumps [`Changes`] and wakes every waiter; a waiter re-reads the mapping
//! and decides again. It ends:
//! * the file is verified: opened;
//! * a download of it failed verification after the wait began (its failure count grew):
//!   `EIO`; the agent fetches it again and a later open waits for that attempt;
//! * the model left the mapping (or its path now serves another artifact): `ENOENT` at once;
//! * the deadline ([`FsCore::set_pending_wait`], default [`DEFAULT_PENDING_WAIT`]) passed:
//!   `ETIMEDOUT`, with a log line naming the model and the file. `ETIMEDOUT` rather than
//!   `EAGAIN`: loaders treat `EAGAIN` as "retry now" and spin, while this error means the
//!   file did not arrive in time.
//!
//! A waiting open tells the wanted hook (the agent: fetch this file next) when it starts
//! waiting, and once more after each [`FsCore::repeat_wanted`] (a new agent connected; the
//! one it told is gone).
//!
//! A waiting open holds the thread that serves its request (the FUSE transports answer
//! synchronously): loaders open shards one after another, so one thread waits per loader.

use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use modelfs_core::artifact::Sha256Digest;

/// How long an open of a file not yet verified waits by default.
pub const DEFAULT_PENDING_WAIT: Duration = Duration::from_secs(600);

/// State of one file of a model served while its artifact is fetched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PendingFile {
    /// Verified: its bytes are this blob of the entry's store.
    Verified(Sha256Digest),
    /// Not verified yet. `failures` counts the downloads of it that failed verification so
    /// far: an open waiting when it grows fails with `EIO`.
    Waiting { failures: u32 },
}

/// Per-file states of a pending mapping entry, in manifest order (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PendingFiles {
    files: Box<[PendingFile]>,
}

impl PendingFiles {
    /// States for a manifest of `files.len()` entries, in its order.
    pub fn new(files: Vec<PendingFile>) -> Self {
        Self {
            files: files.into_boxed_slice(),
        }
    }

    /// Every file waiting, none failed yet.
    pub fn all_waiting(len: usize) -> Self {
        Self::new(vec![PendingFile::Waiting { failures: 0 }; len])
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// The state of manifest entry `i` (`None` past the end).
    pub fn get(&self, i: usize) -> Option<PendingFile> {
        self.files.get(i).copied()
    }

    /// Sets the state of manifest entry `i` (ignored past the end).
    pub fn set(&mut self, i: usize, state: PendingFile) {
        if let Some(f) = self.files.get_mut(i) {
            *f = state;
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = PendingFile> + '_ {
        self.files.iter().copied()
    }

    /// How many files are verified.
    pub fn verified(&self) -> usize {
        self.files
            .iter()
            .filter(|f| matches!(f, PendingFile::Verified(_)))
            .count()
    }

    /// The blobs of the verified files (what garbage collection must keep).
    pub fn verified_blobs(&self) -> impl Iterator<Item = Sha256Digest> + '_ {
        self.files.iter().filter_map(|f| match f {
            PendingFile::Verified(b) => Some(*b),
            PendingFile::Waiting { .. } => None,
        })
    }
}

/// A counter of mapping swaps that waiting opens sleep on.
#[derive(Debug, Default)]
pub(crate) struct Changes {
    count: Mutex<u64>,
    changed: Condvar,
}

impl Changes {
    /// The current count: read it before reading the mapping, then [`Changes::wait`] with it,
    /// so a swap between the two is never missed.
    pub(crate) fn now(&self) -> u64 {
        *self.count.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn bump(&self) {
        *self.count.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        self.changed.notify_all();
    }

    /// Sleeps until the count moves past `seen` or `until` passes.
    pub(crate) fn wait(&self, seen: u64, until: Instant) {
        let mut count = self.count.lock().unwrap_or_else(PoisonError::into_inner);
        while *count == seen {
            let now = Instant::now();
            if now >= until {
                return;
            }
            count = self
                .changed
                .wait_timeout(count, until - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}
