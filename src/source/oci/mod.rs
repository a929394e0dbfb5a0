//! `oci://n/<namespace>/b/<bucket>/o/<prefix>`: OCI Object Storage, as OME's agent reads it.
//!
//! Semantics (OME's `gopher.go` and its object-store client):
//! * The objects whose names start with `<prefix>/` are the artifact; each file's path is the
//!   object name with `<prefix>/` removed (an empty prefix takes the whole bucket). Zero-byte
//!   names ending in `/` are the console's folder markers and are skipped. The listing goes
//!   through [`Manifest::new`], so hostile names (`..`, absolute, empty segments, a name that
//!   is both a file and a prefix) fail the model with a reason and nothing is written.
//! * `parameters.region` picks the endpoint `https://objectstorage.<region>.oraclecloud.com`
//!   (else the credentials' region); env `MODELFS_OCI_ENDPOINT` overrides the endpoint (private
//!   endpoints, tests). `parameters.auth` picks the credentials ([`auth`]).
//! * Integrity as OME checks it: the object's MD5 (the listing's `md5`, which is
//!   `Content-MD5`/`opc-content-md5`); for a multipart upload (`opc-multipart-md5`,
//!   `<base64>-<parts>`) the `opc-meta-md5` metadata when the uploader set it, else the size
//!   only (OME skips the check for those). On top, as for every source, the store names each
//!   blob by the sha256 it computed while writing. The per-file digest is the MD5 (or a hash of
//!   the multipart tag and ETag), so a rewritten object makes a new artifact.
//! * Requests are signed ([`sign`]). Transient failures (5xx, 429, 408, resets, stalls, short
//!   bodies) are retried with jittered backoff under the Hugging Face tuning flags; 401/403/404
//!   fail the model with the service's `code` and `message` (never key material).
//! * Fetch: files in parallel (`max_files`), each a stream into the store's partial file,
//!   resumed with `Range` from the partial file's length after an error or a restart
//!   (SIGKILL), holding a slot of the node-wide transfer limit. Unlike `hf://`, one file is one
//!   stream (no parallel ranges within a file yet).

pub mod auth;
pub mod sign;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::BytesMut;
use futures_util::{stream, StreamExt};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use reqwest::{Method, StatusCode};
use serde::Deserialize;
use sha2::Digest as _;

use self::auth::{AgentOciEnv, AuthMode, Credentials};
use self::sign::RequestToSign;
use super::hf::{DownloadTuning, HubClient};
use super::{FetchContext, SourceError, Token};
use crate::artifact::{FileDigest, Manifest, ManifestEntry, Sha256Digest};
use crate::metrics::SourceScheme;
use crate::store::StoreError;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// Unreserved characters stay; everything else in a path segment or query value is escaped.
const COMPONENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

fn encode(s: &str) -> String {
    utf8_percent_encode(s, COMPONENT).to_string()
}

/// Daemon-wide OCI settings (from the environment at start).
#[derive(Clone, Debug, Default)]
pub struct OciConfig {
    /// `MODELFS_OCI_ENDPOINT`: replaces `https://objectstorage.<region>.oraclecloud.com`.
    pub endpoint: Option<String>,
    pub env: AgentOciEnv,
}

impl OciConfig {
    pub fn from_env() -> Self {
        Self {
            endpoint: std::env::var("MODELFS_OCI_ENDPOINT")
                .ok()
                .map(|e| e.trim_end_matches('/').to_string())
                .filter(|e| !e.is_empty()),
            env: AgentOciEnv::from_env(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error(
        "{what}: OCI Object Storage answered HTTP {status} ({code}): {message}{}",
        request_id.as_deref().map(|r| format!(" (opc-request-id {r})")).unwrap_or_default()
    )]
    Status {
        what: String,
        status: u16,
        code: String,
        message: String,
        request_id: Option<String>,
        retry_after: Option<Duration>,
    },
    #[error("{what}: {detail}")]
    Network { what: String, detail: String },
    #[error("{what}: the body ended after {got} of {want} bytes")]
    Truncated { what: String, got: u64, want: u64 },
    #[error("{what}: no data received for {secs}s")]
    Stalled { what: String, secs: u64 },
    #[error("{what}: invalid answer from OCI Object Storage: {detail}")]
    Protocol { what: String, detail: String },
    #[error("OCI credentials ({mode}): {detail}")]
    Credentials { mode: &'static str, detail: String },
    #[error(
        "no region for the OCI endpoint: set parameters.region (or region in the credentials)"
    )]
    NoRegion,
    #[error(
        "no objects found under namespace {namespace}, bucket {bucket}, object prefix {prefix:?}"
    )]
    Empty {
        namespace: String,
        bucket: String,
        prefix: String,
    },
    #[error("{path}: downloaded bytes failed verification {attempts} times ({detail})")]
    Corrupt {
        path: String,
        attempts: u32,
        detail: String,
    },
    #[error("{last} (gave up after {attempts} attempts)")]
    Exhausted { attempts: u32, last: Box<OciError> },
    #[error("storing {path}: {source}")]
    Store {
        path: String,
        #[source]
        source: StoreError,
    },
    #[error("cancelled")]
    Cancelled,
}

impl OciError {
    pub fn is_retryable(&self) -> bool {
        match self {
            OciError::Status { status, .. } => *status == 408 || *status == 429 || *status >= 500,
            OciError::Network { .. } | OciError::Truncated { .. } | OciError::Stalled { .. } => {
                true
            }
            _ => false,
        }
    }

    pub fn is_transient(&self) -> bool {
        match self {
            OciError::Exhausted { last, .. } => !matches!(**last, OciError::Truncated { .. }),
            OciError::Cancelled => true,
            OciError::Store { source, .. } => {
                matches!(source, StoreError::DiskFull { .. } | StoreError::Io { .. })
            }
            other => other.is_retryable(),
        }
    }

    /// How the failure counts in OME's download metrics (see [`SourceError::ome_outcome`]).
    pub fn ome_outcome(&self) -> Option<crate::metrics::DownloadOutcome> {
        use crate::metrics::DownloadOutcome;
        Some(match self {
            OciError::Cancelled => return None,
            OciError::Corrupt { .. } => DownloadOutcome::VerificationFailed,
            OciError::Status { status: 429, .. } => DownloadOutcome::RateLimited,
            OciError::Exhausted { last, .. } => return last.ome_outcome(),
            _ => DownloadOutcome::Failed,
        })
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            OciError::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

impl From<OciError> for SourceError {
    fn from(e: OciError) -> Self {
        match e {
            OciError::Cancelled => SourceError::Cancelled,
            other => SourceError::Oci(other),
        }
    }
}

/// One `oci://` source as a model sees it.
#[derive(Clone, Debug)]
pub struct OciSource {
    pub namespace: String,
    pub bucket: String,
    /// Without a trailing `/`; empty for the whole bucket.
    pub prefix: String,
    auth: AuthMode,
    region: Option<String>,
    /// The model's Secret entry (user principal profile and key), if any.
    secret: Option<Token>,
    client: Arc<HubClient>,
    config: Arc<OciConfig>,
}

#[derive(Deserialize)]
struct ListPage {
    #[serde(default)]
    objects: Vec<ObjectSummary>,
    #[serde(rename = "nextStartWith")]
    next_start_with: Option<String>,
}

#[derive(Deserialize)]
struct ObjectSummary {
    name: String,
    size: Option<u64>,
    md5: Option<String>,
    etag: Option<String>,
}

/// A multipart upload's MD5: `<base64>-<part count>`.
fn is_multipart_md5(md5: &str) -> bool {
    md5.rsplit_once('-').is_some_and(|(b, n)| {
        !b.is_empty() && !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit())
    })
}

fn decode_md5(value: &str) -> Option<[u8; 16]> {
    B64.decode(value.trim()).ok()?.try_into().ok()
}

/// The credentials and endpoint of one resolve or fetch.
struct Signed {
    creds: Credentials,
    endpoint: String,
}

impl OciSource {
    pub fn new(
        namespace: String,
        bucket: String,
        prefix: String,
        parameters: &BTreeMap<String, String>,
        secret: Option<Token>,
        client: Arc<HubClient>,
        config: Arc<OciConfig>,
    ) -> Result<Self, OciError> {
        let auth = AuthMode::from_parameter(parameters.get("auth").map(String::as_str))?;
        Ok(Self {
            namespace,
            bucket,
            prefix,
            auth,
            region: parameters
                .get("region")
                .filter(|r| !r.trim().is_empty())
                .cloned(),
            secret,
            client,
            config,
        })
    }

    fn label(&self) -> String {
        format!(
            "oci://n/{}/b/{}/o/{}",
            self.namespace, self.bucket, self.prefix
        )
    }

    fn tuning(&self) -> &DownloadTuning {
        &self.client.config().tuning
    }

    /// Credentials and endpoint, read afresh (tokens and keys rotate).
    async fn session(&self) -> Result<Signed, OciError> {
        let creds = auth::credentials(
            self.auth,
            self.secret.as_ref().map(Token::expose),
            &self.config.env,
            self.client.http(),
            self.tuning().request_timeout,
        )
        .await?;
        let endpoint = match &self.config.endpoint {
            Some(e) => e.clone(),
            None => {
                let region = self
                    .region
                    .clone()
                    .or_else(|| creds.region.clone())
                    .ok_or(OciError::NoRegion)?;
                if !region
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-')
                {
                    return Err(OciError::Protocol {
                        what: "parameters.region".into(),
                        detail: format!(
                            "invalid region {:?}",
                            region.chars().take(60).collect::<String>()
                        ),
                    });
                }
                format!("https://objectstorage.{region}.oraclecloud.com")
            }
        };
        Ok(Signed { creds, endpoint })
    }

    fn object_path(&self, name: &str) -> String {
        let name = name.split('/').map(encode).collect::<Vec<_>>().join("%2F");
        format!(
            "/n/{}/b/{}/o/{}",
            encode(&self.namespace),
            encode(&self.bucket),
            name
        )
    }

    /// Sends one signed request and waits for the headers (`stall_timeout`).
    async fn send(
        &self,
        session: &Signed,
        what: &str,
        method: Method,
        path_and_query: &str,
        range: Option<(u64, u64)>,
    ) -> Result<reqwest::Response, OciError> {
        let url = format!("{}{}", session.endpoint, path_and_query);
        let parsed = reqwest::Url::parse(&url).map_err(|e| OciError::Protocol {
            what: what.into(),
            detail: format!("bad URL: {e}"),
        })?;
        let host = sign::host_header(&parsed);
        let date = sign::http_date_now();
        let headers = session.creds.key.sign(&RequestToSign {
            method: method.as_str(),
            path_and_query,
            host: &host,
            date: &date,
            body: None,
        });
        let mut req = self.client.http().request(method, parsed);
        for (name, value) in headers {
            req = req.header(name, value);
        }
        if let Some((start, end)) = range {
            req = req.header(reqwest::header::RANGE, format!("bytes={start}-{end}"));
        }
        let stall = self.tuning().stall_timeout;
        let resp = tokio::time::timeout(stall, req.send())
            .await
            .map_err(|_| OciError::Stalled {
                what: what.into(),
                secs: stall.as_secs(),
            })?
            .map_err(|e| network(what, e))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        Err(self.status_error(what, resp).await)
    }

    /// The service's error: `{"code": ..., "message": ...}` plus `opc-request-id`.
    async fn status_error(&self, what: &str, resp: reqwest::Response) -> OciError {
        let status = resp.status().as_u16();
        let header = |n: &str| {
            resp.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(|s| s.chars().take(120).collect::<String>())
        };
        let request_id = header("opc-request-id");
        let retry_after = header("retry-after")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(|s| Duration::from_secs(s.min(3600)));
        let body = tokio::time::timeout(self.tuning().stall_timeout, resp.bytes())
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        let json: Option<serde_json::Value> =
            serde_json::from_slice(&body[..body.len().min(64 << 10)]).ok();
        let field = |k: &str| {
            json.as_ref()
                .and_then(|j| j.get(k))
                .and_then(|v| v.as_str())
                .map(|s| {
                    s.chars()
                        .filter(|c| !c.is_control())
                        .take(300)
                        .collect::<String>()
                })
        };
        OciError::Status {
            what: what.into(),
            status,
            code: field("code").unwrap_or_else(|| "Unknown".into()),
            message: field("message").unwrap_or_else(|| {
                StatusCode::from_u16(status)
                    .ok()
                    .and_then(|s| s.canonical_reason())
                    .unwrap_or("unexpected status")
                    .to_string()
            }),
            request_id,
            retry_after,
        }
    }

    fn backoff(&self, attempt: u32, err: &OciError) -> Duration {
        let t = self.tuning();
        if let Some(after) = err.retry_after() {
            return after.min(t.retry_max);
        }
        let step = t
            .retry_base
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(16))
            .min(t.retry_max);
        step.mul_f64(0.5 + 0.5 * fastrand::f64())
    }

    async fn retrying<T, F, Fut>(
        &self,
        what: &str,
        cancel: &AtomicBool,
        mut op: F,
    ) -> Result<T, OciError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, OciError>>,
    {
        let max = self.tuning().max_attempts.max(1);
        let mut attempt = 0;
        loop {
            if cancel.load(Ordering::Relaxed) {
                return Err(OciError::Cancelled);
            }
            attempt += 1;
            match op().await {
                Ok(v) => return Ok(v),
                Err(e) if e.is_retryable() && attempt < max => {
                    let delay = self.backoff(attempt, &e);
                    tracing::warn!(%what, attempt, error = %e, delay_ms = delay.as_millis() as u64, "retrying");
                    sleep_unless_cancelled(delay, cancel).await?;
                }
                Err(e) if e.is_retryable() => {
                    return Err(OciError::Exhausted {
                        attempts: attempt,
                        last: Box::new(e),
                    })
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        session: &Signed,
        what: &str,
        path_and_query: &str,
        cancel: &AtomicBool,
    ) -> Result<T, OciError> {
        let deadline = self.tuning().request_timeout;
        self.retrying(what, cancel, || async {
            let attempt = async {
                let resp = self
                    .send(session, what, Method::GET, path_and_query, None)
                    .await?;
                let body = resp.bytes().await.map_err(|e| network(what, e))?;
                serde_json::from_slice::<T>(&body).map_err(|e| OciError::Protocol {
                    what: what.into(),
                    detail: format!("malformed JSON: {e}"),
                })
            };
            tokio::time::timeout(deadline, attempt)
                .await
                .map_err(|_| OciError::Stalled {
                    what: what.into(),
                    secs: deadline.as_secs(),
                })?
        })
        .await
    }

    /// Lists the objects under the prefix and builds the manifest (one HEAD per multipart
    /// object, for its `opc-meta-md5`).
    pub async fn resolve(&self, cancel: Arc<AtomicBool>) -> Result<Manifest, SourceError> {
        let session = self.session().await?;
        let list_prefix = if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        };
        let tuning = self.tuning().clone();
        let mut entries = Vec::new();
        let mut start: Option<String> = None;
        let mut pages = 0usize;
        loop {
            pages += 1;
            if pages > tuning.max_listing_pages {
                return Err(OciError::Protocol {
                    what: self.label(),
                    detail: format!(
                        "the listing has more than {} pages (--hf-max-listing-pages)",
                        tuning.max_listing_pages
                    ),
                }
                .into());
            }
            let mut query = format!(
                "{}?prefix={}&fields=name%2Csize%2Cmd5%2Cetag",
                format_args!(
                    "/n/{}/b/{}/o",
                    encode(&self.namespace),
                    encode(&self.bucket)
                ),
                encode(&list_prefix)
            );
            if let Some(s) = &start {
                query.push_str(&format!("&start={}", encode(s)));
            }
            let page: ListPage = self
                .get_json(
                    &session,
                    &format!("listing {}", self.label()),
                    &query,
                    &cancel,
                )
                .await?;
            for object in page.objects {
                let Some(rel) = object.name.strip_prefix(&list_prefix) else {
                    return Err(OciError::Protocol {
                        what: self.label(),
                        detail: format!(
                            "the listing returned {:?}, which is not under the prefix",
                            object.name.chars().take(200).collect::<String>()
                        ),
                    }
                    .into());
                };
                let size = object.size.ok_or_else(|| OciError::Protocol {
                    what: self.label(),
                    detail: format!(
                        "object {:?} has no size",
                        rel.chars().take(200).collect::<String>()
                    ),
                })?;
                if size == 0 && (rel.is_empty() || rel.ends_with('/')) {
                    continue; // a folder marker
                }
                let digest = self.digest_of(&session, &object, rel, &cancel).await?;
                entries.push(ManifestEntry {
                    path: rel.to_string(),
                    size,
                    digest,
                });
                if entries.len() > tuning.max_listing_entries {
                    return Err(OciError::Protocol {
                        what: self.label(),
                        detail: format!(
                            "the listing has more than {} objects (--hf-max-listing-entries)",
                            tuning.max_listing_entries
                        ),
                    }
                    .into());
                }
            }
            match page.next_start_with {
                Some(next) if !next.is_empty() => {
                    if start.as_deref().is_some_and(|s| next.as_str() <= s) {
                        return Err(OciError::Protocol {
                            what: self.label(),
                            detail: "nextStartWith does not advance".into(),
                        }
                        .into());
                    }
                    start = Some(next)
                }
                _ => break,
            }
        }
        if entries.is_empty() {
            return Err(OciError::Empty {
                namespace: self.namespace.clone(),
                bucket: self.bucket.clone(),
                prefix: list_prefix,
            }
            .into());
        }
        let manifest = Manifest::new(String::new(), entries)?;
        let revision = manifest.id().to_string();
        Ok(Manifest::new(revision, manifest.entries().to_vec())?)
    }

    /// The digest the store checks: the MD5, the multipart upload's `opc-meta-md5`, or a
    /// version tag (size-only check).
    async fn digest_of(
        &self,
        session: &Signed,
        object: &ObjectSummary,
        rel: &str,
        cancel: &AtomicBool,
    ) -> Result<FileDigest, OciError> {
        let bad_md5 = |v: &str| OciError::Protocol {
            what: self.label(),
            detail: format!(
                "object {:?} has an invalid md5 {:?}",
                rel,
                v.chars().take(60).collect::<String>()
            ),
        };
        match object.md5.as_deref() {
            Some(md5) if !is_multipart_md5(md5) => {
                return decode_md5(md5)
                    .map(FileDigest::Md5)
                    .ok_or_else(|| bad_md5(md5))
            }
            _ => {}
        }
        let what = format!("HEAD {rel}");
        let path = self.object_path(&object.name);
        let headers = self
            .retrying(&what, cancel, || async {
                let r = self.send(session, &what, Method::HEAD, &path, None).await?;
                Ok(r.headers().clone())
            })
            .await?;
        let header = |n: &str| {
            headers
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        if let Some(md5) = header("opc-meta-md5").or_else(|| header("content-md5")) {
            return decode_md5(&md5)
                .map(FileDigest::Md5)
                .ok_or_else(|| bad_md5(&md5));
        }
        let tag = format!(
            "oci-multipart:{}:{}",
            header("opc-multipart-md5")
                .or(object.md5.clone())
                .unwrap_or_default(),
            header("etag").or(object.etag.clone()).unwrap_or_default()
        );
        tracing::info!(source = %self.label(), object = %rel, "multipart object without opc-meta-md5: checked by size only, as OME does");
        Ok(FileDigest::ObjectVersion(sha2::Sha256::digest(tag).into()))
    }

    /// Fetches every entry the store lacks; returns the sha256 blob of every entry.
    pub async fn fetch(
        &self,
        manifest: Arc<Manifest>,
        ctx: FetchContext,
    ) -> Result<Vec<Sha256Digest>, SourceError> {
        let session = Arc::new(self.session().await?);
        let entries = manifest.entries();
        let progress = ctx.progress.clone();
        progress
            .total_bytes
            .store(manifest.total_size(), Ordering::Relaxed);
        progress
            .total_files
            .store(entries.len() as u64, Ordering::Relaxed);
        progress.completed_bytes.store(0, Ordering::Relaxed);
        progress.completed_files.store(0, Ordering::Relaxed);
        let mut blobs: Vec<Option<Sha256Digest>> = vec![None; entries.len()];
        let mut todo: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut by_digest: std::collections::HashMap<FileDigest, usize> = Default::default();
        for (i, e) in entries.iter().enumerate() {
            let have = match ctx.reuse_existing(e)? {
                Some(sha) => Some(sha),
                None => ctx.store.lookup_alias(&e.digest, e.size),
            };
            match have {
                Some(sha) => {
                    blobs[i] = Some(sha);
                    progress
                        .completed_bytes
                        .fetch_add(e.size, Ordering::Relaxed);
                    progress.completed_files.fetch_add(1, Ordering::Relaxed);
                }
                None => match by_digest.get(&e.digest) {
                    Some(&t) => todo[t].1.push(i),
                    None => {
                        by_digest.insert(e.digest, todo.len());
                        todo.push((i, Vec::new()));
                    }
                },
            }
        }
        todo.sort_by_key(|(i, _)| (std::cmp::Reverse(entries[*i].size), *i));
        tracing::info!(source = %self.label(), files = todo.len(), "downloading");
        let max_files = self.tuning().max_files.max(1);
        let mut downloads = stream::iter(todo)
            .map(|(i, same)| {
                let session = session.clone();
                let ctx = &ctx;
                let entry = &entries[i];
                async move { (i, same, self.fetch_entry(&session, entry, ctx).await) }
            })
            .buffer_unordered(max_files);
        while let Some((i, same, result)) = downloads.next().await {
            let sha = result?;
            blobs[i] = Some(sha);
            for j in same {
                blobs[j] = Some(sha);
                progress
                    .completed_bytes
                    .fetch_add(entries[j].size, Ordering::Relaxed);
                progress.completed_files.fetch_add(1, Ordering::Relaxed);
            }
        }
        drop(downloads);
        let store = ctx.store.clone();
        tokio::task::spawn_blocking(move || store.sync())
            .await
            .map_err(SourceError::from_join)?
            .map_err(|source| SourceError::Store {
                path: "blobs".into(),
                source,
            })?;
        Ok(blobs
            .into_iter()
            .map(|b| b.expect("every entry fetched"))
            .collect())
    }

    /// One file: resume the partial file, stream the rest with `Range`, verify, publish.
    async fn fetch_entry(
        &self,
        session: &Signed,
        entry: &ManifestEntry,
        ctx: &FetchContext,
    ) -> Result<Sha256Digest, OciError> {
        let store_err = |source| OciError::Store {
            path: entry.path.clone(),
            source,
        };
        let verify_attempts = self.tuning().verify_attempts.max(1);
        let mut last_mismatch = String::new();
        for _ in 0..verify_attempts {
            let (store, digest, size) = (ctx.store.clone(), entry.digest, entry.size);
            let writer = tokio::task::spawn_blocking(move || store.resume_writer(digest, size))
                .await
                .map_err(|_| OciError::Cancelled)?
                .map_err(store_err)?;
            let resumed = writer.written();
            ctx.progress
                .completed_bytes
                .fetch_add(resumed, Ordering::Relaxed);
            let what = format!("GET {}", entry.path);
            let mut writer = writer;
            let max = self.tuning().max_attempts.max(1);
            let mut attempt = 0;
            loop {
                if ctx.cancel.load(Ordering::Relaxed) {
                    return Err(OciError::Cancelled);
                }
                attempt += 1;
                match self
                    .stream_into(session, entry, &mut writer, ctx, &what)
                    .await
                {
                    Ok(()) => break,
                    Err(e) if e.is_retryable() && attempt < max => {
                        let delay = self.backoff(attempt, &e);
                        tracing::warn!(%what, attempt, error = %e, delay_ms = delay.as_millis() as u64, "retrying");
                        sleep_unless_cancelled(delay, &ctx.cancel).await?;
                    }
                    Err(e) if e.is_retryable() => {
                        return Err(OciError::Exhausted {
                            attempts: attempt,
                            last: Box::new(e),
                        })
                    }
                    Err(e) => return Err(e),
                }
            }
            let written = writer.written();
            let committed = tokio::task::spawn_blocking(move || writer.commit())
                .await
                .map_err(|_| OciError::Cancelled)?;
            match committed {
                Ok(sha) => {
                    ctx.store
                        .record_alias(&entry.digest, &sha)
                        .map_err(store_err)?;
                    ctx.progress.completed_files.fetch_add(1, Ordering::Relaxed);
                    ctx.record_fetched(SourceScheme::Oci, written - resumed);
                    return Ok(sha);
                }
                Err(StoreError::DigestMismatch { expected, actual }) => {
                    tracing::warn!(file = %entry.path, %expected, %actual, "downloaded bytes failed verification; downloading again");
                    ctx.progress.completed_bytes.fetch_sub(
                        written.min(ctx.progress.completed_bytes.load(Ordering::Relaxed)),
                        Ordering::Relaxed,
                    );
                    last_mismatch = format!("expected {expected}, got {actual}");
                }
                Err(e) => return Err(store_err(e)),
            }
        }
        Err(OciError::Corrupt {
            path: entry.path.clone(),
            attempts: verify_attempts,
            detail: last_mismatch,
        })
    }

    /// One attempt: GET the missing range and append it to `writer`. Leaves what was written
    /// in place on an error (a valid prefix to resume from).
    async fn stream_into(
        &self,
        session: &Signed,
        entry: &ManifestEntry,
        writer: &mut crate::store::BlobWriter,
        ctx: &FetchContext,
        what: &str,
    ) -> Result<(), OciError> {
        let size = entry.size;
        let start = writer.written();
        if start >= size {
            return Ok(());
        }
        let _permit = self.client.transfer_slot().await;
        let path = self.object_path(&self.full_name(&entry.path));
        let mut resp = self
            .send(session, what, Method::GET, &path, Some((start, size - 1)))
            .await?;
        let body_len = size - start;
        match resp.status() {
            StatusCode::PARTIAL_CONTENT => {}
            StatusCode::OK if start == 0 => {}
            other => {
                return Err(OciError::Protocol {
                    what: what.into(),
                    detail: format!("HTTP {} to a Range request", other.as_u16()),
                })
            }
        }
        let stall = self.tuning().stall_timeout;
        let mut got = 0u64;
        let mut buf = BytesMut::new();
        loop {
            if ctx.cancel.load(Ordering::Relaxed) {
                return Err(OciError::Cancelled);
            }
            let chunk = tokio::time::timeout(stall, resp.chunk())
                .await
                .map_err(|_| OciError::Stalled {
                    what: what.into(),
                    secs: stall.as_secs(),
                });
            let chunk = match chunk {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    flush(writer, &mut buf, entry).await?;
                    let _ = e;
                    return Err(OciError::Truncated {
                        what: what.into(),
                        got,
                        want: body_len,
                    });
                }
                Err(e) => {
                    flush(writer, &mut buf, entry).await?;
                    return Err(e);
                }
            };
            let Some(chunk) = chunk else { break };
            got += chunk.len() as u64;
            if got > body_len {
                return Err(OciError::Protocol {
                    what: what.into(),
                    detail: format!("the body is longer than the {body_len} bytes asked for"),
                });
            }
            ctx.progress
                .completed_bytes
                .fetch_add(chunk.len() as u64, Ordering::Relaxed);
            buf.extend_from_slice(&chunk);
            if buf.len() >= 1 << 20 {
                flush(writer, &mut buf, entry).await?;
            }
        }
        flush(writer, &mut buf, entry).await?;
        if got < body_len {
            return Err(OciError::Truncated {
                what: what.into(),
                got,
                want: body_len,
            });
        }
        Ok(())
    }

    fn full_name(&self, rel: &str) -> String {
        if self.prefix.is_empty() {
            rel.to_string()
        } else {
            format!("{}/{rel}", self.prefix)
        }
    }
}

/// Appends the buffered bytes to the partial file (on a blocking thread).
async fn flush(
    writer: &mut crate::store::BlobWriter,
    buf: &mut BytesMut,
    entry: &ManifestEntry,
) -> Result<(), OciError> {
    if buf.is_empty() {
        return Ok(());
    }
    let bytes = buf.split().freeze();
    let multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    let result = if multi_thread {
        tokio::task::block_in_place(|| writer.write_all(&bytes))
    } else {
        writer.write_all(&bytes)
    };
    result.map_err(|source| OciError::Store {
        path: entry.path.clone(),
        source,
    })
}

async fn sleep_unless_cancelled(d: Duration, cancel: &AtomicBool) -> Result<(), OciError> {
    let end = tokio::time::Instant::now() + d;
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(OciError::Cancelled);
        }
        let now = tokio::time::Instant::now();
        if now >= end {
            return Ok(());
        }
        tokio::time::sleep((end - now).min(Duration::from_millis(200))).await;
    }
}

fn network(what: &str, e: reqwest::Error) -> OciError {
    let mut detail = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        detail.push_str(": ");
        detail.push_str(&s.to_string());
        src = s.source();
    }
    OciError::Network {
        what: what.into(),
        detail,
    }
}
