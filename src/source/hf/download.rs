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
//! * **Every transfer is watched**: no byte for `stall_timeout` aborts and retries it; a body
//!   shorter than its range is retried; each request holds a slot of the node-wide transfer
//!   limit while it runs.

use std::cmp::Reverse;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::{stream, StreamExt};
use reqwest::header::{CONTENT_RANGE, RANGE};
use reqwest::StatusCode;

use super::client::{check_status, network};
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
            .map_err(|_| HfError::Cancelled)?
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
        let streams = if chunks.len() > 1 {
            tuning.range_streams.max(1)
        } else {
            1
        };
        let produced = async {
            let mut parts = stream::iter(chunks)
                .map(|(at, len)| fetch_range(src, &url, &entry.path, at, len, ctx))
                .buffered(streams);
            while let Some(part) = parts.next().await {
                let (bytes, counted) = part?;
                file_counted.n += counted;
                if tx.send(Some(bytes)).await.is_err() {
                    return Ok(false);
                }
            }
            Ok::<_, HfError>(tx.send(None).await.is_ok())
        }
        .await;
        drop(tx);
        let written = writer_task.await.map_err(|_| HfError::Cancelled)?;
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

/// Downloads `[at, at + len)` of one file, with retries. Returns the bytes and how many were
/// counted into progress.
async fn fetch_range(
    src: &HfSource,
    url: &str,
    path: &str,
    at: u64,
    len: u64,
    ctx: &FetchContext,
) -> Result<(Bytes, u64), HfError> {
    let what = format!("downloading {path} (bytes {at}-{})", at + len - 1);
    let client = src.client();
    client
        .retrying(&what, &ctx.cancel, || {
            range_attempt(src, url, &what, at, len, ctx)
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
    ctx: &FetchContext,
) -> Result<(Bytes, u64), HfError> {
    let client = src.client();
    let stall = client.config().tuning.stall_timeout;
    let stalled = || HfError::Stalled {
        what: what.into(),
        secs: stall.as_secs(),
    };
    let _slot = client.transfer_slot().await;
    let mut counted = Counted {
        progress: &ctx.progress,
        n: 0,
    };
    let req = client
        .request(url, src.token())
        .header(RANGE, format!("bytes={at}-{}", at + len - 1));
    let resp = tokio::time::timeout(stall, req.send())
        .await
        .map_err(|_| stalled())?
        .map_err(|e| network(what, e))?;
    let mut resp = check_status(what, resp).await?;
    // A server that ignores Range answers 200 with the whole file: skip to our offset.
    let mut skip = match resp.status() {
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
            0
        }
        StatusCode::OK => at,
        other => {
            return Err(HfError::Protocol {
                what: what.into(),
                detail: format!("unexpected status {other} for a file download"),
            })
        }
    };
    let mut buf = BytesMut::with_capacity(len as usize);
    while (buf.len() as u64) < len {
        let chunk = tokio::time::timeout(stall, resp.chunk())
            .await
            .map_err(|_| stalled())?
            .map_err(|e| network(what, e))?;
        let Some(mut chunk) = chunk else { break };
        if ctx.cancel.load(Ordering::Relaxed) {
            return Err(HfError::Cancelled);
        }
        if skip > 0 {
            let n = skip.min(chunk.len() as u64);
            let _ = chunk.split_to(n as usize);
            skip -= n;
        }
        let take = (len - buf.len() as u64).min(chunk.len() as u64) as usize;
        buf.extend_from_slice(&chunk[..take]);
        counted.add(take as u64);
    }
    if (buf.len() as u64) < len {
        return Err(HfError::Truncated {
            what: what.into(),
            got: buf.len() as u64,
            want: len,
        });
    }
    Ok((buf.freeze(), counted.keep()))
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
