//! The HTTP side of the Hugging Face source: one reqwest client per daemon, hub error
//! decoding, `Link` pagination. The node-wide transfer limit and the retry policy are the
//! pipeline's ([`Transfers`], SPEC 7): 5xx, 408, 429, resets, truncated bodies and stalls are
//! retried with jittered backoff, `Retry-After` wins; 401/403/404 and malformed answers fail at
//! once. After `max_attempts` the error is [`TransferError::Exhausted`], which the reconciler
//! treats as transient (it retries the model with its own, longer backoff), except when every
//! attempt ended in a body shorter than its own `Content-Length`: a hub that lies about its
//! answer that consistently will not stop by itself, so the model is `Failed`.
//!
//! Deadlines: no request waits for the hub without a bound. Connecting has `connect_timeout`;
//! the response headers, and every read of a body (JSON, error pages, file bytes), must arrive
//! within `stall_timeout` of the previous byte ([`HubClient::send`], [`HubClient::next_chunk`]);
//! a metadata request (revision, one listing page) must complete within `request_timeout`
//! altogether, so that a hub that trickles a byte now and then cannot hold it either. An error
//! page gets `stall_timeout` in total: its text is a courtesy, the status code is what counts.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use reqwest::header::{HeaderMap, AUTHORIZATION, LINK, RETRY_AFTER};
use reqwest::{Response, Url};
use serde::de::DeserializeOwned;

use super::HfConfig;
pub(crate) use crate::source::pipeline::parse_retry_after;
use crate::source::pipeline::{TransferError, Transfers};
use crate::source::ranged::network;
use crate::source::Token;

/// Largest JSON answer accepted (one page of a tree listing is far smaller).
const MAX_JSON_BYTES: usize = 64 << 20;

/// Shared by every `hf://` model of the daemon.
#[derive(Debug)]
pub struct HubClient {
    config: HfConfig,
    http: reqwest::Client,
    /// Node-wide transfer limit and retry policy, shared with the other sources.
    transfers: Arc<Transfers>,
}

impl HubClient {
    /// A client with a transfer limit of its own (tests); the daemon shares one with
    /// [`HubClient::with_transfers`].
    pub fn new(config: HfConfig) -> Result<Self, TransferError> {
        let transfers = Transfers::new(config.tuning.clone());
        Self::with_transfers(config, transfers)
    }

    pub fn with_transfers(
        mut config: HfConfig,
        transfers: Arc<Transfers>,
    ) -> Result<Self, TransferError> {
        while config.endpoint.ends_with('/') {
            config.endpoint.pop();
        }
        // The binary installs ring at start; libraries and tests may not have.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let builder = reqwest::Client::builder()
            .user_agent(concat!("modelfs/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(config.tuning.connect_timeout);
        // HTTP(S)_PROXY / NO_PROXY from the environment unless --proxy-hf says otherwise.
        let http = crate::source::proxy::configure(config.proxy.as_ref(), builder)
            .and_then(|b| b.build())
            .map_err(|e| TransferError::Network {
                what: "building the HTTP client".into(),
                detail: e.to_string(),
            })?;
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

    pub fn transfers(&self) -> &Transfers {
        &self.transfers
    }

    pub fn request(&self, url: &str, token: Option<&Token>) -> reqwest::RequestBuilder {
        let mut req = self.http.get(url);
        if let Some(t) = token {
            req = req.header(AUTHORIZATION, format!("Bearer {}", t.expose()));
        }
        req
    }

    fn stalled(&self, what: &str) -> TransferError {
        TransferError::Stalled {
            what: what.into(),
            secs: self.config.tuning.stall_timeout.as_secs(),
        }
    }

    /// Sends `req` and waits for the response headers, at most `stall_timeout`.
    pub async fn send(
        &self,
        what: &str,
        req: reqwest::RequestBuilder,
    ) -> Result<Response, TransferError> {
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
    ) -> Result<Option<bytes::Bytes>, TransferError> {
        tokio::time::timeout(self.config.tuning.stall_timeout, resp.chunk())
            .await
            .map_err(|_| self.stalled(what))?
            .map_err(|e| network(what, e))
    }

    /// A whole body of at most `limit` bytes, each read within `stall_timeout`. A body that
    /// ends before its `Content-Length` is [`TransferError::Truncated`].
    async fn read_limited(
        &self,
        what: &str,
        mut resp: Response,
        limit: usize,
    ) -> Result<Vec<u8>, TransferError> {
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
                    return Err(TransferError::Truncated {
                        what: what.into(),
                        got: out.len() as u64,
                        want: want.unwrap_or(0),
                    })
                }
                Err(e) => return Err(network(what, e)),
            };
            out.extend_from_slice(&chunk);
            if out.len() > limit {
                return Err(TransferError::Protocol {
                    what: what.into(),
                    detail: "answer too large".into(),
                });
            }
        }
        Ok(out)
    }

    /// Passes 2xx answers; turns the others into [`TransferError::Status`] with the hub's error code
    /// (`X-Error-Code`) and message (`X-Error-Message`, else the JSON `error` field). The error
    /// body gets `stall_timeout` in total: a 5xx whose body never comes is still a 5xx.
    pub(crate) async fn check_status(
        &self,
        what: &str,
        resp: Response,
    ) -> Result<Response, TransferError> {
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
        Err(TransferError::Status {
            what: what.into(),
            status: status.as_u16(),
            code,
            message,
            retry_after,
        })
    }

    /// GETs a JSON document (with retries) and the `rel="next"` page URL, if any. Each attempt
    /// must complete within `request_timeout`.
    pub async fn get_json<T: DeserializeOwned>(
        &self,
        what: &str,
        url: &str,
        token: Option<&Token>,
        cancel: &AtomicBool,
        throttle: &crate::source::ThrottleObserver,
    ) -> Result<(T, Option<String>), TransferError> {
        let deadline = self.config.tuning.request_timeout;
        self.transfers
            .retrying(what, cancel, throttle, || async {
                tokio::time::timeout(deadline, self.json_attempt(what, url, token))
                    .await
                    .map_err(|_| TransferError::TimedOut {
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
    ) -> Result<(T, Option<String>), TransferError> {
        let resp = self.send(what, self.request(url, token)).await?;
        let resp = self.check_status(what, resp).await?;
        let next = next_link(resp.headers(), url)
            .map(|n| self.same_origin(what, &n).map(|_| n))
            .transpose()?;
        if resp.content_length().unwrap_or(0) > MAX_JSON_BYTES as u64 {
            return Err(TransferError::Protocol {
                what: what.into(),
                detail: "answer too large".into(),
            });
        }
        let body = self.read_limited(what, resp, MAX_JSON_BYTES).await?;
        let value = serde_json::from_slice(&body).map_err(|e| TransferError::Protocol {
            what: what.into(),
            detail: format!("malformed JSON: {e}"),
        })?;
        Ok((value, next))
    }

    /// Pagination links must stay on the endpoint's origin: the token goes with them.
    fn same_origin(&self, what: &str, url: &str) -> Result<(), TransferError> {
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
            Err(TransferError::Protocol {
                what: what.into(),
                detail: format!("pagination link leaves the endpoint: {url:?}"),
            })
        }
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
}
