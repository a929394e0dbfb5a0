//! The Hugging Face source as a [`RangeSource`]: one byte range of one file at a commit,
//! `GET {ep}/{repo}/resolve/{commit}/{path}` with `Range`. Everything else (scheduling,
//! verification, resume, retries, the transfer limit, progress) is the shared
//! [`pipeline`](crate::source::pipeline).
//!
//! A `206` must start where it was asked to (`Content-Range`); a `200` is a hub that ignores
//! `Range`, handed to the pipeline as a whole-file answer.

use std::sync::Arc;

use futures_util::StreamExt;
use reqwest::header::{CONTENT_RANGE, RANGE};
use reqwest::{Response, StatusCode};

use super::client::network;
use super::HfSource;
use crate::metrics::SourceScheme;
use crate::source::pipeline::{self, BodyStream, RangeBody, RangeSource, TransferError};
use crate::source::{FetchContext, SourceError};
use modelfs_core::artifact::{Manifest, ManifestEntry, Sha256Digest};

/// Fetches every entry the store lacks; returns the sha256 blob of every entry.
pub async fn fetch(
    src: &HfSource,
    manifest: Arc<Manifest>,
    ctx: FetchContext,
) -> Result<Vec<Sha256Digest>, SourceError> {
    let files = HubFiles {
        src,
        commit: manifest.revision.clone(),
    };
    Ok(pipeline::fetch(&files, src.client().transfers(), manifest, ctx).await?)
}

/// The files of one commit of one repository.
struct HubFiles<'a> {
    src: &'a HfSource,
    commit: String,
}

impl RangeSource for HubFiles<'_> {
    fn label(&self) -> String {
        format!("hf://{}@{}", self.src.repo, self.commit)
    }

    fn scheme(&self) -> SourceScheme {
        SourceScheme::Hf
    }

    fn throttle(&self) -> &crate::source::ThrottleObserver {
        self.src.throttle()
    }

    async fn open_range(
        &self,
        what: &str,
        entry: &ManifestEntry,
        at: u64,
        end: Option<u64>,
    ) -> Result<RangeBody, TransferError> {
        let client = self.src.client();
        let url = self.src.file_url(&self.commit, &entry.path);
        let range = match end {
            Some(end) => format!("bytes={at}-{}", end - 1),
            None => format!("bytes={at}-"),
        };
        let req = client.request(&url, self.src.token()).header(RANGE, range);
        let resp = client.send(what, req).await?;
        let resp = client.check_status(what, resp).await?;
        match resp.status() {
            StatusCode::PARTIAL_CONTENT => {
                let start = resp
                    .headers()
                    .get(CONTENT_RANGE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(parse_content_range_start);
                if start != Some(at) {
                    return Err(TransferError::Protocol {
                        what: what.into(),
                        detail: format!(
                            "asked for bytes from {at}, got Content-Range starting at {start:?}"
                        ),
                    });
                }
                Ok(RangeBody::Part(body_stream(what, resp)))
            }
            StatusCode::OK => Ok(RangeBody::WholeFile(body_stream(what, resp))),
            other => Err(TransferError::Protocol {
                what: what.into(),
                detail: format!("unexpected status {other} for a file download"),
            }),
        }
    }
}

/// The body of `resp` as a stream that ends at its first error.
fn body_stream(what: &str, resp: Response) -> BodyStream {
    let what = what.to_string();
    futures_util::stream::unfold(Some(resp), move |resp| {
        let what = what.clone();
        async move {
            let mut resp = resp?;
            match resp.chunk().await {
                Ok(Some(bytes)) => Some((Ok(bytes), Some(resp))),
                Ok(None) => None,
                Err(e) => Some((Err(network(&what, e)), None)),
            }
        }
    })
    .boxed()
}

pub(crate) fn parse_content_range_start(v: &str) -> Option<u64> {
    v.trim()
        .strip_prefix("bytes ")?
        .split('-')
        .next()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_range_start() {
        assert_eq!(parse_content_range_start("bytes 100-199/1000"), Some(100));
        assert_eq!(parse_content_range_start("bytes */1000"), None);
    }
}
