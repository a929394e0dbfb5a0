//! What the FUSE transport does on a machine where io_uring cannot run although the kernel
//! offers FUSE over io_uring: `auto` serves over `/dev/fuse` and says why, `uring` refuses to
//! mount and says why. A test binary of its own: it switches io_uring off for the whole machine
//! (`kernel.io_uring_disabled`, as hardened nodes and some container runtimes do) while it
//! runs, which no other test may see (test binaries run one after another).

mod common;

use common::*;
use sha2::{Digest, Sha256};

const IO_URING_DISABLED: &str = "/proc/sys/kernel/io_uring_disabled";

/// `kernel.io_uring_disabled = 2` (no process may create a ring) until dropped.
struct IoUringDisabled(String);

impl IoUringDisabled {
    fn new() -> Self {
        let before = std::fs::read_to_string(IO_URING_DISABLED)
            .unwrap_or_else(|e| panic!("{IO_URING_DISABLED}: {e} (needs Linux >= 6.6)"));
        std::fs::write(IO_URING_DISABLED, "2").unwrap();
        IoUringDisabled(before.trim().to_string())
    }
}

impl Drop for IoUringDisabled {
    fn drop(&mut self) {
        let _ = std::fs::write(IO_URING_DISABLED, &self.0);
    }
}

#[test]
fn without_io_uring_auto_serves_over_dev_fuse_and_uring_refuses_to_mount() {
    let _offered = UringParam::acquire();
    let _disabled = IoUringDisabled::new();
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 9, 1000);
    env.write_models(
        "m.yaml",
        &cluster_model(
            "m",
            &format!("local://{}", src.display()),
            "AlwaysDownload",
            Some("m"),
        ),
    );

    let out = env
        .serve_command(ANY_PORT)
        .args(["--fuse-transport", "uring"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "uring without io_uring must not mount"
    );
    assert!(
        stderr.contains("--fuse-transport uring, but io_uring cannot be set up here"),
        "{stderr}"
    );
    assert!(
        !sh("cat /proc/self/mountinfo").contains(env.mount.to_str().unwrap()),
        "nothing mounted"
    );

    let d = Daemon::start(&env, &["--fuse-transport", "auto", "--no-keeper"]);
    d.wait_model("clusterbasemodel.m", "Ready");
    for (rel, sha) in files_of(&src) {
        let data = std::fs::read(env.mount.join("m").join(&rel)).unwrap();
        assert_eq!(hex::encode(Sha256::digest(&data)), sha, "{rel}");
    }
    Transport::Dev.assert_served(&d);
    assert!(
        d.log_text()
            .contains("io_uring cannot be set up; serving FUSE over /dev/fuse"),
        "{}",
        d.log_text()
    );
}
