//! The fetch pipeline shared by every remote source (`hf://`, `s3://`, `gs://`, `az://`, ...).
//!
//! A remote source is a small adapter, [`RangeSource`]: it lists its files (the source module
//! turns the listing into a [`Manifest`], with [`manifest_from_listing`] for object stores) and
//! opens one byte range of one file. Everything else is here, once:
//!
//! * **Skip what is there.** An entry whose sha256 blob is already in the model's store (or can
//!   be hard-linked from its previous store), or whose source digest has an alias to a present
//!   blob (git sha1, object identities), is not downloaded again. Entries with the same digest
//!   are downloaded once.
//! * **Several files at once** (`max_files`), largest first, so the big shards start early and
//!   small files fill the gaps.
//! * **Large files as parallel ranges** (`range_streams` requests of `chunk_size` each). The
//!   ranges are requested concurrently but handed to the writer *in order* (`buffered`), so the
//!   partial file is always a contiguous prefix: it is hashed while written, and a crash leaves a
//!   prefix that [`Store::resume_writer`](modelfs_core::store::Store::resume_writer) re-hashes and
//!   continues with a range from its end. At most `range_streams` chunks per file wait in memory,
//!   and all downloads of the node together hold at most `buffer_bytes` of range data
//!   ([`Transfers::buffer`]): a range takes its share of that budget before its request goes
//!   out and gives it back once the writer has written it.
//! * **Pinned and checked end to end.** Every range of a file is asked for the version that
//!   was listed (the adapter's business: `If-Match`, a generation); an object that changed
//!   answers with [`TransferError::Changed`] and the download stops. Before a file is
//!   downloaded the adapter names what its store publishes about the bytes besides the
//!   manifest's digest ([`RangeSource::content_check`]: a CRC32C, an MD5 the store reports on
//!   the object, ...); the writer checks that too. A file with neither is checked by its size
//!   only, counted in [`Progress::size_only_files`] and logged.
//! * **Verified before published.** The writer (a blocking thread per file) streams into
//!   `tmp/<digest>.part` the network's buffers as they were received (a range is a list of
//!   them, never copied into one allocation), in writes of at most
//!   [`WRITE_PIECE`](modelfs_core::store::blob::WRITE_PIECE) bytes; `commit` checks size and
//!   the source's digest and renames into `blobs/` (named by sha256) only on a match. A
//!   mismatch deletes the partial file and the file is downloaded again, up to
//!   `verify_attempts` times; then the model is `Failed`.
//! * **Every transfer is watched**: no body byte for `stall_timeout` aborts and retries it (the
//!   adapter bounds the wait for response headers with [`Transfers::within_stall`]); a range
//!   that arrives slower than `min_range_bytes_per_sec` (after a grace of `stall_timeout`) is
//!   aborted and asked again from its first missing byte ([`TransferError::TooSlow`]); a body
//!   shorter than its range is retried; each request holds a slot of the node-wide transfer
//!   limit ([`Transfers`], one per daemon, shared by all sources) while it runs.
//! * **One retry policy** ([`Transfers::retrying`]): 5xx, 408, 429, resets, truncated bodies and
//!   stalls are retried with jittered exponential backoff (a range whose answer broke off is
//!   asked again from its first missing byte, not from its start) (`retry_base` doubling up to
//!   `retry_max`, each delay drawn from 50-100% of the step so clients do not retry in
//!   lockstep); a `Retry-After` (seconds or HTTP-date, [`parse_retry_after`]) replaces the step,
//!   capped at `retry_max`. 401/403/404 and malformed answers fail at once. After
//!   `max_attempts` the error is [`TransferError::Exhausted`].
//! * **A server that ignores `Range`** answers with the whole file. The first range of a file is
//!   therefore requested alone; only after a partial answer do the other ranges go out in
//!   parallel. After a whole-file answer the rest of the file is read from that one answer (and
//!   on a failure, from one new whole-file answer), so such a server costs one download of the
//!   file per attempt, never one per range (which is quadratic in the file size).
//! * **Served while downloading** ([`crate::progressive`]): when the context carries a live
//!   fetch, files go in the order loaders read them instead of largest first, weight files
//!   one at a time (the next starting once the previous one asked for its last range, so the
//!   link never idles between them), a file an open waits on is taken next, and each file is
//!   reported as it verifies or fails verification.
//! * **Progress** counts bytes as they arrive and takes back the bytes of a failed attempt, so
//!   it never counts twice; a log line every `progress_log_interval`.

use std::cmp::Reverse;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream::BoxStream;
use futures_util::{stream, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::metrics::SourceScheme;
use crate::source::{FetchContext, Progress, SourceError, ThrottleObserver};
use modelfs_core::artifact::{FileDigest, Manifest, ManifestEntry, Sha256Digest};
use modelfs_core::store::blob::ContentCheck;
use modelfs_core::store::StoreError;

/// Download tuning, shared by all remote sources. The defaults were measured against a local
/// hub on a 2-core machine (see `BENCHMARKS.md`, "Hugging Face download") and are meant to be
/// right for a real node too: they keep enough bytes in flight to fill a fast link without
/// holding much memory.
#[derive(Clone, Debug)]
pub struct DownloadTuning {
    /// Files of one model downloaded at once. Small files are latency-bound (one request
    /// each), so several in flight hide the round trips of a remote server; on loopback 1, 8
    /// and 16 measured within noise. 8 stays polite to a remote server.
    pub max_files: usize,
    /// Parallel range requests per large file. On loopback one stream already reaches the
    /// server's and disk's limit (1, 4 and 8 streams measured within noise of each other); 4 is
    /// kept for real links, where one TCP stream from a CDN is often limited to a few hundred
    /// MB/s, at the cost of at most 4 chunks in memory per large file.
    pub range_streams: usize,
    /// Size of one range request, and the unit of in-memory reordering (at most
    /// `range_streams` chunks per file wait in memory: 4 x 8 MiB = 32 MiB). Measured on
    /// loopback: 4, 8 and 16 MiB within noise of each other, 64 MiB twice as slow (large
    /// buffers and head-of-line waits). Against a remote server every chunk costs a round trip
    /// per stream, which argues against going small; 8 MiB is the compromise.
    pub chunk_size: u64,
    /// Node-wide limit on HTTP transfers in flight (all models and sources together), so a
    /// node with many models does not open hundreds of connections.
    pub max_transfers: usize,
    /// Node-wide budget of range data held in memory (received, not yet written), all
    /// downloads together. Without it the worst case was `max_files` x `range_streams` x
    /// `chunk_size` per model (256 MiB) times the fetches running at once, against an agent
    /// that requests 128 MiB. 64 MiB keeps eight 8 MiB ranges in flight, enough to fill a
    /// fast link.
    pub buffer_bytes: u64,
    /// Slowest accepted transfer of a data range, bytes per second, measured over the whole
    /// range after a grace of `stall_timeout`: a server that trickles a byte now and then
    /// (never long enough to trip the stall watchdog) cannot hold a download forever. 0 turns
    /// it off.
    pub min_range_bytes_per_sec: u64,
    /// Stall watchdog of every request: no response headers, or no body byte, for this long
    /// aborts the request and retries it.
    pub stall_timeout: Duration,
    /// Deadline of one metadata request (revision, one listing page) from sending to the last
    /// body byte, so that a server trickling bytes cannot hold a resolve either.
    pub request_timeout: Duration,
    /// Bounds of one file listing: pages followed and entries (files and directories) listed.
    /// The real hub sends 1,000 entries a page, so the defaults admit repositories of
    /// hundreds of thousands of files while a listing whose next page never ends fails
    /// with a reason after a few minutes at most.
    pub max_listing_pages: usize,
    pub max_listing_entries: usize,
    /// Attempts per request before the fetch fails (transiently: the reconciler retries later).
    pub max_attempts: u32,
    /// First backoff after a transient error; doubles per attempt, with jitter, up to
    /// `retry_max`. A `Retry-After` from the server (429, 503) replaces it, capped at
    /// `retry_max`.
    pub retry_base: Duration,
    pub retry_max: Duration,
    /// Times a file is downloaded again after its bytes failed verification before the model
    /// is `Failed`: once can be a glitch, three times is a server serving wrong data.
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
            buffer_bytes: 64 << 20,
            min_range_bytes_per_sec: 64 << 10,
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

/// Why a transfer from a remote source failed. Adapters map their protocol's errors to these
/// variants; the retry policy and the reconciler only look at the variant.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("{what}: the server answered HTTP {status}{}: {message}", code.as_deref().map(|c| format!(" ({c})")).unwrap_or_default())]
    Status {
        what: String,
        status: u16,
        /// The server's error code: `X-Error-Code` of the hub (`GatedRepo`, `RepoNotFound`,
        /// ...), the `<Code>` of an object store (`SlowDown`, `AccessDenied`, ...).
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
    #[error("{what}: {got} bytes in {secs}s, slower than the minimum of {min} bytes/s")]
    TooSlow {
        what: String,
        got: u64,
        secs: u64,
        min: u64,
    },
    /// A bound of the client was exceeded (listing pages or entries); the detail names the flag.
    #[error("{what}: {detail}")]
    Limit { what: String, detail: String },
    #[error("{what}: invalid answer from the server: {detail}")]
    Protocol { what: String, detail: String },
    /// A setting of the model cannot work (a malformed parameter, a missing credential); the
    /// detail says which and never holds a secret.
    #[error("{what}: {detail}")]
    Config { what: String, detail: String },
    /// The object is no longer the version that was listed (its ETag or generation moved, a
    /// precondition failed): no byte of the new version may join the bytes of the old one, so
    /// the download stops at once and the model is listed again (transient).
    #[error("{what}: the object changed since it was listed; it is listed again")]
    Changed { what: String },
    #[error("{path}: downloaded bytes failed verification {attempts} times ({detail})")]
    Corrupt {
        path: String,
        attempts: u32,
        detail: String,
    },
    #[error("{last} (gave up after {attempts} attempts)")]
    Exhausted {
        attempts: u32,
        last: Box<TransferError>,
    },
    #[error("storing {path}: {source}")]
    Store {
        path: String,
        #[source]
        source: StoreError,
    },
    #[error("cancelled")]
    Cancelled,
}

impl TransferError {
    /// Worth another attempt within the same fetch.
    pub fn is_retryable(&self) -> bool {
        match self {
            TransferError::Status { status, .. } => {
                *status == 408 || *status == 429 || *status >= 500
            }
            TransferError::Network { .. }
            | TransferError::Truncated { .. }
            | TransferError::Stalled { .. }
            | TransferError::TimedOut { .. }
            | TransferError::TooSlow { .. } => true,
            TransferError::Protocol { .. }
            | TransferError::Limit { .. }
            | TransferError::Config { .. }
            | TransferError::Corrupt { .. }
            | TransferError::Changed { .. }
            | TransferError::Exhausted { .. }
            | TransferError::Store { .. }
            | TransferError::Cancelled => false,
        }
    }

    /// Worth retrying the whole model later (the reconciler's backoff).
    pub fn is_transient(&self) -> bool {
        match self {
            // A body shorter than its own Content-Length on every attempt is a server that lies
            // about its answer, not a glitch: retrying the model later will not help.
            TransferError::Exhausted { last, .. } => {
                !matches!(**last, TransferError::Truncated { .. })
            }
            TransferError::Cancelled | TransferError::Changed { .. } => true,
            TransferError::Store { source, .. } => {
                matches!(source, StoreError::DiskFull { .. } | StoreError::Io { .. })
            }
            other => other.is_retryable(),
        }
    }

    /// The server asked this client to slow down (HTTP 429).
    pub fn is_rate_limited(&self) -> bool {
        matches!(self, TransferError::Status { status: 429, .. })
    }

    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            TransferError::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

impl From<TransferError> for SourceError {
    fn from(e: TransferError) -> Self {
        match e {
            TransferError::Cancelled => SourceError::Cancelled,
            other => SourceError::Transfer(other),
        }
    }
}

/// Longest `Retry-After` taken as given; a longer one is capped (the backoff caps it further).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

/// `Retry-After` in either form of RFC 9110: delay-seconds, or an HTTP-date (the delay is the
/// time until then; a date in the past means at once). Capped so no caller can overflow an
/// `Instant`; anything else is `None` (the normal backoff applies).
pub fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds).min(MAX_RETRY_AFTER));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    let delay = at
        .duration_since(std::time::SystemTime::now())
        .unwrap_or(Duration::ZERO);
    Some(delay.min(MAX_RETRY_AFTER))
}

/// Waits `d`, or less if `cancel` is raised.
pub async fn sleep_unless_cancelled(d: Duration, cancel: &AtomicBool) -> Result<(), TransferError> {
    let end = tokio::time::Instant::now() + d;
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(TransferError::Cancelled);
        }
        let now = tokio::time::Instant::now();
        if now >= end {
            return Ok(());
        }
        tokio::time::sleep((end - now).min(Duration::from_millis(200))).await;
    }
}

/// The node-wide side of all transfers: the tuning, the transfer limit and the retry policy.
/// One per daemon, shared by every source, so the limit holds across schemes.
#[derive(Debug)]
pub struct Transfers {
    tuning: DownloadTuning,
    slots: Arc<Semaphore>,
    /// The range data budget, in units of [`BUFFER_UNIT`] bytes.
    buffer: Arc<Semaphore>,
    buffer_units: u32,
}

/// The unit of the range data budget.
const BUFFER_UNIT: u64 = 64 << 10;

impl Transfers {
    pub fn new(tuning: DownloadTuning) -> Arc<Self> {
        let slots = Arc::new(Semaphore::new(tuning.max_transfers.max(1)));
        let buffer_units =
            (tuning.buffer_bytes / BUFFER_UNIT).clamp(1, u32::MAX as u64 >> 4) as u32;
        Arc::new(Self {
            tuning,
            slots,
            buffer: Arc::new(Semaphore::new(buffer_units as usize)),
            buffer_units,
        })
    }

    /// A share of the node-wide range data budget for `bytes` (rounded up to the unit; a
    /// range larger than the whole budget takes all of it, so it waits for everything else
    /// but never forever). Waiters are served in order, so the ranges of one file get their
    /// share in the order the writer needs them.
    pub async fn buffer(&self, bytes: u64) -> OwnedSemaphorePermit {
        let units = bytes
            .div_ceil(BUFFER_UNIT)
            .clamp(1, self.buffer_units as u64) as u32;
        self.buffer
            .clone()
            .acquire_many_owned(units)
            .await
            .expect("the buffer semaphore is never closed")
    }

    /// Bytes of the range data budget held right now.
    pub fn buffer_in_use(&self) -> u64 {
        (self.buffer_units as u64 - self.buffer.available_permits() as u64) * BUFFER_UNIT
    }

    pub fn tuning(&self) -> &DownloadTuning {
        &self.tuning
    }

    /// A slot of the node-wide transfer limit.
    pub async fn slot(&self) -> OwnedSemaphorePermit {
        self.slots
            .clone()
            .acquire_owned()
            .await
            .expect("the transfer semaphore is never closed")
    }

    /// Delay before attempt `attempt + 1` (1-based `attempt`).
    pub fn backoff(&self, attempt: u32, err: &TransferError) -> Duration {
        let t = &self.tuning;
        if let Some(after) = err.retry_after() {
            return after.min(t.retry_max);
        }
        crate::retry::Backoff::new(t.retry_base, t.retry_max).random(attempt)
    }

    fn stalled(&self, what: &str) -> TransferError {
        TransferError::Stalled {
            what: what.into(),
            secs: self.tuning.stall_timeout.as_secs(),
        }
    }

    /// `fut` (sending a request and waiting for its response headers), at most
    /// `stall_timeout`.
    pub async fn within_stall<T>(
        &self,
        what: &str,
        fut: impl Future<Output = Result<T, TransferError>>,
    ) -> Result<T, TransferError> {
        tokio::time::timeout(self.tuning.stall_timeout, fut)
            .await
            .map_err(|_| self.stalled(what))?
    }

    /// The next piece of a body, at most `stall_timeout` after the previous one. `Ok(None)` at
    /// the end of the body.
    pub async fn next_chunk(
        &self,
        what: &str,
        body: &mut BodyStream,
    ) -> Result<Option<Bytes>, TransferError> {
        tokio::time::timeout(self.tuning.stall_timeout, body.next())
            .await
            .map_err(|_| self.stalled(what))?
            .transpose()
    }

    /// Runs `op` until it succeeds, fails for good, or runs out of attempts.
    pub async fn retrying<T, F, Fut>(
        &self,
        what: &str,
        cancel: &AtomicBool,
        throttle: &ThrottleObserver,
        mut op: F,
    ) -> Result<T, TransferError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, TransferError>>,
    {
        let max = self.tuning.max_attempts.max(1);
        let mut attempt = 0;
        loop {
            if cancel.load(Ordering::Relaxed) {
                return Err(TransferError::Cancelled);
            }
            attempt += 1;
            match op().await {
                Ok(v) => return Ok(v),
                Err(e) if e.is_retryable() && attempt < max => {
                    let delay = self.backoff(attempt, &e);
                    tracing::warn!(%what, attempt, error = %e, delay_ms = delay.as_millis() as u64, "retrying");
                    let started = Instant::now();
                    let slept = sleep_unless_cancelled(delay, cancel).await;
                    if e.is_rate_limited() {
                        throttle.observe(started.elapsed());
                    }
                    slept?;
                }
                Err(e) if e.is_retryable() => {
                    return Err(TransferError::Exhausted {
                        attempts: attempt,
                        last: Box::new(e),
                    })
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// The bytes of one answer, in order.
pub type BodyStream = BoxStream<'static, Result<Bytes, TransferError>>;

/// What the server sent for a range request.
pub enum RangeBody {
    /// The bytes from the requested offset on (at least up to the requested end).
    Part(BodyStream),
    /// The server ignored the range and sends the whole file from byte 0.
    WholeFile(BodyStream),
}

/// A remote source, reduced to what the pipeline needs. Listing is the source's own business
/// (it yields the [`Manifest`] the pipeline fetches); the pipeline only opens byte ranges.
pub trait RangeSource: Send + Sync {
    /// Names the source in log lines (`hf://org/repo@<commit>`, `s3://bucket/prefix`).
    fn label(&self) -> String;

    /// The metrics label of the source's bytes.
    fn scheme(&self) -> SourceScheme;

    /// One attempt (the pipeline retries) at bytes `[at, end)` of `entry`, `end` `None` for
    /// "to the end of the file". It sends the request and waits for the response headers
    /// (bounded with [`Transfers::within_stall`]); a non-success answer is a
    /// [`TransferError::Status`] with the server's reason and `Retry-After`. The body is read by
    /// the pipeline. `what` describes the request for errors.
    fn open_range(
        &self,
        what: &str,
        entry: &ManifestEntry,
        at: u64,
        end: Option<u64>,
    ) -> impl Future<Output = Result<RangeBody, TransferError>> + Send;

    /// Told each wait the pipeline spends backing off after the server throttled this source.
    fn throttle(&self) -> &ThrottleObserver {
        ThrottleObserver::none()
    }

    /// What the store publishes about the bytes of `entry` besides the manifest's digest,
    /// asked once per download attempt (one attempt; the pipeline retries). The default:
    /// nothing.
    fn content_check(
        &self,
        what: &str,
        entry: &ManifestEntry,
    ) -> impl Future<Output = Result<Option<Published>, TransferError>> + Send {
        let _ = (what, entry);
        async { Ok(None) }
    }
}

/// A checksum a store published for one file (see [`RangeSource::content_check`]).
pub struct Published {
    /// What it is, for log lines (`crc32c`, `Content-MD5`, `S3 ETag`, ...).
    pub name: &'static str,
    pub check: Box<dyn ContentCheck>,
}

/// One object of an object store's listing.
#[derive(Clone, Debug)]
pub struct ListedObject {
    /// The object's full key (the prefix included).
    pub key: String,
    pub size: u64,
    /// The ETag or version id the store reported: the identity input, so a changed object is
    /// a new file and its artifact a new artifact.
    pub version: String,
    /// The MD5 of the object's bytes, when the store publishes one.
    pub md5: Option<[u8; 16]>,
    /// The CRC32C of the object's bytes, when the listing gives one (GCS); checked while
    /// downloading, not part of the identity.
    pub crc32c: Option<u32>,
}

/// The manifest of the objects below `prefix` (a directory: `a/b` holds `a/b/...`, not
/// `a/bc`), named by their keys relative to it. `location` (`s3://bucket`) goes into each
/// object's identity. A directory marker (an empty object whose key ends in `/`, as the S3
/// console's "create folder" leaves, `prefix/` and `prefix/sub/`) is no file. Clients that
/// normalize keys (`object_store` drops the trailing `/`) hand such a marker over as an empty
/// object at the prefix itself or at a directory of other objects: both are skipped too (an
/// empty marker of a folder that holds nothing is indistinguishable from an empty file, and
/// stays one).
/// Hostile keys are refused with a reason naming them: `..` or `.` segments, empty segments
/// (`a//b`, a leading `/`), NUL or control characters, a key that is both a file and the
/// prefix of other keys, an object at the prefix itself; [`Manifest::new`] does the path
/// checks for every source. The revision is the manifest digest.
pub fn manifest_from_listing(
    location: &str,
    prefix: &str,
    objects: Vec<ListedObject>,
) -> Result<Manifest, SourceError> {
    let dir = prefix.trim_end_matches('/');
    // Directories of the listing (relative to the prefix): an empty object at one of them is
    // a folder marker whose trailing `/` the client dropped.
    let mut dirs: std::collections::HashSet<&str> = std::collections::HashSet::new();
    for object in &objects {
        let rel = match object.key.strip_prefix(dir) {
            Some(rel) if !dir.is_empty() => rel.strip_prefix('/'),
            _ if dir.is_empty() => Some(object.key.as_str()),
            _ => None,
        };
        let Some(rel) = rel else { continue };
        let mut at = 0;
        while let Some(i) = rel[at..].find('/') {
            dirs.insert(&rel[..at + i]);
            at += i + 1;
        }
    }
    let mut entries = Vec::with_capacity(objects.len());
    for object in &objects {
        if object.size == 0 && object.key.trim_end_matches('/') == dir && !dir.is_empty() {
            continue;
        }
        let rel = if dir.is_empty() {
            object.key.as_str()
        } else if object.key == dir {
            return Err(modelfs_core::artifact::ArtifactError::BadPath {
                path: object.key.clone(),
                why: "the object is the model's prefix itself (a key that is both a file and a directory)",
            }
            .into());
        } else {
            match object
                .key
                .strip_prefix(dir)
                .and_then(|r| r.strip_prefix('/'))
            {
                Some(rel) => rel,
                None => continue,
            }
        };
        if object.size == 0 && ((rel.ends_with('/') && !rel.starts_with('/')) || dirs.contains(rel))
        {
            continue;
        }
        entries.push(ManifestEntry {
            path: rel.to_string(),
            size: object.size,
            digest: FileDigest::Object {
                identity: modelfs_core::artifact::object_identity(
                    &format!("{location}/{}", object.key),
                    object.size,
                    &object.version,
                ),
                md5: object.md5,
            },
        });
    }
    let manifest = Manifest::new(String::new(), entries)?;
    let revision = manifest.id().to_string();
    Ok(Manifest::new(
        revision,
        manifest.entries().map(|e| e.to_entry()).collect(),
    )?)
}

/// Fetches every entry of `manifest` the store lacks through `source`; returns the sha256 blob
/// of every entry, in manifest order.
pub async fn fetch<S: RangeSource>(
    source: &S,
    transfers: &Transfers,
    manifest: Arc<Manifest>,
    ctx: FetchContext,
) -> Result<Vec<Sha256Digest>, TransferError> {
    let tuning = transfers.tuning().clone();
    let entries = manifest.entries();
    let progress = ctx.progress.clone();
    progress
        .total_bytes
        .store(manifest.total_size(), Ordering::Relaxed);
    progress
        .total_files
        .store(entries.len() as u64, Ordering::Relaxed);
    progress.completed_bytes.store(0, Ordering::Relaxed);
    progress.size_only_files.store(0, Ordering::Relaxed);
    progress.completed_files.store(0, Ordering::Relaxed);

    let mut blobs: Vec<Option<Sha256Digest>> = vec![None; entries.len()];
    let live = ctx.live.clone();
    // Entries with the same digest (identical files under several names) are downloaded once:
    // two writers must never share one partial file.
    let mut todo: Vec<(usize, Vec<usize>)> = Vec::new();
    let mut by_digest: std::collections::HashMap<FileDigest, usize> = Default::default();
    for (i, e) in entries.clone().enumerate() {
        // Blobs the store has (or can hard-link from the model's previous store), then files
        // committed before a crash, known only by their alias.
        let have = match ctx.reuse_existing(e).map_err(|e| match e {
            SourceError::Store { path, source } => TransferError::Store { path, source },
            other => TransferError::Network {
                what: "reusing stored blobs".into(),
                detail: other.to_string(),
            },
        })? {
            Some(sha) => Some(sha),
            None => ctx
                .store
                .lookup_alias_checked(&e.digest, e.size)
                .map(|(sha, size_only)| {
                    if size_only {
                        progress.size_only_files.fetch_add(1, Ordering::Relaxed);
                    }
                    sha
                }),
        };
        match have {
            Some(sha) => {
                blobs[i] = Some(sha);
                progress
                    .completed_bytes
                    .fetch_add(e.size, Ordering::Relaxed);
                progress.completed_files.fetch_add(1, Ordering::Relaxed);
            }
            None => match by_digest.get(&e.digest) {
                Some(&t) => todo[t].1.push(i),
                None => {
                    by_digest.insert(e.digest, todo.len());
                    todo.push((i, Vec::new()));
                }
            },
        }
    }
    if let Some(live) = &live {
        let present: Vec<(usize, Sha256Digest)> = blobs
            .iter()
            .enumerate()
            .filter_map(|(i, b)| Some((i, (*b)?)))
            .collect();
        live.verified_many(&present);
        todo.sort_by_key(|(i, _)| {
            let path = manifest.entry(*i).path;
            (crate::progressive::loader_rank(path), path.to_string())
        });
    } else {
        todo.sort_by_key(|(i, _)| (Reverse(manifest.entry(*i).size), *i));
    }
    let label = source.label();
    tracing::info!(
        source = %label,
        files = todo.len(),
        bytes = todo.iter().map(|(i, _)| manifest.entry(*i).size).sum::<u64>(),
        already_present = entries.len() - todo.iter().map(|(_, d)| d.len() + 1).sum::<usize>(),
        "downloading"
    );

    let file_fetch = FileFetch {
        source,
        transfers,
        ctx: &ctx,
    };
    let work = async {
        let mut blobs = blobs;
        // Served while downloading, weight files go one at a time (small files still several
        // at once): a loader reads the shards one after another, so the first must complete
        // first rather than all of them together at the end, and one large file already fills
        // the link with its parallel ranges. "At a time" counts the files that still have
        // bytes to ask for: the next one starts when the previous one's last range is asked
        // for, so the link never idles between two files (no gap for the last ranges' round
        // trips, the digest check, sync and rename, or this loop), and only a file's last
        // ranges (at most `range_streams`) share it with the next file's first ones
        // (BENCHMARKS.md, "Serving while downloading").
        let one_weight_at_a_time = live.is_some();
        let is_weight = |i: usize| crate::progressive::loader_rank(manifest.entry(i).path) == 1;
        let asking = AskingWeights::default();
        let mut queue: std::collections::VecDeque<(usize, Vec<usize>)> = todo.into();
        // The next file to start now, if any: a file an open waits on first, then queue order.
        let mut next = |weights_in_flight: usize| {
            let allowed =
                |i: usize| !(one_weight_at_a_time && weights_in_flight > 0 && is_weight(i));
            if let Some(live) = &live {
                let mut at = None;
                live.next_wanted(|w| {
                    at = queue
                        .iter()
                        .position(|(i, same)| (*i == w || same.contains(&w)) && allowed(*i));
                    at.is_some()
                });
                if let Some(at) = at {
                    return queue.remove(at);
                }
            }
            let at = queue.iter().position(|(i, _)| allowed(*i))?;
            queue.remove(at)
        };
        let start = |(i, same): (usize, Vec<usize>)| {
            // Owned for the download's lifetime: one entry per download in flight.
            let entry = manifest.entry(i).to_entry();
            let file_fetch = &file_fetch;
            let live = live.clone();
            let slot = (one_weight_at_a_time && is_weight(i)).then(|| asking.take());
            async move {
                let mut indices = vec![i];
                indices.extend(&same);
                let failed = || {
                    if let Some(live) = &live {
                        live.failed(&indices);
                    }
                };
                let asked_all = || {
                    if let Some(slot) = &slot {
                        slot.release();
                    }
                };
                let result = file_fetch.download(&entry, &failed, &asked_all).await;
                // Released here at the latest (a failed download never asked for it all).
                drop(slot);
                (i, same, result)
            }
        };
        let mut downloads = futures_util::stream::FuturesUnordered::new();
        loop {
            // Started as slots free (so a file an open asks for meanwhile can still go first).
            while downloads.len() < tuning.max_files.max(1) {
                let Some(item) = next(asking.count()) else {
                    break;
                };
                downloads.push(start(item));
            }
            let done = tokio::select! {
                done = downloads.next() => done,
                // A weight file asked for its last range: the next one may start.
                _ = asking.released.notified() => continue,
            };
            let Some((i, same, result)) = done else {
                break;
            };
            let sha = result?;
            if let Some(live) = &live {
                let mut indices = vec![i];
                indices.extend(&same);
                live.verified(&indices, sha);
            }
            blobs[i] = Some(sha);
            for j in same {
                blobs[j] = Some(sha);
                let p = &ctx.progress;
                p.completed_bytes
                    .fetch_add(manifest.entry(j).size, Ordering::Relaxed);
                p.completed_files.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok::<_, TransferError>(blobs)
    };
    tokio::pin!(work);
    let mut ticker =
        tokio::time::interval(tuning.progress_log_interval.max(Duration::from_millis(100)));
    ticker.tick().await;
    let blobs = loop {
        tokio::select! {
            result = &mut work => break result?,
            _ = ticker.tick() => log_progress(&label, &progress),
        }
    };
    ctx.store.sync().map_err(|source| TransferError::Store {
        path: ctx.store.root().display().to_string(),
        source,
    })?;
    log_progress(&label, &progress);
    Ok(blobs
        .into_iter()
        .map(|b| b.expect("every entry was present or downloaded"))
        .collect())
}

fn log_progress(label: &str, p: &Progress) {
    let done = p.completed_bytes.load(Ordering::Relaxed);
    let total = p.total_bytes.load(Ordering::Relaxed);
    let speed = p.bytes_per_sec();
    let eta = total.saturating_sub(done).checked_div(speed);
    tracing::info!(
        source = %label,
        percent = format!("{:.1}", if total == 0 { 100.0 } else { done as f64 * 100.0 / total as f64 }),
        completed_bytes = done,
        total_bytes = total,
        completed_files = p.completed_files.load(Ordering::Relaxed),
        total_files = p.total_files.load(Ordering::Relaxed),
        speed_mb_per_sec = format!("{:.1}", speed as f64 / 1e6),
        eta_secs = eta,
        elapsed_secs = p.started.elapsed().as_secs(),
        "download progress"
    );
}

/// Weight files of a fetch served while it downloads that still have bytes to ask for (see
/// `fetch`): each download holds a [`AskingSlot`] until its last range is asked for.
#[derive(Default)]
struct AskingWeights {
    count: Arc<std::sync::atomic::AtomicUsize>,
    released: Arc<tokio::sync::Notify>,
}

impl AskingWeights {
    fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    fn take(&self) -> AskingSlot {
        self.count.fetch_add(1, Ordering::SeqCst);
        AskingSlot {
            count: self.count.clone(),
            released: self.released.clone(),
            held: AtomicBool::new(true),
        }
    }
}

/// One weight file's place among the asking ones, given back once (by
/// [`AskingSlot::release`] or on drop).
struct AskingSlot {
    count: Arc<std::sync::atomic::AtomicUsize>,
    released: Arc<tokio::sync::Notify>,
    held: AtomicBool,
}

impl AskingSlot {
    fn release(&self) {
        if self.held.swap(false, Ordering::SeqCst) {
            self.count.fetch_sub(1, Ordering::SeqCst);
            // A permit is stored if the fetch loop is not waiting yet: no wake-up is lost.
            self.released.notify_one();
        }
    }
}

impl Drop for AskingSlot {
    fn drop(&mut self) {
        self.release();
    }
}

/// Bytes counted into the fetch's progress by one attempt; taken back if the attempt fails or
/// is dropped, so progress never counts bytes twice.
struct Counted<'a> {
    progress: &'a Progress,
    n: u64,
}

impl Counted<'_> {
    fn add(&mut self, n: u64) {
        self.progress
            .completed_bytes
            .fetch_add(n, Ordering::Relaxed);
        self.n += n;
    }
    fn keep(mut self) -> u64 {
        std::mem::take(&mut self.n)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.progress
            .completed_bytes
            .fetch_sub(self.n, Ordering::Relaxed);
    }
}

/// `(offset, len)` ranges covering `[from, size)`.
fn ranges(from: u64, size: u64, chunk: u64) -> Vec<(u64, u64)> {
    let chunk = chunk.max(1);
    let mut out = Vec::new();
    let mut at = from;
    while at < size {
        let len = chunk.min(size - at);
        out.push((at, len));
        at += len;
    }
    out
}

fn store_err(path: &str) -> impl Fn(StoreError) -> TransferError + '_ {
    move |source| TransferError::Store {
        path: path.to_string(),
        source,
    }
}

/// A blocking worker that did not finish: cancelled at shutdown, or panicked. A panic is
/// carried on to the task that runs the model's work, which reports it as a permanent failure
/// with its message instead of a cancellation that would be retried forever.
fn joined(e: tokio::task::JoinError) -> TransferError {
    match e.try_into_panic() {
        Ok(panic) => std::panic::resume_unwind(panic),
        Err(_) => TransferError::Cancelled,
    }
}

/// What a range request brought.
enum RangeAnswer {
    /// The bytes of the range (the network's buffers, in order), and how many were counted
    /// into progress.
    Part(Parts, u64),
    /// The server ignored the range and answers with the whole file (only when the caller
    /// accepts that), with the transfer slot the answer holds.
    WholeFile(BodyStream, OwnedSemaphorePermit),
}

/// The next bytes of a file (the network's buffers, in order) and the share of the range
/// data budget they hold until the writer has written them.
struct Parts {
    bytes: Vec<Bytes>,
    _budget: Option<OwnedSemaphorePermit>,
}

/// To the writer: the next bytes of the file, or `None` to commit.
type Chunks = tokio::sync::mpsc::Sender<Option<Parts>>;

/// The bytes of one range received so far (from its start), counted into progress; taken
/// back from progress if the range fails for good. The network's buffers are kept as they
/// came (a slice of the last one if it ran past the range), not copied into one allocation of
/// the range's size: that copy, and the page faults of a fresh allocation per range, were a
/// fifth of the agent's CPU time.
struct PartialRange<'a> {
    parts: Vec<Bytes>,
    have: u64,
    counted: Counted<'a>,
    budget: Option<OwnedSemaphorePermit>,
}

/// One fetch's view of the pipeline.
struct FileFetch<'a, S> {
    source: &'a S,
    transfers: &'a Transfers,
    ctx: &'a FetchContext,
}

impl<S: RangeSource> FileFetch<'_, S> {
    /// Downloads and verifies one file; `failed_verification` is told of each attempt whose
    /// bytes did not verify, `asked_all` once every byte of the file is asked for (see
    /// [`FileFetch::produce`]; at the latest when the bytes are all received).
    async fn download(
        &self,
        entry: &ManifestEntry,
        failed_verification: &(dyn Fn() + Sync),
        asked_all: &(dyn Fn() + Sync),
    ) -> Result<Sha256Digest, TransferError> {
        let tuning = self.transfers.tuning();
        let ctx = self.ctx;
        let mut last_mismatch = String::new();
        let attempts = tuning.verify_attempts.max(1);
        for _ in 0..attempts {
            ctx.check_cancelled()
                .map_err(|_| TransferError::Cancelled)?;
            let what = format!("checksums of {}", entry.path);
            let published = self
                .transfers
                .retrying(&what, &ctx.cancel, self.source.throttle(), || {
                    self.source.content_check(&what, entry)
                })
                .await?;
            let size_only = published.is_none() && !entry.digest.checks_content();
            let store = ctx.store.clone();
            let (digest, size) = (entry.digest, entry.size);
            let check = published.map(|p| p.check);
            let writer = tokio::task::spawn_blocking(move || {
                store.resume_writer_checked(digest, size, check)
            })
            .await
            .map_err(joined)?
            .map_err(store_err(&entry.path))?;
            let resumed = writer.written();
            let mut file_counted = Counted {
                progress: &ctx.progress,
                n: 0,
            };
            file_counted.add(resumed);
            if resumed > 0 {
                tracing::info!(path = %entry.path, resumed_bytes = resumed, size, "resuming partial download");
            }

            // `None` tells the writer to commit; a closed channel without it leaves the partial
            // file in place for a later resume.
            let (tx, mut rx) = tokio::sync::mpsc::channel::<Option<Parts>>(2);
            let writer_task = tokio::task::spawn_blocking(move || {
                let mut w = writer;
                while let Some(msg) = rx.blocking_recv() {
                    match msg {
                        Some(parts) => {
                            let slices: Vec<&[u8]> = parts.bytes.iter().map(|b| &b[..]).collect();
                            w.write_parts(&slices)?;
                            // Written: its budget goes back.
                            drop(parts);
                        }
                        None => {
                            // How long the digest check, sync and rename took (the step
                            // between a file's last byte written and its blob published).
                            let at = Instant::now();
                            return w.commit().map(|sha| Some((sha, at.elapsed())));
                        }
                    }
                }
                // Stopped without a commit: what was written stays for a resume.
                w.checkpoint()?;
                Ok(None)
            });

            let began = Instant::now();
            let produced = self
                .produce(entry, resumed, &tx, &mut file_counted, asked_all)
                .await;
            let received_after = began.elapsed();
            if matches!(produced, Ok(true)) {
                // Nothing left to ask for (also when a resume found the file complete).
                asked_all();
            }
            drop(tx);
            let written = writer_task.await.map_err(joined)?;
            let published = began.elapsed();
            match (produced, written) {
                (_, Err(e @ (StoreError::Io { .. } | StoreError::DiskFull { .. }))) => {
                    return Err(store_err(&entry.path)(e))
                }
                (Err(e), _) => return Err(e),
                (Ok(_), Ok(Some((sha, commit)))) => {
                    let recorded = if size_only {
                        ctx.progress.size_only_files.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(source = %self.source.label(), path = %entry.path, "the store publishes no digest or checksum of this file: it was checked by its size only");
                        ctx.store.record_alias_size_only(&entry.digest, &sha)
                    } else {
                        ctx.store.record_alias(&entry.digest, &sha)
                    };
                    recorded.map_err(store_err(&entry.path))?;
                    // The per-file steps of a download, for finding where the time between a
                    // file's last byte and its first open goes (BENCHMARKS.md, "Serving while
                    // downloading").
                    tracing::debug!(
                        path = %entry.path,
                        size,
                        receive_ms = received_after.as_millis() as u64,
                        write_behind_ms = (published - received_after).saturating_sub(commit).as_millis() as u64,
                        commit_ms = commit.as_millis() as u64,
                        record_ms = (began.elapsed() - published).as_millis() as u64,
                        "file verified"
                    );
                    let downloaded = file_counted.keep().saturating_sub(resumed);
                    ctx.record_fetched(self.source.scheme(), downloaded);
                    ctx.progress.completed_files.fetch_add(1, Ordering::Relaxed);
                    return Ok(sha);
                }
                (Ok(_), Ok(None)) => return Err(TransferError::Cancelled),
                (Ok(_), Err(e)) => {
                    // Size or digest mismatch: the writer removed the partial file.
                    tracing::warn!(path = %entry.path, error = %e, "downloaded bytes failed verification; downloading again");
                    last_mismatch = e.to_string();
                    failed_verification();
                }
            }
        }
        Err(TransferError::Corrupt {
            path: entry.path.clone(),
            attempts,
            detail: last_mismatch,
        })
    }

    /// Sends `[resumed, size)` of `entry` to the writer, then `None` (commit). Returns `false`
    /// if the writer went away. `asked_all` is told when the request for the file's last
    /// range goes out after a first range that came back as a range (the first one is asked
    /// alone, so a file of one range tells it only once that range arrived), or when the
    /// server answers with the whole file.
    async fn produce(
        &self,
        entry: &ManifestEntry,
        resumed: u64,
        tx: &Chunks,
        file_counted: &mut Counted<'_>,
        asked_all: &(dyn Fn() + Sync),
    ) -> Result<bool, TransferError> {
        let tuning = self.transfers.tuning();
        let mut chunks = ranges(resumed, entry.size, tuning.chunk_size).into_iter();
        // The first range alone: it tells whether the server honours ranges at all.
        if let Some((at, len)) = chunks.next() {
            match self.fetch_range(entry, at, len, true).await? {
                RangeAnswer::Part(bytes, counted) => {
                    file_counted.n += counted;
                    if tx.send(Some(bytes)).await.is_err() {
                        return Ok(false);
                    }
                }
                RangeAnswer::WholeFile(body, slot) => {
                    asked_all();
                    if !self
                        .whole_file(entry, body, slot, at, tx, file_counted)
                        .await?
                    {
                        return Ok(false);
                    }
                    return Ok(tx.send(None).await.is_ok());
                }
            }
        }
        let mut parts = stream::iter(chunks)
            .map(|(at, len)| {
                // Taken by `buffered` just before it starts the request.
                if at + len >= entry.size {
                    asked_all();
                }
                self.fetch_range(entry, at, len, false)
            })
            .buffered(tuning.range_streams.max(1));
        while let Some(part) = parts.next().await {
            let (bytes, counted) = match part? {
                RangeAnswer::Part(bytes, counted) => (bytes, counted),
                RangeAnswer::WholeFile(..) => {
                    unreachable!("only the first range may take the whole file")
                }
            };
            file_counted.n += counted;
            if tx.send(Some(bytes)).await.is_err() {
                return Ok(false);
            }
        }
        Ok(tx.send(None).await.is_ok())
    }

    /// Downloads `[at, at + len)` of one file, with retries. With `accept_whole`, a whole-file
    /// answer is handed back unread instead of being read up to the range.
    async fn fetch_range(
        &self,
        entry: &ManifestEntry,
        at: u64,
        len: u64,
        accept_whole: bool,
    ) -> Result<RangeAnswer, TransferError> {
        let what = format!("downloading {} (bytes {at}-{})", entry.path, at + len - 1);
        // What earlier attempts received: an answer that broke off is continued from its first
        // missing byte, so a flaky link costs the missing bytes, not the whole chunk again.
        // Held from before the request until the writer has written the range.
        let budget = self.transfers.buffer(len).await;
        let partial = tokio::sync::Mutex::new(PartialRange {
            parts: Vec::new(),
            have: 0,
            counted: Counted {
                progress: &self.ctx.progress,
                n: 0,
            },
            budget: Some(budget),
        });
        self.transfers
            .retrying(&what, &self.ctx.cancel, self.source.throttle(), || {
                self.range_attempt(&what, entry, at, len, accept_whole, &partial)
            })
            .await
    }

    async fn range_attempt(
        &self,
        what: &str,
        entry: &ManifestEntry,
        at: u64,
        len: u64,
        accept_whole: bool,
        partial: &tokio::sync::Mutex<PartialRange<'_>>,
    ) -> Result<RangeAnswer, TransferError> {
        // Attempts run one after the other: the lock is never contended.
        let mut partial = partial.lock().await;
        let PartialRange {
            parts,
            have,
            counted,
            budget,
        } = &mut *partial;
        let slot = self.transfers.slot().await;
        let mut body = match self
            .source
            .open_range(what, entry, at + *have, Some(at + len))
            .await?
        {
            RangeBody::Part(body) => body,
            RangeBody::WholeFile(body) if accept_whole && *have == 0 => {
                return Ok(RangeAnswer::WholeFile(body, slot))
            }
            // It honoured ranges for the first range of this file: a hiccup (another server
            // behind the same name?). Retried; each attempt reads at most up to the end of the
            // range.
            RangeBody::WholeFile(_) => {
                return Err(TransferError::Network {
                    what: what.into(),
                    detail: "the server ignored Range after honouring it".into(),
                })
            }
        };
        // The throughput deadline of this attempt: the grace, then the rest of the range at
        // the slowest accepted rate.
        let tuning = self.transfers.tuning();
        let started = tokio::time::Instant::now();
        let at_start = *have;
        let deadline = (tuning.min_range_bytes_per_sec > 0).then(|| {
            let rest = (len - *have) as f64 / tuning.min_range_bytes_per_sec as f64;
            started + tuning.stall_timeout + Duration::from_secs_f64(rest)
        });
        while *have < len {
            let next = self.transfers.next_chunk(what, &mut body);
            let next = match deadline {
                Some(deadline) => match tokio::time::timeout_at(deadline, next).await {
                    Ok(next) => next,
                    Err(_) => {
                        return Err(TransferError::TooSlow {
                            what: what.into(),
                            got: *have - at_start,
                            secs: started.elapsed().as_secs(),
                            min: tuning.min_range_bytes_per_sec,
                        })
                    }
                },
                None => next.await,
            };
            let Some(mut chunk) = next? else {
                break;
            };
            if self.ctx.cancel.load(Ordering::Relaxed) {
                return Err(TransferError::Cancelled);
            }
            let take = (len - *have).min(chunk.len() as u64) as usize;
            if take == 0 {
                continue;
            }
            chunk.truncate(take);
            parts.push(chunk);
            *have += take as u64;
            counted.add(take as u64);
        }
        drop(slot);
        if *have < len {
            return Err(TransferError::Truncated {
                what: what.into(),
                got: *have,
                want: len,
            });
        }
        let n = std::mem::take(&mut counted.n);
        let parts = Parts {
            bytes: std::mem::take(parts),
            _budget: budget.take(),
        };
        Ok(RangeAnswer::Part(parts, n))
    }

    /// The rest of one file from a server that ignores ranges: whole-file answers, read from
    /// the start, the bytes before the current offset skipped. Sends `[from, size)` to the
    /// writer, starting with the answer `first`; a failed answer is replaced by a new request
    /// (with retries and backoff) that continues where it broke off. Returns `false` if the
    /// writer went away.
    async fn whole_file(
        &self,
        entry: &ManifestEntry,
        first: BodyStream,
        first_slot: OwnedSemaphorePermit,
        mut from: u64,
        tx: &Chunks,
        file_counted: &mut Counted<'_>,
    ) -> Result<bool, TransferError> {
        let max = self.transfers.tuning().max_attempts.max(1);
        tracing::info!(path = %entry.path, "the server ignores Range; reading the whole file from one answer");
        let mut answer = Some((RangeBody::WholeFile(first), first_slot));
        let mut attempt = 0;
        loop {
            attempt += 1;
            let what = format!(
                "downloading {} (bytes {from}- of a whole-file answer)",
                entry.path
            );
            let result = async {
                let (body, slot) = match answer.take() {
                    Some(a) => a,
                    None => {
                        let slot = self.transfers.slot().await;
                        // Asked from the offset, in case it honours ranges this time.
                        let body = self.source.open_range(&what, entry, from, None).await?;
                        (body, slot)
                    }
                };
                self.read_rest(entry, body, slot, &what, &mut from, tx, file_counted)
                    .await
            }
            .await;
            match result {
                Ok(sent) => return Ok(sent),
                Err(e) if e.is_retryable() && attempt < max => {
                    let delay = self.transfers.backoff(attempt, &e);
                    tracing::warn!(%what, attempt, error = %e, delay_ms = delay.as_millis() as u64, "retrying");
                    sleep_unless_cancelled(delay, &self.ctx.cancel).await?;
                }
                Err(e) if e.is_retryable() => {
                    return Err(TransferError::Exhausted {
                        attempts: attempt,
                        last: Box::new(e),
                    })
                }
                Err(e) => return Err(e),
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn read_rest(
        &self,
        entry: &ManifestEntry,
        body: RangeBody,
        slot: OwnedSemaphorePermit,
        what: &str,
        from: &mut u64,
        tx: &Chunks,
        file_counted: &mut Counted<'_>,
    ) -> Result<bool, TransferError> {
        let (mut skip, mut body) = match body {
            RangeBody::WholeFile(body) => (*from, body),
            RangeBody::Part(body) => (0, body),
        };
        let size = entry.size;
        while *from < size {
            let Some(mut chunk) = self.transfers.next_chunk(what, &mut body).await? else {
                return Err(TransferError::Truncated {
                    what: what.into(),
                    got: *from,
                    want: size,
                });
            };
            if self.ctx.cancel.load(Ordering::Relaxed) {
                return Err(TransferError::Cancelled);
            }
            if skip > 0 {
                let n = skip.min(chunk.len() as u64);
                let _ = chunk.split_to(n as usize);
                skip -= n;
            }
            let take = (size - *from).min(chunk.len() as u64) as usize;
            if take == 0 {
                continue;
            }
            let part = chunk.split_to(take);
            *from += take as u64;
            file_counted.add(take as u64);
            let part = Parts {
                bytes: vec![part],
                _budget: None,
            };
            if tx.send(Some(part)).await.is_err() {
                return Ok(false);
            }
        }
        drop(slot);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The range data budget is shared and bounded: shares are rounded up to the unit, a
    /// share larger than the budget takes all of it (instead of waiting forever), and a
    /// waiter gets its share when one is given back.
    #[tokio::test]
    async fn the_buffer_budget_bounds_range_data_node_wide() {
        use futures_util::FutureExt;
        let t = Transfers::new(DownloadTuning {
            buffer_bytes: 1 << 20,
            ..DownloadTuning::default()
        });
        let first = t.buffer(1).await;
        assert_eq!(t.buffer_in_use(), BUFFER_UNIT);
        drop(first);
        let all = t.buffer(8 << 20).await;
        assert_eq!(t.buffer_in_use(), 1 << 20, "clamped to the whole budget");
        let mut waiting = Box::pin(t.buffer(100));
        assert!(
            waiting.as_mut().now_or_never().is_none(),
            "the budget is spent"
        );
        drop(all);
        let got = waiting.await;
        assert_eq!(t.buffer_in_use(), BUFFER_UNIT);
        drop(got);
        assert_eq!(t.buffer_in_use(), 0);
    }

    #[test]
    fn ranges_cover_the_rest_exactly() {
        assert_eq!(ranges(0, 0, 4), vec![]);
        assert_eq!(ranges(0, 10, 4), vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(ranges(5, 10, 4), vec![(5, 4), (9, 1)]);
        assert_eq!(ranges(10, 10, 4), vec![]);
    }

    fn listed(key: &str, size: u64) -> ListedObject {
        ListedObject {
            key: key.into(),
            size,
            version: "\"etag-1\"".into(),
            md5: None,
            crc32c: None,
        }
    }

    #[test]
    fn listings_become_manifests_relative_to_the_prefix() {
        let m = manifest_from_listing(
            "s3://b",
            "models/llama/",
            vec![
                listed("models/llama/config.json", 3),
                listed("models/llama/sub/", 0),
                listed("models/llama/sub/w.bin", 5),
                listed("models/llama-2/other", 1),
            ],
        )
        .unwrap();
        let paths: Vec<&str> = m.entries().map(|e| e.path).collect();
        assert_eq!(paths, ["config.json", "sub/w.bin"]);
        assert_eq!(m.revision, m.id().to_string());
        // A changed object (new ETag) is a new artifact; another bucket too.
        let mut changed = listed("models/llama/config.json", 3);
        changed.version = "\"etag-2\"".into();
        let one = |location: &str, o: ListedObject| {
            manifest_from_listing(location, "models/llama", vec![o])
                .unwrap()
                .id()
        };
        let first = one("s3://b", listed("models/llama/config.json", 3));
        assert_eq!(first, one("s3://b", listed("models/llama/config.json", 3)));
        assert_ne!(first, one("s3://b", changed));
        assert_ne!(first, one("s3://c", listed("models/llama/config.json", 3)));
    }

    /// Folder markers as `object_store` hands them over (trailing `/` dropped): an empty
    /// object at the prefix itself, or at a directory of other objects.
    #[test]
    fn folder_markers_without_their_slash_are_skipped() {
        let m = manifest_from_listing(
            "s3://b",
            "models/llama",
            vec![
                listed("models/llama", 0),
                listed("models/llama/sub", 0),
                listed("models/llama/sub/deeper", 0),
                listed("models/llama/sub/deeper/w.bin", 5),
                listed("models/llama/empty.txt", 0),
            ],
        )
        .unwrap();
        let paths: Vec<&str> = m.entries().map(|e| e.path).collect();
        assert_eq!(paths, ["empty.txt", "sub/deeper/w.bin"]);
    }

    #[test]
    fn hostile_keys_are_refused_with_a_reason() {
        for (keys, want) in [
            (vec!["p/../x"], "dot segment"),
            (vec!["p//etc/passwd"], "absolute"),
            (vec!["p/a//b"], "empty segment"),
            (vec!["p/a/./b"], "dot segment"),
            (vec!["p/a", "p/a/b"], "both a file and a directory"),
            (vec!["p", "p/a"], "both a file and a directory"),
            (vec!["p/x\u{1b}[2J"], "control character"),
            (vec!["p/trailing/"], "empty segment"),
        ] {
            let objects = keys.iter().map(|k| listed(k, 1)).collect();
            let err = manifest_from_listing("s3://b", "p", objects).unwrap_err();
            assert!(
                err.to_string().contains(want) && !err.is_transient(),
                "{keys:?}: {err} should mention {want}"
            );
        }
    }

    #[test]
    fn retry_after_in_both_forms() {
        assert_eq!(parse_retry_after(" 3 "), Some(Duration::from_secs(3)));
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO),
            "a date in the past: at once"
        );
        let in_a_minute =
            httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(60));
        let d = parse_retry_after(&in_a_minute).expect("an HTTP-date parses");
        assert!(
            d > Duration::from_secs(55) && d <= Duration::from_secs(60),
            "{d:?}"
        );
        assert_eq!(parse_retry_after("soon"), None);
        assert_eq!(
            parse_retry_after(&u64::MAX.to_string()),
            Some(MAX_RETRY_AFTER)
        );
    }

    #[test]
    fn backoff_grows_and_honours_retry_after() {
        let t = Transfers::new(DownloadTuning::default());
        let e = TransferError::Network {
            what: "w".into(),
            detail: "d".into(),
        };
        let base = t.tuning.retry_base;
        let d1 = t.backoff(1, &e);
        let d4 = t.backoff(4, &e);
        assert!(d1 >= base / 2 && d1 <= base);
        assert!(d4 >= base * 4 && d4 <= base * 8);
        let limited = TransferError::Status {
            what: "w".into(),
            status: 429,
            code: None,
            message: "slow down".into(),
            retry_after: Some(Duration::from_secs(3)),
        };
        assert_eq!(t.backoff(1, &limited), Duration::from_secs(3));
        let later = TransferError::Status {
            what: "w".into(),
            status: 503,
            code: Some("SlowDown".into()),
            message: "slow down".into(),
            retry_after: Some(Duration::from_secs(3600)),
        };
        assert_eq!(t.backoff(1, &later), t.tuning.retry_max, "capped");
    }

    #[test]
    fn classification() {
        let status = |status| TransferError::Status {
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
        let corrupt = TransferError::Corrupt {
            path: "p".into(),
            attempts: 3,
            detail: "d".into(),
        };
        assert!(!corrupt.is_transient());
        let exhausted = |last| TransferError::Exhausted {
            attempts: 8,
            last: Box::new(last),
        };
        let stalled = TransferError::Stalled {
            what: "w".into(),
            secs: 30,
        };
        assert!(stalled.is_retryable() && exhausted(stalled).is_transient());
        let lying = TransferError::Truncated {
            what: "w".into(),
            got: 10,
            want: 20,
        };
        assert!(lying.is_retryable(), "one short body can be a glitch");
        assert!(
            !exhausted(lying).is_transient(),
            "short on every attempt is a lie that will not stop"
        );
        let limit = TransferError::Limit {
            what: "w".into(),
            detail: "d".into(),
        };
        assert!(!limit.is_retryable() && !limit.is_transient());
        let config = TransferError::Config {
            what: "w".into(),
            detail: "d".into(),
        };
        assert!(!config.is_retryable() && !config.is_transient());
    }
}
