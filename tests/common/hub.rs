//! The loopback Hugging Face hub in the test process, and daemon flags to use it.
#![allow(dead_code)]

use std::net::SocketAddr;

use modelfs_devhub::hf::{Fault, FaultKind, FaultTarget, Hub, HubConfig, RunningHub};

use super::{Daemon, TestEnv};

pub struct TestHub {
    pub running: RunningHub,
    _rt: tokio::runtime::Runtime,
}

impl TestHub {
    pub fn start(page_size: usize) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let hub = Hub::new(HubConfig {
            page_size,
            ..HubConfig::default()
        });
        let cdn: SocketAddr = "127.0.0.2:0".parse().unwrap();
        let running = rt
            .block_on(hub.serve("127.0.0.1:0".parse().unwrap(), Some(cdn)))
            .unwrap();
        Self { running, _rt: rt }
    }

    pub fn hub(&self) -> &Hub {
        &self.running.hub
    }

    pub fn fault(&self, kind: FaultKind, count: u64, path: Option<&str>) {
        self.hub().add_fault(Fault {
            kind,
            count,
            path: path.map(str::to_string),
            target: FaultTarget::File,
        });
    }
}

/// Daemon flags for tests: the hub, small chunks so that even test-sized files use parallel
/// ranges, quick retries and a short stall watchdog.
pub fn hf_flags(hub: &TestHub) -> Vec<String> {
    [
        "--hf-endpoint",
        &hub.running.url(),
        "--hf-chunk-mib",
        "1",
        "--hf-retry-base-ms",
        "20",
        "--hf-stall-timeout-secs",
        "1",
        "--hf-progress-log-secs",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

pub fn start_daemon(env: &TestEnv, hub: &TestHub) -> Daemon {
    let flags = hf_flags(hub);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    Daemon::start(env, &flags)
}
