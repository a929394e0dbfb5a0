//! `modelfs-core`: what a model's files are and where their bytes live.
//!
//! * [`artifact`]: an artifact is the immutable list of a model's files (path, size, digest),
//!   identified by its own digest; a stored artifact adds the blob each file reads from.
//! * [`store`]: content-addressed blob stores (staging, verification, publishing with one
//!   `syncfs` per batch, hard links, deletion) and the state directory's files.
//!
//! # Place in the workspace
//!
//! The bottom layer, beside `modelfs-ome`: it depends on no other modelfs crate and on no
//! network, Kubernetes or async runtime crate, only hashing, serde and system calls (rustix).
//! Both processes build on it: the mount server (`modelfs-mount`) reads artifacts and opens
//! blobs, the agent (`modelfs-agent`) fetches into stores and decides what they hold. It knows
//! nothing about OME objects or policies: who owns which store and which model serves what are
//! the agent's records, so this crate stores blobs and forgets why.

#![forbid(unsafe_code)]

pub mod artifact;
pub mod store;

/// Binary search over the indexes `range` of a sorted sequence that is not a slice (packed
/// strings read by index): the index whose key `cmp` finds equal, if any. `cmp(i)` orders the
/// key at `i` against the one sought.
pub fn search_sorted(
    range: std::ops::Range<usize>,
    cmp: impl Fn(usize) -> std::cmp::Ordering,
) -> Option<usize> {
    let (mut lo, mut hi) = (range.start, range.end);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match cmp(mid) {
            std::cmp::Ordering::Less => lo = mid + 1,
            std::cmp::Ordering::Greater => hi = mid,
            std::cmp::Ordering::Equal => return Some(mid),
        }
    }
    None
}
