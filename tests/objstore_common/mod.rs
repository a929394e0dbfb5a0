//! Real object-store servers for tests, started by the test on 127.0.0.1 and killed on drop,
//! and the official client of each to put and read objects (`objstore_client.py`):
//!
//! | kind | server | reference client |
//! |---|---|---|
//! | S3 | `moto_server` (PyPI `moto[server]`) | `boto3` |
//! | GCS | `gcp-storage-emulator` (PyPI) | `google-cloud-storage` |
//! | Azure Blob | `azurite-blob` (npm `azurite`) | `azure-storage-blob` |
//!
//! The Python packages live in the test venv (`MODELFS_TEST_PYTHON`, see
//! `scripts/requirements-objstore.txt`); azurite is installed by `scripts/test` under
//! `.venv/node` (or found through `MODELFS_AZURITE_BLOB`, or on `PATH`). A missing server is a
//! test failure, not a skip.
//!
//! Each server gets a free port of its own (with a retry if another process takes it between
//! the probe and the bind) and a private temporary directory; its log is kept for failure
//! messages. Azurite runs with telemetry off: no test sends anything beyond the loopback.
//!
//! [`proxy`] holds the loopback counting and fault-injecting HTTP proxy.
//!
//! Use from an integration test with `mod common; mod objstore_common;` (it uses
//! `common::python()` and `common::unique()`); tests/objstore_servers.rs shows every
//! launcher round-tripping an object.
#![allow(dead_code)]

pub mod proxy;

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The development account every Azurite accepts (published in Azure's documentation).
pub const AZURITE_ACCOUNT: &str = "devstoreaccount1";
pub const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";
/// Credentials moto accepts while it does not check them (until `require-auth`, see objstore_client.py).
pub const S3_ACCESS_KEY: &str = "test";
pub const S3_SECRET_KEY: &str = "test";
pub const S3_REGION: &str = "us-east-1";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    S3,
    Gcs,
    Azure,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::S3, Kind::Gcs, Kind::Azure];

    /// `--kind` of objstore_client.py.
    pub fn client_kind(self) -> &'static str {
        match self {
            Kind::S3 => "s3",
            Kind::Gcs => "gcs",
            Kind::Azure => "azure",
        }
    }

    /// The modelfs URI scheme of this kind.
    pub fn scheme(self) -> &'static str {
        match self {
            Kind::S3 => "s3",
            Kind::Gcs => "gs",
            Kind::Azure => "az",
        }
    }
}

/// One object of a listing, as the reference client reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectInfo {
    pub key: String,
    pub size: u64,
    pub etag: String,
}

/// A running object-store server. Dropping it kills the process.
pub struct ObjectServer {
    pub kind: Kind,
    /// `127.0.0.1:<port>`.
    pub addr: String,
    child: Option<Child>,
    dir: tempfile::TempDir,
    log: PathBuf,
}

impl ObjectServer {
    pub fn s3() -> Self {
        Self::start(Kind::S3)
    }

    pub fn gcs() -> Self {
        Self::start(Kind::Gcs)
    }

    pub fn azure() -> Self {
        Self::start(Kind::Azure)
    }

    /// Starts a server of `kind` on a free loopback port and waits until it answers. Moto and
    /// Azurite are given port 0 and name the port the system picked in their log. The GCS
    /// emulator cannot (it logs the port it was given), so it gets a port that was free a
    /// moment ago; if another process takes that port first, the emulator's bind fails, which
    /// its log says, and it is started again on another (up to three attempts). Either way the
    /// address comes from the server itself, never from a port merely found free.
    pub fn start(kind: Kind) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("modelfs-{}-", kind.client_kind()))
            .tempdir()
            .unwrap();
        let mut failures = Vec::new();
        for attempt in 0..3 {
            let port = match kind {
                Kind::Gcs => recently_free_port(),
                Kind::S3 | Kind::Azure => 0,
            };
            let log = dir.path().join(format!("server-{attempt}.log"));
            let log_file = std::fs::File::create(&log).unwrap();
            let mut cmd = server_command(kind, port, dir.path());
            cmd.current_dir(dir.path())
                .stdin(Stdio::null())
                .stdout(log_file.try_clone().unwrap())
                .stderr(log_file);
            for var in PROXY_VARS {
                cmd.env_remove(var);
            }
            let mut child = cmd
                .spawn()
                .unwrap_or_else(|e| panic!("starting the {kind:?} server ({cmd:?}): {e}"));
            match wait_listening(kind, &mut child, &log, port, Duration::from_secs(60)) {
                Ok(addr) => {
                    return ObjectServer {
                        kind,
                        addr,
                        child: Some(child),
                        dir,
                        log,
                    }
                }
                Err(why) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let text = std::fs::read_to_string(&log).unwrap_or_default();
                    failures.push(format!("attempt {attempt}: {why}; log:\n{text}"));
                }
            }
        }
        panic!(
            "the {kind:?} server did not come up:\n{}",
            failures.join("\n")
        );
    }

    /// `http://127.0.0.1:<port>`: the endpoint for clients (Azure: the account URL is
    /// [`ObjectServer::azure_account_url`]).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `http://127.0.0.1:<port>/devstoreaccount1` (Azurite's path-style account URL).
    pub fn azure_account_url(&self) -> String {
        format!("{}/{AZURITE_ACCOUNT}", self.endpoint())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A scratch directory that lives as long as the server.
    pub fn scratch(&self) -> &Path {
        self.dir.path()
    }

    /// The modelfs source URI of `bucket` / `prefix` (`s3://b/p`, `gs://b/p`, `az://c/p`).
    pub fn uri(&self, bucket: &str, prefix: &str) -> String {
        format!("{}://{bucket}/{prefix}", self.kind.scheme())
    }

    /// Environment for a modelfs daemon to reach this server with the usual variable names of
    /// each cloud's SDKs and of the `object_store` crate (credentials, region, endpoint,
    /// plain HTTP allowed).
    pub fn daemon_env(&self) -> Vec<(String, String)> {
        let pairs: Vec<(&str, String)> = match self.kind {
            Kind::S3 => vec![
                ("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY.into()),
                ("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY.into()),
                ("AWS_REGION", S3_REGION.into()),
                ("AWS_DEFAULT_REGION", S3_REGION.into()),
                ("AWS_ENDPOINT_URL", self.endpoint()),
                ("AWS_ENDPOINT", self.endpoint()),
                ("AWS_ALLOW_HTTP", "true".into()),
            ],
            Kind::Gcs => vec![
                // The variable Google's own clients use to talk to an emulator.
                ("STORAGE_EMULATOR_HOST", self.endpoint()),
                ("GOOGLE_CLOUD_PROJECT", "test".into()),
            ],
            Kind::Azure => vec![
                ("AZURE_STORAGE_ACCOUNT_NAME", AZURITE_ACCOUNT.into()),
                ("AZURE_STORAGE_ACCOUNT_KEY", AZURITE_KEY.into()),
                ("AZURE_STORAGE_USE_EMULATOR", "true".into()),
                ("AZURITE_BLOB_STORAGE_URL", self.endpoint()),
                ("AZURE_ALLOW_HTTP", "true".into()),
            ],
        };
        pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    /// Runs objstore_client.py against this server; returns stdout, panics with stderr and
    /// the server's log on failure.
    pub fn client(&self, args: &[&str]) -> String {
        run_client(self.kind, &self.endpoint(), args)
            .unwrap_or_else(|e| panic!("{e}\nserver log:\n{}", self.log_text()))
    }

    pub fn create_bucket(&self, bucket: &str) {
        self.client(&["mkbucket", bucket]);
    }

    /// Uploads every file below `dir` as `prefix` + its relative path (`/`-separated).
    pub fn upload_dir(&self, bucket: &str, prefix: &str, dir: &Path) {
        self.client(&["upload-dir", bucket, prefix, dir.to_str().unwrap()]);
    }

    pub fn put(&self, bucket: &str, key: &str, data: &[u8]) {
        let file = tempfile::NamedTempFile::new_in(self.scratch()).unwrap();
        std::fs::write(file.path(), data).unwrap();
        self.client(&["put", bucket, key, file.path().to_str().unwrap()]);
    }

    /// S3 only: puts an object with the canned ACL `public-read`, so that plain unsigned HTTP
    /// (curl, a raw request through the proxy) can read it.
    pub fn put_public(&self, bucket: &str, key: &str, data: &[u8]) {
        assert_eq!(self.kind, Kind::S3, "canned ACLs are an S3 feature");
        let file = tempfile::NamedTempFile::new_in(self.scratch()).unwrap();
        std::fs::write(file.path(), data).unwrap();
        self.client(&[
            "put",
            bucket,
            key,
            file.path().to_str().unwrap(),
            "public-read",
        ]);
    }

    pub fn get(&self, bucket: &str, key: &str) -> Vec<u8> {
        let out = self
            .scratch()
            .join(format!("get-{}", super::common::unique()));
        self.client(&["get", bucket, key, out.to_str().unwrap()]);
        let data = std::fs::read(&out).unwrap();
        let _ = std::fs::remove_file(&out);
        data
    }

    /// Downloads every object below `prefix` into `dir` (key without `prefix` as relative path).
    pub fn download_dir(&self, bucket: &str, prefix: &str, dir: &Path) {
        self.client(&["download-dir", bucket, prefix, dir.to_str().unwrap()]);
    }

    pub fn delete(&self, bucket: &str, key: &str) {
        self.client(&["delete", bucket, key]);
    }

    /// Every object below `prefix`, sorted by key.
    pub fn list(&self, bucket: &str, prefix: &str) -> Vec<ObjectInfo> {
        let out = self.client(&["list", bucket, prefix]);
        let v: Value = serde_json::from_str(&out).unwrap();
        let mut objects: Vec<ObjectInfo> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|o| ObjectInfo {
                key: o["key"].as_str().unwrap().to_string(),
                size: o["size"].as_u64().unwrap(),
                etag: o["etag"].as_str().unwrap_or_default().to_string(),
            })
            .collect();
        objects.sort_by(|a, b| a.key.cmp(&b.key));
        objects
    }
}

/// Waits until `addr` accepts connections, failing early if the server exits (for example
/// because another process took the port).
/// A loopback port nothing listened on a moment ago: only for a server that cannot name the
/// port it picked (see [`ObjectServer::start`]).
fn recently_free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The address the server says in its `log` it listens on (`port`: what it was given), once
/// it answers there.
fn wait_listening(
    kind: Kind,
    child: &mut Child,
    log: &Path,
    port: u16,
    timeout: Duration,
) -> Result<String, String> {
    let deadline = Instant::now() + timeout;
    // The address after `marker` in the log: `127.0.0.1:<port>`.
    let named = |text: &str, marker: &str| {
        let rest = &text[text.find(marker)? + marker.len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == ':'))
            .unwrap_or(rest.len());
        rest[..end]
            .parse::<std::net::SocketAddr>()
            .ok()
            .map(|a| a.to_string())
    };
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return Err(format!("exited with {status}"));
        }
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let addr = match kind {
            Kind::S3 => named(&text, "Running on http://"),
            Kind::Azure => named(&text, "successfully listens on http://"),
            // Its API thread dies on a failed bind, and the process waits for it for ever.
            Kind::Gcs if text.contains("Address already in use") => {
                return Err(format!(
                    "port {port} was taken before the emulator bound it"
                ))
            }
            Kind::Gcs => text
                .contains("All services started")
                .then(|| format!("127.0.0.1:{port}")),
        };
        if let Some(addr) = addr {
            if TcpStream::connect(&addr).is_ok() {
                return Ok(addr);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!("not listening after {timeout:?}"))
}

impl Drop for ObjectServer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Proxy variables removed from the servers' and clients' environment: the harness itself
/// always talks to the loopback directly.
pub const PROXY_VARS: [&str; 8] = [
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
];

fn venv_bin(name: &str) -> PathBuf {
    super::common::python().parent().unwrap().join(name)
}

fn server_command(kind: Kind, port: u16, dir: &Path) -> Command {
    let port = port.to_string();
    match kind {
        Kind::S3 => {
            let mut c = Command::new(venv_bin("moto_server"));
            c.args(["-H", "127.0.0.1", "-p", &port]);
            c
        }
        Kind::Gcs => {
            let mut c = Command::new(venv_bin("gcp-storage-emulator"));
            c.args([
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                &port,
                "--in-memory",
            ]);
            c
        }
        Kind::Azure => {
            let mut c = Command::new(azurite_blob());
            c.args(["--blobHost", "127.0.0.1", "--blobPort", &port, "--location"])
                .arg(dir.join("azurite"))
                // The Python client may speak a newer API version than the server knows;
                // the blob operations the tests use are the same.
                .args([
                    "--skipApiVersionCheck",
                    "--loose",
                    "--silent",
                    "--disableTelemetry",
                ]);
            c
        }
    }
}

/// `azurite-blob`: `MODELFS_AZURITE_BLOB`, else `.venv/node` next to the test Python (where
/// scripts/test installs it), else `PATH`.
pub fn azurite_blob() -> PathBuf {
    if let Some(p) = std::env::var_os("MODELFS_AZURITE_BLOB") {
        return PathBuf::from(p);
    }
    let python = super::common::python();
    let venv = python.parent().unwrap().parent().unwrap();
    let local = venv.join("node/node_modules/.bin/azurite-blob");
    if local.exists() {
        return local;
    }
    PathBuf::from("azurite-blob")
}

/// The reference-client script next to this file.
pub fn client_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/objstore_common/objstore_client.py")
}

/// Runs objstore_client.py for `kind` at `endpoint`.
pub fn run_client(kind: Kind, endpoint: &str, args: &[&str]) -> Result<String, String> {
    let mut cmd = Command::new(super::common::python());
    cmd.arg(client_script())
        .args(["--kind", kind.client_kind(), "--endpoint", endpoint])
        .args(args);
    for var in PROXY_VARS {
        cmd.env_remove(var);
    }
    let out = cmd.output().map_err(|e| format!("running {cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "objstore_client.py {} {args:?} failed: {}",
            kind.client_kind(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8(out.stdout).unwrap())
}
