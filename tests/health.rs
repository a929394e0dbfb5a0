//! `/healthz` fails when the daemon cannot do its job: the state directory does not take a
//! write (a read-only bind mount over it, as a disk remounted read-only after errors; root
//! ignores permission bits, so a chmod would prove nothing), or the FUSE mount is gone.

mod common;

use std::process::Command;

use common::*;

fn run(program: &str, args: &[&str]) {
    let status = Command::new(program).args(args).status().unwrap();
    assert!(status.success(), "{program} {args:?} failed");
}

#[test]
fn healthz_fails_on_an_unwritable_state_directory_and_a_lost_mount() {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 3, 1 << 16);
    env.write_models(
        "m.yaml",
        &cluster_model(
            "m",
            &format!("local://{}", src.display()),
            "AlwaysDownload",
            None,
        ),
    );
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.m", "Ready");
    assert_eq!(d.get("/healthz"), (200, "ok\n".to_owned()));

    let state = env.state.to_str().unwrap();
    run("mount", &["--bind", state, state]);
    // A remount to read-only is refused (EBUSY) while a file is open for writing on it: the
    // daemon may be writing its records or status at this moment. Retried until it takes.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !Command::new("mount")
        .args(["-o", "remount,bind,ro", state])
        .status()
        .unwrap()
        .success()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the state directory never remounted read-only"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (code, body) = d.get("/healthz");
    run("umount", &[state]);
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("state directory") && body.contains("not writable"),
        "{body}"
    );
    assert_eq!(d.get("/healthz").0, 200, "writable again");
    // The probe leaves nothing behind.
    assert!(!std::fs::read_dir(&env.state)
        .unwrap()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().starts_with(".healthz")));

    // The FUSE mount goes away under the daemon (a lazy unmount by someone else).
    run("umount", &["-l", env.mount.to_str().unwrap()]);
    let (code, body) = d.get("/healthz");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("mount") && body.contains("gone"), "{body}");
    // The other probes are not health checks of the node: the process still answers.
    assert_eq!(d.get("/livez").0, 200);
}
