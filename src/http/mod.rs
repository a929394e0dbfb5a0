//! The operator's HTTP endpoint: health probes, Prometheus metrics and the status document.
//!
//! * `/healthz`: the process answers.
//! * `/livez`: the reconciler's actor loop is turning (it ticks every second; a loop stuck for
//!   30 s is a deadlock worth a restart).
//! * `/readyz`: the mount is up and the first desired state has been reconciled.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};

use crate::metrics::Metrics;
use crate::reconciler::ReconcilerHandle;

/// Longest pause of the reconciler loop that still counts as alive.
const LIVENESS_LIMIT_SECS: u64 = 30;

#[derive(Clone)]
pub struct HttpState {
    pub metrics: Arc<Metrics>,
    pub reconciler: ReconcilerHandle,
    pub mounted: Arc<AtomicBool>,
}

pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .with_state(state)
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
