//! Migration from OME's model agent (SPEC section 5, last bullet): files the old agent left under
//! the models root are adopted through a handle on the directory underneath the mount
//! (verified, hard-linked into the store), never hidden and never downloaded again; a corrupted
//! file is downloaded; `local://` directories under the models root are served from there.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use common::hub::*;
use common::*;
use modelfs_devhub::hf::files_from_dir;
use sha2::{Digest, Sha256};

/// Everything below `dir` without following symlinks: relative path -> description (kind,
/// symlink target or size, mode, mtime, content digest). Equal snapshots mean nothing was
/// changed but the write bits of files, which adoption takes from the files it links.
fn snapshot(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for entry in walkdir(dir) {
        let rel = entry.strip_prefix(dir).unwrap().display().to_string();
        let m = std::fs::symlink_metadata(&entry).unwrap();
        let what = if m.file_type().is_symlink() {
            format!("link -> {}", std::fs::read_link(&entry).unwrap().display())
        } else if m.is_dir() {
            format!("dir {:o}", m.mode())
        } else {
            let data = std::fs::read(&entry).unwrap();
            format!(
                "file {:o} {} {}.{} {}",
                m.mode() & !0o222,
                m.len(),
                m.mtime(),
                m.mtime_nsec(),
                hex::encode(Sha256::digest(&data))
            )
        };
        out.insert(rel, what);
    }
    out
}

/// The traps in a snapshot: one-line files the mount server keeps beneath the mount at served
/// paths (see `modelfs_mount::underlay`).
fn traps(snap: &BTreeMap<String, String>) -> Vec<String> {
    let sha = hex::encode(Sha256::digest(modelfs_mount::underlay::TRAP_CONTENT));
    let size = modelfs_mount::underlay::TRAP_CONTENT.len();
    snap.iter()
        .filter(|(_, v)| v.starts_with(&format!("file 100444 {size} ")) && v.ends_with(&sha))
        .map(|(k, _)| k.clone())
        .collect()
}

/// A snapshot as it was before the mount server made its traps: entries moved aside for a
/// trap (`.<name>.modelfs-aside-<secs>`) back at their names, the traps and the directories
/// made only to hold them gone. Equal to the snapshot before means nothing was changed or
/// deleted, only moved aside.
fn without_traps(
    snap: BTreeMap<String, String>,
    before: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let traps = traps(&snap);
    let original = |component: &str| -> String {
        component
            .strip_prefix('.')
            .and_then(|c| c.split_once(".modelfs-aside-"))
            .filter(|(_, secs)| secs.bytes().all(|b| b.is_ascii_digit() || b == b'-'))
            .map(|(name, _)| name.to_owned())
            .unwrap_or_else(|| component.to_owned())
    };
    let kept: BTreeMap<String, String> = snap
        .into_iter()
        .filter(|(k, _)| !traps.contains(k))
        .map(|(k, v)| (k.split('/').map(original).collect::<Vec<_>>().join("/"), v))
        .collect();
    // Deepest first, so that a directory is looked at after everything below it.
    let mut out = BTreeMap::new();
    for (k, v) in kept.into_iter().rev() {
        let holds_something = out.keys().any(|o: &String| o.starts_with(&format!("{k}/")));
        if !v.starts_with("dir ") || before.contains_key(&k) || holds_something {
            out.insert(k, v);
        }
    }
    out
}

/// Where the entry `name` of `dir` was moved aside for a trap.
fn moved_aside(dir: &Path, name: &str) -> PathBuf {
    let prefix = format!(".{name}.modelfs-aside-");
    let found: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    assert_eq!(found.len(), 1, "{name} in {}: {found:?}", dir.display());
    found[0].clone()
}

fn walkdir(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                todo.push(p.clone());
            }
            out.push(p);
        }
    }
    out
}

/// Copies the files of `src` to `dst` as OME's agent writes them (plain files at their relative
/// paths, nothing else).
fn prefill(src: &Path, dst: &Path) {
    for (rel, _) in files_of(src) {
        let to = dst.join(&rel);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(src.join(&rel), &to).unwrap();
    }
}

/// The blob file in some store with this sha256 (hex), if any.
fn blob_inodes(env: &TestEnv, sha: &str) -> Vec<u64> {
    env.stores_with_blobs()
        .iter()
        .filter_map(|s| std::fs::metadata(s.join("blobs").join(sha)).ok())
        .map(|m| m.ino())
        .collect()
}

fn publish(env: &TestEnv, hub: &TestHub, repo: &str, seed: u64) -> (PathBuf, u64) {
    let dir = env.dir(&format!("repo-{seed}"));
    make_model_dir(&dir, seed, 3 << 20);
    hub.hub()
        .add_commit(repo, &["main"], files_from_dir(&dir, 64 << 10).unwrap());
    let size = tree(&dir).values().map(|v| v.1).sum();
    (dir, size)
}

const BIG: &str = "weights/model-00001-of-00002.safetensors";
const SMALL: &str = "tokenizer/vocab/merges.txt";

#[test]
fn a_models_root_left_by_ome_is_adopted_not_downloaded() {
    let hub = TestHub::start(50);
    let env = TestEnv::new();
    let (dir_m, size_m) = publish(&env, &hub, "org/m", 11);
    let (dir_k, _) = publish(&env, &hub, "org/k", 12);
    let root = env.mount.clone();

    // What OME's agent leaves: a parent's download, two children as relative directory
    // symlinks to it (OME's ReuseIfExists), a second model whose copy has one corrupted file
    // of the right size (OME trusts sizes), and a "child" whose link leads outside the root.
    prefill(&dir_m, &root.join("shared/m"));
    for child in ["team-a", "team-b"] {
        std::fs::create_dir_all(root.join(child)).unwrap();
        std::os::unix::fs::symlink("../shared/m", root.join(child).join("m")).unwrap();
    }
    prefill(&dir_k, &root.join("other/k"));
    let corrupt = root.join("other/k").join(BIG);
    let mut bytes = std::fs::read(&corrupt).unwrap();
    bytes[1000] ^= 0xff;
    std::fs::write(&corrupt, &bytes).unwrap();
    let corrupt_size = bytes.len() as u64;
    let outside = env.dir("outside/m");
    prefill(&dir_m, &outside);
    std::fs::create_dir_all(root.join("escape")).unwrap();
    std::os::unix::fs::symlink(&outside, root.join("escape/m")).unwrap();
    let before = snapshot(&root);

    let at = |p: &str| root.join(p).display().to_string();
    env.write_models(
        "models.yaml",
        &[
            cluster_model("m", "hf://org/m", "AlwaysDownload", Some(&at("shared/m"))),
            base_model(
                "team-a",
                "m",
                "hf://org/m",
                "ReuseIfExists",
                Some(&at("team-a/m")),
            ),
            base_model(
                "team-b",
                "m",
                "hf://org/m",
                "AlwaysDownload",
                Some(&at("team-b/m")),
            ),
            cluster_model("k", "hf://org/k", "AlwaysDownload", Some(&at("other/k"))),
            cluster_model(
                "escape",
                "hf://org/m",
                "AlwaysDownload",
                Some(&at("escape/m")),
            ),
        ]
        .join("---\n"),
    );
    let d = start_daemon(&env, &hub);
    for key in [
        "clusterbasemodel.m",
        "team-a.basemodel.m",
        "team-b.basemodel.m",
        "clusterbasemodel.k",
        "clusterbasemodel.escape",
    ] {
        d.wait_model(key, "Ready");
    }
    for (path, dir) in [
        ("shared/m", &dir_m),
        ("team-a/m", &dir_m),
        ("team-b/m", &dir_m),
        ("other/k", &dir_k),
        ("escape/m", &dir_m),
    ] {
        assert_eq!(
            contents(&root.join(path)),
            contents(dir),
            "{path} via the mount"
        );
    }
    // The hub served the corrupted file and the model whose link leads outside the root,
    // nothing else.
    assert_eq!(
        hub.hub().stats().bytes_served,
        corrupt_size + size_m,
        "hub bytes; log:\n{}",
        d.log_text()
    );
    let log = d.log_text();
    assert!(
        log.contains("old file not adopted") && log.contains(BIG),
        "the rejected file is reported; log:\n{log}"
    );
    assert!(d.stop(), "clean shutdown");

    // Nothing under the old tree changed but what was moved aside for the traps: the
    // symlinks and the copy with a corrupted file. The parent's copy, whose files are the
    // store's blobs now, stays. The adopted blobs are the old files' inodes.
    let after = snapshot(&root);
    let trapped = traps(&after);
    for path in ["team-a/m", "team-b/m", "other/k", "escape/m"] {
        assert!(
            trapped.contains(&path.to_owned()),
            "no trap at {path}: {trapped:?}"
        );
    }
    assert!(!trapped.contains(&"shared/m".to_owned()), "{trapped:?}");
    assert_eq!(
        without_traps(after, &before),
        before,
        "the old tree was modified"
    );
    let old_k = moved_aside(&root.join("other"), "k");
    for (old, rel) in [
        (root.join("shared/m"), BIG),
        (root.join("shared/m"), SMALL),
        (old_k, SMALL),
    ] {
        let file = old.join(rel);
        let sha = hex::encode(Sha256::digest(std::fs::read(&file).unwrap()));
        let ino = std::fs::metadata(&file).unwrap().ino();
        assert!(
            blob_inodes(&env, &sha).contains(&ino),
            "{}/{rel} was not hard-linked into a store",
            old.display()
        );
    }
    // The corrupted file's bytes never entered a store; the downloaded one did.
    let bad = hex::encode(Sha256::digest(&bytes));
    assert!(blob_inodes(&env, &bad).is_empty(), "corrupted bytes stored");
    let good = hex::encode(Sha256::digest(std::fs::read(dir_k.join(BIG)).unwrap()));
    assert!(!blob_inodes(&env, &good).is_empty());

    // A restart serves the adopted stores as they are: nothing is adopted or fetched again.
    let served = hub.hub().stats().bytes_served;
    let d = start_daemon(&env, &hub);
    for key in [
        "clusterbasemodel.m",
        "team-b.basemodel.m",
        "clusterbasemodel.k",
    ] {
        d.wait_model(key, "Ready");
    }
    assert_eq!(contents(&root.join("team-b/m")), contents(&dir_m));
    assert_eq!(hub.hub().stats().bytes_served, served);
    assert!(!d.log_text().contains("adopted files"), "adopted again");
    assert!(d.stop(), "clean shutdown");
    assert_eq!(
        without_traps(snapshot(&root), &before),
        before,
        "the old tree was modified"
    );
}

#[test]
fn a_local_source_under_the_models_root_is_served_from_the_files_there() {
    let env = TestEnv::new();
    let root = env.mount.clone();
    let src = env.dir("src");
    make_model_dir(&src, 21, 1 << 20);
    // As OME's local:// means it: the files already sit on the node, here below the models
    // root (reached by one model through an OME-style relative symlink).
    prefill(&src, &root.join("data/tiny"));
    std::fs::create_dir_all(root.join("links")).unwrap();
    std::os::unix::fs::symlink("../data/tiny", root.join("links/tiny")).unwrap();
    let before = snapshot(&root);

    let uri = |p: &str| format!("local://{}", root.join(p).display());
    env.write_models(
        "models.yaml",
        &[
            cluster_model(
                "tiny",
                &uri("data/tiny"),
                "AlwaysDownload",
                Some("data/tiny"),
            ),
            cluster_model(
                "linked",
                &uri("links/tiny"),
                "AlwaysDownload",
                Some("copies/tiny"),
            ),
        ]
        .join("---\n"),
    );
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.tiny", "Ready");
    d.wait_model("clusterbasemodel.linked", "Ready");
    assert_eq!(contents(&root.join("data/tiny")), contents(&src));
    assert_eq!(contents(&root.join("copies/tiny")), contents(&src));
    // Nothing was copied: every local file is counted as fetched only when copied.
    assert_eq!(
        d.metric("modelfs_fetched_bytes_total"),
        0.0,
        "{}",
        d.metrics()
    );
    assert!(d.stop(), "clean shutdown");

    // The source at its model's own path stays (its files are the store's blobs); the other
    // model's path gets a trap.
    let after = snapshot(&root);
    assert_eq!(traps(&after), ["copies/tiny"]);
    assert_eq!(
        without_traps(after, &before),
        before,
        "the old tree was modified"
    );
    let file = root.join("data/tiny").join(BIG);
    let sha = hex::encode(Sha256::digest(std::fs::read(&file).unwrap()));
    let ino = std::fs::metadata(&file).unwrap().ino();
    let inodes = blob_inodes(&env, &sha);
    assert_eq!(
        inodes,
        vec![ino, ino],
        "both stores hold the old file's inode"
    );
}

/// Issue 21, item 1: an old file a user owns, adopted, then written by that user through a
/// hard link they kept outside the models root, does not change what the mount serves (it was
/// copied: the user could write it at any time). Root's ordinary files are still linked, and
/// lose their write bits. Nothing is downloaded.
#[test]
fn a_users_old_file_written_through_a_kept_link_does_not_change_the_served_bytes() {
    use std::os::unix::fs::PermissionsExt;
    let hub = TestHub::start(50);
    let env = TestEnv::new();
    let (dir_m, _) = publish(&env, &hub, "org/m", 41);
    let root = env.mount.clone();
    prefill(&dir_m, &root.join("m"));
    // The user's file, and a link to it (and one to a root file) kept where the user can
    // reach it after the mount covers the models root.
    let home = env.dir("home");
    for dir in [env.root.path(), home.as_path()] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let users = root.join("m").join(BIG);
    sh(&format!("chown 65534:65534 '{}'", users.display()));
    let kept = home.join("kept-link");
    std::fs::hard_link(&users, &kept).unwrap();
    let roots = home.join("root-link");
    std::fs::hard_link(root.join("m").join(SMALL), &roots).unwrap();

    env.write_models(
        "m.yaml",
        &cluster_model("m", "hf://org/m", "AlwaysDownload", Some("m")),
    );
    let d = start_daemon(&env, &hub);
    d.wait_model("clusterbasemodel.m", "Ready");
    assert_eq!(hub.hub().stats().bytes_served, 0, "adopted, not downloaded");
    assert_eq!(contents(&root.join("m")), contents(&dir_m));

    // The user writes their file in place, as themselves, through the kept link.
    sh(&format!(
        "setpriv --reuid=65534 --regid=65534 --clear-groups \
         sh -c 'printf CHANGED-BY-A-USER | dd of={} bs=1 seek=4096 conv=notrunc status=none'",
        kept.display()
    ));
    assert_ne!(
        std::fs::read(&kept).unwrap(),
        std::fs::read(dir_m.join(BIG)).unwrap(),
        "the user's write went through"
    );
    // Served bytes come from the store, not from the page cache.
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    assert_eq!(
        contents(&root.join("m")),
        contents(&dir_m),
        "the served bytes changed"
    );
    // Root's file is read-only now, for its owner too; the user cannot write it.
    assert_eq!(std::fs::metadata(&roots).unwrap().mode() & 0o7777, 0o444);
    let denied = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
        ])
        .arg(format!("printf x >> '{}' 2>/dev/null", roots.display()))
        .status()
        .unwrap();
    assert!(!denied.success());
    assert!(d.stop(), "clean shutdown");

    // The user's file was copied, root's linked.
    let sha = |p: &Path| hex::encode(Sha256::digest(std::fs::read(p).unwrap()));
    let big = blob_inodes(&env, &sha(&dir_m.join(BIG)));
    assert_eq!(big.len(), 1);
    assert_ne!(big[0], std::fs::metadata(&kept).unwrap().ino(), "copied");
    assert_eq!(
        blob_inodes(&env, &sha(&roots)),
        vec![std::fs::metadata(&roots).unwrap().ino()],
        "linked"
    );
}

/// Detaches a bind mount when the test ends, whatever happens.
struct BindMount(PathBuf);

impl Drop for BindMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

#[test]
fn a_models_root_that_is_a_bind_mount_is_mounted_over_and_adopted() {
    // As in the DaemonSet: the models root the daemon sees is a bind mount of the host
    // directory. Hard links cannot cross mounts, so the files are copied (and verified).
    let hub = TestHub::start(50);
    let env = TestEnv::new();
    let (dir_m, _) = publish(&env, &hub, "org/m", 31);
    let host = env.dir("host-models");
    prefill(&dir_m, &host.join("m"));
    let before = snapshot(&host);
    std::fs::create_dir_all(&env.mount).unwrap();
    sh(&format!(
        "mount --bind '{}' '{}'",
        host.display(),
        env.mount.display()
    ));
    let _bind = BindMount(env.mount.clone());

    env.write_models(
        "m.yaml",
        &cluster_model("m", "hf://org/m", "AlwaysDownload", Some("m")),
    );
    let d = start_daemon(&env, &hub);
    d.wait_model("clusterbasemodel.m", "Ready");
    assert_eq!(contents(&env.mount.join("m")), contents(&dir_m));
    assert_eq!(hub.hub().stats().bytes_served, 0, "log:\n{}", d.log_text());
    assert_eq!(hub.hub().stats().file_requests, 0);
    assert!(d.stop(), "clean shutdown");

    // Copied, not linked: the old copy is moved aside for the trap.
    let after = snapshot(&host);
    assert!(traps(&after).contains(&"m".to_owned()), "{after:?}");
    assert_eq!(
        without_traps(after, &before),
        before,
        "the old tree was modified"
    );
    let file = moved_aside(&host, "m").join(BIG);
    let sha = hex::encode(Sha256::digest(std::fs::read(&file).unwrap()));
    let inodes = blob_inodes(&env, &sha);
    assert_eq!(inodes.len(), 1, "adopted into one store");
    assert_ne!(inodes[0], std::fs::metadata(&file).unwrap().ino(), "copied");
}

/// The agent and the mount server of the shipped Kubernetes layout (deploy/base), as separate
/// processes: the mount server sees the models root and the state directory through one mount
/// (their common parent, one hostPath volume), the agent through two (one volume each, bind
/// mounts in a private mount namespace), so no path of the agent's can hard-link between them.
struct SplitLayout {
    raid: PathBuf,
    models_root: PathBuf,
    state: PathBuf,
    listen: String,
    log: PathBuf,
    server: Option<std::process::Child>,
    agent: Option<std::process::Child>,
}

impl SplitLayout {
    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn log_file(&self) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap()
    }

    fn start(env: &TestEnv, raid: PathBuf, hub: &TestHub) -> Self {
        let socket = env.dir("run").join("agent.sock");
        let listen_file = env.root.path().join("agent.addr");
        let mut layout = SplitLayout {
            models_root: raid.join("models"),
            state: raid.join(".modelfs-models"),
            raid,
            listen: String::new(),
            log: env.root.path().join("split.log"),
            server: None,
            agent: None,
        };
        let common = |cmd: &mut std::process::Command, log: std::fs::File| {
            cmd.env("RUST_LOG", "info,modelfs=debug")
                .stdin(std::process::Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log);
        };
        let mut server = std::process::Command::new(BIN);
        server
            .arg("mount-server")
            .arg("--mount")
            .arg(&layout.models_root)
            .arg("--state")
            .arg(&layout.state)
            .arg("--mount-socket")
            .arg(&socket)
            .args(["--fuse-transport", "dev"]);
        common(&mut server, layout.log_file());
        layout.server = Some(server.spawn().unwrap());
        wait_for(
            "the mount server",
            std::time::Duration::from_secs(30),
            || layout.log_text().contains("waiting for the agent"),
        );

        // The agent's pod: the models root (with the FUSE mount on it) and the state directory
        // are two volumes, each a bind mount of its own.
        let mut agent = std::process::Command::new("unshare");
        agent
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(r#"mount --rbind "$1" "$1" && mount --bind "$2" "$2" && shift 2 && exec "$@""#)
            .arg("sh")
            .arg(&layout.models_root)
            .arg(&layout.state)
            .arg(BIN)
            .arg("agent")
            .arg("--mount")
            .arg(&layout.models_root)
            .arg("--state")
            .arg(&layout.state)
            .arg("--models")
            .arg(&env.models)
            .arg("--listen")
            .arg(ANY_PORT)
            .arg("--listen-addr-file")
            .arg(&listen_file)
            .arg("--mount-socket")
            .arg(&socket)
            .args(hf_flags(hub));
        common(&mut agent, layout.log_file());
        layout.agent = Some(agent.spawn().unwrap());
        layout.listen = listen_addr(&listen_file, std::time::Duration::from_secs(30), || {
            layout.log_text()
        });
        wait_for("the agent", std::time::Duration::from_secs(30), || {
            matches!(http_get(&layout.listen, "/readyz"), Some((200, _)))
        });
        layout
    }

    fn wait_ready(&self, key: &str) {
        wait_for(
            &format!("{key} Ready"),
            std::time::Duration::from_secs(60),
            || {
                http_get(&self.listen, "/v1/models")
                    .and_then(|(_, body)| serde_json::from_str::<serde_json::Value>(&body).ok())
                    .is_some_and(|doc| doc[key]["status"] == "Ready")
            },
        );
    }

    /// Stops the agent (SIGTERM, as a rollout does) and ends the mount (SIGINT).
    fn stop(&mut self) {
        if let Some(mut agent) = self.agent.take() {
            terminate(agent.id());
            agent.wait().unwrap();
        }
        if let Some(mut server) = self.server.take() {
            interrupt(server.id());
            server.wait().unwrap();
        }
    }
}

impl Drop for SplitLayout {
    fn drop(&mut self) {
        // A test that failed before `stop` leaves the processes and the mount.
        let running: Vec<_> = [self.agent.take(), self.server.take()]
            .into_iter()
            .flatten()
            .collect();
        if !running.is_empty() {
            for mut child in running {
                let _ = child.kill();
                let _ = child.wait();
            }
            let _ = std::process::Command::new(BIN)
                .arg("unmount")
                .arg("--mount")
                .arg(&self.models_root)
                .arg("--state")
                .arg(&self.state)
                .status();
        }
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.raid)
            .status();
    }
}

/// Bytes free on the filesystem holding `dir`.
fn free_bytes(dir: &Path) -> u64 {
    let st = rustix::fs::statvfs(dir).unwrap();
    st.f_bavail * st.f_frsize
}

#[test]
fn adoption_in_the_shipped_kubernetes_layout_links_without_a_copy() {
    let hub = TestHub::start(50);
    let env = TestEnv::new();
    let dir_m = env.dir("repo");
    make_model_dir(&dir_m, 51, 24 << 20);
    hub.hub().add_commit(
        "org/m",
        &["main"],
        files_from_dir(&dir_m, 64 << 10).unwrap(),
    );
    let size: u64 = tree(&dir_m).values().map(|v| v.1).sum();

    // The node's large disk: a filesystem of its own, so `df` sees only this test.
    let raid = env.dir("raid");
    sh(&format!(
        "mount -t tmpfs -o size=256m modelfs-raid '{}'",
        raid.display()
    ));
    let old = raid.join("models/shared/m");
    prefill(&dir_m, &old);
    let before = snapshot(&raid.join("models"));
    let old_ino = std::fs::metadata(old.join(BIG)).unwrap().ino();
    env.write_models(
        "m.yaml",
        &cluster_model(
            "m",
            "hf://org/m",
            "AlwaysDownload",
            Some(&old.display().to_string()),
        ),
    );
    let free_before = free_bytes(&raid);

    let mut layout = SplitLayout::start(&env, raid.clone(), &hub);
    layout.wait_ready("clusterbasemodel.m");
    assert_eq!(contents(&old), contents(&dir_m), "served through the mount");
    assert_eq!(
        hub.hub().stats().bytes_served,
        0,
        "log:\n{}",
        layout.log_text()
    );

    // Every old file is the store's blob: one inode with two names, and the disk holds the
    // bytes once (the state's own files are a few KiB).
    let used = free_before.saturating_sub(free_bytes(&raid));
    assert!(
        used < size / 8,
        "adoption used {used} bytes of the disk for {size} bytes of old files"
    );
    let log = layout.log_text();
    assert!(
        log.contains("adoption of old files links through the mount that holds both"),
        "log:\n{log}"
    );
    layout.stop();
    // Linked files are the store's: the old directory stays where it is (no trap there).
    let after = snapshot(&raid.join("models"));
    let trapped = traps(&after);
    assert!(
        !trapped.iter().any(|t| t.starts_with("shared/")),
        "{trapped:?}"
    );
    for (rel, _) in files_of(&dir_m) {
        let file = old.join(&rel);
        let meta = std::fs::metadata(&file).unwrap();
        if meta.len() == 0 {
            continue;
        }
        let sha = hex::encode(Sha256::digest(std::fs::read(&file).unwrap()));
        let blobs: Vec<std::fs::Metadata> = env_stores(&layout.state)
            .iter()
            .filter_map(|s| std::fs::metadata(s.join("blobs").join(&sha)).ok())
            .collect();
        assert_eq!(blobs.len(), 1, "{rel} adopted into one store");
        assert_eq!(blobs[0].ino(), meta.ino(), "{rel} linked, not copied");
        assert_eq!(meta.nlink(), 2, "{rel}: the old name and the blob");
    }
    assert_eq!(std::fs::metadata(old.join(BIG)).unwrap().ino(), old_ino);
    assert_eq!(
        without_traps(after, &before),
        before,
        "the old tree was modified"
    );
}

/// The store directories under `state`.
fn env_stores(state: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(state.join("stores"))
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}
