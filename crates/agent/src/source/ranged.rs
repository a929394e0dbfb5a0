//! What the HTTP sources (`hf://`, `oci://`, `gs://`) share about one ranged GET: the `Range`
//! header for `[at, end)`, the reading of the answer and the mapping of `reqwest` errors.
//!
//! A `206` must start where it was asked to (`Content-Range`): a server that answers another
//! range would have its bytes written at the wrong offset, so that is a protocol error. A `200`
//! is a server that ignores `Range`: the pipeline gets it as a whole-file answer and skips what it
//! already has. Anything else the source has already turned into a status error; what is left is
//! a protocol error naming the status.

use futures_util::StreamExt;
use reqwest::header::CONTENT_RANGE;
use reqwest::{Response, StatusCode};

use super::pipeline::{BodyStream, RangeBody, TransferError};

/// The `Range` header value for bytes `[at, end)`, `end` `None` for "to the end of the file".
pub fn range_header(at: u64, end: Option<u64>) -> String {
    match end {
        Some(end) => format!("bytes={at}-{}", end - 1),
        None => format!("bytes={at}-"),
    }
}

/// Reads the answer to a ranged GET that asked for bytes from `at` (see the module docs).
/// `what` describes the request for errors; `kind` names what was downloaded ("a file", "an
/// object").
pub fn range_answer(
    what: &str,
    kind: &str,
    at: u64,
    resp: Response,
) -> Result<RangeBody, TransferError> {
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
            detail: format!("unexpected status {other} for {kind} download"),
        }),
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

/// The first byte of a `Content-Range: bytes <first>-<last>/<size>` value.
pub(crate) fn parse_content_range_start(v: &str) -> Option<u64> {
    v.trim()
        .strip_prefix("bytes ")?
        .split('-')
        .next()?
        .trim()
        .parse()
        .ok()
}

/// A `reqwest` error as a network error, with its whole source chain (reqwest's own message
/// names the URL, never headers, so no credential reaches it).
pub(crate) fn network(what: &str, e: reqwest::Error) -> TransferError {
    let mut detail = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        detail.push_str(": ");
        detail.push_str(&s.to_string());
        src = s.source();
    }
    TransferError::Network {
        what: what.into(),
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_headers() {
        assert_eq!(range_header(0, Some(10)), "bytes=0-9");
        assert_eq!(range_header(100, None), "bytes=100-");
    }

    #[test]
    fn content_range_start() {
        assert_eq!(parse_content_range_start("bytes 100-199/1000"), Some(100));
        assert_eq!(parse_content_range_start(" bytes 0-0/*"), Some(0));
        assert_eq!(parse_content_range_start("bytes */1000"), None);
        assert_eq!(parse_content_range_start("items 1-2/3"), None);
    }
}
