//! Policy changes T-01..T-04 (SPEC section 3.2) and the lifecycle of section 3.3 on a real mount, with readers
//! looping over every file of the affected models while the change happens.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use serde_json::Value;

fn uri(p: &Path) -> String {
    format!("local://{}", p.display())
}

fn parent(e: &Value) -> String {
    e["config"]["artifact"]["parentPath"]
        .as_object()
        .and_then(|o| o.keys().next().cloned())
        .unwrap_or_default()
}

fn children(e: &Value) -> Vec<String> {
    let mut v: Vec<String> = e["config"]["artifact"]["childrenPaths"]
        .as_array()
        .map(|a| a.iter().map(|x| x.as_str().unwrap().to_string()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

fn fetched(d: &Daemon) -> f64 {
    d.metric("modelfs_fetched_bytes_total")
}

/// A source of `mib` MiB in a few files, so that a copy takes long enough to read during it.
fn source(env: &TestEnv, name: &str, seed: u64, mib: usize) -> PathBuf {
    let src = env.dir(name);
    make_model_dir(&src, seed, mib << 20);
    src
}

fn total_size(src: &Path) -> f64 {
    tree(src).values().map(|v| v.1).sum::<u64>() as f64
}

#[test]
fn t01_child_to_always_download_keeps_serving_then_flips_to_own_copy() {
    let env = TestEnv::new();
    let src = source(&env, "src", 1, 48);
    let u = uri(&src);
    env.write_models(
        "p.yaml",
        &cluster_model("parent", &u, "AlwaysDownload", None),
    );
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.parent", "Ready");
    env.write_models(
        "c.yaml",
        &base_model("ns", "child", &u, "ReuseIfExists", None),
    );
    let c = d.wait_model("ns.basemodel.child", "Ready");
    assert_eq!(parent(&c), "clusterbasemodel.parent");
    let one_copy = total_size(&src);
    assert_eq!(
        fetched(&d),
        one_copy,
        "the child mapped onto the parent: zero bytes"
    );

    let readers = Readers::start(
        &[env.mount.join("ns/child"), env.mount.join("parent")],
        &files_of(&src),
    );
    env.write_models(
        "c.yaml",
        &base_model("ns", "child", &u, "AlwaysDownload", None),
    );
    let s = d.wait_until("child is its own parent", Duration::from_secs(60), |s| {
        parent(&s["ns.basemodel.child"]) == "ns.basemodel.child"
            && s["ns.basemodel.child"]["status"] == "Ready"
    });
    readers.finish();
    assert_eq!(
        fetched(&d),
        2.0 * one_copy,
        "T-01 downloads exactly one more copy"
    );
    assert!(
        children(&s["clusterbasemodel.parent"]).is_empty(),
        "old parent dropped the child"
    );
    assert_eq!(env.stores_with_blobs().len(), 2);
}

#[test]
fn t02_own_copy_to_reuse_flips_at_once_and_releases_the_copy() {
    let env = TestEnv::new();
    let src = source(&env, "src", 2, 16);
    let u = uri(&src);
    let yaml = [
        cluster_model("holder", &u, "AlwaysDownload", None),
        base_model("ns", "m", &u, "AlwaysDownload", None),
    ]
    .join("---\n");
    env.write_models("m.yaml", &yaml);
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.holder", "Ready");
    assert_eq!(
        parent(&d.wait_model("ns.basemodel.m", "Ready")),
        "ns.basemodel.m"
    );
    assert_eq!(env.stores_with_blobs().len(), 2);
    let before = fetched(&d);

    let readers = Readers::start(&[env.mount.join("ns/m")], &files_of(&src));
    let yaml = [
        cluster_model("holder", &u, "AlwaysDownload", None),
        base_model("ns", "m", &u, "ReuseIfExists", None),
    ]
    .join("---\n");
    env.write_models("m.yaml", &yaml);
    let s = d.wait_until("m is a child of holder", Duration::from_secs(30), |s| {
        parent(&s["ns.basemodel.m"]) == "clusterbasemodel.holder"
    });
    readers.finish();
    assert_eq!(fetched(&d), before, "T-02 downloads nothing");
    assert_eq!(
        children(&s["clusterbasemodel.holder"]),
        vec![env.mount.join("ns/m").display().to_string()]
    );
    // The released copy is collected after the grace period.
    d.wait_until("copy collected", Duration::from_secs(30), |_| {
        env.stores_with_blobs().len() == 1
    });

    // With no other holder in scope, the same change is no operation.
    let env2 = TestEnv::new();
    let src2 = source(&env2, "src", 3, 1);
    env2.write_models(
        "m.yaml",
        &base_model("ns", "solo", &uri(&src2), "AlwaysDownload", None),
    );
    let d2 = Daemon::start(&env2, &[]);
    d2.wait_model("ns.basemodel.solo", "Ready");
    let f = fetched(&d2);
    env2.write_models(
        "m.yaml",
        &base_model("ns", "solo", &uri(&src2), "ReuseIfExists", None),
    );
    d2.wait_until("policy applied", Duration::from_secs(30), |s| {
        s["ns.basemodel.solo"]["policy"] == "ReuseIfExists"
    });
    let e = d2.wait_model("ns.basemodel.solo", "Ready");
    assert_eq!(parent(&e), "ns.basemodel.solo");
    assert_eq!(fetched(&d2), f);
    assert_eq!(env2.stores_with_blobs().len(), 1);
}

#[test]
fn t03_parent_to_always_download_is_no_operation() {
    let env = TestEnv::new();
    let src = source(&env, "src", 4, 8);
    let u = uri(&src);
    let yaml = [
        cluster_model("p", &u, "ReuseIfExists", None),
        base_model("ns", "c", &u, "ReuseIfExists", None),
    ]
    .join("---\n");
    env.write_models("m.yaml", &yaml);
    let d = Daemon::start(&env, &[]);
    let c = d.wait_model("ns.basemodel.c", "Ready");
    d.wait_model("clusterbasemodel.p", "Ready");
    assert_eq!(parent(&c), "clusterbasemodel.p");
    let before = fetched(&d);
    let readers = Readers::start(
        &[env.mount.join("p"), env.mount.join("ns/c")],
        &files_of(&src),
    );
    let yaml = [
        cluster_model("p", &u, "AlwaysDownload", None),
        base_model("ns", "c", &u, "ReuseIfExists", None),
    ]
    .join("---\n");
    env.write_models("m.yaml", &yaml);
    let s = d.wait_until("policy applied", Duration::from_secs(30), |s| {
        s["clusterbasemodel.p"]["policy"] == "AlwaysDownload"
            && s["clusterbasemodel.p"]["status"] == "Ready"
    });
    readers.finish();
    assert_eq!(fetched(&d), before);
    assert_eq!(parent(&s["clusterbasemodel.p"]), "clusterbasemodel.p");
    assert_eq!(
        parent(&s["ns.basemodel.c"]),
        "clusterbasemodel.p",
        "children stay mapped"
    );
    assert_eq!(env.stores_with_blobs().len(), 1);
}

#[test]
fn t04_parent_to_reuse_repoints_itself_and_its_children_without_chains() {
    let env = TestEnv::new();
    let src = source(&env, "src", 5, 16);
    let u = uri(&src);
    let holder = cluster_model("z-holder", &u, "AlwaysDownload", None);
    let p_always = cluster_model("a-parent", &u, "AlwaysDownload", None);
    let kids = [
        base_model("ns", "c1", &u, "ReuseIfExists", None),
        base_model("ns", "c2", &u, "ReuseIfExists", None),
    ]
    .join("---\n");
    env.write_models("h.yaml", &holder);
    env.write_models("p.yaml", &p_always);
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.z-holder", "Ready");
    d.wait_model("clusterbasemodel.a-parent", "Ready");
    env.write_models("kids.yaml", &kids);
    for k in ["ns.basemodel.c1", "ns.basemodel.c2"] {
        // Tie on children: the smaller key wins, deterministically.
        assert_eq!(
            parent(&d.wait_model(k, "Ready")),
            "clusterbasemodel.a-parent"
        );
    }
    let before = fetched(&d);
    let dirs: Vec<PathBuf> = ["a-parent", "ns/c1", "ns/c2", "z-holder"]
        .iter()
        .map(|m| env.mount.join(m))
        .collect();
    let readers = Readers::start(&dirs, &files_of(&src));
    env.write_models(
        "p.yaml",
        &cluster_model("a-parent", &u, "ReuseIfExists", None),
    );
    let s = d.wait_until("all re-pointed", Duration::from_secs(30), |s| {
        [
            "clusterbasemodel.a-parent",
            "ns.basemodel.c1",
            "ns.basemodel.c2",
        ]
        .iter()
        .all(|k| parent(&s[*k]) == "clusterbasemodel.z-holder")
    });
    readers.finish();
    assert_eq!(fetched(&d), before, "T-04 downloads nothing");
    let mut want: Vec<String> = ["a-parent", "ns/c1", "ns/c2"]
        .iter()
        .map(|m| env.mount.join(m).display().to_string())
        .collect();
    want.sort();
    assert_eq!(children(&s["clusterbasemodel.z-holder"]), want);
    assert!(
        children(&s["clusterbasemodel.a-parent"]).is_empty(),
        "no chain through the old parent"
    );
    d.wait_until("old copy collected", Duration::from_secs(30), |_| {
        env.stores_with_blobs().len() == 1
    });
}

#[test]
fn open_handles_survive_flips_and_store_release_then_the_bytes_are_freed() {
    let env = TestEnv::new();
    let src = source(&env, "src", 6, 8);
    let u = uri(&src);
    let yaml = [
        cluster_model("holder", &u, "AlwaysDownload", None),
        base_model("ns", "m", &u, "AlwaysDownload", None),
    ]
    .join("---\n");
    env.write_models("m.yaml", &yaml);
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.holder", "Ready");
    d.wait_model("ns.basemodel.m", "Ready");
    let stores_before = env.stores_with_blobs();
    assert_eq!(stores_before.len(), 2);
    let rel = "weights/model-00001-of-00002.safetensors";
    let want = std::fs::read(src.join(rel)).unwrap();
    let open = std::fs::File::open(env.mount.join("ns/m").join(rel)).unwrap();

    // T-02: m moves to holder's store; its own store is released while `open` still reads it.
    let yaml = [
        cluster_model("holder", &u, "AlwaysDownload", None),
        base_model("ns", "m", &u, "ReuseIfExists", None),
    ]
    .join("---\n");
    env.write_models("m.yaml", &yaml);
    d.wait_until("flip", Duration::from_secs(30), |s| {
        parent(&s["ns.basemodel.m"]) == "clusterbasemodel.holder"
    });
    // Collection has run on the flipped state and settled: the store must stay while the file
    // is open (if it were garbage, settling would include its removal after the 1 s grace).
    d.wait_gc_settled(&env.mount.join("holder").join(rel));
    assert_eq!(
        env.stores_with_blobs(),
        stores_before,
        "a store with an open file was collected"
    );
    use std::os::unix::fs::FileExt;
    let mut got = vec![0u8; want.len()];
    open.read_exact_at(&mut got, 0).unwrap();
    assert!(got == want, "an open file changed its bytes after the flip");
    drop(open);
    d.wait_until("released store collected", Duration::from_secs(30), |_| {
        env.stores_with_blobs().len() == 1
    });
}

#[test]
fn deleting_a_parent_hands_its_store_to_a_child_and_deleting_all_empties_the_state() {
    let env = TestEnv::new();
    let src = source(&env, "src", 7, 4);
    let u = uri(&src);
    let d = Daemon::start(&env, &[]);
    let empty_usage = sh(&format!(
        "du -sb '{}' | cut -f1",
        env.state.join("stores").display()
    ));
    env.write_models("p.yaml", &cluster_model("p", &u, "AlwaysDownload", None));
    d.wait_model("clusterbasemodel.p", "Ready");
    let kids = [
        cluster_model("k1", &u, "ReuseIfExists", None),
        cluster_model("k2", &u, "ReuseIfExists", None),
    ]
    .join("---\n");
    env.write_models("kids.yaml", &kids);
    d.wait_model("clusterbasemodel.k1", "Ready");
    d.wait_model("clusterbasemodel.k2", "Ready");
    let readers = Readers::start(
        &[env.mount.join("k1"), env.mount.join("k2")],
        &files_of(&src),
    );
    let before = fetched(&d);
    env.remove_models("p.yaml");
    let s = d.wait_until("ownership handed over", Duration::from_secs(30), |s| {
        s.get("clusterbasemodel.p").is_none()
    });
    readers.finish();
    assert!(
        !env.mount.join("p").exists(),
        "deleted parent still visible"
    );
    assert_eq!(
        parent(&s["clusterbasemodel.k1"]),
        "clusterbasemodel.k1",
        "smallest key takes over"
    );
    assert_eq!(
        parent(&s["clusterbasemodel.k2"]),
        "clusterbasemodel.k1",
        "the other child is re-pointed"
    );
    assert_eq!(
        children(&s["clusterbasemodel.k1"]),
        vec![env.mount.join("k2").display().to_string()]
    );
    assert_eq!(fetched(&d), before, "no bytes moved");
    d.wait_gc_settled(&env.mount.join("k1/config.json"));
    assert_eq!(
        env.stores_with_blobs().len(),
        1,
        "the store stays for the children"
    );

    env.remove_models("kids.yaml");
    d.wait_gone("clusterbasemodel.k1");
    d.wait_gone("clusterbasemodel.k2");
    // Collection removes the stores first and the artifact records after them: wait for both
    // (a timeout here means a store or an artifact record was left behind).
    d.wait_until(
        "stores and artifact records empty",
        Duration::from_secs(30),
        |_| {
            sh(&format!(
                "du -sb '{}' | cut -f1",
                env.state.join("stores").display()
            )) == empty_usage
                && std::fs::read_dir(env.state.join("artifacts"))
                    .unwrap()
                    .count()
                    == 0
        },
    );
}

#[test]
fn reserve_label_keeps_the_store_for_a_later_reuse_model() {
    let env = TestEnv::new();
    let src = source(&env, "src", 8, 4);
    let u = uri(&src);
    let reserved = cluster_model("keep", &u, "AlwaysDownload", None).replace(
        "metadata:\n  name: keep\n",
        "metadata:\n  name: keep\n  labels:\n    models.ome/reserve-model-artifact: \"TRUE\"\n",
    );
    env.write_models("keep.yaml", &reserved);
    let d = Daemon::start(&env, &[]);
    d.wait_model("clusterbasemodel.keep", "Ready");
    let imported = fetched(&d);
    // Collection settled before the deletion, so the next pass is the one that sees it.
    d.wait_gc_settled(&env.mount.join("keep/config.json"));
    let passes = d.gc_passes();
    env.remove_models("keep.yaml");
    d.wait_gone("clusterbasemodel.keep");
    d.wait_gc_settled_since(passes);
    assert_eq!(
        env.stores_with_blobs().len(),
        1,
        "a reserved store was collected"
    );
    // As OME keeps a reserved model's directory, it stays at its path until the store is
    // reused.
    assert_eq!(contents(&env.mount.join("keep")), contents(&src));

    env.write_models(
        "later.yaml",
        &base_model("ns", "later", &u, "ReuseIfExists", None),
    );
    let e = d.wait_model("ns.basemodel.later", "Ready");
    assert_eq!(
        fetched(&d),
        imported,
        "the reserved copy was reused, nothing imported"
    );
    assert_eq!(
        parent(&e),
        "ns.basemodel.later",
        "the model adopts the reserved store"
    );
    assert_eq!(env.stores_with_blobs().len(), 1);
    assert_eq!(tree(&env.mount.join("ns/later")).len(), tree(&src).len());
    wait_for(
        "the reserved path gone once reused",
        Duration::from_secs(30),
        || !env.mount.join("keep").exists(),
    );
}
