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

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{Event, Reconciler};
use modelfs_core::artifact::ArtifactId;
use modelfs_ome::modelconfig::{derive, Outcome, PathFiles};
use modelfs_ome::status::ModelStatus;
use modelfs_ome::ModelKey;

/// Bumped when the derivation changes, so that cached results are recomputed.
const PARSER_VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct CachedOutcome {
    parser: u32,
    outcome: Outcome,
}

/// Config parses running at once. The artifacts of a whole import become served in one pass,
/// and a blocking thread each (tokio starts up to 512) kept their stacks and allocator caches
/// resident after the import, for no speed on a few cores.
static CONFIG_PARSES: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

impl Reconciler {
    /// Starts a parse for every served artifact that has no result yet (loading the cached one
    /// when there is).
    pub(super) fn request_model_configs(&mut self) {
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
                // Waiting here holds no thread; the semaphore is never closed.
                let _permit = CONFIG_PARSES.acquire().await;
                let parsed = tokio::task::spawn_blocking(move || {
                    // A parser panic is a bug: reported as the config's problem (a warning on
                    // the model, logged), never a parse that stays pending forever.
                    std::panic::catch_unwind(|| derive(&files)).unwrap_or_else(|panic| {
                        Outcome::Broken(
                            crate::source::SourceError::from_panic(panic)
                                .to_string()
                                .replace("a worker", "the config parser"),
                        )
                    })
                })
                .await;
                let outcome = parsed.unwrap_or_else(|e| {
                    Outcome::Broken(format!("the config parser did not finish: {e}"))
                });
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
            .desired
            .as_ref()
            .and_then(|d| d.models.get(key))
            .and_then(|s| s.as_ref().ok())
            .is_some_and(|s| s.skip_config_parsing);
        if skip {
            return;
        }
        let Some(outcome) = self.core.records.models()[key]
            .artifact
            .as_ref()
            .and_then(|a| self.known.model_configs.get(a))
        else {
            return;
        };
        match &**outcome {
            Outcome::Derived(d) => entry.config.set_derived(d),
            other => entry.config_warning = other.warning(),
        }
    }
}
