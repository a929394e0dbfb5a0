//! The mapping against real mounts: the path-conflict rule whatever the arrival order and
//! across restarts, and disk reclaimed after deleting a model whose files were open.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::Value;

fn uri(p: &Path) -> String {
    format!("local://{}", p.display())
}

const A: &str = "clusterbasemodel.a";
const B: &str = "clusterbasemodel.b";

/// `a` Ready and `b` Failed because of `a`.
fn a_wins(s: &Value) -> bool {
    s[A]["status"] == "Ready"
        && s[B]["status"] == "Failed"
        && s[B]["reason"]
            .as_str()
            .is_some_and(|r| r.contains(A) && r.contains("different artifact"))
}

#[test]
fn same_path_different_content_in_one_batch_exactly_one_ready_across_restarts() {
    let env = TestEnv::new();
    let src_a = env.dir("src-a");
    make_model_dir(&src_a, 1, 2 << 20);
    let src_b = env.dir("src-b");
    make_model_dir(&src_b, 2, 2 << 20);
    // A fresh node receiving both models at once: one document set, one desired state.
    env.write_models(
        "both.yaml",
        &[
            cluster_model("a", &uri(&src_a), "AlwaysDownload", Some("shared/m")),
            cluster_model("b", &uri(&src_b), "AlwaysDownload", Some("shared/m")),
        ]
        .join("---\n"),
    );
    let d = Daemon::start(&env, &[]);
    d.wait_until(
        "a Ready, b Failed naming a",
        Duration::from_secs(60),
        a_wins,
    );
    let m = env.mount.join("shared/m");
    assert_eq!(contents(&m), contents(&src_a), "the mount serves a's bytes");
    // b's work is over (a loser waits for the rule, not for a timer): nothing fetched into a
    // store of b, so nothing can flip it to Ready later.
    let ready = d
        .status()
        .as_object()
        .unwrap()
        .values()
        .filter(|e| e["status"] == "Ready")
        .count();
    assert_eq!(ready, 1);

    // A restart keeps it so, from the records.
    assert!(d.stop());
    let d = Daemon::start(&env, &[]);
    d.wait_until("a wins after restart", Duration::from_secs(60), a_wins);
    assert_eq!(contents(&m), contents(&src_a));

    // When the winner goes, the loser gets its turn.
    env.write_models(
        "both.yaml",
        &cluster_model("b", &uri(&src_b), "AlwaysDownload", Some("shared/m")),
    );
    d.wait_gone(A);
    d.wait_model(B, "Ready");
    assert_eq!(
        contents(&m),
        contents(&src_b),
        "the mount now serves b's bytes"
    );
}

#[test]
fn records_with_two_served_models_on_one_path_are_repaired_at_restart() {
    let env = TestEnv::new();
    let src_a = env.dir("src-a");
    make_model_dir(&src_a, 3, 1 << 20);
    let src_b = env.dir("src-b");
    make_model_dir(&src_b, 4, 1 << 20);
    let yaml = |b_path: &str| {
        [
            cluster_model("a", &uri(&src_a), "AlwaysDownload", Some("x")),
            cluster_model("b", &uri(&src_b), "AlwaysDownload", Some(b_path)),
        ]
        .join("---\n")
    };
    env.write_models("both.yaml", &yaml("y"));
    let d = Daemon::start(&env, &[]);
    d.wait_model(A, "Ready");
    d.wait_model(B, "Ready");
    assert!(d.stop());

    // What the old, non-atomic rule could persist: b Ready and served at a's path with other
    // bytes, its fingerprint matching its spec (so nothing would ever look at it again).
    let b_yaml = cluster_model("b", &uri(&src_b), "AlwaysDownload", Some("x"));
    let spec = match modelfs_ome::parse_documents(&b_yaml).unwrap().remove(0) {
        modelfs_ome::Document::Model(Ok(object)) => object.to_spec(&env.mount).unwrap(),
        other => panic!("not a model: {other:?}"),
    };
    let records_path = env.state.join("records.json");
    let mut records: Value =
        serde_json::from_slice(&std::fs::read(&records_path).unwrap()).unwrap();
    let b = &mut records["models"][B];
    assert_eq!(b["phase"], "Ready");
    b["path"] = "x".into();
    b["served_path"] = "x".into();
    b["fingerprint"] = modelfs_agent::reconciler::fingerprint(&spec, None).into();
    std::fs::write(&records_path, serde_json::to_vec_pretty(&records).unwrap()).unwrap();
    env.write_models("both.yaml", &yaml("x"));

    let d = Daemon::start(&env, &[]);
    d.wait_until("a wins at restart", Duration::from_secs(60), a_wins);
    assert_eq!(contents(&env.mount.join("x")), contents(&src_a));
    assert!(!env.mount.join("y").exists());
    // And it stays repaired through another restart.
    assert!(d.stop());
    let d = Daemon::start(&env, &[]);
    d.wait_until("a wins again", Duration::from_secs(60), a_wins);
    assert_eq!(contents(&env.mount.join("x")), contents(&src_a));
}

#[test]
fn deleting_a_model_whose_file_is_open_frees_its_store_after_close_without_drop_caches() {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;

    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 5, 4 << 20);
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&src), "AlwaysDownload", None),
    );
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.m", "Ready");
    let stores = env.stores_with_blobs();
    assert_eq!(stores.len(), 1);
    let store = stores[0].clone();

    let model = env.mount.join("m");
    let rel = "weights/model-00001-of-00002.safetensors";
    let want = std::fs::read(src.join(rel)).unwrap();
    let mut file = std::fs::File::open(model.join(rel)).unwrap();
    let mut got = vec![0u8; want.len()];
    let half = want.len() / 2;
    file.read_exact(&mut got[..half]).unwrap();
    // Inodes the kernel can still reach without any open blob: a directory handle (like a
    // process's working directory) and an O_PATH handle of a file.
    let dir = std::fs::File::open(model.join("tokenizer")).unwrap();
    let path_only = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH)
        .open(model.join("config.json"))
        .unwrap();

    env.remove_models("m.yaml");
    d.wait_gone("clusterbasemodel.m");
    assert!(!model.exists(), "the deleted model is gone from the mount");
    // The open file keeps reading the bytes it opened.
    file.read_exact(&mut got[half..]).unwrap();
    assert!(got == want, "bytes of the open file changed after deletion");
    drop(file);

    // Closed: garbage collection removes the store (1 s grace) although the kernel still
    // references inodes of the model, and without any cache pressure.
    d.wait_until("store removed", Duration::from_secs(60), |_| {
        !store.exists()
    });
    assert!(env.stores_with_blobs().is_empty());
    // Nor does the mount server keep a descriptor of a removed blob (a released file's
    // passthrough registration stays only while the mapping still serves its blob).
    let held: Vec<_> = std::fs::read_dir(format!("/proc/{}/fd", d.pid()))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.starts_with(&store))
        .collect();
    assert!(held.is_empty(), "the mount server still holds {held:?}");

    // Those inodes, used after the store is gone: an error, never bytes.
    let opened = rustix::fs::openat(
        &dir,
        "tokenizer.json",
        rustix::fs::OFlags::RDONLY,
        rustix::fs::Mode::empty(),
    );
    let err = std::io::Error::from(opened.expect_err("opened a file of a deleted model"));
    assert!(
        matches!(err.raw_os_error(), Some(libc::ESTALE | libc::ENOENT)),
        "{err}"
    );
    let reopened = std::fs::read(format!("/proc/self/fd/{}", path_only.as_raw_fd()));
    match reopened {
        Ok(bytes) => panic!("read {} bytes through a deleted inode", bytes.len()),
        Err(e) => assert!(
            matches!(e.raw_os_error(), Some(libc::ESTALE | libc::ENOENT)),
            "{e}"
        ),
    }
    assert_eq!(d.get("/healthz").0, 200);
}
