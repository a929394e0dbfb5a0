//! Hostile `local://` sources end to end, with a real mount: a FIFO swapped in during an import,
//! an import blocked in the kernel at shutdown, symlinks leaving the source tree, files other
//! users cannot read, control characters and non-UTF-8 names (and control characters in a
//! hub's listing: the check is shared by every source). Also extended attributes on the mount.

mod common;

use std::ffi::OsStr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

fn uri(p: &Path) -> String {
    format!("local://{}", p.display())
}

fn mkfifo(path: &Path) {
    rustix::fs::mknodat(
        rustix::fs::CWD,
        path,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
}

fn write_mode(path: &Path, data: &[u8], mode: u32) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, data).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// A permanent failure: `Failed`, with a reason that says `want`, and no retry scheduled (the
/// reconciler appends "(retry N in Ts)" to the reason of every failure it will retry).
fn assert_failed_for_good(d: &Daemon, key: &str, want: &str) -> String {
    let entry = d.wait_model(key, "Failed");
    let reason = entry["reason"].as_str().unwrap_or_default().to_string();
    assert!(
        reason.contains(want),
        "{key}: reason {reason:?} should say {want:?}"
    );
    assert!(
        !reason.contains("(retry"),
        "{key}: a permanent error must not be retried: {reason:?}"
    );
    reason
}

/// Waits until some process opens `name` in the watched directory.
fn wait_for_open(inotify: &OwnedFd, name: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
    let mut reader = rustix::fs::inotify::Reader::new(inotify, &mut buf);
    while Instant::now() < deadline {
        match reader.next() {
            Ok(event) => {
                if event
                    .file_name()
                    .is_some_and(|n| n.to_bytes() == name.as_bytes())
                {
                    return;
                }
            }
            Err(rustix::io::Errno::AGAIN) => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => panic!("inotify: {e}"),
        }
    }
    panic!("nobody opened {name} within {timeout:?}");
}

#[test]
fn a_fifo_swapped_in_during_an_import_fails_the_model_and_sigterm_still_exits() {
    let env = TestEnv::new();
    // Large enough that hashing it takes a while: the swap happens after the directory was
    // walked (the walk saw a regular b.bin) and before b.bin is opened, or at the latest before
    // the copy opens it again.
    let src = env.dir("src");
    std::fs::write(src.join("a.bin"), bytes(1, 64 << 20)).unwrap();
    std::fs::write(src.join("b.bin"), b"small file").unwrap();
    let fifo = env.root.path().join("fifo");
    mkfifo(&fifo);
    let present = env.dir("present");
    std::fs::write(present.join("ok.bin"), b"ok").unwrap();
    mkfifo(&present.join("pipe"));

    let inotify = rustix::fs::inotify::init(
        rustix::fs::inotify::CreateFlags::NONBLOCK | rustix::fs::inotify::CreateFlags::CLOEXEC,
    )
    .unwrap();
    rustix::fs::inotify::add_watch(&inotify, &src, rustix::fs::inotify::WatchFlags::OPEN).unwrap();

    let d = Daemon::start(&env, &[]);
    env.write_models(
        "m.yaml",
        &[
            cluster_model("swapped", &uri(&src), "AlwaysDownload", None),
            cluster_model("present", &uri(&present), "AlwaysDownload", None),
        ]
        .join("---\n"),
    );
    wait_for_open(&inotify, "a.bin", Duration::from_secs(60));
    std::fs::rename(&fifo, src.join("b.bin")).unwrap();

    assert_failed_for_good(
        &d,
        "clusterbasemodel.swapped",
        &format!("{} is a named pipe (FIFO)", src.join("b.bin").display()),
    );
    assert_failed_for_good(
        &d,
        "clusterbasemodel.present",
        &format!("{} is a named pipe (FIFO)", present.join("pipe").display()),
    );
    assert!(!env.mount.join("swapped").exists());
    let log = d.log.clone();
    assert!(
        d.stop(),
        "the daemon did not exit cleanly on SIGINT; log:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

/// A FUSE mount whose server never answers: every access below it blocks in the kernel, as on
/// a hung network filesystem. Dropping it aborts the connection (blocked callers get
/// `ENOTCONN`) and detaches the mount.
struct HungMount {
    fuse: Option<std::fs::File>,
    target: PathBuf,
}

impl HungMount {
    fn new(target: &Path) -> HungMount {
        let fuse = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")
            .unwrap();
        let options = std::ffi::CString::new(format!(
            "fd={},rootmode=40000,user_id=0,group_id=0",
            fuse.as_raw_fd()
        ))
        .unwrap();
        rustix::mount::mount(
            "modelfs-test-hung",
            target,
            "fuse.modelfs-test-hung",
            rustix::mount::MountFlags::NOSUID | rustix::mount::MountFlags::NODEV,
            options.as_c_str(),
        )
        .expect("mount");
        HungMount {
            fuse: Some(fuse),
            target: target.to_path_buf(),
        }
    }
}

impl Drop for HungMount {
    fn drop(&mut self) {
        drop(self.fuse.take());
        let _ = Command::new("umount").arg("-l").arg(&self.target).status();
    }
}

/// Whether a thread of `pid` or of its children (`serve` runs the agent, which imports, as
/// its child) waits for an answer from a FUSE server (`fuse_get_req` while the connection is
/// not initialised; the daemon's own FUSE threads wait in `fuse_dev_*` instead).
fn blocked_on_fuse(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|task| {
        let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        std::fs::read_to_string(task.path().join("wchan"))
            .is_ok_and(|w| w.starts_with("fuse") && !w.starts_with("fuse_dev"))
            || children
                .split_whitespace()
                .filter_map(|c| c.parse().ok())
                .any(blocked_on_fuse)
    })
}

#[test]
fn a_daemon_whose_import_is_blocked_in_the_kernel_exits_promptly_on_sigterm() {
    let env = TestEnv::new();
    let src = env.dir("src");
    std::fs::write(src.join("a.bin"), b"data").unwrap();
    let hung = HungMount::new(&env.dir("src/stuck"));
    let d = Daemon::start(&env, &[]);
    env.write_models(
        "m.yaml",
        &cluster_model("stuck", &uri(&src), "AlwaysDownload", None),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while !blocked_on_fuse(d.pid()) {
        assert!(
            Instant::now() < deadline,
            "the import never reached the hung mount; log:\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = d.log.clone();
    // `stop` waits 30 s for the exit: generous next to the daemon's own bounds.
    assert!(
        d.stop(),
        "the daemon did not exit on SIGINT while an import was blocked; log:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    drop(hung);
}

#[test]
fn symlinks_leaving_the_tree_and_private_files_are_refused_and_never_published() {
    let env = TestEnv::new();
    // Let user nobody reach the mount (the test root is private).
    std::fs::set_permissions(env.root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(env.root.path().join("secret.bin"), b"not part of any model").unwrap();

    let inside = env.dir("inside");
    std::fs::create_dir_all(inside.join("weights")).unwrap();
    std::fs::write(inside.join("weights/model.bin"), bytes(7, 10_000)).unwrap();
    std::os::unix::fs::symlink("weights/model.bin", inside.join("alias.bin")).unwrap();
    std::os::unix::fs::symlink("weights", inside.join("linked")).unwrap();

    let escape = env.dir("escape");
    std::fs::write(escape.join("ok.bin"), b"ok").unwrap();
    std::os::unix::fs::symlink("../secret.bin", escape.join("leak.bin")).unwrap();

    let private = env.dir("private");
    std::fs::write(private.join("ok.bin"), b"ok").unwrap();
    write_mode(&private.join("root-only.bin"), b"root only", 0o600);

    let unreadable = env.dir("unreadable");
    std::fs::write(unreadable.join("ok.bin"), b"ok").unwrap();
    write_mode(&unreadable.join("mode-000.bin"), b"nobody", 0o000);

    let d = Daemon::start(&env, &[]);
    env.write_models(
        "m.yaml",
        &[
            cluster_model("inside", &uri(&inside), "AlwaysDownload", None),
            cluster_model("escape", &uri(&escape), "AlwaysDownload", None),
            cluster_model("private", &uri(&private), "AlwaysDownload", None),
            cluster_model("unreadable", &uri(&unreadable), "AlwaysDownload", None),
        ]
        .join("---\n"),
    );
    d.wait_model("clusterbasemodel.inside", "Ready");
    assert_failed_for_good(
        &d,
        "clusterbasemodel.escape",
        &format!(
            "{} is a symlink that leads to {}, outside the source directory",
            escape.join("leak.bin").display(),
            env.root.path().join("secret.bin").display()
        ),
    );
    assert_failed_for_good(
        &d,
        "clusterbasemodel.private",
        &format!(
            "{} is not readable by other users (mode 0600)",
            private.join("root-only.bin").display()
        ),
    );
    assert_failed_for_good(
        &d,
        "clusterbasemodel.unreadable",
        &format!(
            "{} is not readable by other users (mode 0000)",
            unreadable.join("mode-000.bin").display()
        ),
    );

    // Symlinks inside the tree are served as copies: regular files with the target's bytes.
    let served = env.mount.join("inside");
    let want = std::fs::read(inside.join("weights/model.bin")).unwrap();
    for rel in ["alias.bin", "linked/model.bin", "weights/model.bin"] {
        let meta = std::fs::symlink_metadata(served.join(rel)).unwrap();
        assert!(meta.file_type().is_file(), "{rel} is served as a file");
        assert_eq!(std::fs::read(served.join(rel)).unwrap(), want, "{rel}");
    }

    // User nobody reads a published file, and cannot reach the private ones.
    let as_nobody = |path: &Path| {
        Command::new("runuser")
            .args(["-u", "nobody", "--", "cat"])
            .arg(path)
            .output()
            .unwrap()
    };
    let public = as_nobody(&served.join("alias.bin"));
    assert!(public.status.success(), "{public:?}");
    assert_eq!(public.stdout, want);
    for path in [
        env.mount.join("escape/leak.bin"),
        env.mount.join("private/root-only.bin"),
        env.mount.join("unreadable/mode-000.bin"),
    ] {
        let out = as_nobody(&path);
        assert!(!out.status.success(), "nobody read {}", path.display());
        assert!(!path.exists(), "{} is published", path.display());
    }
}

#[test]
fn control_characters_and_non_utf8_names_fail_for_good_and_hurt_no_other_model() {
    let env = TestEnv::new();
    let control = env.dir("control");
    std::fs::write(control.join("ok.bin"), b"ok").unwrap();
    std::fs::create_dir_all(control.join("sub")).unwrap();
    std::fs::write(control.join("sub/evil\x1b[2J.bin"), b"x").unwrap();
    let latin1 = env.dir("latin1");
    std::fs::write(latin1.join("ok.bin"), b"ok").unwrap();
    std::fs::write(latin1.join(OsStr::from_bytes(b"caf\xe9.bin")), b"x").unwrap();
    let good = env.dir("good");
    make_model_dir(&good, 3, 10_000);

    let d = Daemon::start(&env, &[]);
    env.write_models(
        "m.yaml",
        &[
            cluster_model("control", &uri(&control), "AlwaysDownload", None),
            cluster_model("latin1", &uri(&latin1), "AlwaysDownload", None),
            cluster_model("good", &uri(&good), "AlwaysDownload", None),
        ]
        .join("---\n"),
    );
    let control_reason =
        assert_failed_for_good(&d, "clusterbasemodel.control", "control character");
    // The name is quoted with its escapes, never written raw into status or logs.
    assert!(
        control_reason.contains(r"sub/evil\u{1b}[2J.bin"),
        "{control_reason}"
    );
    assert!(
        !d.log_text().contains('\x1b'),
        "a raw escape reached the log"
    );
    let latin1_reason = assert_failed_for_good(
        &d,
        "clusterbasemodel.latin1",
        "the file name is not valid UTF-8",
    );
    assert!(latin1_reason.contains(&latin1.display().to_string()));
    d.wait_model("clusterbasemodel.good", "Ready");
    assert_eq!(contents(&env.mount.join("good")), contents(&good));
}

#[test]
fn a_hub_listing_with_control_characters_fails_for_good() {
    let hub = common::hub::TestHub::start(100);
    hub.hub().add_commit(
        "org/bell",
        &["main"],
        vec![
            (
                "config.json".to_string(),
                modelfs_devhub::hf::HubFile::memory(b"{}".to_vec(), false),
            ),
            (
                "docs/ring\u{7}.md".to_string(),
                modelfs_devhub::hf::HubFile::memory(b"x".to_vec(), false),
            ),
        ],
    );
    let env = TestEnv::new();
    let d = common::hub::start_daemon(&env, &hub);
    env.write_models(
        "m.yaml",
        &cluster_model("bell", "hf://org/bell", "AlwaysDownload", None),
    );
    let reason = assert_failed_for_good(&d, "clusterbasemodel.bell", "control character");
    assert!(reason.contains(r"docs/ring\u{7}.md"), "{reason}");
    assert!(!env.mount.join("bell").exists());
}

/// No entry has extended attributes: listing names answers the empty list on every entry;
/// asking for one by name answers `EOPNOTSUPP`, decided by the kernel after the daemon said so
/// once (`ENOSYS`), so per-file questions (`ls -l` asks two per entry) cost no round trip.
#[test]
fn extended_attributes_are_answered_without_warnings() {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 5, 1000);
    let d = Daemon::start(&env, &[]);
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&src), "AlwaysDownload", Some("team/m")),
    );
    d.wait_model("clusterbasemodel.m", "Ready");
    let script = r#"
import errno, os, sys
for path in sys.argv[1:]:
    for _ in range(3):
        try:
            os.getxattr(path, "user.test")
            print("value")
        except OSError as e:
            print(errno.errorcode[e.errno])
    print(os.listxattr(path))
"#;
    let mut paths = vec![
        env.mount.clone(),
        env.mount.join("team"),
        env.mount.join("team/m"),
    ];
    for entry in std::fs::read_dir(env.mount.join("team/m")).unwrap() {
        paths.push(entry.unwrap().path());
    }
    let out = Command::new(python())
        .arg("-c")
        .arg(script)
        .args(&paths)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        // EOPNOTSUPP, which Python names by its Linux alias ENOTSUP (the same number).
        "ENOTSUP\nENOTSUP\nENOTSUP\n[]\n".repeat(paths.len())
    );
    // `ls -l` of every entry asks nothing more of the daemon.
    sh(&format!("ls -lR {} >/dev/null", env.mount.display()));
    let getxattr = r#"modelfs_fuse_requests_total{op="getxattr"}"#;
    let asked = counters_after_marker(&d, &env.mount, getxattr);
    assert_eq!(
        asked,
        1.0,
        "GETXATTR reached the daemon {asked} times for {} entries",
        paths.len()
    );
    let log = d.log_text();
    assert!(!log.contains("Not Implemented"), "{log}");
}
