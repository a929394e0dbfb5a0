//! Standalone mode end to end: placement by policy and scope, manifest changes, crash restart,
//! bad input.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

fn uri(p: &Path) -> String {
    format!("local://{}", p.display())
}

#[test]
fn reuse_shares_one_store_always_downloads_and_namespaces_stay_apart() {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 11, 2 << 20);
    let u = uri(&src);
    let d = Daemon::start(&env, &[]);

    // Two ReuseIfExists models of the same content: one store.
    let yaml = [
        cluster_model("a", &u, "ReuseIfExists", None),
        cluster_model("b", &u, "ReuseIfExists", None),
    ]
    .join("---\n");
    env.write_models("reuse.yaml", &yaml);
    let a = d.wait_model("clusterbasemodel.a", "Ready");
    let b = d.wait_model("clusterbasemodel.b", "Ready");
    assert_eq!(
        env.stores_with_blobs().len(),
        1,
        "two ReuseIfExists models must share one store"
    );
    let parent_of = |e: &serde_json::Value| {
        e["config"]["artifact"]["parentPath"]
            .as_object()
            .unwrap()
            .keys()
            .next()
            .cloned()
            .unwrap()
    };
    assert_eq!(
        parent_of(&a),
        parent_of(&b),
        "both served from the same parent"
    );
    let parent = parent_of(&a);
    let child = if parent == "clusterbasemodel.a" {
        &b
    } else {
        &a
    };
    let parent_entry = if parent == "clusterbasemodel.a" {
        &a
    } else {
        &b
    };
    assert_eq!(
        parent_entry["config"]["artifact"]["childrenPaths"],
        serde_json::json!([child["path"]])
    );
    assert_eq!(
        a["config"]["artifact"]["sha"],
        b["config"]["artifact"]["sha"]
    );

    // Two AlwaysDownload models: two more private copies.
    let yaml = [
        cluster_model("c", &u, "AlwaysDownload", None),
        cluster_model("e", &u, "AlwaysDownload", None),
    ]
    .join("---\n");
    env.write_models("always.yaml", &yaml);
    d.wait_model("clusterbasemodel.c", "Ready");
    d.wait_model("clusterbasemodel.e", "Ready");
    assert_eq!(env.stores_with_blobs().len(), 3);

    // BaseModels: team-x may reuse a ClusterBaseModel's copy; team-y must never map onto
    // team-x's BaseModel copy, even under ReuseIfExists.
    let other = env.dir("other");
    make_model_dir(&other, 99, 1 << 20);
    let yaml = [
        base_model("team-x", "m", &uri(&other), "ReuseIfExists", None),
        base_model("team-y", "m", &uri(&other), "ReuseIfExists", None),
        base_model("team-x", "shared", &u, "ReuseIfExists", None),
    ]
    .join("---\n");
    env.write_models("teams.yaml", &yaml);
    let x = d.wait_model("team-x.basemodel.m", "Ready");
    let y = d.wait_model("team-y.basemodel.m", "Ready");
    let shared = d.wait_model("team-x.basemodel.shared", "Ready");
    assert_eq!(parent_of(&x), "team-x.basemodel.m");
    assert_eq!(parent_of(&y), "team-y.basemodel.m", "cross-namespace reuse");
    assert!(
        parent_of(&shared).starts_with("clusterbasemodel."),
        "a BaseModel reuses a cluster copy"
    );
    assert_eq!(env.stores_with_blobs().len(), 5);
    for m in ["team-x/m", "team-y/m"] {
        assert_eq!(tree(&env.mount.join(m)).len(), tree(&other).len());
    }
}

#[test]
fn manifest_files_add_change_and_delete_models() {
    let env = TestEnv::new();
    let v1 = env.dir("v1");
    let v2 = env.dir("v2");
    make_model_dir(&v1, 1, 100_000);
    make_model_dir(&v2, 2, 150_000);
    std::fs::write(v2.join("only-in-v2.txt"), b"new file").unwrap();
    let d = Daemon::start(&env, &[]);

    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&v1), "AlwaysDownload", None),
    );
    let first = d.wait_model("clusterbasemodel.m", "Ready");
    let sha1 = first["config"]["artifact"]["sha"].clone();
    assert_eq!(tree(&env.mount.join("m")).len(), tree(&v1).len());

    // Change the source: the model flips to the new content once it is imported.
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&v2), "AlwaysDownload", None),
    );
    let second = d.wait_until("new artifact", Duration::from_secs(30), |s| {
        s["clusterbasemodel.m"]["status"] == "Ready"
            && s["clusterbasemodel.m"]["config"]["artifact"]["sha"] != sha1
    });
    assert_eq!(
        std::fs::read(env.mount.join("m/only-in-v2.txt")).unwrap(),
        b"new file"
    );
    let want: Vec<_> = contents(&v2);
    let got: Vec<_> = contents(&env.mount.join("m"));
    assert_eq!(got, want);

    // Rename the file: same model, nothing changes (once the rescan that sees it is done).
    let rescans = d.metric("modelfs_manifest_rescans_total");
    let imported = d.metric("modelfs_fetched_bytes_total");
    std::fs::rename(env.models.join("m.yaml"), env.models.join("renamed.yaml")).unwrap();
    d.wait_until("a rescan after the rename", Duration::from_secs(30), |_| {
        d.metric("modelfs_manifest_rescans_total") > rescans
    });
    let after = d.status();
    assert_eq!(after["clusterbasemodel.m"]["status"], "Ready");
    assert_eq!(
        after["clusterbasemodel.m"]["config"]["artifact"]["sha"],
        second["clusterbasemodel.m"]["config"]["artifact"]["sha"]
    );
    assert_eq!(
        d.metric("modelfs_fetched_bytes_total"),
        imported,
        "nothing imported again"
    );

    // Add a second model in another file, delete the first.
    env.write_models(
        "n.yaml",
        &cluster_model("n", &uri(&v1), "AlwaysDownload", Some("deep/er/n")),
    );
    d.wait_model("clusterbasemodel.n", "Ready");
    assert!(env.mount.join("deep/er/n/config.json").exists());
    env.remove_models("renamed.yaml");
    d.wait_gone("clusterbasemodel.m");
    assert!(!env.mount.join("m").exists(), "deleted model still visible");
    assert!(env.mount.join("deep/er/n/config.json").exists());

    // Everything gone: the stores are collected after the grace period and the state is empty.
    env.remove_models("n.yaml");
    d.wait_gone("clusterbasemodel.n");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !env.stores_with_blobs().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(env.stores_with_blobs().is_empty(), "stores not collected");
    assert_eq!(
        std::fs::read_dir(&env.mount).unwrap().count(),
        0,
        "mount not empty"
    );
}

#[test]
fn sigkill_then_restart_serves_everything_without_reimport() {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 5, 8 << 20);
    let yaml = [
        cluster_model("a", &uri(&src), "AlwaysDownload", None),
        base_model("ns", "b", &uri(&src), "ReuseIfExists", None),
    ]
    .join("---\n");
    env.write_models("m.yaml", &yaml);
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.a", "Ready");
    d.wait_model("ns.basemodel.b", "Ready");
    assert!(d.metric("modelfs_fetched_bytes_total") > 0.0);
    let before = d.status();
    let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(env.mount.join("a")).unwrap());
    d.kill9();

    // The keeper holds the connection: a lookup made while no daemon runs waits for the next
    // one instead of failing (tests/takeover.rs drives a pod through many restarts).
    let path = env.mount.join("a");
    let waiting = std::thread::spawn(move || std::fs::metadata(path));
    let d = Daemon::start(&env, &[]);
    let meta = waiting
        .join()
        .unwrap()
        .expect("answered by the restarted daemon");
    assert_eq!(
        std::os::unix::fs::MetadataExt::ino(&meta),
        ino,
        "the same inode number across the restart"
    );
    let after = d.wait_until("models back", Duration::from_secs(30), |s| {
        s["clusterbasemodel.a"]["status"] == "Ready" && s["ns.basemodel.b"]["status"] == "Ready"
    });
    for k in ["clusterbasemodel.a", "ns.basemodel.b"] {
        assert_eq!(
            after[k]["config"], before[k]["config"],
            "{k}: placement changed across restart"
        );
    }
    assert_eq!(
        d.metric("modelfs_fetched_bytes_total"),
        0.0,
        "something was imported again"
    );
    for m in ["a", "ns/b"] {
        let want: Vec<_> = contents(&src);
        let got: Vec<_> = contents(&env.mount.join(m));
        assert_eq!(got, want, "{m}");
    }
    d.wait_ready();
}

#[test]
fn bad_input_fails_with_a_reason_and_hurts_no_other_model() {
    let env = TestEnv::new();
    let src = env.dir("src");
    let other = env.dir("other");
    make_model_dir(&src, 8, 50_000);
    make_model_dir(&other, 9, 60_000);
    let d = Daemon::start(&env, &[]);
    env.write_models(
        "good.yaml",
        &cluster_model("good", &uri(&src), "AlwaysDownload", Some("good")),
    );
    d.wait_model("clusterbasemodel.good", "Ready");

    env.write_models(
        "broken.yaml",
        "apiVersion: ome.io/v1beta1\nkind: [unclosed\n",
    );
    let no_storage = "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: nostorage\nspec:\n  vendor: x\n";
    let no_uri = "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: nouri\nspec:\n  storage:\n    path: nouri\n";
    let bad_policy = cluster_model("badpolicy", &uri(&src), "Sometimes", None);
    let yaml = [
        no_storage.to_string(),
        no_uri.to_string(),
        bad_policy,
        cluster_model("s3", "github://org/model", "AlwaysDownload", None),
        cluster_model("weird", "ftp://host/model", "AlwaysDownload", None),
        cluster_model("escape", &uri(&src), "AlwaysDownload", Some("../../etc")),
        cluster_model(
            "outside",
            &uri(&src),
            "AlwaysDownload",
            Some("/etc/models/x"),
        ),
        cluster_model("nested", &uri(&other), "AlwaysDownload", Some("good/inner")),
        cluster_model("clash", &uri(&other), "AlwaysDownload", Some("good")),
        cluster_model(
            "missing",
            "local:///nonexistent/dir",
            "AlwaysDownload",
            None,
        ),
    ]
    .join("---\n");
    env.write_models("bad.yaml", &yaml);
    let expect = [
        ("clusterbasemodel.nostorage", "storage"),
        ("clusterbasemodel.nouri", "storageUri"),
        ("clusterbasemodel.badpolicy", "Sometimes"),
        ("clusterbasemodel.s3", "not supported"),
        ("clusterbasemodel.weird", "ftp"),
        ("clusterbasemodel.escape", ".."),
        ("clusterbasemodel.outside", "/etc/models/x"),
        ("clusterbasemodel.nested", "nests"),
        ("clusterbasemodel.clash", "different artifact"),
        ("clusterbasemodel.missing", "does not exist"),
    ];
    for (key, needle) in expect {
        let e = d.wait_model(key, "Failed");
        let reason = e["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains(needle),
            "{key}: reason {reason:?} should mention {needle:?}"
        );
    }
    let s = d.status();
    let file_err = s["file:broken.yaml"]["reason"].as_str().unwrap();
    assert!(
        file_err.contains("line"),
        "a YAML error names its line: {file_err}"
    );
    assert!(
        !file_err.contains("kept"),
        "a new file has no earlier models to keep: {file_err}"
    );
    // A rejected policy is not shown as the default one.
    assert_eq!(s["clusterbasemodel.badpolicy"]["policy"], "", "{s}");
    assert_eq!(s["clusterbasemodel.good"]["status"], "Ready");
    assert_eq!(
        std::fs::read(env.mount.join("good/config.json")).unwrap(),
        std::fs::read(src.join("config.json")).unwrap()
    );
    assert!(!env.mount.join("good/inner").exists());
    assert_eq!(d.get("/healthz").0, 200);

    // A valid file that turns invalid keeps its models: nothing is lost to a typo.
    env.write_models(
        "good.yaml",
        "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata: {name: good\n",
    );
    let s = d.wait_until("file error", Duration::from_secs(10), |s| {
        s.get("file:good.yaml").is_some()
    });
    let kept = s["file:good.yaml"]["reason"].as_str().unwrap();
    assert!(kept.contains("defined before are kept"), "{kept}");
    assert_eq!(d.status()["clusterbasemodel.good"]["status"], "Ready");
    assert!(env.mount.join("good/config.json").exists());

    // The clash resolves once the earlier model goes away.
    env.remove_models("good.yaml");
    d.wait_model("clusterbasemodel.clash", "Ready");
    assert_eq!(
        std::fs::read(env.mount.join("good/config.json")).unwrap(),
        std::fs::read(other.join("config.json")).unwrap()
    );
}

#[test]
fn a_full_disk_fails_the_model_with_a_reason_and_hurts_no_other() {
    let env = TestEnv::new();
    // The state directory on an 8 MiB tmpfs.
    std::fs::create_dir_all(&env.state).unwrap();
    sh(&format!(
        "mount -t tmpfs -o size=8m modelfs-test-tmpfs '{}'",
        env.state.display()
    ));
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _tmpfs = Unmount(env.state.clone());
    let small = env.dir("small");
    make_model_dir(&small, 1, 1 << 20);
    let big = env.dir("big");
    make_model_dir(&big, 2, 20 << 20);
    env.write_models(
        "small.yaml",
        &cluster_model("small", &uri(&small), "AlwaysDownload", None),
    );
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.small", "Ready");

    env.write_models(
        "big.yaml",
        &cluster_model("big", &uri(&big), "AlwaysDownload", None),
    );
    let e = d.wait_model("clusterbasemodel.big", "Failed");
    let reason = e["reason"].as_str().unwrap();
    // Refused before it starts (SPEC 12: it cannot fit), and it waits for space.
    assert!(
        reason.starts_with("InsufficientStorage: needs "),
        "{reason}"
    );
    assert!(reason.ends_with("free under the budget"), "{reason}");
    assert!(!env.mount.join("big").exists());
    // The partial file was discarded: the space is free again for others.
    let partials = sh(&format!(
        "find '{}' -name '*.part' | wc -l",
        env.state.display()
    ));
    assert_eq!(partials.trim(), "0");
    assert_eq!(d.status()["clusterbasemodel.small"]["status"], "Ready");
    let want: Vec<_> = contents(&small);
    let got: Vec<_> = contents(&env.mount.join("small"));
    assert_eq!(got, want);
    assert_eq!(d.get("/healthz").0, 200);
    drop(d);
}

/// The README's quick start serves `examples/models`: it must keep working.
#[test]
fn quick_start_example_serves_both_policies() {
    let env = TestEnv::new();
    // Copy the example (manifests with relative local:// paths, and the tiny model) so the
    // test never writes into the repository.
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    sh(&format!(
        "cp -r '{}' '{}'",
        examples.display(),
        env.root.path().join("examples").display()
    ));
    let models = env.root.path().join("examples/models");
    std::fs::remove_dir_all(&env.models).unwrap();
    std::os::unix::fs::symlink(&models, &env.models).unwrap();
    let d = Daemon::start(&env, &[]);
    let cluster = d.wait_model("clusterbasemodel.tiny-llm", "Ready");
    let a = d.wait_model("team-a.basemodel.tiny-llm", "Ready");
    let b = d.wait_model("team-b.basemodel.tiny-llm", "Ready");
    let parent = |e: &serde_json::Value| {
        e["config"]["artifact"]["parentPath"]
            .as_object()
            .unwrap()
            .keys()
            .next()
            .cloned()
            .unwrap()
    };
    assert_eq!(parent(&cluster), "clusterbasemodel.tiny-llm");
    // The manifest's relative `local://../tiny-model` is shown as the directory it names.
    let source = cluster["source"].as_str().unwrap_or_default();
    assert!(
        source.ends_with("/examples/tiny-model") && !source.contains(".."),
        "{source}"
    );
    // The example's config.json is parsed as OME's agent does: the architecture, and the
    // parameter count from the safetensors header (4x8 weight + 8 bias = 40).
    // It is parsed after the model is Ready: wait for it.
    let doc = d.wait_until("the example's config", Duration::from_secs(60), |doc| {
        doc["clusterbasemodel.tiny-llm"]["config"]
            .get("modelArchitecture")
            .is_some()
    });
    let config = &doc["clusterbasemodel.tiny-llm"]["config"];
    assert_eq!(config["modelArchitecture"], "LlamaForCausalLM", "{config}");
    assert_eq!(config["modelParameterSize"], "40", "{config}");
    assert_eq!(config["maxTokens"], 128, "{config}");
    assert_eq!(
        parent(&a),
        "clusterbasemodel.tiny-llm",
        "team-a reuses the cluster copy"
    );
    assert_eq!(
        parent(&b),
        "team-b.basemodel.tiny-llm",
        "team-b has its own copy"
    );
    assert_eq!(env.stores_with_blobs().len(), 2);
    let src = env.root.path().join("examples/tiny-model");
    for m in ["shared/tiny-llm", "team-a/tiny-llm", "team-b/tiny-llm"] {
        let want: Vec<_> = contents(&src);
        let got: Vec<_> = contents(&env.mount.join(m));
        assert_eq!(got, want, "{m}");
    }
}

/// Rescans of unchanged files parse nothing and log nothing: a broken file is reported once per
/// version (not on every rescan), and a file over the size cap is unusable like a broken one
/// (its previous models are kept).
#[test]
fn unchanged_manifest_files_are_not_parsed_or_reported_again() {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 3, 10_000);
    let d = Daemon::start(&env, &[]);
    env.write_models(
        "kept.yaml",
        &cluster_model("kept", &uri(&src), "AlwaysDownload", None),
    );
    d.wait_model("clusterbasemodel.kept", "Ready");
    env.write_models(
        "broken.yaml",
        "apiVersion: ome.io/v1beta1\nkind: [unclosed\n",
    );
    d.wait_until("broken file reported", Duration::from_secs(30), |s| {
        s.get("file:broken.yaml").is_some()
    });
    let rescans = || d.metric("modelfs_manifest_rescans_total");
    let parses = d.metric("modelfs_manifest_parses_total");
    let warnings = |log: &str| {
        log.lines()
            .filter(|l| l.contains("WARN") && l.contains("broken.yaml"))
            .count()
    };
    assert_eq!(warnings(&d.log_text()), 1, "{}", d.log_text());

    // Five rescans, each triggered by a change elsewhere in the directory (not a manifest).
    let first = rescans();
    for i in 0..5 {
        let before = rescans();
        std::fs::write(env.models.join("notes.txt"), format!("{i}")).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while rescans() <= before {
            assert!(std::time::Instant::now() < deadline, "no rescan");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    // Exactly those (plus at most one periodic backstop rescan): a scan reads the directory,
    // and reading must not count as a change that triggers the next scan.
    assert!(
        rescans() <= first + 6.0,
        "rescans trigger themselves: {} after {first}",
        rescans()
    );
    assert_eq!(
        d.metric("modelfs_manifest_parses_total"),
        parses,
        "unchanged files were parsed again"
    );
    assert_eq!(
        warnings(&d.log_text()),
        1,
        "a broken file is reported once per change:\n{}",
        d.log_text()
    );

    // A changed version is parsed (and reported) again.
    env.write_models(
        "broken.yaml",
        "apiVersion: ome.io/v1beta1\nkind: [still unclosed\n",
    );
    d.wait_until("second version parsed", Duration::from_secs(30), |_| {
        d.metric("modelfs_manifest_parses_total") > parses
    });
    assert_eq!(warnings(&d.log_text()), 2, "{}", d.log_text());

    // Over the size cap (4 MiB): unusable, with a reason; the models it defined stay.
    let mut huge = cluster_model("kept", &uri(&src), "AlwaysDownload", None);
    let padding = format!("# {}\n", "x".repeat(1000));
    while huge.len() <= 4 << 20 {
        huge.push_str(&padding);
    }
    env.write_models("kept.yaml", &huge);
    let s = d.wait_until("size cap reported", Duration::from_secs(30), |s| {
        s.get("file:kept.yaml").is_some()
    });
    let reason = s["file:kept.yaml"]["reason"].as_str().unwrap();
    assert!(
        reason.contains("larger than the limit of 4194304 bytes"),
        "{reason}"
    );
    assert!(reason.contains("defined before are kept"), "{reason}");
    assert_eq!(s["clusterbasemodel.kept"]["status"], "Ready");
    assert!(env.mount.join("kept/config.json").exists());
}

/// On a full disk the records and status files cannot be written: the daemon says so once,
/// keeps its status current in memory, retries with backoff, and says so once more when the
/// writes work again (then both files are current).
#[test]
fn state_writes_on_a_full_disk_back_off_and_recover() {
    let env = TestEnv::new();
    std::fs::create_dir_all(&env.state).unwrap();
    sh(&format!(
        "mount -t tmpfs -o size=4m modelfs-test-tmpfs '{}'",
        env.state.display()
    ));
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _tmpfs = Unmount(env.state.clone());
    let src = env.dir("src");
    make_model_dir(&src, 4, 10_000);
    env.write_models(
        "a.yaml",
        &cluster_model("a", &uri(&src), "AlwaysDownload", None),
    );
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.a", "Ready");

    // Fill the disk.
    let filler = env.state.join("filler");
    let _ = sh(&format!(
        "dd if=/dev/zero of='{}' bs=64k 2>/dev/null || true",
        filler.display()
    ));
    let failures = || d.metric("modelfs_state_write_failures_total");
    // Changes the records: failed models with their reasons. Each one is visible at once.
    for i in 0..3 {
        env.write_models(
            &format!("bad{i}.yaml"),
            &cluster_model(
                &format!("bad{i}"),
                "ftp://nowhere/x",
                "AlwaysDownload",
                None,
            ),
        );
        d.wait_model(&format!("clusterbasemodel.bad{i}"), "Failed");
    }
    // Several failed attempts (backoff 1 s, 2 s, ...).
    d.wait_until("write retries", Duration::from_secs(60), |_| {
        failures() >= 10.0
    });
    let log = d.log_text();
    let lines = |log: &str, needle: &str| log.lines().filter(|l| l.contains(needle)).count();
    assert_eq!(
        lines(&log, "writing failed;"),
        2,
        "one message per file (records.json, status.json):\n{log}"
    );
    let on_disk = std::fs::read_to_string(env.state.join("records.json")).unwrap();
    assert!(!on_disk.contains("bad2"), "the disk was full");

    // Space again: both files catch up without any further change.
    std::fs::remove_file(&filler).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let records = std::fs::read_to_string(env.state.join("records.json")).unwrap();
        let status = std::fs::read_to_string(env.state.join("status.json")).unwrap();
        if records.contains("clusterbasemodel.bad2") && status.contains("clusterbasemodel.bad2") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "state files not caught up:\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = d.log_text();
    assert_eq!(lines(&log, "writing works again"), 2, "{log}");
    assert_eq!(lines(&log, "writing failed;"), 2, "{log}");
    assert_eq!(d.status()["clusterbasemodel.a"]["status"], "Ready");
}

/// A `local://` directory that does not exist yet fails the model with a retry, and the model
/// starts by itself once the directory appears (no manifest change needed).
#[test]
fn a_missing_local_directory_is_retried_and_served_once_created() {
    let env = TestEnv::new();
    let later = env.root.path().join("later");
    let d = Daemon::start(&env, &[]);
    env.write_models(
        "m.yaml",
        &cluster_model("later", &uri(&later), "AlwaysDownload", None),
    );
    let failed = d.wait_model("clusterbasemodel.later", "Failed");
    let reason = failed["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("does not exist"), "{reason}");
    assert!(
        reason.contains("retry"),
        "the reason says it is retried: {reason}"
    );
    // Made elsewhere and renamed in, as a copy tool would, so no import sees half of it.
    let staging = env.dir("staging");
    make_model_dir(&staging, 11, 50_000);
    std::fs::rename(&staging, &later).unwrap();
    d.wait_model("clusterbasemodel.later", "Ready");
    assert_eq!(contents(&env.mount.join("later")), contents(&later));
}

/// `serve` with a `--listen` address another program holds fails at once, names the flag,
/// and mounts nothing (rather than an agent restarted forever under a live mount).
#[test]
fn a_taken_listen_address_fails_serve_before_mounting() {
    let env = TestEnv::new();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let mut child = env
        .serve_command(&addr)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut exit = None;
    wait_for("serve to exit", Duration::from_secs(30), || {
        exit = child.try_wait().unwrap();
        exit.is_some()
    });
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!exit.unwrap().success(), "{stderr}");
    assert!(
        stderr.contains("--listen") && stderr.contains(&addr),
        "{stderr}"
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(env.mount.to_str().unwrap()),
        "nothing is mounted"
    );
    drop(taken);
}

/// The agent's and the keeper's sockets live below `--state` by default; a state directory
/// deeper than a socket address holds (108 bytes) still serves, and a restart still takes the
/// mount over from the keeper through its socket there.
#[test]
fn a_state_directory_deeper_than_a_socket_address_serves_and_restarts() {
    let mut env = TestEnv::new();
    let mut state = env.root.path().join("state");
    while state.as_os_str().len() < 150 {
        state.push("a-rather-long-directory-name");
    }
    env.state = state;
    let own_dir = modelfs_mount::server::own_dir(&env.state);
    assert!(
        modelfs_mount::server::default_socket(&env.state)
            .as_os_str()
            .len()
            > 150
    );
    let src = env.dir("src");
    make_model_dir(&src, 9, 1 << 20);
    env.write_models(
        "m.yaml",
        &cluster_model("a", &uri(&src), "AlwaysDownload", None),
    );
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.a", "Ready");
    assert_eq!(contents(&env.mount.join("a")), contents(&src));
    for socket in ["agent.sock", "keeper.sock"] {
        let meta = std::fs::symlink_metadata(own_dir.join(socket)).unwrap();
        assert!(
            std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()),
            "{socket}"
        );
    }
    // The FUSE connection's device: a fresh mount would get another one.
    let id = |m: &std::fs::Metadata| {
        use std::os::unix::fs::MetadataExt;
        (m.dev(), m.ino())
    };
    let before = id(&std::fs::metadata(env.mount.join("a")).unwrap());
    d.kill9();

    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.a", "Ready");
    let after = id(&std::fs::metadata(env.mount.join("a")).unwrap());
    assert_eq!(
        after,
        before,
        "the same connection, taken over from the keeper; log:\n{}",
        d.log_text()
    );
    assert_eq!(contents(&env.mount.join("a")), contents(&src));
    assert!(d.stop(), "clean shutdown");
}

/// A mount that a keeper holds for a mount server of another state directory answers nothing
/// (nobody serves it, and the connection is alive). A start on it with a new state directory
/// (an operator who wiped the state, or a typo in `--state`) fails with the reason and the way
/// out instead of hanging in its first `statfs`, and leaves the held mount alone: the daemon
/// of the first state directory resumes it afterwards.
#[test]
fn a_start_on_a_mount_held_for_another_state_directory_fails_with_the_reason() {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 31, 1 << 20);
    env.write_models(
        "m.yaml",
        &cluster_model("m", &uri(&src), "AlwaysDownload", Some("m")),
    );
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.m", "Ready");
    assert!(d.hand_on(), "a hand-on exits cleanly");

    let other = env.dir("other-state");
    let log = env.root.path().join("other.log");
    let mut child = std::process::Command::new(BIN)
        .args([
            "serve",
            "--fuse-transport",
            "dev",
            "--listen",
            "127.0.0.1:0",
        ])
        .arg("--mount")
        .arg(&env.mount)
        .arg("--state")
        .arg(&other)
        .arg("--models")
        .arg(&env.models)
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    // Bounded: the probe gives up after its timeout; a hang would keep it here.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "a start on a held mount hangs; log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!status.success(), "it must fail; log:\n{text}");
    assert!(
        text.contains("did not answer within") && text.contains("modelfs unmount --mount"),
        "the reason and the way out are given; log:\n{text}"
    );

    // The held mount is untouched: its own state directory resumes it and serves the model.
    let d = Daemon::start(&env, &[]);
    assert!(
        d.log_text()
            .contains("resumed the FUSE connection of the previous mount server"),
        "log:\n{}",
        d.log_text()
    );
    d.wait_model("clusterbasemodel.m", "Ready");
    assert_eq!(
        std::fs::read(env.mount.join("m/config.json")).unwrap(),
        std::fs::read(src.join("config.json")).unwrap()
    );
    assert!(d.stop());
}
