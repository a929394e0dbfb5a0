//! Disk admission and reclaim order (SPEC section 12), as pure decisions.
//!
//! *Admission*: a fetch is started only when the bytes it still has to write fit in what the
//! disk budget leaves free ([`Space`], measured by the actor just before the decision: free
//! bytes under the budget, minus what fetches already admitted will still write). A fetch that
//! does not fit is not started: the model is `Failed` with an `InsufficientStorage` reason that
//! states both numbers. It then stays `Failed` with that reason, without a retry timer: at
//! every tick the disk is measured again and [`start_refused`] picks the refused models that
//! fit now, which start then (resolved again at that point, as any retry is). Re-checking
//! costs a `statvfs`, never a resolve of the source: a refused model re-resolved on a timer
//! would show `Updating` between two refusals, and each flap costs a status write and a
//! Kubernetes Event per model, for nothing, as long as the disk stays full. Refusing up front
//! is the point: a fetch of hundreds of GB that fails at 95% wastes the bandwidth and leaves
//! the disk full for every other writer of the node.
//!
//! *Reclaim*: under pressure (a refused fetch), what nothing serves goes before its grace
//! period ends. The order is fixed here ([`reclaim_order`]): garbage whose grace period is over
//! first (it goes anyway), then garbage inside its grace period (released stores, and the
//! blobs of retired revisions left in a store that still serves a newer one: the grace period
//! only spares a quick re-create a download), then reserved stores (an operator asked to keep
//! those); within a class, oldest first. A store that is mapped or open never goes, whatever
//! its class (its reader would see `ESTALE`), nor a blob an open file may still read.

use modelfs_core::store::StoreId;

/// What admission needs to know about the disk for one fetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Space {
    /// Bytes the stores may still write under the budget (already net of the bytes that
    /// admitted fetches will still write).
    pub free: u64,
    /// Bytes this fetch will write: the artifact's size minus what the store already holds.
    pub needed: u64,
}

impl Space {
    /// Whether the fetch fits.
    pub fn fits(&self) -> bool {
        self.needed <= self.free
    }

    /// Bytes to reclaim before the fetch fits (0 when it does).
    pub fn shortfall(&self) -> u64 {
        self.needed.saturating_sub(self.free)
    }
}

/// The reason a model shows when its fetch does not fit.
pub fn insufficient_reason(space: &Space) -> String {
    format!(
        "InsufficientStorage: needs {}, {} free under the budget",
        human_bytes(space.needed),
        human_bytes(space.free)
    )
}

/// The reason a model shows when the disk filled during its fetch (another writer): the
/// budget said it fitted, the filesystem disagreed.
pub fn disk_full_reason(free: u64) -> String {
    format!(
        "InsufficientStorage: the disk filled during the fetch (no space left on device), {} free under the budget",
        human_bytes(free)
    )
}

/// Bytes in binary units with at most one decimal: `412 GiB`, `1.5 MiB`, `512 B`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if v >= 100.0 || (v - v.round()).abs() < 0.05 {
        format!("{:.0} {}", v.round(), UNITS[unit])
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Of the models refused for space (each with the bytes its fetch needs), those to start now
/// that `free` bytes are free under the budget: smallest first, each counted against the
/// ones before it, so two refused models never start on the same free bytes; ties by key.
/// A model that does not fit stays refused, however long it has waited (no timer: only the
/// disk decides).
pub fn start_refused<K: Ord + Clone>(refused: &[(K, u64)], free: u64) -> Vec<K> {
    let mut order: Vec<&(K, u64)> = refused.iter().collect();
    order.sort_by(|a, b| a.1.cmp(&b.1).then(a.0.cmp(&b.0)));
    let mut left = free;
    let mut out = Vec::new();
    for (key, needed) in order {
        if *needed > left {
            break;
        }
        left -= needed;
        out.push(key.clone());
    }
    out
}

/// Why a store may be reclaimed, in the order classes go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ReclaimClass {
    /// Garbage whose grace period is over: the next collection pass removes it anyway.
    Expired,
    /// Garbage inside its grace period: a retired revision, a released store.
    InGrace,
    /// Kept by the reserve label, with no model served from it.
    Reserved,
}

/// What of a store pressure removes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReclaimWhat {
    /// The whole store (it serves nothing).
    Store,
    /// The blobs of retired revisions in a store that still serves (none of them is
    /// referenced by what it serves, nor read by an open file).
    RetiredBlobs,
}

/// One thing pressure may remove.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReclaimCandidate {
    pub store: StoreId,
    pub what: ReclaimWhat,
    pub class: ReclaimClass,
    /// Seconds since it stopped serving anything (larger is older); for a reserved store
    /// without a known release time, its age as a store.
    pub age_secs: u64,
    /// Bytes removing it frees.
    pub bytes: u64,
    /// Mapped, open, or written by a fetch: never removed.
    pub busy: bool,
}

/// The stores to remove, in order, until `shortfall` bytes are freed: classes in the order of
/// [`ReclaimClass`], oldest first within a class, busy ones never. Stops as soon as enough is
/// freed; when everything available is not enough, everything available is returned (the
/// fetch still waits, but with the most room the disk can give, and the next admission
/// check sees it).
pub fn reclaim_order(
    candidates: &[ReclaimCandidate],
    shortfall: u64,
) -> Vec<(StoreId, ReclaimWhat)> {
    if shortfall == 0 {
        return Vec::new();
    }
    let mut eligible: Vec<&ReclaimCandidate> = candidates.iter().filter(|c| !c.busy).collect();
    eligible.sort_by(|a, b| {
        a.class
            .cmp(&b.class)
            .then(b.age_secs.cmp(&a.age_secs))
            .then(a.store.cmp(&b.store))
    });
    let mut freed = 0u64;
    let mut out = Vec::new();
    for c in eligible {
        if freed >= shortfall {
            break;
        }
        freed = freed.saturating_add(c.bytes);
        out.push((c.store.clone(), c.what));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn admission_table() {
        // (free, needed, fits, shortfall)
        let cases = [
            (10 * GIB, 0, true, 0),
            (10 * GIB, 10 * GIB, true, 0),
            (10 * GIB, 10 * GIB + 1, false, 1),
            (0, 1, false, 1),
            (120 * GIB, 412 * GIB, false, 292 * GIB),
        ];
        for (free, needed, fits, shortfall) in cases {
            let s = Space { free, needed };
            assert_eq!(s.fits(), fits, "{s:?}");
            assert_eq!(s.shortfall(), shortfall, "{s:?}");
        }
    }

    #[test]
    fn start_refused_table() {
        let refused = [("a", 5 * GIB), ("b", 2 * GIB), ("c", 2 * GIB), ("d", 0)];
        // (free, models started, in order)
        let cases: [(u64, Vec<&str>); 7] = [
            // Nothing free: only a fetch that writes nothing (all its blobs held).
            (0, vec!["d"]),
            (GIB, vec!["d"]),
            // Smallest first, ties by key; each counted against the ones before it.
            (2 * GIB, vec!["d", "b"]),
            (4 * GIB - 1, vec!["d", "b"]),
            (4 * GIB, vec!["d", "b", "c"]),
            // The first that does not fit ends the check.
            (8 * GIB, vec!["d", "b", "c"]),
            (9 * GIB, vec!["d", "b", "c", "a"]),
        ];
        for (free, want) in cases {
            assert_eq!(start_refused(&refused, free), want, "free {free}");
        }
        assert!(start_refused::<&str>(&[], u64::MAX).is_empty());
        // Order of the input does not matter.
        let mut reversed = refused;
        reversed.reverse();
        assert_eq!(start_refused(&reversed, 4 * GIB), vec!["d", "b", "c"]);
    }

    #[test]
    fn reason_names_both_numbers_in_binary_units() {
        let s = Space {
            free: 120 * GIB,
            needed: 412 * GIB,
        };
        assert_eq!(
            insufficient_reason(&s),
            "InsufficientStorage: needs 412 GiB, 120 GiB free under the budget"
        );
        assert!(disk_full_reason(3 << 20).starts_with("InsufficientStorage: the disk filled"));
        assert!(disk_full_reason(3 << 20).contains("3 MiB free"));
    }

    #[test]
    fn human_bytes_table() {
        let cases = [
            (0, "0 B"),
            (1023, "1023 B"),
            (1024, "1 KiB"),
            (1536, "1.5 KiB"),
            (64 << 20, "64 MiB"),
            (412 * GIB, "412 GiB"),
            (2 * 1024 * GIB, "2 TiB"),
            (u64::MAX, "16 EiB"),
        ];
        for (n, want) in cases {
            assert_eq!(human_bytes(n), want, "{n}");
        }
    }

    fn store(n: u64) -> StoreId {
        StoreId::from_seq(n)
    }

    fn cand(n: u64, class: ReclaimClass, age: u64, bytes: u64, busy: bool) -> ReclaimCandidate {
        ReclaimCandidate {
            store: store(n),
            what: ReclaimWhat::Store,
            class,
            age_secs: age,
            bytes,
            busy,
        }
    }

    #[test]
    fn reclaim_order_table() {
        use ReclaimClass::*;
        let all = vec![
            cand(1, Reserved, 9000, 100, false),
            cand(2, InGrace, 10, 100, false),
            cand(3, InGrace, 200, 100, false),
            cand(4, Expired, 5, 100, false),
            cand(5, Expired, 50, 100, true),
            cand(6, InGrace, 900, 100, true),
        ];
        // (shortfall, expected stores in order)
        let cases: [(u64, Vec<u64>); 6] = [
            (0, vec![]),
            (1, vec![4]),
            (100, vec![4]),
            (101, vec![4, 3]),
            (250, vec![4, 3, 2]),
            // More than everything: all that is not busy, busy ones never.
            (10_000, vec![4, 3, 2, 1]),
        ];
        for (shortfall, want) in cases {
            let want: Vec<(StoreId, ReclaimWhat)> = want
                .into_iter()
                .map(|n| (store(n), ReclaimWhat::Store))
                .collect();
            assert_eq!(
                reclaim_order(&all, shortfall),
                want,
                "shortfall {shortfall}"
            );
        }
    }

    #[test]
    fn reclaim_order_prefers_oldest_within_a_class_and_ties_by_store() {
        use ReclaimClass::*;
        let all = vec![
            cand(7, Reserved, 10, 50, false),
            cand(3, Reserved, 10, 50, false),
            cand(9, Reserved, 30, 50, false),
        ];
        let got: Vec<StoreId> = reclaim_order(&all, 120)
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        assert_eq!(got, vec![store(9), store(3), store(7)]);
    }

    #[test]
    fn retired_blobs_of_a_serving_store_go_with_the_other_garbage_in_grace() {
        use ReclaimClass::*;
        let blobs = |n, age, bytes| ReclaimCandidate {
            what: ReclaimWhat::RetiredBlobs,
            ..cand(n, InGrace, age, bytes, false)
        };
        let all = vec![
            cand(1, Reserved, 9000, 100, false),
            blobs(2, 50, 100),
            cand(3, InGrace, 10, 100, false),
            cand(4, Expired, 1, 100, false),
        ];
        assert_eq!(
            reclaim_order(&all, 350),
            vec![
                (store(4), ReclaimWhat::Store),
                (store(2), ReclaimWhat::RetiredBlobs),
                (store(3), ReclaimWhat::Store),
                (store(1), ReclaimWhat::Store),
            ]
        );
        assert_eq!(
            reclaim_order(&all, 150),
            vec![
                (store(4), ReclaimWhat::Store),
                (store(2), ReclaimWhat::RetiredBlobs)
            ]
        );
    }
}
