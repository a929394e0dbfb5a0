//! The boot race (issue 20): after a reboot, a container that binds a model path before the
//! FUSE mount exists must fail to start, never see the files underneath the mount (an old
//! agent's copy) or an empty directory; once the mount serves, the next start reads the
//! served model. A "container start" is what a runtime does for a `hostPath` volume without
//! mount propagation: a private mount namespace and a bind of the model path onto a directory
//! of the container.

mod common;

use std::path::Path;
use std::process::Command;

use common::{cluster_model, files_of, make_model_dir, Daemon, TestEnv};

/// Binds `model` onto a fresh directory in a private mount namespace and prints the sha256 of
/// `file` below it: Ok(sha256) or Err(what the start printed).
fn container_start(model: &Path, file: &str) -> Result<String, String> {
    let target = tempfile::tempdir().unwrap();
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount --bind "$1" "$2" && sha256sum "$2/$3""#)
        .arg("sh")
        .arg(model)
        .arg(target.path())
        .arg(file)
        .output()
        .unwrap();
    if out.status.success() {
        let text = String::from_utf8(out.stdout).unwrap();
        Ok(text
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// What a reboot leaves: the mount gone with every modelfs process. `serve` ends the mount
/// for good on SIGINT (SIGTERM hands the connection on).
fn unmount(d: Daemon) {
    let pid = rustix::process::Pid::from_raw(d.pid() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::INT).unwrap();
    assert!(d.stop(), "clean shutdown");
}

/// Whether anything is mounted at `path`.
fn mounted(path: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let want = path.to_str().unwrap();
    info.lines().any(|l| l.split(' ').nth(4) == Some(want))
}

#[test]
fn a_container_never_starts_on_the_underlay_and_starts_once_the_mount_serves() {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 41, 1 << 20);
    let files = files_of(&src);
    // What an old agent left at one model's path (another revision), and an empty directory a
    // runtime created at the other's.
    let old = env.mount.join("llama");
    std::fs::create_dir_all(old.join("weights")).unwrap();
    std::fs::write(old.join("config.json"), b"{\"stale\": true}").unwrap();
    std::fs::write(old.join("weights/x.safetensors"), b"old weights").unwrap();
    std::fs::create_dir_all(env.mount.join("team/empty")).unwrap();
    let uri = format!("local://{}", src.display());
    env.write_models(
        "models.yaml",
        &[
            cluster_model("llama", &uri, "AlwaysDownload", Some("llama")),
            cluster_model("empty", &uri, "AlwaysDownload", Some("team/empty")),
        ]
        .join("---\n"),
    );

    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.llama", "Ready");
    d.wait_model("clusterbasemodel.empty", "Ready");
    for path in ["llama", "team/empty"] {
        assert_eq!(
            container_start(&env.mount.join(path), "config.json"),
            Ok(files["config.json"].clone()),
            "{path} while mounted"
        );
    }
    // A node reboot: the mount is gone, kubelet starts the pods again.
    unmount(d);
    assert!(!mounted(&env.mount), "still mounted");
    for path in ["llama", "team/empty"] {
        let failed = container_start(&env.mount.join(path), "config.json")
            .expect_err("a container started on the underlay");
        assert!(failed.contains("Not a directory"), "{path}: {failed}");
    }
    // The old agent's files were moved aside, not deleted.
    let aside: Vec<_> = std::fs::read_dir(&env.mount)
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(".llama.modelfs-aside-")
        })
        .map(|e| e.path())
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(
        std::fs::read(aside[0].join("weights/x.safetensors")).unwrap(),
        b"old weights"
    );

    // The mount server is back: the same start now reads the served model.
    let d = Daemon::start(&env, &[]);
    d.wait_ready();
    for path in ["llama", "team/empty"] {
        for file in ["config.json", "weights/model-00001-of-00002.safetensors"] {
            assert_eq!(
                container_start(&env.mount.join(path), file),
                Ok(files[file].clone()),
                "{path}/{file} after the restart"
            );
        }
    }
    unmount(d);
}

#[test]
fn traps_follow_the_mapping() {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 42, 4096);
    let uri = format!("local://{}", src.display());
    env.write_models(
        "a.yaml",
        &cluster_model("a", &uri, "AlwaysDownload", Some("x/a")),
    );
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.a", "Ready");
    env.write_models(
        "b.yaml",
        &cluster_model("b", &uri, "AlwaysDownload", Some("x/b")),
    );
    d.wait_model("clusterbasemodel.b", "Ready");
    env.remove_models("a.yaml");
    d.wait_gone("clusterbasemodel.a");
    unmount(d);
    // Underneath: b's path is a trap, a's trap went with a.
    let trap = std::fs::read_to_string(env.mount.join("x/b")).unwrap();
    assert_eq!(trap, modelfs_mount::underlay::TRAP_CONTENT);
    assert!(!env.mount.join("x/a").exists(), "a's trap stayed");
}
