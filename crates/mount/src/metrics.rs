//! The FUSE adapter's counters. The mount server counts them and reports them to the agent as a
//! snapshot ([`FuseMetrics::snapshot`], [`crate::protocol`]); the agent adds what moved to its
//! own copy ([`FuseMetrics::add_snapshot`]) and exports it on `/metrics` beside its other
//! metrics ([`FuseMetrics::register`]). The list of counters lives here, next to the adapter
//! that counts, so the two processes cannot disagree on it.
//!
//! Bytes read are counted only for read-through opens: with passthrough the kernel reads the blob
//! directly and the daemon never sees the bytes (that is the point), so `passthrough_opens` is the
//! signal for that path.

use std::collections::BTreeMap;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The operations the FUSE adapter counts. `journal` is no request: its errors are failed
/// records of open files for a successor (`fuse::journal`).
pub const FUSE_OPS: &[&str] = &[
    "create",
    "fallocate",
    "flush",
    "getattr",
    "getxattr",
    "journal",
    "link",
    "listxattr",
    "lookup",
    "mkdir",
    "mknod",
    "open",
    "opendir",
    "read",
    "readdir",
    "readdirplus",
    "release",
    "releasedir",
    "removexattr",
    "rename",
    "rmdir",
    "setattr",
    "setxattr",
    "statfs",
    "symlink",
    "unlink",
    "write",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabel {
    pub op: &'static str,
}

/// The FUSE adapter's counters (module docs).
#[derive(Default)]
pub struct FuseMetrics {
    pub fuse_requests: Family<OpLabel, Counter>,
    pub fuse_errors: Family<OpLabel, Counter>,
    pub read_bytes: Counter,
    pub passthrough_opens: Counter,
    pub read_through_opens: Counter,
    pub passthrough_fallbacks: Counter,
    /// Passthrough opens that reused the inode's registered backing id (no registration ioctl).
    pub backing_reuses: Counter,
    pub kernel_invalidations: Counter,
    /// Requests that arrived over FUSE's io_uring transport (each also counts by operation).
    pub uring_requests: Counter,
    pub open_files: Gauge,
}

impl FuseMetrics {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers the counters in `registry` (the agent's, whose prefix is `modelfs`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "fuse_requests",
            "FUSE requests handled, by operation",
            self.fuse_requests.clone(),
        );
        registry.register(
            "fuse_errors",
            "FUSE requests answered with an error, by operation",
            self.fuse_errors.clone(),
        );
        registry.register(
            "read_bytes",
            "Bytes served by read-through reads (passthrough reads bypass the daemon)",
            self.read_bytes.clone(),
        );
        registry.register(
            "passthrough_opens",
            "Opens served with kernel passthrough",
            self.passthrough_opens.clone(),
        );
        registry.register(
            "read_through_opens",
            "Opens served by the daemon's read handler",
            self.read_through_opens.clone(),
        );
        registry.register(
            "passthrough_fallbacks",
            "Opens that asked for passthrough and fell back to read-through",
            self.passthrough_fallbacks.clone(),
        );
        registry.register(
            "passthrough_backing_reuses",
            "Passthrough opens that reused the inode's registered backing file",
            self.backing_reuses.clone(),
        );
        registry.register(
            "kernel_invalidations",
            "Kernel entry/inode invalidations sent after mapping changes",
            self.kernel_invalidations.clone(),
        );
        registry.register(
            "fuse_uring_requests",
            "FUSE requests that arrived over io_uring (per-CPU queues) instead of /dev/fuse",
            self.uring_requests.clone(),
        );
        registry.register(
            "open_files",
            "Files open through the mount",
            self.open_files.clone(),
        );
    }

    /// The counters by name (`fuse_requests/<op>`, `fuse_errors/<op>`, ...), zeros left out:
    /// the mount server reports them, the agent exports them ([`FuseMetrics::add_snapshot`]).
    pub fn snapshot(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for op in FUSE_OPS {
            let label = OpLabel { op };
            out.insert(
                format!("fuse_requests/{op}"),
                self.fuse_requests.get_or_create(&label).get(),
            );
            out.insert(
                format!("fuse_errors/{op}"),
                self.fuse_errors.get_or_create(&label).get(),
            );
        }
        out.insert("read_bytes".into(), self.read_bytes.get());
        out.insert("passthrough_opens".into(), self.passthrough_opens.get());
        out.insert("read_through_opens".into(), self.read_through_opens.get());
        out.insert(
            "passthrough_fallbacks".into(),
            self.passthrough_fallbacks.get(),
        );
        out.insert("backing_reuses".into(), self.backing_reuses.get());
        out.insert(
            "kernel_invalidations".into(),
            self.kernel_invalidations.get(),
        );
        out.insert("uring_requests".into(), self.uring_requests.get());
        out.insert("open_files".into(), self.open_files.get().max(0) as u64);
        out.retain(|_, v| *v > 0);
        out
    }

    /// Adds what a mount server's counters moved from `previous` to `now` (`previous` empty for
    /// a new server); the open files gauge takes the new value.
    pub fn add_snapshot(&self, previous: &BTreeMap<String, u64>, now: &BTreeMap<String, u64>) {
        for (name, value) in now {
            let delta = value.saturating_sub(previous.get(name).copied().unwrap_or(0));
            let (family, op) = match name.split_once('/') {
                Some((family, op)) => (family, FUSE_OPS.iter().find(|o| **o == op)),
                None => (name.as_str(), None),
            };
            match (family, op) {
                ("fuse_requests", Some(op)) => {
                    self.fuse_requests
                        .get_or_create(&OpLabel { op })
                        .inc_by(delta);
                }
                ("fuse_errors", Some(op)) => {
                    self.fuse_errors
                        .get_or_create(&OpLabel { op })
                        .inc_by(delta);
                }
                ("read_bytes", None) => {
                    self.read_bytes.inc_by(delta);
                }
                ("passthrough_opens", None) => {
                    self.passthrough_opens.inc_by(delta);
                }
                ("read_through_opens", None) => {
                    self.read_through_opens.inc_by(delta);
                }
                ("passthrough_fallbacks", None) => {
                    self.passthrough_fallbacks.inc_by(delta);
                }
                ("backing_reuses", None) => {
                    self.backing_reuses.inc_by(delta);
                }
                ("kernel_invalidations", None) => {
                    self.kernel_invalidations.inc_by(delta);
                }
                ("uring_requests", None) => {
                    self.uring_requests.inc_by(delta);
                }
                _ => {}
            }
        }
        self.open_files
            .set(now.get("open_files").copied().unwrap_or(0) as i64);
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
    fn a_snapshot_moves_the_other_side_by_the_difference() {
        let server = FuseMetrics::new();
        server.request("lookup");
        server.request("lookup");
        server.error("open");
        server.read_bytes.inc_by(10);
        server.uring_requests.inc_by(3);
        server.open_files.inc();
        let first = server.snapshot();
        assert!(
            !first.contains_key("fuse_requests/read"),
            "zeros are left out"
        );

        let agent = FuseMetrics::new();
        agent.add_snapshot(&BTreeMap::new(), &first);
        server.request("lookup");
        server.open_files.dec();
        let second = server.snapshot();
        agent.add_snapshot(&first, &second);
        assert_eq!(agent.snapshot(), second);
        assert_eq!(
            agent
                .fuse_requests
                .get_or_create(&OpLabel { op: "lookup" })
                .get(),
            3
        );
        assert_eq!(agent.open_files.get(), 0);
    }
}
