//! Prometheus metrics, one registry per daemon.
//!
//! Bytes read are counted only for read-through opens: with passthrough the kernel reads the blob
//! directly and the daemon never sees the bytes (that is the point), so `passthrough_opens` is the
//! signal for that path.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabel {
    pub op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    pub status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreLabel {
    pub store: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabel {
    pub scheme: SourceScheme,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum SourceScheme {
    Local,
    Hf,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FileLabel {
    pub file: String,
}

pub struct Metrics {
    registry: Registry,
    pub fuse_requests: Family<OpLabel, Counter>,
    pub fuse_errors: Family<OpLabel, Counter>,
    pub read_bytes: Counter,
    pub passthrough_opens: Counter,
    pub read_through_opens: Counter,
    pub passthrough_fallbacks: Counter,
    pub kernel_invalidations: Counter,
    pub mapping_changes: Counter,
    pub models: Family<StatusLabel, Gauge>,
    pub store_bytes: Family<StoreLabel, Gauge>,
    pub fetched_bytes: Family<SourceLabel, Counter>,
    pub fetched_files: Family<SourceLabel, Counter>,
    pub open_files: Gauge,
    /// From a desired-state change reaching the reconciler to the new mapping being live, for
    /// changes that need no fetch (policy flips, deletions, re-points).
    pub mapping_update_seconds: Histogram,
    /// Standalone mode: rescans of the models directory, and manifest files read and parsed
    /// (only new or changed files are).
    pub manifest_rescans: Counter,
    pub manifest_parses: Counter,
    /// Failed writes of the daemon's state files (`records.json`, `status.json`).
    pub state_write_failures: Family<FileLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("modelfs");
        let m = Self {
            fuse_requests: Family::default(),
            fuse_errors: Family::default(),
            read_bytes: Counter::default(),
            passthrough_opens: Counter::default(),
            read_through_opens: Counter::default(),
            passthrough_fallbacks: Counter::default(),
            kernel_invalidations: Counter::default(),
            mapping_changes: Counter::default(),
            models: Family::default(),
            store_bytes: Family::default(),
            fetched_bytes: Family::default(),
            fetched_files: Family::default(),
            open_files: Gauge::default(),
            // 10 us .. ~5 s.
            mapping_update_seconds: Histogram::new(exponential_buckets(1e-5, 2.0, 20)),
            manifest_rescans: Counter::default(),
            manifest_parses: Counter::default(),
            state_write_failures: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "fuse_requests",
            "FUSE requests handled, by operation",
            m.fuse_requests.clone(),
        );
        registry.register(
            "fuse_errors",
            "FUSE requests answered with an error, by operation",
            m.fuse_errors.clone(),
        );
        registry.register(
            "read_bytes",
            "Bytes served by read-through reads (passthrough reads bypass the daemon)",
            m.read_bytes.clone(),
        );
        registry.register(
            "passthrough_opens",
            "Opens served with kernel passthrough",
            m.passthrough_opens.clone(),
        );
        registry.register(
            "read_through_opens",
            "Opens served by the daemon's read handler",
            m.read_through_opens.clone(),
        );
        registry.register(
            "passthrough_fallbacks",
            "Opens that asked for passthrough and fell back to read-through",
            m.passthrough_fallbacks.clone(),
        );
        registry.register(
            "kernel_invalidations",
            "Kernel entry/inode invalidations sent after mapping changes",
            m.kernel_invalidations.clone(),
        );
        registry.register(
            "mapping_changes",
            "Atomic swaps of the mount's mapping",
            m.mapping_changes.clone(),
        );
        registry.register("models", "Models by status", m.models.clone());
        registry.register(
            "store_bytes",
            "Bytes on disk per store",
            m.store_bytes.clone(),
        );
        registry.register(
            "fetched_bytes",
            "Bytes written into stores by imports and downloads, by source",
            m.fetched_bytes.clone(),
        );
        registry.register(
            "fetched_files",
            "Blobs written into stores by imports and downloads, by source",
            m.fetched_files.clone(),
        );
        registry.register(
            "open_files",
            "Files open through the mount",
            m.open_files.clone(),
        );
        registry.register(
            "mapping_update_seconds",
            "Desired-state change received to new mapping live (changes needing no fetch)",
            m.mapping_update_seconds.clone(),
        );
        registry.register(
            "manifest_rescans",
            "Standalone mode: rescans of the models directory",
            m.manifest_rescans.clone(),
        );
        registry.register(
            "manifest_parses",
            "Standalone mode: manifest files read and parsed (new or changed files only)",
            m.manifest_parses.clone(),
        );
        registry.register(
            "state_write_failures",
            "Failed writes of the daemon's state files (retried with backoff)",
            m.state_write_failures.clone(),
        );
        Self { registry, ..m }
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }

    pub fn request(&self, op: &'static str) {
        self.fuse_requests.get_or_create(&OpLabel { op }).inc();
    }

    pub fn error(&self, op: &'static str) {
        self.fuse_errors.get_or_create(&OpLabel { op }).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_exported() {
        let m = Metrics::new();
        m.request("lookup");
        m.error("lookup");
        m.mapping_update_seconds.observe(0.001);
        m.fetched_bytes
            .get_or_create(&SourceLabel {
                scheme: SourceScheme::Local,
            })
            .inc_by(5);
        let text = m.encode();
        for name in [
            "modelfs_fuse_requests_total{op=\"lookup\"} 1",
            "modelfs_fuse_errors_total{op=\"lookup\"} 1",
            "modelfs_read_bytes_total 0",
            "modelfs_passthrough_opens_total 0",
            "modelfs_read_through_opens_total 0",
            "modelfs_passthrough_fallbacks_total 0",
            "modelfs_kernel_invalidations_total 0",
            "modelfs_mapping_changes_total 0",
            "modelfs_fetched_bytes_total{scheme=\"Local\"} 5",
            "modelfs_open_files 0",
            "modelfs_mapping_update_seconds_count 1",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
    }
}
