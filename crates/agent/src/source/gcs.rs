//! `gs://` over the documented Cloud Storage JSON API: listing, object metadata and ranged
//! media downloads, with the credentials of `object_store`'s GCS client.
//!
//! # Why not `object_store`'s GCS requests
//! `object_store` speaks the GCS *XML* API: it lists with `GET /<bucket>?list-type=2` (the
//! XML ListObjectsV2 form), reads metadata with `HEAD /<bucket>/<object>` and requires `ETag`
//! and `Last-Modified` on every download. The XML listing carries no MD5 and no generation.
//! The JSON API (`GET /storage/v1/b/<bucket>/o?prefix=`, `.../o/<object>`, `...?alt=media`)
//! does: each listed object has its `generation` (the version a download can be pinned to),
//! its `crc32c` and, unless it was composed, its `md5Hash`, which the store checks as it does
//! OCI's MD5 (a composed object is checked by its CRC32C while it is downloaded). It
//! is also the API that Google's own client libraries and the GCS emulators speak (the
//! `gcp-storage-emulator` of the tests answers the XML listing with 501 Not Implemented, has
//! no `HEAD`, and sends neither `ETag` nor `Last-Modified` on downloads).
//!
//! So the requests are ours, the authentication is `object_store`'s: its builder reads the
//! usual environment (`GOOGLE_SERVICE_ACCOUNT`, `GOOGLE_APPLICATION_CREDENTIALS`, application
//! default credentials, the metadata server) and the model's service account key, and its
//! credential provider hands out (and refreshes) the bearer token of each request.
//!
//! # Requests
//! * `GET {base}/storage/v1/b/{bucket}/o?prefix={dir}/&pageToken=...`: pages followed through
//!   `nextPageToken`, each within the metadata deadline.
//! * `GET {base}/storage/v1/b/{bucket}/o/{object}`: the metadata of one object (after a
//!   restart, to pin a download to the listed generation).
//! * `GET {base}/storage/v1/b/{bucket}/o/{object}?alt=media&ifGenerationMatch={gen}` with
//!   `Range`: the bytes, only while the object is still the listed generation (412 otherwise,
//!   and the model lists again).
//!
//! `{base}` is `https://storage.googleapis.com`, or `parameters.endpoint`, or
//! `STORAGE_EMULATOR_HOST` (the variable Google's clients read). Object names are
//! percent-encoded as one path segment (a `/` is `%2F`), as the API requires. Errors are the
//! JSON API's `{"error": {"code", "message", "errors": [{"reason"}]}}`: the reason
//! (`forbidden`, `notFound`, `rateLimitExceeded`, ...) is the error code.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use base64::Engine;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use reqwest::{Method, StatusCode};
use serde::Deserialize;

use super::pipeline::{self, ListedObject, RangeBody, TransferError, Transfers};
use super::ranged::{self, network};
use super::ThrottleObserver;

/// The public endpoint of the JSON API.
pub const DEFAULT_BASE: &str = "https://storage.googleapis.com";

/// Unreserved characters stay; everything else (`/` included) is escaped.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

fn encode(s: &str) -> String {
    utf8_percent_encode(s, SEGMENT).to_string()
}

/// The JSON API client of one bucket.
#[derive(Debug)]
pub struct GcsJsonApi {
    http: reqwest::Client,
    base: String,
    bucket: String,
    /// `None`: unsigned requests (`parameters.anonymous`, or an emulator without a key).
    credentials: Option<object_store::gcp::GcpCredentialProvider>,
    transfers: Arc<Transfers>,
}

/// One object of a listing page, or the metadata of one object.
#[derive(Deserialize)]
struct ObjectResource {
    name: String,
    /// The API sends 64-bit integers as strings.
    size: String,
    generation: String,
    #[serde(rename = "md5Hash")]
    md5_hash: Option<String>,
    /// Base64 of the big-endian CRC32C: every object has one, composed objects (which have
    /// no `md5Hash`) included.
    crc32c: Option<String>,
}

#[derive(Deserialize)]
struct ListPage {
    #[serde(default)]
    items: Vec<ObjectResource>,
    #[serde(rename = "nextPageToken")]
    next_page_token: Option<String>,
}

impl ObjectResource {
    fn listed(self, what: &str) -> Result<ListedObject, TransferError> {
        let size = self.size.parse().map_err(|_| TransferError::Protocol {
            what: what.into(),
            detail: format!("object {:?} has size {:?}", self.name, self.size),
        })?;
        let md5 = self.md5_hash.as_deref().and_then(|m| {
            base64::engine::general_purpose::STANDARD
                .decode(m.trim())
                .ok()?
                .try_into()
                .ok()
        });
        Ok(ListedObject {
            key: self.name,
            size,
            version: self.generation,
            md5,
            crc32c: self
                .crc32c
                .as_deref()
                .and_then(super::checks::crc32c_from_base64),
        })
    }
}

impl GcsJsonApi {
    pub fn new(
        http: reqwest::Client,
        base: &str,
        bucket: &str,
        credentials: Option<object_store::gcp::GcpCredentialProvider>,
        transfers: Arc<Transfers>,
    ) -> Self {
        Self {
            http,
            base: base.trim_end_matches('/').to_string(),
            bucket: bucket.to_string(),
            credentials,
            transfers,
        }
    }

    fn object_url(&self, key: &str) -> String {
        format!(
            "{}/storage/v1/b/{}/o/{}",
            self.base,
            encode(&self.bucket),
            encode(key)
        )
    }

    /// Sends one request (bearer token added) and waits for its headers within the stall
    /// timeout; a non-success answer is the service's error.
    async fn send(
        &self,
        what: &str,
        url: &str,
        query: &[(&str, &str)],
        range: Option<String>,
    ) -> Result<reqwest::Response, TransferError> {
        self.transfers
            .within_stall(what, async {
                let url = reqwest::Url::parse_with_params(url, query).map_err(|e| {
                    TransferError::Protocol {
                        what: what.into(),
                        detail: format!("bad URL: {e}"),
                    }
                })?;
                let mut req = self.http.request(Method::GET, url);
                if let Some(provider) = &self.credentials {
                    let credential =
                        provider
                            .get_credential()
                            .await
                            .map_err(|e| TransferError::Network {
                                what: format!("{what}: getting a Google access token"),
                                detail: e.to_string(),
                            })?;
                    req = req.bearer_auth(&credential.bearer);
                }
                if let Some(range) = range {
                    req = req.header(reqwest::header::RANGE, range);
                }
                let resp = req.send().await.map_err(|e| network(what, e))?;
                if resp.status().is_success() {
                    return Ok(resp);
                }
                Err(self.status_error(what, resp).await)
            })
            .await
    }

    /// The JSON API's error document as the pipeline's error.
    async fn status_error(&self, what: &str, resp: reqwest::Response) -> TransferError {
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(pipeline::parse_retry_after);
        let body = resp.bytes().await.unwrap_or_default();
        let json: Option<serde_json::Value> =
            serde_json::from_slice(&body[..body.len().min(64 << 10)]).ok();
        let clean =
            |s: &str| -> String { s.chars().filter(|c| !c.is_control()).take(300).collect() };
        let error = json.as_ref().and_then(|j| j.get("error"));
        let code = error
            .and_then(|e| e.pointer("/errors/0/reason"))
            .and_then(|r| r.as_str())
            .map(clean);
        let mut message = error
            .and_then(|e| e.get("message"))
            .and_then(|m| m.as_str())
            .map(clean)
            .unwrap_or_else(|| {
                let text = String::from_utf8_lossy(&body);
                let text = text.trim();
                if text.is_empty() || text.starts_with('<') {
                    StatusCode::from_u16(status)
                        .ok()
                        .and_then(|s| s.canonical_reason())
                        .unwrap_or("unexpected status")
                        .to_string()
                } else {
                    clean(text)
                }
            });
        if matches!(status, 401 | 403) {
            message.push_str(
                " (check the model's credentials: its Secret, parameters, or the daemon's \
                 environment)",
            );
        }
        TransferError::Status {
            what: format!("{what} (Cloud Storage)"),
            status,
            code,
            message,
            retry_after,
        }
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        what: &str,
        url: &str,
        query: &[(&str, &str)],
    ) -> Result<T, TransferError> {
        let deadline = self.transfers.tuning().request_timeout;
        let body = tokio::time::timeout(deadline, async {
            let resp = self.send(what, url, query, None).await?;
            resp.bytes().await.map_err(|e| network(what, e))
        })
        .await
        .map_err(|_| TransferError::Stalled {
            what: what.into(),
            secs: deadline.as_secs(),
        })??;
        serde_json::from_slice(&body).map_err(|e| TransferError::Protocol {
            what: what.into(),
            detail: format!("unexpected answer: {e}"),
        })
    }

    /// Every object whose name starts with `prefix` (with retries per page; at most
    /// `max_listing_pages` pages and `max_listing_entries` objects).
    pub async fn list(
        &self,
        what: &str,
        prefix: &str,
        cancel: &AtomicBool,
        throttle: &ThrottleObserver,
    ) -> Result<Vec<ListedObject>, TransferError> {
        let tuning = self.transfers.tuning();
        let url = format!("{}/storage/v1/b/{}/o", self.base, encode(&self.bucket));
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        for _ in 0..tuning.max_listing_pages.max(1) {
            let page: ListPage = self
                .transfers
                .retrying(what, cancel, throttle, || {
                    let mut query = vec![("prefix", prefix)];
                    if let Some(t) = &token {
                        query.push(("pageToken", t.as_str()));
                    }
                    let url = url.clone();
                    async move { self.json(what, &url, &query).await }
                })
                .await?;
            for item in page.items {
                if out.len() >= tuning.max_listing_entries {
                    return Err(TransferError::Limit {
                        what: what.into(),
                        detail: format!(
                            "the listing has more than {} objects; if the prefix really holds \
                             that many, raise --hf-max-listing-entries",
                            tuning.max_listing_entries
                        ),
                    });
                }
                out.push(item.listed(what)?);
            }
            match page.next_page_token.filter(|t| !t.is_empty()) {
                Some(t) => token = Some(t),
                None => return Ok(out),
            }
        }
        Err(TransferError::Limit {
            what: what.into(),
            detail: format!(
                "the listing has more than {} pages",
                tuning.max_listing_pages
            ),
        })
    }

    /// The size and generation of one object (one attempt).
    pub async fn metadata(&self, what: &str, key: &str) -> Result<ListedObject, TransferError> {
        let resource: ObjectResource = self.json(what, &self.object_url(key), &[]).await?;
        if resource.name != key {
            return Err(TransferError::Protocol {
                what: what.into(),
                detail: format!("asked for {key:?}, got {:?}", resource.name),
            });
        }
        resource.listed(what)
    }

    /// Bytes `[at, end)` of generation `generation` of `key` (one attempt). A 412 (the object
    /// changed) is a [`TransferError::Status`] with status 412.
    pub async fn open_range(
        &self,
        what: &str,
        key: &str,
        generation: &str,
        at: u64,
        end: Option<u64>,
    ) -> Result<RangeBody, TransferError> {
        let range = ranged::range_header(at, end);
        let query = [("alt", "media"), ("ifGenerationMatch", generation)];
        let resp = self
            .send(what, &self.object_url(key), &query, Some(range))
            .await?;
        ranged::range_answer(what, "an object", at, resp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_names_are_one_path_segment() {
        assert_eq!(encode("org/m/a b+c.json"), "org%2Fm%2Fa%20b%2Bc.json");
    }

    #[test]
    fn listed_objects_carry_generation_and_md5() {
        let r: ObjectResource = serde_json::from_str(
            r#"{"name":"p/f","size":"6","generation":"17","md5Hash":"sZRqySSS0jR8YjW00mERhA=="}"#,
        )
        .unwrap();
        let o = r.listed("x").unwrap();
        assert_eq!(
            (o.key.as_str(), o.size, o.version.as_str()),
            ("p/f", 6, "17")
        );
        assert_eq!(
            hex::encode(o.md5.unwrap()),
            "b1946ac92492d2347c6235b4d2611184"
        );
        // A composite object without a CRC32C either: the size and the sha256 still hold.
        let r: ObjectResource =
            serde_json::from_str(r#"{"name":"c","size":"1","generation":"2"}"#).unwrap();
        assert!(r.listed("x").unwrap().md5.is_none());
        // A composed object: no md5Hash, its CRC32C is what is checked.
        let composed: ObjectResource = serde_json::from_str(
            r#"{"name":"p/c","size":"6","generation":"18","crc32c":"yZRlqg=="}"#,
        )
        .unwrap();
        let listed = composed.listed("x").unwrap();
        assert_eq!((listed.md5, listed.crc32c), (None, Some(0xc994_65aa)));
    }
}
