//! Garbage collection: old revisions' blobs, crash leftovers, `modelfs gc`.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

fn uri(p: &Path) -> String {
    format!("local://{}", p.display())
}

fn blob_names(env: &TestEnv) -> Vec<String> {
    let mut out = Vec::new();
    for s in env.stores_with_blobs() {
        for e in std::fs::read_dir(s.join("blobs")).unwrap().flatten() {
            out.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    out.sort();
    out
}

#[test]
fn new_revision_fetches_only_changed_files_and_old_blobs_are_swept() {
    let env = TestEnv::new();
    let v1 = env.dir("v1");
    make_model_dir(&v1, 1, 3 << 20);
    let v2 = env.dir("v2");
    make_model_dir(&v2, 1, 3 << 20);
    // v2 changes one file and adds one; everything else is identical.
    std::fs::write(v2.join("config.json"), b"{\"v\": 2}").unwrap();
    std::fs::write(v2.join("added.txt"), b"added").unwrap();
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&v1), "AlwaysDownload", None),
    );
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.m", "Ready");
    let before = d.metric("modelfs_fetched_bytes_total");
    let v1_blobs = blob_names(&env);

    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&v2), "AlwaysDownload", None),
    );
    d.wait_until("v2 served", Duration::from_secs(30), |_| {
        std::fs::read(env.mount.join("m/added.txt")).is_ok()
    });
    let delta = d.metric("modelfs_fetched_bytes_total") - before;
    assert_eq!(
        delta,
        (b"{\"v\": 2}".len() + b"added".len()) as f64,
        "only changed files are fetched"
    );
    // The old config.json blob is garbage once the grace period has passed.
    d.wait_until("old blob swept", Duration::from_secs(30), |_| {
        blob_names(&env).len() == v1_blobs.len() + 1
    });
    let now = blob_names(&env);
    let v2_tree = tree(&v2);
    assert_eq!(
        now.len(),
        v2_tree
            .values()
            .filter(|v| !v.0)
            .map(|v| v.3.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    );
    for (rel, (is_dir, _, _, sha)) in v2_tree {
        if !is_dir {
            assert!(now.contains(&sha), "{rel}'s blob was swept");
        }
    }
}

#[test]
fn crash_leftovers_are_swept_and_gc_dry_run_lists_without_removing() {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 4, 1 << 20);
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&src), "AlwaysDownload", None),
    );
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.m", "Ready");
    d.kill9();

    // Leftovers of crashes: a store directory no record names, an abandoned partial download in
    // a live store (old mtime), a stray blob, an artifact record nobody holds.
    let stores = env.state.join("stores");
    let live = env.stores_with_blobs()[0].clone();
    std::fs::create_dir_all(stores.join("s99999999/blobs")).unwrap();
    std::fs::write(stores.join("s99999999/blobs/00"), vec![1u8; 100_000]).unwrap();
    let partial = live.join("tmp/sha256-abandoned.part");
    std::fs::write(&partial, vec![2u8; 50_000]).unwrap();
    sh(&format!("touch -d '3 hours ago' '{}'", partial.display()));
    let stray = live.join("blobs").join("ff".repeat(32));
    std::fs::write(&stray, b"stray").unwrap();
    let stray_artifact = env
        .state
        .join("artifacts")
        .join(format!("{}.json", "ab".repeat(32)));
    std::fs::write(&stray_artifact, b"{}").unwrap();

    let out = Command::new(BIN)
        .args(["gc", "--dry-run", "--state"])
        .arg(&env.state)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "orphan store    s99999999",
        "sha256-abandoned.part",
        &"ff".repeat(32),
        &"ab".repeat(32),
    ] {
        assert!(
            listed.contains(needle),
            "dry run misses {needle}:\n{listed}"
        );
    }
    assert!(!listed.contains(&format!(
        "store           {}",
        live.file_name().unwrap().to_string_lossy()
    )));
    assert!(
        stores.join("s99999999").exists() && partial.exists() && stray.exists(),
        "dry run removed something"
    );

    // The restarted daemon sweeps them after its grace period and keeps serving.
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.m", "Ready");
    d.wait_until("leftovers swept", Duration::from_secs(30), |_| {
        !stores.join("s99999999").exists()
            && !partial.exists()
            && !stray.exists()
            && !stray_artifact.exists()
    });
    let want: Vec<_> = contents(&src);
    let got: Vec<_> = contents(&env.mount.join("m"));
    assert_eq!(got, want);

    // `modelfs gc` without --dry-run refuses while the daemon runs.
    let out = Command::new(BIN)
        .args(["gc", "--state"])
        .arg(&env.state)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("another modelfs daemon"));
}
