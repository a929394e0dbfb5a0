//! The OCI Object Storage look-alike (`modelfs_devhub::oci`, served by `modelfs-oci-dev`) against the official `oci` Python SDK:
//! with the SDK's own request signer and a freshly generated API key, listing (through
//! pagination), GET, ranged GET and HEAD must give exactly the objects, their MD5 headers and
//! the multipart MD5; a request signed with another key, or by a stale clock, is refused with
//! the service's error JSON. This keeps the look-alike's signature check (and so modelfs's
//! signer, which it also verifies) faithful to OCI's published signing scheme.
//!
//! The same for OKE workload identity, with the SDK's own OKE workload identity signer as the
//! reference client: its whole path runs, from the factory that reads `KUBERNETES_SERVICE_HOST`
//! and the service account CA variable, over TLS to port 12250 checked against that CA, to the
//! requests it signs with the session token and its session key. Only the service account token
//! file's path is passed in (the SDK's `service_account_token_path` argument; the default path
//! needs a pod).

mod common;
mod oci_common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use common::*;
use modelfs_agent::source::oci::sign::rsa_public_key_from_pem;
use modelfs_devhub::oci::{OciDev, OciDevConfig, RunningOciDev};
use serde_json::Value;

const TENANCY: &str = "ocid1.tenancy.oc1..aaaatestenancy";
const USER: &str = "ocid1.user.oc1..aaaatestuser";

/// The look-alike served in this process (as `modelfs-oci-dev` would serve it), with its
/// runtime.
struct DevProcess {
    url: String,
    running: RunningOciDev,
    rt: tokio::runtime::Runtime,
}

/// Serves the files of `dir` as objects `<prefix>/<path>` of bucket `namespace/bucket` (files
/// of at least `multipart_threshold` bytes as multipart uploads), accepting signatures of the
/// API key `key_id` whose public key is the PEM file `public_key`.
struct DevSetup<'a> {
    namespace: &'a str,
    bucket: &'a str,
    prefix: &'a str,
    dir: &'a Path,
    key_id: String,
    public_key: &'a str,
    page_size: usize,
    multipart_threshold: u64,
}

fn start_dev(setup: DevSetup) -> DevProcess {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = OciDev::new(OciDevConfig {
        page_size: setup.page_size,
        ..OciDevConfig::default()
    });
    server.create_bucket(setup.namespace, setup.bucket);
    server
        .put_dir(
            setup.namespace,
            setup.bucket,
            setup.prefix,
            setup.dir,
            Some(setup.multipart_threshold),
        )
        .unwrap();
    let pem = std::fs::read_to_string(setup.public_key).unwrap();
    server.add_key(&setup.key_id, rsa_public_key_from_pem(&pem).unwrap());
    let running = rt
        .block_on(server.serve("127.0.0.1:0".parse().unwrap()))
        .unwrap();
    DevProcess {
        url: running.url(),
        running,
        rt,
    }
}

/// Generates an RSA key pair with openssl; returns (private path, public path, fingerprint).
fn api_key(dir: &Path, name: &str) -> (String, String, String) {
    let private = dir.join(format!("{name}.pem"));
    let public = dir.join(format!("{name}.pub.pem"));
    sh(&format!(
        "openssl genrsa -out {} 2048 2>/dev/null",
        private.display()
    ));
    sh(&format!(
        "openssl rsa -in {} -pubout -out {} 2>/dev/null",
        private.display(),
        public.display()
    ));
    let fp = sh(&format!(
        "openssl rsa -in {} -pubout -outform DER 2>/dev/null | openssl md5 -c",
        private.display()
    ));
    let fp = fp.trim().rsplit(' ').next().unwrap().to_string();
    (
        private.display().to_string(),
        public.display().to_string(),
        fp,
    )
}

const SCRIPT: &str = r#"
import base64, hashlib, json, sys
import oci

url, key_file, fingerprint, tenancy, user, ns, bucket, prefix = sys.argv[1:9]
config = {"user": user, "fingerprint": fingerprint, "tenancy": tenancy,
          "region": "us-ashburn-1", "key_file": key_file}
oci.config.validate_config(config)
client = oci.object_storage.ObjectStorageClient(config, service_endpoint=url,
                                               retry_strategy=oci.retry.NoneRetryStrategy())
out = {}
if sys.argv[9] == "full":
    out["namespace"] = client.get_namespace().data
    names, start, pages = [], None, 0
    while True:
        kw = {"prefix": prefix, "fields": "name,size,md5,etag", "limit": 1000}
        if start:
            kw["start"] = start
        r = client.list_objects(ns, bucket, **kw).data
        pages += 1
        names += [(o.name, o.size, o.md5) for o in r.objects]
        if not r.next_start_with:
            break
        start = r.next_start_with
    out["pages"] = pages
    out["objects"] = names
    out["files"] = {}
    for name, size, md5 in names:
        body = client.get_object(ns, bucket, name).data.content
        head = client.head_object(ns, bucket, name).headers
        ranged = client.get_object(ns, bucket, name, range="bytes=1-3") if len(body) >= 4 else None
        out["files"][name] = {
            "sha256": hashlib.sha256(body).hexdigest(),
            "md5": base64.b64encode(hashlib.md5(body).digest()).decode(),
            "len": len(body),
            "head_md5": head.get("content-md5"),
            "head_opc_md5": head.get("opc-content-md5"),
            "head_multipart": head.get("opc-multipart-md5"),
            "head_meta_md5": head.get("opc-meta-md5"),
            "head_length": head.get("content-length"),
            "range_status": ranged and ranged.status,
            "range": ranged and ranged.data.content.hex(),
            "content_range": ranged and ranged.headers.get("content-range"),
        }
else:
    try:
        client.list_objects(ns, bucket, prefix=prefix)
        out["refused"] = None
    except oci.exceptions.ServiceError as e:
        out["refused"] = {"status": e.status, "code": e.code, "message": e.message}
print(json.dumps(out))
"#;

fn run_sdk(
    dev: &DevProcess,
    key: &(String, String, String),
    mode: &str,
    extra_env: &[(&str, &str)],
) -> Value {
    let mut cmd = Command::new(python());
    cmd.arg("-c")
        .arg(SCRIPT)
        .arg(&dev.url)
        .arg(&key.0)
        .arg(&key.2)
        .arg(TENANCY)
        .arg(USER)
        .arg("testns")
        .arg("models")
        .arg("llama/")
        .arg(mode);
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    sdk_json(cmd)
}

#[test]
fn the_official_oci_sdk_lists_gets_and_heads_with_its_own_signer() {
    let env = TestEnv::new();
    let keys = env.dir("keys");
    let good = api_key(&keys, "good");
    let other = api_key(&keys, "other");
    let src = env.dir("src");
    make_model_dir(&src, 11, 3 << 20);
    std::fs::create_dir_all(src.join("sub/deeper")).unwrap();
    for i in 0..7 {
        std::fs::write(
            src.join(format!("sub/deeper/f{i}.txt")),
            format!("file {i}\n"),
        )
        .unwrap();
    }
    let want = files_of(&src);
    let dev = start_dev(DevSetup {
        namespace: "testns",
        bucket: "models",
        prefix: "llama",
        dir: &src,
        key_id: format!("{TENANCY}/{USER}/{}", good.2),
        public_key: &good.1,
        page_size: 3,
        multipart_threshold: 1 << 20,
    });

    let out = run_sdk(&dev, &good, "full", &[]);
    assert_eq!(out["namespace"], "testns");
    let objects = out["objects"].as_array().unwrap();
    assert_eq!(objects.len(), want.len());
    assert!(out["pages"].as_u64().unwrap() >= (want.len() as u64).div_ceil(3));
    let files = out["files"].as_object().unwrap();
    for (rel, sha) in &want {
        let f = &files[&format!("llama/{rel}")];
        assert_eq!(f["sha256"].as_str().unwrap(), sha, "{rel}");
        let size = std::fs::metadata(src.join(rel)).unwrap().len();
        assert_eq!(f["len"].as_u64().unwrap(), size);
        assert_eq!(f["head_length"].as_str().unwrap(), size.to_string());
        if size >= 1 << 20 {
            // A multipart upload: no content MD5, the parts' MD5, and OME's opc-meta-md5.
            assert!(f["head_md5"].is_null(), "{rel}");
            let mp = f["head_multipart"].as_str().unwrap();
            assert!(mp.ends_with("-1"), "{mp}");
            assert_eq!(f["head_meta_md5"], f["md5"]);
        } else {
            assert_eq!(f["head_md5"], f["md5"], "{rel}");
            assert_eq!(f["head_opc_md5"], f["md5"], "{rel}");
        }
        if size >= 4 {
            assert_eq!(f["range_status"], 206);
            assert_eq!(
                f["content_range"].as_str().unwrap(),
                format!("bytes 1-3/{size}")
            );
            let bytes = std::fs::read(src.join(rel)).unwrap();
            assert_eq!(f["range"].as_str().unwrap(), hex(&bytes[1..4]));
        }
    }
    // The listing's md5 is the multipart tag for the large file, the content MD5 otherwise.
    for o in objects {
        let name = o[0].as_str().unwrap();
        let f = &files[name];
        if f["len"].as_u64().unwrap() >= 1 << 20 {
            assert_eq!(o[2], f["head_multipart"]);
        } else {
            assert_eq!(o[2], f["md5"]);
        }
    }

    // Another key under the same key id: the service's NotAuthenticated.
    let forged = (other.0.clone(), other.1.clone(), good.2.clone());
    let out = run_sdk(&dev, &forged, "refused", &[]);
    assert_eq!(out["refused"]["status"], 401, "{out}");
    assert_eq!(out["refused"]["code"], "NotAuthenticated");
    let stats: Value = serde_json::from_str(
        &http_get(dev.url.trim_start_matches("http://"), "/_oci/stats")
            .unwrap()
            .1,
    )
    .unwrap();
    assert!(
        stats["refused_signatures"].as_u64().unwrap() >= 1,
        "{stats}"
    );
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

const OKE_SCRIPT: &str = r#"
import hashlib, json, sys
import oci

url, token_path, ns, bucket, prefix, mode = sys.argv[1:7]

def oke_signer():
    # The SDK's factory: https://$KUBERNETES_SERVICE_HOST:12250, TLS checked against
    # $OCI_KUBERNETES_SERVICE_ACCOUNT_CERT_PATH, region from $OCI_RESOURCE_PRINCIPAL_REGION.
    return oci.auth.signers.get_oke_workload_identity_resource_principal_signer(
        service_account_token_path=token_path, retry_strategy=oci.retry.NoneRetryStrategy())

def client_for(signer):
    return oci.object_storage.ObjectStorageClient(
        {"region": "us-ashburn-1"}, signer=signer, service_endpoint=url,
        retry_strategy=oci.retry.NoneRetryStrategy())

out = {}
if mode == "full":
    signer = oke_signer()
    out["region"] = signer.region
    out["key_id_prefix"] = signer.api_key[:3]
    claims = signer.security_token.get_jwt()
    out["lifetime"] = claims["exp"] - claims["iat"]
    client = client_for(signer)
    objects = client.list_objects(ns, bucket, prefix=prefix, fields="name,size").data.objects
    out["files"] = {o.name: hashlib.sha256(client.get_object(ns, bucket, o.name).data.content).hexdigest()
                    for o in objects}
    # A second exchange: a new session key and token. That token signed by the first
    # signer's key is refused; signed by its own key it works.
    other = oke_signer()
    out["distinct_tokens"] = other.api_key != signer.api_key
    forged = oci.auth.signers.SecurityTokenSigner(other.security_token.security_token,
                                                  signer.private_key)
    try:
        client_for(forged).list_objects(ns, bucket, prefix=prefix)
        out["forged"] = None
    except oci.exceptions.ServiceError as e:
        out["forged"] = {"status": e.status, "code": e.code}
    out["other_head"] = client_for(other).head_object(ns, bucket, objects[0].name).status
else:
    try:
        oke_signer()
        out["refused"] = None
    except oci.exceptions.ServiceError as e:
        out["refused"] = {"status": e.status, "message": e.message}
print(json.dumps(out))
"#;

fn run_oke_sdk(dev: &DevProcess, token_path: &Path, mode: &str, vars: &[(&str, &str)]) -> Value {
    let mut cmd = Command::new(python());
    cmd.arg("-c")
        .arg(OKE_SCRIPT)
        .arg(&dev.url)
        .arg(token_path)
        .args(["testns", "models", "llama/", mode])
        .envs(vars.iter().copied())
        .env_remove("OCI_KUBERNETES_SERVICE_ACCOUNT_TOKEN_PATH");
    sdk_json(cmd)
}

/// Runs an SDK script; its standard output is one JSON document.
fn sdk_json(mut cmd: Command) -> Value {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "oci SDK failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn the_official_oci_sdk_oke_workload_identity_signer_exchanges_and_signs() {
    let env = TestEnv::new();
    let keys = env.dir("keys");
    let api = api_key(&keys, "unused");
    let src = env.dir("src");
    make_model_dir(&src, 12, 1 << 20);
    let want = files_of(&src);
    let dev = start_dev(DevSetup {
        namespace: "testns",
        bucket: "models",
        prefix: "llama",
        dir: &src,
        key_id: format!("{TENANCY}/{USER}/{}", api.2),
        public_key: &api.1,
        page_size: 1000,
        multipart_threshold: 1 << 30,
    });
    let sa = env.dir("serviceaccount");
    let proxymux = oci_common::start_proxymux(&dev.running.server, &dev.rt, &sa);
    let token = oci_common::service_account_token("sdk", 3600);
    dev.running.server.set_oke_service_account_token(&token);
    std::fs::write(sa.join("token"), &token).unwrap();
    let ca = proxymux.ca_path.display().to_string();
    let vars = [
        ("KUBERNETES_SERVICE_HOST", proxymux.host.as_str()),
        ("OCI_KUBERNETES_SERVICE_ACCOUNT_CERT_PATH", ca.as_str()),
        ("OCI_RESOURCE_PRINCIPAL_REGION", "us-ashburn-1"),
    ];

    let out = run_oke_sdk(&dev, &sa.join("token"), "full", &vars);
    assert_eq!(out["region"], "us-ashburn-1");
    assert_eq!(out["key_id_prefix"], "ST$");
    assert_eq!(
        out["lifetime"], 3600,
        "the SDK reads iat and exp of the token"
    );
    let got: BTreeMap<String, String> = out["files"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            (
                k.strip_prefix("llama/").unwrap().to_string(),
                v.as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(got, want, "the bucket's bytes through the session token");
    assert_eq!(out["distinct_tokens"], true);
    assert_eq!(out["forged"]["status"], 401, "{out}");
    assert_eq!(out["forged"]["code"], "NotAuthenticated");
    assert_eq!(out["other_head"], 200);
    let stats = dev.running.server.stats();
    assert_eq!(stats.oke_exchanges, 2, "{stats:?}");
    assert_eq!(stats.oke_pod_keys, 2, "a new session key per exchange");
    assert_eq!(stats.refused_signatures, 1, "only the forged request");

    // Another pod's token (well-formed, unexpired): the proxymux refuses the exchange.
    let wrong = oci_common::service_account_token("other", 3600);
    std::fs::write(sa.join("wrong-token"), &wrong).unwrap();
    let out = run_oke_sdk(&dev, &sa.join("wrong-token"), "refused", &vars);
    assert_eq!(out["refused"]["status"], 401, "{out}");
    let stats = dev.running.server.stats();
    assert_eq!(stats.oke_exchanges, 2);
    assert_eq!(stats.refused_signatures, 2);
}
