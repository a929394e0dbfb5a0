//! OME parity in Kubernetes mode, end to end: the real `modelfs` binary with a real FUSE mount,
//! the in-process fake API server (finalizers and deletionTimestamp as the real one), kube's
//! real client playing OME's BaseModel controller, and the loopback Hugging Face hub.

mod common;
mod fake_apiserver;
mod kube_common;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{files_of, make_model_dir, only_child, Readers};
use fake_apiserver::FakeApiServer;
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube_common::*;
use modelfs_devhub::hf::files_from_dir;
use modelfs_ome::ModelKind;
use serde_json::{json, Value};

const EVENTS: &str = "apis/events.k8s.io/v1/events";
/// OME's finalizers (pkg/constants: BaseModelFinalizer, ClusterBaseModelFinalizer).
const BASE_MODEL_FINALIZER: &str = "basemodels.ome.io/finalizer";
const CLUSTER_BASE_MODEL_FINALIZER: &str = "clusterbasemodels.ome.io/finalizer";

impl Daemon {
    fn get(&self, path: &str) -> (u16, String) {
        common::http_get(&self.listen, path).expect("daemon answers")
    }
}

fn node() -> Value {
    json!({"metadata": {"name": NODE, "labels": {"gpu": "h100"}}})
}

/// OME's BaseModel and ClusterBaseModel controllers, as far as deletion goes
/// (pkg/controller/v1beta1/basemodel): every model gets the kind's finalizer (an Update of the
/// object); an object with a deletionTimestamp keeps it until no model-status ConfigMap in
/// `ome` has the model's key (or only an entry marked `Deleted`), then the finalizer is
/// removed with an Update.
struct OmeController {
    client: kube::Client,
    finalizers_removed: Arc<AtomicU64>,
}

impl OmeController {
    fn spawn(client: kube::Client) -> (tokio::task::JoinHandle<()>, Arc<AtomicU64>) {
        let finalizers_removed = Arc::new(AtomicU64::new(0));
        let controller = OmeController {
            client,
            finalizers_removed: finalizers_removed.clone(),
        };
        let task = tokio::spawn(async move {
            loop {
                controller.pass().await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        (task, finalizers_removed)
    }

    async fn pass(&self) {
        let configmaps: Api<k8s_openapi::api::core::v1::ConfigMap> =
            Api::namespaced(self.client.clone(), "ome");
        let Ok(status_maps) = configmaps
            .list(&ListParams::default().labels("models.ome/basemodel-status=true"))
            .await
        else {
            return;
        };
        for (kind, finalizer) in [
            (ModelKind::BaseModel, BASE_MODEL_FINALIZER),
            (ModelKind::ClusterBaseModel, CLUSTER_BASE_MODEL_FINALIZER),
        ] {
            let resource = modelfs_agent::kubernetes::producer::model_resource(kind);
            let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &resource);
            let Ok(objects) = api.list(&ListParams::default()).await else {
                continue;
            };
            for mut object in objects {
                let name = object.metadata.name.clone().unwrap_or_default();
                let namespace = object.metadata.namespace.clone();
                let scoped: Api<DynamicObject> = match &namespace {
                    Some(ns) => Api::namespaced_with(self.client.clone(), ns, &resource),
                    None => Api::all_with(self.client.clone(), &resource),
                };
                let finalizers = object.metadata.finalizers.get_or_insert_with(Vec::new);
                let has = finalizers.iter().any(|f| f == finalizer);
                if object.metadata.deletion_timestamp.is_none() {
                    if !has {
                        finalizers.push(finalizer.to_owned());
                        // A conflict is retried on the next pass, as controller-runtime does.
                        let _ = scoped.replace(&name, &PostParams::default(), &object).await;
                    }
                    continue;
                }
                if !has {
                    continue;
                }
                let key = match &namespace {
                    Some(ns) => format!("{ns}.basemodel.{name}"),
                    None => format!("clusterbasemodel.{name}"),
                };
                let still_held = status_maps.items.iter().any(|cm| {
                    cm.data
                        .as_ref()
                        .and_then(|d| d.get(&key))
                        .is_some_and(|entry| {
                            serde_json::from_str::<Value>(entry)
                                .map(|e| e["status"] != "Deleted")
                                .unwrap_or(true)
                        })
                });
                if still_held {
                    continue;
                }
                finalizers.retain(|f| f != finalizer);
                if scoped
                    .replace(&name, &PostParams::default(), &object)
                    .await
                    .is_ok()
                {
                    self.finalizers_removed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

fn has_finalizer(object: &Value, finalizer: &str) -> bool {
    object["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|list| list.iter().any(|f| f == finalizer))
}

fn read_all(file: &mut std::fs::File) -> Vec<u8> {
    use std::io::Seek;
    file.seek(std::io::SeekFrom::Start(0)).unwrap();
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).unwrap();
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deletion_with_omes_finalizers_for_models_parents_and_children() {
    let server = FakeApiServer::start().await;
    let data = tempfile::tempdir().unwrap();
    let sources: Vec<PathBuf> = (0..3)
        .map(|i| {
            let dir = data.path().join(format!("src{i}"));
            make_model_dir(&dir, 70 + i, 2 << 20);
            dir
        })
        .collect();
    let uri = |i: usize| format!("local://{}", sources[i].display());
    server.put(NODES, node());
    // Plain models of both kinds.
    server.put(CBM, cluster_model("solo", json!({"storageUri": uri(0)})));
    server.put(
        BM,
        base_model("team", "solo", json!({"storageUri": uri(1)})),
    );
    // A ClusterBaseModel parent with two children (a ClusterBaseModel and a BaseModel), and a
    // BaseModel parent with a BaseModel child, all of one artifact.
    server.put(CBM, cluster_model("parent", json!({"storageUri": uri(2)})));
    let reuse = json!({"storageUri": uri(2), "downloadPolicy": "ReuseIfExists"});
    server.put(CBM, cluster_model("child", reuse.clone()));
    server.put(BM, base_model("team", "child", reuse.clone()));
    server.put(
        BM,
        base_model("lab", "bparent", json!({"storageUri": uri(2)})),
    );
    server.put(BM, base_model("lab", "bchild", reuse.clone()));

    let daemon = start_daemon(&server, &["--allow-local-sources"], &[]);
    let (controller, finalizers_removed) = OmeController::spawn(server.client().await);
    let mnt = daemon.mount.clone();
    for key in [
        "clusterbasemodel.solo",
        "team.basemodel.solo",
        "clusterbasemodel.parent",
        "clusterbasemodel.child",
        "team.basemodel.child",
        "lab.basemodel.bparent",
        "lab.basemodel.bchild",
    ] {
        wait_status(&server, key, "Ready").await;
    }
    // The controller has put its finalizer on every model.
    wait_for("finalizers on every model", || {
        let all: Vec<(Value, &str)> = server
            .list(BM)
            .into_iter()
            .map(|o| (o, BASE_MODEL_FINALIZER))
            .chain(
                server
                    .list(CBM)
                    .into_iter()
                    .map(|o| (o, CLUSTER_BASE_MODEL_FINALIZER)),
            )
            .collect();
        (all.len() == 7 && all.iter().all(|(o, f)| has_finalizer(o, f))).then_some(())
    })
    .await;
    let parent_key = "clusterbasemodel.parent";
    let entry = entries(&server)[parent_key].clone();
    let children_paths = entry["config"]["artifact"]["childrenPaths"].to_string();
    for child in ["mnt/child\"", "mnt/team/child\""] {
        assert!(children_paths.contains(child), "{entry}");
    }

    // 1. Plain models: DELETE only sets deletionTimestamp; the daemon unserves the model and
    // removes its key and label; the controller then removes its finalizer; the object goes.
    let solo_want = files_of(&sources[0]);
    let (solo_rel, solo_sha) = solo_want.iter().next().unwrap();
    let mut open_file = std::fs::File::open(mnt.join("solo").join(solo_rel)).unwrap();
    for (resource, namespace, name, key, label) in [
        (
            CBM,
            "",
            "solo",
            "clusterbasemodel.solo",
            "models.ome.io/clusterbasemodel.solo",
        ),
        (
            BM,
            "team",
            "solo",
            "team.basemodel.solo",
            "models.ome.io/team.basemodel.solo",
        ),
    ] {
        let answered = server.delete(resource, namespace, name).unwrap();
        assert!(answered["metadata"]["deletionTimestamp"].is_string());
        assert!(server.get(resource, namespace, name).is_some());
        wait_for(&format!("{key} object gone"), || {
            server
                .get(resource, namespace, name)
                .is_none()
                .then_some(())
        })
        .await;
        assert!(!entries(&server).contains_key(key));
        assert!(!node_labels(&server).contains_key(label));
    }
    assert!(
        !mnt.join("solo").exists(),
        "the deleted model's path is gone"
    );
    assert!(!mnt.join("team/solo").exists());
    // A file opened before the deletion keeps reading its bytes.
    use sha2::Digest;
    assert_eq!(
        hex::encode(sha2::Sha256::digest(read_all(&mut open_file))),
        *solo_sha
    );
    drop(open_file);
    wait_for("Deleted events", || {
        let events = server.list(EVENTS);
        let deleted = |kind: &str| {
            events.iter().any(|e| {
                e["reason"] == "Deleted"
                    && e["regarding"]["kind"] == kind
                    && e["regarding"]["name"] == "solo"
            })
        };
        (deleted("ClusterBaseModel") && deleted("BaseModel")).then_some(())
    })
    .await;

    // 2. Parents with children: the children keep reading their files throughout; the
    // parent's path disappears; ownership passes to a child; no byte moves.
    let want = files_of(&sources[2]);
    let children = [
        mnt.join("child"),
        mnt.join("team/child"),
        mnt.join("lab/bchild"),
    ];
    let readers = Readers::start(&children, &want);
    let fetched_before = fetched_bytes(&daemon.listen).await;
    server.delete(CBM, "", "parent").unwrap();
    wait_for("the ClusterBaseModel parent gone", || {
        server.get(CBM, "", "parent").is_none().then_some(())
    })
    .await;
    assert!(!mnt.join("parent").exists());
    let e = entries(&server);
    assert!(!e.contains_key(parent_key));
    // Every former child is still Ready, served from a copy another model owns now.
    for key in [
        "clusterbasemodel.child",
        "team.basemodel.child",
        "lab.basemodel.bchild",
    ] {
        assert_eq!(e[key]["status"], "Ready", "{key}: {}", e[key]);
        let parent = e[key]["config"]["artifact"]["parentPath"]
            .as_object()
            .unwrap()
            .keys()
            .next()
            .cloned()
            .unwrap();
        assert_ne!(parent, parent_key, "{key}");
    }
    server.delete(BM, "lab", "bparent").unwrap();
    wait_for("the BaseModel parent gone", || {
        server.get(BM, "lab", "bparent").is_none().then_some(())
    })
    .await;
    assert!(!mnt.join("lab/bparent").exists());
    assert!(!entries(&server).contains_key("lab.basemodel.bparent"));
    assert_eq!(
        status_of(&server, "lab.basemodel.bchild").as_deref(),
        Some("Ready")
    );
    readers.finish();
    // Finally two of the children themselves; the last one keeps its files.
    for (resource, namespace, name) in [(CBM, "", "child"), (BM, "team", "child")] {
        server.delete(resource, namespace, name).unwrap();
    }
    for (resource, namespace, name) in [(CBM, "", "child"), (BM, "team", "child")] {
        wait_for(&format!("{namespace}/{name} gone"), || {
            server
                .get(resource, namespace, name)
                .is_none()
                .then_some(())
        })
        .await;
    }
    assert!(!mnt.join("child").exists());
    assert_eq!(files_of(&mnt.join("lab/bchild")), want);
    assert_eq!(
        fetched_bytes(&daemon.listen).await,
        fetched_before,
        "deleting parents moved or fetched bytes"
    );
    assert_eq!(finalizers_removed.load(Ordering::Relaxed), 6);

    // 3. A deletion while no daemon runs is completed by the next one at start.
    drop(daemon);
    server.delete(BM, "lab", "bchild").unwrap();
    assert!(entries(&server).contains_key("lab.basemodel.bchild"));
    let restarted = start_daemon(&server, &["--allow-local-sources"], &[]);
    wait_for("lab/bchild gone after the restart", || {
        server.get(BM, "lab", "bchild").is_none().then_some(())
    })
    .await;
    assert!(!entries(&server).contains_key("lab.basemodel.bchild"));
    assert!(!node_labels(&server).contains_key("models.ome.io/lab.basemodel.bchild"));
    assert_eq!(finalizers_removed.load(Ordering::Relaxed), 7);
    controller.abort();
    drop(restarted);
}

async fn fetched_bytes(listen: &str) -> u64 {
    metric_sum(listen, "modelfs_fetched_bytes").await
}

async fn metrics_text(listen: &str) -> String {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::get(format!("http://{listen}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

async fn metric_sum(listen: &str, prefix: &str) -> u64 {
    metrics_text(listen)
        .await
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Standard base64, for Secret data.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn secret(namespace: &str, name: &str, entry: &str, token: &str) -> Value {
    json!({"metadata": {"name": name, "namespace": namespace},
        "data": {entry: base64(token.as_bytes())}})
}

const GATED_TOKEN: &str = "hf_GatedGood_4242abcd";
const ENV_TOKEN: &str = "hf_EnvToken_7373efgh";
const WRONG_TOKEN: &str = "hf_WrongToken_9191ijkl";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schemes_tokens_and_ome_metrics() {
    assert_eq!(base64(b"token!"), "dG9rZW4h");
    assert_eq!(base64(b"ab"), "YWI=");
    let server = FakeApiServer::start().await;
    let data = tempfile::tempdir().unwrap();
    let hub = modelfs_devhub::hf::Hub::new(modelfs_devhub::hf::HubConfig::default());
    let mut repos: BTreeMap<&str, PathBuf> = BTreeMap::new();
    for (i, repo) in ["gpt2", "org/public", "org/gated", "org/gated-env"]
        .into_iter()
        .enumerate()
    {
        let dir = data.path().join(format!("repo{i}"));
        make_model_dir(&dir, 90 + i as u64, 1 << 20);
        hub.add_commit(repo, &["main"], files_from_dir(&dir, 1 << 10).unwrap());
        repos.insert(repo, dir);
    }
    hub.set_gated("org/gated", GATED_TOKEN);
    hub.set_gated("org/gated-env", ENV_TOKEN);
    let running = hub
        .clone()
        .serve("127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();

    server.put(NODES, node());
    server.put("api/v1/secrets", secret("team", "hf", "token", GATED_TOKEN));
    server.put(
        "api/v1/secrets",
        secret("team", "hf-custom", "hf_token", GATED_TOKEN),
    );
    // A ClusterBaseModel's Secret is read in the daemon's namespace, not in another one.
    server.put(
        "api/v1/secrets",
        secret("ome", "cluster-hf", "token", GATED_TOKEN),
    );
    server.put(
        "api/v1/secrets",
        secret("team", "cluster-hf", "token", WRONG_TOKEN),
    );
    let hf = |repo: &str| json!({"storageUri": format!("hf://{repo}")});
    let with = |mut storage: Value, extra: Value| {
        for (k, v) in extra.as_object().unwrap() {
            storage[k] = v.clone();
        }
        storage
    };
    server.put(CBM, cluster_model("single", hf("gpt2")));
    server.put(
        CBM,
        cluster_model("vendor", json!({"storageUri": "vendor://nvidia/llama"})),
    );
    server.put(
        CBM,
        cluster_model("claim", json!({"storageUri": "pvc://models/llama"})),
    );
    server.put(
        CBM,
        cluster_model(
            "cluster-secret",
            with(hf("org/gated"), json!({"key": "cluster-hf"})),
        ),
    );
    for (name, storage) in [
        ("from-secret", with(hf("org/gated"), json!({"key": "hf"}))),
        (
            "secret-wins",
            with(
                hf("org/gated"),
                json!({"key": "hf-custom",
                    "parameters": {"secretKey": "hf_token", "token": WRONG_TOKEN}}),
            ),
        ),
        (
            "inline",
            with(
                hf("org/gated"),
                json!({"parameters": {"token": GATED_TOKEN}}),
            ),
        ),
        ("from-env", hf("org/gated-env")),
        (
            "missing-public",
            with(hf("org/public"), json!({"key": "absent"})),
        ),
        (
            "missing-gated",
            with(hf("org/gated"), json!({"key": "absent"})),
        ),
        (
            "wrong",
            with(
                hf("org/gated"),
                json!({"parameters": {"token": WRONG_TOKEN}}),
            ),
        ),
    ] {
        server.put(BM, base_model("team", name, storage));
    }

    let url = running.url();
    let daemon = start_daemon(
        &server,
        &["--hf-endpoint", &url, "--hf-retry-base-ms", "20"],
        &[("HF_TOKEN", ENV_TOKEN)],
    );
    let mnt = daemon.mount.clone();
    for (key, repo) in [
        ("clusterbasemodel.single", "gpt2"),
        ("clusterbasemodel.cluster-secret", "org/gated"),
        ("team.basemodel.from-secret", "org/gated"),
        ("team.basemodel.secret-wins", "org/gated"),
        ("team.basemodel.inline", "org/gated"),
        ("team.basemodel.from-env", "org/gated-env"),
        ("team.basemodel.missing-public", "org/public"),
    ] {
        let entry = wait_status(&server, key, "Ready").await;
        let path = entry["path"].as_str().unwrap();
        assert_eq!(files_of(Path::new(path)), files_of(&repos[repo]), "{key}");
    }
    // vendor://: Ready with no files, as OME; below the models root its path is an empty
    // directory, so a pod binding it starts.
    let vendor = wait_status(&server, "clusterbasemodel.vendor", "Ready").await;
    let dir = mnt.join("vendor");
    assert!(dir.is_dir(), "{vendor}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "{vendor}");
    // A gated repository without a usable token fails with the hub's reason.
    for key in ["team.basemodel.missing-gated", "team.basemodel.wrong"] {
        let entry = wait_status(&server, key, "Failed").await;
        let reason = entry["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains("403") && reason.contains("GatedRepo"),
            "{key}: {reason}"
        );
    }
    wait_for("labels", || {
        let labels = node_labels(&server);
        (labels
            .get("models.ome.io/clusterbasemodel.vendor")
            .map(String::as_str)
            == Some("Ready")
            && labels
                .get("models.ome.io/team.basemodel.wrong")
                .map(String::as_str)
                == Some("Failed"))
        .then_some(())
    })
    .await;
    // pvc:// is not the node agent's: no entry, no label (written in the same passes as the
    // entries above).
    assert!(!entries(&server).contains_key("clusterbasemodel.claim"));
    assert!(!node_labels(&server)
        .keys()
        .any(|label| label.contains("claim")));
    // A missing Secret is a warning and an Event, not a failure.
    wait_for("TokenSecretUnavailable events", || {
        let events = server.list(EVENTS);
        let warned = |name: &str| {
            events.iter().any(|e| {
                e["reason"] == "TokenSecretUnavailable"
                    && e["type"] == "Warning"
                    && e["regarding"]["name"] == name
                    && e["note"]
                        .as_str()
                        .is_some_and(|n| n.contains("team/absent"))
            })
        };
        (warned("missing-public") && warned("missing-gated")).then_some(())
    })
    .await;
    assert!(daemon.log_text().contains("token Secret unusable"));

    // OME's metric names beside modelfs's own.
    let metrics = metrics_text(&daemon.listen).await;
    for line in [
        "model_agent_downloads_success_total{model_type=\"ClusterBaseModel\",namespace=\"\",name=\"single\"} 1",
        "model_agent_verifications_total{model_type=\"BaseModel\",namespace=\"team\",name=\"inline\",result=\"success\"} 1",
        "model_agent_download_duration_seconds_count{model_type=\"BaseModel\",namespace=\"team\",name=\"from-env\"} 1",
        // At least once (a new failure may get one more attempt).
        "model_agent_downloads_failed_total{model_type=\"BaseModel\",namespace=\"team\",name=\"wrong\"} ",
        "modelfs_fetched_bytes_total{scheme=\"Hf\"}",
        "model_agent_verification_duration_seconds_count ",
    ] {
        assert!(metrics.contains(line), "{line} missing from:\n{metrics}");
    }
    let single_bytes: u64 = metrics
        .lines()
        .find(|l| l.starts_with("model_agent_download_bytes_total{model_type=\"ClusterBaseModel\",namespace=\"\",name=\"single\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap();
    let repo_bytes: u64 = files_of(&repos["gpt2"])
        .keys()
        .map(|p| std::fs::metadata(repos["gpt2"].join(p)).unwrap().len())
        .sum();
    assert_eq!(single_bytes, repo_bytes);

    // No token text anywhere: ConfigMap, labels, Events, status, metrics, log.
    let (_, models) = daemon.get("/v1/models");
    let places = [
        (
            "ConfigMap",
            server.get(CM, "ome", NODE).unwrap().to_string(),
        ),
        ("Node", server.get(NODES, "", NODE).unwrap().to_string()),
        ("Events", Value::from(server.list(EVENTS)).to_string()),
        ("/v1/models", models),
        ("/metrics", metrics),
        ("daemon log", daemon.log_text()),
    ];
    for (place, text) in &places {
        for token in [GATED_TOKEN, ENV_TOKEN, WRONG_TOKEN] {
            assert!(!text.contains(token), "a token appears in the {place}");
        }
    }

    // A downloaded model whose source becomes vendor:// stays Ready and serves no files.
    assert!(mnt.join("single").exists());
    server.merge(
        CBM,
        "",
        "single",
        &json!({"spec": {"storage": {"storageUri": "vendor://openai/gpt2"}}}),
    );
    wait_for("single served by its vendor", || {
        let e = entries(&server).get("clusterbasemodel.single").cloned()?;
        (e["status"] == "Ready"
            && e["source"] == "vendor://openai/gpt2"
            && e["config"]["artifact"]["sha"] == "")
            .then_some(())
    })
    .await;
    // Its files leave; the path stays as an empty directory (vendor below the models root).
    wait_for("single's files gone", || {
        let dir = mnt.join("single");
        (dir.is_dir() && std::fs::read_dir(&dir).ok()?.count() == 0).then_some(())
    })
    .await;
    drop(daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn progress_is_written_with_omes_phases_at_the_configured_interval() {
    let server = FakeApiServer::start().await;
    let data = tempfile::tempdir().unwrap();
    let dir = data.path().join("big");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), b"{\"model_type\":\"llama\"}").unwrap();
    std::fs::write(dir.join("weights.bin"), common::bytes(5, 3 << 20)).unwrap();
    let hub = modelfs_devhub::hf::Hub::new(modelfs_devhub::hf::HubConfig::default());
    hub.add_commit("org/big", &["main"], files_from_dir(&dir, 1 << 10).unwrap());
    // About six seconds of download.
    hub.add_fault(modelfs_devhub::hf::Fault {
        kind: modelfs_devhub::hf::FaultKind::Slow {
            bytes_per_sec: 512 << 10,
        },
        count: 1000,
        path: Some("weights".into()),
        target: modelfs_devhub::hf::FaultTarget::File,
    });
    let running = hub
        .clone()
        .serve("127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();
    server.put(NODES, node());
    server.put(
        CBM,
        cluster_model("big", json!({"storageUri": "hf://org/big"})),
    );
    // Record when each ConfigMap write happens, as OME's controller would be woken.
    let writes: Arc<std::sync::Mutex<Vec<(Instant, Value)>>> = Arc::default();
    let watcher = {
        let writes = writes.clone();
        let api: Api<k8s_openapi::api::core::v1::ConfigMap> =
            Api::namespaced(server.client().await, "ome");
        tokio::spawn(async move {
            use futures::StreamExt;
            let stream = kube::runtime::watcher(api, kube::runtime::watcher::Config::default());
            futures::pin_mut!(stream);
            while let Some(event) = stream.next().await {
                if let Ok(kube::runtime::watcher::Event::Apply(cm)) = event {
                    if let Some(entry) =
                        cm.data.as_ref().and_then(|d| d.get("clusterbasemodel.big"))
                    {
                        let entry: Value = serde_json::from_str(entry).unwrap();
                        writes.lock().unwrap().push((Instant::now(), entry));
                    }
                }
            }
        })
    };
    let url = running.url();
    let daemon = start_daemon(
        &server,
        &["--hf-endpoint", &url, "--progress-interval-secs", "2"],
        &[],
    );
    wait_status(&server, "clusterbasemodel.big", "Ready").await;
    watcher.abort();
    let writes = writes.lock().unwrap().clone();
    let progress: Vec<(Instant, Value)> = writes
        .iter()
        .filter(|(_, e)| e["status"] == "Updating" && e["progress"].is_object())
        .cloned()
        .collect();
    assert!(
        progress.len() >= 2,
        "expected several progress writes during the download: {writes:?}"
    );
    for (_, entry) in &progress {
        let phase = entry["progress"]["phase"].as_str().unwrap();
        assert!(
            ["scanning", "downloading", "finalizing"].contains(&phase),
            "{entry}"
        );
        if phase != "scanning" {
            assert_eq!(entry["progress"]["totalBytes"], (3 << 20) + 22);
        }
    }
    assert!(progress
        .iter()
        .any(|(_, e)| e["progress"]["phase"] == "downloading"));
    // Progress-only writes (same state, new numbers) are at least the interval apart.
    for pair in progress.windows(2) {
        let gap = pair[1].0 - pair[0].0;
        assert!(
            gap >= Duration::from_millis(1900),
            "two progress writes {gap:?} apart: {} then {}",
            pair[0].1,
            pair[1].1
        );
    }
    let ready = wait_status(&server, "clusterbasemodel.big", "Ready").await;
    assert!(ready.get("progress").is_none(), "{ready}");
    drop(daemon);
}

/// `local://` as OME's agent sees it, through the mount: a model without `storage.path` is at
/// its directory. Outside the models root it is `Ready` with OME's entry and nothing is served
/// (the pod binds the node's directory); below the models root the files are taken into a
/// store by hard link (no copy) and served at that very directory, read-only.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_models_without_a_path_are_at_their_directory() {
    let server = FakeApiServer::start().await;
    let data = tempfile::tempdir().unwrap();
    let outside = data.path().join("outside");
    make_model_dir(&outside, 91, 2 << 20);
    let expected = files_of(&outside);
    server.put(NODES, node());
    let mut inside = PathBuf::new();
    let daemon = start_daemon_over(&server, &["--allow-local-sources"], &[], |root| {
        // Files an operator put below the models root, root's and read-only for others.
        inside = root.join("local/in");
        for (rel, _) in files_of(&outside) {
            let to = inside.join(&rel);
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(outside.join(&rel), &to).unwrap();
        }
    });
    let uri = |dir: &Path| format!("local://{}", dir.display());
    server.put(
        CBM,
        cluster_model("out", without_path(json!({"storageUri": uri(&outside)}))),
    );
    server.put(
        BM,
        base_model(
            "team",
            "in",
            without_path(json!({"storageUri": uri(&inside)})),
        ),
    );

    let out = wait_status(&server, "clusterbasemodel.out", "Ready").await;
    let served = wait_status(&server, "team.basemodel.in", "Ready").await;
    let (_, body) = daemon.get("/v1/models");
    let status: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        status["clusterbasemodel.out"]["path"],
        outside.display().to_string(),
        "{out}"
    );
    assert_eq!(
        status["team.basemodel.in"]["path"],
        inside.display().to_string(),
        "{served}"
    );
    // The labels are written after the ConfigMap entries.
    wait_for("both node labels Ready", || {
        let labels = node_labels(&server);
        ["clusterbasemodel.out", "team.basemodel.in"]
            .iter()
            .all(|key| {
                labels
                    .get(&format!("models.ome.io/{key}"))
                    .map(String::as_str)
                    == Some("Ready")
            })
            .then_some(())
    })
    .await;
    // Nothing at a default path: the model outside the root is not served, the one inside is
    // served at its directory only.
    let mnt = daemon.mount.clone();
    let top: Vec<String> = std::fs::read_dir(&mnt)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    assert_eq!(top, ["local"], "{}", daemon.log_text());
    assert_eq!(files_of(&inside), expected, "served through the mount");
    assert!(
        std::fs::write(inside.join("config.json"), b"{}").is_err(),
        "read-only"
    );
    // Each file's blob is the file the operator left: one inode, two names.
    let stores = mnt.parent().unwrap().join("state/stores");
    for (rel, sha) in &expected {
        if std::fs::metadata(outside.join(rel)).unwrap().len() == 0 {
            continue;
        }
        let blobs: Vec<u64> = std::fs::read_dir(&stores)
            .unwrap()
            .flatten()
            .filter_map(|s| std::fs::metadata(s.path().join("blobs").join(sha)).ok())
            .map(|m| std::os::unix::fs::MetadataExt::nlink(&m))
            .collect();
        assert_eq!(
            blobs,
            [2],
            "{rel}: linked from the directory below the root"
        );
    }
    // The outside directory is untouched and read by nothing but the existence check.
    assert_eq!(files_of(&outside), expected);
    drop(daemon);
}

/// SPEC section 13 in Kubernetes mode: a model annotated
/// `modelfs.io/serve-while-downloading: "true"` is `Ready` (node label and ConfigMap entry) as
/// soon as the mount server serves its listing, with OME's `progress` going on and the reason
/// counting verified files, and its files read through the mount while the rest downloads; a
/// model without the annotation keeps OME's meaning (`Ready` once complete).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_annotated_model_is_ready_once_its_listing_is_served_and_others_once_complete() {
    let server = FakeApiServer::start().await;
    let data = tempfile::tempdir().unwrap();
    // One link of 1 MiB/s for every body of the hub: about six seconds for both models.
    let hub = modelfs_devhub::hf::Hub::new(modelfs_devhub::hf::HubConfig {
        rate_bytes_per_sec: 1 << 20,
        ..modelfs_devhub::hf::HubConfig::default()
    });
    let mut contents = BTreeMap::new();
    for repo in ["opt", "plain"] {
        let dir = data.path().join(repo);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), b"{\"model_type\":\"llama\"}").unwrap();
        std::fs::write(dir.join("tokenizer.json"), common::bytes(7, 2000)).unwrap();
        for i in 1..=3u64 {
            let name = format!("model-0000{i}-of-00003.safetensors");
            std::fs::write(dir.join(&name), common::bytes(10 + i, 1 << 20)).unwrap();
        }
        hub.add_commit(
            &format!("org/{repo}"),
            &["main"],
            files_from_dir(&dir, 1 << 10).unwrap(),
        );
        contents.insert(repo, dir);
    }
    let running = hub
        .clone()
        .serve("127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();
    server.put(NODES, node());
    server.put(CBM, served_while_downloading("opt", "hf://org/opt"));
    server.put(
        CBM,
        cluster_model("plain", json!({"storageUri": "hf://org/plain"})),
    );
    let url = running.url();
    let daemon = start_daemon(
        &server,
        &[
            "--hf-endpoint",
            &url,
            "--hf-max-files",
            "1",
            "--progress-interval-secs",
            "1",
        ],
        &[],
    );
    // Ready while it still downloads: OME's progress is there, and the reason counts files. The
    // node label follows the ConfigMap entry (the sink writes the ConfigMap first, then the
    // labels), so both are awaited together; the entry's progress says the download still runs.
    let early = wait_for("opt Ready while downloading, entry and label", || {
        // The label first: Ready there, then an entry still with progress, means the label
        // said Ready while the model downloaded.
        let label = node_labels(&server)
            .get("models.ome.io/clusterbasemodel.opt")
            .cloned();
        let entry = entries(&server).get("clusterbasemodel.opt").cloned()?;
        (entry["status"] == "Ready"
            && entry["progress"].is_object()
            && label.as_deref() == Some("Ready"))
        .then_some(entry)
    })
    .await;
    let reason = early["reason"].as_str().unwrap_or_default().to_string();
    assert!(
        reason.starts_with("served while downloading: ") && reason.ends_with("/5 files verified"),
        "{early}"
    );
    assert_ne!(
        status_of(&server, "clusterbasemodel.plain").as_deref(),
        Some("Ready"),
        "a model without the annotation is Ready only once complete"
    );
    assert!(
        early["progress"]["totalBytes"].as_u64().unwrap() >= 3 << 20,
        "{early}"
    );
    // Pods scheduled now read the model through the mount: every file has its own bytes.
    let served = daemon.mount.join("opt");
    let last = "model-00003-of-00003.safetensors";
    let got = tokio::task::spawn_blocking(move || std::fs::read(served.join(last)))
        .await
        .unwrap()
        .unwrap();
    assert!(got == std::fs::read(contents["opt"].join(last)).unwrap());

    // Both complete: the annotated one stays Ready, now without progress or reason.
    let done = wait_for("opt complete", || {
        let entry = entries(&server).get("clusterbasemodel.opt").cloned()?;
        (entry["status"] == "Ready" && entry.get("progress").is_none()).then_some(entry)
    })
    .await;
    assert!(done.get("reason").is_none(), "{done}");
    let plain = wait_status(&server, "clusterbasemodel.plain", "Ready").await;
    assert!(plain.get("progress").is_none(), "{plain}");
    for repo in ["opt", "plain"] {
        let want = files_of(&contents[repo]);
        assert_eq!(files_of(&daemon.mount.join(repo)), want, "{repo}");
    }
    drop(daemon);
}

/// Every status the node label and the ConfigMap entry of `key` had, oldest first, as the
/// fake API server recorded each write (`None`: no label or entry in that version).
fn status_history(server: &FakeApiServer, key: &str) -> (Vec<Option<String>>, Vec<Option<String>>) {
    let label = format!("models.ome.io/{key}");
    let labels = server
        .history(NODES)
        .iter()
        .filter(|n| n["metadata"]["name"] == NODE)
        .map(|n| n["metadata"]["labels"][&label].as_str().map(str::to_owned))
        .collect();
    let entries = server
        .history(CM)
        .iter()
        .filter(|c| c["metadata"]["name"] == NODE && c["metadata"]["namespace"] == "ome")
        .map(|c| {
            let entry = c["data"][key].as_str()?;
            let entry: Value = serde_json::from_str(entry).ok()?;
            entry["status"].as_str().map(str::to_owned)
        })
        .collect();
    (labels, entries)
}

/// A model annotated `modelfs.io/serve-while-downloading: "true"` stays `Ready` across a
/// SIGKILL of the agent mid-fetch: the mount server keeps serving its listing, and neither
/// the node label nor the ConfigMap entry says anything else from its first `Ready` on,
/// through the restart, the resumed fetch and its completion (every write recorded).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_annotated_model_stays_ready_across_an_agent_restart_mid_fetch() {
    let server = FakeApiServer::start().await;
    let data = tempfile::tempdir().unwrap();
    // One link of 256 KiB/s: the 3 MiB of shards take about 12 s.
    let hub = modelfs_devhub::hf::Hub::new(modelfs_devhub::hf::HubConfig {
        rate_bytes_per_sec: 256 << 10,
        ..modelfs_devhub::hf::HubConfig::default()
    });
    let dir = data.path().join("opt");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), b"{\"model_type\":\"llama\"}").unwrap();
    std::fs::write(dir.join("tokenizer.json"), common::bytes(7, 2000)).unwrap();
    for i in 1..=3u64 {
        let name = format!("model-0000{i}-of-00003.safetensors");
        std::fs::write(dir.join(&name), common::bytes(20 + i, 1 << 20)).unwrap();
    }
    hub.add_commit("org/opt", &["main"], files_from_dir(&dir, 1 << 10).unwrap());
    let running = hub
        .clone()
        .serve("127.0.0.1:0".parse().unwrap(), None)
        .await
        .unwrap();
    server.put(NODES, node());
    server.put(CBM, served_while_downloading("opt", "hf://org/opt"));
    let url = running.url();
    let daemon = start_daemon(
        &server,
        &["--hf-endpoint", &url, "--hf-max-files", "1"],
        &[],
    );
    let key = "clusterbasemodel.opt";
    wait_for("opt Ready while downloading", || {
        let entry = entries(&server).get(key).cloned()?;
        let labelled =
            node_labels(&server).get(&format!("models.ome.io/{key}")) == Some(&"Ready".to_string());
        (labelled && entry["status"] == "Ready" && entry["progress"].is_object()).then_some(())
    })
    .await;

    let agent = only_child(daemon.child.id()).expect("one agent child");
    let addr_file = daemon.log.with_file_name("daemon.addr");
    std::fs::remove_file(&addr_file).unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(agent as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    wait_for("the restarted agent to listen", || {
        std::fs::read_to_string(&addr_file)
            .ok()
            .filter(|a| a.ends_with('\n'))
    })
    .await;
    let resumed = daemon.log_text();
    assert!(
        resumed.contains("serving the listing of a fetch a restart ended"),
        "killed mid-fetch"
    );
    wait_for("opt complete", || {
        let entry = entries(&server).get(key).cloned()?;
        (entry["status"] == "Ready" && entry.get("progress").is_none()).then_some(())
    })
    .await;
    let want = files_of(&dir);
    assert_eq!(files_of(&daemon.mount.join("opt")), want);

    let (labels, statuses) = status_history(&server, key);
    for (what, history) in [("node label", labels), ("ConfigMap entry", statuses)] {
        let first_ready = history
            .iter()
            .position(|s| s.as_deref() == Some("Ready"))
            .unwrap_or_else(|| panic!("the {what} was never Ready: {history:?}"));
        assert!(
            history[first_ready..]
                .iter()
                .all(|s| s.as_deref() == Some("Ready")),
            "the {what} left Ready across the restart: {history:?}"
        );
    }
    drop(daemon);
}

/// A ClusterBaseModel of `uri` that opts in to serving while downloading (Ready once its
/// listing is served).
fn served_while_downloading(name: &str, uri: &str) -> serde_json::Value {
    let mut model = cluster_model(name, json!({ "storageUri": uri }));
    model["metadata"]["annotations"] =
        json!({modelfs_ome::model::SERVE_WHILE_DOWNLOADING_ANNOTATION: "true"});
    model
}
