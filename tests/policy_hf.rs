//! Policy changes against the loopback Hugging Face hub: what the hub serves during T-01, T-02
//! and T-04 (SPEC section 3.2), and the access check before a gated copy is shared (section 3.1).

mod common;

use std::path::Path;
use std::time::Duration;

use common::hub::*;
use common::*;
use modelfs_devhub::hf::files_from_dir;

fn parent(e: &serde_json::Value) -> String {
    e["config"]["artifact"]["parentPath"]
        .as_object()
        .and_then(|o| o.keys().next().cloned())
        .unwrap_or_default()
}

fn same_tree(a: &Path, b: &Path) {
    assert_eq!(
        contents(a),
        contents(b),
        "{} differs from {}",
        a.display(),
        b.display()
    );
}

/// A repository on the hub made of a generated directory (LFS above 64 KiB). Returns the
/// directory and the repository's size in bytes.
fn publish(env: &TestEnv, hub: &TestHub, repo: &str, seed: u64) -> (std::path::PathBuf, u64) {
    let dir = env.dir(&format!("repo-{seed}"));
    make_model_dir(&dir, seed, 6 << 20);
    hub.hub()
        .add_commit(repo, &["main"], files_from_dir(&dir, 64 << 10).unwrap());
    let size = tree(&dir).values().map(|v| v.1).sum();
    (dir, size)
}

fn served(hub: &TestHub) -> u64 {
    hub.hub().stats().bytes_served
}

#[test]
fn hub_bytes_for_t01_t02_t04() {
    let hub = TestHub::start(50);
    let env = TestEnv::new();
    let (dir, size) = publish(&env, &hub, "org/m", 1);
    let uri = "hf://org/m";
    env.write_models(
        "holder.yaml",
        &cluster_model("z-holder", uri, "AlwaysDownload", None),
    );
    let d = start_daemon(&env, &hub);
    d.wait_model("clusterbasemodel.z-holder", "Ready");
    assert_eq!(served(&hub), size, "one copy for the holder");

    // A parent with two children, next to the holder.
    env.write_models(
        "p.yaml",
        &cluster_model("a-parent", uri, "AlwaysDownload", None),
    );
    d.wait_model("clusterbasemodel.a-parent", "Ready");
    let kids = [
        base_model("ns", "c1", uri, "ReuseIfExists", None),
        base_model("ns", "c2", uri, "ReuseIfExists", None),
    ]
    .join("---\n");
    env.write_models("kids.yaml", &kids);
    for k in ["ns.basemodel.c1", "ns.basemodel.c2"] {
        assert_eq!(
            parent(&d.wait_model(k, "Ready")),
            "clusterbasemodel.a-parent"
        );
    }
    assert_eq!(served(&hub), 2 * size, "children download nothing");

    let want = files_of(&dir);
    let dirs: Vec<std::path::PathBuf> = ["z-holder", "a-parent", "ns/c1", "ns/c2"]
        .iter()
        .map(|m| env.mount.join(m))
        .collect();

    // T-04: the parent and its children move to the holder; the hub serves nothing.
    let readers = Readers::start(&dirs, &want);
    env.write_models(
        "p.yaml",
        &cluster_model("a-parent", uri, "ReuseIfExists", None),
    );
    d.wait_until("T-04", Duration::from_secs(30), |s| {
        [
            "clusterbasemodel.a-parent",
            "ns.basemodel.c1",
            "ns.basemodel.c2",
        ]
        .iter()
        .all(|k| parent(&s[*k]) == "clusterbasemodel.z-holder")
    });
    readers.finish();
    assert_eq!(served(&hub), 2 * size, "T-04 served bytes");

    // T-01: a child asks for its own copy: exactly one more copy is served.
    let readers = Readers::start(&dirs, &want);
    env.write_models(
        "kids.yaml",
        &[
            base_model("ns", "c1", uri, "AlwaysDownload", None),
            base_model("ns", "c2", uri, "ReuseIfExists", None),
        ]
        .join("---\n"),
    );
    d.wait_until("T-01", Duration::from_secs(60), |s| {
        parent(&s["ns.basemodel.c1"]) == "ns.basemodel.c1"
    });
    readers.finish();
    assert_eq!(served(&hub), 3 * size, "T-01 serves one copy");

    // T-02: that copy is given up again for the holder's: nothing served.
    let readers = Readers::start(&dirs, &want);
    env.write_models(
        "kids.yaml",
        &[
            base_model("ns", "c1", uri, "ReuseIfExists", None),
            base_model("ns", "c2", uri, "ReuseIfExists", None),
        ]
        .join("---\n"),
    );
    d.wait_until("T-02", Duration::from_secs(30), |s| {
        parent(&s["ns.basemodel.c1"]) == "clusterbasemodel.z-holder"
    });
    readers.finish();
    assert_eq!(served(&hub), 3 * size, "T-02 served bytes");
    for m in ["z-holder", "a-parent", "ns/c1", "ns/c2"] {
        same_tree(&env.mount.join(m), &dir);
    }
    d.wait_until("one store left", Duration::from_secs(30), |_| {
        env.stores_with_blobs().len() == 1
    });
}

#[test]
fn gated_copy_is_shared_only_with_models_whose_token_passes() {
    const TOKEN: &str = "hf_GatedTokenForTests_91ab";
    let hub = TestHub::start(50);
    let env = TestEnv::new();
    let (dir, size) = publish(&env, &hub, "org/gated", 2);
    hub.hub().set_gated("org/gated", TOKEN);
    let with_token = |yaml: String| {
        yaml.replace(
            "    storageUri:",
            &format!("    parameters:\n      token: {TOKEN}\n    storageUri:"),
        )
    };
    env.write_models(
        "owner.yaml",
        &with_token(cluster_model(
            "owner",
            "hf://org/gated",
            "AlwaysDownload",
            None,
        )),
    );
    let d = start_daemon(&env, &hub);
    d.wait_model("clusterbasemodel.owner", "Ready");

    // Same artifact, ReuseIfExists, but no token: never mapped onto the owner's copy.
    env.write_models(
        "thief.yaml",
        &base_model("ns", "thief", "hf://org/gated", "ReuseIfExists", None),
    );
    let e = d.wait_model("ns.basemodel.thief", "Failed");
    let reason = e["reason"].as_str().unwrap();
    assert!(
        reason.contains("401") || reason.contains("Gated"),
        "{reason}"
    );
    assert!(
        !env.mount.join("ns/thief").exists(),
        "content handed to a model without access"
    );
    assert!(!d.log_text().contains(TOKEN), "token in the log");

    // With the token it maps onto the copy: nothing more is served.
    env.write_models(
        "thief.yaml",
        &with_token(base_model(
            "ns",
            "thief",
            "hf://org/gated",
            "ReuseIfExists",
            None,
        )),
    );
    let e = d.wait_model("ns.basemodel.thief", "Ready");
    assert_eq!(parent(&e), "clusterbasemodel.owner");
    assert_eq!(served(&hub), size);
    same_tree(&env.mount.join("ns/thief"), &dir);
    assert!(!std::fs::read_to_string(env.state.join("status.json"))
        .unwrap()
        .contains(TOKEN));
    assert!(!std::fs::read_to_string(env.state.join("records.json"))
        .unwrap()
        .contains(TOKEN));
}
