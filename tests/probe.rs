//! `modelfs probe`, the mount server's liveness probe (issue 20): it passes against a live
//! mount and fails, without hanging, against an unmounted directory, an aborted FUSE
//! connection and a daemon that does not answer.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{cluster_model, make_model_dir, Daemon, TestEnv, BIN};

fn probe(mount: &Path, timeout_secs: u64) -> (Output, Duration) {
    let started = Instant::now();
    let out = Command::new(BIN)
        .arg("probe")
        .arg("--mount")
        .arg(mount)
        .arg("--timeout-secs")
        .arg(timeout_secs.to_string())
        .output()
        .unwrap();
    (out, started.elapsed())
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn serving(env: &TestEnv) -> Daemon {
    let src = env.dir("src");
    make_model_dir(&src, 51, 4096);
    env.write_models(
        "m.yaml",
        &cluster_model(
            "m",
            &format!("local://{}", src.display()),
            "AlwaysDownload",
            Some("m"),
        ),
    );
    let d = Daemon::start(env, &[]);
    d.wait_model("clusterbasemodel.m", "Ready");
    d
}

fn signal(pid: u32, signal: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(pid as i32).unwrap();
    rustix::process::kill_process(pid, signal).unwrap();
}

#[test]
fn a_live_mount_passes_and_an_unmounted_one_fails() {
    let env = TestEnv::new();
    let d = serving(&env);
    let (out, _) = probe(&env.mount, 5);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("looked at m"),
        "{out:?}"
    );
    // Unmounted for good (SIGINT; SIGTERM would hand the connection on).
    signal(d.pid(), rustix::process::Signal::INT);
    assert!(d.stop(), "clean shutdown");
    let (out, _) = probe(&env.mount, 5);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("not a mount point"),
        "{}",
        stderr(&out)
    );
    // Another filesystem there is not the modelfs mount either.
    let (out, _) = probe(Path::new("/proc"), 5);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("not a modelfs FUSE mount"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn an_aborted_connection_fails() {
    let env = TestEnv::new();
    let d = serving(&env);
    let connections = Path::new("/sys/fs/fuse/connections");
    if std::fs::read_dir(connections).unwrap().next().is_none() {
        let status = Command::new("mount")
            .args(["-t", "fusectl", "fusectl"])
            .arg(connections)
            .status()
            .unwrap();
        assert!(status.success(), "mounting fusectl");
    }
    let minor = libc::minor(std::fs::metadata(&env.mount).unwrap().dev());
    // Stopped first, so that it cannot remount before the probe looks (it heals itself).
    signal(d.pid(), rustix::process::Signal::STOP);
    std::fs::write(connections.join(minor.to_string()).join("abort"), "1").unwrap();
    let (out, elapsed) = probe(&env.mount, 5);
    signal(d.pid(), rustix::process::Signal::CONT);
    assert!(!out.status.success(), "an aborted mount passed");
    assert!(
        stderr(&out).contains("Transport endpoint is not connected"),
        "{}",
        stderr(&out)
    );
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
    drop(d);
}

#[test]
fn a_daemon_that_does_not_answer_fails_after_the_timeout() {
    let env = TestEnv::new();
    let d = serving(&env);
    // Every process of the daemon stopped: requests reach the kernel and wait there.
    signal(d.pid(), rustix::process::Signal::STOP);
    let (out, elapsed) = probe(&env.mount, 2);
    signal(d.pid(), rustix::process::Signal::CONT);
    assert!(!out.status.success(), "a hung mount passed");
    assert!(
        stderr(&out).contains("no answer within"),
        "{}",
        stderr(&out)
    );
    assert!(
        elapsed >= Duration::from_secs(2) && elapsed < Duration::from_secs(10),
        "{elapsed:?}"
    );
    // Answering again, it passes again.
    let (out, _) = probe(&env.mount, 5);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(d.stop(), "clean shutdown");
}
