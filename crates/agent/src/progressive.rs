//! Serving while downloading, the agent's side (SPEC section 13; the mount's side is
//! `modelfs_mount::vfs::pending`).
//!
//! A fetch of a model that is served while it downloads carries a [`LiveFetch`]: which files
//! of its manifest verified (and into which blob), how often each failed verification, and
//! which files opens are waiting on. The fetch pipeline reports each file as it verifies or
//! fails and asks it which file to fetch next; the reconciler turns its state into a pending
//! mapping entry ([`LiveFetch::pending`]) at the model's path whenever it changed.
//!
//! # Order
//! Loaders read configs, the tokenizer and the weight index first, then the weight files in
//! name order, so that is the order files are fetched in ([`loader_rank`]); a file an open
//! waits on jumps the queue ([`LiveFetch::want`]).
//!
//! # The listing artifact
//! The mount needs the listing (names, sizes) before any blob is known, and a file checked by
//! git sha1 or an object identity has no sha256 until it is downloaded. So the entry carries
//! an artifact of the same id whose blobs are the manifest's sha256 where there is one and
//! zero otherwise ([`LiveFetch::listing`]); the mount reads no blob of it while the entry is
//! pending, only the verified blobs the pending states name.
//!
//! # Restarts
//! A fetch a restart ended is shown again from what its store verified ([`stored_files`]) until
//! the model's new fetch of the same manifest takes its states and waiting files over
//! ([`LiveFetch::take_over`]); the reconciler keeps the journal that makes this possible
//! (`reconciler::progressive`, "Restarts").

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use modelfs_core::artifact::{FileDigest, Manifest, Sha256Digest, StoredArtifact};
use modelfs_core::store::Store;
use modelfs_mount::vfs::{PendingFile, PendingFiles};

/// Extensions of weight files: fetched after everything else, in name order.
const WEIGHT_EXTENSIONS: &[&str] = &[
    "safetensors",
    "bin",
    "pt",
    "pth",
    "ckpt",
    "gguf",
    "ggml",
    "onnx",
    "msgpack",
    "h5",
    "npz",
    "tflite",
    "mlmodel",
    "ot",
];

/// Where a file comes in the order loaders read a model: 0 for configs, tokenizer files, index
/// files and anything else small a loader reads first; 1 for weight files. Ties go by path.
pub fn loader_rank(path: &str) -> u8 {
    let name = path.rsplit('/').next().unwrap_or(path);
    let ext = name.rsplit_once('.').map(|(_, e)| e).unwrap_or("");
    u8::from(WEIGHT_EXTENSIONS.contains(&ext.to_ascii_lowercase().as_str()))
}

/// Told when a live fetch's state changed (called on the fetch's task: must not block).
pub type Changed = Box<dyn Fn() + Send + Sync>;

/// The state of one fetch served while it downloads (module docs).
pub struct LiveFetch {
    listing: Arc<StoredArtifact>,
    state: Mutex<State>,
    changed: Changed,
}

struct State {
    files: Vec<PendingFile>,
    /// Files opens wait on, oldest first.
    wanted: VecDeque<usize>,
    /// When each file verified, until a mapping showed it ([`LiveFetch::shown`]).
    verified_at: Vec<Option<Instant>>,
}

impl LiveFetch {
    pub fn new(manifest: Arc<Manifest>, changed: Changed) -> Arc<Self> {
        let blobs = manifest
            .entries()
            .map(|e| match e.digest {
                FileDigest::Sha256(d) => Sha256Digest(d),
                _ => Sha256Digest([0; 32]),
            })
            .collect();
        let len = manifest.len();
        let listing =
            StoredArtifact::new(manifest, blobs, now_secs()).expect("one blob per manifest entry");
        Arc::new(Self {
            listing: Arc::new(listing),
            state: Mutex::new(State {
                files: vec![PendingFile::Waiting { failures: 0 }; len],
                wanted: VecDeque::new(),
                verified_at: vec![None; len],
            }),
            changed,
        })
    }

    /// The artifact the pending entry lists the files with (module docs).
    pub fn listing(&self) -> Arc<StoredArtifact> {
        self.listing.clone()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Files `indices` verified into `blob`.
    pub fn verified(&self, indices: &[usize], blob: Sha256Digest) {
        let pairs: Vec<(usize, Sha256Digest)> = indices.iter().map(|&i| (i, blob)).collect();
        self.verified_many(&pairs);
    }

    /// Each (file, blob) verified; one change (also when `files` is empty: the fetch started
    /// and its listing can be shown).
    pub fn verified_many(&self, files: &[(usize, Sha256Digest)]) {
        {
            let mut s = self.state();
            let now = Instant::now();
            for &(i, blob) in files {
                if let Some(f) = s.files.get_mut(i) {
                    *f = PendingFile::Verified(blob);
                    s.verified_at[i] = Some(now);
                }
            }
            s.wanted.retain(|i| !files.iter().any(|(j, _)| j == i));
        }
        (self.changed)();
    }

    /// A download of files `indices` failed verification (it is fetched again).
    pub fn failed(&self, indices: &[usize]) {
        {
            let mut s = self.state();
            for &i in indices {
                if let Some(PendingFile::Waiting { failures }) = s.files.get_mut(i) {
                    *failures += 1;
                }
            }
        }
        (self.changed)();
    }

    /// An open waits on file `i`: it is fetched next.
    ///
    /// True when the file joined the queue now (it was waiting and not wanted yet); an open
    /// waiting on a file already wanted changes nothing.
    pub fn want(&self, i: usize) -> bool {
        let mut s = self.state();
        let joins =
            matches!(s.files.get(i), Some(PendingFile::Waiting { .. })) && !s.wanted.contains(&i);
        if joins {
            s.wanted.push_back(i);
        }
        joins
    }

    /// The oldest wanted file for which `take` answers true (it took it from its queue).
    pub fn next_wanted(&self, mut take: impl FnMut(usize) -> bool) -> Option<usize> {
        let mut s = self.state();
        let pos = s.wanted.iter().position(|&i| take(i))?;
        s.wanted.remove(pos)
    }

    /// Takes on what `earlier` (a fetch of the same manifest that a restart ended) knew: the
    /// files opens wait on and their failure counts, so no waiting open loses its place in
    /// the queue, and with `same_store` its verified files, so the mapping shows no file
    /// going back to waiting (the verified blobs are in the store it fetched into).
    pub fn take_over(&self, earlier: &LiveFetch, same_store: bool) {
        let old = earlier.state().clone_parts();
        let mut s = self.state();
        for (i, f) in old.0.into_iter().enumerate() {
            if !same_store && matches!(f, PendingFile::Verified(_)) {
                continue;
            }
            let Some(mine) = s.files.get_mut(i) else {
                continue;
            };
            match (f, *mine) {
                (PendingFile::Verified(b), PendingFile::Waiting { .. }) => {
                    *mine = PendingFile::Verified(b)
                }
                (PendingFile::Waiting { failures: a }, PendingFile::Waiting { failures: b }) => {
                    *mine = PendingFile::Waiting { failures: a.max(b) }
                }
                _ => {}
            }
        }
        for i in old.1 {
            if matches!(s.files.get(i), Some(PendingFile::Waiting { .. })) && !s.wanted.contains(&i)
            {
                s.wanted.push_back(i);
            }
        }
    }

    /// The per-file states for the mount.
    pub fn pending(&self) -> PendingFiles {
        PendingFiles::new(self.state().files.clone())
    }

    /// A mapping shows the states as they are now: logs, for each file it shows verified for
    /// the first time, how long after its verification that came (the lag between the fetch
    /// and the mount that a waiting open pays).
    pub fn shown(&self) {
        let mut s = self.state();
        let paths = &self.listing.manifest;
        for (i, at) in s.verified_at.iter_mut().enumerate() {
            if let Some(at) = at.take() {
                tracing::debug!(file = %paths.entry(i).path, lag_ms = at.elapsed().as_millis() as u64, "a mapping shows a file verified");
            }
        }
    }

    /// How many files verified, of how many.
    pub fn counts(&self) -> (usize, usize) {
        let s = self.state();
        let verified = s
            .files
            .iter()
            .filter(|f| matches!(f, PendingFile::Verified(_)))
            .count();
        (verified, s.files.len())
    }
}

impl State {
    fn clone_parts(&self) -> (Vec<PendingFile>, Vec<usize>) {
        (self.files.clone(), self.wanted.iter().copied().collect())
    }
}

/// The files of `manifest` that `store` already holds verified (a sha256 blob present with
/// its size, or an alias to one written after it verified): what a fetch resumed after a
/// restart does not download again, and so what may be served before it starts.
pub fn stored_files(manifest: &Manifest, store: &Store) -> Vec<(usize, Sha256Digest)> {
    manifest
        .entries()
        .enumerate()
        .filter_map(|(i, e)| {
            let blob = match e.digest {
                FileDigest::Sha256(d) => {
                    let d = Sha256Digest(d);
                    store.has_blob(&d, e.size).then_some(d)
                }
                _ => store.lookup_alias(&e.digest, e.size),
            }?;
            Some((i, blob))
        })
        .collect()
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use modelfs_core::artifact::ManifestEntry;

    /// A manifest of `n` one-byte files `f0`, `f1`, ... checked by git sha1 (no sha256 known
    /// before they download).
    fn manifest_of(n: u8) -> Arc<Manifest> {
        let entries = (0..n)
            .map(|i| ManifestEntry {
                path: format!("f{i}"),
                size: 1,
                digest: FileDigest::GitSha1([i; 20]),
            })
            .collect();
        Arc::new(Manifest::new("r".into(), entries).unwrap())
    }

    #[test]
    fn configs_tokenizer_and_index_before_weights() {
        let mut paths = vec![
            "model-00002-of-00002.safetensors",
            "config.json",
            "model-00001-of-00002.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
            "sub/pytorch_model.BIN",
        ];
        paths.sort_by_key(|p| (loader_rank(p), *p));
        assert_eq!(
            paths,
            [
                "config.json",
                "model.safetensors.index.json",
                "tokenizer.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "sub/pytorch_model.BIN",
            ]
        );
    }

    #[test]
    fn wanted_files_come_out_oldest_first_once_and_never_after_they_verified() {
        let manifest = manifest_of(4);
        let changes = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let seen = changes.clone();
        let live = LiveFetch::new(
            manifest.clone(),
            Box::new(move || {
                seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }),
        );
        assert_eq!(live.listing().id, manifest.id());
        live.want(3);
        live.want(1);
        live.want(3);
        live.verified(&[1], Sha256Digest([1; 32]));
        live.want(1);
        assert_eq!(live.next_wanted(|_| true), Some(3));
        assert_eq!(live.next_wanted(|_| true), None);
        live.failed(&[2]);
        assert_eq!(
            live.pending().get(2),
            Some(PendingFile::Waiting { failures: 1 })
        );
        assert_eq!(live.counts(), (1, 4));
        assert_eq!(changes.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[test]
    fn a_new_fetch_takes_over_waiting_files_and_verified_ones_only_in_the_same_store() {
        let manifest = manifest_of(3);
        let earlier = LiveFetch::new(manifest.clone(), Box::new(|| {}));
        earlier.verified(&[0], Sha256Digest([7; 32]));
        earlier.failed(&[1]);
        earlier.want(2);
        let same = LiveFetch::new(manifest.clone(), Box::new(|| {}));
        same.take_over(&earlier, true);
        assert_eq!(
            same.pending().get(0),
            Some(PendingFile::Verified(Sha256Digest([7; 32])))
        );
        assert_eq!(
            same.pending().get(1),
            Some(PendingFile::Waiting { failures: 1 })
        );
        assert_eq!(same.next_wanted(|_| true), Some(2));
        let other = LiveFetch::new(manifest, Box::new(|| {}));
        other.take_over(&earlier, false);
        assert_eq!(
            other.pending().get(0),
            Some(PendingFile::Waiting { failures: 0 })
        );
        assert_eq!(other.next_wanted(|_| true), Some(2));
    }
}
