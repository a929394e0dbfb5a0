//! The operator's HTTP endpoint: health probes, Prometheus metrics and the status document.
//!
//! * `/healthz`: the daemon can do its job on this node: the state directory takes a write
//!   (a probe file is created and removed: a disk remounted read-only or full of inodes
//!   fails it, whatever the permission bits say to root) and the mount is still in place (the
//!   mount point's device is the one the FUSE mount had when it was made; an unmounted or
//!   aborted mount fails). OME's agent answers its health check the same way for its models
//!   root. Each check runs off the async threads with a deadline, so a hung disk fails the
//!   probe instead of hanging it.
//! * `/livez`: the reconciler's actor loop is turning (it ticks every second; a loop stuck for
//!   30 s is a deadlock worth a restart).
//! * `/readyz`: the mount is up and the first desired state has been reconciled.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};

use crate::metrics::Metrics;
use crate::reconciler::ReconcilerHandle;

/// Longest pause of the reconciler loop that still counts as alive.
const LIVENESS_LIMIT_SECS: u64 = 30;

/// Longest a `/healthz` check may take before it counts as failed.
const HEALTH_CHECK_DEADLINE: Duration = Duration::from_secs(5);

#[derive(Clone)]
pub struct HttpState {
    pub metrics: Arc<Metrics>,
    pub reconciler: ReconcilerHandle,
    pub mounted: Arc<AtomicBool>,
    pub health: Arc<HealthChecks>,
}

/// What `/healthz` checks (module docs).
#[derive(Clone, Debug)]
pub struct HealthChecks {
    pub state_dir: PathBuf,
    pub mount_dir: PathBuf,
    /// Device number of the mount's root right after mounting (updated when a restarted
    /// mount server reports its new mount).
    pub mount_dev: Arc<std::sync::atomic::AtomicU64>,
}

impl HealthChecks {
    /// Records the device of the freshly made mount at `mount_dir`.
    pub fn new(state_dir: PathBuf, mount_dir: PathBuf) -> std::io::Result<Self> {
        let mount_dev = std::fs::metadata(&mount_dir)?.dev();
        Ok(Self {
            state_dir,
            mount_dir,
            mount_dev: Arc::new(std::sync::atomic::AtomicU64::new(mount_dev)),
        })
    }

    /// `Err` with what is wrong, for an operator.
    fn check(&self) -> Result<(), String> {
        match std::fs::metadata(&self.mount_dir) {
            Err(error) => {
                return Err(format!("mount {}: {error}", self.mount_dir.display()));
            }
            Ok(meta) if meta.dev() != self.mount_dev.load(Ordering::Relaxed) => {
                return Err(format!(
                    "mount {} is gone (the directory is no longer the FUSE mount)",
                    self.mount_dir.display()
                ));
            }
            Ok(_) => {}
        }
        // A unique name per probe: concurrent probes must not remove each other's file.
        static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let probe = self.state_dir.join(format!(
            ".healthz-{}-{}",
            std::process::id(),
            PROBES.fetch_add(1, Ordering::Relaxed)
        ));
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&probe)
            .and_then(|mut file| {
                use std::io::Write;
                file.write_all(b"ok")
            });
        let removed = std::fs::remove_file(&probe);
        written.and(removed).map_err(|error| {
            format!(
                "state directory {} is not writable: {error}",
                self.state_dir.display()
            )
        })
    }
}

pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/disk", get(disk))
        .with_state(state)
}

async fn healthz(State(s): State<HttpState>) -> impl IntoResponse {
    if !s.mounted.load(Ordering::Relaxed) {
        return (StatusCode::SERVICE_UNAVAILABLE, "not mounted\n".to_owned());
    }
    let checks = s.health.clone();
    let outcome = tokio::time::timeout(
        HEALTH_CHECK_DEADLINE,
        tokio::task::spawn_blocking(move || checks.check()),
    )
    .await;
    match outcome {
        Ok(Ok(Ok(()))) => (StatusCode::OK, "ok\n".to_owned()),
        Ok(Ok(Err(problem))) => {
            tracing::warn!(problem, "health check failed");
            (StatusCode::SERVICE_UNAVAILABLE, format!("{problem}\n"))
        }
        Ok(Err(_)) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "health check panicked\n".to_owned(),
        ),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "health check did not finish in {}s (mount or state disk hung)\n",
                HEALTH_CHECK_DEADLINE.as_secs()
            ),
        ),
    }
}

async fn livez(State(s): State<HttpState>) -> impl IntoResponse {
    let idle = s.reconciler.seconds_since_heartbeat();
    if idle <= LIVENESS_LIMIT_SECS {
        (StatusCode::OK, "ok\n".to_string())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("reconciler loop idle for {idle}s\n"),
        )
    }
}

async fn readyz(State(s): State<HttpState>) -> impl IntoResponse {
    if !s.mounted.load(Ordering::Relaxed) {
        return (StatusCode::SERVICE_UNAVAILABLE, "not mounted\n");
    }
    if !s.reconciler.is_ready() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "initial reconcile pending\n",
        );
    }
    (StatusCode::OK, "ok\n")
}

async fn metrics(State(s): State<HttpState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
}

async fn models(State(s): State<HttpState>) -> impl IntoResponse {
    Json(s.reconciler.status().as_ref().clone())
}

/// The disk under the stores as last measured ([`crate::disk::DiskState`]).
async fn disk(State(s): State<HttpState>) -> impl IntoResponse {
    Json(s.reconciler.disk().as_ref().clone())
}

/// Serves until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: HttpState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}
