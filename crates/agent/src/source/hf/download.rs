//! The Hugging Face source as a [`RangeSource`]: one byte range of one file at a commit,
//! `GET {ep}/{repo}/resolve/{commit}/{path}` with `Range`. Everything else (scheduling,
//! verification, resume, retries, the transfer limit, progress) is the shared
//! [`pipeline`](crate::source::pipeline).
//!
//! A `206` must start where it was asked to (`Content-Range`); a `200` is a hub that ignores
//! `Range`, handed to the pipeline as a whole-file answer.

use std::sync::Arc;

use reqwest::header::RANGE;

use super::HfSource;
use crate::metrics::SourceScheme;
use crate::source::pipeline::{self, RangeBody, RangeSource, TransferError};
use crate::source::ranged;
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
        let req = client
            .request(&url, self.src.token())
            .header(RANGE, ranged::range_header(at, end));
        let resp = client.send(what, req).await?;
        let resp = client.check_status(what, resp).await?;
        ranged::range_answer(what, "a file", at, resp)
    }
}
