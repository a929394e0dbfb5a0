//! The loopback hub against the real `huggingface_hub` client: `snapshot_download` (plain HTTP,
//! `HF_HUB_DISABLE_XET=1`) must fetch exactly the repository, through pagination, LFS
//! redirects to the CDN address and a gated repository. This keeps the hub, and therefore every
//! other Hugging Face test, faithful to the real protocol.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use common::*;
use modelfs_devhub::hf::{files_from_dir, Hub, HubConfig, RunningHub};

const TOKEN: &str = "hf_PythonClientToken_51d0";

/// The hub served in this process (as `modelfs-hub` would serve it), with its runtime.
struct HubProcess {
    url: String,
    _running: RunningHub,
    _rt: tokio::runtime::Runtime,
}

/// A hub with LFS redirects to a CDN address: `repos` as `(org/name, refs, DIR)`, `gated`
/// repositories needing [`TOKEN`]; files of 1 MiB and more are LFS files (`modelfs-hub`'s
/// default).
fn start_hub(page_size: usize, repos: &[(&str, &[&str], &Path)], gated: &[&str]) -> HubProcess {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let hub = Hub::new(HubConfig {
        page_size,
        ..HubConfig::default()
    });
    for (repo, refs, dir) in repos {
        hub.add_commit(repo, refs, files_from_dir(dir, 1 << 20).unwrap());
    }
    for repo in gated {
        hub.set_gated(repo, TOKEN);
    }
    let cdn: SocketAddr = "127.0.0.2:0".parse().unwrap();
    let running = rt
        .block_on(hub.serve("127.0.0.1:0".parse().unwrap(), Some(cdn)))
        .unwrap();
    HubProcess {
        url: running.url(),
        _running: running,
        _rt: rt,
    }
}

fn snapshot_download(
    hub: &HubProcess,
    repo: &str,
    revision: &str,
    out: &Path,
    token: Option<&str>,
) -> std::process::Output {
    let script = r#"
import os, sys
from huggingface_hub import snapshot_download
p = snapshot_download(repo_id=sys.argv[1], revision=sys.argv[2], local_dir=sys.argv[3],
                      token=os.environ.get("TEST_TOKEN") or False)
print(p)
"#;
    let mut cmd = Command::new(python());
    cmd.arg("-c")
        .arg(script)
        .arg(repo)
        .arg(revision)
        .arg(out)
        .env("HF_ENDPOINT", &hub.url)
        .env("HF_HUB_DISABLE_XET", "1")
        .env("HF_HOME", out.parent().unwrap().join("hf-home"))
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("HF_TOKEN");
    if let Some(t) = token {
        cmd.env("TEST_TOKEN", t);
    }
    cmd.output().unwrap()
}

/// Regular files below `dir` with their sha256, ignoring the client's `.cache` bookkeeping.
fn files(dir: &Path) -> Vec<(String, u64, String)> {
    tree(dir)
        .into_iter()
        .filter(|(p, (is_dir, ..))| !is_dir && !p.starts_with(".cache"))
        .map(|(p, (_, size, _, sha))| (p, size, sha))
        .collect()
}

#[test]
fn huggingface_hub_snapshot_download_matches_the_repository() {
    let env = TestEnv::new();
    let src = env.dir("repo");
    make_model_dir(&src, 21, 3 << 20);
    for i in 0..12 {
        let p = src.join(format!("extra/d{}/f{i}.txt", i % 3));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, bytes(500 + i, 50 * i as usize)).unwrap();
    }
    let gated = env.dir("gated");
    make_model_dir(&gated, 22, 1 << 20);
    let hub = start_hub(
        4,
        &[
            ("org/model", &["main", "v1"], &src),
            ("org/gated", &["main"], &gated),
        ],
        &["org/gated"],
    );

    let out = env.root.path().join("dl-model");
    let r = snapshot_download(&hub, "org/model", "v1", &out, None);
    assert!(
        r.status.success(),
        "snapshot_download failed:\n{}",
        String::from_utf8_lossy(&r.stderr)
    );
    assert_eq!(files(&out), files(&src));

    let out = env.root.path().join("dl-gated-no-token");
    let r = snapshot_download(&hub, "org/gated", "main", &out, None);
    assert!(!r.status.success(), "a gated repo needs a token");
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(err.contains("Gated") || err.contains("401"), "{err}");

    let out = env.root.path().join("dl-gated");
    let r = snapshot_download(&hub, "org/gated", "main", &out, Some(TOKEN));
    assert!(
        r.status.success(),
        "snapshot_download with a token failed:\n{}",
        String::from_utf8_lossy(&r.stderr)
    );
    assert_eq!(files(&out), files(&gated));

    let stats = http_get(hub.url.trim_start_matches("http://"), "/_hub/stats").unwrap();
    let stats: serde_json::Value = serde_json::from_str(&stats.1).unwrap();
    assert_eq!(stats["cdn_requests_with_auth"], 0, "{stats}");
}
