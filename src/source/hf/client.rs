//! The HTTP side of the Hugging Face source: one reqwest client per daemon, the node-wide
//! transfer limit, hub error decoding, `Link` pagination and retries.
//!
//! Retry policy (SPEC 7): 5xx, 408, resets, truncated bodies and stalls are retried with
//! jittered exponential backoff (`retry_base` doubling up to `retry_max`, each delay drawn
//! uniformly from 50-100% of the step so that many clients do not retry in lockstep); 429 and
//! 503 wait for `Retry-After` when the hub sends one; 401/403/404 and malformed answers fail at
//! once. After `max_attempts` the error is returned as [`HfError::Exhausted`], which the
//! reconciler treats as transient (it retries the model with its own, longer backoff), except
//! when every attempt ended in a body shorter than its own `Content-Length`: a hub that lies
//! about its answer that consistently will not stop by itself, so the model is `Failed`.
//!
//! Deadlines: no request waits for the hub without a bound. Connecting has `connect_timeout`;
//! the response headers, and every read of a body (JSON, error pages, file bytes), must arrive
//! within `stall_timeout` of the previous byte ([`HubClient::send`], [`HubClient::next_chunk`]);
//! a metadata request (revision, one listing page) must complete within `request_timeout`
//! altogether, so that a hub that trickles a byte now and then cannot hold it either. An error
//! page gets `stall_timeout` in total: its text is a courtesy, the status code is what counts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{HeaderMap, AUTHORIZATION, LINK, RETRY_AFTER};
use reqwest::{Response, Url};
use serde::de::DeserializeOwned;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{HfConfig, HfError};
use crate::source::Token;

/// Largest JSON answer accepted (one page of a tree listing is far smaller).
const MAX_JSON_BYTES: usize = 64 << 20;

/// Shared by every `hf://` model of the daemon.
#[derive(Debug)]
pub struct HubClient {
    config: HfConfig,
    http: reqwest::Client,
    /// Node-wide limit on transfers in flight.
    transfers: Arc<Semaphore>,
}

impl HubClient {
    pub fn new(mut config: HfConfig) -> Result<Self, HfError> {
        while config.endpoint.ends_with('/') {
            config.endpoint.pop();
        }
        // The binary installs ring at start; libraries and tests may not have.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .user_agent(concat!("modelfs/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(config.tuning.connect_timeout)
            .build()
            .map_err(|e| HfError::Network {
                what: "building the HTTP client".into(),
                detail: e.to_string(),
            })?;
        let transfers = Arc::new(Semaphore::new(config.tuning.max_transfers.max(1)));
        Ok(Self {
            config,
            http,
            transfers,
        })
    }

    pub fn config(&self) -> &HfConfig {
        &self.config
    }

    /// The daemon's HTTP client (connection pool), for other sources that share the transfer
    /// limit and tuning.
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    pub fn endpoint(&self) -> &str {
        &self.config.endpoint
    }

    /// A slot of the node-wide transfer limit.
    pub async fn transfer_slot(&self) -> OwnedSemaphorePermit {
        self.transfers
            .clone()
            .acquire_owned()
            .await
            .expect("the transfer semaphore is never closed")
    }

    pub fn request(&self, url: &str, token: Option<&Token>) -> reqwest::RequestBuilder {
        let mut req = self.http.get(url);
        if let Some(t) = token {
            req = req.header(AUTHORIZATION, format!("Bearer {}", t.expose()));
        }
        req
    }

    /// Delay before attempt `attempt + 1` (1-based `attempt`).
    pub fn backoff(&self, attempt: u32, err: &HfError) -> Duration {
        let t = &self.config.tuning;
        if let Some(after) = err.retry_after() {
            return after.min(t.retry_max);
        }
        let step = t
            .retry_base
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(16))
            .min(t.retry_max);
        step.mul_f64(0.5 + 0.5 * fastrand::f64())
    }

    fn stalled(&self, what: &str) -> HfError {
        HfError::Stalled {
            what: what.into(),
            secs: self.config.tuning.stall_timeout.as_secs(),
        }
    }

    /// Sends `req` and waits for the response headers, at most `stall_timeout`.
    pub async fn send(
        &self,
        what: &str,
        req: reqwest::RequestBuilder,
    ) -> Result<Response, HfError> {
        tokio::time::timeout(self.config.tuning.stall_timeout, req.send())
            .await
            .map_err(|_| self.stalled(what))?
            .map_err(|e| network(what, e))
    }

    /// The next piece of a body, at most `stall_timeout` after the previous one. `Ok(None)` at
    /// the end of the body.
    pub async fn next_chunk(
        &self,
        what: &str,
        resp: &mut Response,
    ) -> Result<Option<bytes::Bytes>, HfError> {
        tokio::time::timeout(self.config.tuning.stall_timeout, resp.chunk())
            .await
            .map_err(|_| self.stalled(what))?
            .map_err(|e| network(what, e))
    }

    /// A whole body of at most `limit` bytes, each read within `stall_timeout`. A body that
    /// ends before its `Content-Length` is [`HfError::Truncated`].
    async fn read_limited(
        &self,
        what: &str,
        mut resp: Response,
        limit: usize,
    ) -> Result<Vec<u8>, HfError> {
        let want = resp.content_length();
        let mut out = Vec::new();
        loop {
            let chunk = tokio::time::timeout(self.config.tuning.stall_timeout, resp.chunk())
                .await
                .map_err(|_| self.stalled(what))?;
            let chunk = match chunk {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(e) if is_incomplete_body(&e) => {
                    return Err(HfError::Truncated {
                        what: what.into(),
                        got: out.len() as u64,
                        want: want.unwrap_or(0),
                    })
                }
                Err(e) => return Err(network(what, e)),
            };
            out.extend_from_slice(&chunk);
            if out.len() > limit {
                return Err(HfError::Protocol {
                    what: what.into(),
                    detail: "answer too large".into(),
                });
            }
        }
        Ok(out)
    }

    /// Passes 2xx answers; turns the others into [`HfError::Status`] with the hub's error code
    /// (`X-Error-Code`) and message (`X-Error-Message`, else the JSON `error` field). The error
    /// body gets `stall_timeout` in total: a 5xx whose body never comes is still a 5xx.
    pub(crate) async fn check_status(
        &self,
        what: &str,
        resp: Response,
    ) -> Result<Response, HfError> {
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(|s| s.chars().take(300).collect::<String>())
        };
        let code = header("x-error-code");
        let mut message = header("x-error-message");
        let retry_after = resp
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_retry_after);
        if message.is_none() {
            let body = tokio::time::timeout(
                self.config.tuning.stall_timeout,
                self.read_limited(what, resp, 64 << 10),
            )
            .await;
            if let Ok(Ok(body)) = body {
                message = serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
                    .or_else(|| {
                        let s = String::from_utf8_lossy(&body).trim().to_string();
                        (!s.is_empty()).then_some(s)
                    })
                    .map(|s| s.chars().take(300).collect());
            }
        }
        let mut message = message.unwrap_or_else(|| {
            status
                .canonical_reason()
                .unwrap_or("unexpected status")
                .to_string()
        });
        if matches!(status.as_u16(), 401 | 403) {
            message
                .push_str(" (check the model's token: parameters.token, its Secret, or HF_TOKEN)");
        }
        Err(HfError::Status {
            what: what.into(),
            status: status.as_u16(),
            code,
            message,
            retry_after,
        })
    }

    /// Runs `op` until it succeeds, fails for good, or runs out of attempts.
    pub async fn retrying<T, F, Fut>(
        &self,
        what: &str,
        cancel: &AtomicBool,
        mut op: F,
    ) -> Result<T, HfError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, HfError>>,
    {
        let max = self.config.tuning.max_attempts.max(1);
        let mut attempt = 0;
        loop {
            if cancel.load(Ordering::Relaxed) {
                return Err(HfError::Cancelled);
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
                    return Err(HfError::Exhausted {
                        attempts: attempt,
                        last: Box::new(e),
                    })
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// GETs a JSON document (with retries) and the `rel="next"` page URL, if any. Each attempt
    /// must complete within `request_timeout`.
    pub async fn get_json<T: DeserializeOwned>(
        &self,
        what: &str,
        url: &str,
        token: Option<&Token>,
        cancel: &AtomicBool,
    ) -> Result<(T, Option<String>), HfError> {
        let deadline = self.config.tuning.request_timeout;
        self.retrying(what, cancel, || async {
            tokio::time::timeout(deadline, self.json_attempt(what, url, token))
                .await
                .map_err(|_| HfError::TimedOut {
                    what: what.into(),
                    secs: deadline.as_secs(),
                })?
        })
        .await
    }

    async fn json_attempt<T: DeserializeOwned>(
        &self,
        what: &str,
        url: &str,
        token: Option<&Token>,
    ) -> Result<(T, Option<String>), HfError> {
        let resp = self.send(what, self.request(url, token)).await?;
        let resp = self.check_status(what, resp).await?;
        let next = next_link(resp.headers(), url)
            .map(|n| self.same_origin(what, &n).map(|_| n))
            .transpose()?;
        if resp.content_length().unwrap_or(0) > MAX_JSON_BYTES as u64 {
            return Err(HfError::Protocol {
                what: what.into(),
                detail: "answer too large".into(),
            });
        }
        let body = self.read_limited(what, resp, MAX_JSON_BYTES).await?;
        let value = serde_json::from_slice(&body).map_err(|e| HfError::Protocol {
            what: what.into(),
            detail: format!("malformed JSON: {e}"),
        })?;
        Ok((value, next))
    }

    /// Pagination links must stay on the endpoint's origin: the token goes with them.
    fn same_origin(&self, what: &str, url: &str) -> Result<(), HfError> {
        let origin = |u: &str| {
            Url::parse(u).ok().map(|u| {
                (
                    u.scheme().to_string(),
                    u.host_str().map(str::to_string),
                    u.port_or_known_default(),
                )
            })
        };
        if origin(url).is_some() && origin(url) == origin(&self.config.endpoint) {
            Ok(())
        } else {
            Err(HfError::Protocol {
                what: what.into(),
                detail: format!("pagination link leaves the endpoint: {url:?}"),
            })
        }
    }
}

pub(crate) async fn sleep_unless_cancelled(
    d: Duration,
    cancel: &AtomicBool,
) -> Result<(), HfError> {
    let end = tokio::time::Instant::now() + d;
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(HfError::Cancelled);
        }
        let now = tokio::time::Instant::now();
        if now >= end {
            return Ok(());
        }
        tokio::time::sleep((end - now).min(Duration::from_millis(200))).await;
    }
}

pub(crate) fn network(what: &str, e: reqwest::Error) -> HfError {
    // reqwest's Display names the URL (never headers); the source chain has the cause.
    let mut detail = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        detail.push_str(": ");
        detail.push_str(&s.to_string());
        src = s.source();
    }
    HfError::Network {
        what: what.into(),
        detail,
    }
}

/// Whether a body read failed because the connection closed before the body reached its
/// `Content-Length` (hyper reports that as `UnexpectedEof`; a reset is `ConnectionReset`, a
/// timeout never gets here).
fn is_incomplete_body(e: &reqwest::Error) -> bool {
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        if s.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::UnexpectedEof)
        {
            return true;
        }
        src = s.source();
    }
    false
}

/// Longest `Retry-After` taken as given; a longer one is capped (the backoff caps it further).
pub(crate) const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

/// `Retry-After` in seconds (the HTTP-date form is not used by the hub and is ignored, as
/// before: the normal backoff applies). Capped so no caller can overflow an `Instant`.
pub(crate) fn parse_retry_after(value: &str) -> Option<Duration> {
    let seconds = value.trim().parse::<u64>().ok()?;
    Some(Duration::from_secs(seconds).min(MAX_RETRY_AFTER))
}

/// The `rel="next"` target of a `Link` header, resolved against the request URL.
pub(crate) fn next_link(headers: &HeaderMap, base: &str) -> Option<String> {
    for value in headers.get_all(LINK) {
        let Ok(value) = value.to_str() else { continue };
        for link in value.split(',') {
            let mut parts = link.split(';');
            let Some(target) = parts.next() else { continue };
            let target = target.trim();
            let Some(target) = target.strip_prefix('<').and_then(|t| t.strip_suffix('>')) else {
                continue;
            };
            let is_next = parts.any(|p| {
                let p = p.trim();
                p.strip_prefix("rel=")
                    .map(|r| r.trim_matches('"').split_whitespace().any(|r| r == "next"))
                    .unwrap_or(false)
            });
            if is_next {
                return Url::parse(base)
                    .ok()
                    .and_then(|b| b.join(target).ok())
                    .map(|u| u.to_string());
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn link_header_next() {
        let mut h = HeaderMap::new();
        h.insert(
            LINK,
            HeaderValue::from_static(
                r#"<https://hub/api/x?cursor=1>; rel="prev", </api/models/a/b/tree/c?cursor=2>; rel="next""#,
            ),
        );
        assert_eq!(
            next_link(&h, "https://hub/api/models/a/b/tree/c?recursive=true").as_deref(),
            Some("https://hub/api/models/a/b/tree/c?cursor=2")
        );
        assert_eq!(next_link(&HeaderMap::new(), "https://hub/"), None);
    }

    #[test]
    fn foreign_pagination_links_are_refused() {
        let c = HubClient::new(HfConfig {
            endpoint: "http://127.0.0.1:9/".into(),
            ..HfConfig::default()
        })
        .unwrap();
        assert_eq!(c.endpoint(), "http://127.0.0.1:9");
        assert!(c
            .same_origin("t", "http://127.0.0.1:9/api/x?cursor=1")
            .is_ok());
        assert!(c.same_origin("t", "http://127.0.0.2:9/api/x").is_err());
        assert!(c.same_origin("t", "https://127.0.0.1:9/api/x").is_err());
    }

    #[test]
    fn backoff_grows_and_honours_retry_after() {
        let c = HubClient::new(HfConfig::default()).unwrap();
        let e = HfError::Network {
            what: "w".into(),
            detail: "d".into(),
        };
        let base = c.config.tuning.retry_base;
        let d1 = c.backoff(1, &e);
        let d4 = c.backoff(4, &e);
        assert!(d1 >= base / 2 && d1 <= base);
        assert!(d4 >= base * 4 && d4 <= base * 8);
        let limited = HfError::Status {
            what: "w".into(),
            status: 429,
            code: None,
            message: "slow down".into(),
            retry_after: Some(Duration::from_secs(3)),
        };
        assert_eq!(c.backoff(1, &limited), Duration::from_secs(3));
    }
}
