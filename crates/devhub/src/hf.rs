//! A Hugging Face-compatible hub for tests and benchmarks. **Development only**: it serves
//! generated repositories on loopback, has no persistence and no real authentication, and is not
//! part of the daemon (the `modelfs-hub` binary and the integration tests are its only users).
//!
//! It speaks the subset of the hub protocol that clients use to download (SPEC 7), checked
//! against the real `huggingface_hub` client by a test:
//!
//! * `GET /api/models/{repo}/revision/{rev}`: `sha` and `siblings`.
//! * `GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=true`: files and directories, `lfs`
//!   for LFS files, paginated with `Link: <..>; rel="next"` after `page_size` entries.
//! * `GET|HEAD /{repo}/resolve/{rev}/{path}`: bytes with `Range`, `X-Repo-Commit`, `ETag` (git
//!   blob sha1, or sha256 for LFS files), `X-Linked-Etag`, `X-Linked-Size`. With a CDN address
//!   configured, LFS files answer `302` to `/cdn/{sha256}` on that other address, as the real hub
//!   redirects to its CDN; requests reaching the CDN with an `Authorization` header are counted
//!   (a client must drop it when the host changes).
//! * Single-part repository ids (`gpt2`, the hub's legacy models) have the same routes without
//!   the organisation part.
//! * Errors with `X-Error-Code`: `RepoNotFound`, `RevisionNotFound`, `EntryNotFound`, and
//!   `GatedRepo` (401 without a token, 403 with a wrong one) for repositories given a token.
//!
//! Fault injection ([`Fault`]) applies to requests that serve file bytes, or to `/api/`
//! requests: status codes (500, 429 with `Retry-After`...), truncated bodies, wrong bytes, slow
//! streams. Its **hostile mode** covers what a broken or malicious hub does to a client that
//! trusts it: headers that never come, a body that never comes or stops midway, a 5xx whose
//! body never arrives, a `Content-Length` larger than the body, `rel="next"` pagination that
//! never ends; and [`Hub::set_ignore_range`] makes it a server that ignores `Range` (answers
//! `200` with the whole file), which composes with the faults. A fault
//! can be limited to the requests whose path contains a string (for `/api/` requests the path
//! is `{org}/{name}/revision/{rev}` or `{org}/{name}/tree/{rev}`). Counters ([`HubStats`])
//! report requests and bytes served. Everything is reachable in-process (tests) and over HTTP
//! under `/_hub/` (the binary: `--fault JSON` at start, `POST /_hub/faults`,
//! `DELETE /_hub/faults`, `GET /_hub/stats`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha1::Sha1;
use sha2::{Digest, Sha256};

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> HubError {
    let context = context.into();
    move |source| HubError::Io { context, source }
}

/// Where a file's bytes live.
#[derive(Clone, Debug)]
pub enum Content {
    Memory(Bytes),
    Disk(PathBuf),
}

#[derive(Debug)]
pub struct HubFile {
    pub content: Content,
    pub size: u64,
    pub lfs: bool,
    pub git_sha1: [u8; 20],
    pub sha256: [u8; 32],
}

impl HubFile {
    pub fn memory(bytes: impl Into<Bytes>, lfs: bool) -> Self {
        let bytes: Bytes = bytes.into();
        let mut s = Sha256::new();
        let mut g = Sha1::new();
        g.update(format!("blob {}\0", bytes.len()).as_bytes());
        s.update(&bytes);
        g.update(&bytes);
        Self {
            size: bytes.len() as u64,
            content: Content::Memory(bytes),
            lfs,
            git_sha1: g.finalize().into(),
            sha256: s.finalize().into(),
        }
    }

    /// Hashes a file on disk (one pass for both digests).
    pub fn disk(path: &Path, lfs: bool) -> Result<Self, HubError> {
        let ctx = path.display().to_string();
        let mut f = std::fs::File::open(path).map_err(io_err(&ctx))?;
        let size = f.metadata().map_err(io_err(&ctx))?.len();
        let mut s = Sha256::new();
        let mut g = Sha1::new();
        g.update(format!("blob {size}\0").as_bytes());
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf).map_err(io_err(&ctx))?;
            if n == 0 {
                break;
            }
            s.update(&buf[..n]);
            if !lfs {
                g.update(&buf[..n]);
            }
        }
        Ok(Self {
            content: Content::Disk(path.to_path_buf()),
            size,
            lfs,
            // LFS files are identified by sha256; their git object is the pointer file.
            git_sha1: if lfs {
                Sha1::digest(format!("lfs pointer {}", hex::encode(s.clone().finalize()))).into()
            } else {
                g.finalize().into()
            },
            sha256: s.finalize().into(),
        })
    }

    fn etag(&self) -> String {
        if self.lfs {
            format!("\"{}\"", hex::encode(self.sha256))
        } else {
            format!("\"{}\"", hex::encode(self.git_sha1))
        }
    }
}

#[derive(Debug)]
pub struct Commit {
    pub sha: String,
    pub files: BTreeMap<String, Arc<HubFile>>,
}

#[derive(Default, Debug)]
struct Repo {
    refs: HashMap<String, String>,
    commits: HashMap<String, Arc<Commit>>,
    token: Option<String>,
}

/// Which requests a fault applies to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultTarget {
    /// Requests that serve file bytes (`resolve` GETs and CDN GETs).
    #[default]
    File,
    /// `/api/...` requests.
    Api,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum FaultKind {
    /// Answer with this status (and `Retry-After` seconds if given) instead of the content.
    Status {
        status: u16,
        #[serde(default)]
        retry_after: Option<u64>,
    },
    /// Send the headers of the full answer, then close the connection after `after` body bytes.
    Truncate { after: u64 },
    /// Flip the bits of the first body byte.
    Corrupt,
    /// Send at most this many bytes per second.
    Slow { bytes_per_sec: u64 },
    /// Send the first chunk, then nothing for `secs` seconds (the body stops midway).
    Stall { secs: u64 },
    /// Send nothing at all, not even the response headers, for `secs` seconds.
    StallHeaders { secs: u64 },
    /// Send the headers, then no body byte for `secs` seconds.
    StallBody { secs: u64 },
    /// Answer with this status and a `Content-Length`, but send no body byte for `secs`
    /// seconds (then close the connection).
    StatusStalledBody { status: u16, secs: u64 },
    /// Declare a `Content-Length` `extra` bytes larger than the body, send the body, close.
    LyingLength { extra: u64 },
    /// Always add a `rel="next"` link to a tree listing, to a page further on, so that the
    /// pagination never ends (tree requests).
    EndlessPages,
}

/// The fault rules of a look-alike, in the order they were added.
#[derive(Default)]
pub struct FaultRules {
    rules: Mutex<Vec<Fault>>,
    applied: AtomicU64,
}

impl FaultRules {
    pub fn add(&self, fault: Fault) {
        self.rules.lock().unwrap().push(fault);
    }

    pub fn clear(&self) {
        self.rules.lock().unwrap().clear();
    }

    /// Faults applied so far.
    pub fn applied(&self) -> u64 {
        self.applied.load(Ordering::Relaxed)
    }

    /// The fault for a request to `path` of `target`: the first rule that matches and has
    /// requests left, which this request uses up by one.
    pub fn take(&self, target: FaultTarget, path: &str) -> Option<FaultKind> {
        let mut faults = self.rules.lock().unwrap();
        let i = faults.iter().position(|f| {
            f.count > 0 && f.target == target && f.path.as_deref().is_none_or(|p| path.contains(p))
        })?;
        faults[i].count -= 1;
        let kind = faults[i].kind.clone();
        if faults[i].count == 0 {
            faults.remove(i);
        }
        self.applied.fetch_add(1, Ordering::Relaxed);
        Some(kind)
    }
}

/// One fault rule: the next `count` matching requests get `kind`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Fault {
    #[serde(flatten)]
    pub kind: FaultKind,
    pub count: u64,
    /// Only requests for files whose path contains this string.
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default)]
    pub target: FaultTarget,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct HubStats {
    /// File body bytes sent.
    pub bytes_served: u64,
    /// GET requests for file bytes (resolve and CDN).
    pub file_requests: u64,
    /// Requests under `/api/`.
    pub api_requests: u64,
    /// Faults applied.
    pub faults_applied: u64,
    /// CDN requests that arrived with an `Authorization` header (must stay 0).
    pub cdn_requests_with_auth: u64,
    /// Requests that carried a bearer token, and those refused for a gated repository.
    pub authorized_requests: u64,
    pub refused_requests: u64,
}

#[derive(Clone, Debug)]
pub struct HubConfig {
    /// Tree entries per page (the real hub uses 1000 for recursive listings; tests use fewer to
    /// exercise pagination).
    pub page_size: usize,
    /// Body chunk size when streaming from memory or disk.
    pub chunk: usize,
    /// All file bodies together are sent at most this fast (bytes per second; 0: no limit),
    /// as through one link of a fixed bandwidth: a benchmark's throttled hub.
    pub rate_bytes_per_sec: u64,
}

impl Default for HubConfig {
    fn default() -> Self {
        Self {
            page_size: 1000,
            chunk: 256 << 10,
            rate_bytes_per_sec: 0,
        }
    }
}

#[derive(Default)]
struct Counters {
    bytes_served: AtomicU64,
    file_requests: AtomicU64,
    api_requests: AtomicU64,
    cdn_requests_with_auth: AtomicU64,
    authorized_requests: AtomicU64,
    refused_requests: AtomicU64,
}

/// An LFS file as the CDN serves it, and a path it has in some commit (for fault filters).
type CdnEntry = (Arc<HubFile>, String);

pub struct Hub {
    config: HubConfig,
    repos: Mutex<HashMap<String, Repo>>,
    /// LFS content by sha256 (what the CDN serves), with the first path it was added under.
    by_sha256: Mutex<HashMap<[u8; 32], CdnEntry>>,
    faults: FaultRules,
    counters: Counters,
    /// `http://host:port` of the CDN listener, when there is one.
    cdn: Mutex<Option<String>>,
    /// Answer every file request with the whole file, whatever its `Range`.
    ignore_range: std::sync::atomic::AtomicBool,
    /// When the shared link is free again (see [`HubConfig::rate_bytes_per_sec`]).
    link_free_at: Mutex<Option<tokio::time::Instant>>,
}

/// A running hub.
pub struct RunningHub {
    pub hub: Arc<Hub>,
    pub addr: SocketAddr,
    pub cdn_addr: Option<SocketAddr>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl RunningHub {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for RunningHub {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn commit_sha(repo: &str, files: &BTreeMap<String, Arc<HubFile>>) -> String {
    let mut h = Sha1::new();
    h.update(repo.as_bytes());
    for (p, f) in files {
        h.update(b"\n");
        h.update(p.as_bytes());
        h.update(b"\0");
        h.update(f.sha256);
    }
    hex::encode(h.finalize())
}

impl Hub {
    pub fn new(config: HubConfig) -> Arc<Self> {
        Arc::new(Self {
            config,
            repos: Mutex::default(),
            by_sha256: Mutex::default(),
            faults: FaultRules::default(),
            counters: Counters::default(),
            cdn: Mutex::default(),
            ignore_range: Default::default(),
            link_free_at: Mutex::default(),
        })
    }

    /// Waits until `n` body bytes have crossed the shared link (no wait without a rate): each
    /// chunk books the link after the ones before it, so all bodies together keep to the rate.
    async fn through_link(&self, n: u64) {
        let rate = self.config.rate_bytes_per_sec;
        if rate == 0 {
            return;
        }
        let done = {
            let mut free = self.link_free_at.lock().unwrap();
            let now = tokio::time::Instant::now();
            let start = free.filter(|t| *t > now).unwrap_or(now);
            let done = start + Duration::from_secs_f64(n as f64 / rate as f64);
            *free = Some(done);
            done
        };
        tokio::time::sleep_until(done).await;
    }

    /// Hostile mode: ignore `Range` headers (answer `200` with the whole file), as some
    /// servers and proxies do.
    pub fn set_ignore_range(&self, ignore: bool) {
        self.ignore_range.store(ignore, Ordering::Relaxed);
    }

    /// Adds a commit to `repo` and points `refs` (branches or tags) at it. Returns the commit.
    pub fn add_commit(&self, repo: &str, refs: &[&str], files: Vec<(String, HubFile)>) -> String {
        let files: BTreeMap<String, Arc<HubFile>> =
            files.into_iter().map(|(p, f)| (p, Arc::new(f))).collect();
        {
            let mut by = self.by_sha256.lock().unwrap();
            for (p, f) in &files {
                by.entry(f.sha256).or_insert_with(|| (f.clone(), p.clone()));
            }
        }
        let sha = commit_sha(repo, &files);
        let mut repos = self.repos.lock().unwrap();
        let r = repos.entry(repo.to_string()).or_default();
        r.commits.insert(
            sha.clone(),
            Arc::new(Commit {
                sha: sha.clone(),
                files,
            }),
        );
        for name in refs {
            r.refs.insert(name.to_string(), sha.clone());
        }
        sha
    }

    /// Makes `repo` gated: every request needs `Authorization: Bearer <token>`.
    pub fn set_gated(&self, repo: &str, token: &str) {
        self.repos
            .lock()
            .unwrap()
            .entry(repo.to_string())
            .or_default()
            .token = Some(token.to_string());
    }

    pub fn add_fault(&self, fault: Fault) {
        self.faults.add(fault);
    }

    pub fn clear_faults(&self) {
        self.faults.clear();
    }

    pub fn stats(&self) -> HubStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        HubStats {
            bytes_served: l(&c.bytes_served),
            file_requests: l(&c.file_requests),
            api_requests: l(&c.api_requests),
            faults_applied: self.faults.applied(),
            cdn_requests_with_auth: l(&c.cdn_requests_with_auth),
            authorized_requests: l(&c.authorized_requests),
            refused_requests: l(&c.refused_requests),
        }
    }

    /// Serves on `addr` (use port 0 for a random port); with `cdn_addr`, LFS files are
    /// redirected to a second listener there.
    pub async fn serve(
        self: &Arc<Self>,
        addr: SocketAddr,
        cdn_addr: Option<SocketAddr>,
    ) -> Result<RunningHub, HubError> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(io_err(format!("binding {addr}")))?;
        let addr = listener.local_addr().map_err(io_err("local address"))?;
        let mut tasks = Vec::new();
        let mut cdn_bound = None;
        if let Some(c) = cdn_addr {
            let l = tokio::net::TcpListener::bind(c)
                .await
                .map_err(io_err(format!("binding {c}")))?;
            let a = l.local_addr().map_err(io_err("local address"))?;
            *self.cdn.lock().unwrap() = Some(format!("http://{a}"));
            cdn_bound = Some(a);
            let app = self.router();
            tasks.push(tokio::spawn(async move {
                let _ = axum::serve(l, app).await;
            }));
        }
        let app = self.router();
        tasks.push(tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        }));
        Ok(RunningHub {
            hub: self.clone(),
            addr,
            cdn_addr: cdn_bound,
            tasks,
        })
    }

    fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/api/models/{org}/{name}/revision/{*rev}", get(revision))
            .route("/api/models/{org}/{name}/tree/{rev}", get(tree_root))
            .route(
                "/api/models/{org}/{name}/tree/{rev}/{*path}",
                get(tree_path),
            )
            .route(
                "/{org}/{name}/resolve/{rev}/{*path}",
                get(resolve).head(resolve),
            )
            .route("/api/models/{org}/revision/{*rev}", get(single_revision))
            .route("/api/models/{org}/tree/{rev}", get(single_tree_root))
            .route(
                "/api/models/{org}/tree/{rev}/{*path}",
                get(single_tree_path),
            )
            .route(
                "/{org}/resolve/{rev}/{*path}",
                get(single_resolve).head(single_resolve),
            )
            .route("/cdn/{sha}", get(cdn).head(cdn))
            .route(
                "/_hub/faults",
                axum::routing::post(post_faults).delete(delete_faults),
            )
            .route("/_hub/stats", get(get_stats))
            .with_state(self.clone())
    }

    /// The common start of an `/api/` request: count it and take the fault that applies to it
    /// (`what` is `{org}/{name}/{revision|tree}/{rev}`).
    fn api_start(&self, what: &str) -> Option<FaultKind> {
        self.counters.api_requests.fetch_add(1, Ordering::Relaxed);
        self.faults.take(FaultTarget::Api, what)
    }

    /// Checks access and finds the commit of an `/api/` request. Returns the repository name
    /// and the commit, or the response to send.
    fn api_commit(
        self: &Arc<Self>,
        org: &str,
        name: &str,
        rev: &str,
        headers: &HeaderMap,
    ) -> Result<(String, Arc<Commit>), Box<Response>> {
        let repo = repo_id(org, name);
        let commit = self.lookup(&repo, rev, headers)?;
        Ok((repo, commit))
    }

    /// Checks access and finds the commit `rev` names in `repo`.
    fn lookup(
        &self,
        repo: &str,
        rev: &str,
        headers: &HeaderMap,
    ) -> Result<Arc<Commit>, Box<Response>> {
        let repos = self.repos.lock().unwrap();
        let Some(r) = repos.get(repo) else {
            return Err(Box::new(hub_error(
                StatusCode::NOT_FOUND,
                "RepoNotFound",
                &format!("Repository Not Found for url: {repo}."),
            )));
        };
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if bearer.is_some() {
            self.counters
                .authorized_requests
                .fetch_add(1, Ordering::Relaxed);
        }
        if let Some(token) = &r.token {
            match bearer {
                Some(b) if b == token => {}
                Some(_) => {
                    self.counters
                        .refused_requests
                        .fetch_add(1, Ordering::Relaxed);
                    return Err(Box::new(hub_error(
                        StatusCode::FORBIDDEN,
                        "GatedRepo",
                        &format!("Access to model {repo} is restricted and you are not in the authorized list."),
                    )));
                }
                None => {
                    self.counters
                        .refused_requests
                        .fetch_add(1, Ordering::Relaxed);
                    return Err(Box::new(hub_error(
                        StatusCode::UNAUTHORIZED,
                        "GatedRepo",
                        &format!("Access to model {repo} is restricted. You must have access to it and be authenticated to access it."),
                    )));
                }
            }
        }
        let sha = r.refs.get(rev).cloned().unwrap_or_else(|| rev.to_string());
        r.commits.get(&sha).cloned().ok_or_else(|| {
            Box::new(hub_error(
                StatusCode::NOT_FOUND,
                "RevisionNotFound",
                &format!("Invalid rev id: {rev}"),
            ))
        })
    }
}

fn hub_error(status: StatusCode, code: &str, message: &str) -> Response {
    let mut resp = (status, Json(serde_json::json!({ "error": message }))).into_response();
    let h = resp.headers_mut();
    h.insert("x-error-code", HeaderValue::from_str(code).unwrap());
    if let Ok(v) = HeaderValue::from_str(message) {
        h.insert("x-error-message", v);
    }
    resp
}

type HubState = State<Arc<Hub>>;

/// `org/name`, or `name` alone for a single-part id (routed with an empty `org`).
fn repo_id(org: &str, name: &str) -> String {
    if org.is_empty() {
        name.to_owned()
    } else {
        format!("{org}/{name}")
    }
}

async fn single_revision(
    state: HubState,
    UrlPath((name, rev)): UrlPath<(String, String)>,
    headers: HeaderMap,
) -> Response {
    revision(state, UrlPath((String::new(), name, rev)), headers).await
}

async fn single_tree_root(
    state: HubState,
    UrlPath((name, rev)): UrlPath<(String, String)>,
    query: Query<TreeQuery>,
    headers: HeaderMap,
) -> Response {
    tree_root(state, UrlPath((String::new(), name, rev)), query, headers).await
}

async fn single_tree_path(
    state: HubState,
    UrlPath((name, rev, path)): UrlPath<(String, String, String)>,
    query: Query<TreeQuery>,
    headers: HeaderMap,
) -> Response {
    tree_path(
        state,
        UrlPath((String::new(), name, rev, path)),
        query,
        headers,
    )
    .await
}

async fn single_resolve(
    state: HubState,
    method: Method,
    UrlPath((name, rev, path)): UrlPath<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    resolve(
        state,
        method,
        UrlPath((String::new(), name, rev, path)),
        headers,
    )
    .await
}

async fn revision(
    State(hub): HubState,
    UrlPath((org, name, rev)): UrlPath<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let fault = hub.api_start(&format!("{org}/{name}/revision/{rev}"));
    let resp = revision_answer(&hub, &org, &name, &rev, &headers);
    apply_api_fault(resp, fault).await
}

fn revision_answer(
    hub: &Arc<Hub>,
    org: &str,
    name: &str,
    rev: &str,
    headers: &HeaderMap,
) -> Response {
    let (repo, commit) = match hub.api_commit(org, name, rev, headers) {
        Ok(found) => found,
        Err(r) => return *r,
    };
    let siblings: Vec<_> = commit
        .files
        .keys()
        .map(|p| serde_json::json!({ "rfilename": p }))
        .collect();
    Json(serde_json::json!({
        "_id": commit.sha,
        "id": repo,
        "modelId": repo,
        "sha": commit.sha,
        "private": false,
        "disabled": false,
        "gated": false,
        "tags": [],
        "siblings": siblings,
    }))
    .into_response()
}

/// Reshapes an `/api/` answer by a fault (faults that do not apply to `/api/` leave it as is).
async fn apply_api_fault(resp: Response, fault: Option<FaultKind>) -> Response {
    let Some(fault) = fault else {
        return resp;
    };
    match fault {
        FaultKind::Status {
            status,
            retry_after,
        } => return status_fault(status, retry_after),
        FaultKind::StatusStalledBody { status, secs } => return status_stalled_body(status, secs),
        FaultKind::StallHeaders { secs } => {
            tokio::time::sleep(Duration::from_secs(secs)).await;
            return resp;
        }
        FaultKind::Slow { .. } | FaultKind::EndlessPages => return resp,
        _ => {}
    }
    let (mut parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let len = bytes.len() as u64;
    let (first, rest, pause, declared) = match fault {
        FaultKind::Stall { secs } => {
            let half = bytes.len() / 2;
            (
                bytes.slice(..half),
                bytes.slice(half..),
                Duration::from_secs(secs),
                len,
            )
        }
        FaultKind::StallBody { secs } => (Bytes::new(), bytes, Duration::from_secs(secs), len),
        // The body goes out (with the headers) before it ends short of its length, as from a
        // real server; ending at once would close the connection before the headers are sent.
        FaultKind::LyingLength { extra } => {
            (bytes, Bytes::new(), Duration::from_millis(100), len + extra)
        }
        FaultKind::Truncate { after } => {
            let cut = (after as usize).min(bytes.len());
            (
                bytes.slice(..cut),
                Bytes::new(),
                Duration::from_millis(100),
                len,
            )
        }
        FaultKind::Corrupt => {
            let mut v = bytes.to_vec();
            if let Some(b) = v.first_mut() {
                *b ^= 0xff;
            }
            (Bytes::from(v), Bytes::new(), Duration::ZERO, len)
        }
        _ => unreachable!("handled above"),
    };
    parts
        .headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from(declared));
    use futures_util::StreamExt;
    let body = futures_util::stream::iter([first])
        .chain(futures_util::stream::once(async move {
            tokio::time::sleep(pause).await;
            rest
        }))
        .filter(|b| std::future::ready(!b.is_empty()))
        .map(Ok::<_, std::io::Error>);
    Response::from_parts(parts, Body::from_stream(body))
}

/// A status answer whose declared body never comes within `secs` seconds.
fn status_stalled_body(status: u16, secs: u64) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = futures_util::stream::once(async move {
        tokio::time::sleep(Duration::from_secs(secs)).await;
        Err::<Bytes, _>(std::io::Error::other("injected stalled error body"))
    });
    let mut resp = Response::new(Body::from_stream(body));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(100u64));
    resp
}

fn status_fault(status: u16, retry_after: Option<u64>) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = (status, "injected fault").into_response();
    if let Some(s) = retry_after {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(s));
    }
    resp
}

#[derive(Deserialize)]
struct TreeQuery {
    #[serde(default)]
    recursive: Option<String>,
    #[serde(default)]
    cursor: Option<usize>,
}

async fn tree_root(
    state: HubState,
    UrlPath((org, name, rev)): UrlPath<(String, String, String)>,
    query: Query<TreeQuery>,
    headers: HeaderMap,
) -> Response {
    let fault = state.0.api_start(&format!("{org}/{name}/tree/{rev}"));
    let endless = fault == Some(FaultKind::EndlessPages);
    let resp = tree(
        state,
        org,
        name,
        rev,
        String::new(),
        query,
        headers,
        endless,
    );
    apply_api_fault(resp, fault).await
}

async fn tree_path(
    state: HubState,
    UrlPath((org, name, rev, path)): UrlPath<(String, String, String, String)>,
    query: Query<TreeQuery>,
    headers: HeaderMap,
) -> Response {
    let fault = state.0.api_start(&format!("{org}/{name}/tree/{rev}"));
    let endless = fault == Some(FaultKind::EndlessPages);
    let resp = tree(state, org, name, rev, path, query, headers, endless);
    apply_api_fault(resp, fault).await
}

/// One page of a tree listing; with `endless`, a `rel="next"` link to a later page is added
/// whatever the listing holds.
#[allow(clippy::too_many_arguments)]
fn tree(
    State(hub): HubState,
    org: String,
    name: String,
    rev: String,
    prefix: String,
    Query(q): Query<TreeQuery>,
    headers: HeaderMap,
    endless: bool,
) -> Response {
    let (repo, commit) = match hub.api_commit(&org, &name, &rev, &headers) {
        Ok(found) => found,
        Err(r) => return *r,
    };
    let recursive = q
        .recursive
        .as_deref()
        .is_some_and(|r| r.eq_ignore_ascii_case("true") || r == "1");
    let prefix = prefix.trim_matches('/').to_string();
    let under = |p: &str| -> Option<String> {
        if prefix.is_empty() {
            Some(p.to_string())
        } else {
            p.strip_prefix(&format!("{prefix}/")).map(str::to_string)
        }
    };
    // Every entry (files and directories) below the prefix, sorted by path.
    let mut dirs = BTreeSet::new();
    let mut listed: Vec<(String, Option<&Arc<HubFile>>)> = Vec::new();
    for (path, f) in &commit.files {
        let Some(rel) = under(path) else { continue };
        let segs: Vec<&str> = rel.split('/').collect();
        for i in 1..segs.len() {
            if !recursive && i > 1 {
                break;
            }
            let d = segs[..i].join("/");
            dirs.insert(if prefix.is_empty() {
                d
            } else {
                format!("{prefix}/{d}")
            });
        }
        if recursive || segs.len() == 1 {
            listed.push((path.clone(), Some(f)));
        }
    }
    if !prefix.is_empty() && listed.is_empty() && dirs.is_empty() {
        return hub_error(
            StatusCode::NOT_FOUND,
            "EntryNotFound",
            &format!("{prefix} does not exist on {rev}"),
        );
    }
    listed.extend(dirs.into_iter().map(|d| (d, None)));
    listed.sort_by(|a, b| a.0.cmp(&b.0));
    let start = q.cursor.unwrap_or(0).min(listed.len());
    let end = (start + hub.config.page_size.max(1)).min(listed.len());
    let page: Vec<serde_json::Value> = listed[start..end]
        .iter()
        .map(|(p, f)| match f {
            Some(f) => {
                let mut v = serde_json::json!({
                    "type": "file",
                    "oid": hex::encode(f.git_sha1),
                    "size": f.size,
                    "path": p,
                });
                if f.lfs {
                    v["lfs"] = serde_json::json!({
                        "oid": hex::encode(f.sha256),
                        "size": f.size,
                        "pointerSize": 134,
                    });
                }
                v
            }
            None => serde_json::json!({
                "type": "directory",
                "oid": hex::encode(Sha1::digest(p.as_bytes())),
                "size": 0,
                "path": p,
            }),
        })
        .collect();
    let mut resp = Json(page).into_response();
    if end < listed.len() || endless {
        // Endless: always a page further on than the one asked for, so no URL repeats.
        let end = if end < listed.len() {
            end
        } else {
            end.max(q.cursor.unwrap_or(0) + 1)
        };
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("127.0.0.1");
        let path = if prefix.is_empty() {
            format!("/api/models/{repo}/tree/{}", commit.sha)
        } else {
            format!("/api/models/{repo}/tree/{}/{prefix}", commit.sha)
        };
        let link = format!(
            "<http://{host}{path}?recursive={}&cursor={end}>; rel=\"next\"",
            if recursive { "true" } else { "false" }
        );
        if let Ok(v) = HeaderValue::from_str(&link) {
            resp.headers_mut().insert(header::LINK, v);
        }
    }
    resp
}

async fn resolve(
    State(hub): HubState,
    method: Method,
    UrlPath((org, name, rev, path)): UrlPath<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let repo = repo_id(&org, &name);
    let commit = match hub.lookup(&repo, &rev, &headers) {
        Ok(c) => c,
        Err(r) => return *r,
    };
    let Some(file) = commit.files.get(&path).cloned() else {
        return hub_error(
            StatusCode::NOT_FOUND,
            "EntryNotFound",
            &format!("{path} does not exist on {rev}"),
        );
    };
    let cdn = hub.cdn.lock().unwrap().clone();
    if let (true, Some(cdn)) = (file.lfs, cdn) {
        let mut resp = StatusCode::FOUND.into_response();
        let h = resp.headers_mut();
        let location = format!("{cdn}/cdn/{}", hex::encode(file.sha256));
        h.insert(header::LOCATION, HeaderValue::from_str(&location).unwrap());
        add_file_headers(h, &commit.sha, &file);
        return resp;
    }
    serve_file(&hub, &method, &headers, &path, file, Some(&commit.sha)).await
}

async fn cdn(
    State(hub): HubState,
    method: Method,
    UrlPath(sha): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    if headers.contains_key(header::AUTHORIZATION) {
        hub.counters
            .cdn_requests_with_auth
            .fetch_add(1, Ordering::Relaxed);
    }
    let mut key = [0u8; 32];
    if hex::decode_to_slice(&sha, &mut key).is_err() {
        return StatusCode::NOT_FOUND.into_response();
    }
    let Some((file, path)) = hub.by_sha256.lock().unwrap().get(&key).cloned() else {
        return StatusCode::NOT_FOUND.into_response();
    };
    serve_file(&hub, &method, &headers, &path, file, None).await
}

fn add_file_headers(h: &mut HeaderMap, commit: &str, file: &HubFile) {
    h.insert("x-repo-commit", HeaderValue::from_str(commit).unwrap());
    h.insert(header::ETAG, HeaderValue::from_str(&file.etag()).unwrap());
    if file.lfs {
        h.insert(
            "x-linked-etag",
            HeaderValue::from_str(&file.etag()).unwrap(),
        );
        h.insert("x-linked-size", HeaderValue::from(file.size));
    }
}

/// `Range: bytes=a-b | a- | -n` -> `[start, end)`; `Err` when unsatisfiable.
fn parse_range(v: &str, size: u64) -> Option<Result<(u64, u64), ()>> {
    let spec = v.trim().strip_prefix("bytes=")?;
    if spec.contains(',') {
        return None;
    }
    let (a, b) = spec.split_once('-')?;
    let (a, b) = (a.trim(), b.trim());
    let r = if a.is_empty() {
        let n: u64 = b.parse().ok()?;
        if n == 0 {
            return Some(Err(()));
        }
        (size.saturating_sub(n), size)
    } else {
        let start: u64 = a.parse().ok()?;
        let end = if b.is_empty() {
            size
        } else {
            b.parse::<u64>().ok()?.saturating_add(1).min(size)
        };
        if start >= size || start >= end {
            return Some(Err(()));
        }
        (start, end)
    };
    Some(Ok(r))
}

async fn serve_file(
    hub: &Arc<Hub>,
    method: &Method,
    headers: &HeaderMap,
    path: &str,
    file: Arc<HubFile>,
    commit: Option<&str>,
) -> Response {
    let mut fault = None;
    if *method == Method::GET {
        hub.counters.file_requests.fetch_add(1, Ordering::Relaxed);
        fault = hub.faults.take(FaultTarget::File, path);
        match fault {
            Some(FaultKind::Status {
                status,
                retry_after,
            }) => return status_fault(status, retry_after),
            Some(FaultKind::StatusStalledBody { status, secs }) => {
                return status_stalled_body(status, secs)
            }
            Some(FaultKind::StallHeaders { secs }) => {
                tokio::time::sleep(Duration::from_secs(secs)).await
            }
            _ => {}
        }
    }
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| parse_range(v, file.size))
        .filter(|_| !hub.ignore_range.load(Ordering::Relaxed));
    let (status, start, end) = match range {
        None => (StatusCode::OK, 0, file.size),
        Some(Ok((s, e))) => (StatusCode::PARTIAL_CONTENT, s, e),
        Some(Err(())) => {
            let mut r = StatusCode::RANGE_NOT_SATISFIABLE.into_response();
            r.headers_mut().insert(
                header::CONTENT_RANGE,
                HeaderValue::from_str(&format!("bytes */{}", file.size)).unwrap(),
            );
            return r;
        }
    };
    let declared = match fault {
        Some(FaultKind::LyingLength { extra }) => end - start + extra,
        _ => end - start,
    };
    let mut h = HeaderMap::new();
    if let Some(c) = commit {
        add_file_headers(&mut h, c, &file);
    } else {
        h.insert(header::ETAG, HeaderValue::from_str(&file.etag()).unwrap());
    }
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(declared));
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    if status == StatusCode::PARTIAL_CONTENT {
        h.insert(
            header::CONTENT_RANGE,
            HeaderValue::from_str(&format!("bytes {start}-{}/{}", end - 1, file.size)).unwrap(),
        );
    }
    let body = if *method == Method::HEAD {
        Body::empty()
    } else {
        Body::from_stream(body_stream(hub.clone(), file, start, end, fault))
    };
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    *resp.headers_mut() = h;
    resp
}

struct BodyState {
    hub: Arc<Hub>,
    file: Arc<HubFile>,
    disk: Option<std::fs::File>,
    at: u64,
    end: u64,
    sent: u64,
    fault: Option<FaultKind>,
}

fn body_stream(
    hub: Arc<Hub>,
    file: Arc<HubFile>,
    start: u64,
    end: u64,
    fault: Option<FaultKind>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> {
    let state = BodyState {
        hub,
        file,
        disk: None,
        at: start,
        end,
        sent: 0,
        fault,
    };
    futures_util::stream::unfold(state, |mut st| async move {
        if st.at >= st.end {
            return None;
        }
        let mut n = (st.end - st.at).min(st.hub.config.chunk as u64);
        match &st.fault {
            Some(FaultKind::Truncate { after }) => {
                if st.sent >= *after {
                    let e = std::io::Error::other("injected truncation");
                    st.at = st.end;
                    return Some((Err(e), st));
                }
                n = n.min(after - st.sent);
            }
            Some(FaultKind::Slow { bytes_per_sec }) => {
                n = n.min((bytes_per_sec / 10).max(1));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Some(FaultKind::Stall { secs }) if st.sent > 0 => {
                tokio::time::sleep(Duration::from_secs(*secs)).await;
                st.fault = None;
            }
            Some(FaultKind::StallBody { secs }) => {
                tokio::time::sleep(Duration::from_secs(*secs)).await;
                st.fault = None;
            }
            _ => {}
        }
        let chunk = match &st.file.content {
            Content::Memory(b) => b.slice(st.at as usize..(st.at + n) as usize),
            Content::Disk(p) => {
                if st.disk.is_none() {
                    match std::fs::File::open(p) {
                        Ok(f) => st.disk = Some(f),
                        Err(e) => {
                            st.at = st.end;
                            return Some((Err(e), st));
                        }
                    }
                }
                let f = st.disk.as_ref().unwrap();
                let mut buf = vec![0u8; n as usize];
                use std::os::unix::fs::FileExt;
                if let Err(e) = f.read_exact_at(&mut buf, st.at) {
                    st.at = st.end;
                    return Some((Err(e), st));
                }
                Bytes::from(buf)
            }
        };
        st.hub.through_link(n).await;
        let chunk = if st.sent == 0 && st.fault == Some(FaultKind::Corrupt) {
            let mut v = chunk.to_vec();
            v[0] ^= 0xff;
            Bytes::from(v)
        } else {
            chunk
        };
        st.at += n;
        st.sent += n;
        st.hub.counters.bytes_served.fetch_add(n, Ordering::Relaxed);
        Some((Ok(chunk), st))
    })
}

async fn post_faults(State(hub): HubState, Json(faults): Json<Vec<Fault>>) -> StatusCode {
    for f in faults {
        hub.add_fault(f);
    }
    StatusCode::NO_CONTENT
}

async fn delete_faults(State(hub): HubState) -> StatusCode {
    hub.clear_faults();
    StatusCode::NO_CONTENT
}

async fn get_stats(State(hub): HubState) -> Json<HubStats> {
    Json(hub.stats())
}

/// Files of a directory tree as hub files: LFS when at least `lfs_threshold` bytes or a weights
/// extension (as `.gitattributes` of model repositories do).
pub fn files_from_dir(dir: &Path, lfs_threshold: u64) -> Result<Vec<(String, HubFile)>, HubError> {
    let mut paths = Vec::new();
    for e in walkdir::WalkDir::new(dir)
        .follow_links(true)
        .sort_by_file_name()
    {
        let e = e.map_err(|e| io_err(dir.display().to_string())(e.into()))?;
        if e.file_type().is_dir() {
            continue;
        }
        let rel = e.path().strip_prefix(dir).expect("below the root");
        paths.push((rel.to_string_lossy().into_owned(), e.path().to_path_buf()));
    }
    paths.sort();
    let mut out = Vec::new();
    for (rel, p) in paths {
        let size = std::fs::metadata(&p)
            .map_err(io_err(p.display().to_string()))?
            .len();
        let weights = [".safetensors", ".bin", ".pt", ".gguf", ".onnx"]
            .iter()
            .any(|x| rel.ends_with(x));
        out.push((rel, HubFile::disk(&p, size >= lfs_threshold || weights)?));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two downloads at once share the rate: 4 MiB at 8 MiB/s take half a second however
    /// many requests carry them.
    #[tokio::test]
    async fn the_rate_bounds_all_bodies_together() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let hub = Hub::new(HubConfig {
            rate_bytes_per_sec: 8 << 20,
            ..HubConfig::default()
        });
        let content = Bytes::from(vec![7u8; 2 << 20]);
        hub.add_commit(
            "org/m",
            &["main"],
            vec![("w.bin".into(), HubFile::memory(content, false))],
        );
        let running = hub
            .serve("127.0.0.1:0".parse().unwrap(), None)
            .await
            .unwrap();
        let url = format!("{}/org/m/resolve/main/w.bin", running.url());
        let started = std::time::Instant::now();
        let get = |url: String| async move {
            reqwest::get(url)
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap()
                .len()
        };
        let (a, b) = tokio::join!(get(url.clone()), get(url));
        let took = started.elapsed();
        assert_eq!((a, b), (2 << 20, 2 << 20));
        assert!(took >= Duration::from_millis(450), "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
    }

    #[test]
    fn ranges() {
        assert_eq!(parse_range("bytes=0-9", 100), Some(Ok((0, 10))));
        assert_eq!(parse_range("bytes=90-", 100), Some(Ok((90, 100))));
        assert_eq!(parse_range("bytes=-10", 100), Some(Ok((90, 100))));
        assert_eq!(parse_range("bytes=95-200", 100), Some(Ok((95, 100))));
        assert_eq!(parse_range("bytes=100-", 100), Some(Err(())));
        assert_eq!(parse_range("bytes=0-1,5-6", 100), None);
        assert_eq!(parse_range("items=0-1", 100), None);
    }

    #[test]
    fn faults_parse_from_json() {
        let f: Vec<Fault> = serde_json::from_str(
            r#"[{"kind":"status","status":429,"retry_after":1,"count":3},
                {"kind":"truncate","after":100,"count":1,"path":"model"}]"#,
        )
        .unwrap();
        assert_eq!(
            f[0].kind,
            FaultKind::Status {
                status: 429,
                retry_after: Some(1)
            }
        );
        assert_eq!(f[1].path.as_deref(), Some("model"));
        assert_eq!(f[1].target, FaultTarget::File);
        let hostile: Vec<Fault> = serde_json::from_str(
            r#"[{"kind":"endless_pages","count":9,"target":"api","path":"/tree/"},
                {"kind":"status_stalled_body","status":503,"secs":60,"count":1},
                {"kind":"lying_length","extra":10,"count":1,"target":"api"}]"#,
        )
        .unwrap();
        assert_eq!(hostile[0].kind, FaultKind::EndlessPages);
        assert_eq!(hostile[0].target, FaultTarget::Api);
        assert_eq!(
            hostile[1].kind,
            FaultKind::StatusStalledBody {
                status: 503,
                secs: 60
            }
        );
        assert_eq!(hostile[2].kind, FaultKind::LyingLength { extra: 10 });
    }
}
