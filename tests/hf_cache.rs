//! The Hugging Face cache view (SPEC section 10) read by the real clients, offline:
//! `huggingface_hub` (`snapshot_download`, `hf_hub_download`) and `transformers`
//! (`AutoConfig`, `AutoTokenizer`) resolve model ids from `<mount>/.hf-cache` with
//! `HF_HUB_OFFLINE=1`; the view follows policy flips, a moved branch, a revision change and
//! deletions while a reader resolves ids in a loop.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::hub::*;
use common::*;
use modelfs_devhub::hf::files_from_dir;
use serde_json::Value;

/// Environment of a Python client that may only read the view.
fn offline(cmd: &mut Command, cache: &Path, home: &Path) {
    cmd.env("HF_HUB_CACHE", cache)
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("HF_HOME", home)
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        // Nothing may go to the network: an unroutable endpoint makes any attempt fail loudly.
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .env_remove("HF_TOKEN");
}

fn run_python(script: &str, args: &[&str], cache: &Path, home: &Path) -> Value {
    let mut cmd = Command::new(python());
    cmd.arg("-c").arg(script).args(args);
    offline(&mut cmd, cache, home);
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "python failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

const TINY_MODEL: &str = r#"
import json, os, sys
from tokenizers import Tokenizer, models, pre_tokenizers
d = sys.argv[1]
vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "[PAD]": 3, "hello": 4, "world": 5, "model": 6}
tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.save(os.path.join(d, "tokenizer.json"))
with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]",
               "pad_token": "[PAD]", "model_max_length": 32}, f)
with open(os.path.join(d, "config.json"), "w") as f:
    json.dump({"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 32,
               "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
               "vocab_size": len(vocab), "max_position_embeddings": 32}, f)
print("{}")
"#;

const CLIENTS: &str = r#"
import hashlib, json, os, sys
from huggingface_hub import snapshot_download, hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import LocalEntryNotFoundError
repo, commit = sys.argv[1], sys.argv[2]

def files(root):
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out

def error_of(fn):
    try:
        fn()
        return None
    except Exception as e:
        return type(e).__name__ + ("/LocalEntryNotFoundError" if isinstance(e, LocalEntryNotFoundError) else "")

res = {}
p = snapshot_download(repo, local_files_only=True)
res["snapshot"] = p
res["snapshot_files"] = files(p)
res["snapshot_rev_commit"] = snapshot_download(repo, revision=commit, local_files_only=True)
res["snapshot_rev_main"] = snapshot_download(repo, revision="main", local_files_only=True)
res["snapshot_rev_tag"] = snapshot_download(repo, revision="v1", local_files_only=True)
res["single"] = {}
for name in ["config.json", "tokenizer.json", "weights/model-00001-of-00002.safetensors"]:
    q = hf_hub_download(repo, name)
    with open(q, "rb") as f:
        res["single"][name] = [q, hashlib.sha256(f.read()).hexdigest()]
res["single_at_commit"] = hf_hub_download(repo, "config.json", revision=commit, local_files_only=True)
res["try_to_load"] = try_to_load_from_cache(repo, "config.json")
res["missing_file"] = error_of(lambda: hf_hub_download(repo, "no-such-file.bin"))
res["unknown_snapshot"] = error_of(lambda: snapshot_download("org/not-served", local_files_only=True))
res["unknown_file"] = error_of(lambda: hf_hub_download("org/not-served", "config.json"))
res["unknown_revision"] = error_of(lambda: snapshot_download(repo, revision="v9", local_files_only=True))

from transformers import AutoConfig, AutoTokenizer
cfg = AutoConfig.from_pretrained(repo)
res["config"] = [cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers]
tok = AutoTokenizer.from_pretrained(repo)
res["tokens"] = tok("hello world model")["input_ids"]
res["token_names"] = tok.convert_ids_to_tokens(res["tokens"])
print(json.dumps(res))
"#;

/// A real tiny model (two safetensors shards) read through the view: `AutoConfig` and every
/// tensor through `safe_open` (mmap), compared with the source files.
const PHI: &str = r#"
import json, os, sys
import numpy as np
from huggingface_hub import snapshot_download
from safetensors import safe_open
from transformers import AutoConfig
src = sys.argv[1]
cfg = AutoConfig.from_pretrained("org/phi")
p = snapshot_download("org/phi", local_files_only=True)
same, n = True, 0
for shard in ["model-1-of-2.safetensors", "model-2-of-2.safetensors"]:
    with safe_open(os.path.join(p, shard), "np") as f, safe_open(os.path.join(src, shard), "np") as g:
        if sorted(f.keys()) != sorted(g.keys()):
            same = False
        for k in f.keys():
            n += 1
            same = same and np.array_equal(f.get_tensor(k), g.get_tensor(k))
print(json.dumps({"model_type": cfg.model_type, "snapshot": p, "tensors": n, "same": same}))
"#;

fn in_view(p: &Value, view: &Path) -> PathBuf {
    let p = PathBuf::from(p.as_str().unwrap_or_else(|| panic!("not a path: {p}")));
    assert!(
        p.starts_with(view),
        "{} is not inside {}",
        p.display(),
        view.display()
    );
    p
}

#[test]
fn huggingface_hub_and_transformers_resolve_ids_offline_from_the_view() {
    let hub = TestHub::start(50);
    let env = TestEnv::new();
    let src = env.dir("tiny");
    let home = env.dir("hf-home");
    let made = Command::new(python())
        .arg("-c")
        .arg(TINY_MODEL)
        .arg(&src)
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    std::fs::create_dir_all(src.join("weights")).unwrap();
    std::fs::write(
        src.join("weights/model-00001-of-00002.safetensors"),
        bytes(7, 3 << 20),
    )
    .unwrap();
    std::fs::write(
        src.join("weights/model-00002-of-00002.safetensors"),
        bytes(8, 100_000),
    )
    .unwrap();
    let commit = hub.hub().add_commit(
        "org/tiny",
        &["main", "v1"],
        files_from_dir(&src, 64 << 10).unwrap(),
    );
    let other = env.dir("other");
    make_model_dir(&other, 3, 1 << 20);
    hub.hub().add_commit(
        "org/other",
        &["main"],
        files_from_dir(&other, 64 << 10).unwrap(),
    );

    // The real two-shard Phi model of the fixtures, read with transformers; without the
    // fixtures that part is skipped (one line says so) and the rest runs.
    let phi = modelfs_test_fixtures::require(
        "huggingface_hub_and_transformers_resolve_ids_offline_from_the_view (its Phi model part)",
        "hf-configs/tiny-random-PhiModel",
    );
    if let Some(phi) = &phi {
        hub.hub()
            .add_commit("org/phi", &["main"], files_from_dir(phi, 64 << 10).unwrap());
    }

    let mut models = vec![];
    if phi.is_some() {
        models.push(cluster_model("phi", "hf://org/phi", "AlwaysDownload", None));
    }
    env.write_models(
        "m.yaml",
        &models
            .into_iter()
            .chain([
                cluster_model("tiny", "hf://org/tiny", "AlwaysDownload", None),
                cluster_model("tiny-v1", "hf://org/tiny@v1", "AlwaysDownload", None),
                base_model(
                    "team",
                    "tiny",
                    &format!("hf://org/tiny@{commit}"),
                    "ReuseIfExists",
                    None,
                ),
                cluster_model("other", "hf://org/other", "AlwaysDownload", Some("o/other")),
                cluster_model(
                    "squatter",
                    "hf://org/other",
                    "ReuseIfExists",
                    Some(".hf-cache/models--org--other"),
                ),
            ])
            .collect::<Vec<_>>()
            .join("---\n"),
    );
    let d = start_daemon(&env, &hub);
    if phi.is_some() {
        d.wait_model("clusterbasemodel.phi", "Ready");
    }
    for k in [
        "clusterbasemodel.tiny",
        "clusterbasemodel.tiny-v1",
        "team.basemodel.tiny",
        "clusterbasemodel.other",
    ] {
        d.wait_model(k, "Ready");
    }
    let squatter = d.wait_model("clusterbasemodel.squatter", "Failed");
    assert!(
        squatter["reason"]
            .as_str()
            .unwrap()
            .contains("--hf-cache-dir"),
        "{squatter}"
    );

    let view = env.mount.join(".hf-cache");
    let repo_dir = view.join("models--org--tiny");
    let mut snapshots: Vec<String> = std::fs::read_dir(repo_dir.join("snapshots"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    snapshots.sort();
    assert_eq!(
        snapshots,
        std::slice::from_ref(&commit),
        "three models, one commit, one snapshot"
    );
    for r in ["main", "v1"] {
        assert_eq!(
            std::fs::read_to_string(repo_dir.join("refs").join(r)).unwrap(),
            commit
        );
    }
    assert!(
        !repo_dir.join("refs").join(&commit).exists(),
        "a commit pin needs no ref"
    );
    assert_eq!(
        contents(&repo_dir.join("snapshots").join(&commit)),
        contents(&src)
    );
    assert_eq!(
        contents(
            &view
                .join("models--org--other/snapshots")
                .join(std::fs::read_to_string(view.join("models--org--other/refs/main")).unwrap())
        ),
        contents(&other)
    );

    let res = run_python(CLIENTS, &["org/tiny", &commit], &view, &home);
    let snapshot = in_view(&res["snapshot"], &view);
    assert_eq!(snapshot, repo_dir.join("snapshots").join(&commit));
    let want = files_of(&src);
    let got: BTreeMap<String, String> =
        serde_json::from_value(res["snapshot_files"].clone()).unwrap();
    assert_eq!(got, want, "snapshot_download bytes equal the source");
    for k in [
        "snapshot_rev_commit",
        "snapshot_rev_main",
        "snapshot_rev_tag",
    ] {
        assert_eq!(in_view(&res[k], &view), snapshot, "{k}");
    }
    for (name, [path, sha]) in
        serde_json::from_value::<BTreeMap<String, [Value; 2]>>(res["single"].clone()).unwrap()
    {
        assert_eq!(in_view(&path, &view), snapshot.join(&name));
        assert_eq!(sha.as_str().unwrap(), want[&name], "{name}");
    }
    assert_eq!(
        in_view(&res["single_at_commit"], &view),
        snapshot.join("config.json")
    );
    assert_eq!(
        in_view(&res["try_to_load"], &view),
        snapshot.join("config.json")
    );
    for k in [
        "missing_file",
        "unknown_snapshot",
        "unknown_file",
        "unknown_revision",
    ] {
        let e = res[k]
            .as_str()
            .unwrap_or_else(|| panic!("{k}: no error: {res}"));
        assert!(e.ends_with("/LocalEntryNotFoundError"), "{k}: {e}");
    }
    assert_eq!(res["config"], serde_json::json!(["bert", 32, 2]));
    assert_eq!(res["tokens"], serde_json::json!([4, 5, 6]));
    assert_eq!(
        res["token_names"],
        serde_json::json!(["hello", "world", "model"])
    );

    if let Some(phi) = &phi {
        let res = run_python(PHI, &[phi.to_str().unwrap()], &view, &home);
        assert_eq!(res["model_type"], "phi", "{res}");
        in_view(&res["snapshot"], &view);
        assert!(res["tensors"].as_u64().unwrap() > 0, "{res}");
        assert_eq!(
            res["same"], true,
            "tensors read through the view differ: {res}"
        );
    }

    // Nothing was written to the view or fetched again.
    assert!(std::fs::write(repo_dir.join("refs/main"), b"x").is_err());
    let log = d.log_text();
    assert!(!log.contains("mapping update refused"));
    assert!(
        !log.contains("passthrough open failed"),
        "ref files are served like blobs"
    );

    // After a restart with another view directory, a served model whose path now lies in it
    // fails with the reason, and the view is rebuilt there from the records.
    assert!(d.stop());
    let flags = hf_flags(&hub);
    let mut flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    flags.extend(["--hf-cache-dir", "o"]);
    let d = Daemon::start(&env, &flags);
    let e = d.wait_model("clusterbasemodel.other", "Failed");
    assert!(
        e["reason"].as_str().unwrap().contains("--hf-cache-dir"),
        "{e}"
    );
    d.wait_until("view at o", Duration::from_secs(30), |_| {
        std::fs::read_to_string(env.mount.join("o/models--org--tiny/refs/main")).ok()
            == Some(commit.clone())
    });
    assert!(!repo_dir.exists());
    let res = run_python(CLIENTS, &["org/tiny", &commit], &env.mount.join("o"), &home);
    assert_eq!(res["config"], serde_json::json!(["bert", 32, 2]));

    // An empty --hf-cache-dir turns the view off.
    assert!(d.stop());
    let flags = hf_flags(&hub);
    let mut flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    flags.push("--hf-cache-dir=");
    let d = Daemon::start(&env, &flags);
    d.wait_model("clusterbasemodel.other", "Ready");
    d.wait_model("clusterbasemodel.tiny", "Ready");
    assert_eq!(contents(&env.mount.join("o/other")), contents(&other));
    assert!(!env.mount.join("o/models--org--tiny").exists());
    assert!(!repo_dir.exists());
    // Without a view, its former directory is an ordinary model path.
    d.wait_model("clusterbasemodel.squatter", "Ready");
    assert_eq!(contents(&view.join("models--org--other")), contents(&other));
}

/// A reader in a loop: resolves the id (`snapshot_download` and `hf_hub_download`), checks
/// every byte against the commit it resolved to, until `stop` exists. Errors are failures,
/// except `LocalEntryNotFoundError` once `deleted` exists.
const READER: &str = r#"
import hashlib, json, os, sys, time
from huggingface_hub import snapshot_download, hf_hub_download
from huggingface_hub.errors import LocalEntryNotFoundError
repo, expected_path, stop, deleted, out = sys.argv[1:6]
with open(expected_path) as f:
    expected = json.load(f)
passes, errors, seen, not_found = 0, [], set(), 0
while not os.path.exists(stop) and len(errors) < 20:
    gone = os.path.exists(deleted)
    try:
        p = snapshot_download(repo, local_files_only=True)
        commit = os.path.basename(p)
        want = expected.get(commit)
        if want is None:
            errors.append(f"unknown commit {commit}")
            continue
        got = {}
        for d, _, names in os.walk(p):
            for n in names:
                q = os.path.join(d, n)
                with open(q, "rb") as f:
                    got[os.path.relpath(q, p)] = hashlib.sha256(f.read()).hexdigest()
        if got != want:
            errors.append(f"{commit}: snapshot differs: {sorted(set(got.items()) ^ set(want.items()))[:4]}")
        q = hf_hub_download(repo, "config.json")
        c = os.path.basename(os.path.dirname(q))
        with open(q, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != expected[c]["config.json"]:
                errors.append(f"{c}: config.json differs")
        seen.add(commit)
        passes += 1
    except LocalEntryNotFoundError as e:
        if gone:
            not_found += 1
            time.sleep(0.01)
        else:
            errors.append(f"not found before deletion: {e}")
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")
with open(out, "w") as f:
    json.dump({"passes": passes, "errors": errors, "seen": sorted(seen), "not_found": not_found}, f)
"#;

struct Reader {
    child: Child,
    stop: PathBuf,
    out: PathBuf,
}

impl Reader {
    fn finish(mut self) -> Value {
        std::fs::write(&self.stop, b"").unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "reader exited with {status}");
        serde_json::from_str(&std::fs::read_to_string(&self.out).unwrap()).unwrap()
    }
}

fn parent(e: &Value) -> String {
    e["config"]["artifact"]["parentPath"]
        .as_object()
        .and_then(|o| o.keys().next().cloned())
        .unwrap_or_default()
}

#[test]
fn view_follows_flips_revisions_and_deletion_without_reader_errors() {
    let hub = TestHub::start(50);
    let env = TestEnv::new();
    let v1 = env.dir("v1");
    make_model_dir(&v1, 11, 1 << 20);
    let v2 = env.dir("v2");
    make_model_dir(&v2, 11, 1 << 20);
    std::fs::write(v2.join("config.json"), b"{\"v\": 2}").unwrap();
    std::fs::write(v2.join("added.txt"), b"new in v2").unwrap();
    let c1 = hub
        .hub()
        .add_commit("org/m", &["main"], files_from_dir(&v1, 64 << 10).unwrap());

    let uri = "hf://org/m";
    env.write_models(
        "z.yaml",
        &cluster_model("z-holder", uri, "ReuseIfExists", None),
    );
    let flags = hf_flags(&hub);
    let mut flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    flags.extend(["--hf-cache-linger-secs", "3"]);
    let d = Daemon::start(&env, &flags);
    d.wait_model("clusterbasemodel.z-holder", "Ready");
    env.write_models(
        "p.yaml",
        &cluster_model("a-parent", uri, "AlwaysDownload", None),
    );
    d.wait_model("clusterbasemodel.a-parent", "Ready");
    let kids = |p1: &str| {
        [
            base_model("ns", "k1", uri, p1, None),
            base_model("ns", "k2", uri, "ReuseIfExists", None),
        ]
        .join("---\n")
    };
    env.write_models("kids.yaml", &kids("ReuseIfExists"));
    for k in ["ns.basemodel.k1", "ns.basemodel.k2"] {
        assert_eq!(
            parent(&d.wait_model(k, "Ready")),
            "clusterbasemodel.a-parent"
        );
    }

    let view = env.mount.join(".hf-cache");
    let repo_dir = view.join("models--org--m");
    let expected = env.root.path().join("expected.json");
    // c2 is published later; its expected files are known now.
    let c2 = hub.hub().add_commit(
        "org/m",
        &["v2-staging"],
        files_from_dir(&v2, 64 << 10).unwrap(),
    );
    std::fs::write(
        &expected,
        serde_json::to_vec(&serde_json::json!({ &c1: files_of(&v1), &c2: files_of(&v2) })).unwrap(),
    )
    .unwrap();
    let (stop, deleted, out) = (
        env.root.path().join("stop"),
        env.root.path().join("deleted"),
        env.root.path().join("reader.json"),
    );
    let mut cmd = Command::new(python());
    cmd.arg("-c")
        .arg(READER)
        .arg("org/m")
        .arg(&expected)
        .arg(&stop)
        .arg(&deleted)
        .arg(&out);
    offline(&mut cmd, &view, &env.dir("hf-home"));
    let reader = Reader {
        child: cmd.stdin(Stdio::null()).spawn().unwrap(),
        stop,
        out,
    };
    let path_readers = Readers::start(&[env.mount.join("a-parent")], &files_of(&v1));

    // T-04: the parent (and its children) move to the holder.
    env.write_models(
        "p.yaml",
        &cluster_model("a-parent", uri, "ReuseIfExists", None),
    );
    d.wait_until("T-04", Duration::from_secs(30), |s| {
        [
            "clusterbasemodel.a-parent",
            "ns.basemodel.k1",
            "ns.basemodel.k2",
        ]
        .iter()
        .all(|k| parent(&s[*k]) == "clusterbasemodel.z-holder")
    });
    // T-01: a child downloads its own copy and flips to it.
    env.write_models("kids.yaml", &kids("AlwaysDownload"));
    d.wait_until("T-01", Duration::from_secs(60), |s| {
        parent(&s["ns.basemodel.k1"]) == "ns.basemodel.k1"
    });
    // T-02: it gives its copy up again.
    env.write_models("kids.yaml", &kids("ReuseIfExists"));
    d.wait_until("T-02", Duration::from_secs(30), |s| {
        parent(&s["ns.basemodel.k1"]) == "clusterbasemodel.z-holder"
    });
    // T-03: the holder (a parent under ReuseIfExists) asks for AlwaysDownload: no change.
    env.write_models(
        "z.yaml",
        &cluster_model("z-holder", uri, "AlwaysDownload", None),
    );
    d.wait_until("T-03", Duration::from_secs(30), |s| {
        s["clusterbasemodel.z-holder"]["policy"] == "AlwaysDownload"
            && parent(&s["clusterbasemodel.z-holder"]) == "clusterbasemodel.z-holder"
    });
    path_readers.finish();
    assert_eq!(
        std::fs::read_to_string(repo_dir.join("refs/main")).unwrap(),
        c1
    );

    // The branch moves: a new model resolving `main` gets c2, and the ref follows it (newest
    // resolution) while c1 stays served for the others.
    hub.hub()
        .add_commit("org/m", &["main"], files_from_dir(&v2, 64 << 10).unwrap());
    env.write_models(
        "y.yaml",
        &cluster_model("y-new", uri, "AlwaysDownload", None),
    );
    let e = d.wait_model("clusterbasemodel.y-new", "Ready");
    assert_eq!(e["config"]["artifact"]["sha"], c2.as_str());
    assert_eq!(
        std::fs::read_to_string(repo_dir.join("refs/main")).unwrap(),
        c2
    );
    let mut snaps: Vec<String> = std::fs::read_dir(repo_dir.join("snapshots"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    snaps.sort();
    let mut both = vec![c1.clone(), c2.clone()];
    both.sort();
    assert_eq!(snaps, both);

    // A revision change: the parent pins c2. The ref does not move; c1 is still served.
    env.write_models(
        "p.yaml",
        &cluster_model(
            "a-parent",
            &format!("hf://org/m@{c2}"),
            "ReuseIfExists",
            None,
        ),
    );
    d.wait_until("a-parent on c2", Duration::from_secs(30), |s| {
        s["clusterbasemodel.a-parent"]["config"]["artifact"]["sha"] == c2.as_str()
    });
    assert_eq!(
        contents(&repo_dir.join("snapshots").join(&c2)),
        contents(&v2)
    );

    // Deletion: everything serving c2 goes; the ref falls back to... nothing newer: c1.
    env.remove_models("y.yaml");
    env.remove_models("p.yaml");
    d.wait_gone("clusterbasemodel.y-new");
    d.wait_gone("clusterbasemodel.a-parent");
    assert_eq!(
        std::fs::read_to_string(repo_dir.join("refs/main")).unwrap(),
        c1
    );
    // The c2 snapshot lingers for readers that resolved it, then leaves.
    d.wait_until("c2 snapshot gone", Duration::from_secs(30), |_| {
        !repo_dir.join("snapshots").join(&c2).exists()
    });

    // Every model of the repository goes: its id stops resolving.
    std::fs::write(env.root.path().join("deleted"), b"").unwrap();
    env.remove_models("kids.yaml");
    env.remove_models("z.yaml");
    d.wait_gone("clusterbasemodel.z-holder");
    assert!(!repo_dir.join("refs/main").exists());
    d.wait_until("view empty", Duration::from_secs(30), |_| {
        !repo_dir.exists()
    });
    // Lingering snapshots held their stores; once they are gone, so is every blob.
    d.wait_until("every store collected", Duration::from_secs(30), |_| {
        env.stores_with_blobs().is_empty()
    });
    let res = reader.finish();
    assert_eq!(res["errors"], serde_json::json!([]), "{res}");
    assert!(res["passes"].as_u64().unwrap() > 0, "{res}");
    assert_eq!(res["seen"], serde_json::json!(both), "{res}");
    assert!(res["not_found"].as_u64().unwrap() > 0, "{res}");
}
