//! Sources: resolve a model's `storageUri` to an artifact, then fetch the artifact's blobs into a
//! store.
//!
//! The two steps are separate on purpose. `resolve` is cheap relative to `fetch` for remote
//! sources (metadata calls only) and yields the artifact identity, which is what placement needs
//! to decide whether anything must be fetched at all (`ReuseIfExists` onto an existing holder
//! downloads zero bytes). `fetch` then writes only the blobs the target store lacks and verifies
//! every one against the digest `resolve` obtained.

pub mod checks;
pub mod gcs;
pub mod hf;
pub mod local;
pub mod objstore;
pub mod oci;
pub mod pipeline;
pub mod proxy;
pub mod ranged;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::metrics::{Metrics, SourceLabel, SourceScheme};
use modelfs_core::artifact::{ArtifactError, EntryRef, FileDigest, Manifest, Sha256Digest};
use modelfs_core::store::{Store, StoreError};
use modelfs_ome::SourceUri;
use pipeline::TransferError;

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("source directory {path} does not exist")]
    LocalMissing { path: String },
    /// A `local://` model's directory outside the models root (read in place, never imported)
    /// is missing: OME's agent's words for it.
    #[error("local model path does not exist: {path}")]
    NodeDirMissing { path: String },
    #[error("source {path}: {source}")]
    LocalIo {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("source {path} is a {kind}; only regular files and directories can be imported")]
    LocalSpecialFile { path: String, kind: &'static str },
    #[error("source {path} is not a directory; local:// names the directory to import")]
    LocalNotDirectory { path: String },
    #[error(
        "source {path} is a symlink that leads to {target}, outside the source directory \
         {tree}; only symlinks that stay inside it are followed"
    )]
    LocalSymlinkEscape {
        path: String,
        target: String,
        tree: String,
    },
    #[error(
        "source {what} {path} is not readable by other users (mode {mode:04o}), but the mount \
         would show it to every user: make it readable by others ({fix}) or remove it from the \
         source directory"
    )]
    LocalNotPublic {
        path: String,
        what: &'static str,
        mode: u32,
        fix: &'static str,
    },
    #[error("source {path}: the file name {why}")]
    LocalBadName { path: String, why: &'static str },
    #[error("source {path} changed while it was being imported")]
    LocalChanged { path: String },
    #[error("source directory {path} contains a symlink loop")]
    LocalLoop { path: String },
    #[error(transparent)]
    Listing(#[from] ArtifactError),
    #[error("storing {path}: {source}")]
    Store {
        path: String,
        #[source]
        source: StoreError,
    },
    #[error(
        "storage scheme {scheme}:// is not supported yet (supported: hf://, local://, oci://, \
         s3://, gs://, az://)"
    )]
    Unsupported { scheme: String },
    #[error(transparent)]
    Transfer(pipeline::TransferError),
    #[error("cancelled")]
    Cancelled,
    /// A worker panicked: a bug, reported with its message rather than retried forever.
    #[error("internal error (a bug, please report it): {detail}")]
    Panicked { detail: String },
}

impl SourceError {
    /// The error for a worker that panicked with `payload`.
    pub fn from_panic(payload: Box<dyn std::any::Any + Send>) -> Self {
        let detail = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a worker panicked".into());
        SourceError::Panicked {
            detail: format!("a worker panicked: {detail}"),
        }
    }

    /// The result of a blocking worker that did not finish: panicked, or cancelled at shutdown.
    fn from_join(e: tokio::task::JoinError) -> Self {
        match e.try_into_panic() {
            Ok(payload) => Self::from_panic(payload),
            Err(_) => SourceError::Cancelled,
        }
    }
}

impl SourceError {
    /// Whether retrying the same request later can succeed without anyone changing the spec.
    pub fn is_transient(&self) -> bool {
        match self {
            SourceError::LocalChanged { .. } | SourceError::Cancelled => true,
            SourceError::Store { source, .. } => {
                matches!(source, StoreError::DiskFull { .. } | StoreError::Io { .. })
            }
            SourceError::LocalIo { .. } => true,
            // The directory may be created (or its disk mounted) later: the model starts by
            // itself then, as for any source that is not there yet.
            SourceError::LocalMissing { .. } | SourceError::NodeDirMissing { .. } => true,
            SourceError::Transfer(e) => e.is_transient(),
            SourceError::LocalSpecialFile { .. }
            | SourceError::LocalNotDirectory { .. }
            | SourceError::LocalSymlinkEscape { .. }
            | SourceError::LocalNotPublic { .. }
            | SourceError::LocalBadName { .. }
            | SourceError::LocalLoop { .. }
            | SourceError::Listing(_)
            | SourceError::Unsupported { .. }
            | SourceError::Panicked { .. } => false,
        }
    }
}

impl SourceError {
    /// How this failure counts in OME's download metrics (`None`: not a download failure, the
    /// work was cancelled).
    pub fn ome_outcome(&self) -> Option<crate::metrics::DownloadOutcome> {
        use crate::metrics::DownloadOutcome;
        fn mismatch(e: &StoreError) -> bool {
            matches!(
                e,
                StoreError::DigestMismatch { .. } | StoreError::SizeMismatch { .. }
            )
        }
        fn transfer(e: &TransferError) -> Option<DownloadOutcome> {
            Some(match e {
                TransferError::Cancelled => return None,
                TransferError::Corrupt { .. } => DownloadOutcome::VerificationFailed,
                TransferError::Store { source, .. } if mismatch(source) => {
                    DownloadOutcome::VerificationFailed
                }
                TransferError::Status { status: 429, .. } => DownloadOutcome::RateLimited,
                TransferError::Exhausted { last, .. } => return transfer(last),
                _ => DownloadOutcome::Failed,
            })
        }
        match self {
            SourceError::Cancelled => None,
            SourceError::Transfer(e) => transfer(e),
            SourceError::Store { source, .. } if mismatch(source) => {
                Some(DownloadOutcome::VerificationFailed)
            }
            _ => Some(DownloadOutcome::Failed),
        }
    }
}

/// A source credential (a Hugging Face token). `Debug` and `Display` never show it, so it
/// cannot reach a log line by accident; only [`Token::expose`] gives the value.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret value, for the `Authorization` header and nothing else.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// A short digest that identifies the token without revealing it (fingerprints, caches).
    pub fn digest(&self) -> String {
        use sha2::{Digest, Sha256};
        hex::encode(&Sha256::digest(self.0.as_bytes())[..8])
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(***)")
    }
}

impl std::fmt::Display for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// Progress of one fetch, shared with the status reporter.
#[derive(Debug)]
pub struct Progress {
    pub total_bytes: AtomicU64,
    pub completed_bytes: AtomicU64,
    pub total_files: AtomicU64,
    pub completed_files: AtomicU64,
    /// Bytes this fetch wrote into the store (blobs it already had or linked are not counted).
    pub fetched_bytes: AtomicU64,
    /// Files this fetch downloaded that could be checked by their size only: the store
    /// published no digest or checksum of their bytes (the status says `integrity: size-only`).
    pub size_only_files: AtomicU64,
    pub started: Instant,
}

impl Default for Progress {
    fn default() -> Self {
        Self {
            total_bytes: AtomicU64::new(0),
            completed_bytes: AtomicU64::new(0),
            total_files: AtomicU64::new(0),
            completed_files: AtomicU64::new(0),
            fetched_bytes: AtomicU64::new(0),
            size_only_files: AtomicU64::new(0),
            started: Instant::now(),
        }
    }
}

impl Progress {
    /// Progress of a fetch of `manifest`, nothing done yet.
    pub fn for_manifest(manifest: &Manifest) -> Self {
        let p = Self::default();
        p.total_bytes
            .store(manifest.total_size(), Ordering::Relaxed);
        p.total_files
            .store(manifest.entries().len() as u64, Ordering::Relaxed);
        p
    }

    pub fn bytes_per_sec(&self) -> u64 {
        let secs = self.started.elapsed().as_secs_f64();
        if secs <= 0.0 {
            return 0;
        }
        (self.completed_bytes.load(Ordering::Relaxed) as f64 / secs) as u64
    }
}

/// Blobs a fetch may take instead of downloading: those already in the target store, and those
/// of a *seed* store (the model's previous store, handed to its children when the model moved to
/// a new revision), hard-linked across. `known` maps a source digest (which may be a git sha1)
/// to the sha256 blob name, from the artifacts those stores hold.
#[derive(Clone, Debug, Default)]
pub struct KnownBlobs {
    pub known: HashMap<FileDigest, Sha256Digest>,
    pub seed: Option<Store>,
}

/// Everything a fetch needs besides the manifest.
#[derive(Clone)]
pub struct FetchContext {
    pub store: Store,
    pub progress: Arc<Progress>,
    pub cancel: Arc<AtomicBool>,
    pub metrics: Arc<Metrics>,
    pub existing: Arc<KnownBlobs>,
    /// Set when the model is served while it downloads ([`crate::progressive`]).
    pub live: Option<Arc<crate::progressive::LiveFetch>>,
}

impl FetchContext {
    /// The blob of `entry` if the target store has it or can take it from the seed store by a
    /// hard link (a copy across filesystems). Verified blobs are never fetched again.
    pub fn reuse_existing(&self, entry: EntryRef<'_>) -> Result<Option<Sha256Digest>, SourceError> {
        let sha = match entry.digest {
            FileDigest::Sha256(d) => Some(Sha256Digest(d)),
            other => self.existing.known.get(&other).copied(),
        };
        let Some(sha) = sha else {
            return Ok(None);
        };
        if self.store.has_blob(&sha, entry.size) {
            return Ok(Some(sha));
        }
        let Some(seed) = &self.existing.seed else {
            return Ok(None);
        };
        if !seed.has_blob(&sha, entry.size) {
            return Ok(None);
        }
        let (from, to) = (seed.blob_path(&sha), self.store.blob_path(&sha));
        let linked = match std::fs::hard_link(&from, &to) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => std::fs::copy(&from, &to).map(drop),
            Err(e) => Err(e),
        };
        linked.map_err(|e| SourceError::Store {
            path: entry.path.to_string(),
            source: StoreError::io(format!("linking {}", to.display()), e),
        })?;
        Ok(Some(sha))
    }

    pub fn check_cancelled(&self) -> Result<(), SourceError> {
        if self.cancel.load(Ordering::Relaxed) {
            Err(SourceError::Cancelled)
        } else {
            Ok(())
        }
    }

    pub fn record_fetched(&self, scheme: SourceScheme, bytes: u64) {
        self.progress
            .fetched_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        let label = SourceLabel { scheme };
        self.metrics
            .fetched_bytes
            .get_or_create(&label)
            .inc_by(bytes);
        self.metrics.fetched_files.get_or_create(&label).inc();
    }
}

/// Told how long a source waits each time a server throttles it (HTTP 429) before it retries:
/// the agent feeds OME's `model_agent_rate_limit_wait_seconds` with the model's labels from it.
/// Sources are built per model, so the observer travels with the source rather than through the
/// shared HTTP client.
#[derive(Clone, Default)]
pub struct ThrottleObserver(Option<Arc<dyn Fn(std::time::Duration) + Send + Sync>>);

impl ThrottleObserver {
    /// The observer of sources nobody watches.
    pub fn none() -> &'static ThrottleObserver {
        static NONE: ThrottleObserver = ThrottleObserver(None);
        &NONE
    }

    pub fn new(f: impl Fn(std::time::Duration) + Send + Sync + 'static) -> Self {
        Self(Some(Arc::new(f)))
    }

    pub fn observe(&self, waited: std::time::Duration) {
        if let Some(f) = &self.0 {
            f(waited)
        }
    }
}

impl std::fmt::Debug for ThrottleObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "ThrottleObserver(set)"
        } else {
            "ThrottleObserver(none)"
        })
    }
}

/// Daemon-wide settings of all sources, built once at start and shared by every model.
#[derive(Clone, Debug)]
pub struct SourceConfig {
    /// The Hugging Face client (endpoint, default token, tuning).
    pub hf: Arc<hf::HubClient>,
    /// `oci://` settings (endpoint override, the agent's OCI config file and environment). Its
    /// transfers go through the Hugging Face client's pool, limit and tuning.
    pub oci: Arc<oci::OciConfig>,
    /// The node-wide transfer limit and retry policy, shared by every remote source.
    pub transfers: Arc<pipeline::Transfers>,
    /// The directory underneath the mount (see [`crate::adopt`]): `local://` directories below
    /// the models root are read through it, and fetches adopt old files from it.
    pub under_mount: Option<Arc<crate::adopt::UnderMount>>,
    /// `--proxy-<scheme>` of every remote source (`hf` is also in the hub client's config);
    /// a source without one uses the environment's proxies.
    pub proxies: proxy::Proxies,
}

impl SourceConfig {
    pub fn new(hf: hf::HfConfig) -> Result<Self, SourceError> {
        let transfers = pipeline::Transfers::new(hf.tuning.clone());
        let proxies = proxy::Proxies {
            hf: hf.proxy.clone(),
            ..proxy::Proxies::default()
        };
        Ok(Self {
            hf: Arc::new(hf::HubClient::with_transfers(hf, transfers.clone())?),
            transfers,
            oci: Arc::new(oci::OciConfig::from_env()),
            under_mount: None,
            proxies,
        })
    }

    /// The per-scheme proxies; the Hugging Face one must already be in the `HfConfig` given to
    /// [`SourceConfig::new`] (its client is built there).
    pub fn with_proxies(self, proxies: proxy::Proxies) -> Self {
        debug_assert_eq!(proxies.hf, self.proxies.hf, "hf's proxy is set in HfConfig");
        Self { proxies, ..self }
    }

    pub fn with_under_mount(self, under: Arc<crate::adopt::UnderMount>) -> Self {
        Self {
            under_mount: Some(under),
            ..self
        }
    }

    /// Where a `local://` directory is read from: below the models root, through the handle on
    /// the directory underneath the mount (with OME's symlinks followed within the root); the
    /// path itself elsewhere.
    pub fn local_root(&self, path: &std::path::Path) -> Result<std::path::PathBuf, SourceError> {
        let Some(under) = &self.under_mount else {
            return Ok(path.to_path_buf());
        };
        let Some(rel) = under.relative_of(path) else {
            return Ok(path.to_path_buf());
        };
        match under.resolve(&rel) {
            Ok(real) => Ok(under.proc_path(&real)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(SourceError::LocalMissing {
                path: path.display().to_string(),
            }),
            Err(source) => Err(SourceError::LocalIo {
                path: path.display().to_string(),
                source,
            }),
        }
    }
}

/// A resolvable, fetchable source.
#[derive(Clone, Debug)]
pub enum Source {
    Local(local::LocalSource),
    Hf(hf::HfSource),
    Oci(oci::OciSource),
    Object(objstore::ObjectSource),
}

/// Local resolves (a walk and a hash of every file, on a blocking thread each) running at
/// once in the whole process. Unbounded, the models of a first start all resolved at once:
/// 1,000 `local://` models meant 512 blocking threads (tokio's limit), each a stack and a share
/// of the allocator's arenas that kept their memory after the import, for no speed on a few
/// cores (each resolve already hashes several files at once, see [`local`]). Fetches are
/// bounded by the reconciler (`--max-concurrent-fetches`).
static LOCAL_RESOLVES: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(4);

impl Source {
    /// Builds the source for a validated URI with the model's own token (if any; the source's
    /// default applies otherwise), `spec.storage.parameters` and the TensorRT-LLM shape filter
    /// (`oci://` only, as in OME; the planner sets no shape elsewhere). Schemes without an
    /// implementation are an error here, so such models fail at once with a reason instead of
    /// waiting.
    pub fn for_uri(
        uri: &SourceUri,
        config: &SourceConfig,
        token: Option<Token>,
        spec: &modelfs_ome::ModelSpec,
    ) -> Result<Self, SourceError> {
        let parameters = &spec.parameters;
        match uri {
            SourceUri::Local { path } => Ok(Source::Local(local::LocalSource::new(
                config.local_root(path)?,
            ))),
            SourceUri::HuggingFace { repo, revision } => Ok(Source::Hf(hf::HfSource::new(
                repo.clone(),
                revision.clone(),
                token,
                config.hf.clone(),
            ))),
            SourceUri::Oci {
                namespace,
                region,
                bucket,
                prefix,
            } => Ok(Source::Oci(
                oci::OciSource::new(
                    namespace.clone(),
                    region.clone(),
                    bucket.clone(),
                    prefix.clone(),
                    parameters,
                    token,
                    config.hf.clone(),
                    config.oci.clone(),
                )?
                .with_shape(spec.shape.clone()),
            )),
            SourceUri::ObjectStore {
                scheme,
                bucket,
                prefix,
                region,
                account,
                uri,
            } => Ok(Source::Object(objstore::ObjectSource::new(
                objstore::ObjectTarget {
                    scheme: *scheme,
                    bucket,
                    prefix,
                    region: region.as_deref(),
                    account: account.as_deref(),
                    uri: uri.clone(),
                },
                parameters,
                token,
                config,
            )?)),
            SourceUri::Unsupported { scheme, .. } => Err(SourceError::Unsupported {
                scheme: scheme.clone(),
            }),
        }
    }

    /// The same source, reporting its throttling waits to `observer`.
    pub fn observe_throttling(self, observer: ThrottleObserver) -> Self {
        match self {
            Source::Hf(s) => Source::Hf(s.with_throttle_observer(observer)),
            Source::Oci(s) => Source::Oci(s.with_throttle_observer(observer)),
            Source::Object(s) => Source::Object(s.with_throttle_observer(observer)),
            local @ Source::Local(_) => local,
        }
    }

    pub async fn resolve(&self, cancel: Arc<AtomicBool>) -> Result<Manifest, SourceError> {
        match self {
            Source::Local(s) => {
                let s = s.clone();
                // Waiting here holds no thread; the semaphore is never closed.
                let _permit = LOCAL_RESOLVES.acquire().await;
                tokio::task::spawn_blocking(move || s.resolve(&cancel))
                    .await
                    .unwrap_or_else(|e| Err(SourceError::from_join(e)))
            }
            // Boxed: a resolve's state is kilobytes and every model of a node's first desired
            // state has one at once; inline, each future would be the size of the largest.
            Source::Hf(s) => Box::pin(s.resolve(cancel)).await,
            Source::Oci(s) => Box::pin(s.resolve(cancel)).await,
            Source::Object(s) => Box::pin(s.resolve(cancel)).await,
        }
    }

    /// Fetches every entry the store lacks; returns the sha256 blob name of every entry, once
    /// the final verification (below) has found every one of them in the store.
    pub async fn fetch(
        &self,
        manifest: Arc<Manifest>,
        ctx: FetchContext,
    ) -> Result<Vec<Sha256Digest>, SourceError> {
        let digests = match self {
            Source::Local(s) => {
                let (s, manifest, ctx) = (s.clone(), manifest.clone(), ctx.clone());
                tokio::task::spawn_blocking(move || s.fetch(&manifest, &ctx))
                    .await
                    .unwrap_or_else(|e| Err(SourceError::from_join(e)))?
            }
            Source::Hf(s) => Box::pin(s.fetch(manifest.clone(), ctx.clone())).await?,
            Source::Oci(s) => Box::pin(s.fetch(manifest.clone(), ctx.clone())).await?,
            Source::Object(s) => Box::pin(s.fetch(manifest.clone(), ctx.clone())).await?,
        };
        let metrics = ctx.metrics.clone();
        tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            let verified = verify_fetched(&manifest, &digests, &ctx.store);
            metrics
                .ome
                .verification_duration
                .observe(started.elapsed().as_secs_f64());
            verified.map(|()| digests)
        })
        .await
        .unwrap_or_else(|e| Err(SourceError::from_join(e)))
    }
}

/// The final verification of a completed fetch, OME's "final integrity verification" pass:
/// every entry's blob is in the store with the manifest's size. Digests need no second read:
/// a blob is named by the sha256 of the bytes written into it, checked against the source's
/// digest as they were written. What this catches is a store changed underneath the fetch (a
/// blob removed or truncated by hand or by a bug) before the artifact is recorded and served.
fn verify_fetched(
    manifest: &Manifest,
    digests: &[Sha256Digest],
    store: &Store,
) -> Result<(), SourceError> {
    if digests.len() != manifest.len() {
        return Err(SourceError::Panicked {
            detail: format!(
                "a fetch returned {} blobs for {} manifest entries",
                digests.len(),
                manifest.len()
            ),
        });
    }
    for (entry, digest) in manifest.entries().zip(digests) {
        let path = store.blob_path(digest);
        let actual = match std::fs::metadata(&path) {
            Ok(m) if m.is_file() => m.len(),
            Ok(_) => 0,
            Err(e) => {
                return Err(SourceError::Store {
                    path: entry.path.to_string(),
                    source: StoreError::io(
                        format!("verifying {} after the fetch", path.display()),
                        e,
                    ),
                })
            }
        };
        if actual != entry.size {
            return Err(SourceError::Store {
                path: entry.path.to_string(),
                source: StoreError::SizeMismatch {
                    expected: entry.size,
                    actual,
                },
            });
        }
    }
    Ok(())
}

impl Source {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::DownloadOutcome;
    use modelfs_core::artifact::ManifestEntry;

    #[test]
    fn failures_count_in_omes_download_metrics_by_kind() {
        let status = |status: u16| TransferError::Status {
            what: "x".into(),
            status,
            code: None,
            message: String::new(),
            retry_after: None,
        };
        let mismatch = StoreError::DigestMismatch {
            expected: "a".into(),
            actual: "b".into(),
        };
        let cases: Vec<(SourceError, Option<DownloadOutcome>)> = vec![
            (SourceError::Cancelled, None),
            (SourceError::Transfer(TransferError::Cancelled), None),
            (
                SourceError::Transfer(TransferError::Exhausted {
                    attempts: 8,
                    last: Box::new(status(429)),
                }),
                Some(DownloadOutcome::RateLimited),
            ),
            (
                SourceError::Transfer(TransferError::Corrupt {
                    path: "w".into(),
                    attempts: 3,
                    detail: String::new(),
                }),
                Some(DownloadOutcome::VerificationFailed),
            ),
            (
                SourceError::Store {
                    path: "w".into(),
                    source: mismatch,
                },
                Some(DownloadOutcome::VerificationFailed),
            ),
            (
                SourceError::Transfer(status(403)),
                Some(DownloadOutcome::Failed),
            ),
            (
                SourceError::LocalMissing { path: "/x".into() },
                Some(DownloadOutcome::Failed),
            ),
        ];
        for (error, expected) in cases {
            assert_eq!(error.ome_outcome(), expected, "{error}");
        }
    }

    /// The final verification catches a store changed under a completed fetch: a blob gone or
    /// cut short is an error naming the file, and the intact store passes.
    #[test]
    fn final_verification_finds_missing_and_short_blobs() {
        use sha2::Digest;
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("s")).unwrap();
        let contents: [&[u8]; 2] = [b"first file", b"second, longer file"];
        let mut entries = Vec::new();
        let mut digests = Vec::new();
        for (i, bytes) in contents.iter().enumerate() {
            let sha: [u8; 32] = sha2::Sha256::digest(bytes).into();
            std::fs::write(store.blob_path(&Sha256Digest(sha)), bytes).unwrap();
            entries.push(ManifestEntry {
                path: format!("f{i}"),
                size: bytes.len() as u64,
                digest: FileDigest::Sha256(sha),
            });
            digests.push(Sha256Digest(sha));
        }
        let manifest = Manifest::new("r".into(), entries).unwrap();
        verify_fetched(&manifest, &digests, &store).unwrap();

        std::fs::write(store.blob_path(&digests[1]), b"second").unwrap();
        let short = verify_fetched(&manifest, &digests, &store).unwrap_err();
        assert!(
            matches!(
                &short,
                SourceError::Store { path, source: StoreError::SizeMismatch { expected: 19, actual: 6 } }
                    if path == "f1"
            ),
            "{short}"
        );
        assert_eq!(
            short.ome_outcome(),
            Some(crate::metrics::DownloadOutcome::VerificationFailed)
        );

        std::fs::remove_file(store.blob_path(&digests[0])).unwrap();
        let missing = verify_fetched(&manifest, &digests, &store).unwrap_err();
        assert!(
            matches!(&missing, SourceError::Store { path, .. } if path == "f0"),
            "{missing}"
        );
        assert!(
            missing.is_transient(),
            "a vanished blob is fetched again: {missing}"
        );
    }
}
