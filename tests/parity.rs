//! OME parity of the sources whose files are already on the node or in the serving image,
//! end to end through the real daemon and its FUSE mount: `vendor://` and `local://` models
//! whose `storage.path` lies outside the models root are `Ready` with OME's entry and nothing
//! served (the pod binds that node directory itself).

mod common;

use std::time::Duration;

use common::hub::TestHub;
use common::*;
use modelfs_devhub::hf::files_from_dir;

/// `vendor://` with OME's own documentation example (a path under `/opt/models`, here a
/// directory outside the models root) and `local://` with its directory outside the root:
/// `Ready`, the status path is the node directory, nothing is added to the mount, and the
/// node directory is left as it was. A `local://` directory that does not exist yet fails the
/// model with OME's reason and is retried, so it becomes `Ready` once it is created.
#[test]
fn models_whose_files_are_outside_the_models_root_are_ready_and_serve_nothing() {
    let env = TestEnv::new();
    let node = env.dir("opt-models");
    let local_dir = node.join("llama-local");
    make_model_dir(&local_dir, 7, 1 << 16);
    let before = contents(&local_dir);
    let later = node.join("later");
    let vendor_dir = node.join("vendor-llama");
    let local_uri = format!("local://{}", local_dir.display());
    let later_uri = format!("local://{}", later.display());
    env.write_models(
        "models.yaml",
        &[
            cluster_model(
                "vend",
                "vendor://nvidia/llama-3",
                "AlwaysDownload",
                Some(vendor_dir.to_str().unwrap()),
            ),
            cluster_model(
                "loc",
                &local_uri,
                "AlwaysDownload",
                Some(local_dir.to_str().unwrap()),
            ),
            cluster_model(
                "later",
                &later_uri,
                "AlwaysDownload",
                Some(later.to_str().unwrap()),
            ),
        ]
        .join("---\n"),
    );
    let d = Daemon::start(&env, &["--allow-local-sources"]);
    let vend = d.wait_model("clusterbasemodel.vend", "Ready");
    assert_eq!(vend["path"], vendor_dir.to_str().unwrap(), "{vend}");
    let loc = d.wait_model("clusterbasemodel.loc", "Ready");
    assert_eq!(loc["path"], local_dir.to_str().unwrap(), "{loc}");
    assert!(
        loc["config"]["artifact"]["parentPath"]
            .as_object()
            .is_none_or(|p| p.is_empty()),
        "nothing served: {loc}"
    );
    let missing = d.wait_model("clusterbasemodel.later", "Failed");
    let reason = missing["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains(&format!(
            "local model path does not exist: {}",
            later.display()
        )),
        "{reason}"
    );

    // Nothing in the mount, nothing fetched, no store; the node directories are untouched.
    let listed: Vec<_> = std::fs::read_dir(&env.mount)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(listed.is_empty(), "the mount shows {listed:?}");
    assert_eq!(d.metric("modelfs_fetched_bytes_total"), 0.0);
    assert!(env.stores_with_blobs().is_empty());
    assert_eq!(contents(&local_dir), before);
    assert!(!vendor_dir.exists(), "nothing is created at a vendor path");

    // The missing directory appears: the model is retried and becomes Ready by itself.
    make_model_dir(&later, 8, 1 << 10);
    d.wait_until(
        "the created local directory is Ready",
        Duration::from_secs(120),
        |doc| doc["clusterbasemodel.later"]["status"] == "Ready",
    );
    assert!(d.stop(), "clean shutdown");
}

/// `vendor://` below the models root: `Ready`, and its path is an empty read-only directory in
/// the mount, so a runtime that binds it or creates it (`mkdir -p`) starts; writing into it is
/// refused. A served model beside it is unaffected, and the directory goes with the model.
#[test]
fn a_vendor_model_below_the_models_root_is_an_empty_read_only_directory() {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 3, 1 << 12);
    let local_uri = format!("local://{}", src.display());
    env.write_models(
        "vendor.yaml",
        &cluster_model(
            "vend",
            "vendor://nvidia/llama-3",
            "AlwaysDownload",
            Some("vendors/llama"),
        ),
    );
    env.write_models(
        "served.yaml",
        &cluster_model("plain", &local_uri, "AlwaysDownload", Some("vendors/plain")),
    );
    let d = Daemon::start(&env, &["--allow-local-sources"]);
    d.wait_model("clusterbasemodel.vend", "Ready");
    d.wait_model("clusterbasemodel.plain", "Ready");
    let dir = env.mount.join("vendors/llama");
    wait_for("the vendor directory", Duration::from_secs(30), || {
        dir.is_dir()
    });
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "empty");
    std::fs::create_dir_all(&dir).expect("mkdir -p of an existing directory succeeds");
    let write = std::fs::write(dir.join("x"), b"x").unwrap_err();
    assert_eq!(
        write.raw_os_error(),
        Some(rustix::io::Errno::ROFS.raw_os_error()),
        "{write}"
    );
    assert_eq!(contents(&env.mount.join("vendors/plain")), contents(&src));

    env.remove_models("vendor.yaml");
    d.wait_gone("clusterbasemodel.vend");
    wait_for("the vendor directory gone", Duration::from_secs(30), || {
        !dir.exists()
    });
    assert_eq!(contents(&env.mount.join("vendors/plain")), contents(&src));
    assert!(d.stop(), "clean shutdown");
}

fn reserved_model(name: &str, uri: &str, policy: &str, path: &str) -> String {
    format!(
        "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: {name}\n  labels:\n    models.ome/reserve-model-artifact: \"true\"\nspec:\n  storage:\n    storageUri: {uri}\n    downloadPolicy: {policy}\n    path: {path}\n"
    )
}

/// A reserved model (`models.ome/reserve-model-artifact: "true"`) that is deleted keeps its
/// directory at its path, read-only with the same files, as OME keeps it on disk; once a model
/// reuses the reserved store elsewhere, the old path goes.
#[test]
fn a_deleted_reserved_models_directory_stays_until_its_store_is_reused() {
    let env = TestEnv::new();
    let src = env.dir("src");
    make_model_dir(&src, 11, 1 << 14);
    let uri = format!("local://{}", src.display());
    env.write_models(
        "kept.yaml",
        &reserved_model("kept", &uri, "AlwaysDownload", "keep/llama"),
    );
    let d = Daemon::start(&env, &["--allow-local-sources"]);
    d.wait_model("clusterbasemodel.kept", "Ready");
    let kept = env.mount.join("keep/llama");
    assert_eq!(contents(&kept), contents(&src));

    env.remove_models("kept.yaml");
    d.wait_gone("clusterbasemodel.kept");
    // Past the grace period and a garbage collection pass, the directory is still served.
    let passes = d.gc_passes();
    d.wait_gc_settled_since(passes);
    assert_eq!(
        contents(&kept),
        contents(&src),
        "the reserved directory stays"
    );
    let write = std::fs::write(kept.join("new"), b"x").unwrap_err();
    assert_eq!(
        write.raw_os_error(),
        Some(rustix::io::Errno::ROFS.raw_os_error()),
        "{write}"
    );

    // Reused by a model at another path: the store is that model's now; the old path goes.
    env.write_models(
        "user.yaml",
        &cluster_model("user", &uri, "ReuseIfExists", Some("elsewhere/llama")),
    );
    d.wait_model("clusterbasemodel.user", "Ready");
    assert_eq!(contents(&env.mount.join("elsewhere/llama")), contents(&src));
    wait_for("the reserved path gone", Duration::from_secs(30), || {
        !kept.exists()
    });
    assert_eq!(env.stores_with_blobs().len(), 1, "one store, reused");
    assert!(d.stop(), "clean shutdown");
}

/// OME's agent reads the hub endpoint from `ENDPOINT`: with `HF_ENDPOINT` empty and no flag,
/// modelfs downloads from the hub `ENDPOINT` names.
#[test]
fn the_hub_endpoint_comes_from_omes_endpoint_variable() {
    let hub = TestHub::start(50);
    let env = TestEnv::new();
    let repo = env.dir("repo");
    make_model_dir(&repo, 5, 1 << 16);
    hub.hub()
        .add_commit("org/m", &["main"], files_from_dir(&repo, 64 << 10).unwrap());
    env.write_models(
        "m.yaml",
        &cluster_model("m", "hf://org/m", "AlwaysDownload", None),
    );
    let url = hub.running.url();
    let d = Daemon::start_with_env(
        &env,
        &["--hf-retry-base-ms", "20"],
        &[("HF_ENDPOINT", ""), ("ENDPOINT", url.as_str())],
    );
    d.wait_model("clusterbasemodel.m", "Ready");
    assert_eq!(contents(&env.mount.join("m")), contents(&repo));
    assert!(hub.hub().stats().bytes_served > 0);
    assert!(d.stop(), "clean shutdown");
}
