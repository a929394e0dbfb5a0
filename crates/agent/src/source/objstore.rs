//! `s3://`, `gs://`, `az://`: models from object stores, through the `object_store` crate, as
//! [`RangeSource`] adapters of the shared [`pipeline`](crate::source::pipeline).
//!
//! # URIs
//! * `s3://<bucket>[@<region>]/<prefix>` (OME's form; the region may also come from
//!   `parameters.region` or `AWS_REGION`).
//! * `gs://<bucket>/<prefix>`: listed and downloaded through the Cloud Storage JSON API
//!   ([`super::gcs`], which explains why), with `object_store`'s GCS credentials.
//! * `az://<container>/<prefix>` with the account from `parameters.account_name` or
//!   `AZURE_STORAGE_ACCOUNT_NAME`, or OME's full form
//!   `az://<account>.blob.core.windows.net/<container>/<prefix>`. (OME's short form
//!   `az://<account>/<container>/<prefix>` cannot be told from the container form and is read
//!   as the latter.)
//!
//! The objects below the prefix (a directory: `p` holds `p/...`) are the artifact, named by
//! their keys relative to it; [`manifest_from_listing`] refuses hostile keys.
//!
//! # Identity and integrity
//! Object stores vouch for no sha256 before the download. Each file's digest is
//! [`FileDigest::Object`](modelfs_core::artifact::FileDigest::Object): its location, size and ETag (or
//! version id), so a changed object is a new artifact and `ReuseIfExists` maps only onto a
//! copy of the same object versions. Every range is requested with `If-Match: <ETag>`, so the
//! bytes of one file all come from the version that was listed (`gs://`: the generation, with
//! `ifGenerationMatch`); an object that changed stops the download
//! ([`TransferError::Changed`]) and the model is listed again. The size is checked and the
//! sha256 computed while writing, as for every source, and so is what the store publishes
//! about the bytes ([`RangeSource::content_check`]): GCS's `md5Hash` (in the manifest) or,
//! for a composed object, its `crc32c`; Azure's `Content-MD5`; for S3, from one `HEAD` of the
//! listed version with `x-amz-checksum-mode: ENABLED`, best first: a full-object checksum
//! (CRC32, CRC32C, CRC64NVME, SHA1, SHA256), a composite checksum (`<value>-<N>`, the
//! checksum of the parts' checksums), the ETag when it is the MD5 of the bytes (a single-part
//! upload without SSE-KMS or SSE-C) or of the parts' MD5s (`<md5>-<N>`, a multipart upload
//! without SSE-KMS or SSE-C). Composite values need each part's size: one
//! `HEAD ?partNumber=N` per part gives its `Content-Length` (remembered per object version;
//! sizes that do not add up to the object's, as from a store that ignores `partNumber`,
//! leave the value unused). Azure takes one HEAD per file. A file with none of these (an
//! SSE-KMS multipart object without a checksum, a store that answers no part HEAD) is checked
//! by its size only, the reason logged, and the model's status says so
//! (`integrity: size-only`).
//!
//! # Credentials and settings
//! The usual environment of each cloud (`object_store`'s `from_env`: `AWS_*`, `GOOGLE_*`,
//! `AZURE_*`), overridden by the model: its token (the Secret entry named by
//! `parameters.secretKey`, or `parameters.token`) is the secret part (S3: the secret access key,
//! with `parameters.access_key_id`; GCS: a service account key JSON; Azure: the account key),
//! and `parameters.region` / `parameters.endpoint` (an S3-compatible store; `http://` allowed
//! for it) / `parameters.account_name` / `parameters.anonymous: "true"` (unsigned requests). The
//! names follow OME's `pkg/auth` configuration (`access_key_id`, `account_name`, `region`).
//!
//! # Retries
//! `object_store`'s own retries are off: the pipeline's one policy applies. The
//! [`RecordingConnector`] keeps the status, body and `Retry-After` of an error answer (which
//! `object_store`'s error does not let a caller read) for the request that got it, so a
//! `503 SlowDown` or `429` is retried after the server's delay and a refusal fails with the
//! server's code and message.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetRange, ObjectStore, RetryConfig};

use super::checks::{
    md5_from_base64, s3_checksum, s3_etag_md5, s3_multipart_etag, Algorithm, AnyOf, ChecksumKind,
    Crc32cCheck, Md5Check, PartsCheck, S3Checksum, WholeCheck,
};
use super::gcs::GcsJsonApi;
use super::pipeline::{
    self, manifest_from_listing, ListedObject, Published, RangeBody, RangeSource, TransferError,
    Transfers,
};
use super::{FetchContext, SourceConfig, SourceError, Token};
use crate::metrics::SourceScheme;
use modelfs_core::artifact::{object_identity, FileDigest, Manifest, ManifestEntry, Sha256Digest};
use modelfs_ome::source::ObjectScheme;

/// One object-store source as a model sees it.
#[derive(Clone, Debug)]
pub struct ObjectSource {
    scheme: ObjectScheme,
    /// `s3://bucket`: the location part of every object's identity.
    location: String,
    prefix: String,
    /// The source URI, for logs.
    label: String,
    store: Arc<dyn ObjectStore>,
    /// `gs://`: listing and downloads through the JSON API ([`super::gcs`]); `store` only
    /// provides the credentials.
    gcs: Option<Arc<GcsJsonApi>>,
    transfers: Arc<Transfers>,
    /// What the last resolve listed of each key: the version every range must match, and the
    /// checksum the listing published.
    etags: Arc<Mutex<HashMap<String, Pinned>>>,
    /// `s3://`: the HEADs `object_store` cannot send (see [`S3Heads`]).
    s3: Option<Arc<S3Heads>>,
    throttle: crate::source::ThrottleObserver,
}

/// What a listing said about one key: the version every range must match (ETag, version id
/// or generation) and the CRC32C it published, if any.
#[derive(Clone, Debug)]
struct Pinned {
    version: String,
    crc32c: Option<u32>,
}

/// What the URI names.
#[derive(Clone, Debug)]
pub struct ObjectTarget<'a> {
    pub scheme: ObjectScheme,
    pub bucket: &'a str,
    pub prefix: &'a str,
    pub region: Option<&'a str>,
    pub account: Option<&'a str>,
    pub uri: String,
}

fn config_error(what: &str, detail: impl Into<String>) -> SourceError {
    SourceError::Transfer(TransferError::Config {
        what: what.into(),
        detail: detail.into(),
    })
}

impl ObjectSource {
    /// Builds the client of one model: environment, then the model's parameters and token.
    pub fn new(
        target: ObjectTarget<'_>,
        parameters: &std::collections::BTreeMap<String, String>,
        token: Option<Token>,
        config: &SourceConfig,
    ) -> Result<Self, SourceError> {
        let what = format!("configuring {}", target.uri);
        let param = |k: &str| {
            parameters
                .get(k)
                .map(|v| v.trim())
                .filter(|v| !v.is_empty())
                .map(str::to_string)
        };
        let anonymous = param("anonymous").is_some_and(|v| v.eq_ignore_ascii_case("true"));
        let tuning = config.transfers.tuning();
        // The pipeline retries; object_store must not (its backoff ignores Retry-After).
        let retry = RetryConfig {
            max_retries: 0,
            retry_timeout: Duration::from_secs(1),
            ..RetryConfig::default()
        };
        let mut options = object_store::ClientOptions::new()
            .with_connect_timeout(tuning.connect_timeout)
            // Bodies are watched by the pipeline's stall timeout instead of a whole-request
            // deadline that a large range on a slow link would hit.
            .with_timeout_disabled();
        if let Some(p) = config.proxies.for_scheme(target.scheme.as_str()) {
            options = options.with_proxy_url(p.expose());
            if let Some(n) = super::proxy::no_proxy_from_env() {
                options = options.with_proxy_excludes(n);
            }
        }
        let endpoint = param("endpoint");
        // The client options replace those `from_env` read, so plain HTTP (an S3-compatible
        // store or an emulator on a private network) is allowed here as the environment or the
        // model's endpoint asks.
        let env_true = |k: &str| std::env::var(k).is_ok_and(|v| v.eq_ignore_ascii_case("true"));
        let env_http = |k: &str| std::env::var(k).is_ok_and(|v| v.starts_with("http://"));
        let allow_http = endpoint
            .as_deref()
            .is_some_and(|e| e.starts_with("http://"))
            || match target.scheme {
                ObjectScheme::S3 => {
                    env_true("AWS_ALLOW_HTTP")
                        || env_http("AWS_ENDPOINT")
                        || env_http("AWS_ENDPOINT_URL")
                }
                ObjectScheme::Gs => env_http("STORAGE_EMULATOR_HOST"),
                ObjectScheme::Az => {
                    env_true("AZURE_ALLOW_HTTP") || env_true("AZURE_STORAGE_USE_EMULATOR")
                }
            };
        if allow_http {
            options = options.with_allow_http(true);
        }
        let connector = RecordingConnector;
        let mut gcs = None;
        let mut s3 = None;
        let bad = |e: object_store::Error| config_error(&what, scrub(&e.to_string(), &token));
        let store: Arc<dyn ObjectStore> = match target.scheme {
            ObjectScheme::S3 => {
                let mut b = object_store::aws::AmazonS3Builder::from_env()
                    .with_bucket_name(target.bucket)
                    .with_retry(retry)
                    .with_http_connector(connector);
                if let Some(r) = target.region.map(str::to_string).or(param("region")) {
                    b = b.with_region(r);
                }
                if let Some(e) = &endpoint {
                    b = b.with_endpoint(e);
                }
                if let Some(t) = &token {
                    let id = param("access_key_id")
                        .or_else(|| std::env::var("AWS_ACCESS_KEY_ID").ok())
                        .ok_or_else(|| {
                            config_error(
                                &what,
                                "the model's secret is an S3 secret access key, but no \
                                 access key id was given (parameters.access_key_id or \
                                 AWS_ACCESS_KEY_ID)",
                            )
                        })?;
                    b = b.with_access_key_id(id).with_secret_access_key(t.expose());
                }
                // Anonymous requests carry no signature: the URL of a HEAD is made by signing
                // with a placeholder key and dropping the signature.
                let signer = if anonymous {
                    b = b.with_skip_signature(true);
                    b.clone()
                        .with_skip_signature(false)
                        .with_access_key_id("anonymous")
                        .with_secret_access_key("anonymous")
                } else {
                    b.clone()
                };
                let signer = signer
                    .with_client_options(options.clone())
                    .build()
                    .map_err(bad)?;
                let _ = rustls::crypto::ring::default_provider().install_default();
                let builder = reqwest::Client::builder()
                    .user_agent(concat!("modelfs/", env!("CARGO_PKG_VERSION")))
                    .connect_timeout(tuning.connect_timeout);
                let http = super::proxy::configure(config.proxies.for_scheme("s3"), builder)
                    .and_then(|b| b.build())
                    .map_err(|e| config_error(&what, e.to_string()))?;
                let region = b
                    .get_config_value(&object_store::aws::AmazonS3ConfigKey::Region)
                    .unwrap_or_else(|| "us-east-1".to_string());
                s3 = Some(Arc::new(S3Heads {
                    signer,
                    region,
                    anonymous,
                    http,
                    parts: Mutex::default(),
                }));
                Arc::new(b.with_client_options(options).build().map_err(bad)?)
            }
            ObjectScheme::Gs => {
                let mut b = object_store::gcp::GoogleCloudStorageBuilder::from_env()
                    .with_bucket_name(target.bucket)
                    .with_retry(retry)
                    .with_http_connector(connector);
                // The variable Google's own clients use for an emulator or private endpoint.
                let emulator = std::env::var("STORAGE_EMULATOR_HOST")
                    .ok()
                    .filter(|v| !v.is_empty());
                if let Some(e) = endpoint.clone().or(emulator.clone()) {
                    b = b.with_base_url(&e);
                }
                if let Some(t) = &token {
                    b = b.with_service_account_key(t.expose());
                }
                let unsigned = anonymous || (token.is_none() && emulator.is_some());
                if unsigned {
                    b = b.with_skip_signature(true);
                }
                let built = b.with_client_options(options).build().map_err(bad)?;
                let _ = rustls::crypto::ring::default_provider().install_default();
                let builder = reqwest::Client::builder()
                    .user_agent(concat!("modelfs/", env!("CARGO_PKG_VERSION")))
                    .connect_timeout(tuning.connect_timeout);
                let http = super::proxy::configure(config.proxies.for_scheme("gs"), builder)
                    .and_then(|b| b.build())
                    .map_err(|e| config_error(&what, e.to_string()))?;
                let base = endpoint
                    .clone()
                    .or(emulator)
                    .unwrap_or_else(|| super::gcs::DEFAULT_BASE.to_string());
                gcs = Some(Arc::new(GcsJsonApi::new(
                    http,
                    &base,
                    target.bucket,
                    (!unsigned).then(|| built.credentials().clone()),
                    config.transfers.clone(),
                )));
                Arc::new(built)
            }
            ObjectScheme::Az => {
                let mut b = object_store::azure::MicrosoftAzureBuilder::from_env()
                    .with_container_name(target.bucket)
                    .with_retry(retry)
                    .with_http_connector(connector);
                if let Some(a) = target.account.map(str::to_string).or(param("account_name")) {
                    b = b.with_account(a);
                }
                if let Some(e) = &endpoint {
                    b = b.with_endpoint(e.clone());
                }
                if let Some(t) = &token {
                    b = b.with_access_key(t.expose());
                }
                if anonymous {
                    b = b.with_skip_signature(true);
                }
                Arc::new(b.with_client_options(options).build().map_err(bad)?)
            }
        };
        let location = format!("{}://{}", target.scheme.as_str(), target.bucket);
        Ok(Self {
            scheme: target.scheme,
            location,
            prefix: target.prefix.trim_matches('/').to_string(),
            label: target.uri,
            store,
            gcs,
            transfers: config.transfers.clone(),
            etags: Arc::default(),
            s3,
            throttle: Default::default(),
        })
    }

    /// Reports every wait this source spends on HTTP 429 to `observer`.
    pub fn with_throttle_observer(self, observer: crate::source::ThrottleObserver) -> Self {
        Self {
            throttle: observer,
            ..self
        }
    }

    /// Lists the objects below the prefix (with retries; each listing answer within the stall
    /// timeout, at most `max_listing_entries` objects) into a manifest.
    pub async fn resolve(&self, cancel: Arc<AtomicBool>) -> Result<Manifest, SourceError> {
        let what = format!("listing {}", self.label);
        let limit = self.transfers.tuning().max_listing_entries;
        let objects = if let Some(gcs) = &self.gcs {
            let prefix = if self.prefix.is_empty() {
                String::new()
            } else {
                format!("{}/", self.prefix)
            };
            gcs.list(&what, &prefix, &cancel, &self.throttle).await?
        } else {
            self.transfers
                .retrying(&what, &cancel, &self.throttle, || async {
                    let prefix =
                        (!self.prefix.is_empty()).then(|| ObjectPath::from(self.prefix.as_str()));
                    let mut listing = self.store.list(prefix.as_ref());
                    let mut out = Vec::new();
                    loop {
                        let next = with_error_answer(
                            self.transfers
                                .within_stall(&what, async { Ok(listing.next().await) }),
                        )
                        .await;
                        let meta = match next {
                            (Ok(None), _) => break,
                            (Ok(Some(Ok(meta))), _) => meta,
                            (Ok(Some(Err(e))), answer) => {
                                return Err(transfer_error(&what, &e, answer))
                            }
                            (Err(e), _) => return Err(e),
                        };
                        if out.len() >= limit {
                            return Err(TransferError::Limit {
                                what: what.clone(),
                                detail: format!(
                                "the listing has more than {limit} objects; if the prefix really \
                                 holds that many, raise --hf-max-listing-entries"
                            ),
                            });
                        }
                        let version = meta
                            .e_tag
                            .clone()
                            .or(meta.version.clone())
                            .unwrap_or_else(|| meta.last_modified.to_rfc3339());
                        out.push(ListedObject {
                            key: meta.location.to_string(),
                            size: meta.size,
                            version,
                            md5: None,
                            crc32c: None,
                        });
                    }
                    Ok(out)
                })
                .await?
        };
        let manifest = manifest_from_listing(&self.location, &self.prefix, objects.clone())?;
        let mut etags = self.etags.lock().expect("etag map");
        etags.clear();
        for o in objects {
            let pinned = Pinned {
                version: o.version,
                crc32c: o.crc32c,
            };
            etags.insert(o.key, pinned);
        }
        Ok(manifest)
    }

    pub async fn fetch(
        &self,
        manifest: Arc<Manifest>,
        ctx: FetchContext,
    ) -> Result<Vec<Sha256Digest>, SourceError> {
        Ok(pipeline::fetch(self, &self.transfers, manifest, ctx).await?)
    }

    fn key_of(&self, entry: &ManifestEntry) -> String {
        if self.prefix.is_empty() {
            entry.path.clone()
        } else {
            format!("{}/{}", self.prefix, entry.path)
        }
    }

    /// The version (ETag) `entry` was listed with: from the last listing, or (a fetch after a
    /// restart, with a manifest from the records) from a HEAD whose identity must match.
    async fn version_of(&self, what: &str, entry: &ManifestEntry) -> Result<Pinned, TransferError> {
        let key = self.key_of(entry);
        if let Some(v) = self.etags.lock().expect("etag map").get(&key).cloned() {
            return Ok(v);
        }
        let (size, version, crc32c) = if let Some(gcs) = &self.gcs {
            let meta = gcs.metadata(what, &key).await?;
            (meta.size, meta.version, meta.crc32c)
        } else {
            let head = GetOptions {
                head: true,
                ..GetOptions::default()
            };
            let path = object_path(what, &key)?;
            let (result, answer) = with_error_answer(
                self.transfers
                    .within_stall(what, async { Ok(self.store.get_opts(&path, head).await) }),
            )
            .await;
            let meta = result?.map_err(|e| transfer_error(what, &e, answer))?.meta;
            let version = meta
                .e_tag
                .clone()
                .or(meta.version.clone())
                .unwrap_or_else(|| meta.last_modified.to_rfc3339());
            (meta.size, version, None)
        };
        let identity = object_identity(&format!("{}/{key}", self.location), size, &version);
        match entry.digest {
            FileDigest::Object { identity: want, .. } if want == identity => {
                let pinned = Pinned { version, crc32c };
                self.etags
                    .lock()
                    .expect("etag map")
                    .insert(key, pinned.clone());
                Ok(pinned)
            }
            _ => Err(changed(what)),
        }
    }
}

/// A key as listed (no encoding added: `object_store` would percent-encode characters it
/// considers unsafe and so name another object).
fn object_path(what: &str, key: &str) -> Result<ObjectPath, TransferError> {
    ObjectPath::parse(key).map_err(|e| TransferError::Protocol {
        what: what.into(),
        detail: format!("invalid key: {e}"),
    })
}

/// The object changed after it was listed: the download stops and the model resolves again.
pub(crate) fn changed(what: &str) -> TransferError {
    TransferError::Changed { what: what.into() }
}

impl RangeSource for ObjectSource {
    fn label(&self) -> String {
        self.label.clone()
    }

    fn scheme(&self) -> SourceScheme {
        match self.scheme {
            ObjectScheme::S3 => SourceScheme::S3,
            ObjectScheme::Gs => SourceScheme::Gs,
            ObjectScheme::Az => SourceScheme::Az,
        }
    }

    fn throttle(&self) -> &crate::source::ThrottleObserver {
        &self.throttle
    }

    /// GCS: the listed CRC32C (a composed object has no MD5). Azure: one HEAD of the listed
    /// version for its `Content-MD5`. S3: see [`ObjectSource::s3_check`]. An object whose MD5
    /// the manifest already carries needs nothing more.
    async fn content_check(
        &self,
        what: &str,
        entry: &ManifestEntry,
    ) -> Result<Option<Published>, TransferError> {
        if entry.digest.checks_content() {
            return Ok(None);
        }
        let pinned = self.version_of(what, entry).await?;
        if self.scheme == ObjectScheme::Gs {
            const NAME: &str = "GCS crc32c";
            return Ok(pinned.crc32c.map(|c| Published {
                name: NAME,
                check: Box::new(Crc32cCheck::new(NAME, c)),
            }));
        }
        if self.scheme == ObjectScheme::S3 {
            return self.s3_check(what, entry, pinned.version).await;
        }
        let headers = self.head_headers(what, entry, pinned.version).await?;
        let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
        const NAME: &str = "Content-MD5";
        Ok(header("content-md5")
            .and_then(md5_from_base64)
            .map(|m| Published {
                name: NAME,
                check: Box::new(Md5Check::new(NAME, m)),
            }))
    }

    async fn open_range(
        &self,
        what: &str,
        entry: &ManifestEntry,
        at: u64,
        end: Option<u64>,
    ) -> Result<RangeBody, TransferError> {
        let version = self.version_of(what, entry).await?.version;
        if let Some(gcs) = &self.gcs {
            return match gcs
                .open_range(what, &self.key_of(entry), &version, at, end)
                .await
            {
                Err(TransferError::Status { status: 412, .. }) => {
                    self.etags.lock().expect("etag map").clear();
                    Err(changed(what))
                }
                other => other,
            };
        }
        let path = object_path(what, &self.key_of(entry))?;
        let options = GetOptions {
            range: Some(match end {
                Some(end) => GetRange::Bounded(at..end),
                None => GetRange::Offset(at),
            }),
            if_match: Some(version.clone()),
            ..GetOptions::default()
        };
        let (result, answer) = with_error_answer(self.transfers.within_stall(what, async {
            Ok(self.store.get_opts(&path, options).await)
        }))
        .await;
        let got = match result? {
            Ok(got) => got,
            Err(object_store::Error::Precondition { .. }) => {
                self.etags.lock().expect("etag map").clear();
                return Err(changed(what));
            }
            // A server or proxy that ignores `Range` answered 200 with the whole object, which
            // the client refuses for a ranged request: ask for the whole object (same version)
            // and let the pipeline read the file from that one answer, as for `hf://`.
            Err(e) if ignored_range(&e) => {
                return self.whole_object(what, &path, version).await;
            }
            Err(e) => return Err(transfer_error(what, &e, answer)),
        };
        if got.range.start != at {
            return Err(TransferError::Protocol {
                what: what.into(),
                detail: format!(
                    "asked for bytes from {at}, got bytes from {}",
                    got.range.start
                ),
            });
        }
        let what = what.to_string();
        Ok(RangeBody::Part(
            got.into_stream()
                .map(move |r| {
                    r.map_err(|e| TransferError::Network {
                        what: what.clone(),
                        detail: e.to_string(),
                    })
                })
                .boxed(),
        ))
    }
}

/// The S3 HEADs `object_store` cannot send: with `x-amz-checksum-mode: ENABLED` (the
/// object's checksum) and `?partNumber=N` (one part's size), both of which must be signed.
/// The URL comes from `object_store`'s signer (the same endpoint and addressing as every other
/// request of the source, its signature dropped); the request is signed in its headers
/// (SigV4 `Authorization`, as every other request of the source, not a presigned query: some
/// S3-compatible servers answer presigned requests only for GET) and goes out through a
/// client with the source's proxy.
#[derive(Debug)]
struct S3Heads {
    signer: object_store::aws::AmazonS3,
    /// The region requests are signed for.
    region: String,
    anonymous: bool,
    http: reqwest::Client,
    /// The part sizes of each multipart object version (key, ETag), once known; `None`: the
    /// store would not tell them.
    parts: Mutex<HashMap<ObjectVersion, Option<Vec<u64>>>>,
}

/// An object version: its key and ETag.
type ObjectVersion = (String, String);

/// Most parts an S3 multipart upload has.
const MAX_S3_PARTS: u32 = 10_000;
/// Part HEADs in flight at once for one object.
const PART_HEADS_IN_FLIGHT: usize = 8;

/// What a HEAD of [`S3Heads`] got.
enum HeadAnswer {
    Headers(reqwest::header::HeaderMap),
    /// A client error other than a failed precondition: the store does not offer this HEAD
    /// (a partNumber it ignores, a checksum mode a compatible store refuses, SSE-C headers
    /// the presigned request lacks, ...).
    Refused(u16),
}

impl S3Heads {
    /// One HEAD of `key` (of part `part`), `if_match` pinning the version.
    async fn head(
        &self,
        what: &str,
        transfers: &Transfers,
        key: &str,
        part: Option<u32>,
        if_match: Option<&str>,
    ) -> Result<HeadAnswer, TransferError> {
        use object_store::signer::{SignedUrlOptions, Signer as _};
        let mode = (
            reqwest::header::HeaderName::from_static("x-amz-checksum-mode"),
            reqwest::header::HeaderValue::from_static("ENABLED"),
        );
        let mut options =
            SignedUrlOptions::default().with_signed_header(mode.0.clone(), mode.1.clone());
        if let Some(n) = part {
            options = options.with_query([("partNumber", n.to_string())]);
        }
        let path = object_path(what, key)?;
        let mut url = self
            .signer
            .signed_url_opts(
                reqwest::Method::HEAD,
                &path,
                Duration::from_secs(15 * 60),
                &options,
            )
            .await
            .map_err(|e| TransferError::Config {
                what: what.into(),
                detail: format!("signing a HEAD request: {e}"),
            })?;
        // Only the object's address and `partNumber` are kept from the presigned URL.
        let kept: Vec<(String, String)> = url
            .query_pairs()
            .filter(|(k, _)| !k.to_ascii_lowercase().starts_with("x-amz-"))
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        url.query_pairs_mut().clear().extend_pairs(kept);
        if url.query() == Some("") {
            url.set_query(None);
        }
        let mut request = self.http.head(url.as_str());
        if self.anonymous {
            request = request.header(mode.0, mode.1);
        } else {
            let signing_error = |detail: String| TransferError::Config {
                what: what.into(),
                detail: format!("signing a HEAD request: {detail}"),
            };
            let credential = self
                .signer
                .credentials()
                .get_credential()
                .await
                .map_err(|e| signing_error(e.to_string()))?;
            let mut signed = http::Request::builder()
                .method(http::Method::HEAD)
                .uri(url.as_str())
                .header(mode.0, mode.1)
                .body(object_store::client::HttpRequestBody::empty())
                .map_err(|e| signing_error(e.to_string()))?;
            object_store::aws::AwsAuthorizer::new(&credential, "s3", &self.region)
                .try_authorize(&mut signed, None)
                .map_err(|e| signing_error(e.to_string()))?;
            for (name, value) in signed.headers() {
                request = request.header(name, value);
            }
        }
        if let Some(v) = if_match {
            request = request.header(reqwest::header::IF_MATCH, v);
        }
        let resp = transfers
            .within_stall(what, async {
                request.send().await.map_err(|e| TransferError::Network {
                    what: what.into(),
                    detail: e.to_string(),
                })
            })
            .await?;
        let status = resp.status().as_u16();
        if resp.status().is_success() {
            return Ok(HeadAnswer::Headers(resp.headers().clone()));
        }
        if status == 412 {
            return Err(changed(what));
        }
        if status == 429 || status == 408 || status >= 500 {
            let retry_after = resp
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(pipeline::parse_retry_after);
            return Err(TransferError::Status {
                what: what.into(),
                status,
                code: None,
                message: resp
                    .status()
                    .canonical_reason()
                    .unwrap_or("server error")
                    .into(),
                retry_after,
            });
        }
        Ok(HeadAnswer::Refused(status))
    }

    /// The size of each of the `count` parts of `key` at `version` (`HEAD ?partNumber=N`), or
    /// why they cannot be known. Remembered per version.
    async fn part_sizes(
        &self,
        what: &str,
        transfers: &Transfers,
        key: &str,
        version: &str,
        count: u32,
        size: u64,
    ) -> Result<Result<Vec<u64>, String>, TransferError> {
        let id = (key.to_string(), version.to_string());
        if let Some(known) = self.parts.lock().expect("part sizes").get(&id) {
            return Ok(known.clone().ok_or_else(|| "not published".to_string()));
        }
        if count > MAX_S3_PARTS {
            return Ok(Err(format!("{count} parts is more than S3 allows")));
        }
        let heads = futures_util::stream::iter(1..=count)
            .map(|n| async move { (n, self.head(what, transfers, key, Some(n), None).await) })
            .buffered(PART_HEADS_IN_FLIGHT)
            .collect::<Vec<_>>()
            .await;
        let mut sizes = Vec::with_capacity(count as usize);
        let mut why = None;
        for (n, answer) in heads {
            let headers = match answer? {
                HeadAnswer::Headers(h) => h,
                HeadAnswer::Refused(status) => {
                    why.get_or_insert(format!("HEAD of part {n} answered HTTP {status}"));
                    continue;
                }
            };
            let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
            let told = header("x-amz-mp-parts-count").and_then(|c| c.trim().parse::<u32>().ok());
            if told.is_some_and(|c| c != count) {
                why.get_or_insert(format!(
                    "the store counts {} parts, the ETag {count}",
                    told.unwrap_or_default()
                ));
            }
            match header("content-length").and_then(|l| l.trim().parse::<u64>().ok()) {
                Some(len) => sizes.push(len),
                None => {
                    why.get_or_insert(format!("HEAD of part {n} gave no Content-Length"));
                }
            }
        }
        let total: u64 = sizes.iter().sum();
        if why.is_none() && total != size {
            // A store that ignores `partNumber` answers with the whole object each time.
            why = Some(format!(
                "the parts' sizes add up to {total} bytes, not the object's {size}"
            ));
        }
        let known = match why {
            None => Ok(sizes),
            Some(w) => Err(w),
        };
        self.parts
            .lock()
            .expect("part sizes")
            .insert(id, known.clone().ok());
        Ok(known)
    }
}

impl ObjectSource {
    /// The headers of a HEAD of the listed version through `object_store`.
    async fn head_headers(
        &self,
        what: &str,
        entry: &ManifestEntry,
        version: String,
    ) -> Result<reqwest::header::HeaderMap, TransferError> {
        let path = object_path(what, &self.key_of(entry))?;
        let head = GetOptions {
            head: true,
            if_match: Some(version),
            ..GetOptions::default()
        };
        let ((result, answer), headers) = with_success_headers(with_error_answer(
            self.transfers
                .within_stall(what, async { Ok(self.store.get_opts(&path, head).await) }),
        ))
        .await;
        match result? {
            Ok(_) => Ok(headers.unwrap_or_default()),
            Err(object_store::Error::Precondition { .. }) => {
                self.etags.lock().expect("etag map").clear();
                Err(changed(what))
            }
            Err(e) => Err(transfer_error(what, &e, answer)),
        }
    }

    /// What S3 publishes about the listed version, from one HEAD with `ChecksumMode` (and,
    /// for a multipart object, one `HEAD ?partNumber=N` per part, for the part sizes), best
    /// first:
    /// 1. a full-object checksum (CRC32, CRC32C, CRC64NVME, SHA1, SHA256 of the bytes);
    /// 2. a composite checksum (`<value>-<N>`: the checksum of the parts' checksums);
    /// 3. the ETag: the MD5 of a single-part upload, or of a multipart upload's part MD5s
    ///    (`<md5>-<N>`), unless SSE-KMS or SSE-C made it no MD5 of the bytes;
    ///
    /// else nothing (size only; the reason is logged). A store that refuses the checksum
    /// HEAD is asked through `object_store` for the ETag alone.
    async fn s3_check(
        &self,
        what: &str,
        entry: &ManifestEntry,
        version: String,
    ) -> Result<Option<Published>, TransferError> {
        let heads = self
            .s3
            .as_ref()
            .expect("an s3:// source has its HEAD client");
        let key = self.key_of(entry);
        let headers = match heads
            .head(what, &self.transfers, &key, None, Some(&version))
            .await
        {
            Ok(HeadAnswer::Headers(h)) => h,
            Ok(HeadAnswer::Refused(status)) => {
                tracing::info!(source = %self.label, path = %entry.path, status, "the store refused a HEAD with ChecksumMode; checking the ETag only");
                self.head_headers(what, entry, version.clone()).await?
            }
            Err(e @ TransferError::Changed { .. }) => {
                self.etags.lock().expect("etag map").clear();
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
        let etag = header("etag").unwrap_or(&version).to_string();
        let multipart = s3_multipart_etag(&etag);
        let encryption = header("x-amz-server-side-encryption");
        let customer_key = header("x-amz-server-side-encryption-customer-algorithm").is_some();
        // SSE-KMS and SSE-C ETags are no MD5 of the bytes, multipart or not.
        let etag_is_md5 =
            !(customer_key || encryption.is_some_and(|e| e.trim().starts_with("aws:kms")));
        let mut why_not = Vec::new();
        if let Some((checksum, suffix_parts)) = s3_checksum(header, multipart.is_some()) {
            let S3Checksum {
                algorithm,
                value,
                kind,
            } = checksum;
            const FULL: &str = "S3 full-object checksum";
            const COMPOSITE: &str = "S3 composite checksum";
            const EITHER: &str = "S3 checksum";
            let whole = || Box::new(WholeCheck::new(FULL, algorithm, value.clone()));
            if kind == ChecksumKind::Full {
                return Ok(Some(Published {
                    name: FULL,
                    check: whole(),
                }));
            }
            let count = suffix_parts.or(multipart.map(|m| m.1)).unwrap_or(1);
            match heads
                .part_sizes(what, &self.transfers, &key, &version, count, entry.size)
                .await?
            {
                Ok(sizes) => {
                    let parts =
                        Box::new(PartsCheck::new(COMPOSITE, algorithm, value.clone(), sizes));
                    return Ok(Some(if kind == ChecksumKind::Composite {
                        Published {
                            name: COMPOSITE,
                            check: parts,
                        }
                    } else {
                        Published {
                            name: EITHER,
                            check: Box::new(AnyOf(vec![whole(), parts])),
                        }
                    }));
                }
                Err(why) => why_not.push(format!(
                    "a composite {} whose part sizes are unknown ({why})",
                    algorithm.name()
                )),
            }
        }
        if let Some(md5) =
            s3_etag_md5(&etag, encryption, customer_key).filter(|_| multipart.is_none())
        {
            const NAME: &str = "S3 ETag";
            return Ok(Some(Published {
                name: NAME,
                check: Box::new(Md5Check::new(NAME, md5)),
            }));
        }
        match multipart {
            Some((md5, count)) if etag_is_md5 => {
                match heads
                    .part_sizes(what, &self.transfers, &key, &version, count, entry.size)
                    .await?
                {
                    Ok(sizes) => {
                        const NAME: &str = "S3 multipart ETag";
                        return Ok(Some(Published {
                            name: NAME,
                            check: Box::new(PartsCheck::new(
                                NAME,
                                Algorithm::Md5,
                                md5.to_vec(),
                                sizes,
                            )),
                        }));
                    }
                    Err(why) => why_not.push(format!(
                        "a multipart ETag whose part sizes are unknown ({why})"
                    )),
                }
            }
            Some(_) => {
                why_not.push("a multipart ETag of an SSE-KMS or SSE-C object (no MD5)".into())
            }
            None => why_not.push("an ETag of an SSE-KMS or SSE-C object (no MD5)".into()),
        }
        tracing::info!(source = %self.label, path = %entry.path, published = %why_not.join("; "), "no usable checksum published for this object");
        Ok(None)
    }

    /// The whole object at `version`, as a [`RangeBody::WholeFile`] (see `open_range`).
    async fn whole_object(
        &self,
        what: &str,
        path: &ObjectPath,
        version: String,
    ) -> Result<RangeBody, TransferError> {
        let options = GetOptions {
            if_match: Some(version),
            ..GetOptions::default()
        };
        let (result, answer) = with_error_answer(
            self.transfers
                .within_stall(what, async { Ok(self.store.get_opts(path, options).await) }),
        )
        .await;
        let got = match result? {
            Ok(got) => got,
            Err(object_store::Error::Precondition { .. }) => {
                self.etags.lock().expect("etag map").clear();
                return Err(changed(what));
            }
            Err(e) => return Err(transfer_error(what, &e, answer)),
        };
        let what = what.to_string();
        Ok(RangeBody::WholeFile(
            got.into_stream()
                .map(move |r| {
                    r.map_err(|e| TransferError::Network {
                        what: what.clone(),
                        detail: e.to_string(),
                    })
                })
                .boxed(),
        ))
    }
}

/// Whether the client refused an answer because it was not partial (`200` to a ranged GET:
/// the server ignores `Range`). `object_store` keeps that error's type private; its message is
/// what tells it (the S3 test through a proxy that drops `Range` fails if it changes).
fn ignored_range(e: &object_store::Error) -> bool {
    match e {
        object_store::Error::Generic { source, .. } => source
            .to_string()
            .contains("non-partial response when range requested"),
        _ => false,
    }
}

/// An error message with the model's secret cut out, should a library ever echo it.
fn scrub(text: &str, token: &Option<Token>) -> String {
    match token {
        Some(t) if !t.expose().is_empty() => text.replace(t.expose(), "***"),
        _ => text.to_string(),
    }
}

/// The `<Code>` and `<Message>` of an object store's XML error body (S3, GCS XML, Azure).
fn xml_error(body: &str) -> (Option<String>, Option<String>) {
    let field = |name: &str| {
        let open = format!("<{name}>");
        let close = format!("</{name}>");
        let start = body.find(&open)? + open.len();
        let len = body[start..].find(&close)?;
        Some(
            body[start..start + len]
                .chars()
                .take(300)
                .collect::<String>(),
        )
    };
    (field("Code"), field("Message"))
}

/// An `object_store` error as the pipeline's error: HTTP status, the server's code and message,
/// and the `Retry-After` of the answer, when the request got an error answer.
fn transfer_error(
    what: &str,
    e: &object_store::Error,
    answer: Option<ErrorAnswer>,
) -> TransferError {
    if let Some(answer) = answer {
        let (code, message) = xml_error(&answer.body);
        let status = reqwest::StatusCode::from_u16(answer.status).ok();
        let mut message = message
            .or_else(|| {
                let b = answer.body.trim();
                (!b.is_empty()).then(|| b.chars().take(300).collect())
            })
            .unwrap_or_else(|| {
                status
                    .and_then(|s| s.canonical_reason())
                    .unwrap_or("unexpected status")
                    .to_string()
            });
        if matches!(answer.status, 401 | 403) {
            message.push_str(
                " (check the model's credentials: its Secret, parameters, or the daemon's \
                 environment)",
            );
        }
        return TransferError::Status {
            what: what.into(),
            status: answer.status,
            code,
            message,
            retry_after: answer.retry_after,
        };
    }
    match e {
        object_store::Error::NotFound { .. } => TransferError::Status {
            what: what.into(),
            status: 404,
            code: None,
            message: "not found".into(),
            retry_after: None,
        },
        object_store::Error::InvalidPath { source } => TransferError::Protocol {
            what: what.into(),
            detail: format!("the store listed an invalid key: {source}"),
        },
        other => TransferError::Network {
            what: what.into(),
            detail: other.to_string(),
        },
    }
}

/// The last error answer of a request: what `object_store`'s error does not let a caller read
/// (its status and body are private to the crate, and it never had the headers).
#[derive(Clone, Debug)]
struct ErrorAnswer {
    status: u16,
    retry_after: Option<Duration>,
    body: String,
}

tokio::task_local! {
    static LAST_ERROR: Cell<Option<ErrorAnswer>>;
    static LAST_HEADERS: Cell<Option<reqwest::header::HeaderMap>>;
}

/// Runs `fut` and returns what it returned with the headers of the last successful answer it
/// received (what `object_store`'s metadata leaves out: `Content-MD5`, encryption).
async fn with_success_headers<T>(
    fut: impl std::future::Future<Output = T>,
) -> (T, Option<reqwest::header::HeaderMap>) {
    LAST_HEADERS
        .scope(Cell::new(None), async {
            let out = fut.await;
            (out, LAST_HEADERS.with(|c| c.take()))
        })
        .await
}

/// Runs `fut` and returns what it returned with the last error answer it received, if any.
async fn with_error_answer<T>(
    fut: impl std::future::Future<Output = T>,
) -> (T, Option<ErrorAnswer>) {
    LAST_ERROR
        .scope(Cell::new(None), async {
            let out = fut.await;
            (out, LAST_ERROR.with(|c| c.take()))
        })
        .await
}

/// `object_store`'s reqwest client, recording error answers (see [`with_error_answer`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct RecordingConnector;

impl object_store::client::HttpConnector for RecordingConnector {
    fn connect(
        &self,
        options: &object_store::ClientOptions,
    ) -> object_store::Result<object_store::client::HttpClient> {
        // The binary installs ring at start; libraries and tests may not have.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let inner = object_store::client::ReqwestConnector::default().connect(options)?;
        Ok(object_store::client::HttpClient::new(RecordingService(
            inner,
        )))
    }
}

#[derive(Debug)]
struct RecordingService(object_store::client::HttpClient);

/// Largest error body kept (an error document is a few hundred bytes).
const MAX_ERROR_BODY: usize = 64 << 10;

#[async_trait::async_trait]
impl object_store::client::HttpService for RecordingService {
    async fn call(
        &self,
        req: object_store::client::HttpRequest,
    ) -> Result<object_store::client::HttpResponse, object_store::client::HttpError> {
        let resp = self.0.execute(req).await?;
        if resp.status().is_success() || resp.status().is_redirection() {
            let _ = LAST_HEADERS.try_with(|c| c.set(Some(resp.headers().clone())));
            return Ok(resp);
        }
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(pipeline::parse_retry_after);
        let (parts, body) = resp.into_parts();
        // The body is read here (bounded by the caller's stall timeout) and handed on intact.
        let bytes = body.bytes().await.unwrap_or_default();
        let text = String::from_utf8_lossy(&bytes[..bytes.len().min(MAX_ERROR_BODY)]).into_owned();
        let answer = ErrorAnswer {
            status: parts.status.as_u16(),
            retry_after,
            body: text,
        };
        let _ = LAST_ERROR.try_with(|c| c.set(Some(answer)));
        Ok(object_store::client::HttpResponse::from_parts(
            parts,
            bytes.into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xml_errors_give_code_and_message() {
        let body = "<?xml version=\"1.0\"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>";
        assert_eq!(
            xml_error(body),
            (
                Some("SlowDown".into()),
                Some("Please reduce your request rate.".into())
            )
        );
        assert_eq!(xml_error("{}"), (None, None));
    }

    #[test]
    fn secrets_are_scrubbed_from_messages() {
        let t = Some(Token::new("s3cr3t"));
        assert_eq!(scrub("bad key s3cr3t here", &t), "bad key *** here");
    }
}
