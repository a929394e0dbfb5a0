//! Standalone mode: the desired set of models is a directory of YAML files.
//!
//! Every change (create, write, rename, delete) triggers a full rescan after a short quiet
//! period; a periodic rescan backs up the inotify watch (missed events, directories replaced by
//! a ConfigMap-style symlink swap). A full rescan is cheap (a few files of a few KiB) and makes
//! the result independent of event order.
//!
//! Bad input loses nothing: a file that cannot be read or parsed keeps contributing the models
//! it defined the last time it was valid, and is reported under the key `file:<name>`; an object
//! that cannot be validated is reported `Failed` under its model key; a key defined twice keeps
//! its first definition (in file name order) and the duplicate is reported.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::{RecursiveMode, Watcher};

use crate::manifest::{parse_documents, Document, ManifestError, ModelKey, ModelSpec};
use crate::reconciler::{DesiredState, ReconcilerHandle};
use crate::source::Token;

/// `spec.storage.parameters` entry that carries a source token in standalone manifests. It is
/// moved out of the spec into [`DesiredState::tokens`] so no spec ever holds a secret.
pub const TOKEN_PARAMETER: &str = "token";

#[derive(Clone, Debug)]
pub struct ModelsDirConfig {
    pub dir: PathBuf,
    pub models_root_dir: PathBuf,
    /// Quiet period after the last event before rescanning: editors write files in several
    /// steps (truncate, write, rename) and one scan should see the end result.
    pub debounce: Duration,
    /// Backstop rescan period.
    pub rescan: Duration,
}

type FileModels = Vec<(ModelKey, Result<ModelSpec, String>, Option<Token>)>;

/// Scans the directory; remembers each file's last valid content.
#[derive(Default)]
pub struct Scanner {
    last_good: BTreeMap<PathBuf, FileModels>,
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        // Hidden entries include Kubernetes' `..data` indirection of mounted ConfigMaps.
        if name.starts_with('.') {
            continue;
        }
        let path = entry.path();
        let meta = std::fs::metadata(&path)?;
        if meta.is_dir() {
            yaml_files(&path, out)?;
        } else if meta.is_file() && (name.ends_with(".yaml") || name.ends_with(".yml")) {
            out.push(path);
        }
    }
    Ok(())
}

impl Scanner {
    pub fn scan(&mut self, dir: &Path, models_root_dir: &Path) -> DesiredState {
        let mut desired = DesiredState::default();
        let mut files = Vec::new();
        if let Err(e) = yaml_files(dir, &mut files) {
            desired.errors.insert(
                format!("file:{}", dir.display()),
                format!("cannot read the models directory: {e}"),
            );
            // Nothing is known: keep every model as it was.
            for models in self.last_good.values() {
                for (k, v, token) in models {
                    desired.models.entry(k.clone()).or_insert_with(|| v.clone());
                    if let Some(t) = token {
                        desired.tokens.insert(k.clone(), t.clone());
                    }
                }
            }
            return desired;
        }
        files.sort();
        self.last_good.retain(|p, _| files.contains(p));
        let mut origin: BTreeMap<ModelKey, PathBuf> = BTreeMap::new();
        for file in files {
            let rel = file
                .strip_prefix(dir)
                .unwrap_or(&file)
                .display()
                .to_string();
            let base = file.parent().unwrap_or(dir).to_path_buf();
            let parsed = std::fs::read_to_string(&file)
                .map_err(|e| format!("cannot read: {e}"))
                .and_then(|text| parse_documents(&text).map_err(|e| e.to_string()));
            let models = match parsed {
                Ok(docs) => {
                    let (models, errors) = Self::models_of(docs, &base, models_root_dir);
                    for (i, e) in errors.into_iter().enumerate() {
                        let key = if i == 0 {
                            format!("file:{rel}")
                        } else {
                            format!("file:{rel}#{}", i + 1)
                        };
                        desired.errors.insert(key, e);
                    }
                    self.last_good.insert(file.clone(), models.clone());
                    models
                }
                Err(reason) => {
                    tracing::warn!(file = %rel, %reason, "manifest file unusable; keeping its previous models");
                    desired.errors.insert(
                        format!("file:{rel}"),
                        format!("{reason} (the models this file defined before are kept)"),
                    );
                    self.last_good.get(&file).cloned().unwrap_or_default()
                }
            };
            for (key, spec, token) in models {
                if let Some(first) = origin.get(&key) {
                    desired.errors.insert(
                        format!("file:{rel}"),
                        format!(
                            "{key} is defined again; the definition in {} is used",
                            first.strip_prefix(dir).unwrap_or(first).display()
                        ),
                    );
                    continue;
                }
                origin.insert(key.clone(), file.clone());
                if let Some(t) = token {
                    desired.tokens.insert(key.clone(), t);
                }
                desired.models.insert(key, spec);
            }
        }
        desired
    }

    fn models_of(
        docs: Vec<Document>,
        base: &Path,
        models_root_dir: &Path,
    ) -> (FileModels, Vec<String>) {
        let mut models = Vec::new();
        let mut errors = Vec::new();
        for doc in docs {
            match doc {
                Document::Model(Ok(obj)) => match obj.key() {
                    Ok(key) => {
                        let mut token = None;
                        let spec = obj
                            .to_spec(models_root_dir)
                            .map(|mut s| {
                                s.source = s.source.resolve_local_relative(base);
                                token = s.parameters.remove(TOKEN_PARAMETER).map(Token::new);
                                s
                            })
                            .map_err(|e| e.to_string());
                        models.push((key, spec, token));
                    }
                    Err(e) => errors.push(e.to_string()),
                },
                Document::Model(Err(e)) => match &e {
                    ManifestError::InvalidObject {
                        kind,
                        name: Some(name),
                        namespace,
                        reason,
                        ..
                    } => match ModelKey::new(*kind, namespace.as_deref(), name) {
                        Ok(key) => models.push((key, Err(reason.clone()), None)),
                        Err(_) => errors.push(e.to_string()),
                    },
                    _ => errors.push(e.to_string()),
                },
                Document::Invalid(e) => errors.push(e.to_string()),
                Document::Other { kind, .. } => {
                    tracing::debug!(kind, "skipping a non-model object");
                }
            }
        }
        (models, errors)
    }
}

/// Watches the directory and feeds the reconciler until the returned guard is dropped.
pub struct ModelsDirWatcher {
    _watcher: notify::RecommendedWatcher,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ModelsDirWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub fn watch(
    config: ModelsDirConfig,
    reconciler: ReconcilerHandle,
) -> notify::Result<ModelsDirWatcher> {
    std::fs::create_dir_all(&config.dir).map_err(notify::Error::io)?;
    let dir = std::fs::canonicalize(&config.dir).map_err(notify::Error::io)?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok() {
            let _ = tx.send(());
        }
    })?;
    watcher.watch(&dir, RecursiveMode::Recursive)?;
    let task = tokio::spawn(async move {
        let mut scanner = Scanner::default();
        reconciler.set_desired(scanner.scan(&dir, &config.models_root_dir));
        loop {
            let woke = tokio::time::timeout(config.rescan, rx.recv()).await;
            if let Ok(None) = woke {
                return;
            }
            if woke.is_ok() {
                // Debounce: wait until the directory is quiet.
                while let Ok(Some(())) = tokio::time::timeout(config.debounce, rx.recv()).await {}
            }
            reconciler.set_desired(scanner.scan(&dir, &config.models_root_dir));
        }
    });
    Ok(ModelsDirWatcher {
        _watcher: watcher,
        task,
    })
}
