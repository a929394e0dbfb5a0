//! Prometheus metrics, one registry per daemon.
//!
//! Besides modelfs's own metrics (prefix `modelfs_`), the model-agent metrics of OME's agent
//! (`model_agent_*`, labels `model_type` = `BaseModel` | `ClusterBaseModel`, `namespace` (empty
//! for a ClusterBaseModel), `name`) are exported with the same meaning, so dashboards and
//! alerts built for OME keep working: a download is one fetch of a model's artifact (resolve
//! and fetch; a model served from another model's copy downloads nothing and counts nothing),
//! its bytes are the bytes written into the store, a verification is the digest check of a
//! completed fetch, and a checksum failure is a fetch that ended on bytes that never matched
//! their digest (OME checks MD5s; modelfs sha256 / git sha1, same meaning). The verification
//! duration times the final pass over a completed fetch (every blob present with its size; the
//! digests were checked as the bytes were written). A rate limit is a download that failed on
//! HTTP 429; the rate-limit wait histogram observes each back-off after a 429 as actually waited
//! (OME observes a fixed 30 s estimate per rate-limited download). OME's Go runtime gauges
//! (`go_*`) have no equivalent.
//!
//! The FUSE counters (`modelfs_fuse_requests_total`, `modelfs_open_files`, ...) are counted by
//! the mount server and defined there ([`modelfs_mount::metrics::FuseMetrics`]); the agent adds
//! the snapshots the mount server reports ([`Metrics::fuse`]) and exports them with the rest.

use modelfs_mount::metrics::FuseMetrics;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

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
    S3,
    Gs,
    Az,
    Oci,
}

/// Labels of OME's model-agent metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OmeModelLabels {
    pub model_type: String,
    pub namespace: String,
    pub name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OmeVerificationLabels {
    pub model_type: String,
    pub namespace: String,
    pub name: String,
    /// `success` or `failure`.
    pub result: &'static str,
}

/// How a download attempt of a model ended, for OME's metrics.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DownloadOutcome {
    Succeeded {
        seconds: f64,
        bytes: u64,
    },
    /// The bytes never matched their digest.
    VerificationFailed,
    /// The hub answered 429 until the fetch gave up.
    RateLimited,
    Failed,
}

fn ome_duration_histogram() -> Histogram {
    // As OME: 0.1 s doubling, 10 buckets.
    Histogram::new(exponential_buckets(0.1, 2.0, 10))
}

/// OME's `model_agent_*` metrics (module docs).
pub struct OmeMetrics {
    registry: Registry,
    pub downloads_success: Family<OmeModelLabels, Counter>,
    pub downloads_failed: Family<OmeModelLabels, Counter>,
    pub verifications: Family<OmeVerificationLabels, Counter>,
    pub checksum_failed: Family<OmeModelLabels, Counter>,
    pub rate_limit: Family<OmeModelLabels, Counter>,
    pub download_duration: Family<OmeModelLabels, Histogram, fn() -> Histogram>,
    pub download_bytes: Family<OmeModelLabels, Counter>,
    /// The final verification pass of each completed fetch (no labels, as OME).
    pub verification_duration: Histogram,
    /// Each wait spent backing off after HTTP 429 (OME observes a fixed 30 s estimate per
    /// rate-limited download; modelfs observes the waits it actually took).
    pub rate_limit_wait: Family<OmeModelLabels, Histogram, fn() -> Histogram>,
}

fn ome_rate_limit_wait_histogram() -> Histogram {
    // As OME: 1 s doubling, 10 buckets.
    Histogram::new(exponential_buckets(1.0, 2.0, 10))
}

impl OmeMetrics {
    fn new() -> Self {
        let mut registry = Registry::default();
        let m = Self {
            downloads_success: Family::default(),
            downloads_failed: Family::default(),
            verifications: Family::default(),
            checksum_failed: Family::default(),
            rate_limit: Family::default(),
            download_duration: Family::new_with_constructor(ome_duration_histogram),
            download_bytes: Family::default(),
            verification_duration: ome_duration_histogram(),
            rate_limit_wait: Family::new_with_constructor(ome_rate_limit_wait_histogram),
            registry: Registry::default(),
        };
        registry.register(
            "model_agent_downloads_success",
            "The total number of successful model downloads",
            m.downloads_success.clone(),
        );
        registry.register(
            "model_agent_downloads_failed",
            "The total number of failed model downloads",
            m.downloads_failed.clone(),
        );
        registry.register(
            "model_agent_verifications",
            "The total number of model verification attempts",
            m.verifications.clone(),
        );
        registry.register(
            "model_agent_md5_checksum_failed",
            "The total number of checksum failures (sha256 / git sha1 in modelfs)",
            m.checksum_failed.clone(),
        );
        registry.register(
            "model_agent_rate_limit",
            "The total number of rate limit (429) responses encountered",
            m.rate_limit.clone(),
        );
        registry.register(
            "model_agent_download_duration_seconds",
            "The duration of model downloads in seconds",
            m.download_duration.clone(),
        );
        registry.register(
            "model_agent_download_bytes",
            "The total bytes transferred while downloading models",
            m.download_bytes.clone(),
        );
        registry.register(
            "model_agent_verification_duration_seconds",
            "The duration of model verifications in seconds",
            m.verification_duration.clone(),
        );
        registry.register(
            "model_agent_rate_limit_wait_seconds",
            "The duration waited due to rate limits in seconds",
            m.rate_limit_wait.clone(),
        );
        Self { registry, ..m }
    }

    /// Records how one download of a model ended.
    pub fn record(&self, model: OmeModelLabels, outcome: DownloadOutcome) {
        let verification = |result| OmeVerificationLabels {
            model_type: model.model_type.clone(),
            namespace: model.namespace.clone(),
            name: model.name.clone(),
            result,
        };
        match outcome {
            DownloadOutcome::Succeeded { seconds, bytes } => {
                self.downloads_success.get_or_create(&model).inc();
                self.download_duration
                    .get_or_create(&model)
                    .observe(seconds);
                self.download_bytes.get_or_create(&model).inc_by(bytes);
                self.verifications
                    .get_or_create(&verification("success"))
                    .inc();
            }
            DownloadOutcome::VerificationFailed => {
                self.downloads_failed.get_or_create(&model).inc();
                self.checksum_failed.get_or_create(&model).inc();
                self.verifications
                    .get_or_create(&verification("failure"))
                    .inc();
            }
            DownloadOutcome::RateLimited => {
                self.downloads_failed.get_or_create(&model).inc();
                self.rate_limit.get_or_create(&model).inc();
            }
            DownloadOutcome::Failed => {
                self.downloads_failed.get_or_create(&model).inc();
            }
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FileLabel {
    pub file: String,
}

pub struct Metrics {
    registry: Registry,
    /// OME's model-agent metrics, exported beside these.
    pub ome: OmeMetrics,
    /// The mount server's FUSE counters, as it last reported them.
    pub fuse: FuseMetrics,
    pub mapping_changes: Counter,
    pub models: Family<StatusLabel, Gauge>,
    pub store_bytes: Family<StoreLabel, Gauge>,
    pub fetched_bytes: Family<SourceLabel, Counter>,
    pub fetched_files: Family<SourceLabel, Counter>,
    /// `local://` files that entered a store as hard links (immutable sources), not copies.
    pub local_linked_files: Counter,
    /// From a desired-state change reaching the reconciler to the new mapping being live, for
    /// changes that need no fetch (policy flips, deletions, re-points).
    pub mapping_update_seconds: Histogram,
    /// One run of the reconciler's whole-state passes (path rule, mapping, records, status):
    /// proportional to the number of models, and what paces them.
    pub state_pass_seconds: Histogram,
    /// Standalone mode: rescans of the models directory, and manifest files read and parsed
    /// (only new or changed files are).
    pub manifest_rescans: Counter,
    pub manifest_parses: Counter,
    /// Garbage-collection passes completed, and the garbage found waiting out its grace period
    /// at the end of the last one: together they say when collection has settled.
    pub gc_passes: Counter,
    pub gc_pending: Gauge,
    /// The disk under the stores (see [`crate::disk`]): bytes free under the budget, used by
    /// the stores, kept by the reserve label with nothing served, the budget itself, and
    /// still lacking for fetches refused for space.
    pub disk: DiskMetrics,
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
            fuse: FuseMetrics::new(),
            mapping_changes: Counter::default(),
            models: Family::default(),
            store_bytes: Family::default(),
            fetched_bytes: Family::default(),
            fetched_files: Family::default(),
            local_linked_files: Counter::default(),
            // 10 us .. ~5 s.
            mapping_update_seconds: Histogram::new(exponential_buckets(1e-5, 2.0, 20)),
            state_pass_seconds: Histogram::new(exponential_buckets(1e-5, 2.0, 20)),
            manifest_rescans: Counter::default(),
            gc_passes: Counter::default(),
            gc_pending: Gauge::default(),
            disk: DiskMetrics::default(),
            manifest_parses: Counter::default(),
            state_write_failures: Family::default(),
            registry: Registry::default(),
            ome: OmeMetrics::new(),
        };
        m.fuse.register(&mut registry);
        registry.register(
            "mapping_changes",
            "Atomic swaps of the mount's mapping",
            m.mapping_changes.clone(),
        );
        registry.register("models", "Models by status", m.models.clone());
        m.disk.register(&mut registry);
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
            "local_linked_files",
            "local:// files hard-linked into stores instead of copied (read-only, root-owned sources)",
            m.local_linked_files.clone(),
        );
        registry.register(
            "mapping_update_seconds",
            "Desired-state change received to new mapping live (changes needing no fetch)",
            m.mapping_update_seconds.clone(),
        );
        registry.register(
            "state_pass_seconds",
            "One run of the reconciler's passes over all models (path rule, mapping, records, status)",
            m.state_pass_seconds.clone(),
        );
        registry.register(
            "manifest_rescans",
            "Standalone mode: rescans of the models directory",
            m.manifest_rescans.clone(),
        );
        registry.register(
            "gc_passes",
            "Garbage-collection passes completed",
            m.gc_passes.clone(),
        );
        registry.register(
            "gc_pending",
            "Garbage waiting out its grace period after the last collection pass",
            m.gc_pending.clone(),
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
        use prometheus_client::encoding::text::{encode_eof, encode_registry};
        let mut out = String::new();
        encode_registry(&mut out, &self.registry)
            .and_then(|()| encode_registry(&mut out, &self.ome.registry))
            .and_then(|()| encode_eof(&mut out))
            .expect("writing to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_exported() {
        let m = Metrics::new();
        m.fuse.request("lookup");
        m.fuse.error("lookup");
        m.mapping_update_seconds.observe(0.001);
        m.fetched_bytes
            .get_or_create(&SourceLabel {
                scheme: SourceScheme::Local,
            })
            .inc_by(5);
        let model = |name: &str| OmeModelLabels {
            model_type: "BaseModel".into(),
            namespace: "team".into(),
            name: name.into(),
        };
        m.ome.record(
            model("ok"),
            DownloadOutcome::Succeeded {
                seconds: 0.5,
                bytes: 7,
            },
        );
        m.ome
            .record(model("bad"), DownloadOutcome::VerificationFailed);
        m.ome.record(model("slow"), DownloadOutcome::RateLimited);
        let text = m.encode();
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        assert!(text.ends_with("# EOF\n"));
        for name in [
            "model_agent_downloads_success_total{model_type=\"BaseModel\",namespace=\"team\",name=\"ok\"} 1",
            "model_agent_download_bytes_total{model_type=\"BaseModel\",namespace=\"team\",name=\"ok\"} 7",
            "model_agent_download_duration_seconds_bucket{le=\"0.8\",model_type=\"BaseModel\",namespace=\"team\",name=\"ok\"} 1",
            "model_agent_verifications_total{model_type=\"BaseModel\",namespace=\"team\",name=\"ok\",result=\"success\"} 1",
            "model_agent_verifications_total{model_type=\"BaseModel\",namespace=\"team\",name=\"bad\",result=\"failure\"} 1",
            "model_agent_md5_checksum_failed_total{model_type=\"BaseModel\",namespace=\"team\",name=\"bad\"} 1",
            "model_agent_downloads_failed_total{model_type=\"BaseModel\",namespace=\"team\",name=\"bad\"} 1",
            "model_agent_rate_limit_total{model_type=\"BaseModel\",namespace=\"team\",name=\"slow\"} 1",
            "modelfs_fuse_requests_total{op=\"lookup\"} 1",
            "modelfs_fuse_errors_total{op=\"lookup\"} 1",
            "modelfs_read_bytes_total 0",
            "modelfs_passthrough_opens_total 0",
            "modelfs_read_through_opens_total 0",
            "modelfs_passthrough_fallbacks_total 0",
            "modelfs_passthrough_backing_reuses_total 0",
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

/// Gauges of the disk under the stores, set at every measurement.
#[derive(Default)]
pub struct DiskMetrics {
    pub free_bytes: Gauge,
    pub used_bytes: Gauge,
    pub reserved_bytes: Gauge,
    pub budget_bytes: Gauge,
    pub filesystem_available_bytes: Gauge,
    pub shortfall_bytes: Gauge,
    /// Stores removed before their grace period ended (or reserved ones) to make room.
    pub reclaimed_stores: Counter,
    /// Fetches refused for space, and fetches that hit a full disk anyway.
    pub refused_fetches: Counter,
    pub disk_full_fetches: Counter,
    /// Ticks that checked the models refused for space against the disk again.
    pub space_checks: Counter,
}

impl DiskMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "disk_free_bytes",
            "Bytes the stores may still write under --disk-budget",
            self.free_bytes.clone(),
        );
        registry.register(
            "disk_used_bytes",
            "Bytes on disk of all stores",
            self.used_bytes.clone(),
        );
        registry.register(
            "disk_reserved_bytes",
            "Bytes of stores kept by the reserve label that serve no model",
            self.reserved_bytes.clone(),
        );
        registry.register(
            "disk_budget_bytes",
            "--disk-budget in bytes",
            self.budget_bytes.clone(),
        );
        registry.register(
            "disk_filesystem_available_bytes",
            "Bytes available on the filesystem of the state directory (statvfs f_bavail)",
            self.filesystem_available_bytes.clone(),
        );
        registry.register(
            "disk_shortfall_bytes",
            "Bytes the largest fetch refused for space lacks (0: none waits)",
            self.shortfall_bytes.clone(),
        );
        registry.register(
            "disk_reclaimed_stores",
            "Stores removed under disk pressure before their grace period ended, or reserved",
            self.reclaimed_stores.clone(),
        );
        registry.register(
            "disk_refused_fetches",
            "Fetches not started because they did not fit under the disk budget",
            self.refused_fetches.clone(),
        );
        registry.register(
            "disk_full_fetches",
            "Fetches that failed on a full disk (no space left on device)",
            self.disk_full_fetches.clone(),
        );
        registry.register(
            "disk_space_checks",
            "Ticks that checked the models refused for space against the disk again",
            self.space_checks.clone(),
        );
    }
}
