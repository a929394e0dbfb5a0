//! The mount against a real directory: content, metadata, read paths, read-only semantics.

// mmap of a mounted file is what loaders do; mapping memory has no safe API.
#![allow(unsafe_code)]

mod common;

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use common::*;

fn uri(p: &Path) -> String {
    format!("local://{}", p.display())
}

/// Mount view of a source tree: directories 0555, files 0444, everything else identical.
fn assert_mount_equals_source(mount_dir: &Path, source: &Path) {
    let want: Vec<_> = tree(source)
        .into_iter()
        .map(|(p, (dir, size, _mode, sha))| (p, (dir, size, if dir { 0o555 } else { 0o444 }, sha)))
        .collect();
    let got: Vec<_> = tree(mount_dir).into_iter().collect();
    assert_eq!(
        got,
        want,
        "mount {} differs from source",
        mount_dir.display()
    );
    // The same through real clients: find (names, types, sizes) and sha256sum.
    let listing = |d: &Path| {
        sh(&format!(
            "cd '{}' && find . -printf '%y %s %P\\n' | sort",
            d.display()
        ))
    };
    let strip_dir_sizes = |s: String| -> Vec<String> {
        s.lines()
            .map(|l| {
                if l.starts_with("d ") {
                    format!("d {}", l.splitn(3, ' ').nth(2).unwrap_or(""))
                } else {
                    l.to_string()
                }
            })
            .collect()
    };
    assert_eq!(
        strip_dir_sizes(listing(mount_dir)),
        strip_dir_sizes(listing(source))
    );
    let sums = |d: &Path| {
        sh(&format!(
            "cd '{}' && find . -type f -print0 | sort -z | xargs -0 sha256sum",
            d.display()
        ))
    };
    assert_eq!(sums(mount_dir), sums(source));
}

/// Random preads and an mmap of every file compare equal to the source.
fn assert_random_reads(mount_dir: &Path, source: &Path) {
    let mut rng = 0x1234_5678_u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for (rel, (is_dir, size, _, _)) in tree(source) {
        if is_dir {
            continue;
        }
        let a = File::open(mount_dir.join(&rel)).unwrap();
        let b = std::fs::read(source.join(&rel)).unwrap();
        for _ in 0..50 {
            let off = if size == 0 { 0 } else { next() % (size + 10) };
            let len = (next() % 300_000) as usize;
            let mut buf = vec![0u8; len];
            let n = read_full_at(&a, &mut buf, off);
            let start = (off as usize).min(b.len());
            let end = (start + len).min(b.len());
            assert_eq!(&buf[..n], &b[start..end], "{rel} pread at {off} len {len}");
        }
        if size > 0 {
            // SAFETY: read-only private mapping of a file we keep open for its lifetime.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    size as usize,
                    libc::PROT_READ,
                    libc::MAP_PRIVATE,
                    a.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED, "mmap {rel}");
            // SAFETY: the mapping is `size` bytes long and readable.
            let mapped = unsafe { std::slice::from_raw_parts(p as *const u8, size as usize) };
            assert!(mapped == b.as_slice(), "{rel}: mmap content differs");
            // SAFETY: unmapping what we mapped.
            unsafe { libc::munmap(p, size as usize) };
        }
    }
}

fn read_full_at(f: &File, buf: &mut [u8], off: u64) -> usize {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], off + done as u64).unwrap() {
            0 => break,
            n => done += n,
        }
    }
    done
}

fn serve_one_model(mode: &str, transport: Transport) {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 7, 24 << 20);
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&src), "AlwaysDownload", Some("org/m")),
    );
    let d = Daemon::start_over(&env, transport, &["--passthrough", mode]);
    let entry = d.wait_model("clusterbasemodel.m", "Ready");
    assert_eq!(entry["path"], env.mount.join("org/m").to_str().unwrap());
    let model_dir = env.mount.join("org/m");
    assert_mount_equals_source(&model_dir, &src);
    assert_random_reads(&model_dir, &src);
    let passthrough_opens = d.metric("modelfs_passthrough_opens_total");
    let read_through_opens = d.metric("modelfs_read_through_opens_total");
    match mode {
        "never" => {
            assert_eq!(passthrough_opens, 0.0);
            assert!(read_through_opens > 0.0);
            assert!(d.metric("modelfs_read_bytes_total") > 0.0);
        }
        _ => {
            // Root on Linux >= 6.9 (this project's test machines): every open is passthrough.
            assert!(
                passthrough_opens > 0.0,
                "no passthrough opens: {}",
                d.metrics()
            );
            assert_eq!(read_through_opens, 0.0);
        }
    }
    transport.assert_served(&d);
    assert!(d.stop(), "clean shutdown");
    assert!(
        !sh("cat /proc/self/mountinfo").contains(env.mount.to_str().unwrap()),
        "Ctrl-C (SIGINT) must unmount"
    );
}

#[test]
fn mount_equals_source_with_passthrough() {
    serve_one_model("always", Transport::Dev);
}

#[test]
fn mount_equals_source_with_read_through() {
    serve_one_model("never", Transport::Dev);
}

#[test]
fn mount_equals_source_with_passthrough_over_io_uring() {
    serve_one_model("always", Transport::Uring);
}

#[test]
fn mount_equals_source_with_read_through_over_io_uring() {
    serve_one_model("never", Transport::Uring);
}

fn every_write_fails_with_erofs_over(transport: Transport) {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 3, 1000);
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&src), "AlwaysDownload", None),
    );
    let d = Daemon::start_over(&env, transport, &[]);
    d.wait_model("clusterbasemodel.m", "Ready");
    let dir = env.mount.join("m");
    let file = dir.join("config.json");
    let erofs = |what: &str, r: std::io::Result<()>| {
        let e = r.expect_err(what);
        assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{what}: {e}");
    };
    erofs(
        "open for write",
        OpenOptions::new().write(true).open(&file).map(drop),
    );
    erofs(
        "open read-write",
        OpenOptions::new()
            .read(true)
            .write(true)
            .open(&file)
            .map(drop),
    );
    erofs(
        "truncate",
        OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&file)
            .map(drop),
    );
    erofs("create", File::create(dir.join("new")).map(drop));
    erofs(
        "create at root",
        File::create(env.mount.join("new")).map(drop),
    );
    erofs("mkdir", std::fs::create_dir(dir.join("d")));
    erofs("rename", std::fs::rename(&file, dir.join("other")));
    erofs("unlink", std::fs::remove_file(&file));
    erofs("rmdir", std::fs::remove_dir(dir.join("tokenizer/vocab")));
    erofs("symlink", std::os::unix::fs::symlink("x", dir.join("link")));
    erofs("hard link", std::fs::hard_link(&file, dir.join("hl")));
    use std::os::unix::fs::PermissionsExt;
    erofs(
        "chmod",
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o777)),
    );
    // The content is untouched.
    assert_eq!(
        std::fs::read(&file).unwrap(),
        std::fs::read(src.join("config.json")).unwrap()
    );
    transport.assert_served(&d);
}

fn safetensors_loads_by_mmap_from_the_mount_over(transport: Transport) {
    let env = TestEnv::new();
    let src = env.dir("src");
    let py = python();
    // Write a real checkpoint with the real library, then load it back from both places.
    let script = format!(
        r#"
import numpy as np, sys
from safetensors.numpy import save_file
rng = np.random.default_rng(42)
save_file({{"embed": rng.standard_normal((512, 256)).astype(np.float32),
            "lm_head": rng.standard_normal((256, 1024)).astype(np.float16),
            "bias": np.arange(1024, dtype=np.int64)}}, "{}/model.safetensors", metadata={{"format": "np"}})
"#,
        src.display()
    );
    let out = std::process::Command::new(&py)
        .arg("-c")
        .arg(&script)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // safetensors writes 0600; the mount shows files to every user, so an import needs them
    // readable by others (a private file is refused with a reason).
    std::fs::set_permissions(
        src.join("model.safetensors"),
        std::os::unix::fs::PermissionsExt::from_mode(0o644),
    )
    .unwrap();
    env.write_models(
        "m.yaml",
        &cluster_model("st", &uri(&src), "AlwaysDownload", None),
    );
    let d = Daemon::start_over(&env, transport, &[]);
    d.wait_model("clusterbasemodel.st", "Ready");
    // safe_open maps the file (mmap) and reads tensors out of the mapping.
    let check = format!(
        r#"
import numpy as np
from safetensors import safe_open
def load(p):
    with safe_open(p, framework="np") as f:
        return {{k: f.get_tensor(k) for k in f.keys()}}, f.metadata()
a, ma = load("{mnt}/st/model.safetensors")
b, mb = load("{src}/model.safetensors")
assert sorted(a) == ["bias", "embed", "lm_head"], sorted(a)
assert ma == mb == {{"format": "np"}}
for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
    assert np.array_equal(a[k], b[k]), k
print("ok", sum(v.nbytes for v in a.values()))
"#,
        mnt = env.mount.display(),
        src = src.display()
    );
    let out = std::process::Command::new(&py)
        .arg("-c")
        .arg(&check)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("ok "));
    transport.assert_served(&d);
}

#[test]
fn model_is_never_visible_half_imported() {
    let env = TestEnv::new();
    let src = env.dir("src");
    // Enough data that the import takes a while: 40 files of 4 MiB.
    for i in 0..40 {
        std::fs::write(src.join(format!("shard-{i:03}.bin")), bytes(i, 4 << 20)).unwrap();
    }
    let want = tree(&src);
    let d = Daemon::start(&env, &[]);
    let model = env.mount.join("big");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let model = model.clone();
        let stop = stop.clone();
        let want: Vec<(String, u64)> = want.iter().map(|(k, v)| (k.clone(), v.1)).collect();
        std::thread::spawn(move || {
            let mut seen_complete = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(rd) = std::fs::read_dir(&model) {
                    let mut got: Vec<(String, u64)> = rd
                        .flatten()
                        .map(|e| {
                            (
                                e.file_name().to_string_lossy().into_owned(),
                                e.metadata().unwrap().len(),
                            )
                        })
                        .collect();
                    got.sort();
                    assert_eq!(got, want, "a partial tree was visible");
                    seen_complete += 1;
                }
            }
            seen_complete
        })
    };
    env.write_models(
        "m.yaml",
        &cluster_model("big", &uri(&src), "AlwaysDownload", None),
    );
    d.wait_model("clusterbasemodel.big", "Ready");
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = watcher.join().expect("watcher saw a partial tree");
    assert!(seen > 0, "the watcher never saw the model");
}

/// A tree walk that needs every file's attributes (`find -printf %s`, `ls -l`, `du`) is
/// answered by `READDIRPLUS` listings: no `LOOKUP` per entry, whatever the directory size (the
/// big directory spans several replies, so the kernel's adaptive mode, which falls back to
/// plain `READDIR` after the first reply, would fail this too). The sizes are the source's.
fn tree_walks_need_no_lookup_per_file_over(transport: Transport) {
    let env = TestEnv::new();
    let src = env.dir("src");
    let mut want = Vec::new();
    for (dir, count) in [("", 1000usize), ("sub/", 200)] {
        std::fs::create_dir_all(src.join(dir)).unwrap();
        for i in 0..count {
            let rel = format!("{dir}file-{i:04}.bin");
            std::fs::write(src.join(&rel), bytes(i as u64, i % 97)).unwrap();
            want.push(format!("{} {rel}", i % 97));
        }
    }
    want.sort();
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&src), "AlwaysDownload", Some("m")),
    );
    let d = Daemon::start_over(&env, transport, &[]);
    d.wait_model("clusterbasemodel.m", "Ready");
    let model = env.mount.join("m");
    let lookups = r#"modelfs_fuse_requests_total{op="lookup"}"#;
    let before = counters_after_marker(&d, &model, lookups);

    let found = sh(&format!(
        "find {} -type f -printf '%s %P\\n' | sort",
        model.display()
    ));
    assert_eq!(found.lines().collect::<Vec<_>>(), want);
    let listed = sh(&format!(
        "ls -lR {} | grep -c '^-r--r--r--'",
        model.display()
    ));
    assert_eq!(listed.trim(), "1200");
    let du = sh(&format!("du -ab {} | wc -l", model.display()));
    assert_eq!(du.trim(), "1202", "files, sub/ and the model root");

    let walk_lookups = counters_after_marker(&d, &model, lookups) - before;
    assert!(
        walk_lookups <= 5.0,
        "{walk_lookups} lookups for a walk of 1,200 files: {}",
        d.metrics()
    );
    assert!(d.metric(r#"modelfs_fuse_requests_total{op="readdirplus"}"#) >= 2.0);
    transport.assert_served(&d);
}

/// `find -printf '%y %P\n'` of `dir`, sorted: what a walk sees, types included.
fn walk(dir: &Path) -> Vec<String> {
    let out = sh(&format!(
        "find '{}' -mindepth 1 -printf '%y %P\\n' | sort",
        dir.display()
    ));
    out.lines().map(str::to_string).collect()
}

/// What `walk` of the mount must show for models at `team/<name>` with these source trees.
fn expected_walk(models: &[(&str, &Path)]) -> Vec<String> {
    let mut want = vec!["d team".to_string()];
    for (name, src) in models {
        want.push(format!("d team/{name}"));
        for (rel, (is_dir, ..)) in tree(src) {
            let kind = if is_dir { 'd' } else { 'f' };
            want.push(format!("{kind} team/{name}/{rel}"));
        }
    }
    want.sort();
    want
}

/// The kernel keeps every directory listing cached (the daemon answers no `OPENDIR`), so each
/// mapping change must reach the listings it changes: after a model is re-pointed to other
/// content at the same path, one model is removed and another added in the same directory,
/// and after a model is only added, `find` and `ls` show exactly the new trees, without
/// `drop_caches`. Each listing was read
/// (and cached) before the change. Waits for the new listing with a deadline: a cache that is
/// never invalidated never shows it.
fn listings_follow_mapping_changes_over(transport: Transport) {
    let env = TestEnv::new();
    let src_a = env.dir("src-a");
    make_model_dir(&src_a, 1, 1000);
    let src_b = env.dir("src-b");
    for i in 0..30 {
        let rel = format!("shards/part-{i:02}.bin");
        std::fs::create_dir_all(src_b.join("shards")).unwrap();
        std::fs::write(src_b.join(rel), bytes(i, 10 + i as usize)).unwrap();
    }
    std::fs::write(src_b.join("config.json"), b"{\"b\": true}").unwrap();
    let src_c = env.dir("src-c");
    make_model_dir(&src_c, 3, 100);
    env.write_models(
        "m.yaml",
        &[
            cluster_model("m", &uri(&src_a), "AlwaysDownload", Some("team/m")),
            cluster_model("gone", &uri(&src_c), "AlwaysDownload", Some("team/gone")),
        ]
        .join("---\n"),
    );
    let d = Daemon::start_over(&env, transport, &[]);
    d.wait_model("clusterbasemodel.m", "Ready");
    d.wait_model("clusterbasemodel.gone", "Ready");
    let before = expected_walk(&[("gone", &src_c), ("m", &src_a)]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while walk(&env.mount) != before {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            walk(&env.mount)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Cached now: a second walk sends no listing request for the model directories.
    let listings = r#"modelfs_fuse_requests_total{op="readdirplus"}"#;
    let first = counters_after_marker(&d, &env.mount, listings);
    assert_eq!(walk(&env.mount), before);
    assert_eq!(counters_after_marker(&d, &env.mount, listings), first);

    env.write_models(
        "m.yaml",
        &[
            cluster_model("m", &uri(&src_b), "AlwaysDownload", Some("team/m")),
            cluster_model("new", &uri(&src_c), "AlwaysDownload", Some("team/new")),
        ]
        .join("---\n"),
    );
    d.wait_gone("clusterbasemodel.gone");
    d.wait_model("clusterbasemodel.new", "Ready");
    let after = expected_walk(&[("m", &src_b), ("new", &src_c)]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while walk(&env.mount) != after {
        assert!(
            std::time::Instant::now() < deadline,
            "the mount still lists {:?}\nwant {:?}",
            walk(&env.mount),
            after
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let ls = |rel: &str| sh(&format!("ls -A '{}'", env.mount.join(rel).display()));
    assert_eq!(ls("team"), "m\nnew\n");
    assert_eq!(ls("team/m"), "config.json\nshards\n");
    assert_eq!(ls("team/m/shards").lines().count(), 30);
    assert_eq!(
        std::fs::read(env.mount.join("team/m/config.json")).unwrap(),
        b"{\"b\": true}"
    );

    // A model only added: no entry of the cached `team` listing changes or goes, so only the
    // directory's own invalidation can make the new one appear.
    env.write_models(
        "z.yaml",
        &cluster_model("z", &uri(&src_a), "AlwaysDownload", Some("team/z")),
    );
    d.wait_model("clusterbasemodel.z", "Ready");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while ls("team") != "m\nnew\nz\n" {
        assert!(
            std::time::Instant::now() < deadline,
            "team still lists {:?}",
            ls("team")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let all = expected_walk(&[("m", &src_b), ("new", &src_c), ("z", &src_a)]);
    assert_eq!(walk(&env.mount), all);
    transport.assert_served(&d);
}

/// A file opened again after its last close reuses the passthrough registration of its inode
/// (no second `FUSE_DEV_IOC_BACKING_OPEN`), and reads the same bytes.
fn reopening_a_file_reuses_its_passthrough_registration_over(transport: Transport) {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 4, 100_000);
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&src), "AlwaysDownload", Some("m")),
    );
    let d = Daemon::start_over(&env, transport, &["--passthrough", "always"]);
    d.wait_model("clusterbasemodel.m", "Ready");
    let rel = "weights/model-00001-of-00002.safetensors";
    let want = std::fs::read(src.join(rel)).unwrap();
    let reuses = "modelfs_passthrough_backing_reuses_total";
    let before = counters_after_marker(&d, &env.mount, reuses);
    for _ in 0..3 {
        assert!(std::fs::read(env.mount.join("m").join(rel)).unwrap() == want);
    }
    let reused = counters_after_marker(&d, &env.mount, reuses) - before;
    assert!(
        reused >= 2.0,
        "{reused} reuses for 3 opens: {}",
        d.metrics()
    );
    transport.assert_served(&d);
}

#[test]
fn every_write_fails_with_erofs() {
    every_write_fails_with_erofs_over(Transport::Dev);
}

#[test]
fn every_write_fails_with_erofs_over_io_uring() {
    every_write_fails_with_erofs_over(Transport::Uring);
}

#[test]
fn safetensors_loads_by_mmap_from_the_mount() {
    safetensors_loads_by_mmap_from_the_mount_over(Transport::Dev);
}

#[test]
fn safetensors_loads_by_mmap_from_the_mount_over_io_uring() {
    safetensors_loads_by_mmap_from_the_mount_over(Transport::Uring);
}

#[test]
fn tree_walks_need_no_lookup_per_file() {
    tree_walks_need_no_lookup_per_file_over(Transport::Dev);
}

#[test]
fn tree_walks_need_no_lookup_per_file_over_io_uring() {
    tree_walks_need_no_lookup_per_file_over(Transport::Uring);
}

#[test]
fn listings_follow_mapping_changes() {
    listings_follow_mapping_changes_over(Transport::Dev);
}

#[test]
fn listings_follow_mapping_changes_over_io_uring() {
    listings_follow_mapping_changes_over(Transport::Uring);
}

#[test]
fn reopening_a_file_reuses_its_passthrough_registration() {
    reopening_a_file_reuses_its_passthrough_registration_over(Transport::Dev);
}

#[test]
fn reopening_a_file_reuses_its_passthrough_registration_over_io_uring() {
    reopening_a_file_reuses_its_passthrough_registration_over(Transport::Uring);
}

/// `--fuse-transport auto` (the default) takes the ring when the kernel offers it; with a
/// keeper, only the rings the keeper makes and polls, which a restart resumes without losing a
/// request (see `tests/takeover.rs`).
#[test]
fn auto_transport_uses_io_uring_when_the_kernel_offers_it() {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 5, 1000);
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&src), "AlwaysDownload", Some("m")),
    );
    let d = Daemon::start(&env, &["--fuse-transport", "auto", "--no-keeper"]);
    d.wait_model("clusterbasemodel.m", "Ready");
    assert_mount_equals_source(&env.mount.join("m"), &src);
    Transport::Uring.assert_served(&d);
    assert!(d.log_text().contains("serving FUSE requests over io_uring"));
    assert!(d.stop(), "clean shutdown");

    let d = Daemon::start(&env, &["--fuse-transport", "auto"]);
    d.wait_model("clusterbasemodel.m", "Ready");
    assert_mount_equals_source(&env.mount.join("m"), &src);
    Transport::Uring.assert_served(&d);
    assert!(d.log_text().contains("the keeper polls the io_uring rings"));
}

/// Python's buffered `open()` asks every file whether it is a terminal (`ioctl(TCGETS)`):
/// where the kernel passes it on, it is answered `ENOTTY` and counted, never logged per
/// request (a loader opening files in a loop once wrote three WARN lines per open); other
/// operations the mount does not implement are counted as `unsupported`, also without a line
/// each. 2,000 opens must not write a line each.
#[test]
fn python_opens_are_answered_without_a_log_line_per_request() {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 10, 1000);
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&src), "AlwaysDownload", Some("m")),
    );
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.m", "Ready");
    let opens = r#"modelfs_fuse_requests_total{op="open"}"#;
    let opens_before = d.metric(opens);
    let lines_before = d.log_text().lines().count();
    let script = "import os, sys\n\
        d = sys.argv[1]\n\
        files = sorted(os.path.join(d, f) for f in os.listdir(d) if os.path.isfile(os.path.join(d, f)))\n\
        for i in range(2000):\n\
        \x20   with open(files[i % len(files)], 'rb') as f:\n\
        \x20       f.read(16)\n";
    let out = std::process::Command::new(python())
        .arg("-c")
        .arg(script)
        .arg(env.mount.join("m"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Counted: the metrics reach the daemon's HTTP side within a report interval.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while d.metric(opens) < opens_before + 2000.0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        d.metric(opens) >= opens_before + 2000.0,
        "2,000 opens counted: {}",
        d.metrics()
    );
    let lines = d.log_text().lines().count() - lines_before;
    assert!(
        lines < 100,
        "{lines} log lines for 2,000 opens; log:\n{}",
        d.log_text()
    );
}

/// A ring thread that fails (once, forced by the debug-build hook `MODELFS_TEST_RING_FAIL`
/// right after it registered its entry) drops its ring, starts again with a new one and
/// registers a new entry on its CPU's queue: a reader pinned to that CPU is served. Without
/// the restart the queue would be left without an entry and every request made on that CPU
/// would wait forever (the reader is killed after a minute, which fails the test).
#[test]
fn a_failed_ring_thread_restarts_and_serves_its_cpu() {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 9, 3 << 20);
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&src), "AlwaysDownload", Some("m")),
    );
    // The last CPU: its queue is the one whose thread fails.
    let cpus = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap();
    let cpu: usize = cpus
        .trim()
        .rsplit(['-', ','])
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let cpu_text = cpu.to_string();
    let d = Daemon::start_with_env(
        &env,
        &["--fuse-transport", "uring", "--passthrough", "never"],
        &[("MODELFS_TEST_RING_FAIL", cpu_text.as_str())],
    );
    d.wait_model("clusterbasemodel.m", "Ready");
    let qid = format!("qid={cpu}");
    let restarted = |log: &str| {
        log.lines().any(|l| {
            l.contains("a failed FUSE ring thread serves again with a new ring") && l.contains(&qid)
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !restarted(&d.log_text()) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = d.log_text();
    assert!(
        log.lines().any(
            |l| l.contains("MODELFS_TEST_RING_FAIL: this FUSE ring thread fails once")
                && l.contains(&qid)
        ),
        "the hook fired: {log}"
    );
    assert!(restarted(&log), "the thread restarted: {log}");
    let want = sh(&format!(
        "cd {} && find . -type f | sort | xargs sha256sum",
        src.display()
    ));
    let got = sh(&format!(
        "cd {} && find . -type f | sort | timeout -s KILL 60 taskset -c {cpu} xargs sha256sum",
        env.mount.join("m").display()
    ));
    assert_eq!(got, want, "read on CPU {cpu} through the mount");
    Transport::Uring.assert_served(&d);
}
