//! `hf://<org>/<repo>[@<revision>]`: models from a Hugging Face hub (SPEC 2 and 7).
//!
//! # Resolve
//! A branch or tag is resolved to a commit with `GET /api/models/{repo}/revision/{rev}`; a 40-hex
//! revision is already a commit and skips that call. The file list comes from
//! `GET /api/models/{repo}/tree/{commit}?recursive=true`, following `Link: <..>; rel="next"`
//! pages. Only pages on the endpoint's own origin are followed (a hostile `Link` must not receive
//! the token), at most `max_listing_pages` of them with at most `max_listing_entries` entries in
//! all (a `rel="next"` that never ends fails the model with a reason naming the flag, instead of
//! keeping it `Updating` forever), and the listing goes through [`Manifest::new`], which rejects absolute paths,
//! `..`, NUL, duplicates, file/directory clashes and absurd sizes; negative sizes and LFS sizes
//! that disagree with the entry are rejected here. The manifest's revision is the commit, so the
//! artifact is identified by repo + commit and by the manifest digest; two revisions with
//! different files are different artifacts.
//!
//! **Access check (SPEC 3.1).** `resolve` always calls the hub with the model's own token
//! (never a cache of resolves shared between models), and the reconciler resolves every model
//! before placing it. A model without access therefore fails at resolve with the hub's error
//! code (`GatedRepo`, `RepoNotFound`) and can never be mapped onto another model's copy.
//!
//! # Fetch
//! Through the shared [`pipeline`](crate::source::pipeline); [`download`] is the adapter that
//! opens a byte range of a file at a commit. Files are fetched several at a time, large files as
//! parallel ranges that are written in order, each blob hashed while written (sha256 for LFS
//! files, git blob sha1 for the rest) and renamed into the store only once verified. Partial files survive a crash and
//! resume with `Range`. Blobs the model's store already holds are not downloaded again; for
//! small (git sha1) files the store keeps an alias from the git digest to the blob, so a new
//! revision fetches only what changed.
//!
//! # Credentials
//! The model's token (`parameters.token`, later the Kubernetes Secret) wins over the daemon's
//! default (`HF_TOKEN`). A [`Token`] cannot be formatted; it reaches only the `Authorization`
//! header. reqwest drops that header when a redirect changes host, scheme or port (the real hub
//! redirects LFS files to a CDN), and errors never include request headers.

pub mod client;
pub mod download;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde::Deserialize;

use super::{FetchContext, SourceError, Token};
use modelfs_core::artifact::{FileDigest, Manifest, ManifestEntry, Sha256Digest, MAX_ENTRIES};
use modelfs_ome::source::is_commit_hash;

pub use crate::source::pipeline::DownloadTuning;
use crate::source::pipeline::TransferError;
pub use client::HubClient;

/// The public hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Daemon-wide Hugging Face settings.
#[derive(Clone, Debug)]
pub struct HfConfig {
    /// Base URL of the hub, without a trailing slash.
    pub endpoint: String,
    /// Used by models that bring no token of their own.
    pub default_token: Option<Token>,
    pub tuning: DownloadTuning,
    /// `--proxy-hf`; `None`: the environment's proxies (see `source::proxy`).
    pub proxy: Option<crate::source::proxy::ProxyUrl>,
}

impl Default for HfConfig {
    fn default() -> Self {
        Self {
            endpoint: DEFAULT_ENDPOINT.into(),
            default_token: None,
            tuning: DownloadTuning::default(),
            proxy: None,
        }
    }
}

/// Characters escaped in a revision placed in a URL path segment (`refs/pr/1` -> `refs%2Fpr%2F1`).
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.');
/// Characters escaped in a file path: as above, but `/` separates segments.
const PATH: &AsciiSet = &SEGMENT.remove(b'/');

pub(crate) fn encode_segment(s: &str) -> String {
    utf8_percent_encode(s, SEGMENT).to_string()
}

pub(crate) fn encode_path(s: &str) -> String {
    utf8_percent_encode(s, PATH).to_string()
}

/// One `hf://` source as a model sees it: repo, requested revision, and the credentials to use.
#[derive(Clone, Debug)]
pub struct HfSource {
    pub repo: String,
    pub revision: String,
    token: Option<Token>,
    client: Arc<HubClient>,
    throttle: crate::source::ThrottleObserver,
}

#[derive(Deserialize)]
struct RevisionInfo {
    sha: Option<String>,
}

#[derive(Deserialize)]
struct TreeEntry {
    #[serde(rename = "type")]
    kind: String,
    path: String,
    #[serde(default)]
    size: Option<serde_json::Number>,
    #[serde(default)]
    oid: Option<String>,
    #[serde(default)]
    lfs: Option<LfsInfo>,
}

#[derive(Deserialize)]
struct LfsInfo {
    oid: String,
    size: serde_json::Number,
}

fn parse_size(what: &str, path: &str, n: &serde_json::Number) -> Result<u64, TransferError> {
    n.as_u64().ok_or_else(|| TransferError::Protocol {
        what: what.into(),
        detail: format!("{path:?} has an invalid size {n}"),
    })
}

impl TreeEntry {
    fn into_manifest_entry(self, what: &str) -> Result<ManifestEntry, TransferError> {
        let bad = |detail: String| TransferError::Protocol {
            what: what.into(),
            detail,
        };
        let size = match &self.size {
            Some(n) => parse_size(what, &self.path, n)?,
            None => return Err(bad(format!("{:?} has no size", self.path))),
        };
        let digest = match &self.lfs {
            Some(lfs) => {
                let lfs_size = parse_size(what, &self.path, &lfs.size)?;
                if lfs_size != size {
                    return Err(bad(format!(
                        "{:?} has size {size} but LFS size {lfs_size}",
                        self.path
                    )));
                }
                let mut d = [0u8; 32];
                hex::decode_to_slice(&lfs.oid, &mut d)
                    .map_err(|_| bad(format!("{:?} has an invalid LFS oid", self.path)))?;
                FileDigest::Sha256(d)
            }
            None => {
                let oid = self.oid.as_deref().unwrap_or("");
                let mut d = [0u8; 20];
                hex::decode_to_slice(oid, &mut d)
                    .map_err(|_| bad(format!("{:?} has an invalid oid", self.path)))?;
                FileDigest::GitSha1(d)
            }
        };
        Ok(ManifestEntry {
            path: self.path,
            size,
            digest,
        })
    }
}

impl HfSource {
    pub fn new(
        repo: String,
        revision: String,
        token: Option<Token>,
        client: Arc<HubClient>,
    ) -> Self {
        let token = token.or_else(|| client.config().default_token.clone());
        Self {
            repo,
            revision,
            token,
            client,
            throttle: Default::default(),
        }
    }

    /// Reports every wait this source spends on HTTP 429 to `observer`.
    pub fn with_throttle_observer(self, observer: crate::source::ThrottleObserver) -> Self {
        Self {
            throttle: observer,
            ..self
        }
    }

    pub(crate) fn throttle(&self) -> &crate::source::ThrottleObserver {
        &self.throttle
    }

    fn label(&self) -> String {
        format!("hf://{}@{}", self.repo, self.revision)
    }

    /// Resolves the revision to a commit and lists its files, with this model's own token.
    pub async fn resolve(&self, cancel: Arc<AtomicBool>) -> Result<Manifest, SourceError> {
        let commit = if is_commit_hash(&self.revision) {
            self.revision.clone()
        } else {
            let what = format!("resolving {}", self.label());
            let url = format!(
                "{}/api/models/{}/revision/{}",
                self.client.endpoint(),
                self.repo,
                encode_segment(&self.revision)
            );
            let info: RevisionInfo = self
                .client
                .get_json(&what, &url, self.token.as_ref(), &cancel, &self.throttle)
                .await?
                .0;
            match info.sha {
                Some(sha) if is_commit_hash(&sha) => sha,
                other => {
                    return Err(TransferError::Protocol {
                        what,
                        detail: format!("revision answer has no valid commit sha ({other:?})"),
                    }
                    .into())
                }
            }
        };
        let what = format!("listing hf://{}@{}", self.repo, commit);
        let mut url = format!(
            "{}/api/models/{}/tree/{}?recursive=true",
            self.client.endpoint(),
            self.repo,
            commit
        );
        let tuning = &self.client.config().tuning;
        let mut entries = Vec::new();
        let mut listed = 0usize;
        let mut pages = 0usize;
        let mut seen_pages = std::collections::HashSet::new();
        loop {
            if !seen_pages.insert(url.clone()) {
                return Err(TransferError::Protocol {
                    what,
                    detail: "tree pagination loops".into(),
                }
                .into());
            }
            if pages >= tuning.max_listing_pages {
                return Err(TransferError::Limit {
                    what,
                    detail: format!(
                        "the listing did not end after {pages} pages ({listed} entries): the hub's pagination may never end; if the repository really is that large, raise --hf-max-listing-pages"
                    ),
                }
                .into());
            }
            pages += 1;
            let (page, next): (Vec<TreeEntry>, _) = self
                .client
                .get_json(&what, &url, self.token.as_ref(), &cancel, &self.throttle)
                .await?;
            listed += page.len();
            if listed > tuning.max_listing_entries {
                return Err(TransferError::Limit {
                    what,
                    detail: format!(
                        "the listing has more than {} entries (after {pages} pages); if the repository really is that large, raise --hf-max-listing-entries",
                        tuning.max_listing_entries
                    ),
                }
                .into());
            }
            for e in page {
                if e.kind == "file" {
                    entries.push(e.into_manifest_entry(&what)?);
                }
            }
            if entries.len() > MAX_ENTRIES {
                return Err(modelfs_core::artifact::ArtifactError::TooManyEntries {
                    count: entries.len(),
                }
                .into());
            }
            match next {
                Some(n) => url = n,
                None => break,
            }
        }
        Ok(Manifest::new(commit, entries)?)
    }

    pub async fn fetch(
        &self,
        manifest: Arc<Manifest>,
        ctx: FetchContext,
    ) -> Result<Vec<Sha256Digest>, SourceError> {
        download::fetch(self, manifest, ctx).await
    }

    pub(crate) fn client(&self) -> &HubClient {
        &self.client
    }

    pub(crate) fn token(&self) -> Option<&Token> {
        self.token.as_ref()
    }

    /// URL of one file of a commit.
    pub(crate) fn file_url(&self, commit: &str, path: &str) -> String {
        format!(
            "{}/{}/resolve/{}/{}",
            self.client.endpoint(),
            self.repo,
            commit,
            encode_path(path)
        )
    }
}

#[cfg(test)]
mod proptests;

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(json: &str) -> Result<ManifestEntry, TransferError> {
        serde_json::from_str::<TreeEntry>(json)
            .unwrap()
            .into_manifest_entry("t")
    }

    #[test]
    fn tree_entries_map_to_digests() {
        let e = entry(&format!(
            r#"{{"type":"file","path":"a/b.json","size":3,"oid":"{}"}}"#,
            "ab".repeat(20)
        ))
        .unwrap();
        assert_eq!(e.digest, FileDigest::GitSha1([0xab; 20]));
        let e = entry(&format!(
            r#"{{"type":"file","path":"w.safetensors","size":9,"oid":"{}","lfs":{{"oid":"{}","size":9}}}}"#,
            "ab".repeat(20),
            "cd".repeat(32)
        ))
        .unwrap();
        assert_eq!(e.digest, FileDigest::Sha256([0xcd; 32]));
    }

    #[test]
    fn lying_sizes_are_rejected() {
        for json in [
            format!(
                r#"{{"type":"file","path":"x","size":-1,"oid":"{}"}}"#,
                "ab".repeat(20)
            ),
            format!(
                r#"{{"type":"file","path":"x","size":1.5,"oid":"{}"}}"#,
                "ab".repeat(20)
            ),
            format!(
                r#"{{"type":"file","path":"x","oid":"{}"}}"#,
                "ab".repeat(20)
            ),
            format!(
                r#"{{"type":"file","path":"x","size":5,"lfs":{{"oid":"{}","size":6}}}}"#,
                "cd".repeat(32)
            ),
            r#"{"type":"file","path":"x","size":5,"oid":"zz"}"#.to_string(),
        ] {
            assert!(
                matches!(entry(&json), Err(TransferError::Protocol { .. })),
                "{json}"
            );
        }
    }

    #[test]
    fn paths_are_escaped_per_segment() {
        assert_eq!(encode_segment("refs/pr/1"), "refs%2Fpr%2F1");
        assert_eq!(
            encode_path("dir/\u{fc} b#?.json"),
            "dir/%C3%BC%20b%23%3F.json"
        );
    }
}
