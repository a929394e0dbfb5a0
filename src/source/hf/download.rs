//! The download engine of the Hugging Face source.
//!
//! * **Skip what is there.** An LFS entry whose sha256 blob is already in the model's store, or
//!   a small entry whose git sha1 has an alias to a present blob, is not downloaded again.
//! * **Several files at once** (`max_files`), largest first, so the big shards start early and
//!   small files fill the gaps.
//! * **Large files as parallel ranges** (`range_streams` requests of `chunk_size` each). The
//!   ranges are requested concurrently but handed to the writer *in order* (`buffered`), so the
//!   partial file is always a contiguous prefix: it is hashed while written, and a crash leaves a
//!   prefix that [`Store::resume_writer`](crate::store::Store::resume_writer) re-hashes and
//!   continues with `Range`. At most `range_streams` chunks per file wait in memory.
//! * **Verified before published.** The writer (a blocking thread per file) streams into
//!   `tmp/<digest>.part`; `commit` checks size and digest (sha256 for LFS, git blob sha1 for the
//!   rest) and renames into `blobs/` only on a match. A mismatch deletes the partial file and the
//!   file is downloaded again, up to `verify_attempts` times; then the model is `Failed`.
//! * **Every transfer is watched**: no response headers or no byte for `stall_timeout` aborts
//!   and retries it; a body shorter than its range is retried; each request holds a slot of the
//!   node-wide transfer limit while it runs.
//! * **A server that ignores `Range`** answers `200` with the whole file. The first range of a
//!   file is therefore requested alone; only after a `206` do the other ranges go out in
//!   parallel. After a `200` the rest of the file is read from that one answer (and on a
//!   failure, from one new whole-file answer), so such a server costs one download of the file
//!   per attempt, never one per range (which is quadratic in the file size).

use std::cmp::Reverse;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::{stream, StreamExt};
use reqwest::header::{CONTENT_RANGE, RANGE};
use reqwest::{Response, StatusCode};
use tokio::sync::OwnedSemaphorePermit;

use super::client::HubClient;
use super::{HfError, HfSource};
use crate::artifact::{FileDigest, Manifest, ManifestEntry, Sha256Digest};
use crate::metrics::SourceScheme;
use crate::source::{FetchContext, Progress, SourceError};
use crate::store::StoreError;

/// Fetches every entry the store lacks; returns the sha256 blob of every entry.
pub async fn fetch(
    src: &HfSource,
    manifest: Arc<Manifest>,
    ctx: FetchContext,
) -> Result<Vec<Sha256Digest>, SourceError> {
    let tuning = src.client().config().tuning.clone();
    let entries = manifest.entries();
    let progress = ctx.progress.clone();
    progress
        .total_bytes
        .store(manifest.total_size(), Ordering::Relaxed);
    progress
        .total_files
        .store(entries.len() as u64, Ordering::Relaxed);
    progress.completed_bytes.store(0, Ordering::Relaxed);
    progress.completed_files.store(0, Ordering::Relaxed);

    let mut blobs: Vec<Option<Sha256Digest>> = vec![None; entries.len()];
    // Entries with the same digest (identical files under several names) are downloaded once:
    // two writers must never share one partial file.
    let mut todo: Vec<(usize, Vec<usize>)> = Vec::new();
    let mut by_digest: std::collections::HashMap<FileDigest, usize> = Default::default();
    for (i, e) in entries.iter().enumerate() {
        // Blobs the store has (or can hard-link from the model's previous store), then small
        // files committed before a crash, known only by their alias.
        let have = match ctx.reuse_existing(e)? {
            Some(sha) => Some(sha),
            None => ctx.store.lookup_alias(&e.digest, e.size),
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
    todo.sort_by_key(|(i, _)| (Reverse(entries[*i].size), *i));
    let label = format!("hf://{}@{}", src.repo, manifest.revision);
    tracing::info!(
        source = %label,
        files = todo.len(),
        bytes = todo.iter().map(|(i, _)| entries[*i].size).sum::<u64>(),
        already_present = entries.len() - todo.iter().map(|(_, d)| d.len() + 1).sum::<usize>(),
        "downloading"
    );

    let work = async {
        let mut blobs = blobs;
        let mut downloads = stream::iter(todo)
            .map(|(i, same)| {
                let fut = download_file(src, &manifest.revision, &entries[i], &ctx, &tuning);
                async move { (i, same, fut.await) }
            })
            .buffer_unordered(tuning.max_files.max(1));
        while let Some((i, same, result)) = downloads.next().await {
            let sha = result?;
            blobs[i] = Some(sha);
            for j in same {
                blobs[j] = Some(sha);
                let p = &ctx.progress;
                p.completed_bytes
                    .fetch_add(entries[j].size, Ordering::Relaxed);
                p.completed_files.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok::<_, HfError>(blobs)
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
    ctx.store.sync().map_err(|source| HfError::Store {
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

fn store_err(path: &str) -> impl Fn(StoreError) -> HfError + '_ {
    move |source| HfError::Store {
        path: path.to_string(),
        source,
    }
}

async fn download_file(
    src: &HfSource,
    commit: &str,
    entry: &ManifestEntry,
    ctx: &FetchContext,
    tuning: &super::DownloadTuning,
) -> Result<Sha256Digest, HfError> {
    let url = src.file_url(commit, &entry.path);
    let mut last_mismatch = String::new();
    let attempts = tuning.verify_attempts.max(1);
    for _ in 0..attempts {
        ctx.check_cancelled().map_err(|_| HfError::Cancelled)?;
        let store = ctx.store.clone();
        let (digest, size) = (entry.digest, entry.size);
        let writer = tokio::task::spawn_blocking(move || store.resume_writer(digest, size))
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
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Option<Bytes>>(2);
        let writer_task = tokio::task::spawn_blocking(move || {
            let mut w = writer;
            while let Some(msg) = rx.blocking_recv() {
                match msg {
                    Some(buf) => w.write_all(&buf)?,
                    None => return w.commit().map(Some),
                }
            }
            Ok(None)
        });

        let chunks = ranges(resumed, size, tuning.chunk_size);
        let produced = async {
            let mut chunks = chunks.into_iter();
            // The first range alone: it tells whether the server honours Range at all.
            if let Some((at, len)) = chunks.next() {
                match fetch_range(src, &url, &entry.path, at, len, true, ctx).await? {
                    RangeAnswer::Part(bytes, counted) => {
                        file_counted.n += counted;
                        if tx.send(Some(bytes)).await.is_err() {
                            return Ok(false);
                        }
                    }
                    RangeAnswer::WholeFile(resp, slot) => {
                        let whole = WholeFile {
                            src,
                            url: &url,
                            path: &entry.path,
                            size,
                            ctx,
                        };
                        if !whole.stream(resp, slot, at, &tx, &mut file_counted).await? {
                            return Ok(false);
                        }
                        return Ok::<_, HfError>(tx.send(None).await.is_ok());
                    }
                }
            }
            let mut parts = stream::iter(chunks)
                .map(|(at, len)| fetch_range(src, &url, &entry.path, at, len, false, ctx))
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
            Ok::<_, HfError>(tx.send(None).await.is_ok())
        }
        .await;
        drop(tx);
        let written = writer_task.await.map_err(joined)?;
        match (produced, written) {
            (_, Err(e @ (StoreError::Io { .. } | StoreError::DiskFull { .. }))) => {
                return Err(store_err(&entry.path)(e))
            }
            (Err(e), _) => return Err(e),
            (Ok(_), Ok(Some(sha))) => {
                ctx.store
                    .record_alias(&entry.digest, &sha)
                    .map_err(store_err(&entry.path))?;
                let downloaded = file_counted.keep().saturating_sub(resumed);
                ctx.record_fetched(SourceScheme::Hf, downloaded);
                ctx.progress.completed_files.fetch_add(1, Ordering::Relaxed);
                return Ok(sha);
            }
            (Ok(_), Ok(None)) => return Err(HfError::Cancelled),
            (Ok(_), Err(e)) => {
                // Size or digest mismatch: the writer removed the partial file.
                tracing::warn!(path = %entry.path, error = %e, "downloaded bytes failed verification; downloading again");
                last_mismatch = e.to_string();
            }
        }
    }
    Err(HfError::Corrupt {
        path: entry.path.clone(),
        attempts,
        detail: last_mismatch,
    })
}

/// A blocking worker that did not finish: cancelled at shutdown, or panicked. A panic is
/// carried on to the task that runs the model's work, which reports it as a permanent failure
/// with its message instead of a cancellation that would be retried forever.
fn joined(e: tokio::task::JoinError) -> HfError {
    match e.try_into_panic() {
        Ok(panic) => std::panic::resume_unwind(panic),
        Err(_) => HfError::Cancelled,
    }
}

/// What a range request brought.
enum RangeAnswer {
    /// The bytes of the range, and how many were counted into progress.
    Part(Bytes, u64),
    /// The server ignored `Range` and answers with the whole file (only when the caller
    /// accepts that), with the transfer slot the answer holds.
    WholeFile(Response, OwnedSemaphorePermit),
}

/// Downloads `[at, at + len)` of one file, with retries. With `accept_whole`, a `200` answer
/// is handed back unread instead of being read up to the range.
async fn fetch_range(
    src: &HfSource,
    url: &str,
    path: &str,
    at: u64,
    len: u64,
    accept_whole: bool,
    ctx: &FetchContext,
) -> Result<RangeAnswer, HfError> {
    let what = format!("downloading {path} (bytes {at}-{})", at + len - 1);
    let client = src.client();
    client
        .retrying(&what, &ctx.cancel, src.throttle(), || {
            range_attempt(src, url, &what, at, len, accept_whole, ctx)
        })
        .await
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

async fn range_attempt(
    src: &HfSource,
    url: &str,
    what: &str,
    at: u64,
    len: u64,
    accept_whole: bool,
    ctx: &FetchContext,
) -> Result<RangeAnswer, HfError> {
    let client = src.client();
    let slot = client.transfer_slot().await;
    let mut counted = Counted {
        progress: &ctx.progress,
        n: 0,
    };
    let req = client
        .request(url, src.token())
        .header(RANGE, format!("bytes={at}-{}", at + len - 1));
    let resp = client.send(what, req).await?;
    let mut resp = client.check_status(what, resp).await?;
    match resp.status() {
        StatusCode::PARTIAL_CONTENT => {
            let start = resp
                .headers()
                .get(CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .and_then(parse_content_range_start);
            if start != Some(at) {
                return Err(HfError::Protocol {
                    what: what.into(),
                    detail: format!(
                        "asked for bytes from {at}, got Content-Range starting at {start:?}"
                    ),
                });
            }
        }
        StatusCode::OK if accept_whole => return Ok(RangeAnswer::WholeFile(resp, slot)),
        // It honoured Range for the first range of this file: a hiccup (another server behind
        // the same name?). Retried; each attempt reads at most up to the end of the range.
        StatusCode::OK => {
            return Err(HfError::Network {
                what: what.into(),
                detail: "the server ignored Range after honouring it".into(),
            })
        }
        other => {
            return Err(HfError::Protocol {
                what: what.into(),
                detail: format!("unexpected status {other} for a file download"),
            })
        }
    }
    let mut buf = BytesMut::with_capacity(len as usize);
    while (buf.len() as u64) < len {
        let Some(chunk) = client.next_chunk(what, &mut resp).await? else {
            break;
        };
        if ctx.cancel.load(Ordering::Relaxed) {
            return Err(HfError::Cancelled);
        }
        let take = (len - buf.len() as u64).min(chunk.len() as u64) as usize;
        buf.extend_from_slice(&chunk[..take]);
        counted.add(take as u64);
    }
    drop(slot);
    if (buf.len() as u64) < len {
        return Err(HfError::Truncated {
            what: what.into(),
            got: buf.len() as u64,
            want: len,
        });
    }
    Ok(RangeAnswer::Part(buf.freeze(), counted.keep()))
}

/// The rest of one file from a server that ignores `Range`: whole-file answers, read from the
/// start, the bytes before the current offset skipped.
struct WholeFile<'a> {
    src: &'a HfSource,
    url: &'a str,
    path: &'a str,
    size: u64,
    ctx: &'a FetchContext,
}

impl WholeFile<'_> {
    /// Sends `[from, size)` to the writer, starting with the answer `first`; a failed answer
    /// is replaced by a new request (with retries and backoff) that continues where it broke
    /// off. Returns `false` if the writer went away.
    async fn stream(
        &self,
        first: Response,
        first_slot: OwnedSemaphorePermit,
        mut from: u64,
        tx: &tokio::sync::mpsc::Sender<Option<Bytes>>,
        file_counted: &mut Counted<'_>,
    ) -> Result<bool, HfError> {
        let client: &HubClient = self.src.client();
        let max = client.config().tuning.max_attempts.max(1);
        tracing::info!(path = %self.path, "the server ignores Range; reading the whole file from one answer");
        let mut answer = Some((first, first_slot));
        let mut attempt = 0;
        loop {
            attempt += 1;
            let what = format!(
                "downloading {} (bytes {from}- of a whole-file answer)",
                self.path
            );
            let result = match answer.take() {
                Some((resp, slot)) => {
                    self.read(resp, slot, &what, &mut from, tx, file_counted)
                        .await
                }
                None => {
                    self.request_and_read(&what, &mut from, tx, file_counted)
                        .await
                }
            };
            match result {
                Ok(sent) => return Ok(sent),
                Err(e) if e.is_retryable() && attempt < max => {
                    let delay = client.backoff(attempt, &e);
                    tracing::warn!(%what, attempt, error = %e, delay_ms = delay.as_millis() as u64, "retrying");
                    super::client::sleep_unless_cancelled(delay, &self.ctx.cancel).await?;
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

    async fn request_and_read(
        &self,
        what: &str,
        from: &mut u64,
        tx: &tokio::sync::mpsc::Sender<Option<Bytes>>,
        file_counted: &mut Counted<'_>,
    ) -> Result<bool, HfError> {
        let client = self.src.client();
        let slot = client.transfer_slot().await;
        // Asked from the offset, in case it honours Range this time.
        let req = client
            .request(self.url, self.src.token())
            .header(RANGE, format!("bytes={from}-"));
        let resp = client.send(what, req).await?;
        let resp = client.check_status(what, resp).await?;
        self.read(resp, slot, what, from, tx, file_counted).await
    }

    async fn read(
        &self,
        mut resp: Response,
        slot: OwnedSemaphorePermit,
        what: &str,
        from: &mut u64,
        tx: &tokio::sync::mpsc::Sender<Option<Bytes>>,
        file_counted: &mut Counted<'_>,
    ) -> Result<bool, HfError> {
        let client = self.src.client();
        let mut skip = match resp.status() {
            StatusCode::OK => *from,
            StatusCode::PARTIAL_CONTENT => {
                let start = resp
                    .headers()
                    .get(CONTENT_RANGE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(parse_content_range_start);
                if start != Some(*from) {
                    return Err(HfError::Protocol {
                        what: what.into(),
                        detail: format!(
                            "asked for bytes from {from}, got Content-Range starting at {start:?}"
                        ),
                    });
                }
                0
            }
            other => {
                return Err(HfError::Protocol {
                    what: what.into(),
                    detail: format!("unexpected status {other} for a file download"),
                })
            }
        };
        while *from < self.size {
            let Some(mut chunk) = client.next_chunk(what, &mut resp).await? else {
                return Err(HfError::Truncated {
                    what: what.into(),
                    got: *from,
                    want: self.size,
                });
            };
            if self.ctx.cancel.load(Ordering::Relaxed) {
                return Err(HfError::Cancelled);
            }
            if skip > 0 {
                let n = skip.min(chunk.len() as u64);
                let _ = chunk.split_to(n as usize);
                skip -= n;
            }
            let take = (self.size - *from).min(chunk.len() as u64) as usize;
            if take == 0 {
                continue;
            }
            let part = chunk.split_to(take);
            *from += take as u64;
            file_counted.add(take as u64);
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

    #[test]
    fn ranges_cover_the_rest_exactly() {
        assert_eq!(ranges(0, 0, 4), vec![]);
        assert_eq!(ranges(0, 10, 4), vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(ranges(5, 10, 4), vec![(5, 4), (9, 1)]);
        assert_eq!(ranges(10, 10, 4), vec![]);
    }

    #[test]
    fn content_range_start() {
        assert_eq!(parse_content_range_start("bytes 100-199/1000"), Some(100));
        assert_eq!(parse_content_range_start("bytes */1000"), None);
    }
}
