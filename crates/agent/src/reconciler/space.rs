//! The actor's side of the disk budget (SPEC section 12; the decisions are in
//! [`super::decide::space`], the measurements in [`crate::disk`]).
//!
//! * Before each placement the disk is measured (one `statvfs`) and the event carries
//!   [`decide::Space`]: free bytes under the budget net of what admitted fetches will still
//!   write, and what this fetch needs: the artifact's size minus the blobs its own store
//!   already holds, minus the old files adoption will hard-link (only when the store and the
//!   models root are one mount: a link costs no bytes).
//! * A model refused for space is `Failed` with the `InsufficientStorage` reason and kept in
//!   `refused` with what it needs, while the core says it is parked for space
//!   ([`decide::Machine::parked_for_space`], from its own retry, never the reason's text) or
//!   its retry works. Every tick the disk is measured again: the refused models that fit now ([`decide::space::start_refused`]) are retried at once (a release, a
//!   collection pass, another writer deleting files all show up there), the others stay
//!   `Failed` and are checked again at the next tick. Their pending retry is parked, not
//!   timed: a re-check never resolves the source again, so a refused model does not flap
//!   through `Updating` (each flap a status write and a Kubernetes Event). A change of its
//!   spec still starts over at once, as for any failed model.
//! * While some model is refused, [`Reconciler::reclaim`] removes what nothing serves (stores
//!   released or reserved, and the blobs of retired revisions in stores that stay), in the
//!   order of [`decide::space::reclaim_order`], never a store the mount uses or a fetch writes,
//!   nor a blob an open file may read.
//! * The passes over every store run at every tick only while a fetch is admitted or a model
//!   refused; otherwise every [`FULL_MEASURE_IDLE`], so an idle tick costs one `statvfs`, and
//!   a placement costs one `statvfs` plus a `stat` per file adoption may link.
//! * A fetch that hits a full disk anyway (another writer filled it) fails with the same
//!   reason and waits the same way; the mount and every served model are untouched (the
//!   records and status writes have their own retry, `persist::FileWrites`).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;

use super::decide::space::{ReclaimCandidate, ReclaimClass, ReclaimWhat};
use super::decide::{self, Space};
use super::gc::RetiredBlobs;
use super::{Reconciler, Stage};
use crate::disk::{DiskBudget, DiskState, FsSpace, Placement};
use crate::source::SourceError;
use modelfs_core::artifact::Manifest;
use modelfs_core::store::{StoreError, StoreId};
use modelfs_ome::{ModelKey, ModelSpec};

/// With nothing refused and nothing admitted, the passes over every store (the bytes of all
/// stores, of reserved and releasable ones) run this often; otherwise at every tick. An idle
/// tick costs one `statvfs`.
const FULL_MEASURE_IDLE: Duration = Duration::from_secs(30);

/// The actor's disk bookkeeping.
pub(super) struct Disk {
    pub(super) budget: Option<DiskBudget>,
    /// The store and the models root are one mount: adoption links.
    pub(super) links: bool,
    pub(super) shared: Arc<ArcSwap<DiskState>>,
    /// Bytes each fetch in progress was admitted with, and their sum.
    admitted: HashMap<ModelKey, u64>,
    admitted_total: u64,
    /// Of `admitted_total`, what the fetches had written at the last full measurement.
    written_seen: u64,
    /// When the passes over every store last ran.
    last_full: Option<Instant>,
    /// Models refused for space, with the bytes their fetch needs.
    pub(super) refused: BTreeMap<ModelKey, u64>,
    /// What was last saved to [`crate::disk::DISK_FILE`] (see [`DiskState::saved_part`]).
    saved: Option<(String, u64, u64, u64, u64)>,
}

impl Disk {
    pub(super) fn new(budget: Option<DiskBudget>) -> Self {
        Self {
            budget,
            links: false,
            shared: Arc::new(ArcSwap::from_pointee(DiskState::default())),
            admitted: HashMap::new(),
            admitted_total: 0,
            written_seen: 0,
            last_full: None,
            refused: BTreeMap::new(),
            saved: None,
        }
    }
}

/// Whether `err` is a full disk (`ENOSPC`, `EDQUOT`) rather than another failure.
pub fn is_disk_full(err: &SourceError) -> bool {
    let io_full =
        |e: &std::io::Error| matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT));
    match err {
        SourceError::Store { source, .. } => match source {
            StoreError::DiskFull { .. } => true,
            StoreError::Io { source, .. } => io_full(source),
            _ => false,
        },
        SourceError::LocalIo { source, .. } => io_full(source),
        _ => {
            let mut next: Option<&(dyn std::error::Error + 'static)> =
                std::error::Error::source(err);
            while let Some(e) = next {
                if let Some(s) = e.downcast_ref::<StoreError>() {
                    if matches!(s, StoreError::DiskFull { .. }) {
                        return true;
                    }
                }
                if e.downcast_ref::<std::io::Error>().is_some_and(io_full) {
                    return true;
                }
                next = e.source();
            }
            false
        }
    }
}

fn gauge(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Reconciler {
    /// At start: which filesystem and mount hold the store and the models root, how much is
    /// free, and what adoption costs when they differ.
    pub(super) fn report_placement(&mut self) {
        let Some(under) = self.config.sources.under_mount.clone() else {
            return;
        };
        let state = self.state.root().to_path_buf();
        let placement = match Placement::measure(&state, under.as_fd()) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "cannot tell where the state directory and the models root are");
                return;
            }
        };
        let through_server = self.state.links_through_another_mount();
        self.disk.links = placement.links() || through_server;
        let human = decide::space::human_bytes;
        // The mount server hands a private copy of its mount (`modelfs_mount::confine`), so
        // links always go through it; whether the store and the models root are one mount
        // as this process sees them is told by the directory that holds the mount point.
        let one_mount_here = under
            .mount_dir()
            .parent()
            .and_then(|holder| {
                rustix::fs::statx(
                    rustix::fs::CWD,
                    holder,
                    rustix::fs::AtFlags::empty(),
                    rustix::fs::StatxFlags::MNT_ID,
                )
                .ok()
            })
            .is_some_and(|st| st.stx_mnt_id == placement.state_mount_id);
        if through_server && !one_mount_here {
            tracing::info!(
                state = %state.display(),
                models_root = %self.config.models_root_dir.display(),
                free = %human(placement.state_free),
                "the store and the models root are on one filesystem, mounted twice: adoption of old files links through the mount that holds both (no copy)"
            );
            return;
        }
        if placement.links() || through_server {
            tracing::info!(
                state = %state.display(),
                models_root = %self.config.models_root_dir.display(),
                mount_id = placement.state_mount_id,
                free = %human(placement.state_free),
                "the store and the models root are on one filesystem and one mount: adoption of old files is a hard link (no copy)"
            );
            return;
        }
        // The old tree's size is what adopting it costs now.
        let old =
            modelfs_core::store::fsutil::disk_usage(&under.proc_path(std::path::Path::new("")));
        tracing::warn!(
            state = %state.display(),
            state_mount_id = placement.state_mount_id,
            state_free = %human(placement.state_free),
            models_root = %self.config.models_root_dir.display(),
            models_root_mount_id = placement.models_root_mount_id,
            models_root_free = %human(placement.models_root_free),
            same_filesystem = placement.same_filesystem(),
            adoption_copies = %human(old),
            "the store and the models root are not one mount: adopting the files under the models root copies them (up to the size shown, read and written once) instead of linking them; put --state beside the models root (the default) to adopt without a copy, and where they are two mounts of one filesystem (two hostPath volumes) give the mount server their common parent as one volume (deploy/base/mount-server.yaml)"
        );
    }

    /// Measures the disk, publishes it and sets the gauges: one `statvfs`, and (`full`) the
    /// passes over every store and every admitted fetch; without `full` their last results
    /// are reused.
    pub(super) fn measure_disk(&mut self, full: bool) -> Arc<DiskState> {
        let fs = FsSpace::of(self.state.root()).unwrap_or_default();
        let last = self.disk.shared.load_full();
        if !full && self.disk.last_full.is_some() {
            let free = self
                .disk
                .budget
                .map(|b| b.free(&fs, last.stores_bytes))
                .unwrap_or(fs.available);
            let state = Arc::new(DiskState {
                filesystem: fs,
                free_bytes: free,
                budget_bytes: self.disk.budget.map(|b| b.limit(&fs)).unwrap_or(fs.size),
                ..(*last).clone()
            });
            self.publish_disk(&state);
            return state;
        }
        self.disk.last_full = Some(Instant::now());
        let stores_bytes: u64 = self.known.store_bytes.values().sum();
        let mut reserved = 0;
        let mut releasable = 0;
        for (id, s) in self.core.records.stores() {
            if s.owner.is_some() || self.core.records.user_count(id) > 0 {
                continue;
            }
            let bytes = self.known.store_bytes.get(id).copied().unwrap_or(0);
            if s.reserved {
                reserved += bytes;
            } else {
                releasable += bytes;
            }
        }
        // What admitted fetches will still write: admitted minus written so far. Fetches that
        // ended leave the sums.
        let mut committed = 0u64;
        let mut total = 0u64;
        let works = &self.works;
        self.disk.admitted.retain(|k, admitted| {
            let Some(Stage::Fetching { progress, .. }) = works.get(k).map(|w| &w.stage) else {
                return false;
            };
            total = total.saturating_add(*admitted);
            committed = committed.saturating_add(
                admitted.saturating_sub(progress.fetched_bytes.load(Ordering::Relaxed)),
            );
            true
        });
        self.disk.admitted_total = total;
        self.disk.written_seen = total - committed;
        let budget = self.disk.budget;
        let state = DiskState {
            state_dir: self.state.root().display().to_string(),
            budget: budget
                .map(|b| b.to_string())
                .unwrap_or_else(|| "none".into()),
            budget_bytes: budget.map(|b| b.limit(&fs)).unwrap_or(fs.size),
            filesystem: fs,
            stores_bytes,
            reserved_bytes: reserved,
            releasable_bytes: releasable,
            committed_bytes: committed,
            free_bytes: budget
                .map(|b| b.free(&fs, stores_bytes))
                .unwrap_or(fs.available),
            shortfall_bytes: 0,
        };
        let free_now = state.free_for_new_fetch();
        let shortfall = self
            .disk
            .refused
            .values()
            .map(|needed| needed.saturating_sub(free_now))
            .max()
            .unwrap_or(0);
        let state = Arc::new(DiskState {
            shortfall_bytes: shortfall,
            ..state
        });
        self.publish_disk(&state);
        state
    }

    fn publish_disk(&mut self, state: &Arc<DiskState>) {
        let m = &self.metrics.disk;
        m.free_bytes.set(gauge(state.free_bytes));
        m.used_bytes.set(gauge(state.stores_bytes));
        m.reserved_bytes.set(gauge(state.reserved_bytes));
        m.budget_bytes.set(gauge(state.budget_bytes));
        m.filesystem_available_bytes
            .set(gauge(state.filesystem.available));
        m.shortfall_bytes.set(gauge(state.shortfall_bytes));
        self.disk.shared.store(state.clone());
        self.save_disk(state);
    }

    /// Saves `state` to [`crate::disk::DISK_FILE`] when what is saved of it changed (for
    /// `modelfs status --state`). Best effort: a failed write (a full disk) is tried again at
    /// the next measurement and never holds anything up.
    fn save_disk(&mut self, state: &DiskState) {
        if self.disk.budget.is_none() {
            return;
        }
        let part = state.saved_part();
        if self.disk.saved.as_ref() == Some(&part) {
            return;
        }
        let bytes = serde_json::to_vec_pretty(state).unwrap_or_default();
        let path = self.state.root().join(crate::disk::DISK_FILE);
        match modelfs_core::store::fsutil::atomic_write(&path, &bytes) {
            Ok(()) => self.disk.saved = Some(part),
            Err(e) => {
                tracing::debug!(path = %path.display(), error = %e, "could not save the disk state")
            }
        }
    }

    /// Free bytes for a new fetch now: a fresh `statvfs`, the stores' bytes from the last full
    /// measurement, and what admitted fetches will still write (admitted since then counted
    /// whole). Costs no pass over the stores: it runs at every placement.
    fn free_now(&self) -> u64 {
        let fs = FsSpace::of(self.state.root()).unwrap_or_default();
        let last = self.disk.shared.load();
        let free = self
            .disk
            .budget
            .map(|b| b.free(&fs, last.stores_bytes))
            .unwrap_or(fs.available);
        let committed = self
            .disk
            .admitted_total
            .saturating_sub(self.disk.written_seen);
        free.saturating_sub(committed)
    }

    /// What admission needs to know for a fetch of `manifest` by `key` (`None`: no budget).
    pub(super) fn space_for(
        &mut self,
        key: &ModelKey,
        spec: &ModelSpec,
        manifest: &Manifest,
    ) -> Option<Space> {
        self.disk.budget?;
        let own = self.core.records.owned_store(key).cloned();
        let held = self.known_blobs(&[own], None).known;
        let adopt = if self.disk.links {
            self.adopt_from(spec)
        } else {
            None
        };
        let mut needed = 0u64;
        for e in manifest.entries() {
            if held.contains_key(&e.digest) {
                continue;
            }
            // An old file of the right size that adoption will link costs no bytes (if its
            // digest turns out wrong, the fetch writes it and a full disk fails it then).
            let linkable = adopt.as_ref().is_some_and(|a| {
                a.under
                    .linkable_size(&a.dir.join(e.path))
                    .is_some_and(|size| size == e.size)
            });
            if !linkable {
                needed = needed.saturating_add(e.size);
            }
        }
        Some(Space {
            free: self.free_now(),
            needed,
        })
    }

    /// After a placement of `key` with `space`: a fetch it started counts against the budget
    /// until it ends.
    pub(super) fn admitted(&mut self, key: &ModelKey, space: Option<Space>) {
        let Some(space) = space else {
            return;
        };
        if matches!(
            self.works.get(key).map(|w| &w.stage),
            Some(Stage::Fetching { .. })
        ) {
            let before = self.disk.admitted.insert(key.clone(), space.needed);
            self.disk.admitted_total = self
                .disk
                .admitted_total
                .saturating_sub(before.unwrap_or(0))
                .saturating_add(space.needed);
            self.disk.refused.remove(key);
        }
    }

    /// `key` was refused for space (or its fetch hit a full disk; the core recorded it
    /// `Failed` and parked its retry): its work stops, and it is checked again at every tick
    /// until `needed` bytes fit.
    pub(super) fn wait_for_space(&mut self, key: &ModelKey, needed: u64) {
        self.cancel_work(key);
        if let Some(n) = self.disk.admitted.remove(key) {
            self.disk.admitted_total = self.disk.admitted_total.saturating_sub(n);
        }
        self.disk.refused.insert(key.clone(), needed);
    }

    /// Whether `err` is a fetch failing on a full disk: then the reason and the bytes the model
    /// waits for, as for a refusal.
    pub(super) fn disk_full(&mut self, key: &ModelKey, err: &SourceError) -> Option<(String, u64)> {
        if !is_disk_full(err) {
            return None;
        }
        let needed = self.disk.admitted.get(key).copied().unwrap_or(0);
        let disk = self.measure_disk(true);
        self.metrics.disk.disk_full_fetches.inc();
        tracing::warn!(model = %key, error = %err, "the disk filled during the fetch");
        let reason = decide::space::disk_full_reason(disk.free_for_new_fetch());
        // At least one byte more than is free now: it waits until the disk has room again.
        let needed = needed.max(disk.free_for_new_fetch().saturating_add(1));
        Some((reason, needed))
    }

    /// Every tick: measure, make room for refused models, and retry those that fit now.
    pub(super) fn space_tick(&mut self) -> bool {
        if self.disk.budget.is_none() {
            return false;
        }
        // Forget refusals the model moved on from (served, deleted, changed, failing
        // otherwise): the core says which models are parked for space; one whose retry
        // started work keeps its place until the work places it again.
        let core = &self.core;
        self.disk
            .refused
            .retain(|k, _| core.parked_for_space(k) || core.phase(k).is_some());
        let busy = !self.disk.refused.is_empty() || !self.disk.admitted.is_empty();
        let full = busy
            || self
                .disk
                .last_full
                .is_none_or(|t| t.elapsed() >= FULL_MEASURE_IDLE);
        let mut disk = self.measure_disk(full);
        if self.disk.refused.is_empty() {
            return false;
        }
        let mut changed = false;
        if disk.shortfall_bytes > 0 && self.reclaim(disk.shortfall_bytes) {
            disk = self.measure_disk(true);
            changed = true;
        }
        let refused: Vec<(ModelKey, u64)> = self
            .disk
            .refused
            .iter()
            .map(|(k, n)| (k.clone(), *n))
            .collect();
        let keys = decide::space::start_refused(&refused, disk.free_for_new_fetch());
        self.step(decide::Event::SpaceFits { keys });
        self.metrics.disk.space_checks.inc();
        changed
    }

    /// Removes what nothing serves until `shortfall` bytes are free (or nothing is left to
    /// remove), in the order of [`decide::space::reclaim_order`]. Returns whether anything went.
    pub(super) fn reclaim(&mut self, shortfall: u64) -> bool {
        let (candidates, mut retired) = self.reclaim_candidates();
        let order = decide::space::reclaim_order(&candidates, shortfall);
        if order.is_empty() {
            return false;
        }
        for (id, what) in &order {
            if *what == ReclaimWhat::RetiredBlobs {
                if let Some(r) = retired.remove(id) {
                    self.remove_retired_blobs(id, &r.names);
                    tracing::info!(store = %id, blobs = r.names.len(), bytes = r.bytes, "reclaimed the blobs of retired revisions under disk pressure");
                }
            }
        }
        let mut chosen: Vec<StoreId> = order
            .into_iter()
            .filter(|(_, what)| *what == ReclaimWhat::Store)
            .map(|(id, _)| id)
            .collect();
        chosen.retain(|id| !self.withdraw_placed(id));
        if chosen.is_empty() {
            return true;
        }
        self.remove_reclaimed(&chosen, &candidates)
    }

    /// A reserved store still placed at its path: its directory is withdrawn now (returns
    /// true); the store goes at a later pass, when the mount no longer reads it (never while
    /// a file of it is open).
    fn withdraw_placed(&mut self, id: &StoreId) -> bool {
        let placed = self
            .core
            .records
            .stores()
            .get(id)
            .is_some_and(|s| s.reserved_at.is_some());
        if placed {
            if let Some(mut s) = self.core.records.store_mut(id) {
                s.reserved_at = None;
            }
            self.batch.remap_needed = true;
            self.batch.flush_pending = true;
            tracing::info!(store = %id, "withdrew a reserved model's directory to reclaim its store under disk pressure");
        }
        placed
    }

    /// Forgets the `chosen` stores and removes their directories. Returns whether the records
    /// were saved (nothing is removed otherwise).
    fn remove_reclaimed(&mut self, chosen: &[StoreId], candidates: &[ReclaimCandidate]) -> bool {
        for id in chosen {
            self.forget_store(id);
        }
        // Records first (as garbage collection does): a directory goes only once no saved
        // record names it. A failed save removes nothing; the next tick tries again.
        if !self.save() {
            return false;
        }
        for id in chosen {
            let c = candidates.iter().find(|c| &c.store == id);
            match self.state.remove_store(id) {
                Ok(()) => {
                    self.metrics.disk.reclaimed_stores.inc();
                    tracing::info!(store = %id, class = ?c.map(|c| c.class), bytes = c.map_or(0, |c| c.bytes), "reclaimed under disk pressure");
                }
                Err(e) => {
                    tracing::warn!(store = %id, error = %e, "could not remove a store under disk pressure")
                }
            }
        }
        true
    }

    /// What reclaiming could remove: stores nothing serves (reserved, in grace, expired) and
    /// the retired blobs of stores that stay, with the retired blobs' names by store.
    fn reclaim_candidates(&self) -> (Vec<ReclaimCandidate>, BTreeMap<StoreId, RetiredBlobs>) {
        let busy_fetch = self.fetching_stores();
        let now = Instant::now();
        let grace = self.config.gc_grace;
        let mut candidates = Vec::new();
        for (id, s) in self.core.records.stores() {
            if s.owner.is_some() || self.core.records.user_count(id) > 0 {
                continue;
            }
            // A reserved store keeps its last owner's directory in the mapping (read-only, as
            // OME keeps it) until it is released: under pressure it is released, its directory
            // withdrawn first and the store removed by a later pass once nothing reads it.
            let placed = s.reserved && s.reserved_at.is_some();
            let busy = busy_fetch.contains(id) || (!placed && self.fs.store_in_use(id));
            let bytes = self.known.store_bytes.get(id).copied().unwrap_or(0);
            let (class, age_secs) = if s.reserved {
                let age = self
                    .state
                    .existing_store(id)
                    .and_then(|st| std::fs::metadata(st.root()).ok())
                    .and_then(|m| m.modified().ok())
                    .and_then(|t| SystemTime::now().duration_since(t).ok())
                    .map_or(0, |d| d.as_secs());
                (ReclaimClass::Reserved, age)
            } else {
                let seen = self.gc.candidates.first_seen(&format!("store:{id}"));
                let age = seen.map_or(Duration::ZERO, |t| now.duration_since(t));
                let class = if age >= grace {
                    ReclaimClass::Expired
                } else {
                    ReclaimClass::InGrace
                };
                (class, age.as_secs())
            };
            candidates.push(ReclaimCandidate {
                store: id.clone(),
                what: ReclaimWhat::Store,
                class,
                age_secs,
                bytes,
                busy,
            });
        }
        // Retired revisions in stores that stay: their unreferenced blobs, in grace.
        let retired = self.retired_blobs();
        for (id, r) in &retired {
            let age = r.since.map_or(Duration::ZERO, |t| now.duration_since(t));
            candidates.push(ReclaimCandidate {
                store: id.clone(),
                what: ReclaimWhat::RetiredBlobs,
                class: if age >= grace {
                    ReclaimClass::Expired
                } else {
                    ReclaimClass::InGrace
                },
                age_secs: age.as_secs(),
                bytes: r.bytes,
                busy: false,
            });
        }
        (candidates, retired)
    }
}
