//! Writing `records.json` and `status.json` when the disk refuses (full, read-only, I/O
//! errors).
//!
//! The daemon keeps working from memory: decisions, the mapping and `GET /v1/models` stay
//! current, and the writes are retried with exponential backoff (1 s doubling to 60 s) instead
//! of on every event. The failure is logged once when it starts and once when a write works
//! again, not once per attempt (a full disk produced several lines a second before), and
//! counted in `modelfs_state_write_failures_total{file=...}`.

use std::time::{Duration, Instant};

use super::Reconciler;
use crate::retry::Backoff;
use modelfs_core::artifact::Sha256Digest;

/// 1 s doubling to 60 s, without jitter ([`crate::retry`]).
const WRITE_RETRY: Backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));

/// Failure state of one file's writes.
#[derive(Debug)]
pub(super) struct FileWrites {
    file: &'static str,
    /// Failures in a row (0: the last write worked).
    failures: u32,
    /// No attempt before this instant (set after a failure).
    next_attempt: Option<Instant>,
}

impl FileWrites {
    pub(super) fn new(file: &'static str) -> Self {
        Self {
            file,
            failures: 0,
            next_attempt: None,
        }
    }

    /// Whether an attempt now respects the backoff.
    pub(super) fn due(&self) -> bool {
        self.next_attempt.is_none_or(|at| Instant::now() >= at)
    }

    pub(super) fn failing(&self) -> bool {
        self.failures > 0
    }

    fn succeeded(&mut self) {
        if self.failures > 0 {
            tracing::info!(
                file = self.file,
                failed_attempts = self.failures,
                "writing works again; the file is current"
            );
        }
        self.failures = 0;
        self.next_attempt = None;
    }

    fn failed(&mut self, error: &std::io::Error) {
        self.failures += 1;
        let delay = WRITE_RETRY.step(self.failures);
        self.next_attempt = Some(Instant::now() + delay);
        if self.failures == 1 {
            tracing::error!(
                file = self.file,
                %error,
                "writing failed; the daemon keeps serving and reporting from memory and retries \
                 with backoff (next message when it works again)"
            );
        } else {
            tracing::debug!(file = self.file, %error, attempt = self.failures, "writing failed again");
        }
    }

    /// Records the outcome of one attempt.
    pub(super) fn record(
        &mut self,
        result: &std::io::Result<()>,
        metrics: &crate::metrics::Metrics,
    ) {
        match result {
            Ok(()) => self.succeeded(),
            Err(e) => {
                metrics
                    .state_write_failures
                    .get_or_create(&crate::metrics::FileLabel {
                        file: self.file.to_owned(),
                    })
                    .inc();
                self.failed(e)
            }
        }
    }
}

impl Reconciler {
    /// Saves the records if they changed. Always attempts (callers that need the records on
    /// disk before they create a directory rely on it); the backoff only spaces out retries
    /// that nothing asks for (see [`Reconciler::retry_failed_writes`]). Returns whether the
    /// records on disk are current.
    pub(super) fn save(&mut self) -> bool {
        let ok = self.write_records();
        // Fetches waiting for this save may create their store directories now (a failed
        // write lets them go too, as it always did: the write is retried with backoff, and
        // holding every download back while a disk is full would only add a second failure).
        self.saving.saves.send_modify(|n| *n += 1);
        ok
    }

    fn write_records(&mut self) -> bool {
        let bytes = match serde_json::to_vec_pretty(&self.core.records) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "records do not serialize");
                return false;
            }
        };
        // A digest, not the bytes: the records of 10,000 models are megabytes.
        let digest = Sha256Digest::of(&bytes);
        if self.saving.saved == Some(digest) {
            return true;
        }
        let result = modelfs_core::store::fsutil::atomic_write(&self.state.records_path(), &bytes);
        let ok = result.is_ok();
        self.saving.records_writes.record(&result, &self.metrics);
        if ok {
            self.saving.saved = Some(digest);
        }
        ok
    }

    /// Builds the status document and, if it changed, publishes it (in memory: `GET /v1/models`
    /// and the Kubernetes status writer) and writes `status.json`.
    pub(super) fn publish(&mut self) {
        // Every served artifact gets its config parsed once; the result arrives as an event
        // and is published then.
        self.request_model_configs();
        let doc = self.status_doc();
        let bytes = serde_json::to_vec_pretty(&doc).unwrap_or_default();
        let digest = Sha256Digest::of(&bytes);
        if self.publishing.digest == Some(digest) {
            return;
        }
        for status in ["Ready", "Updating", "Failed"] {
            let n = doc.values().filter(|e| e.status == status).count();
            self.metrics
                .models
                .get_or_create(&crate::metrics::StatusLabel { status })
                .set(n as i64);
        }
        // The file first: whoever sees a document in memory (`GET /v1/models`) then finds
        // `status.json` at least as new (`modelfs status --state` reads it).
        self.publishing.file_stale = true;
        if self.publishing.writes.due() {
            self.write_status_bytes(&bytes);
        }
        let doc = std::sync::Arc::new(doc);
        self.publishing.status.store(doc.clone());
        self.publishing.changes.send_replace(doc);
        self.publishing.digest = Some(digest);
    }

    /// Writes the published document again (a retry after a failed write).
    fn write_status_file(&mut self) {
        let bytes = serde_json::to_vec_pretty(&**self.publishing.status.load()).unwrap_or_default();
        self.write_status_bytes(&bytes);
    }

    fn write_status_bytes(&mut self, bytes: &[u8]) {
        let result = modelfs_core::store::fsutil::atomic_write(&self.state.status_path(), bytes);
        self.publishing.file_stale = result.is_err();
        self.publishing.writes.record(&result, &self.metrics);
    }

    /// After an event that changed nothing: retries writes that failed, once their backoff is
    /// over.
    pub(super) fn retry_failed_writes(&mut self) {
        if self.saving.records_writes.failing() && self.saving.records_writes.due() {
            self.save();
        }
        if self.publishing.file_stale && self.publishing.writes.due() {
            self.write_status_file();
        }
    }
}
