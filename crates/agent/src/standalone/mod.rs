//! Standalone mode: the desired set of models is a directory of YAML files.
//!
//! Every change (create, write, rename, delete) triggers a rescan after a short quiet period; a
//! periodic rescan backs up the inotify watch (missed events, directories replaced by a
//! ConfigMap-style symlink swap). A rescan lists the directory and `stat`s each file; only a
//! file whose identity changed (device, inode, size, mtime, ctime: an editor's write-and-rename
//! changes the inode, an in-place write the size or times) is read and parsed again. The others
//! contribute what their last parse produced, so an idle daemon with thousands of models does
//! no parsing at all, and the result stays independent of event order.
//!
//! Bad input loses nothing: a file that cannot be read or parsed (or is larger than
//! [`MAX_MANIFEST_FILE_BYTES`]) keeps contributing the models it defined the last time it was
//! valid, and is reported under the key `file:<name>`; an object that cannot be validated is
//! reported `Failed` under its model key; a key defined twice keeps its first definition (in
//! file name order) and the duplicate is reported. Problems are logged once per version of the
//! file (when it is parsed), not on every rescan.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};

use crate::metrics::Metrics;
use crate::reconciler::{DesiredState, ReconcilerHandle};
use crate::source::Token;
use modelfs_ome::{parse_documents, Document, ManifestError, ModelKey, ModelSpec, SourceUri};

/// `spec.storage.parameters` entry that carries a source token in standalone manifests. It is
/// moved out of the spec into [`DesiredState::tokens`] so no spec ever holds a secret.
pub const TOKEN_PARAMETER: &str = "token";

/// Largest manifest file that is read. An OME model object is well under 2 KiB, so this holds
/// thousands of models (more than [`modelfs_ome::MAX_DOCUMENTS_PER_FILE`]), while a runaway
/// generator or a file dropped here by mistake (a model's weights) costs no memory or parse
/// time. A larger file is unusable like an invalid one: it keeps the models it defined before.
pub const MAX_MANIFEST_FILE_BYTES: u64 = 4 << 20;

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

/// One version of a file, as `stat` sees it; a different stamp means "read it again".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl FileStamp {
    fn of(meta: &std::fs::Metadata) -> Self {
        let ns = |secs: i64, nanos: i64| i128::from(secs) * 1_000_000_000 + i128::from(nanos);
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: ns(meta.mtime(), meta.mtime_nsec()),
            ctime_ns: ns(meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// What the scanner remembers of one file.
struct KnownFile {
    /// The version last parsed.
    stamp: FileStamp,
    /// Models of the last version that could be read and parsed.
    last_good: FileModels,
    /// Problems of the current version, in order (the first keyed `file:<name>`, the next
    /// `file:<name>#2`, ...).
    errors: Vec<String>,
}

/// Scans the directory; remembers each file's last parse and last valid content.
#[derive(Default)]
pub struct Scanner {
    files: BTreeMap<PathBuf, KnownFile>,
    /// Files read and parsed so far (a rescan of unchanged files parses none).
    pub parses: u64,
    /// Whether the last scan can have a different result than the one before (a file was
    /// parsed, added or removed, or the directory could not be read).
    pub changed: bool,
}

fn yaml_files(dir: &Path, out: &mut Vec<(PathBuf, FileStamp)>) -> std::io::Result<()> {
    // Symlinks are followed (Kubernetes mounts a ConfigMap as links into `..data`); a symlink
    // loop is an error for the scan, not an endless descent.
    let walk = walkdir::WalkDir::new(dir)
        .follow_links(true)
        .min_depth(1)
        .into_iter()
        // Hidden entries include Kubernetes' `..data` indirection of mounted ConfigMaps.
        .filter_entry(|e| e.depth() == 0 || !e.file_name().to_string_lossy().starts_with('.'));
    for entry in walk {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy();
        let meta = entry.metadata()?;
        if meta.is_file() && (name.ends_with(".yaml") || name.ends_with(".yml")) {
            out.push((entry.path().to_path_buf(), FileStamp::of(&meta)));
        }
    }
    Ok(())
}

/// Reads a manifest file: a regular file (opened without blocking, so a FIFO swapped in after
/// the listing cannot hang the scan) of at most [`MAX_MANIFEST_FILE_BYTES`], in UTF-8.
fn read_manifest(path: &Path) -> Result<String, String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("cannot read: {e}"))?;
    let meta = file.metadata().map_err(|e| format!("cannot read: {e}"))?;
    if !meta.is_file() {
        return Err("cannot read: not a regular file".to_owned());
    }
    let too_large = |size: u64| {
        format!(
            "the file is {size} bytes, larger than the limit of {MAX_MANIFEST_FILE_BYTES} bytes \
             for a manifest file; split it into several files"
        )
    };
    if meta.len() > MAX_MANIFEST_FILE_BYTES {
        return Err(too_large(meta.len()));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // The file may grow between fstat and read.
    file.take(MAX_MANIFEST_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    if bytes.len() as u64 > MAX_MANIFEST_FILE_BYTES {
        return Err(too_large(bytes.len() as u64));
    }
    String::from_utf8(bytes).map_err(|e| {
        format!(
            "not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })
}

impl Scanner {
    pub fn scan(&mut self, dir: &Path, models_root_dir: &Path) -> DesiredState {
        let parses_before = self.parses;
        let known_before = self.files.len();
        self.changed = true;
        let mut desired = DesiredState::default();
        let mut files = Vec::new();
        if let Err(e) = yaml_files(dir, &mut files) {
            desired.errors.insert(
                format!("file:{}", dir.display()),
                format!("cannot read the models directory: {e}"),
            );
            // Nothing is known: keep every model as it was.
            for known in self.files.values() {
                for (k, v, token) in &known.last_good {
                    desired.models.entry(k.clone()).or_insert_with(|| v.clone());
                    if let Some(t) = token {
                        desired.tokens.insert(k.clone(), t.clone());
                    }
                }
            }
            return desired;
        }
        files.sort_by(|a, b| a.0.cmp(&b.0));
        let listed: std::collections::BTreeSet<&PathBuf> = files.iter().map(|f| &f.0).collect();
        self.files.retain(|p, _| listed.contains(p));
        let removed = self.files.len() != known_before;
        let mut origin: BTreeMap<ModelKey, PathBuf> = BTreeMap::new();
        for (file, stamp) in &files {
            let rel = file.strip_prefix(dir).unwrap_or(file).display().to_string();
            let unchanged = self
                .files
                .get(file)
                .is_some_and(|known| known.stamp == *stamp);
            if !unchanged {
                self.parse_file(file, *stamp, &rel, models_root_dir);
            }
            let known = &self.files[file];
            for (i, e) in known.errors.iter().enumerate() {
                let key = if i == 0 {
                    format!("file:{rel}")
                } else {
                    format!("file:{rel}#{}", i + 1)
                };
                desired.errors.insert(key, e.clone());
            }
            for (key, spec, token) in &known.last_good {
                if let Some(first) = origin.get(key) {
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
                    desired.tokens.insert(key.clone(), t.clone());
                }
                desired.models.insert(key.clone(), spec.clone());
            }
        }
        // New files are parsed, so an unchanged count of parses and files means the same set.
        self.changed = removed || self.parses != parses_before;
        desired
    }

    /// Reads and parses one (new or changed) file, and logs what is wrong with it: once per
    /// version of the file, since unchanged files are not parsed again.
    fn parse_file(&mut self, file: &Path, stamp: FileStamp, rel: &str, models_root_dir: &Path) {
        self.parses += 1;
        let base = file.parent().unwrap_or(file).to_path_buf();
        let parsed =
            read_manifest(file).and_then(|text| parse_documents(&text).map_err(|e| e.to_string()));
        let known = self
            .files
            .entry(file.to_path_buf())
            .or_insert_with(|| KnownFile {
                stamp,
                last_good: Vec::new(),
                errors: Vec::new(),
            });
        known.stamp = stamp;
        match parsed {
            Ok(docs) => {
                let (models, errors) = Self::models_of(docs, &base, models_root_dir);
                for e in &errors {
                    tracing::warn!(file = %rel, reason = %e, "manifest document unusable");
                }
                known.last_good = models;
                known.errors = errors;
            }
            Err(reason) => {
                // Only a file that defined models before has any to keep.
                if known.last_good.is_empty() {
                    tracing::warn!(file = %rel, %reason, "manifest file unusable");
                    known.errors = vec![reason];
                } else {
                    tracing::warn!(file = %rel, %reason, "manifest file unusable; keeping its previous models");
                    known.errors = vec![format!(
                        "{reason} (the models this file defined before are kept)"
                    )];
                }
            }
        }
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
                                s.source = resolve_local(s.source, base);
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

/// Whether a watch event can change what a scan finds. Opening and reading files and
/// directories cannot; and every scan opens the directory (inotify reports `IN_OPEN`), so
/// reacting to it made each scan trigger the next one, four times a second, forever.
fn is_change(event: &notify::Event) -> bool {
    !matches!(event.kind, notify::EventKind::Access(_))
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
    metrics: Arc<Metrics>,
) -> notify::Result<ModelsDirWatcher> {
    std::fs::create_dir_all(&config.dir).map_err(notify::Error::io)?;
    let dir = std::fs::canonicalize(&config.dir).map_err(notify::Error::io)?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok_and(|event| is_change(&event)) {
            let _ = tx.send(());
        }
    })?;
    watcher.watch(&dir, RecursiveMode::Recursive)?;
    let task = tokio::spawn(async move {
        let mut scanner = Scanner::default();
        let mut reported_parses = 0;
        let mut first = true;
        let mut scan = |scanner: &mut Scanner| {
            let desired = scanner.scan(&dir, &config.models_root_dir);
            // Counted before the desired state goes out: whoever sees the counter move knows
            // the scan (and its log lines) is complete.
            metrics
                .manifest_parses
                .inc_by(scanner.parses - reported_parses);
            reported_parses = scanner.parses;
            metrics.manifest_rescans.inc();
            // The reconciler's work on a desired state is proportional to the number of
            // models: an unchanged one is not sent again.
            if scanner.changed || first {
                reconciler.set_desired(desired);
            }
            first = false;
        };
        scan(&mut scanner);
        loop {
            let woke = tokio::time::timeout(config.rescan, rx.recv()).await;
            if let Ok(None) = woke {
                return;
            }
            if woke.is_ok() {
                // Debounce: wait until the directory is quiet.
                while let Ok(Some(())) = tokio::time::timeout(config.debounce, rx.recv()).await {}
            }
            scan(&mut scanner);
        }
    });
    Ok(ModelsDirWatcher {
        _watcher: watcher,
        task,
    })
}

/// A relative `local://` path made absolute against the manifest's directory, and then the
/// real path it names when it exists (so `local://../tiny-model` is shown and compared as
/// `/srv/examples/tiny-model`, its `..` resolved by the filesystem, symlinks included, never
/// lexically). A directory that does not exist yet keeps the joined path.
fn resolve_local(source: SourceUri, base: &Path) -> SourceUri {
    let was_relative = matches!(&source, SourceUri::Local { path } if path.is_relative());
    match source.resolve_local_relative(base) {
        SourceUri::Local { path } if was_relative => SourceUri::Local {
            path: std::fs::canonicalize(&path).unwrap_or(path),
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind, RemoveKind};
    use notify::{Event, EventKind};

    use super::{is_change, yaml_files};

    /// Linked directories are followed, hidden entries skipped, and a symlink loop is an error
    /// for the scan rather than a descent until the path is too long.
    #[test]
    fn manifest_files_below_links_and_loops() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("real/deeper")).unwrap();
        std::fs::create_dir_all(root.join(".hidden")).unwrap();
        std::fs::write(root.join("real/deeper/a.yaml"), "x").unwrap();
        std::fs::write(root.join("real/b.yml"), "x").unwrap();
        std::fs::write(root.join("real/c.txt"), "x").unwrap();
        std::fs::write(root.join(".hidden/d.yaml"), "x").unwrap();
        std::os::unix::fs::symlink(root.join("real"), root.join("linked")).unwrap();
        let mut found = Vec::new();
        yaml_files(root, &mut found).unwrap();
        let mut names: Vec<String> = found
            .iter()
            .map(|(p, _)| p.strip_prefix(root).unwrap().display().to_string())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "linked/b.yml",
                "linked/deeper/a.yaml",
                "real/b.yml",
                "real/deeper/a.yaml"
            ]
        );

        std::os::unix::fs::symlink(root.join("real"), root.join("real/deeper/loop")).unwrap();
        let mut found = Vec::new();
        assert!(yaml_files(root, &mut found).is_err());
    }

    #[test]
    fn reading_the_directory_is_no_change() {
        for kind in [
            EventKind::Access(AccessKind::Open(AccessMode::Any)),
            EventKind::Access(AccessKind::Read),
            EventKind::Access(AccessKind::Close(AccessMode::Read)),
        ] {
            assert!(!is_change(&Event::new(kind)), "{kind:?}");
        }
        for kind in [
            EventKind::Create(CreateKind::File),
            EventKind::Modify(ModifyKind::Any),
            EventKind::Remove(RemoveKind::File),
            EventKind::Any,
        ] {
            assert!(is_change(&Event::new(kind)), "{kind:?}");
        }
    }
}
