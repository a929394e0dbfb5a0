//! `oci://n/<namespace>/b/<bucket>/o/<prefix>`: OCI Object Storage, as OME's agent reads it.
//!
//! Semantics (OME's `gopher.go` and its object-store client):
//! * The objects whose names start with `<prefix>/` are the artifact; each file's path is the
//!   object name with `<prefix>/` removed (an empty prefix takes the whole bucket). Zero-byte
//!   names ending in `/` are the console's folder markers and are skipped. The listing goes
//!   through [`Manifest::new`], so hostile names (`..`, absolute, empty segments, a name that
//!   is both a file and a prefix) fail the model with a reason and nothing is written.
//! * OME's legacy URI forms (`<namespace>@<region>/<bucket>/<prefix>`, `<bucket>/<prefix>`)
//!   name the same objects; without a namespace each session asks the service for the
//!   tenancy's (`GET /n/`), and object identities always carry the namespace used, so a
//!   model in one form reuses a copy made in another.
//! * `parameters.region` picks the endpoint `https://objectstorage.<region>.oraclecloud.com`
//!   (else the legacy form's region, else the credentials' region); env `MODELFS_OCI_ENDPOINT` overrides the endpoint (private
//!   endpoints, tests). `parameters.auth` picks the credentials ([`auth`]).
//! * Integrity as OME checks it: the object's MD5 (the listing's `md5`, which is
//!   `Content-MD5`/`opc-content-md5`); for a multipart upload (`opc-multipart-md5`,
//!   `<base64>-<parts>`) the `opc-meta-md5` metadata when the uploader set it, else the size
//!   only (OME skips the check for those; the multipart MD5 would need each part's size,
//!   which the service does not report), which the model's status reports
//!   (`integrity: size-only`). On top, as for every source, the store names each
//!   blob by the sha256 it computed while writing. Each file's digest is an object identity
//!   (location, size, ETag) plus that MD5, so a rewritten object makes a new artifact.
//! * Every range is pinned to the listed version: it carries `If-Match: <ETag>` (the ETag of
//!   the listing, or after a restart of one HEAD whose identity must be the entry's). An
//!   object rewritten while it is downloaded, even with the same size, answers `412`: the
//!   download stops ([`TransferError::Changed`]) and the model is listed again, so bytes of
//!   two versions are never joined into one file (each version has its own partial file,
//!   named by its identity).
//! * Requests are signed ([`sign`]). 401/403/404 fail the model with the service's `code` and
//!   `message` (never key material); the rest of the retry policy is the pipeline's.
//! * Fetch: [`OciObjects`] is the [`RangeSource`] adapter of the shared
//!   [`pipeline`](crate::source::pipeline) (files in parallel, large files as parallel ranges,
//!   resume with `Range` after an error or a restart, verification, the node-wide transfer
//!   limit, progress). Credentials are read once per resolve and once per fetch.

pub mod auth;
pub mod sign;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use reqwest::{Method, StatusCode};
use serde::Deserialize;

use self::auth::{AgentOciEnv, AuthMode, Credentials};
use self::sign::RequestToSign;
use super::hf::{DownloadTuning, HubClient};
use super::pipeline::{self, ListedObject, RangeBody, RangeSource, TransferError, Transfers};
use super::ranged;
pub(crate) use super::ranged::network;
use super::{FetchContext, SourceError, Token};
use crate::metrics::SourceScheme;
use modelfs_core::artifact::{object_identity, FileDigest, Manifest, ManifestEntry, Sha256Digest};

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

/// One `oci://` source as a model sees it.
#[derive(Clone, Debug)]
pub struct OciSource {
    /// `None` for OME's legacy `oci://<bucket>/<prefix>` form: each session asks the service
    /// for the tenancy's namespace (`GET /n/`), as OME's client does.
    pub namespace: Option<String>,
    pub bucket: String,
    /// Without a trailing `/`; empty for the whole bucket.
    pub prefix: String,
    auth: AuthMode,
    region: Option<String>,
    /// The source as its URI shows it (log lines and reasons).
    shown: String,
    /// The TensorRT-LLM shape alias: only objects whose name contains `/<alias>/` are kept
    /// (`modelfs_ome::shape`).
    shape: Option<String>,
    /// The model's Secret entry (user principal profile and key), if any.
    secret: Option<Token>,
    client: Arc<HubClient>,
    config: Arc<OciConfig>,
    throttle: crate::source::ThrottleObserver,
    /// The ETag of each listed object name, from the last resolve: the version every range
    /// must match (`If-Match`).
    etags: Arc<Mutex<HashMap<String, String>>>,
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
    /// The URI's namespace, or the one the service named.
    namespace: String,
}

impl OciSource {
    /// `uri_region` is the region of OME's legacy `<namespace>@<region>` form: used when
    /// `parameters.region` names none (OME's agent reads only the parameter; the URI's region
    /// is what its writer meant, and without it the credentials' region applies anyway).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        namespace: Option<String>,
        uri_region: Option<String>,
        bucket: String,
        prefix: String,
        parameters: &BTreeMap<String, String>,
        secret: Option<Token>,
        client: Arc<HubClient>,
        config: Arc<OciConfig>,
    ) -> Result<Self, TransferError> {
        let auth = AuthMode::from_parameter(parameters.get("auth").map(String::as_str))?;
        let shown = modelfs_ome::source::SourceUri::Oci {
            namespace: namespace.clone(),
            region: uri_region.clone(),
            bucket: bucket.clone(),
            prefix: prefix.clone(),
        }
        .to_string();
        Ok(Self {
            namespace,
            bucket,
            prefix,
            auth,
            region: parameters
                .get("region")
                .filter(|r| !r.trim().is_empty())
                .cloned()
                .or(uri_region),
            shown,
            shape: None,
            secret,
            client,
            config,
            throttle: Default::default(),
            etags: Arc::default(),
        })
    }

    /// Keeps only the objects of the TensorRT-LLM shape `alias` (`None`: every object).
    pub fn with_shape(self, alias: Option<String>) -> Self {
        Self {
            shape: alias,
            ..self
        }
    }

    /// Reports every wait this source spends on HTTP 429 to `observer`.
    pub fn with_throttle_observer(self, observer: crate::source::ThrottleObserver) -> Self {
        Self {
            throttle: observer,
            ..self
        }
    }

    fn label(&self) -> String {
        self.shown.clone()
    }

    fn transfers(&self) -> &Transfers {
        self.client.transfers()
    }

    fn tuning(&self) -> &DownloadTuning {
        self.transfers().tuning()
    }

    /// Credentials and endpoint, read afresh (tokens and keys rotate).
    async fn session(&self) -> Result<Signed, TransferError> {
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
                    .ok_or_else(|| TransferError::Config {
                        what: self.label(),
                        detail: "no region for the OCI endpoint: set parameters.region (or \
                                 region in the credentials)"
                            .into(),
                    })?;
                if !region
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-')
                {
                    return Err(TransferError::Config {
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
        let mut session = Signed {
            creds,
            endpoint,
            namespace: self.namespace.clone().unwrap_or_default(),
        };
        if self.namespace.is_none() {
            session.namespace = self.tenancy_namespace(&session).await?;
        }
        Ok(session)
    }

    /// `GET /n/`: the namespace of the credentials' tenancy, for a URI that names none. The
    /// answer is a JSON string; it is checked as a URI's namespace would be, since it is
    /// spliced into every request path and object identity.
    async fn tenancy_namespace(&self, session: &Signed) -> Result<String, TransferError> {
        let what = format!("the namespace of {}", self.label());
        let deadline = self.tuning().request_timeout;
        let attempt = async {
            let resp = self
                .send(session, &what, Method::GET, "/n/", None, None)
                .await?;
            let body = resp.bytes().await.map_err(|e| network(&what, e))?;
            serde_json::from_slice::<String>(&body).map_err(|e| TransferError::Protocol {
                what: what.clone(),
                detail: format!("malformed answer: {e}"),
            })
        };
        let namespace = tokio::time::timeout(deadline, attempt)
            .await
            .map_err(|_| TransferError::TimedOut {
                what: what.clone(),
                secs: deadline.as_secs(),
            })??;
        if namespace.is_empty()
            || namespace.len() > 128
            || !namespace
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
            || namespace.chars().all(|c| c == '.')
        {
            return Err(TransferError::Protocol {
                what,
                detail: format!(
                    "the service named an invalid namespace {:?}",
                    namespace.chars().take(60).collect::<String>()
                ),
            });
        }
        Ok(namespace)
    }

    fn object_path(&self, session: &Signed, name: &str) -> String {
        format!(
            "/n/{}/b/{}/o/{}",
            encode(&session.namespace),
            encode(&self.bucket),
            encode(name)
        )
    }

    /// Sends one signed request and waits for the headers (`stall_timeout`); a non-success
    /// answer is the service's error.
    async fn send(
        &self,
        session: &Signed,
        what: &str,
        method: Method,
        path_and_query: &str,
        range: Option<String>,
        if_match: Option<&str>,
    ) -> Result<reqwest::Response, TransferError> {
        let url = format!("{}{}", session.endpoint, path_and_query);
        let parsed = reqwest::Url::parse(&url).map_err(|e| TransferError::Protocol {
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
        if let Some(range) = range {
            req = req.header(reqwest::header::RANGE, range);
        }
        if let Some(etag) = if_match {
            req = req.header(reqwest::header::IF_MATCH, etag);
        }
        let resp = self
            .transfers()
            .within_stall(what, async {
                req.send().await.map_err(|e| network(what, e))
            })
            .await?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        Err(self.status_error(what, resp).await)
    }

    /// The service's error: `{"code": ..., "message": ...}` plus `opc-request-id`.
    async fn status_error(&self, what: &str, resp: reqwest::Response) -> TransferError {
        let status = resp.status().as_u16();
        let header = |n: &str| {
            resp.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(|s| s.chars().take(120).collect::<String>())
        };
        let request_id = header("opc-request-id");
        let retry_after = header("retry-after").and_then(|v| pipeline::parse_retry_after(&v));
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
        let mut message = field("message").unwrap_or_else(|| {
            StatusCode::from_u16(status)
                .ok()
                .and_then(|s| s.canonical_reason())
                .unwrap_or("unexpected status")
                .to_string()
        });
        if let Some(id) = request_id {
            message.push_str(&format!(" (opc-request-id {id})"));
        }
        TransferError::Status {
            what: format!("{what} (OCI Object Storage)"),
            status,
            code: field("code"),
            message,
            retry_after,
        }
    }

    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        session: &Signed,
        what: &str,
        path_and_query: &str,
        cancel: &AtomicBool,
    ) -> Result<T, TransferError> {
        let deadline = self.tuning().request_timeout;
        self.transfers()
            .retrying(what, cancel, &self.throttle, || async {
                let attempt = async {
                    let resp = self
                        .send(session, what, Method::GET, path_and_query, None, None)
                        .await?;
                    let body = resp.bytes().await.map_err(|e| network(what, e))?;
                    serde_json::from_slice::<T>(&body).map_err(|e| TransferError::Protocol {
                        what: what.into(),
                        detail: format!("malformed JSON: {e}"),
                    })
                };
                tokio::time::timeout(deadline, attempt).await.map_err(|_| {
                    TransferError::TimedOut {
                        what: what.into(),
                        secs: deadline.as_secs(),
                    }
                })?
            })
            .await
    }

    /// Lists the objects under the prefix (one HEAD per multipart object, for its
    /// `opc-meta-md5`) and builds the manifest.
    pub async fn resolve(&self, cancel: Arc<AtomicBool>) -> Result<Manifest, SourceError> {
        let session = self.session().await?;
        let list_prefix = if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        };
        let tuning = self.tuning().clone();
        let limit = |detail: String| TransferError::Limit {
            what: self.label(),
            detail,
        };
        let mut objects = Vec::new();
        let mut etags = Vec::new();
        let mut start: Option<String> = None;
        for page_number in 1.. {
            if page_number > tuning.max_listing_pages {
                return Err(limit(format!(
                    "the listing has more than {} pages (--hf-max-listing-pages)",
                    tuning.max_listing_pages
                ))
                .into());
            }
            let mut query = format!(
                "/n/{}/b/{}/o?prefix={}&fields=name%2Csize%2Cmd5%2Cetag",
                encode(&session.namespace),
                encode(&self.bucket),
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
                if !object.name.starts_with(&list_prefix) {
                    return Err(TransferError::Protocol {
                        what: self.label(),
                        detail: format!(
                            "the listing returned {:?}, which is not under the prefix",
                            object.name.chars().take(200).collect::<String>()
                        ),
                    }
                    .into());
                }
                let size = object.size.ok_or_else(|| TransferError::Protocol {
                    what: self.label(),
                    detail: format!(
                        "object {:?} has no size",
                        object.name.chars().take(200).collect::<String>()
                    ),
                })?;
                if size == 0 && object.name.ends_with('/') {
                    objects.push(ListedObject {
                        key: object.name,
                        size,
                        version: String::new(),
                        md5: None,
                        crc32c: None,
                    });
                    continue; // a folder marker, skipped by the manifest
                }
                let md5 = self.md5_of(&session, &object, &cancel).await?;
                if let Some(etag) = &object.etag {
                    etags.push((object.name.clone(), etag.clone()));
                }
                objects.push(ListedObject {
                    version: object
                        .etag
                        .clone()
                        .or(object.md5.clone())
                        .unwrap_or_default(),
                    key: object.name,
                    size,
                    md5,
                    crc32c: None,
                });
                if objects.len() > tuning.max_listing_entries {
                    return Err(limit(format!(
                        "the listing has more than {} objects (--hf-max-listing-entries)",
                        tuning.max_listing_entries
                    ))
                    .into());
                }
            }
            match page.next_start_with {
                Some(next) if !next.is_empty() => {
                    if start.as_deref().is_some_and(|s| next.as_str() <= s) {
                        return Err(TransferError::Protocol {
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
        if !objects
            .iter()
            .any(|o| !(o.size == 0 && o.key.ends_with('/')))
        {
            return Err(TransferError::Config {
                what: self.label(),
                detail: format!(
                    "no objects found under namespace {}, bucket {}, object prefix {:?}",
                    session.namespace, self.bucket, list_prefix
                ),
            }
            .into());
        }
        if let Some(alias) = &self.shape {
            // OME's gopher filters the listing by the full object name (prefix included).
            objects.retain(|o| modelfs_ome::shape::keeps(&o.key, alias));
            if !objects
                .iter()
                .any(|o| !(o.size == 0 && o.key.ends_with('/')))
            {
                return Err(TransferError::Config {
                    what: self.label(),
                    detail: modelfs_ome::shape::nothing_kept_reason(alias),
                }
                .into());
            }
            tracing::info!(source = %self.label(), shape = %alias, objects = objects.len(), "TensorRT-LLM serving model: kept the objects of the node's shape");
        }
        let manifest =
            pipeline::manifest_from_listing(&self.location(&session), &self.prefix, objects)?;
        let mut pinned = self.etags.lock().expect("etag map");
        pinned.clear();
        pinned.extend(etags);
        Ok(manifest)
    }

    /// `oci://n/<namespace>/b/<bucket>`: the location part of every object's identity (the
    /// namespace the session uses, so the legacy forms name the same objects as OME's form).
    fn location(&self, session: &Signed) -> String {
        format!("oci://n/{}/b/{}", session.namespace, self.bucket)
    }

    /// The ETag `entry` was listed with: from the last listing, or (a fetch after a restart,
    /// with a manifest from the records) from a HEAD whose identity must be the entry's.
    /// `None` for a store that reports no ETag (nothing to pin; the MD5 or size still checks).
    async fn pinned_etag(
        &self,
        session: &Signed,
        what: &str,
        entry: &ManifestEntry,
    ) -> Result<Option<String>, TransferError> {
        let name = self.full_name(&entry.path);
        if let Some(etag) = self.etags.lock().expect("etag map").get(&name) {
            return Ok(Some(etag.clone()));
        }
        let resp = self
            .send(
                session,
                what,
                Method::HEAD,
                &self.object_path(session, &name),
                None,
                None,
            )
            .await?;
        let header = |n: &str| {
            resp.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let etag = header("etag");
        let md5 = header("opc-multipart-md5").or_else(|| header("opc-content-md5"));
        let size = resp
            .headers()
            .get(reqwest::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let version = etag.clone().or(md5).unwrap_or_default();
        let identity = size.map(|size| {
            object_identity(
                &format!("{}/{name}", self.location(session)),
                size,
                &version,
            )
        });
        match entry.digest {
            FileDigest::Object { identity: want, .. } if Some(want) == identity => {
                if let Some(etag) = &etag {
                    self.etags
                        .lock()
                        .expect("etag map")
                        .insert(name, etag.clone());
                }
                Ok(etag)
            }
            _ => Err(TransferError::Changed { what: what.into() }),
        }
    }

    /// The MD5 the store checks: the listing's, or for a multipart upload its `opc-meta-md5`
    /// (one HEAD); `None` (size only, as OME) for a multipart upload without it.
    async fn md5_of(
        &self,
        session: &Signed,
        object: &ObjectSummary,
        cancel: &AtomicBool,
    ) -> Result<Option<[u8; 16]>, TransferError> {
        let bad_md5 = |v: &str| TransferError::Protocol {
            what: self.label(),
            detail: format!(
                "object {:?} has an invalid md5 {:?}",
                object.name.chars().take(200).collect::<String>(),
                v.chars().take(60).collect::<String>()
            ),
        };
        if let Some(md5) = object.md5.as_deref().filter(|m| !is_multipart_md5(m)) {
            return decode_md5(md5).map(Some).ok_or_else(|| bad_md5(md5));
        }
        let what = format!("HEAD {}", object.name);
        let path = self.object_path(session, &object.name);
        let headers = self
            .transfers()
            .retrying(&what, cancel, &self.throttle, || async {
                let r = self
                    .send(session, &what, Method::HEAD, &path, None, None)
                    .await?;
                Ok(r.headers().clone())
            })
            .await?;
        let header = |n: &str| {
            headers
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        match header("opc-meta-md5").or_else(|| header("content-md5")) {
            Some(md5) => decode_md5(&md5).map(Some).ok_or_else(|| bad_md5(&md5)),
            None => {
                tracing::info!(source = %self.label(), object = %object.name, "multipart object without opc-meta-md5: checked by size only, as OME does");
                Ok(None)
            }
        }
    }

    /// Fetches every entry the store lacks through the shared pipeline.
    pub async fn fetch(
        &self,
        manifest: Arc<Manifest>,
        ctx: FetchContext,
    ) -> Result<Vec<Sha256Digest>, SourceError> {
        let objects = OciObjects {
            src: self,
            session: self.session().await?,
        };
        Ok(pipeline::fetch(&objects, self.transfers(), manifest, ctx).await?)
    }

    fn full_name(&self, rel: &str) -> String {
        if self.prefix.is_empty() {
            rel.to_string()
        } else {
            format!("{}/{rel}", self.prefix)
        }
    }
}

/// The objects of one `oci://` source for the pipeline: one signed ranged GET per call.
pub struct OciObjects<'a> {
    src: &'a OciSource,
    session: Signed,
}

impl RangeSource for OciObjects<'_> {
    fn label(&self) -> String {
        self.src.label()
    }

    fn scheme(&self) -> SourceScheme {
        SourceScheme::Oci
    }

    fn throttle(&self) -> &crate::source::ThrottleObserver {
        &self.src.throttle
    }

    async fn open_range(
        &self,
        what: &str,
        entry: &ManifestEntry,
        at: u64,
        end: Option<u64>,
    ) -> Result<RangeBody, TransferError> {
        let etag = self.src.pinned_etag(&self.session, what, entry).await?;
        let path = self
            .src
            .object_path(&self.session, &self.src.full_name(&entry.path));
        let range = ranged::range_header(at, end);
        let sent = self
            .src
            .send(
                &self.session,
                what,
                Method::GET,
                &path,
                Some(range),
                etag.as_deref(),
            )
            .await;
        let resp = match sent {
            Ok(resp) => resp,
            // Another version now: forget the pinned ETags, the model is listed again.
            Err(TransferError::Status { status: 412, .. }) => {
                self.src.etags.lock().expect("etag map").clear();
                return Err(TransferError::Changed { what: what.into() });
            }
            Err(e) => return Err(e),
        };
        ranged::range_answer(what, "an object", at, resp)
    }
}
