//! The reconciler's settings and its input, the desired set of models.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use crate::source::SourceConfig;
use modelfs_ome::{ModelKey, ModelSpec, MountPath};

#[derive(Clone, Debug)]
pub struct ReconcilerConfig {
    /// Host directory the mount sits on; status paths are reported below it.
    pub models_root_dir: PathBuf,
    /// How long a store with no users stays on disk before garbage collection removes it. Long
    /// enough that a quick delete-and-recreate of a model (a typo fixed in a manifest) does not
    /// re-download it.
    pub gc_grace: Duration,
    /// How often garbage collection and retries run.
    pub tick: Duration,
    /// Node-wide limit on concurrent fetches (each fetch already parallelises internally).
    pub max_concurrent_fetches: usize,
    /// First retry delay after a transient failure; doubles per attempt up to `retry_max`.
    pub retry_base: Duration,
    pub retry_max: Duration,
    /// Source settings shared by all models (Hugging Face endpoint, default token, tuning).
    pub sources: SourceConfig,
    /// Directory of the Hugging Face cache view below the mount (`None`: no view); see
    /// [`modelfs_mount::vfs::hf_cache`].
    pub hf_cache_dir: Option<MountPath>,
    /// How long a snapshot stays in the view after no model serves it.
    pub hf_cache_linger: Duration,
    /// How often a Ready model whose source can change under the same URI (an object-store
    /// prefix, a Hugging Face branch or tag) is resolved again; `None` (the default, as OME's
    /// agent, which reads a source only when the model object changes) never. See
    /// [`decide::Machine::with_refresh`].
    pub resolve_interval: Option<Duration>,
    /// Serve a model while it downloads: its listing at once, each file once it verified
    /// ([`progressive`]). On in standalone mode; off by default.
    pub serve_while_downloading: bool,
    /// `--disk-budget`: fetches that do not fit are not started (`None`: no admission; see
    /// [`crate::disk`]).
    pub disk_budget: Option<crate::disk::DiskBudget>,
}

/// [`ReconcilerConfig::max_concurrent_fetches`] unless configured.
pub const DEFAULT_MAX_CONCURRENT_FETCHES: usize = 4;

impl ReconcilerConfig {
    /// The defaults around `sources` (which has none: building its HTTP clients can fail, and
    /// that is the caller's error to report).
    pub fn new(sources: SourceConfig) -> Self {
        Self {
            models_root_dir: PathBuf::from("/mnt/models"),
            gc_grace: Duration::from_secs(300),
            tick: Duration::from_secs(1),
            max_concurrent_fetches: DEFAULT_MAX_CONCURRENT_FETCHES,
            retry_base: Duration::from_secs(2),
            retry_max: Duration::from_secs(300),
            sources,
            hf_cache_dir: None,
            hf_cache_linger: Duration::from_secs(300),
            resolve_interval: None,
            serve_while_downloading: false,
            disk_budget: Some(crate::disk::DiskBudget::default()),
        }
    }
}

/// The desired set of models.
#[derive(Clone, Debug, Default)]
pub struct DesiredState {
    /// Valid specs, or why an object with this key is invalid.
    pub models: BTreeMap<ModelKey, Result<ModelSpec, String>>,
    /// Problems that cannot be keyed by a model (an unparseable file): shown in the status
    /// under their own key.
    pub errors: BTreeMap<String, String>,
    /// Source credentials per model, resolved by the producer of the desired state (standalone:
    /// `spec.storage.parameters.token`; Kubernetes: the Secret named by `spec.storage.key`).
    /// A model without an entry uses the daemon's default token, if any.
    pub tokens: BTreeMap<ModelKey, crate::source::Token>,
}
