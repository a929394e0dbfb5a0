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

    // The FUSE mount goes away under the daemon (a lazy unmount by someone else; nobody else
    // holds it, so its connection ends): the mount server notices and mounts afresh, after
    // which /healthz is fine and the model reads (`/healthz` says 503, "mount ... gone", in
    // between). tests/takeover.rs covers the same with a pod holding the connection.
    run("umount", &["-l", env.mount.to_str().unwrap()]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (code, body) = d.get("/healthz");
        assert!(
            code == 200 || (body.contains("mount") && body.contains("gone")),
            "{code} {body}"
        );
        let back = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .any(|l| l.split(' ').nth(4) == env.mount.to_str());
        if back && code == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the mount never came back; log:\n{}",
            d.log_text()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let served = d.status()["clusterbasemodel.m"]["path"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(contents(std::path::Path::new(&served)), contents(&src));
    let log = d.log_text();
    assert!(
        log.contains("the FUSE connection ended; mounting afresh")
            || log.contains("the mount was removed from outside"),
        "{log}"
    );
    // The other probes are not health checks of the node: the process still answers.
    assert_eq!(d.get("/livez").0, 200);
}
