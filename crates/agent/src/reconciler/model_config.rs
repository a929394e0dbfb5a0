//! Config parsing per artifact (see [`modelfs_ome::modelconfig`]).
//!
//! The fields OME derives from `config.json` depend only on an artifact's bytes, so they are
//! computed once per artifact, the first time a model is served from it complete and verified,
//! and kept beside the artifact record (`artifacts/<id>.modelconfig.json`): a restart, a policy
//! flip or a second model of the same artifact reads them back instead of parsing again. The
//! parse reads the blobs in the store (a few KiB of JSON plus the safetensors headers), never
//! the network, and runs off the actor on a blocking thread.
//!
//! Whether a model shows them is per model: the skip annotation hides them (status and spec
//! back-fill), as in OME. A missing or broken config never fails a model: its status carries
//! `configWarning`, and the reason is logged once, when the artifact is parsed.
//!
//! # Models read in place
//! A `local://` model whose directory lies outside the models root ([`ModelSpec::node_dir`])
//! has no artifact: nothing is imported or served, the pod binds the directory itself. As
//! OME's agent does (`processLocalStorageModel`), its config is parsed from that directory,
//! with the same parser, once the directory is known to exist (the model is `Ready`; a
//! missing directory fails the model before this). The read is an import's, minus the copy
//! ([`LocalSource::config_files`]): no symlink is followed out of the directory, nothing
//! blocks on a special file, and the parser bounds how much it reads. Its result is kept per
//! model, not per artifact (the files can change under it), and is not cached on disk.
//!
//! The directory is read again when the model is decided again (its object changed in a way
//! that matters, it was retried, or the daemon started) and, with `--resolve-interval-secs`,
//! each time that interval has passed, as other sources whose content may change are
//! re-resolved: a `config.json` edited in place shows in the entry then. Until a new result
//! arrives the entry keeps the previous one. A result that differs from the previous one is
//! logged (a warning when no fields could be derived), so an unreadable directory is logged
//! once per model, not once per read. In the shipped deploy the agent's pod sees only the
//! models root and the state directory: a directory outside them must be mounted into the
//! agent's pod at the same path, or the model is `Failed` as missing, as OME's agent would
//! report it from its own pod (deploy/MIGRATION.md).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::{Event, Reconciler};
use crate::source::local::LocalSource;
use modelfs_core::artifact::ArtifactId;
use modelfs_ome::model::ModelSpec;
use modelfs_ome::modelconfig::{derive, Outcome, PathFiles};
use modelfs_ome::status::ModelStatus;
use modelfs_ome::{ModelKey, SourceUri};

/// Bumped when the derivation changes, so that cached results are recomputed.
const PARSER_VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct CachedOutcome {
    parser: u32,
    outcome: Outcome,
}

/// The config of a model read in place (see the module docs), by model.
pub(super) struct NodeDirConfig {
    /// The directory it was read from (a changed path is a new read).
    dir: PathBuf,
    /// Bumped by every read started: a result of an older read is dropped.
    generation: u64,
    /// When the latest read was started.
    started: Instant,
    /// A read is running.
    pending: bool,
    /// The model was decided again since the latest read started: read again.
    stale: bool,
    /// The latest result (kept while a newer read runs).
    outcome: Option<Arc<Outcome>>,
}

/// The directory a model's config is read from in place: a `local://` model's directory
/// outside the models root.
fn node_dir(spec: &ModelSpec) -> Option<&Path> {
    match (&spec.node_dir, &spec.source) {
        (Some(dir), SourceUri::Local { .. }) => Some(dir),
        _ => None,
    }
}

/// Parses the config of the directory `dir` in place. Never fails: a directory that cannot be
/// listed is a broken config (with the reason), as OME's agent logs a failed parse and keeps
/// the model.
fn read_in_place(dir: &Path) -> Outcome {
    let cancel = AtomicBool::new(false);
    match LocalSource::new(dir.to_path_buf()).config_files(&cancel) {
        Ok(files) => derive(&files),
        Err(e) => Outcome::Broken(e.to_string()),
    }
}

/// Config parses running at once. The artifacts of a whole import become served in one pass,
/// and a blocking thread each (tokio starts up to 512) kept their stacks and allocator caches
/// resident after the import, for no speed on a few cores.
static CONFIG_PARSES: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// Runs `parse` on a blocking thread, within [`CONFIG_PARSES`]. A parser panic is a bug:
/// reported as the config's problem (a warning on the model, logged), never a parse that stays
/// pending forever.
async fn parse_off_thread(parse: impl FnOnce() -> Outcome + Send + 'static) -> Outcome {
    // Waiting here holds no thread; the semaphore is never closed.
    let _permit = CONFIG_PARSES.acquire().await;
    let parsed = tokio::task::spawn_blocking(move || {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(parse)).unwrap_or_else(|panic| {
            Outcome::Broken(
                crate::source::SourceError::from_panic(panic)
                    .to_string()
                    .replace("a worker", "the config parser"),
            )
        })
    })
    .await;
    parsed.unwrap_or_else(|e| Outcome::Broken(format!("the config parser did not finish: {e}")))
}

impl Reconciler {
    /// Starts a parse for every served artifact that has no result yet (loading the cached one
    /// when there is), and the reads in place that are due.
    pub(super) fn request_model_configs(&mut self) {
        self.request_node_dir_configs();
        let wanted: Vec<(ArtifactId, modelfs_core::store::StoreId)> = self
            .core
            .records
            .models()
            .values()
            .filter_map(|r| Some((r.artifact.clone()?, r.store.clone()?)))
            .filter(|(a, _)| {
                !self.known.model_configs.contains_key(a)
                    && !self.known.model_configs_pending.contains(a)
            })
            .collect();
        for (id, store) in wanted {
            if self.known.model_configs_pending.contains(&id)
                || self.known.model_configs.contains_key(&id)
            {
                continue;
            }
            let cached = self
                .state
                .load_model_config(&id)
                .and_then(|b| serde_json::from_slice::<CachedOutcome>(&b).ok())
                .filter(|c| c.parser == PARSER_VERSION);
            if let Some(c) = cached {
                self.known.model_configs.insert(id, Arc::new(c.outcome));
                continue;
            }
            let Some(stored) = self.artifact(&id) else {
                continue;
            };
            if stored.manifest.is_empty() {
                // Nothing to parse (a source with no files): no fields and no warning.
                continue;
            }
            let Some(handle) = self.state.existing_store(&store) else {
                continue;
            };
            let files = PathFiles(
                stored
                    .files()
                    .map(|(entry, blob)| (entry.path.to_string(), handle.blob_path(&blob)))
                    .collect(),
            );
            self.known.model_configs_pending.insert(id.clone());
            let tx = self.sender();
            tokio::spawn(async move {
                let outcome = parse_off_thread(move || derive(&files)).await;
                let _ = tx.send(Event::ConfigParsed {
                    artifact: id,
                    outcome,
                });
            });
        }
    }

    pub(super) fn on_config_parsed(&mut self, artifact: ArtifactId, outcome: Outcome) {
        self.known.model_configs_pending.remove(&artifact);
        match &outcome {
            Outcome::Derived(d) => tracing::info!(
                %artifact,
                file = %d.source_file,
                model_type = %d.model_type,
                architecture = %d.model_architecture,
                parameters = %d.model_parameter_size,
                max_tokens = d.max_tokens,
                "model config parsed"
            ),
            other => tracing::warn!(
                %artifact,
                warning = other.warning().unwrap_or_default(),
                "model config not usable; models of this artifact are served without derived fields"
            ),
        }
        let cached = CachedOutcome {
            parser: PARSER_VERSION,
            outcome,
        };
        match serde_json::to_vec(&cached) {
            Ok(bytes) => {
                if let Err(e) = self.state.save_model_config(&artifact, &bytes) {
                    tracing::warn!(%artifact, error = %e, "saving the parsed model config failed");
                }
            }
            Err(e) => {
                tracing::warn!(%artifact, error = %e, "parsed model config does not serialize")
            }
        }
        self.known
            .model_configs
            .insert(artifact, Arc::new(cached.outcome));
    }

    /// Puts the derived fields (or the warning) of the model's served artifact into its entry,
    /// unless the model asks for no config parsing.
    pub(super) fn fill_model_config(&self, key: &ModelKey, entry: &mut ModelStatus) {
        let skip = self
            .desired_entry(key)
            .and_then(|s| s.as_ref().ok())
            .is_some_and(|s| s.skip_config_parsing);
        if skip {
            return;
        }
        let rec = &self.core.records.models()[key];
        let in_place = || {
            let c = self.known.node_dir_configs.get(key)?;
            let spec = self.desired.as_ref()?.models.get(key)?.as_ref().ok()?;
            let current = rec.artifact.is_none() && node_dir(spec) == Some(c.dir.as_path());
            c.outcome.as_ref().filter(|_| current)
        };
        let Some(outcome) = rec
            .artifact
            .as_ref()
            .and_then(|a| self.known.model_configs.get(a))
            .or_else(in_place)
        else {
            return;
        };
        match &**outcome {
            Outcome::Derived(d) => entry.config.set_derived(d),
            other => entry.config_warning = other.warning(),
        }
    }
}

impl Reconciler {
    /// Marks the in-place config of `key` for a new read: the model was decided again (its
    /// spec changed, it was retried, or the daemon started).
    pub(super) fn node_dir_config_stale(&mut self, key: &ModelKey) {
        if let Some(c) = self.known.node_dir_configs.get_mut(key) {
            c.stale = true;
        }
    }

    /// Starts a read for every `Ready` model read in place that has no current result (see
    /// the module docs), and forgets the results of models no longer read in place.
    pub(super) fn request_node_dir_configs(&mut self) {
        let Some(desired) = self.desired.as_ref() else {
            return;
        };
        let now = Instant::now();
        let interval = self.config.resolve_interval;
        let mut wanted = Vec::new();
        for (key, rec) in self.core.records.models() {
            let Some(Ok(spec)) = desired.models.get(key) else {
                continue;
            };
            let Some(dir) = node_dir(spec) else {
                continue;
            };
            // OME's agent parses after the existence check, and not at all under the skip
            // annotation.
            if rec.phase != super::records::ModelPhase::Ready || spec.skip_config_parsing {
                continue;
            }
            let due = match self.known.node_dir_configs.get(key) {
                None => true,
                Some(c) if c.dir != dir => true,
                Some(c) if c.pending => false,
                Some(c) => c.stale || interval.is_some_and(|i| now.duration_since(c.started) >= i),
            };
            wanted.push((key.clone(), dir.to_path_buf(), due));
        }
        let keep: std::collections::HashSet<&ModelKey> = wanted.iter().map(|(k, _, _)| k).collect();
        self.known.node_dir_configs.retain(|k, _| keep.contains(k));
        for (key, dir, due) in wanted {
            if !due {
                continue;
            }
            let entry = self
                .known
                .node_dir_configs
                .entry(key.clone())
                .or_insert_with(|| NodeDirConfig {
                    dir: dir.clone(),
                    generation: 0,
                    started: now,
                    pending: false,
                    stale: false,
                    outcome: None,
                });
            if entry.dir != dir {
                entry.dir = dir.clone();
                entry.outcome = None;
            }
            entry.generation += 1;
            entry.started = now;
            entry.pending = true;
            entry.stale = false;
            let generation = entry.generation;
            let tx = self.sender();
            tokio::spawn(async move {
                let outcome = parse_off_thread(move || read_in_place(&dir)).await;
                let _ = tx.send(Event::NodeDirConfigParsed {
                    key,
                    generation,
                    outcome,
                });
            });
        }
    }

    /// Keeps the result of a read in place; returns whether it changed what the model shows.
    pub(super) fn on_node_dir_config_parsed(
        &mut self,
        key: ModelKey,
        generation: u64,
        outcome: Outcome,
    ) -> bool {
        let Some(c) = self.known.node_dir_configs.get_mut(&key) else {
            return false;
        };
        if c.generation != generation {
            return false;
        }
        c.pending = false;
        if c.outcome.as_deref() == Some(&outcome) {
            return false;
        }
        match &outcome {
            Outcome::Derived(d) => tracing::info!(
                model = %key,
                dir = %c.dir.display(),
                file = %d.source_file,
                model_type = %d.model_type,
                architecture = %d.model_architecture,
                parameters = %d.model_parameter_size,
                "model config read in place"
            ),
            other => tracing::warn!(
                model = %key,
                dir = %c.dir.display(),
                warning = other.warning().unwrap_or_default(),
                "model config in place not usable; the model is Ready without derived fields"
            ),
        }
        c.outcome = Some(Arc::new(outcome));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The read in place gives what the parser gives for the same directory, and names the
    /// problem when the directory cannot be read.
    #[test]
    fn model_config_read_in_place_is_the_parsers_and_never_fails() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model");
        std::fs::create_dir_all(&model).unwrap();
        std::fs::write(
            model.join("config.json"),
            br#"{"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
                "vocab_size": 1000, "max_position_embeddings": 512,
                "transformers_version": "4.40.0"}"#,
        )
        .unwrap();
        let read = read_in_place(&model);
        assert!(matches!(read, Outcome::Derived(_)), "{read:?}");
        assert_eq!(read, derive(&PathFiles::from_dir(&model).unwrap()));

        // A config that is a symlink out of the directory is not followed.
        let linked = dir.path().join("linked");
        std::fs::create_dir_all(&linked).unwrap();
        std::os::unix::fs::symlink(model.join("config.json"), linked.join("config.json")).unwrap();
        assert_eq!(read_in_place(&linked), Outcome::NoConfig);

        let missing = dir.path().join("missing");
        match read_in_place(&missing) {
            Outcome::Broken(reason) => assert!(
                reason.contains(&format!("{} does not exist", missing.display())),
                "{reason}"
            ),
            other => panic!("{other:?}"),
        }
    }
}
