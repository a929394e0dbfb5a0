//! The executor's handlers of what happens to a model: the desired state, retries and turns,
//! a resolve or fetch finishing, a deletion. Each asks the decision core
//! ([`decide::Machine::step`]) and runs the effects it answers.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::decide::{self, Effect};
use super::handle::now_secs;
use super::spec::{fingerprint, ome_labels, recorded_path, selection_digest};
use super::{Reconciler, Stage};
use crate::source::{Source, SourceError};
use modelfs_core::artifact::{Manifest, Sha256Digest, StoredArtifact};
use modelfs_core::store::StoreId;
use modelfs_ome::{ModelKey, ModelSpec, SourceUri};

impl Reconciler {
    /// Retries whose time has come (transient failures, refusals, space that fits now,
    /// turns) and periodic re-resolves due: the core says which. Only these models are looked
    /// at: the others cannot change without a new desired state.
    pub(super) fn retry_due(&mut self) -> bool {
        if self.desired.is_none() {
            return false;
        }
        let mut changed = false;
        for effect in self.step(decide::Event::TimePassed) {
            match effect {
                Effect::Retry { key } => changed |= self.reconcile_one(&key),
                Effect::Refresh { key } => self.start_refresh(&key),
                _ => {}
            }
        }
        if changed {
            self.batch.remap_needed = true;
        }
        changed
    }

    /// Reconciles `key`'s desired spec again (a retry, a turn). Returns whether the records
    /// changed.
    pub(super) fn reconcile_one(&mut self, key: &ModelKey) -> bool {
        match self.desired_entry(key).cloned() {
            Some(Ok(spec)) => self.ensure(key, &spec),
            Some(Err(reason)) => self.mark_invalid(key, &reason),
            None => false,
        }
    }

    /// A periodic re-resolve of a served model (module docs of [`decide::machine`]): the
    /// same artifact again ends the work quietly; a new one (a changed object has a new ETag
    /// or generation, so a new manifest) is fetched and flipped to as for a source change
    /// (SPEC 3.3), per the model's policy, while the old one stays served and the model stays
    /// Ready. A failed re-resolve or fetch only logs.
    pub(super) fn start_refresh(&mut self, key: &ModelKey) {
        let Some(spec) = self.desired_spec(key) else {
            return;
        };
        let spec = &spec;
        let token = self.token(key);
        let fp = fingerprint(spec, token.as_ref());
        if self
            .core
            .records
            .models()
            .get(key)
            .is_none_or(|r| r.fingerprint != fp)
        {
            return;
        }
        let source = match Source::for_uri(&spec.source, &self.config.sources, token, spec) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(model = %key, error = %e, "re-resolve skipped");
                return;
            }
        };
        tracing::info!(model = %key, source = %spec.source, "resolving again (periodic)");
        let cancel = self.begin_resolving(key, &fp, spec, &source, true);
        self.spawn_resolve(key, fp, source, &cancel);
    }

    pub(super) fn reconcile_all(&mut self) {
        let Some(desired) = self.desired.clone() else {
            return;
        };
        let gone: Vec<ModelKey> = self
            .core
            .records
            .models()
            .keys()
            .filter(|k| !desired.models.contains_key(*k))
            .cloned()
            .collect();
        let mut changed = false;
        for key in gone {
            self.delete(&key);
            changed = true;
        }
        for (key, wanted) in &desired.models {
            changed |= match wanted {
                Ok(spec) => self.ensure(key, spec),
                Err(reason) => self.mark_invalid(key, reason),
            };
        }
        if changed {
            self.batch.remap_needed = true;
        }
    }

    /// `key`'s object is invalid (see [`decide::Event::Invalid`]). Returns whether the
    /// records changed.
    pub(super) fn mark_invalid(&mut self, key: &ModelKey, reason: &str) -> bool {
        let fingerprint = format!(
            "invalid:{}",
            hex::encode(&Sha256::digest(reason.as_bytes())[..8])
        );
        let effects = self.step(decide::Event::Invalid {
            key: key.clone(),
            fingerprint,
            reason: reason.to_string(),
        });
        if effects.is_empty() {
            return false;
        }
        self.execute(effects, None);
        self.wake_waiters();
        true
    }

    /// `key`'s entry in the desired state: its spec, or why its object is invalid.
    pub(super) fn desired_entry(&self, key: &ModelKey) -> Option<&Result<ModelSpec, String>> {
        self.desired.as_ref()?.models.get(key)
    }

    /// `key`'s desired spec, if it has a valid one.
    pub(super) fn desired_spec(&self, key: &ModelKey) -> Option<ModelSpec> {
        self.desired_entry(key)?.as_ref().ok().cloned()
    }

    /// The model's token as the desired state resolved it (Secret, `parameters.token`, or the
    /// environment).
    pub(super) fn token(&self, key: &ModelKey) -> Option<crate::source::Token> {
        self.desired
            .as_ref()
            .and_then(|d| d.tokens.get(key))
            .cloned()
    }

    /// A spec from the desired state (new, changed, or seen again): the core decides whether
    /// it needs work ([`decide::Event::Spec`]) and the work starts
    /// ([`Reconciler::start_work`]). Returns whether the records changed.
    pub(super) fn ensure(&mut self, key: &ModelKey, spec: &ModelSpec) -> bool {
        let token = self.token(key);
        let event = decide::Event::Spec {
            key: key.clone(),
            spec: decide::SpecSummary {
                fingerprint: fingerprint(spec, token.as_ref()),
                name: spec.name.clone(),
                namespace: spec.namespace.clone(),
                source: spec.source.to_string(),
                policy: spec.policy,
                path: recorded_path(spec),
                reserve: spec.reserve_artifact,
            },
            in_cache_view: self.hf_cache_conflict(&spec.path).is_some(),
        };
        let effects = self.step(event);
        let started = effects.iter().any(|e| matches!(e, Effect::Start { .. }));
        self.execute(effects, None);
        started
    }

    /// Starts the work the core decided for `key`'s desired spec: what only the world can
    /// tell (a node directory, a source that cannot be built) fails it; otherwise it resolves,
    /// or places the served artifact again when only the policy or path changed.
    pub(super) fn start_work(&mut self, key: &ModelKey, new: bool) {
        let Some(spec) = self.desired_spec(key) else {
            return;
        };
        if new {
            tracing::info!(model = %key, source = %spec.source, policy = spec.policy.as_str(), "new model");
        }
        // Observed here, decided by the core: where the files come from (and whether a node
        // directory exists), and whether the path lies in the cache view.
        let files = if spec.source.is_vendor() || spec.node_dir.is_some() {
            decide::Files::Elsewhere {
                missing: self.node_dir_missing(key, &spec),
            }
        } else {
            decide::Files::Mount
        };
        let event = decide::Event::Starting {
            key: key.clone(),
            path: spec.path.clone(),
            observed: decide::Observed {
                source: spec.source.to_string(),
                files,
                cache_view_conflict: self.hf_cache_conflict(&spec.path),
            },
        };
        self.apply_event(event, None);
    }

    /// Whether `spec`'s node directory (a `local://` model outside the models root) is
    /// missing, as the failure it is: as OME's agent, the directory must exist (any other
    /// trouble shows when its config is read); a missing one is retried as any source is.
    fn node_dir_missing(&mut self, key: &ModelKey, spec: &ModelSpec) -> Option<decide::Failure> {
        let (Some(dir), SourceUri::Local { .. }) = (&spec.node_dir, &spec.source) else {
            return None;
        };
        match std::fs::metadata(dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let error = SourceError::NodeDirMissing {
                    path: dir.display().to_string(),
                };
                let (reason, retry) = self.failure_of(key, &error);
                Some(decide::Failure { reason, retry })
            }
            _ => None,
        }
    }

    /// The core's [`Effect::Resolve`]: resolves `key`'s desired spec.
    pub(super) fn resolve_desired(&mut self, key: &ModelKey) {
        let Some(spec) = self.desired_spec(key) else {
            return;
        };
        self.resolve(key, &spec);
    }

    /// The core's [`Effect::FilesElsewhere`]: a `vendor://` model (its files come with the
    /// serving runtime), or a `local://` one whose directory lies outside the models root (the
    /// pod binds it from the node), is `Ready` with nothing fetched or mounted, as OME's agent
    /// does (a copy it owned before was handed to its children or released). Its node
    /// directory's config is read again, and its waiters are woken.
    pub(super) fn files_elsewhere(&mut self, key: &ModelKey) {
        let spec = match self.desired.as_ref().and_then(|d| d.models.get(key)) {
            Some(Ok(spec)) => spec.clone(),
            _ => return,
        };
        if let (Some(_), SourceUri::Local { .. }) = (&spec.node_dir, &spec.source) {
            self.node_dir_config_stale(key);
        }
        tracing::info!(model = %key, source = %spec.source, node_dir = ?spec.node_dir, "files on the node or in the runtime: Ready with nothing served");
        self.wake_waiters();
    }

    /// Resolves `spec`'s source, or places the served artifact again when only the policy,
    /// path or label changed.
    fn resolve(&mut self, key: &ModelKey, spec: &ModelSpec) {
        let token = self.token(key);
        let fp = fingerprint(spec, token.as_ref());
        let source = match Source::for_uri(&spec.source, &self.config.sources, token, spec) {
            Ok(s) => {
                let (metrics, labels) = (self.metrics.clone(), ome_labels(key));
                s.observe_throttling(crate::source::ThrottleObserver::new(move |waited| {
                    metrics
                        .ome
                        .rate_limit_wait
                        .get_or_create(&labels)
                        .observe(waited.as_secs_f64())
                }))
            }
            Err(e) => {
                self.fail(key, &e);
                return;
            }
        };
        let rec = &self.core.records.models()[key];
        // Same source (and parameters) as the served artifact: only policy, path or label
        // changed. No resolve.
        let known = match (rec.artifact.clone(), rec.served_source.clone()) {
            (Some(a), Some(src))
                if src == spec.source.to_string()
                    && rec.served_parameters == selection_digest(spec) =>
            {
                self.artifact(&a)
            }
            _ => None,
        };
        let cancel = self.begin_resolving(key, &fp, spec, &source, false);
        if let Some(stored) = known {
            self.decide(key, stored.manifest.clone());
            return;
        }
        self.spawn_resolve(key, fp, source, &cancel);
    }

    pub(super) fn on_resolved(
        &mut self,
        key: ModelKey,
        fp: String,
        result: Result<Manifest, SourceError>,
    ) {
        if !self.report_current(&key, fp) {
            return;
        }
        self.work_changed(&key);
        let refresh = self.works.get(&key).is_some_and(|w| w.refresh);
        match result {
            Ok(m) => {
                if refresh {
                    tracing::info!(model = %key, artifact = %m.id(), "the source changed; fetching the new artifact");
                }
                self.decide(&key, Arc::new(m))
            }
            Err(e) => self.fail(&key, &e),
        }
        // Waiters on this resolve now see a fetch (and keep waiting), a Ready holder, or a
        // failure (and fetch themselves).
        self.wake_waiters();
    }

    /// Whether a report of `key`'s work started for the spec with `fp` is for its current
    /// work: the core's verdict ([`decide::Event::WorkReported`]).
    fn report_current(&mut self, key: &ModelKey, fp: String) -> bool {
        #[cfg(debug_assertions)]
        let fp_seen = fp.clone();
        let event = decide::Event::WorkReported {
            key: key.clone(),
            fingerprint: fp,
        };
        let current = self
            .step(event)
            .iter()
            .any(|e| matches!(e, Effect::Current { key: k } if k == key));
        debug_assert_eq!(
            current,
            self.works
                .get(key)
                .is_some_and(|w| w.fingerprint == fp_seen),
            "the core's verdict on a report differs from the work in flight"
        );
        current
    }

    /// Places `key`, its artifact known (the core's [`decide::Event::ArtifactKnown`]).
    pub(super) fn decide(&mut self, key: &ModelKey, manifest: Arc<Manifest>) {
        let Some(work) = self.works.get(key) else {
            return;
        };
        let spec = work.spec.clone();
        let want = Self::want(&spec, &manifest);
        let space = self.space_for(key, &spec, &manifest);
        let event = decide::Event::ArtifactKnown {
            key: key.clone(),
            want,
            space,
        };
        self.apply_event(event, Some(&manifest));
        self.admitted(key, space);
    }

    /// What `spec` asks to serve, `manifest` being its artifact.
    pub(super) fn want(spec: &ModelSpec, manifest: &Manifest) -> decide::Want {
        decide::Want {
            policy: spec.policy,
            artifact: manifest.id(),
            sha: manifest.revision.clone(),
            path: spec.path.clone(),
            source: spec.source.to_string(),
            parameters: selection_digest(spec),
        }
    }

    pub(super) fn on_fetched(
        &mut self,
        key: ModelKey,
        fp: String,
        store: StoreId,
        manifest: Arc<Manifest>,
        result: Result<(Vec<Sha256Digest>, u32), SourceError>,
    ) {
        let current = self.report_current(&key, fp);
        match result {
            Ok((blobs, size_only_files)) => {
                // A complete, verified artifact is real data whether or not the model still
                // wants it: record it so that the store (and any waiter) can use it.
                let stored = match StoredArtifact::new(manifest.clone(), blobs, now_secs()) {
                    Ok(s) => s.with_size_only_files(size_only_files),
                    Err(e) => {
                        tracing::error!(model = %key, error = %e, "fetch returned an inconsistent artifact");
                        return;
                    }
                };
                if let Err(e) = self.state.save_artifact(&stored) {
                    let err = SourceError::Store {
                        path: "artifact record".into(),
                        source: modelfs_core::store::StoreError::io("saving artifact", e),
                    };
                    if current {
                        self.fail(&key, &err);
                    }
                    return;
                }
                let id = stored.id.clone();
                self.known.artifacts.insert(id.clone(), Arc::new(stored));
                let mut want = None;
                if current {
                    let spec = self.works[&key].spec.clone();
                    if let Stage::Fetching { progress, .. } = &self.works[&key].stage {
                        self.metrics.ome.record(
                            ome_labels(&key),
                            crate::metrics::DownloadOutcome::Succeeded {
                                seconds: progress.started.elapsed().as_secs_f64(),
                                bytes: progress.fetched_bytes.load(Ordering::Relaxed),
                            },
                        );
                    }
                    tracing::info!(model = %key, %store, "fetch complete and verified");
                    want = Some(Self::want(&spec, &manifest));
                }
                let event = decide::Event::Fetched {
                    key,
                    store: store.clone(),
                    artifact: id,
                    want,
                };
                self.apply_event(event, Some(&manifest));
                self.update_store_bytes(&store);
            }
            // A cancelled fetch of work that is still current was not cancelled by us (the task
            // died): fail it as transient so it is retried rather than stuck in Updating.
            Err(e) => {
                if current {
                    self.fail(&key, &e);
                }
            }
        }
        self.wake_waiters();
    }

    /// `key`'s object is gone (SPEC 3.3): its work stops and the core hands its store over or
    /// releases it.
    pub(super) fn delete(&mut self, key: &ModelKey) {
        tracing::info!(model = %key, "model deleted");
        self.apply_event(decide::Event::Deleted { key: key.clone() }, None);
        self.wake_waiters();
    }
}
