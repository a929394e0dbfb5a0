//! Tests of the actor around the decision core (the core's own tables are in `decide`).

use super::*;
use crate::source::SourceConfig;
use std::time::Duration;

fn start(state: &std::path::Path) -> ReconcilerHandle {
    Reconciler::start(
        ReconcilerConfig {
            tick: Duration::from_millis(10),
            ..ReconcilerConfig::new(
                SourceConfig::new(crate::source::hf::HfConfig::default()).expect("HTTP clients"),
            )
        },
        StateDir::open(state).unwrap(),
        Arc::new(FsCore::new()),
        None,
        Arc::new(Metrics::new()),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_actor_is_reported_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let handle = start(dir.path());
    handle.set_desired(DesiredState::default());
    handle.inject_panic("decision invariant broken");
    let reason = tokio::time::timeout(Duration::from_secs(30), handle.died())
        .await
        .expect("the death is reported");
    assert!(reason.contains("decision invariant broken"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_actor_is_not_reported_dead_and_shuts_down_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let handle = start(dir.path());
    handle.set_desired(DesiredState::default());
    // Events are handled in order: the desired state before the shutdown.
    handle.shutdown().await;
    assert!(handle.is_ready());
    // After a clean shutdown the actor is gone without dying.
    assert!(handle.died.borrow().is_none());
    assert!(dir.path().join("status.json").exists());
}

/// `is_ready` (what the Kubernetes status sink waits for before its first write) never comes
/// before the status of the first desired state is published: whoever sees it true finds that
/// state in the status, never the document the records alone made at start (where a model
/// served while it downloads said `Updating` and its node label flapped across a restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_comes_only_with_the_status_of_the_first_desired_state() {
    let dir = tempfile::tempdir().unwrap();
    let handle = start(dir.path());
    assert!(handle.status().is_empty(), "nothing in the records");
    let mut desired = DesiredState::default();
    desired
        .errors
        .insert("broken.yaml".into(), "not a model".into());
    handle.set_desired(desired);
    // Watched as closely as possible: the actor publishes on another thread.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !handle.is_ready() {
        assert!(Instant::now() < deadline, "never ready");
        std::hint::spin_loop();
    }
    let doc = handle.status();
    assert!(
        !doc.is_empty(),
        "ready before the first desired state's status was published"
    );
    handle.shutdown().await;
}

#[test]
fn runtime_shutdown_stops_the_actor_without_waiting() {
    // As a SIGKILL in the crash tests: the runtime goes away under a running actor whose
    // handle is still held; the shutdown must not wait for the actor's thread.
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let handle = {
        let _guard = runtime.enter();
        start(dir.path())
    };
    handle.set_desired(DesiredState::default());
    let started = Instant::now();
    runtime.shutdown_timeout(Duration::from_secs(60));
    assert!(
        started.elapsed() < Duration::from_secs(50),
        "the actor kept the runtime from shutting down"
    );
    drop(handle);
}
