//! An OCI Object Storage look-alike for tests. **Development only**: objects live in memory,
//! served on loopback; not part of the daemon (the `modelfs-oci-dev` binary and the integration
//! tests are its only users). No OCI emulator exists, so this one is checked against the
//! official `oci` Python SDK by a test (`tests/oci_python.rs`): list, get, ranged get, head with
//! the SDK's own signer, and a request signed with a wrong key refused; and the SDK's OKE
//! workload identity signer through the proxymux exchange below (TLS, its session token and
//! key accepted, a token signed by another key and a wrong service account token refused).
//!
//! What it speaks (the subset a downloader uses):
//! * **Every request must be signed** ([`modelfs_agent::source::oci::sign`]): `Authorization:
//!   Signature ...` with `rsa-sha256` over at least `date (request-target) host`, a `date`
//!   within five minutes of its clock, and a `keyId` it knows: `<tenancy>/<user>/<fingerprint>`
//!   of an added API key, or `ST$<token>` of an added session token. Anything else is `401`
//!   `{"code":"NotAuthenticated","message":...}`, the service's error shape, with an
//!   `opc-request-id`.
//! * `GET /n/` (the namespace), `GET /n/{ns}/b/{bucket}/o?prefix=&start=&limit=&fields=`:
//!   objects in name order, `page_size` a page, `nextStartWith` naming the first object of the
//!   next page. `fields` selects `size`, `md5`, `etag`, `timeCreated` (`name` always).
//! * `GET|HEAD /n/{ns}/b/{bucket}/o/{name}`: bytes with `Range` (`206`, `Content-Range`),
//!   `ETag`, `Content-MD5` and `opc-content-md5` for single-part objects, `opc-multipart-md5`
//!   (`<base64 md5 of the part md5s>-<parts>`) for objects added as multipart uploads, and their
//!   `opc-meta-*` metadata (`opc-meta-md5`).
//!   `If-Match` naming another ETag than the object's is `412 IfMatchFailed`, as the service
//!   answers a request pinned to a version that was overwritten.
//! * Errors: `404 ObjectNotFound`/`BucketNotFound`, `412 IfMatchFailed`, `416 InvalidRange`.
//!
//! It also stands in for the two services an instance principal talks to
//! ([`OciDev::set_instance_identity`]): the **instance metadata service**
//! (`GET /opc/v2/identity/{cert,key,intermediate}.pem`, `/opc/v2/instance/canonicalRegionName`,
//! only with `Authorization: Bearer Oracle`) and the **auth service's** federation endpoint
//! (`POST /v1/x509`): the request must be signed by the key of the certificate it carries, with
//! `keyId` `<tenancy>/fed-x509-sha256/<SHA-256 of that certificate>`, covering the body
//! (`x-content-sha256`, checked against the body, `content-type`, `content-length`), and the
//! certificate must be the instance's (standing in for chain validation). It answers
//! `{"token": ...}` and from then on accepts `ST$<token>` signatures by the session key the
//! request named.
//!
//! And for OKE workload identity ([`OciDev::set_oke_service_account_token`]) it stands in for
//! the cluster's **proxymux** (`POST /resourcePrincipalSessionTokens`, which the SDKs send to
//! `https://$KUBERNETES_SERVICE_HOST:12250`; [`OciDev::serve_tls`] serves it, and everything
//! else, over TLS with a certificate the test makes). `Authorization: Bearer <service account
//! token>` must be exactly the token it was given (else `401 NotAuthenticated`), the body must
//! be JSON (`Content-Type: application/json`) whose `podKey` is the base64 DER
//! SubjectPublicKeyInfo of an RSA key (at least 2048 bits). The answer is the base64 of
//! `{"token": "ST$<token>"}`, the token a JWT (the SDKs decode its `iat` and `exp`; its
//! signature is a stand-in, nothing verifies it), and from then on `ST$<token>` signatures by
//! that pod key are accepted, checked like every other signature. The counters report the
//! exchanges and how many distinct pod keys they carried.
//!
//! Faults ([`crate::hf::Fault`], the hub look-alike's rules): target `file` applies to
//! object GETs, `api` to listings and HEADs; kinds `status` (with `Retry-After`), `truncate`,
//! `corrupt`, `slow`, `stall_headers`. A [`DevObject`] can also lie about its MD5. Counters
//! ([`OciStats`]) report requests, bytes served, ranged requests and refused signatures. Over
//! HTTP: `POST|DELETE /_oci/faults`, `GET /_oci/stats` (unsigned: test control, not the API).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use base64::Engine as _;
use bytes::Bytes;
use md5::{Digest, Md5};
use serde::{Deserialize, Serialize};

use crate::hf::{Fault, FaultKind, FaultRules, FaultTarget};
use modelfs_agent::source::oci::sign;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// Largest accepted distance between a request's `date` and the server clock.
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(300);

/// One object.
#[derive(Clone, Debug)]
pub struct DevObject {
    pub bytes: Bytes,
    /// Base64 MD5 reported for a single-part object (a test may set a wrong one).
    pub md5: String,
    /// `Some((multipart md5, part count))` for an object uploaded in parts.
    pub multipart: Option<String>,
    /// `opc-meta-*` metadata (without the prefix).
    pub meta: BTreeMap<String, String>,
    pub etag: String,
}

impl DevObject {
    /// A single-part object with its true MD5.
    pub fn new(bytes: impl Into<Bytes>) -> Self {
        let bytes: Bytes = bytes.into();
        let md5 = B64.encode(Md5::digest(&bytes));
        let etag = format!("{:x}", Md5::digest(format!("etag:{md5}:{}", bytes.len())));
        Self {
            bytes,
            md5,
            multipart: None,
            meta: BTreeMap::new(),
            etag,
        }
    }

    /// An object uploaded in parts of `part_size` bytes: reports `opc-multipart-md5`, not the
    /// MD5 of the content. With `meta_md5`, also `opc-meta-md5` (the content MD5, as uploaders
    /// that follow OME's convention set it).
    pub fn multipart(bytes: impl Into<Bytes>, part_size: usize, meta_md5: bool) -> Self {
        let mut o = Self::new(bytes);
        let parts: Vec<&[u8]> = o.bytes.chunks(part_size.max(1)).collect();
        let mut all = Md5::new();
        for p in &parts {
            all.update(Md5::digest(p));
        }
        o.multipart = Some(format!("{}-{}", B64.encode(all.finalize()), parts.len()));
        if meta_md5 {
            o.meta.insert("md5".into(), o.md5.clone());
        }
        o
    }

    /// Reports `md5` (base64) instead of the true MD5.
    pub fn with_reported_md5(mut self, md5: &str) -> Self {
        self.md5 = md5.to_string();
        self
    }

    /// The MD5 as the listing reports it.
    fn listed_md5(&self) -> &str {
        self.multipart.as_deref().unwrap_or(&self.md5)
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct OciStats {
    pub requests: u64,
    pub list_requests: u64,
    pub head_requests: u64,
    pub get_requests: u64,
    /// GETs whose range starts after byte 0 (resumed or parallel ranges).
    pub ranged_requests: u64,
    /// Object body bytes sent.
    pub bytes_served: u64,
    /// Requests refused for their signature, key or date.
    pub refused_signatures: u64,
    pub faults_applied: u64,
    /// Instance metadata requests, and session tokens issued by the federation endpoint.
    pub metadata_requests: u64,
    pub federations: u64,
    /// Session tokens issued by the proxymux look-alike, and the distinct pod keys they bound.
    pub oke_exchanges: u64,
    pub oke_pod_keys: u64,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    list_requests: AtomicU64,
    head_requests: AtomicU64,
    get_requests: AtomicU64,
    ranged_requests: AtomicU64,
    bytes_served: AtomicU64,
    refused_signatures: AtomicU64,
    request_ids: AtomicU64,
    metadata_requests: AtomicU64,
    federations: AtomicU64,
    oke_exchanges: AtomicU64,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PodKeyRequest {
    pod_key: String,
}

#[derive(Clone, Debug)]
pub struct OciDevConfig {
    /// Objects per listing page (the service's default and maximum is 1000).
    pub page_size: usize,
    /// Body chunk size.
    pub chunk: usize,
}

impl Default for OciDevConfig {
    fn default() -> Self {
        Self {
            page_size: 1000,
            chunk: 256 << 10,
        }
    }
}

/// (namespace, bucket) -> objects by name.
type Buckets = BTreeMap<(String, String), BTreeMap<String, Arc<DevObject>>>;

pub struct OciDev {
    config: OciDevConfig,
    buckets: Mutex<Buckets>,
    /// keyId -> DER RSAPublicKey.
    keys: Mutex<HashMap<String, Vec<u8>>>,
    faults: FaultRules,
    counters: Counters,
    instance: Mutex<Option<InstanceIdentity>>,
    /// The service account token the proxymux look-alike accepts.
    oke_token: Mutex<Option<String>>,
    /// SHA-256 of every pod key a token was issued for.
    oke_pod_keys: Mutex<std::collections::HashSet<[u8; 32]>>,
}

/// What the metadata look-alike serves to an instance principal.
#[derive(Clone, Debug)]
pub struct InstanceIdentity {
    pub cert_pem: String,
    pub key_pem: String,
    pub intermediate_pem: String,
    pub region: String,
}

pub struct RunningOciDev {
    pub server: Arc<OciDev>,
    pub addr: SocketAddr,
    tls: bool,
    task: tokio::task::JoinHandle<()>,
}

impl RunningOciDev {
    /// `http://addr`, or `https://addr` for [`OciDev::serve_tls`].
    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }
}

/// A TLS listener for `axum::serve`: accepts TCP connections and completes the handshake
/// (bounded) before handing a stream over; a failed handshake is dropped.
struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (stream, addr) = match self.tcp.accept().await {
                Ok(c) => c,
                Err(_) => {
                    // Out of descriptors and the like: the next accept may work.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let handshake = self.acceptor.accept(stream);
            if let Ok(Ok(tls)) = tokio::time::timeout(Duration::from_secs(10), handshake).await {
                return (tls, addr);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }
}

impl Drop for RunningOciDev {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl OciDev {
    pub fn new(config: OciDevConfig) -> Arc<Self> {
        Arc::new(Self {
            config,
            buckets: Mutex::default(),
            keys: Mutex::default(),
            faults: FaultRules::default(),
            counters: Counters::default(),
            instance: Mutex::default(),
            oke_token: Mutex::default(),
            oke_pod_keys: Mutex::default(),
        })
    }

    /// Serves `identity` from the metadata look-alike and federates its certificate.
    pub fn set_instance_identity(&self, identity: InstanceIdentity) {
        *self.instance.lock().unwrap() = Some(identity);
    }

    /// Accepts `token` as the pod's service account token at the proxymux look-alike.
    pub fn set_oke_service_account_token(&self, token: &str) {
        *self.oke_token.lock().unwrap() = Some(token.to_string());
    }

    pub fn create_bucket(&self, namespace: &str, bucket: &str) {
        self.buckets
            .lock()
            .unwrap()
            .entry((namespace.into(), bucket.into()))
            .or_default();
    }

    pub fn put_object(&self, namespace: &str, bucket: &str, name: &str, object: DevObject) {
        self.buckets
            .lock()
            .unwrap()
            .entry((namespace.into(), bucket.into()))
            .or_default()
            .insert(name.into(), Arc::new(object));
    }

    /// Adds every file below `dir` as `<prefix>/<relative path>` (single-part objects; files of
    /// at least `multipart_threshold` bytes as multipart uploads with `opc-meta-md5`).
    pub fn put_dir(
        &self,
        namespace: &str,
        bucket: &str,
        prefix: &str,
        dir: &Path,
        multipart_threshold: Option<u64>,
    ) -> std::io::Result<usize> {
        let mut n = 0;
        for entry in walk(dir)? {
            let rel = entry.strip_prefix(dir).expect("below dir");
            let rel = rel.to_string_lossy().replace('\\', "/");
            let name = if prefix.is_empty() {
                rel
            } else {
                format!("{}/{rel}", prefix.trim_end_matches('/'))
            };
            let bytes = std::fs::read(&entry)?;
            let object = match multipart_threshold {
                Some(t) if bytes.len() as u64 >= t => DevObject::multipart(bytes, 8 << 20, true),
                _ => DevObject::new(bytes),
            };
            self.put_object(namespace, bucket, &name, object);
            n += 1;
        }
        Ok(n)
    }

    /// Accepts signatures by `key_id` made with the private half of `rsa_public_key_der`.
    pub fn add_key(&self, key_id: &str, rsa_public_key_der: Vec<u8>) {
        self.keys
            .lock()
            .unwrap()
            .insert(key_id.into(), rsa_public_key_der);
    }

    pub fn add_fault(&self, fault: Fault) {
        self.faults.add(fault);
    }

    pub fn clear_faults(&self) {
        self.faults.clear();
    }

    pub fn stats(&self) -> OciStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        OciStats {
            requests: l(&c.requests),
            list_requests: l(&c.list_requests),
            head_requests: l(&c.head_requests),
            get_requests: l(&c.get_requests),
            ranged_requests: l(&c.ranged_requests),
            bytes_served: l(&c.bytes_served),
            refused_signatures: l(&c.refused_signatures),
            faults_applied: self.faults.applied(),
            metadata_requests: l(&c.metadata_requests),
            federations: l(&c.federations),
            oke_exchanges: l(&c.oke_exchanges),
            oke_pod_keys: self.oke_pod_keys.lock().unwrap().len() as u64,
        }
    }

    pub async fn serve(self: &Arc<Self>, addr: SocketAddr) -> std::io::Result<RunningOciDev> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let app = self.router();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(RunningOciDev {
            server: self.clone(),
            addr,
            tls: false,
            task,
        })
    }

    /// Serves the same API over TLS on `listener` (already bound, so a test can put the
    /// address in the certificate first), with the PEM certificate chain (leaf first) and its
    /// PEM private key.
    pub async fn serve_tls(
        self: &Arc<Self>,
        listener: std::net::TcpListener,
        cert_chain_pem: &str,
        key_pem: &str,
    ) -> std::io::Result<RunningOciDev> {
        use rustls::pki_types::pem::PemObject as _;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let bad = |what: &str, e: &dyn std::fmt::Display| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{what}: {e}"))
        };
        let certs = CertificateDer::pem_slice_iter(cert_chain_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad("certificate chain", &e))?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| bad("key", &e))?;
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("TLS versions", &e))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| bad("certificate", &e))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        listener.set_nonblocking(true)?;
        let tcp = tokio::net::TcpListener::from_std(listener)?;
        let addr = tcp.local_addr()?;
        let listener = TlsListener {
            tcp,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        };
        let app = self.router();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(RunningOciDev {
            server: self.clone(),
            addr,
            tls: true,
            task,
        })
    }

    fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route(
                "/_oci/faults",
                axum::routing::post(post_faults).delete(delete_faults),
            )
            .route("/_oci/stats", axum::routing::get(get_stats))
            .fallback(handle)
            .with_state(self.clone())
    }

    fn request_id(&self) -> String {
        format!(
            "dev-{:08x}",
            self.counters.request_ids.fetch_add(1, Ordering::Relaxed)
        )
    }

    /// Checks the request's signature by a key this server knows; `Err` is the reason for a
    /// `401`.
    fn authenticate(&self, method: &Method, uri: &Uri, headers: &HeaderMap) -> Result<(), String> {
        verify_request(method, uri, headers, &[], |key_id| {
            self.keys.lock().unwrap().get(key_id).cloned()
        })
    }
}

/// Checks a request's signature (see the module docs); `must_sign` names headers the signature
/// must cover besides `date`, `(request-target)` and `host`; `key_of` gives the DER
/// `RSAPublicKey` of a `keyId`.
fn verify_request(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    must_sign: &[&str],
    key_of: impl FnOnce(&str) -> Option<Vec<u8>>,
) -> Result<(), String> {
    const GENERIC: &str =
        "The required information to complete authentication was not provided or was incorrect.";
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| format!("{GENERIC} (no Authorization header)"))?;
    let parsed = sign::parse_authorization(auth)
        .ok_or_else(|| format!("{GENERIC} (malformed Signature header)"))?;
    if parsed.algorithm != "rsa-sha256" {
        return Err(format!(
            "{GENERIC} (algorithm {} is not supported)",
            parsed.algorithm
        ));
    }
    for required in ["(request-target)", "host"].iter().chain(must_sign) {
        if !parsed.headers.iter().any(|h| h == required) {
            return Err(format!(
                "{GENERIC} (the signature does not cover {required})"
            ));
        }
    }
    let date_header = if parsed.headers.iter().any(|h| h == "x-date") {
        "x-date"
    } else if parsed.headers.iter().any(|h| h == "date") {
        "date"
    } else {
        return Err(format!("{GENERIC} (the signature does not cover date)"));
    };
    let date = headers
        .get(date_header)
        .and_then(|v| v.to_str().ok())
        .and_then(|d| httpdate::parse_http_date(d).ok())
        .ok_or_else(|| format!("{GENERIC} (missing or malformed {date_header})"))?;
    let now = SystemTime::now();
    let skew = now
        .duration_since(date)
        .or_else(|_| date.duration_since(now))
        .unwrap_or_default();
    if skew > MAX_CLOCK_SKEW {
        return Err(format!(
            "The request date is {}s away from the server clock; at most {}s are allowed.",
            skew.as_secs(),
            MAX_CLOCK_SKEW.as_secs()
        ));
    }
    let key = key_of(&parsed.key_id).ok_or_else(|| format!("{GENERIC} (unknown keyId)"))?;
    let path_and_query = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let target = sign::request_target(method.as_str(), path_and_query);
    let names: Vec<&str> = parsed.headers.iter().map(String::as_str).collect();
    let text = sign::signing_string(&names, |name| match name {
        "(request-target)" => Some(target.clone()),
        other => {
            let values: Vec<&str> = headers
                .get_all(other)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            (!values.is_empty()).then(|| values.join(", "))
        }
    })
    .ok_or_else(|| format!("{GENERIC} (a signed header is missing)"))?;
    if sign::verify(&key, &text, &parsed.signature) {
        Ok(())
    } else {
        Err(format!("{GENERIC} (the signature does not verify)"))
    }
}

fn walk(dir: &Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

type DevState = State<Arc<OciDev>>;

fn error(server: &OciDev, status: StatusCode, code: &str, message: &str) -> Response {
    let mut resp = (
        status,
        Json(serde_json::json!({"code": code, "message": message})),
    )
        .into_response();
    resp.headers_mut().insert(
        "opc-request-id",
        HeaderValue::from_str(&server.request_id()).expect("ASCII"),
    );
    resp
}

fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

fn query_params(uri: &Uri) -> HashMap<String, String> {
    uri.query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (percent_decode(k), percent_decode(&v.replace('+', " "))),
            None => (percent_decode(p), String::new()),
        })
        .collect()
}

async fn handle(
    State(server): DevState,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    server.counters.requests.fetch_add(1, Ordering::Relaxed);
    if let Some(path) = uri.path().strip_prefix("/opc/v2/") {
        return metadata(&server, path, &headers);
    }
    if uri.path() == "/v1/x509" && method == Method::POST {
        return federate(&server, &method, &uri, &headers, &body);
    }
    if uri.path() == "/resourcePrincipalSessionTokens" && method == Method::POST {
        return oke_exchange(&server, &headers, &body);
    }
    if let Err(reason) = server.authenticate(&method, &uri, &headers) {
        server
            .counters
            .refused_signatures
            .fetch_add(1, Ordering::Relaxed);
        return error(
            &server,
            StatusCode::UNAUTHORIZED,
            "NotAuthenticated",
            &reason,
        );
    }
    // Segments of the raw path: n, {ns}, b, {bucket}, o, {object name (may hold %2F)}.
    let raw = uri.path();
    let parts: Vec<&str> = raw.trim_start_matches('/').splitn(6, '/').collect();
    match (method.clone(), parts.as_slice()) {
        (Method::GET, ["n", ""] | ["n"]) => {
            let ns = server
                .buckets
                .lock()
                .unwrap()
                .keys()
                .next()
                .map(|(ns, _)| ns.clone())
                .unwrap_or_default();
            Json(ns).into_response()
        }
        (Method::GET, ["n", ns, "b", bucket, "o"]) => {
            list(&server, &percent_decode(ns), &percent_decode(bucket), &uri).await
        }
        (Method::GET | Method::HEAD, ["n", ns, "b", bucket, "o", name]) if !name.is_empty() => {
            object(
                &server,
                &method,
                &percent_decode(ns),
                &percent_decode(bucket),
                &percent_decode(name),
                &headers,
            )
            .await
        }
        _ => error(
            &server,
            StatusCode::NOT_FOUND,
            "NotFound",
            "Not supported by the development look-alike",
        ),
    }
}

fn metadata(server: &OciDev, path: &str, headers: &HeaderMap) -> Response {
    server
        .counters
        .metadata_requests
        .fetch_add(1, Ordering::Relaxed);
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if bearer != Some("Bearer Oracle") {
        return (
            StatusCode::UNAUTHORIZED,
            "Authorization: Bearer Oracle is required",
        )
            .into_response();
    }
    let Some(identity) = server.instance.lock().unwrap().clone() else {
        return (StatusCode::NOT_FOUND, "not an instance").into_response();
    };
    let text = match path {
        "identity/cert.pem" => identity.cert_pem,
        "identity/key.pem" => identity.key_pem,
        "identity/intermediate.pem" => identity.intermediate_pem,
        "instance/canonicalRegionName" => identity.region,
        _ => return (StatusCode::NOT_FOUND, "not found").into_response(),
    };
    text.into_response()
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct FederationRequest {
    certificate: String,
    public_key: String,
    #[serde(default)]
    intermediate_certificates: Vec<String>,
    #[serde(default)]
    purpose: Option<String>,
}

/// The proxymux's token exchange of OKE workload identity (see the module docs).
fn oke_exchange(server: &OciDev, headers: &HeaderMap, body: &[u8]) -> Response {
    let expected = server.oke_token.lock().unwrap().clone();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if expected.is_none() || bearer != expected.as_deref() {
        server
            .counters
            .refused_signatures
            .fetch_add(1, Ordering::Relaxed);
        return error(
            server,
            StatusCode::UNAUTHORIZED,
            "NotAuthenticated",
            "The service account token was not accepted.",
        );
    }
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.to_ascii_lowercase().starts_with("application/json"));
    let session_key = serde_json::from_slice::<PodKeyRequest>(body)
        .ok()
        .filter(|_| json)
        .and_then(|r| B64.decode(r.pod_key).ok())
        .and_then(|der| sign::rsa_public_key_from_spki(&der).ok())
        // Usable for rsa-sha256 signatures (2048 bits and more), as the service requires.
        .filter(|key| sign::rsa_modulus_bits(key).is_some_and(|bits| bits >= 2048));
    let Some(session_key) = session_key else {
        return error(
            server,
            StatusCode::BAD_REQUEST,
            "InvalidParameter",
            "a JSON body with podKey, the base64 DER SubjectPublicKeyInfo of an RSA key of at \
             least 2048 bits, is required",
        );
    };
    let n = server
        .counters
        .oke_exchanges
        .fetch_add(1, Ordering::Relaxed);
    let key_digest: [u8; 32] = sha2::Sha256::digest(&session_key).into();
    server.oke_pod_keys.lock().unwrap().insert(key_digest);
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let b64url = |v: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v);
    let jwt_header = serde_json::json!({"alg": "RS256", "typ": "JWT", "kid": "devhub"});
    let claims = serde_json::json!({
        "sub": "ocid1.workload.oc1..devworkload",
        "res_type": "workload",
        "jti": format!("devrpst{n}.{}", hex::encode(&key_digest[..8])),
        "iat": now,
        "exp": now + 3600,
    });
    let unsigned = format!(
        "{}.{}",
        b64url(jwt_header.to_string().as_bytes()),
        b64url(claims.to_string().as_bytes())
    );
    let stand_in = sha2::Sha256::digest(unsigned.as_bytes());
    let token = format!("{unsigned}.{}", b64url(&stand_in));
    server.add_key(&format!("ST${token}"), session_key);
    let answer = serde_json::json!({ "token": format!("ST${token}") }).to_string();
    let mut resp = B64.encode(answer).into_response();
    resp.headers_mut().insert(
        "opc-request-id",
        HeaderValue::from_str(&server.request_id()).expect("ASCII"),
    );
    resp
}

fn federate(
    server: &OciDev,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Response {
    let refuse = |reason: &str| {
        server
            .counters
            .refused_signatures
            .fetch_add(1, Ordering::Relaxed);
        error(server, StatusCode::UNAUTHORIZED, "NotAuthenticated", reason)
    };
    let Ok(request) = serde_json::from_slice::<FederationRequest>(body) else {
        return error(
            server,
            StatusCode::BAD_REQUEST,
            "InvalidParameter",
            "malformed body",
        );
    };
    let Some(identity) = server.instance.lock().unwrap().clone() else {
        return refuse("no instance is known");
    };
    let Ok(cert) = B64.decode(&request.certificate) else {
        return error(
            server,
            StatusCode::BAD_REQUEST,
            "InvalidParameter",
            "certificate",
        );
    };
    if sign::pem_der(&identity.cert_pem, "CERTIFICATE").as_deref() != Some(&cert[..]) {
        return refuse("the certificate is not the instance's");
    }
    if request.intermediate_certificates.is_empty() || request.purpose.as_deref() != Some("DEFAULT")
    {
        return error(
            server,
            StatusCode::BAD_REQUEST,
            "InvalidParameter",
            "intermediateCertificates and purpose DEFAULT are required",
        );
    }
    let digest = B64.encode(sha2::Sha256::digest(body));
    if headers
        .get("x-content-sha256")
        .and_then(|v| v.to_str().ok())
        != Some(digest.as_str())
    {
        return refuse("x-content-sha256 does not match the body");
    }
    let tenancy = sign::certificate_attribute(&cert, "opc-tenant:").unwrap_or_default();
    let expected_key_id = format!(
        "{tenancy}/fed-x509-sha256/{}",
        sign::certificate_sha256_fingerprint(&cert)
    );
    let leaf_key =
        sign::certificate_spki(&cert).and_then(|s| sign::rsa_public_key_from_spki(&s).ok());
    let verified = verify_request(
        method,
        uri,
        headers,
        &["x-content-sha256", "content-type", "content-length"],
        |key_id| (key_id == expected_key_id).then_some(leaf_key).flatten(),
    );
    if let Err(reason) = verified {
        return refuse(&reason);
    }
    let Some(session_key) = B64
        .decode(&request.public_key)
        .ok()
        .and_then(|der| sign::rsa_public_key_from_spki(&der).ok())
    else {
        return error(
            server,
            StatusCode::BAD_REQUEST,
            "InvalidParameter",
            "publicKey",
        );
    };
    let n = server.counters.federations.fetch_add(1, Ordering::Relaxed);
    let token = format!(
        "devsession{n}.{}",
        hex::encode(&sha2::Sha256::digest(&session_key)[..8])
    );
    server.add_key(&format!("ST${token}"), session_key);
    Json(serde_json::json!({ "token": token })).into_response()
}

async fn list(server: &Arc<OciDev>, ns: &str, bucket: &str, uri: &Uri) -> Response {
    server
        .counters
        .list_requests
        .fetch_add(1, Ordering::Relaxed);
    let q = query_params(uri);
    if let Some(f) = server
        .faults
        .take(FaultTarget::Api, &format!("{ns}/{bucket}/list"))
    {
        if let Some(r) = early_fault(server, &f).await {
            return r;
        }
    }
    let buckets = server.buckets.lock().unwrap();
    let Some(objects) = buckets.get(&(ns.to_string(), bucket.to_string())) else {
        return error(
            server,
            StatusCode::NOT_FOUND,
            "BucketNotFound",
            &format!("Either the bucket named '{bucket}' does not exist in the namespace '{ns}' or you are not authorized to access it"),
        );
    };
    let prefix = q.get("prefix").cloned().unwrap_or_default();
    let start = q.get("start").cloned().unwrap_or_default();
    let limit = q
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .unwrap_or(1000)
        .clamp(1, 1000)
        .min(server.config.page_size.max(1));
    let fields: Vec<String> = q
        .get("fields")
        .map(|f| f.split(',').map(|s| s.trim().to_string()).collect())
        .unwrap_or_default();
    let mut page = Vec::new();
    let mut next = None;
    for (name, o) in objects.range(start.clone()..) {
        if !name.starts_with(&prefix) {
            if name.as_str() > prefix.as_str() && !prefix.is_empty() {
                break;
            }
            continue;
        }
        if page.len() == limit {
            next = Some(name.clone());
            break;
        }
        let mut entry = serde_json::Map::new();
        entry.insert("name".into(), name.clone().into());
        for f in &fields {
            match f.as_str() {
                "size" => {
                    entry.insert("size".into(), (o.bytes.len() as u64).into());
                }
                "md5" => {
                    entry.insert("md5".into(), o.listed_md5().into());
                }
                "etag" => {
                    entry.insert("etag".into(), o.etag.clone().into());
                }
                "timeCreated" => {
                    entry.insert("timeCreated".into(), "2026-01-01T00:00:00.000Z".into());
                }
                _ => {}
            }
        }
        page.push(serde_json::Value::Object(entry));
    }
    let mut body = serde_json::json!({"objects": page});
    if let Some(n) = next {
        body["nextStartWith"] = n.into();
    }
    let mut resp = Json(body).into_response();
    resp.headers_mut().insert(
        "opc-request-id",
        HeaderValue::from_str(&server.request_id()).expect("ASCII"),
    );
    resp
}

/// The fault kinds that replace the answer before any byte of it.
async fn early_fault(server: &OciDev, fault: &FaultKind) -> Option<Response> {
    match fault {
        FaultKind::Status {
            status,
            retry_after,
        } => {
            let status = StatusCode::from_u16(*status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let code = match status.as_u16() {
                429 => "TooManyRequests",
                503 => "ServiceUnavailable",
                _ => "InternalServerError",
            };
            let mut r = error(server, status, code, "injected fault");
            if let Some(s) = retry_after {
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(*s));
            }
            Some(r)
        }
        FaultKind::StallHeaders { secs } => {
            tokio::time::sleep(Duration::from_secs(*secs)).await;
            None
        }
        _ => None,
    }
}

/// `bytes=a-b`, `bytes=a-`, `bytes=-n` within `size`: the inclusive range, or `Err` (416).
fn parse_range(value: &str, size: u64) -> Result<(u64, u64), ()> {
    let spec = value.trim().strip_prefix("bytes=").ok_or(())?;
    let (a, b) = spec.split_once('-').ok_or(())?;
    let (start, end) = match (a.trim(), b.trim()) {
        ("", n) => {
            let n: u64 = n.parse().map_err(|_| ())?;
            (size.saturating_sub(n), size.checked_sub(1).ok_or(())?)
        }
        (a, "") => (a.parse().map_err(|_| ())?, size.checked_sub(1).ok_or(())?),
        (a, b) => {
            let (a, b): (u64, u64) = (a.parse().map_err(|_| ())?, b.parse().map_err(|_| ())?);
            (a, b.min(size.saturating_sub(1)))
        }
    };
    if start >= size || start > end {
        return Err(());
    }
    Ok((start, end))
}

async fn object(
    server: &Arc<OciDev>,
    method: &Method,
    ns: &str,
    bucket: &str,
    name: &str,
    headers: &HeaderMap,
) -> Response {
    let head = *method == Method::HEAD;
    let counter = if head {
        &server.counters.head_requests
    } else {
        &server.counters.get_requests
    };
    counter.fetch_add(1, Ordering::Relaxed);
    let target = if head {
        FaultTarget::Api
    } else {
        FaultTarget::File
    };
    let fault = server.faults.take(target, name);
    if let Some(f) = &fault {
        if let Some(r) = early_fault(server, f).await {
            return r;
        }
    }
    let object = server
        .buckets
        .lock()
        .unwrap()
        .get(&(ns.to_string(), bucket.to_string()))
        .and_then(|b| b.get(name).cloned());
    let Some(object) = object else {
        return error(
            server,
            StatusCode::NOT_FOUND,
            "ObjectNotFound",
            &format!("The object '{name}' was not found in the bucket '{bucket}'"),
        );
    };
    if let Some(want) = headers.get(header::IF_MATCH).and_then(|v| v.to_str().ok()) {
        if want.trim() != "*" && want.trim().trim_matches('"') != object.etag.trim_matches('"') {
            return error(
                server,
                StatusCode::PRECONDITION_FAILED,
                "IfMatchFailed",
                "The If-Match header does not match the object's ETag",
            );
        }
    }
    let size = object.bytes.len() as u64;
    let range = match headers.get(header::RANGE).and_then(|v| v.to_str().ok()) {
        Some(r) if !head => match parse_range(r, size) {
            Ok(r) => Some(r),
            Err(()) => {
                return error(
                    server,
                    StatusCode::RANGE_NOT_SATISFIABLE,
                    "InvalidRange",
                    "The requested range is not satisfiable",
                )
            }
        },
        _ => None,
    };
    let (start, end) = range.unwrap_or((0, size.saturating_sub(1)));
    let len = if size == 0 { 0 } else { end - start + 1 };
    if start > 0 {
        server
            .counters
            .ranged_requests
            .fetch_add(1, Ordering::Relaxed);
    }
    let mut resp = Response::builder()
        .status(if range.is_some() {
            StatusCode::PARTIAL_CONTENT
        } else {
            StatusCode::OK
        })
        .header(header::CONTENT_LENGTH, len)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::ETAG, object.etag.clone())
        .header(header::ACCEPT_RANGES, "bytes")
        .header(header::LAST_MODIFIED, "Thu, 01 Jan 2026 00:00:00 GMT")
        .header("opc-request-id", server.request_id());
    if let Some((s, e)) = range {
        resp = resp.header(header::CONTENT_RANGE, format!("bytes {s}-{e}/{size}"));
    } else {
        match &object.multipart {
            Some(m) => resp = resp.header("opc-multipart-md5", m),
            None => {
                resp = resp
                    .header("content-md5", object.md5.clone())
                    .header("opc-content-md5", object.md5.clone())
            }
        }
    }
    for (k, v) in &object.meta {
        resp = resp.header(format!("opc-meta-{k}"), v);
    }
    if head {
        return resp.body(Body::empty()).expect("valid response");
    }
    let body = body_stream(server.clone(), object, start, start + len, fault);
    resp.body(Body::from_stream(body)).expect("valid response")
}

struct BodyState {
    server: Arc<OciDev>,
    object: Arc<DevObject>,
    at: u64,
    end: u64,
    sent: u64,
    fault: Option<FaultKind>,
}

fn body_stream(
    server: Arc<OciDev>,
    object: Arc<DevObject>,
    start: u64,
    end: u64,
    fault: Option<FaultKind>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> {
    let state = BodyState {
        server,
        object,
        at: start,
        end,
        sent: 0,
        fault,
    };
    futures_util::stream::unfold(state, |mut st| async move {
        if st.at >= st.end {
            return None;
        }
        let mut n = (st.end - st.at).min(st.server.config.chunk as u64);
        match &st.fault {
            Some(FaultKind::Truncate { after }) => {
                if st.sent >= *after {
                    // Let the bytes sent so far reach the client before the connection drops
                    // (aborting at once can discard the headers and the buffered body).
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    st.at = st.end;
                    return Some((Err(std::io::Error::other("injected truncation")), st));
                }
                n = n.min(after - st.sent);
            }
            Some(FaultKind::Slow { bytes_per_sec }) => {
                n = n.min((bytes_per_sec / 10).max(1));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            _ => {}
        }
        let mut chunk = st.object.bytes.slice(st.at as usize..(st.at + n) as usize);
        if st.sent == 0 && st.fault == Some(FaultKind::Corrupt) {
            let mut v = chunk.to_vec();
            v[0] ^= 0xff;
            chunk = Bytes::from(v);
        }
        st.at += n;
        st.sent += n;
        st.server
            .counters
            .bytes_served
            .fetch_add(n, Ordering::Relaxed);
        Some((Ok(chunk), st))
    })
}

async fn post_faults(State(server): DevState, Json(faults): Json<Vec<Fault>>) -> StatusCode {
    for f in faults {
        server.add_fault(f);
    }
    StatusCode::NO_CONTENT
}

async fn delete_faults(State(server): DevState) -> StatusCode {
    server.clear_faults();
    StatusCode::NO_CONTENT
}

async fn get_stats(State(server): DevState) -> Json<OciStats> {
    Json(server.stats())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_as_http_defines_them() {
        assert_eq!(parse_range("bytes=0-9", 100), Ok((0, 9)));
        assert_eq!(parse_range("bytes=90-", 100), Ok((90, 99)));
        assert_eq!(parse_range("bytes=-10", 100), Ok((90, 99)));
        assert_eq!(parse_range("bytes=90-200", 100), Ok((90, 99)));
        assert!(parse_range("bytes=100-", 100).is_err());
        assert!(parse_range("bytes=5-1", 100).is_err());
        assert!(parse_range("items=0-1", 100).is_err());
    }

    use modelfs_agent::source::oci::auth::{self, AgentOciEnv, AuthMode};
    use modelfs_agent::source::oci::sign::{RequestToSign, SigningKey};

    fn exchange(server: &OciDev, bearer: &str, pod_key_spki: &[u8]) -> Response {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {bearer}")).unwrap(),
        );
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let body = serde_json::json!({"podKey": B64.encode(pod_key_spki)});
        oke_exchange(server, &headers, body.to_string().as_bytes())
    }

    /// A signed GET of the listing, as a client sends it.
    fn listing_request(key: &SigningKey) -> (Method, Uri, HeaderMap) {
        let path = "/n/ns/b/models/o?prefix=m%2F";
        let mut headers = HeaderMap::new();
        for (name, value) in key.sign(&RequestToSign {
            method: "GET",
            path_and_query: path,
            host: "127.0.0.1:1",
            date: &sign::http_date_now(),
            body: None,
        }) {
            headers.insert(name, HeaderValue::from_str(&value).unwrap());
        }
        headers.insert(header::HOST, HeaderValue::from_static("127.0.0.1:1"));
        (Method::GET, path.parse().unwrap(), headers)
    }

    async fn body_text(resp: Response) -> String {
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn proxymux_issues_a_jwt_bound_to_the_pod_key_and_refuses_other_tokens() {
        let server = OciDev::new(OciDevConfig::default());
        server.set_oke_service_account_token("sa.token.good");
        let pod = SigningKey::generate("").unwrap();
        let other = SigningKey::generate("").unwrap();

        let resp = exchange(&server, "sa.token.bad", &pod.public_key_spki());
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
        assert!(body_text(resp).await.contains("NotAuthenticated"));
        assert_eq!(server.stats().oke_exchanges, 0);

        let resp = exchange(&server, "sa.token.good", &pod.public_key_spki());
        assert_eq!(resp.status(), StatusCode::OK);
        let answer: serde_json::Value =
            serde_json::from_slice(&B64.decode(body_text(resp).await.trim()).unwrap()).unwrap();
        let token = answer["token"].as_str().unwrap().to_string();
        let jwt = token
            .strip_prefix("ST$")
            .expect("ST$ prefix, as the SDKs strip it");
        let claims: serde_json::Value = serde_json::from_slice(
            &base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(jwt.split('.').nth(1).unwrap())
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            claims["exp"].as_u64().unwrap() - claims["iat"].as_u64().unwrap(),
            3600
        );

        // Signed by the pod key under the token: accepted; by another key: refused.
        let (m, u, h) = listing_request(&pod.with_key_id(token.clone()));
        assert_eq!(server.authenticate(&m, &u, &h), Ok(()));
        let (m, u, h) = listing_request(&other.with_key_id(token));
        assert!(server
            .authenticate(&m, &u, &h)
            .unwrap_err()
            .contains("does not verify"));

        // A 1024-bit key (DER RSAPublicKey of a made-up modulus): a parameter error.
        let mut small = vec![0x02, 0x81, 129, 0x00];
        small.extend([0xc5; 128]);
        small.extend([0x02, 0x03, 0x01, 0x00, 0x01]);
        let mut small_key = vec![0x30, 0x81, small.len() as u8];
        small_key.extend(small);
        assert_eq!(sign::rsa_modulus_bits(&small_key), Some(1024));
        let spki = sign::spki_from_rsa_public_key(&small_key);
        let resp = exchange(&server, "sa.token.good", &spki);
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
        assert!(body_text(resp).await.contains("InvalidParameter"));
        let stats = server.stats();
        assert_eq!((stats.oke_exchanges, stats.oke_pod_keys), (1, 1));
    }

    /// A CA and a certificate for 127.0.0.1 signed by it, made with openssl in `dir`:
    /// (CA path, leaf PEM, leaf key PEM).
    fn loopback_certificate(dir: &Path, name: &str) -> (std::path::PathBuf, String, String) {
        let script = format!(
            "cd {} && openssl req -x509 -newkey rsa:2048 -nodes -days 1 -keyout {name}-ca.key \
             -out {name}-ca.crt -subj '/CN={name} CA' 2>/dev/null && \
             openssl req -newkey rsa:2048 -nodes -keyout {name}.key -out {name}.csr \
             -subj '/CN=proxymux' 2>/dev/null && \
             printf 'subjectAltName=IP:127.0.0.1\\nbasicConstraints=critical,CA:FALSE\\n\
extendedKeyUsage=serverAuth\\n' > {name}.ext && \
             openssl x509 -req -in {name}.csr -CA {name}-ca.crt -CAkey {name}-ca.key \
             -CAcreateserial -days 1 -extfile {name}.ext -out {name}.crt 2>/dev/null",
            dir.display()
        );
        let ok = std::process::Command::new("bash")
            .arg("-c")
            .arg(&script)
            .status()
            .unwrap()
            .success();
        assert!(ok, "openssl failed");
        (
            dir.join(format!("{name}-ca.crt")),
            std::fs::read_to_string(dir.join(format!("{name}.crt"))).unwrap(),
            std::fs::read_to_string(dir.join(format!("{name}.key"))).unwrap(),
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_agents_exchange_over_tls_gives_a_key_the_look_alike_accepts() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().unwrap();
        let (ca, cert, key) = loopback_certificate(dir.path(), "cluster");
        let (other_ca, ..) = loopback_certificate(dir.path(), "other");
        let server = OciDev::new(OciDevConfig::default());
        server.set_oke_service_account_token("header.payload.signature");
        std::fs::write(dir.path().join("token"), "header.payload.signature\n").unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let running = server.serve_tls(listener, &cert, &key).await.unwrap();
        let mut env = AgentOciEnv {
            oke_proxymux: Some(running.url()),
            oke_token_path: dir.path().join("token"),
            oke_ca_path: ca,
            ..Default::default()
        };
        env.resource_principal.insert(
            "OCI_RESOURCE_PRINCIPAL_REGION".into(),
            "eu-frankfurt-1".into(),
        );
        let http = reqwest::Client::builder().build().unwrap();
        let timeout = Duration::from_secs(10);
        let creds = auth::credentials(AuthMode::OkeWorkloadIdentity, None, &env, &http, timeout)
            .await
            .unwrap();
        assert_eq!(creds.region.as_deref(), Some("eu-frankfurt-1"));
        assert!(creds.key.key_id().starts_with("ST$"));
        assert!(!format!("{creds:?}").contains(&creds.key.key_id()[3..]));
        let (m, u, h) = listing_request(&creds.key);
        assert_eq!(server.authenticate(&m, &u, &h), Ok(()));
        // Again: a new exchange, a new session key.
        auth::credentials(AuthMode::OkeWorkloadIdentity, None, &env, &http, timeout)
            .await
            .unwrap();
        assert_eq!(server.stats().oke_pod_keys, 2);

        // A proxymux whose certificate the service account CA did not sign: no exchange.
        env.oke_ca_path = other_ca;
        let e = auth::credentials(AuthMode::OkeWorkloadIdentity, None, &env, &http, timeout)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("certificate"), "{e}");
        assert_eq!(server.stats().oke_exchanges, 2);
    }

    #[test]
    fn multipart_md5_is_over_the_part_md5s() {
        let o = DevObject::multipart(vec![7u8; 10], 4, false);
        let mut all = Md5::new();
        for p in [&[7u8; 4][..], &[7u8; 4][..], &[7u8; 2][..]] {
            all.update(Md5::digest(p));
        }
        assert_eq!(
            o.multipart.as_deref(),
            Some(format!("{}-3", B64.encode(all.finalize())).as_str())
        );
        assert!(o.meta.is_empty());
    }
}
