//! Writes the reconciler's status document to Kubernetes: the node ConfigMap (SPEC 6.1), the
//! node labels (SPEC 6.2) and Events on the model objects.
//!
//! # No lost updates
//! Other writers share both objects (OME's controllers, operators, a second agent during a
//! rollout). Every write is a read-modify-write of the latest object: read it, change only the
//! entries this daemon owns, write it back with the resourceVersion that was read, and on a
//! 409 Conflict start over from a fresh read. The ConfigMap is replaced (`PUT`); the Node is
//! merge-patched with its resourceVersion as a precondition (only the label map changes, so
//! a status or heartbeat update of the Node is never overwritten by a stale copy).
//!
//! Owned entries are the ones shaped like model keys (`clusterbasemodel.*`,
//! `*.basemodel.*` data keys; `models.ome.io/<model key>` labels) that this daemon wrote
//! ([`super::written`]; a key OME's agent wrote for a model modelfs serves becomes one when
//! modelfs writes its status), and those of model objects the producer hands over (a model
//! being deleted: OME's controller keeps its finalizer until no node ConfigMap has the key, so
//! the node's agent must remove it whoever wrote it). An owned entry for a model that is no
//! longer on this node (a deletion while the daemon was down, a model that stopped targeting
//! the node) is removed.
//! Everything else, model-shaped keys and labels added by hand or by another writer included,
//! is left exactly as read, as OME's agent leaves keys it does not handle.
//!
//! # Rate limit
//! A change of a model's state (status, parent, children, reason, ...) is written at once.
//! A change of download progress alone is written at most once per `progress_interval`
//! (default 30 s, as OME's agent; `--progress-interval-secs`): every ConfigMap write wakes
//! OME's BaseModel controllers, which then reconcile every model the ConfigMap names.
//!
//! # Deletion
//! A model that leaves the document while its object is being deleted (the producer keeps
//! the references of objects with a deletionTimestamp) gets a `Deleted` Event; its entry and
//! label are removed by the same read-modify-write as any other change.
//!
//! # Size
//! A ConfigMap's data holds at most 1 MiB (the API server refuses more with 422 `Invalid`).
//! The budget for this daemon's entries is that limit (less some slack) minus what other
//! writers keep in the same ConfigMap. Entries are written in the largest layout that fits,
//! the same for all of them:
//! 1. full: the whole status entry;
//! 2. minimal: OME's layout (name, status, config without the bulky
//!    `decodedModelConfiguration` / diffusion pipeline; no progress or local extras);
//! 3. bare: name and status only (the optional `config` detail is dropped; OME's controllers
//!    derive a model's per-node state from `status`);
//! 4. bare entries in key order while they fit; the others are left out (a bare entry is
//!    about 100 bytes even with long names, so some 10,000 models fit in bare form).
//!
//! Node labels (what OME schedules on) are written whatever happens to the ConfigMap. A change
//! of layout is logged and published as an Event on the Node (`NodeStatusTruncated` /
//! `NodeStatusComplete`), and each model whose entry is left out gets a Warning Event
//! `StatusNotRecorded`, once per change. The full status stays in `GET /v1/models`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Node, ObjectReference};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::Client;
use serde_json::json;

use super::names::{
    configmap_key, is_model_key_shape, is_model_label, node_label_key, MANAGED_BY_ANNOTATION,
    NODE_CONFIGMAP_LABEL, NODE_NAME_ANNOTATION, STATUS_CONFIGMAP_LABEL,
};
use super::producer::References;
use super::written::{Object, Written};
use crate::reconciler::ReconcilerHandle;
use modelfs_ome::status::{ModelStatus, StatusDoc};

/// Name this daemon reports as the ConfigMap's manager and as the Events' controller.
pub const MANAGER: &str = "modelfs";

#[derive(Clone, Debug)]
pub struct StatusSinkConfig {
    pub node_name: String,
    /// Namespace of the node ConfigMaps (OME's default is `ome`).
    pub namespace: String,
    /// Minimum time between two writes that change only download progress.
    pub progress_interval: Duration,
    /// How often the objects are re-checked without a status change (repairs a deleted
    /// ConfigMap or label).
    pub resync: Duration,
    /// First delay after a failed write; doubles up to `retry_max`.
    pub retry_base: Duration,
    pub retry_max: Duration,
    /// Largest ConfigMap data (keys and values of `data` and `binaryData`, this daemon's
    /// entries and everyone else's): the API server's validation limit, 1 MiB.
    pub max_data_bytes: usize,
    /// Where the keys and labels this daemon wrote are kept ([`super::written`]); `None`:
    /// in memory only.
    pub written_file: Option<std::path::PathBuf>,
}

impl StatusSinkConfig {
    pub fn new(node_name: String, namespace: String) -> Self {
        Self {
            node_name,
            namespace,
            progress_interval: DEFAULT_PROGRESS_INTERVAL,
            resync: Duration::from_secs(60),
            retry_base: Duration::from_millis(200),
            retry_max: Duration::from_secs(30),
            max_data_bytes: 1024 * 1024,
            written_file: None,
        }
    }
}

/// How often progress alone is written, as OME's agent (`progressThrottle`).
pub const DEFAULT_PROGRESS_INTERVAL: Duration = Duration::from_secs(30);

/// Why a status write failed.
#[derive(Debug, thiserror::Error)]
pub enum StatusSinkError {
    #[error("Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    #[error("gave up after {0} conflicting writes in a row")]
    TooManyConflicts(u32),
    #[error("encoding a status entry: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("recording the keys written: {0}")]
    Record(#[from] std::io::Error),
}

/// Conflicts tolerated in one write before backing off: each retry re-reads, so only a
/// writer that changes the object continuously can exhaust this.
const MAX_CONFLICT_RETRIES: u32 = 20;

/// The state-relevant part of an entry (everything but progress and byte counts). The
/// reason of a model that is `Ready` while it downloads counts its verified files: progress
/// too, written no more often than the rest of it (only that it downloads is significant,
/// so its completion is written at once).
fn significant(entry: &ModelStatus) -> ModelStatus {
    let downloading = entry.status == "Ready" && entry.progress.is_some();
    ModelStatus {
        progress: None,
        bytes_on_disk: 0,
        reason: if downloading {
            Some("served while downloading".into())
        } else {
            entry.reason.clone()
        },
        ..entry.clone()
    }
}

fn significant_doc(doc: &StatusDoc) -> BTreeMap<&String, ModelStatus> {
    doc.iter()
        .filter(|(key, _)| modelfs_ome::key_parts(key).is_some())
        .map(|(key, entry)| (key, significant(entry)))
        .collect()
}

/// How much of each owned entry the node ConfigMap holds (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Layout {
    Full,
    Minimal,
    Bare,
}

/// The data entries and labels one status document asks for.
struct Wanted {
    /// Per data key: the entry in the full, minimal and bare layouts.
    entries: BTreeMap<String, [String; 3]>,
    labels: BTreeMap<String, String>,
}

/// The data this daemon writes, fitted to a byte budget.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Fitted {
    data: BTreeMap<String, String>,
    layout: Layout,
    /// Data keys left out because not even their bare entries fit.
    omitted: Vec<String>,
}

fn wanted(doc: &StatusDoc) -> Result<Wanted, serde_json::Error> {
    let mut entries = BTreeMap::new();
    let mut labels = BTreeMap::new();
    for (key, entry) in doc {
        let Some((kind, namespace, name)) = modelfs_ome::key_parts(key) else {
            continue;
        };
        let data_key = configmap_key(kind, namespace, name);
        // The minimal layout also leaves out the bulky config-derived objects (OME's
        // controllers read the artifact and the short fields).
        let mut config = entry.config.clone();
        config.decoded_model_configuration = None;
        config.diffusion_pipeline = None;
        let full = serde_json::to_string(entry)?;
        let minimal = serde_json::to_string(&json!({
            "name": entry.name, "status": entry.status, "config": config
        }))?;
        let bare = serde_json::to_string(&json!({"name": entry.name, "status": entry.status}))?;
        entries.insert(data_key, [full, minimal, bare]);
        labels.insert(node_label_key(kind, namespace, name), entry.status.clone());
    }
    Ok(Wanted { entries, labels })
}

/// The largest layout whose entries all fit in `budget` bytes (keys plus values, as the API
/// server counts); if not even the bare one does, bare entries in key order while they fit.
fn fit(entries: &BTreeMap<String, [String; 3]>, budget: usize) -> Fitted {
    for (index, layout) in [Layout::Full, Layout::Minimal, Layout::Bare]
        .into_iter()
        .enumerate()
    {
        let size: usize = entries.iter().map(|(k, v)| k.len() + v[index].len()).sum();
        if size <= budget {
            return Fitted {
                data: entries
                    .iter()
                    .map(|(k, v)| (k.clone(), v[index].clone()))
                    .collect(),
                layout,
                omitted: Vec::new(),
            };
        }
    }
    let mut data = BTreeMap::new();
    let mut omitted = Vec::new();
    let mut used = 0;
    for (key, layouts) in entries {
        let size = key.len() + layouts[2].len();
        if used + size <= budget {
            used += size;
            data.insert(key.clone(), layouts[2].clone());
        } else {
            omitted.push(key.clone());
        }
    }
    Fitted {
        data,
        layout: Layout::Bare,
        omitted,
    }
}

/// Bytes of a ConfigMap's data that this daemon does not own (other writers' entries).
fn foreign_bytes(configmap: &ConfigMap) -> usize {
    let data: usize = configmap
        .data
        .iter()
        .flatten()
        .filter(|(key, _)| !is_model_key_shape(key))
        .map(|(key, value)| key.len() + value.len())
        .sum();
    let binary: usize = configmap
        .binary_data
        .iter()
        .flatten()
        .map(|(key, value)| key.len() + value.0.len())
        .sum();
    data + binary
}

/// Runs the writer until the task is aborted.
pub fn spawn(
    client: Client,
    config: StatusSinkConfig,
    reconciler: ReconcilerHandle,
    references: References,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(run(client, config, reconciler, references))
}

async fn run(
    client: Client,
    config: StatusSinkConfig,
    reconciler: ReconcilerHandle,
    references: References,
) {
    let mut changes = reconciler.subscribe_status();
    // Transitions are relative to what the records held at start: a model that was Ready
    // before a restart gets no new Ready Event, one that fails on the first pass gets its
    // Failed Event.
    let mut seen: Arc<StatusDoc> = changes.borrow_and_update().clone();
    // Until the first desired state is reconciled, the document holds only what the records
    // remembered; writing it would remove entries of models that are about to come back.
    while !reconciler.is_ready() {
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    let written = Written::load(config.written_file.clone()).unwrap_or_else(|error| {
        tracing::error!(%error, "cannot read which status keys this daemon wrote; no model-shaped key or label written before is removed");
        Written::empty(config.written_file.clone())
    });
    let writer = Writer {
        configmaps: Api::namespaced(client.clone(), &config.namespace),
        nodes: Api::all(client.clone()),
        config: config.clone(),
        written: std::sync::Mutex::new(written),
        references: references.clone(),
    };
    let events = EventPublisher {
        recorder: Recorder::new(
            client,
            Reporter {
                controller: MANAGER.to_owned(),
                instance: Some(format!("{MANAGER}-{}", config.node_name)),
            },
        ),
        references,
    };
    let mut written: Option<Arc<StatusDoc>> = None;
    let mut last_write = Instant::now() - config.progress_interval;
    let mut failures: u32 = 0;
    // The layout and omitted keys last reported (Events go out when they change).
    let mut reported: (Layout, Vec<String>) = (Layout::Full, Vec::new());
    loop {
        let doc = changes.borrow_and_update().clone();
        events.publish_transitions(&seen, &doc);
        seen = doc.clone();

        let state_changed = written
            .as_ref()
            .is_none_or(|w| significant_doc(w) != significant_doc(&doc));
        let anything_changed = written.as_ref().is_none_or(|w| **w != *doc);
        let due = last_write + config.progress_interval;
        let wait_until = if state_changed || (anything_changed && Instant::now() >= due) {
            match writer.sync(&doc).await {
                Ok(fitted) => {
                    events.publish_fit(&config.node_name, &reported, &fitted);
                    reported = (fitted.layout, fitted.omitted);
                    written = Some(doc);
                    last_write = Instant::now();
                    failures = 0;
                    Instant::now() + config.resync
                }
                Err(error) => {
                    failures = failures.saturating_add(1);
                    let delay = config
                        .retry_base
                        .saturating_mul(1 << failures.min(16))
                        .min(config.retry_max);
                    tracing::warn!(%error, retry_in = ?delay, "writing node status failed");
                    Instant::now() + delay
                }
            }
        } else if anything_changed {
            due
        } else {
            Instant::now() + config.resync
        };
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep_until(wait_until.into()) => {
                // Periodic resync or retry: force a full check of both objects.
                if failures > 0 || written.as_ref().is_some_and(|w| **w == **changes.borrow()) {
                    written = None;
                }
            }
        }
    }
}

struct Writer {
    configmaps: Api<ConfigMap>,
    nodes: Api<Node>,
    config: StatusSinkConfig,
    /// Never held across an await.
    written: std::sync::Mutex<Written>,
    /// The model objects the producer planned (targeted or being deleted).
    references: References,
}

fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

impl Writer {
    fn lock_written(&self) -> std::sync::MutexGuard<'_, Written> {
        self.written.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The ConfigMap keys and node labels of the model objects the producer planned.
    fn planned_keys(&self) -> (BTreeSet<String>, BTreeSet<String>) {
        let references = self.references.lock().unwrap_or_else(|e| e.into_inner());
        references
            .keys()
            .map(|key| {
                let (kind, namespace, name) = key.parts();
                (
                    configmap_key(kind, namespace, name),
                    node_label_key(kind, namespace, name),
                )
            })
            .unzip()
    }

    /// Writes both objects; the labels (what OME schedules on) also when the ConfigMap write
    /// fails. Returns how the ConfigMap entries were fitted.
    async fn sync(&self, doc: &StatusDoc) -> Result<Fitted, StatusSinkError> {
        let wanted = wanted(doc)?;
        let configmap = self.sync_configmap(&wanted.entries).await;
        let labels = self.sync_labels(&wanted.labels).await;
        let fitted = configmap?;
        labels?;
        Ok(fitted)
    }

    async fn sync_configmap(
        &self,
        entries: &BTreeMap<String, [String; 3]>,
    ) -> Result<Fitted, StatusSinkError> {
        let name = &self.config.node_name;
        for _ in 0..MAX_CONFLICT_RETRIES {
            let current = self.configmaps.get_opt(name).await?;
            let budget = self
                .config
                .max_data_bytes
                .saturating_sub(current.as_ref().map_or(0, foreign_bytes));
            let fitted = fit(entries, budget);
            let data = &fitted.data;
            self.lock_written().record(Object::ConfigMap, data.keys())?;
            let mut removed = Vec::new();
            let result = match current {
                None => {
                    let mut configmap = ConfigMap::default();
                    configmap.metadata.name = Some(name.clone());
                    configmap.metadata.namespace = Some(self.config.namespace.clone());
                    configmap.metadata.labels = Some(
                        [
                            (STATUS_CONFIGMAP_LABEL.to_owned(), "true".to_owned()),
                            (NODE_CONFIGMAP_LABEL.to_owned(), name.clone()),
                        ]
                        .into(),
                    );
                    configmap.metadata.annotations = Some(
                        [
                            (NODE_NAME_ANNOTATION.to_owned(), name.clone()),
                            (MANAGED_BY_ANNOTATION.to_owned(), MANAGER.to_owned()),
                        ]
                        .into(),
                    );
                    configmap.data = Some(data.clone());
                    self.configmaps
                        .create(&PostParams::default(), &configmap)
                        .await
                        .map(drop)
                }
                Some(mut configmap) => {
                    let mut changed = false;
                    let labels = configmap.metadata.labels.get_or_insert_with(BTreeMap::new);
                    for (key, value) in [
                        (STATUS_CONFIGMAP_LABEL, "true"),
                        (NODE_CONFIGMAP_LABEL, name.as_str()),
                    ] {
                        if labels.get(key).map(String::as_str) != Some(value) {
                            labels.insert(key.to_owned(), value.to_owned());
                            changed = true;
                        }
                    }
                    let current = configmap.data.get_or_insert_with(BTreeMap::new);
                    let (planned, _) = self.planned_keys();
                    let stale: Vec<String> = {
                        let written = self.lock_written();
                        current
                            .keys()
                            .filter(|key| {
                                is_model_key_shape(key)
                                    && !data.contains_key(*key)
                                    && (written.contains(Object::ConfigMap, key)
                                        || planned.contains(*key))
                            })
                            .cloned()
                            .collect()
                    };
                    for key in &stale {
                        current.remove(key);
                        changed = true;
                    }
                    removed = stale;
                    for (key, value) in data {
                        if current.get(key) != Some(value) {
                            current.insert(key.clone(), value.clone());
                            changed = true;
                        }
                    }
                    if !changed {
                        return Ok(fitted);
                    }
                    self.configmaps
                        .replace(name, &PostParams::default(), &configmap)
                        .await
                        .map(drop)
                }
            };
            match result {
                Ok(()) => {
                    self.lock_written().forget(Object::ConfigMap, &removed)?;
                    return Ok(fitted);
                }
                // 409 is both "modified since read" and "created meanwhile": re-read.
                Err(error) if is_conflict(&error) => {
                    tracing::debug!("node ConfigMap changed concurrently; retrying");
                }
                Err(error) => return Err(error.into()),
            }
        }
        Err(StatusSinkError::TooManyConflicts(MAX_CONFLICT_RETRIES))
    }

    async fn sync_labels(&self, labels: &BTreeMap<String, String>) -> Result<(), StatusSinkError> {
        let name = &self.config.node_name;
        for _ in 0..MAX_CONFLICT_RETRIES {
            let Some(node) = self.nodes.get_opt(name).await? else {
                tracing::warn!(node = %name, "Node object not found; labels not written");
                return Ok(());
            };
            let current = node.metadata.labels.clone().unwrap_or_default();
            let mut patch = serde_json::Map::new();
            let ours: BTreeSet<&String> = labels.keys().collect();
            let mut removed = Vec::new();
            let (_, planned) = self.planned_keys();
            {
                let written = self.lock_written();
                for key in current.keys() {
                    if is_model_label(key)
                        && !ours.contains(key)
                        && (written.contains(Object::NodeLabels, key) || planned.contains(key))
                    {
                        patch.insert(key.clone(), serde_json::Value::Null);
                        removed.push(key.clone());
                    }
                }
            }
            for (key, value) in labels {
                if current.get(key) != Some(value) {
                    patch.insert(key.clone(), json!(value));
                }
            }
            if patch.is_empty() {
                return Ok(());
            }
            self.lock_written()
                .record(Object::NodeLabels, labels.keys())?;
            let body = json!({"metadata": {
                "resourceVersion": node.metadata.resource_version,
                "labels": patch,
            }});
            match self
                .nodes
                .patch(name, &PatchParams::default(), &Patch::Merge(&body))
                .await
            {
                Ok(_) => {
                    self.lock_written().forget(Object::NodeLabels, &removed)?;
                    return Ok(());
                }
                Err(error) if is_conflict(&error) => {
                    tracing::debug!("Node changed concurrently; retrying");
                }
                Err(error) => return Err(error.into()),
            }
        }
        Err(StatusSinkError::TooManyConflicts(MAX_CONFLICT_RETRIES))
    }
}

/// Publishes Events for state transitions of the models.
struct EventPublisher {
    recorder: Recorder,
    references: References,
}

/// The Event a transition of one model deserves, if any.
fn transition_event(before: Option<&ModelStatus>, after: &ModelStatus) -> Option<Event> {
    let event = |type_, reason: &str, note: String| Event {
        type_,
        reason: reason.to_owned(),
        note: Some(note.chars().take(1000).collect()),
        action: "Reconcile".to_owned(),
        secondary: None,
    };
    let was = before.map(|b| b.status.as_str());
    match after.status.as_str() {
        "Ready" if was != Some("Ready") => Some(event(
            EventType::Normal,
            "Ready",
            format!("model is served at {}", after.path),
        )),
        "Ready" => {
            let before = before?;
            if before.parent() != after.parent() || before.policy != after.policy {
                let parent = after.parent().unwrap_or_default();
                Some(event(
                    EventType::Normal,
                    "PolicyApplied",
                    format!(
                        "downloadPolicy {}: served from the copy of {parent}",
                        after.policy
                    ),
                ))
            } else {
                None
            }
        }
        "Failed"
            if was != Some("Failed") || before.and_then(|b| b.reason.clone()) != after.reason =>
        {
            let note = after
                .reason
                .clone()
                .unwrap_or_else(|| "unknown reason".to_owned());
            // A fetch refused for space (SPEC 12) says so in the Event's reason, so that
            // `kubectl get events --field-selector reason=InsufficientStorage` finds them.
            let reason = if note.starts_with("InsufficientStorage:") {
                "InsufficientStorage"
            } else {
                "Failed"
            };
            Some(event(EventType::Warning, reason, note))
        }
        _ => None,
    }
}

impl EventPublisher {
    fn publish_transitions(&self, before: &StatusDoc, after: &StatusDoc) {
        let references = self
            .references
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for (key, entry) in after {
            let Some(event) = transition_event(before.get(key).map(|e| &**e), entry) else {
                continue;
            };
            let Some(reference) = references
                .iter()
                .find(|(model, _)| model.as_str() == key)
                .map(|(_, reference)| reference.clone())
            else {
                continue;
            };
            self.publish(event, reference, key.clone());
        }
        // Models that left the document while their object still exists (being deleted).
        for (key, entry) in before {
            if after.contains_key(key) || modelfs_ome::key_parts(key).is_none() {
                continue;
            }
            let Some(reference) = references
                .iter()
                .find(|(model, _)| model.as_str() == key)
                .map(|(_, reference)| reference.clone())
            else {
                continue;
            };
            self.publish(removal_event(entry), reference, key.clone());
        }
    }

    /// Reports a change of how the node ConfigMap holds the entries (see the module docs):
    /// a log line and an Event on the Node, and a Warning Event on each model whose entry is
    /// newly left out.
    fn publish_fit(&self, node: &str, before: &(Layout, Vec<String>), now: &Fitted) {
        if (before.0, &before.1) == (now.layout, &now.omitted) {
            return;
        }
        let node_reference = ObjectReference {
            api_version: Some("v1".to_owned()),
            kind: Some("Node".to_owned()),
            name: Some(node.to_owned()),
            ..Default::default()
        };
        let (type_, reason, note) =
            match (now.layout, now.omitted.len()) {
                (Layout::Full, _) => (
                    EventType::Normal,
                    "NodeStatusComplete",
                    "the node ConfigMap holds every model's full status entry again".to_owned(),
                ),
                (layout, 0) => {
                    (
                        EventType::Warning,
                        "NodeStatusTruncated",
                        format!(
                    "model entries exceed the node ConfigMap's 1 MiB limit: written in the {} \
                     layout ({}); GET /v1/models has the full status",
                    if layout == Layout::Minimal { "minimal" } else { "bare" },
                    if layout == Layout::Minimal {
                        "no decoded model configuration, progress or local fields"
                    } else {
                        "name and status only"
                    }
                ),
                    )
                }
                (_, omitted) => (
                    EventType::Warning,
                    "NodeStatusTruncated",
                    format!(
                        "model entries exceed the node ConfigMap's 1 MiB limit even as name and \
                     status only: {omitted} models are left out (first: {}); their node \
                     labels are still written",
                        now.omitted[0]
                    ),
                ),
            };
        if type_ == EventType::Warning {
            tracing::warn!(
                layout = ?now.layout,
                omitted = now.omitted.len(),
                "node ConfigMap budget exceeded: {note}"
            );
        } else {
            tracing::info!("{note}");
        }
        self.publish(
            Event {
                type_,
                reason: reason.to_owned(),
                note: Some(note.chars().take(1000).collect()),
                action: "Report".to_owned(),
                secondary: None,
            },
            node_reference,
            format!("node {node}"),
        );
        let references = self
            .references
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for key in now.omitted.iter().filter(|k| !before.1.contains(k)) {
            let Some(reference) = references
                .iter()
                .find(|(model, _)| {
                    configmap_key_of(model.as_str()).as_deref() == Some(key.as_str())
                })
                .map(|(_, reference)| reference.clone())
            else {
                continue;
            };
            self.publish(
                Event {
                    type_: EventType::Warning,
                    reason: "StatusNotRecorded".to_owned(),
                    note: Some(format!(
                        "the node ConfigMap {node} is full (1 MiB): this model's entry is left \
                         out; its node label and GET /v1/models carry its status"
                    )),
                    action: "Report".to_owned(),
                    secondary: None,
                },
                reference,
                key.clone(),
            );
        }
    }

    fn publish(&self, event: Event, reference: ObjectReference, key: String) {
        let recorder = self.recorder.clone();
        tokio::spawn(async move {
            if let Err(error) = recorder.publish(&event, &reference).await {
                tracing::warn!(model = %key, %error, "publishing an Event failed");
            }
        });
    }
}

/// The node ConfigMap data key of a model key.
fn configmap_key_of(model_key: &str) -> Option<String> {
    let (kind, namespace, name) = modelfs_ome::key_parts(model_key)?;
    Some(configmap_key(kind, namespace, name))
}

/// The Event of a model removed from this node because its object is being deleted.
fn removal_event(before: &ModelStatus) -> Event {
    Event {
        type_: EventType::Normal,
        reason: "Deleted".to_owned(),
        note: Some(
            format!(
                "object is being deleted: no longer served at {}; its node ConfigMap entry and \
                 node label are removed",
                before.path
            )
            .chars()
            .take(1000)
            .collect(),
        ),
        action: "Delete".to_owned(),
        secondary: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(status: &str, parent: &str, policy: &str) -> ModelStatus {
        let mut e = ModelStatus {
            name: "m".into(),
            status: status.into(),
            policy: policy.into(),
            path: "/mnt/models/m".into(),
            ..Default::default()
        };
        if !parent.is_empty() {
            e.config
                .artifact
                .parent_path
                .insert(parent.into(), "/p".into());
        }
        e
    }

    #[test]
    fn transitions_that_deserve_events() {
        let ready = entry("Ready", "clusterbasemodel.m", "AlwaysDownload");
        let updating = entry("Updating", "", "AlwaysDownload");
        assert_eq!(
            transition_event(Some(&updating), &ready).unwrap().reason,
            "Ready"
        );
        assert_eq!(transition_event(None, &ready).unwrap().reason, "Ready");
        assert!(transition_event(Some(&ready), &ready).is_none());
        let flipped = entry("Ready", "clusterbasemodel.other", "ReuseIfExists");
        let event = transition_event(Some(&ready), &flipped).unwrap();
        assert_eq!(event.reason, "PolicyApplied");
        assert!(event.note.unwrap().contains("clusterbasemodel.other"));
        let mut failed = entry("Failed", "", "AlwaysDownload");
        failed.reason = Some("no access".into());
        let event = transition_event(Some(&updating), &failed).unwrap();
        assert_eq!(event.type_, EventType::Warning);
        assert_eq!(event.note.as_deref(), Some("no access"));
        assert!(transition_event(Some(&failed), &failed).is_none());
        assert!(transition_event(Some(&ready), &updating).is_none());
        let mut full = entry("Failed", "", "AlwaysDownload");
        full.reason =
            Some("InsufficientStorage: needs 412 GiB, 120 GiB free under the budget".into());
        let event = transition_event(Some(&updating), &full).unwrap();
        assert_eq!(event.reason, "InsufficientStorage");
        assert_eq!(event.type_, EventType::Warning);
        assert!(event.note.unwrap().contains("needs 412 GiB"));
    }

    #[test]
    fn progress_is_written_every_30_seconds_by_default_as_ome() {
        let config = StatusSinkConfig::new("n".into(), "ome".into());
        assert_eq!(config.progress_interval, Duration::from_secs(30));
    }

    #[test]
    fn removal_event_names_the_path() {
        let event = removal_event(&entry("Ready", "", "AlwaysDownload"));
        assert_eq!(event.reason, "Deleted");
        assert_eq!(event.type_, EventType::Normal);
        assert!(event.note.unwrap().contains("/mnt/models/m"));
    }

    #[test]
    fn wanted_maps_keys_and_skips_non_models() {
        let mut doc = StatusDoc::new();
        let mut ready = entry("Ready", "", "AlwaysDownload");
        ready.config.model_type = "llama".into();
        ready.config.decoded_model_configuration = Some(Arc::new(json!({"model_type": "llama"})));
        doc.insert("team.basemodel.m".into(), Arc::new(ready));
        doc.insert("file:broken.yaml".into(), Arc::new(entry("Failed", "", "")));
        let long = format!("clusterbasemodel.{}", "x".repeat(60));
        doc.insert(
            long.clone(),
            Arc::new(entry("Updating", "", "AlwaysDownload")),
        );
        let w = wanted(&doc).unwrap();
        let full = fit(&w.entries, 1 << 20);
        assert_eq!((full.layout, full.omitted.len()), (Layout::Full, 0));
        assert_eq!(full.data.len(), 2);
        assert!(full.data.contains_key("team.basemodel.m"));
        assert!(full.data.contains_key(&long));
        assert_eq!(w.labels["models.ome.io/team.basemodel.m"], "Ready");
        assert_eq!(w.labels.len(), 2);
        assert!(w
            .labels
            .keys()
            .all(|k| k.len() - "models.ome.io/".len() <= 49));
        let size = |layout: usize| -> usize {
            w.entries
                .iter()
                .map(|(k, v)| k.len() + v[layout].len())
                .sum()
        };
        // Over budget: the minimal layout.
        let minimal = fit(&w.entries, size(1));
        assert_eq!(minimal.layout, Layout::Minimal);
        let value: serde_json::Value =
            serde_json::from_str(&minimal.data["team.basemodel.m"]).unwrap();
        assert_eq!(
            value.as_object().unwrap().keys().collect::<Vec<_>>(),
            vec!["config", "name", "status"]
        );
        assert_eq!(value["config"]["modelType"], "llama");
        assert!(value["config"].get("decodedModelConfiguration").is_none());
        // Further: name and status only.
        let bare = fit(&w.entries, size(1) - 1);
        assert_eq!((bare.layout, bare.omitted.len()), (Layout::Bare, 0));
        let value: serde_json::Value =
            serde_json::from_str(&bare.data["team.basemodel.m"]).unwrap();
        assert_eq!(value, json!({"name": "m", "status": "Ready"}));
        // Not even that: entries in key order while they fit, the rest left out.
        let partial = fit(&w.entries, size(2) - 1);
        assert_eq!(partial.layout, Layout::Bare);
        assert_eq!(partial.data.keys().collect::<Vec<_>>(), vec![&long]);
        assert_eq!(partial.omitted, vec!["team.basemodel.m".to_owned()]);
        assert!(fit(&w.entries, 0).data.is_empty());
    }

    /// 10,000 Ready models with OME-length names and a parent each: how large each layout
    /// is, and that the bare one fits in the 1 MiB a ConfigMap holds (so no model is left out
    /// at that scale). `--nocapture` prints the sizes.
    #[test]
    fn ten_thousand_models_fit_in_the_configmap_in_some_layout() {
        let mut doc = StatusDoc::new();
        for i in 0..10_000 {
            let key = format!("team-{:02}.basemodel.llama-3-1-8b-instruct-{i:05}", i % 50);
            let mut e = entry("Ready", &key, "AlwaysDownload");
            e.name = format!("llama-3-1-8b-instruct-{i:05}");
            e.path = format!("/mnt/models/team-{:02}/{}", i % 50, e.name);
            e.config.artifact.sha = "a".repeat(40);
            e.config.model_type = "llama".into();
            e.config.model_architecture = "LlamaForCausalLM".into();
            doc.insert(key, Arc::new(e));
        }
        let w = wanted(&doc).unwrap();
        let sizes: Vec<usize> = (0..3)
            .map(|layout| {
                w.entries
                    .iter()
                    .map(|(k, v)| k.len() + v[layout].len())
                    .sum()
            })
            .collect();
        println!(
            "10,000 models: full {} B, minimal {} B, bare {} B",
            sizes[0], sizes[1], sizes[2]
        );
        let budget = StatusSinkConfig::new("n".into(), "ome".into()).max_data_bytes;
        assert!(sizes[1] > budget, "the scenario needs a truncated layout");
        let fitted = fit(&w.entries, budget);
        assert_eq!((fitted.layout, fitted.omitted.len()), (Layout::Bare, 0));
        assert_eq!(fitted.data.len(), 10_000);
    }
}
