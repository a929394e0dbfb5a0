//! A loopback HTTP proxy that counts what goes through it and injects faults on demand.
//!
//! Two modes, one handler:
//! * **forward** ([`Proxy::forward`]): a client configured with `HTTP_PROXY=http://<addr>` (or a
//!   per-scheme proxy flag) sends absolute-form requests (`GET http://host:port/path HTTP/1.1`);
//!   the proxy sends them on to that URL. Only `http://` targets: `CONNECT` tunnels (what a
//!   client does for `https://` through a proxy) are refused with 405, since the tests' servers
//!   speak plain HTTP on the loopback.
//! * **reverse** ([`Proxy::reverse`]): the proxy stands in front of one server; a client uses the
//!   proxy's URL as its endpoint and every request goes to the same path and query upstream.
//!
//! Request headers are passed on as sent, `Host` included (a signature over `Host`, such as
//! AWS SigV4, stays valid), minus the hop-by-hop ones; redirects are passed back to the client,
//! not followed (a client following a redirect through a forward proxy comes back through it).
//! Request bodies are buffered (tests upload little through it); response bodies stream.
//!
//! Every request is recorded ([`RequestRecord`]: method, URL, `Range`, status, body bytes sent
//! to the client, injected fault); [`Proxy::stats`] sums them per path. Bytes are counted as
//! they are handed to the connection, so a truncated body counts what was sent.
//!
//! Faults ([`Fault`]) are matched in the order they were added against the method and a
//! substring of the path, each for `count` requests: an error status (optionally with
//! `Retry-After`), S3's `503 SlowDown`, a body cut after some bytes (the upstream's
//! `Content-Length` is kept, then the connection is aborted, as a dropped connection looks to
//! a client), or a body with one byte changed (a bad disk or memory on the server's side: the
//! answer looks perfect).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderName, Method, StatusCode};
use axum::response::Response;

/// What an injected fault does to a matching request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// Answer with `status` (and `Retry-After: <secs>` if given) without asking upstream.
    Status {
        status: u16,
        retry_after_secs: Option<u64>,
    },
    /// S3's throttling answer: `503` with an XML `SlowDown` error body.
    S3SlowDown,
    /// Forward the request but cut the response body after `after` bytes (headers, including
    /// `Content-Length`, as upstream sent them).
    Truncate { after: u64 },
    /// Forward the request without its `Range` header, as a server or proxy that ignores
    /// ranges does: the whole object comes back with `200`.
    IgnoreRange,
    /// Forward the request but flip every bit of the body's byte at offset `at` (of this
    /// answer's body), headers untouched.
    Corrupt { at: u64 },
}

impl FaultKind {
    /// `429 Too Many Requests` with `Retry-After`.
    pub fn too_many_requests(retry_after_secs: u64) -> Self {
        FaultKind::Status {
            status: 429,
            retry_after_secs: Some(retry_after_secs),
        }
    }

    /// A plain error status without `Retry-After`.
    pub fn status(status: u16) -> Self {
        FaultKind::Status {
            status,
            retry_after_secs: None,
        }
    }
}

/// A fault for the next `count` requests whose path contains `path_contains` (any path when
/// `None`) and whose method is `method` (any when `None`).
#[derive(Clone, Debug)]
pub struct Fault {
    pub kind: FaultKind,
    pub count: u64,
    pub path_contains: Option<String>,
    pub method: Option<Method>,
    /// Only requests whose `Range` starts at this byte (`bytes=<at>-...`).
    pub range_from: Option<u64>,
}

impl Fault {
    /// `kind` once, for any request.
    pub fn new(kind: FaultKind) -> Self {
        Fault {
            kind,
            count: 1,
            path_contains: None,
            method: None,
            range_from: None,
        }
    }

    pub fn times(mut self, count: u64) -> Self {
        self.count = count;
        self
    }

    pub fn on_path(mut self, substring: &str) -> Self {
        self.path_contains = Some(substring.to_string());
        self
    }

    pub fn on_method(mut self, method: Method) -> Self {
        self.method = Some(method);
        self
    }

    pub fn on_range_from(mut self, at: u64) -> Self {
        self.range_from = Some(at);
        self
    }

    fn matches(&self, method: &Method, path: &str, range: Option<&str>) -> bool {
        self.count > 0
            && self.method.as_ref().is_none_or(|m| m == method)
            && self
                .path_contains
                .as_deref()
                .is_none_or(|s| path.contains(s))
            && self.range_from.is_none_or(|at| {
                range.is_some_and(|r| r.trim().starts_with(&format!("bytes={at}-")))
            })
    }
}

/// One request seen by the proxy.
#[derive(Clone, Debug)]
pub struct RequestRecord {
    pub method: Method,
    /// The URL the request was sent to (upstream).
    pub url: String,
    /// `host:port` of that URL.
    pub authority: String,
    pub path: String,
    /// The `Range` header, if any.
    pub range: Option<String>,
    /// The `Proxy-Authorization` header, if any (not passed on).
    pub proxy_authorization: Option<String>,
    /// Status returned to the client (502 when upstream could not be reached).
    pub status: u16,
    /// Response body bytes handed to the client so far.
    pub bytes: u64,
    pub fault: Option<FaultKind>,
}

/// Sums over the requests of one path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PathStats {
    pub requests: u64,
    pub bytes: u64,
    pub faults: u64,
}

enum Mode {
    Forward,
    Reverse { upstream: String },
}

struct Entry {
    record: RequestRecord,
    bytes: Arc<AtomicU64>,
}

struct Shared {
    mode: Mode,
    client: reqwest::Client,
    faults: Mutex<Vec<Fault>>,
    records: Mutex<Vec<Entry>>,
}

/// A running proxy; stops with its runtime when dropped.
pub struct Proxy {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    _rt: tokio::runtime::Runtime,
}

impl Proxy {
    /// A forward proxy: set `HTTP_PROXY` (or a per-scheme flag) to [`Proxy::url`].
    pub fn forward() -> Proxy {
        Self::start(Mode::Forward)
    }

    /// A reverse proxy in front of `upstream` (`http://host:port`, no trailing path).
    pub fn reverse(upstream: &str) -> Proxy {
        Self::start(Mode::Reverse {
            upstream: upstream.trim_end_matches('/').to_string(),
        })
    }

    fn start(mode: Mode) -> Proxy {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            // The proxy itself never goes through a proxy from the environment.
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap();
        let shared = Arc::new(Shared {
            mode,
            client,
            faults: Mutex::new(Vec::new()),
            records: Mutex::new(Vec::new()),
        });
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(shared.clone());
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        rt.spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Proxy {
            addr,
            shared,
            _rt: rt,
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn add_fault(&self, fault: Fault) {
        self.shared.faults.lock().unwrap().push(fault);
    }

    /// Drops the faults not yet used up.
    pub fn clear_faults(&self) {
        self.shared.faults.lock().unwrap().clear();
    }

    /// Every request so far, in arrival order.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.shared
            .records
            .lock()
            .unwrap()
            .iter()
            .map(|e| RequestRecord {
                bytes: e.bytes.load(Ordering::Relaxed),
                ..e.record.clone()
            })
            .collect()
    }

    /// Forgets the recorded requests (faults stay).
    pub fn reset_counts(&self) {
        self.shared.records.lock().unwrap().clear();
    }

    /// Requests, body bytes and injected faults per path.
    pub fn stats(&self) -> BTreeMap<String, PathStats> {
        let mut out: BTreeMap<String, PathStats> = BTreeMap::new();
        for r in self.requests() {
            let s = out.entry(r.path.clone()).or_default();
            s.requests += 1;
            s.bytes += r.bytes;
            s.faults += u64::from(r.fault.is_some());
        }
        out
    }

    /// Body bytes of the requests whose path contains `substring`.
    pub fn bytes_on(&self, substring: &str) -> u64 {
        self.requests()
            .iter()
            .filter(|r| r.path.contains(substring))
            .map(|r| r.bytes)
            .sum()
    }

    /// Body bytes of every request.
    pub fn total_bytes(&self) -> u64 {
        self.requests().iter().map(|r| r.bytes).sum()
    }

    /// Requests whose path contains `substring`.
    pub fn requests_on(&self, substring: &str) -> usize {
        self.requests()
            .iter()
            .filter(|r| r.path.contains(substring))
            .count()
    }

    /// Faults injected so far.
    pub fn faults_injected(&self) -> u64 {
        self.requests().iter().filter(|r| r.fault.is_some()).count() as u64
    }

    /// Polls the records until `pred` holds; panics with the records after `timeout`.
    pub fn wait_until(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&[RequestRecord]) -> bool,
    ) -> Vec<RequestRecord> {
        let deadline = Instant::now() + timeout;
        loop {
            let records = self.requests();
            if pred(&records) {
                return records;
            }
            if Instant::now() >= deadline {
                panic!("proxy: timed out waiting for {what}; requests: {records:#?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Headers that belong to one connection, not to the request (RFC 9110 7.6.1), plus the
/// proxy's own credentials.
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "proxy-connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

fn plain(status: StatusCode, text: &str) -> Response {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "text/plain")
        .body(Body::from(text.to_string()))
        .unwrap()
}

const SLOW_DOWN_XML: &str =
    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>\
<Message>Please reduce your request rate.</Message><RequestId>proxy-fault</RequestId></Error>";

async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    if parts.method == Method::CONNECT {
        return plain(
            StatusCode::METHOD_NOT_ALLOWED,
            "this test proxy forwards plain http:// requests only (no CONNECT)",
        );
    }
    let target = match &shared.mode {
        Mode::Forward => {
            if parts.uri.scheme().is_none() {
                return plain(
                    StatusCode::BAD_REQUEST,
                    "forward proxy: expected an absolute-form request (GET http://host/path)",
                );
            }
            parts.uri.to_string()
        }
        Mode::Reverse { upstream } => format!(
            "{upstream}{}",
            parts.uri.path_and_query().map_or("/", |p| p.as_str())
        ),
    };
    let url = match reqwest::Url::parse(&target) {
        Ok(u) => u,
        Err(e) => {
            return plain(
                StatusCode::BAD_REQUEST,
                &format!("bad target {target}: {e}"),
            )
        }
    };
    let path = url.path().to_string();
    let range_header = parts
        .headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok());
    let fault = {
        let mut faults = shared.faults.lock().unwrap();
        faults
            .iter_mut()
            .find(|f| f.matches(&parts.method, &path, range_header))
            .map(|f| {
                f.count -= 1;
                f.kind.clone()
            })
    };
    let bytes = Arc::new(AtomicU64::new(0));
    let index = {
        let mut records = shared.records.lock().unwrap();
        records.push(Entry {
            record: RequestRecord {
                method: parts.method.clone(),
                url: target.clone(),
                authority: format!(
                    "{}:{}",
                    url.host_str().unwrap_or_default(),
                    url.port_or_known_default().unwrap_or_default()
                ),
                path,
                range: parts
                    .headers
                    .get(header::RANGE)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string),
                proxy_authorization: parts
                    .headers
                    .get(header::PROXY_AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string),
                status: 0,
                bytes: 0,
                fault: fault.clone(),
            },
            bytes: bytes.clone(),
        });
        records.len() - 1
    };
    let set_status = |status: u16| {
        if let Some(e) = shared.records.lock().unwrap().get_mut(index) {
            e.record.status = status;
        }
    };

    let mut cut = None;
    let mut flip = None;
    match fault {
        Some(FaultKind::Status {
            status,
            retry_after_secs,
        }) => {
            set_status(status);
            let mut resp = Response::builder()
                .status(status)
                .header(header::CONTENT_TYPE, "text/plain");
            if let Some(secs) = retry_after_secs {
                resp = resp.header(header::RETRY_AFTER, secs.to_string());
            }
            return resp
                .body(Body::from(format!("injected fault: status {status}")))
                .unwrap();
        }
        Some(FaultKind::S3SlowDown) => {
            set_status(503);
            return Response::builder()
                .status(503)
                .header(header::CONTENT_TYPE, "application/xml")
                .body(Body::from(SLOW_DOWN_XML))
                .unwrap();
        }
        Some(FaultKind::Truncate { after }) => cut = Some(after),
        Some(FaultKind::Corrupt { at }) => flip = Some(at),
        Some(FaultKind::IgnoreRange) | None => {}
    }
    let ignore_range = fault == Some(FaultKind::IgnoreRange);

    let body = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(b) => b,
        Err(e) => return plain(StatusCode::BAD_REQUEST, &format!("reading the body: {e}")),
    };
    let mut upstream_req = shared.client.request(parts.method.clone(), url).body(body);
    for (name, value) in &parts.headers {
        let dropped = ignore_range && name == header::RANGE;
        if !hop_by_hop(name) && !dropped {
            upstream_req = upstream_req.header(name, value);
        }
    }
    let upstream = match upstream_req.send().await {
        Ok(r) => r,
        Err(e) => {
            set_status(502);
            return plain(
                StatusCode::BAD_GATEWAY,
                &format!("proxy: upstream {target}: {e}"),
            );
        }
    };
    set_status(upstream.status().as_u16());
    let mut resp = Response::builder().status(upstream.status());
    for (name, value) in upstream.headers() {
        if !hop_by_hop(name) {
            resp = resp.header(name, value);
        }
    }
    let state = BodyState {
        upstream,
        sent: 0,
        cut,
        flip,
        counter: bytes,
        done: false,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        if s.done {
            return None;
        }
        if s.cut.is_some_and(|cut| s.sent >= cut) {
            s.done = true;
            // Give the connection a moment to write out the bytes before the cut: aborting
            // right away can discard what is still buffered, and the client must see them.
            tokio::time::sleep(Duration::from_millis(50)).await;
            return Some((Err(std::io::Error::other("injected truncation")), s));
        }
        match s.upstream.chunk().await {
            Ok(Some(mut chunk)) => {
                if let Some(cut) = s.cut {
                    chunk.truncate((cut - s.sent).min(chunk.len() as u64) as usize);
                }
                let here = s.sent..s.sent + chunk.len() as u64;
                if let Some(at) = s.flip.filter(|at| here.contains(at)) {
                    let mut bytes = chunk.to_vec();
                    bytes[(at - s.sent) as usize] ^= 0xff;
                    chunk = bytes.into();
                }
                s.sent += chunk.len() as u64;
                s.counter.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                Some((Ok(chunk), s))
            }
            Ok(None) => None,
            Err(e) => {
                s.done = true;
                Some((Err(std::io::Error::other(e)), s))
            }
        }
    });
    resp.body(Body::from_stream(stream)).unwrap()
}

struct BodyState {
    upstream: reqwest::Response,
    sent: u64,
    cut: Option<u64>,
    flip: Option<u64>,
    counter: Arc<AtomicU64>,
    done: bool,
}
