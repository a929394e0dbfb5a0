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
//! See [`download`]: files are fetched several at a time, large files as parallel ranges that
//! are written in order, each blob hashed while written (sha256 for LFS files, git blob sha1 for
//! the rest) and renamed into the store only once verified. Partial files survive a crash and
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
use std::time::Duration;

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde::Deserialize;

use super::{FetchContext, SourceError, Token};
use crate::artifact::{FileDigest, Manifest, ManifestEntry, Sha256Digest, MAX_ENTRIES};
use crate::manifest::source::is_commit_hash;
use crate::store::StoreError;

pub use client::HubClient;

/// The public hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Download tuning. The defaults were measured against a local hub on a 2-core machine (see
/// `BENCHMARKS.md`, "Hugging Face download") and are meant to be right for a real node too:
/// they keep enough bytes in flight to fill a fast link without holding much memory.
#[derive(Clone, Debug)]
pub struct DownloadTuning {
    /// Files of one model downloaded at once. Small files are latency-bound (one request
    /// each), so several in flight hide the round trips of a remote hub; on loopback 1, 8 and
    /// 16 measured within noise. 8 stays polite to a remote hub.
    pub max_files: usize,
    /// Parallel range requests per large file. On loopback one stream already reaches the
    /// hub's and disk's limit (1, 4 and 8 streams measured within noise of each other); 4 is
    /// kept for real links, where one TCP stream from a CDN is often limited to a few hundred
    /// MB/s, at the cost of at most 4 chunks in memory per large file.
    pub range_streams: usize,
    /// Size of one range request, and the unit of in-memory reordering (at most
    /// `range_streams` chunks per file wait in memory: 4 x 8 MiB = 32 MiB). Measured on
    /// loopback: 4, 8 and 16 MiB within noise of each other, 64 MiB twice as slow (large
    /// buffers and head-of-line waits). Against a remote hub every chunk costs a round trip
    /// per stream, which argues against going small; 8 MiB is the compromise.
    pub chunk_size: u64,
    /// Node-wide limit on HTTP transfers in flight (all models together), so a node with many
    /// models does not open hundreds of connections to the hub.
    pub max_transfers: usize,
    /// Stall watchdog of every request: no response headers, or no body byte, for this long
    /// aborts the request and retries it.
    pub stall_timeout: Duration,
    /// Deadline of one metadata request (revision, one listing page) from sending to the last
    /// body byte, so that a hub trickling bytes cannot hold a resolve either.
    pub request_timeout: Duration,
    /// Bounds of one file listing: pages followed and entries (files and directories) listed.
    /// The real hub sends 1,000 entries a page, so the defaults admit repositories of
    /// hundreds of thousands of files while a listing whose `rel="next"` never ends fails
    /// with a reason after a few minutes at most.
    pub max_listing_pages: usize,
    pub max_listing_entries: usize,
    /// Attempts per request before the fetch fails (transiently: the reconciler retries later).
    pub max_attempts: u32,
    /// First backoff after a transient error; doubles per attempt, with jitter, up to
    /// `retry_max`. A `Retry-After` from the hub (429, 503) replaces it, capped at `retry_max`.
    pub retry_base: Duration,
    pub retry_max: Duration,
    /// Times a file is downloaded again after its bytes failed verification before the model
    /// is `Failed`: once can be a glitch, three times is a hub serving wrong data.
    pub verify_attempts: u32,
    /// How often a progress line is logged during a fetch.
    pub progress_log_interval: Duration,
    /// TCP connect timeout.
    pub connect_timeout: Duration,
}

impl Default for DownloadTuning {
    fn default() -> Self {
        Self {
            max_files: 8,
            range_streams: 4,
            chunk_size: 8 << 20,
            max_transfers: 32,
            stall_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(120),
            max_listing_pages: 2_000,
            max_listing_entries: 500_000,
            max_attempts: 8,
            retry_base: Duration::from_millis(500),
            retry_max: Duration::from_secs(60),
            verify_attempts: 3,
            progress_log_interval: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(15),
        }
    }
}

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

#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("{what}: the hub answered HTTP {status}{}: {message}", code.as_deref().map(|c| format!(" ({c})")).unwrap_or_default())]
    Status {
        what: String,
        status: u16,
        /// `X-Error-Code`: `GatedRepo`, `RepoNotFound`, `RevisionNotFound`, `EntryNotFound`...
        code: Option<String>,
        message: String,
        retry_after: Option<Duration>,
    },
    #[error("{what}: {detail}")]
    Network { what: String, detail: String },
    #[error("{what}: the body ended after {got} of {want} bytes")]
    Truncated { what: String, got: u64, want: u64 },
    #[error("{what}: no data received for {secs}s")]
    Stalled { what: String, secs: u64 },
    #[error("{what}: no complete answer within {secs}s")]
    TimedOut { what: String, secs: u64 },
    /// A bound of the client was exceeded (listing pages or entries); the detail names the flag.
    #[error("{what}: {detail}")]
    Limit { what: String, detail: String },
    #[error("{what}: invalid answer from the hub: {detail}")]
    Protocol { what: String, detail: String },
    #[error("{path}: downloaded bytes failed verification {attempts} times ({detail})")]
    Corrupt {
        path: String,
        attempts: u32,
        detail: String,
    },
    #[error("{last} (gave up after {attempts} attempts)")]
    Exhausted { attempts: u32, last: Box<HfError> },
    #[error("storing {path}: {source}")]
    Store {
        path: String,
        #[source]
        source: StoreError,
    },
    #[error("cancelled")]
    Cancelled,
}

impl HfError {
    /// Worth another attempt within the same fetch.
    pub fn is_retryable(&self) -> bool {
        match self {
            HfError::Status { status, .. } => *status == 408 || *status == 429 || *status >= 500,
            HfError::Network { .. }
            | HfError::Truncated { .. }
            | HfError::Stalled { .. }
            | HfError::TimedOut { .. } => true,
            HfError::Protocol { .. }
            | HfError::Limit { .. }
            | HfError::Corrupt { .. }
            | HfError::Exhausted { .. }
            | HfError::Store { .. }
            | HfError::Cancelled => false,
        }
    }

    /// Worth retrying the whole model later (the reconciler's backoff).
    pub fn is_transient(&self) -> bool {
        match self {
            // A body shorter than its own Content-Length on every attempt is a hub that lies
            // about its answer, not a glitch: retrying the model later will not help.
            HfError::Exhausted { last, .. } => !matches!(**last, HfError::Truncated { .. }),
            HfError::Cancelled => true,
            HfError::Store { source, .. } => {
                matches!(source, StoreError::DiskFull { .. } | StoreError::Io { .. })
            }
            other => other.is_retryable(),
        }
    }

    /// The server asked this client to slow down (HTTP 429).
    pub fn is_rate_limited(&self) -> bool {
        matches!(self, HfError::Status { status: 429, .. })
    }

    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            HfError::Status { retry_after, .. } => *retry_after,
            _ => None,
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

fn parse_size(what: &str, path: &str, n: &serde_json::Number) -> Result<u64, HfError> {
    n.as_u64().ok_or_else(|| HfError::Protocol {
        what: what.into(),
        detail: format!("{path:?} has an invalid size {n}"),
    })
}

impl TreeEntry {
    fn into_manifest_entry(self, what: &str) -> Result<ManifestEntry, HfError> {
        let bad = |detail: String| HfError::Protocol {
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
                    return Err(HfError::Protocol {
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
                return Err(HfError::Protocol {
                    what,
                    detail: "tree pagination loops".into(),
                }
                .into());
            }
            if pages >= tuning.max_listing_pages {
                return Err(HfError::Limit {
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
                return Err(HfError::Limit {
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
                return Err(crate::artifact::ArtifactError::TooManyEntries {
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

impl From<HfError> for SourceError {
    fn from(e: HfError) -> Self {
        match e {
            HfError::Cancelled => SourceError::Cancelled,
            other => SourceError::Hf(other),
        }
    }
}

#[cfg(test)]
mod proptests;

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(json: &str) -> Result<ManifestEntry, HfError> {
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
                matches!(entry(&json), Err(HfError::Protocol { .. })),
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

    #[test]
    fn classification() {
        let status = |status| HfError::Status {
            what: "w".into(),
            status,
            code: Some("GatedRepo".into()),
            message: "m".into(),
            retry_after: None,
        };
        assert!(!status(401).is_retryable() && !status(401).is_transient());
        assert!(!status(404).is_transient());
        assert!(status(429).is_retryable() && status(503).is_retryable());
        assert!(status(401).to_string().contains("HTTP 401 (GatedRepo)"));
        let corrupt = HfError::Corrupt {
            path: "p".into(),
            attempts: 3,
            detail: "d".into(),
        };
        assert!(!corrupt.is_transient());
        let exhausted = |last| HfError::Exhausted {
            attempts: 8,
            last: Box::new(last),
        };
        let stalled = HfError::Stalled {
            what: "w".into(),
            secs: 30,
        };
        assert!(stalled.is_retryable() && exhausted(stalled).is_transient());
        let lying = HfError::Truncated {
            what: "w".into(),
            got: 10,
            want: 20,
        };
        assert!(lying.is_retryable(), "one short body can be a glitch");
        assert!(
            !exhausted(lying).is_transient(),
            "short on every attempt is a lie that will not stop"
        );
        let limit = HfError::Limit {
            what: "w".into(),
            detail: "d".into(),
        };
        assert!(!limit.is_retryable() && !limit.is_transient());
    }
}
