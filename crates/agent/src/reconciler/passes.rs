//! The whole-state passes that follow a batch of events (the path rule over every claim, the
//! mapping swap, saving the records, publishing the status), their pacing, and the periodic
//! tick.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::decide;
use super::handle::now_secs;
#[cfg(debug_assertions)]
use super::records;
use super::{Event, Reconciler, Stage};
use modelfs_core::store::StoreId;
use modelfs_ome::ModelKey;

/// Most events handled before the records are saved and the status published.
pub(super) const MAX_BATCH: usize = 64;

/// The whole-state passes after a batch (path rule, mapping, records, status: each O(models))
/// wait after each run for this many times what that run cost, so they take at most about a
/// fifth of the actor's time however fast events arrive (see [`FlushPacer`]).
pub(super) const FLUSH_COST_RATIO: u32 = 4;

/// ... but never longer than this: the status and the mapping lag the records by at most this
/// plus one pass.
pub(super) const FLUSH_DELAY_MAX: Duration = Duration::from_secs(1);

/// Longest time between two garbage collection passes when nothing changes.
pub(super) const GC_BACKSTOP: Duration = Duration::from_secs(600);

/// When the whole-state passes may run again. Each pass over the state costs time proportional
/// to the number of models, and events arrive one by one while a node imports (a fetch
/// completing, a config parsed): run after every batch, the passes made an import of N models
/// cost O(N^2) (10,000 models: most of the actor's time went to rebuilding the mapping, the
/// records file and the status document). Paced by their own measured cost instead, they take
/// a bounded share of the time at any scale, and with few models (a pass of microseconds) they
/// still run after every batch. Decisions never wait for them (only a fetch into a new store
/// directory waits for the next records write: see `Reconciler::saves`): what is derived from
/// the records (the mapping, `records.json`, the status) lags, by at most [`FLUSH_DELAY_MAX`] plus
/// one pass, and all of it together, so the status never says Ready before the mapping serves
/// the model.
pub(super) struct FlushPacer {
    /// Not before this instant.
    next: Instant,
    /// A wake-up for `next` is on its way.
    pub(super) wake_pending: bool,
}

impl FlushPacer {
    fn new() -> Self {
        Self {
            next: Instant::now(),
            wake_pending: false,
        }
    }

    fn due(&self, now: Instant) -> bool {
        now >= self.next
    }

    /// A pass that started at `started` just ended.
    fn ran(&mut self, started: Instant) {
        let now = Instant::now();
        self.next = now + ((now - started) * FLUSH_COST_RATIO).min(FLUSH_DELAY_MAX);
    }
}

/// What the events of the current batch left for the whole-state passes.
pub(super) struct Batch {
    /// The records changed what is served; the mapping is rebuilt once at the end of the batch
    /// of events, after the path rule has been applied (so it never sees a conflict).
    pub(super) remap_needed: bool,
    /// Claims may have changed in this batch: the path rule runs over the state at its end.
    pub(super) settle_due: bool,
    /// The first desired state of this batch: when it arrived and the mapping's generation then.
    pub(super) desired_received: Option<(Instant, u64)>,
    /// Events changed the records or the status since the last whole-state passes.
    pub(super) flush_pending: bool,
    pub(super) pacer: FlushPacer,
}

impl Batch {
    pub(super) fn new() -> Self {
        Self {
            remap_needed: false,
            settle_due: false,
            desired_received: None,
            flush_pending: false,
            pacer: FlushPacer::new(),
        }
    }
}

impl Reconciler {
    /// The periodic tick: the disk check, retries due, periodic re-resolves, waiters whose
    /// wake-up was lost, expired cache-view snapshots, garbage collection when due. Returns
    /// whether anything changed.
    pub(super) fn on_tick(&mut self) -> bool {
        let mut changed = self.space_tick();
        changed |= self.retry_due();
        self.request_node_dir_configs();
        // Waiters whose model's work ended without a wake-up (a safety net: every
        // end of work wakes its waiters).
        let stale: Vec<ModelKey> = self
            .core
            .waited_on()
            .filter(|k| !self.works.contains_key(k))
            .cloned()
            .collect();
        for k in stale {
            self.work_changed(&k);
        }
        self.wake_waiters();
        self.gc.due |= changed;
        // Download progress moves without events.
        changed |= self
            .works
            .values()
            .any(|w| matches!(w.stage, Stage::Fetching { .. }));
        // Lingering cache-view snapshots that expired leave the mapping.
        if self
            .hf_cache
            .as_ref()
            .is_some_and(|v| v.expired(Instant::now()))
        {
            self.batch.remap_needed = true;
            self.gc.due = true;
        }
        // A pass every 5 ticks, or more often when the grace period is shorter, when
        // something may have become garbage (or garbage is waiting for its grace
        // period to end); else only every GC_BACKSTOP, for what ages without any
        // change (partial downloads abandoned by a crash).
        let gc_every = (self.config.tick * 5).min(self.config.gc_grace.max(self.config.tick));
        let usage = self.fs.usage_epoch();
        let wanted = self.gc.due
            || usage != self.gc.usage_seen
            || !self.gc.candidates.is_empty()
            || self.gc.last.elapsed() >= GC_BACKSTOP;
        if wanted && self.gc.last.elapsed() >= gc_every {
            self.gc.last = Instant::now();
            self.gc.due = false;
            self.gc.usage_seen = usage;
            changed |= self.gc();
        }
        changed
    }

    /// The actor's loop, on a blocking-pool thread: it may block on disk work.
    pub(super) fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Event>,
        runtime_gone: Arc<AtomicBool>,
    ) {
        while let Some(first) = rx.blocking_recv() {
            if runtime_gone.load(Ordering::Acquire) {
                return;
            }
            // Handle what is queued (up to MAX_BATCH events), then run the whole-state passes
            // once for all of them when the pacer allows: a burst of events (a node's models
            // arriving together) costs one mapping swap and one records write, not one each.
            let mut next = Some(first);
            let mut handled = 0;
            while let Some(event) = next.take() {
                match event {
                    Event::Shutdown(done) => {
                        // The batch's decisions are applied before stopping.
                        self.finish_batch();
                        self.shut_down();
                        let _ = done.send(());
                        return;
                    }
                    Event::Panic(message) => panic!("{message}"),
                    Event::Flush => self.batch.pacer.wake_pending = false,
                    other => self.batch.flush_pending |= self.handle(other),
                }
                handled += 1;
                if handled < MAX_BATCH && !runtime_gone.load(Ordering::Acquire) {
                    next = rx.try_recv().ok();
                }
            }
            let pending = self.batch.flush_pending
                || self.batch.settle_due
                || self.batch.remap_needed
                || self.batch.desired_received.is_some();
            if !pending {
                // Only retries of writes that failed (a full disk), when their backoff is over.
                self.retry_failed_writes();
            } else if self.batch.pacer.due(Instant::now()) {
                self.flush();
            } else if !self.batch.pacer.wake_pending {
                self.batch.pacer.wake_pending = true;
                let tx = self.sender();
                let at = tokio::time::Instant::from_std(self.batch.pacer.next);
                tokio::runtime::Handle::current().spawn(async move {
                    tokio::time::sleep_until(at).await;
                    let _ = tx.send(Event::Flush);
                });
            }
            self.publishing.alive.store(now_secs(), Ordering::Relaxed);
        }
    }

    /// The whole-state passes: the path rule and the mapping ([`Reconciler::finish_batch`]),
    /// then the records and the status if anything changed. Paced by [`FlushPacer`].
    pub(super) fn flush(&mut self) {
        let started = Instant::now();
        let changed = self.finish_batch() | std::mem::take(&mut self.batch.flush_pending);
        if changed {
            // Records that failed to save wait for their backoff, unless a fetch waits for
            // the save to create its store directory.
            let awaited = std::mem::take(&mut self.saving.fetch_awaits_save);
            if awaited || !self.saving.records_writes.failing() || self.saving.records_writes.due()
            {
                self.save();
            }
            self.publish();
        }
        self.batch.pacer.ran(started);
        self.metrics
            .state_pass_seconds
            .observe(started.elapsed().as_secs_f64());
    }

    /// Stops all work at a safe point and saves.
    pub(super) fn shut_down(&mut self) {
        for w in self.works.values() {
            w.cancel.cancel();
        }
        // Fetch tasks end at once; wait (bounded) until all have let go of their slots. Partial
        // files are a verified-on-resume prefix whatever the point.
        let all = self.config.max_concurrent_fetches.max(1) as u32;
        let slots = self.works.fetch_slots.clone();
        let _ = tokio::runtime::Handle::current().block_on(tokio::time::timeout(
            Duration::from_secs(10),
            slots.acquire_many_owned(all),
        ));
        self.save();
        self.publish();
    }

    /// After a batch of events: the path rule over the whole state, the waiters it woke, then
    /// one mapping swap for all the batch's flips (a burst of fetches completing costs one
    /// swap, not one each). Returns whether the mapping changed.
    pub(super) fn finish_batch(&mut self) -> bool {
        if std::mem::take(&mut self.batch.settle_due) {
            self.settle_paths();
            self.wake_waiters();
        }
        // A fetch served while it downloaded ended without recording anything (failed or
        // cancelled): its pending entry leaves the mapping.
        self.batch.remap_needed |= self.live_ended();
        let remapped = std::mem::take(&mut self.batch.remap_needed);
        if remapped {
            self.remap();
        }
        if let Some((received, generation)) = self.batch.desired_received.take() {
            if self.fs.generation() != generation {
                self.metrics
                    .mapping_update_seconds
                    .observe(received.elapsed().as_secs_f64());
            }
            if !self.publishing.ready.load(Ordering::Relaxed) {
                // Ready (the Kubernetes status sink's first write waits for it) only once the
                // status of the first desired state is out: a sink woken in between wrote the
                // document the records alone made at start, where a model served while it
                // downloads says `Updating`, and its label flapped across a restart.
                self.publish();
                self.publishing.ready.store(true, Ordering::Relaxed);
            }
        }
        #[cfg(debug_assertions)]
        self.check_indexes();
        remapped
    }

    /// Applies the path rule to the whole state after an event (and at start-up): a served
    /// model that now loses (an earlier model resolved to another artifact on its path, or
    /// records from before this rule hold two) is unmapped and `Failed`; a model whose work
    /// now loses stops; a loser the rule clears (the model it lost to went away, moved or
    /// changed) gets its turn.
    pub(super) fn settle_paths(&mut self) {
        self.apply_event(decide::Event::SettlePaths, None);
    }

    pub(super) fn refresh_store_bytes(&mut self) {
        let ids: Vec<StoreId> = self.core.records.stores().keys().cloned().collect();
        self.known.store_bytes.clear();
        for id in ids {
            self.update_store_bytes(&id);
        }
    }

    pub(super) fn update_store_bytes(&mut self, id: &StoreId) {
        let bytes = self
            .state
            .existing_store(id)
            .map(|s| s.disk_usage())
            .unwrap_or(0);
        self.known.store_bytes.insert(id.clone(), bytes);
        self.metrics
            .store_bytes
            .get_or_create(&crate::metrics::StoreLabel {
                store: id.to_string(),
            })
            .set(bytes as i64);
    }

    /// Debug builds: the path index holds every path of every record, and the records' and
    /// the work's indexes agree with a full scan.
    #[cfg(debug_assertions)]
    pub(super) fn check_indexes(&self) {
        assert_eq!(
            self.core.records.index(),
            &records::RecordsIndex::build(self.core.records.models(), self.core.records.stores()),
            "records index out of step"
        );
        self.core.paths.check(&self.core.records);
        // The core's phases and the executor's work agree.
        let phases: Vec<(&ModelKey, &str)> = self
            .core
            .working()
            .map(|(k, p)| (k, phase_name(p)))
            .collect();
        let works: Vec<(&ModelKey, &str)> = self
            .works
            .iter()
            .map(|(k, w)| (k, stage_name(&w.stage)))
            .collect();
        assert_eq!(
            phases, works,
            "the core's phases and the work in flight differ"
        );
    }
}

#[cfg(debug_assertions)]
fn phase_name(p: &decide::Phase) -> &'static str {
    match p {
        decide::Phase::Resolving { .. } => "resolving",
        decide::Phase::Waiting { .. } => "waiting",
        decide::Phase::Fetching { .. } => "fetching",
    }
}

#[cfg(debug_assertions)]
fn stage_name(s: &Stage) -> &'static str {
    match s {
        Stage::Resolving => "resolving",
        Stage::Waiting { .. } => "waiting",
        Stage::Fetching { .. } => "fetching",
    }
}
