//! The Hugging Face cache view: every Ready `hf://` model also appears in the directory layout
//! of `huggingface_hub`'s cache, so `HF_HUB_CACHE=<mount>/<dir> HF_HUB_OFFLINE=1` resolves model
//! ids from the mount (SPEC section 10).
//!
//! # Layout
//! ```text
//! <dir>/models--<org>--<name>/refs/<revision>          40-byte file: the commit (no newline)
//! <dir>/models--<org>--<name>/snapshots/<commit>/...   the artifact's files
//! ```
//! This is the subset offline resolution reads (`huggingface_hub` 2.x: `try_to_load_from_cache`,
//! the `local_files_only` branches of `hf_hub_download` and `snapshot_download`): a revision name
//! is looked up in `refs/`, a commit in `snapshots/`, and the file under the snapshot is checked
//! with `os.path.isfile` / `exists`. A real cache makes snapshot entries symlinks to
//! `../../blobs/<etag>`; the library follows them but never needs `blobs/` when reading, and it
//! accepts plain files in `snapshots/` (its own layout on systems without symlinks). The view
//! uses plain files: a snapshot is an ordinary model tree mounted at the snapshot path, with the
//! same blobs, store handles and passthrough as the model's own path, and no symlink or
//! `blobs/` naming by etag (git sha1 for small files) to maintain. Consequences: `realpath` of a
//! file stays inside `snapshots/`, and `hf cache scan` style tools that expect `blobs/` see none.
//! `.no_exist/` and the `trees/<commit>.json` listing are absent: both are optional (an absent
//! listing means "trust the snapshot folder").
//!
//! # Identity and sharing
//! A snapshot is keyed by (repository, commit): several models pinning one revision show it
//! once. It is served from the store of the first such model by key (any of them holds the same
//! artifact); the core numbers its inodes per (path, artifact), so a flip between stores keeps
//! every inode, exactly as for a model path. A ref names one commit; when models of one
//! repository resolved one revision name to different commits (a branch moved between their
//! resolutions) the ref points at the most recently completed artifact (ties: first key). A
//! revision that is itself the commit has no ref (the library looks it up in `snapshots/`).
//!
//! # Changes
//! The view is part of the mapping snapshot ([`super::FsCore::apply_with_files`]): refs and
//! snapshots change in the same atomic swap as model paths. A ref file is an inline file, one
//! inode per content, so a reader sees the old or the new commit, never a mix. Because a reader
//! reads a ref and then opens files of the snapshot it names (and a loader may open shards for
//! minutes after `snapshot_download` returned the folder), a snapshot that leaves the view stays
//! for a linger period (`--hf-cache-linger-secs`): it keeps its store in use, so garbage
//! collection waits for it too. Refs never linger: a deleted model's id stops resolving at once.
//!
//! # Served while downloading
//! An `hf://` model served while it downloads (SPEC section 13) shows its snapshot at once,
//! with the same pending file states as its own path ([`HfServed::pending`]): opens of files
//! not yet verified wait there as they do at the model's path. A complete snapshot of the same
//! (repository, commit) wins over a pending one, and a ref names a pending snapshot only while
//! no complete model gives that ref a commit (a loader resolving a branch keeps getting the
//! complete revision it got before until the new one is complete, as the model path does). A
//! pending snapshot that leaves the view does not linger: its fetch failed or was cancelled
//! (or it completed, and the complete snapshot took its place), and opens waiting in it must
//! end at once.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{InlineFile, MountEntry, PendingFiles, StoreHandle};
use modelfs_core::artifact::StoredArtifact;

/// Default directory of the view below the mount (`--hf-cache-dir`).
pub const DEFAULT_DIR: &str = ".hf-cache";

/// Longest file name Linux accepts.
const NAME_MAX: usize = 255;

/// One Ready model with a Hugging Face source, as the view needs it.
#[derive(Clone, Debug)]
pub struct HfServed {
    /// The model key: the deterministic tie-breaker.
    pub model: String,
    /// `<org>/<name>` (or a single-part id).
    pub repo: String,
    /// The revision the source names (branch, tag or commit).
    pub revision: String,
    /// The artifact served; its manifest revision is the commit.
    pub artifact: Arc<StoredArtifact>,
    pub store: Arc<StoreHandle>,
    /// `Some` while the model is served while it downloads: the per-file states of its
    /// pending entry (the artifact then lists the files only; see [`super::pending`]).
    pub pending: Option<Arc<PendingFiles>>,
}

/// `huggingface_hub`'s folder name for a model repository.
pub fn repo_folder(repo: &str) -> String {
    format!("models--{}", repo.replace('/', "--"))
}

/// Why a model at `model_path` cannot be mounted next to the view at `cache_dir` (both as
/// segments below the mount): the two must not nest. `None` when they are apart.
pub fn path_conflict(model_path: &[String], cache_dir: &[String]) -> Option<String> {
    if cache_dir.is_empty() {
        return None;
    }
    let nests = model_path.starts_with(cache_dir) || cache_dir.starts_with(model_path);
    nests.then(|| {
        format!(
            "path {} nests with {}, the Hugging Face cache view of the mount (--hf-cache-dir)",
            model_path.join("/"),
            cache_dir.join("/")
        )
    })
}

fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A revision as path segments below `refs/`, if it can be one.
fn ref_segments(revision: &str) -> Option<Vec<String>> {
    let segments: Vec<String> = revision.split('/').map(str::to_string).collect();
    let ok = segments.iter().all(|s| {
        !s.is_empty() && s != "." && s != ".." && s.len() <= NAME_MAX && !s.contains('\0')
    });
    ok.then_some(segments)
}

#[derive(Clone, Debug)]
struct Snapshot {
    artifact: Arc<StoredArtifact>,
    store: Arc<StoreHandle>,
    pending: Option<Arc<PendingFiles>>,
}

/// A ref the view cannot show: its path nests with another ref of the same repository
/// (`feature` and `feature/x`: `refs/feature` cannot be a file and a directory). The ref that
/// comes first in name order is shown; the other is reported, not dropped silently.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LeftOutRef {
    /// The model whose source names the revision.
    pub model: String,
    pub repo: String,
    pub revision: String,
    /// The ref shown in its place.
    pub shown: String,
}

/// The view's state between mapping updates: the configured directory and the snapshots that
/// left the view but still linger.
#[derive(Debug)]
pub struct HfCacheView {
    dir: Vec<String>,
    linger: Duration,
    /// Refs of the last update that nest with another ref (see [`LeftOutRef`]).
    left_out: Vec<LeftOutRef>,
    /// Snapshots in the view now, by (repository, commit).
    current: BTreeMap<(String, String), Snapshot>,
    /// Snapshots no model serves any more, until their deadline.
    lingering: BTreeMap<(String, String), (Snapshot, Instant)>,
}

impl HfCacheView {
    /// `dir`: the view's directory below the mount, as segments (non-empty).
    pub fn new(dir: Vec<String>, linger: Duration) -> Self {
        Self {
            dir,
            linger,
            current: BTreeMap::new(),
            lingering: BTreeMap::new(),
            left_out: Vec::new(),
        }
    }

    /// Refs the last update could not show (each is logged once, when it starts being left
    /// out).
    pub fn left_out(&self) -> &[LeftOutRef] {
        &self.left_out
    }

    pub fn dir(&self) -> &[String] {
        &self.dir
    }

    /// Whether a lingering snapshot's time is up (the caller then updates the mapping).
    pub fn expired(&self, now: Instant) -> bool {
        self.lingering.values().any(|(_, until)| *until <= now)
    }

    /// The pending states of the snapshots of the last update that are served while they
    /// download, by path (for [`super::FsCore::apply_with_pending`]).
    pub fn pending(&self) -> std::collections::HashMap<Vec<String>, Arc<PendingFiles>> {
        self.current
            .iter()
            .filter_map(|((repo, commit), snap)| {
                Some((self.snapshot_path(repo, commit), snap.pending.clone()?))
            })
            .collect()
    }

    /// Where the snapshot of `repo` at `commit` is, below the mount.
    pub fn snapshot_path(&self, repo: &str, commit: &str) -> Vec<String> {
        let mut path = self.dir.clone();
        path.extend([repo_folder(repo), "snapshots".into(), commit.to_string()]);
        path
    }

    /// The view's model entries (snapshots) and inline files (refs) for the models served now.
    pub fn update(
        &mut self,
        served: &[HfServed],
        now: Instant,
    ) -> (Vec<MountEntry>, Vec<InlineFile>) {
        let mut by_key: Vec<&HfServed> = served
            .iter()
            .filter(|s| is_commit(&s.artifact.manifest.revision))
            .collect();
        // Complete models first: their snapshots and refs win over pending ones.
        by_key
            .sort_by(|a, b| (a.pending.is_some(), &a.model).cmp(&(b.pending.is_some(), &b.model)));

        let mut current: BTreeMap<(String, String), Snapshot> = BTreeMap::new();
        // (repo, revision) -> (completed_at, model, commit) of the ref's chosen model.
        let mut refs: BTreeMap<(String, String), (u64, &str, &str)> = BTreeMap::new();
        for s in &by_key {
            let commit = s.artifact.manifest.revision.as_str();
            current
                .entry((s.repo.clone(), commit.to_string()))
                .or_insert_with(|| Snapshot {
                    artifact: s.artifact.clone(),
                    store: s.store.clone(),
                    pending: s.pending.clone(),
                });
            if s.revision == commit {
                continue;
            }
            let candidate = (s.artifact.completed_at, s.model.as_str(), commit);
            let ref_key = (s.repo.clone(), s.revision.clone());
            if s.pending.is_some() {
                // Only where no complete model names the ref (those came first).
                refs.entry(ref_key).or_insert(candidate);
                continue;
            }
            refs.entry(ref_key)
                .and_modify(|chosen| {
                    // Newest completion wins; on a tie the earlier key (seen first) stays.
                    if candidate.0 > chosen.0 {
                        *chosen = candidate;
                    }
                })
                .or_insert(candidate);
        }

        for (key, snap) in &self.current {
            if !current.contains_key(key) && !self.linger.is_zero() && snap.pending.is_none() {
                self.lingering
                    .insert(key.clone(), (snap.clone(), now + self.linger));
            }
        }
        self.lingering
            .retain(|key, (_, until)| *until > now && !current.contains_key(key));
        self.current = current;

        let mut entries = Vec::with_capacity(self.current.len() + self.lingering.len());
        let lingering = self.lingering.iter().map(|(k, (s, _))| (k, s));
        for ((repo, commit), snap) in self.current.iter().chain(lingering) {
            entries.push(MountEntry {
                path: self.snapshot_path(repo, commit),
                artifact: snap.artifact.clone(),
                store: snap.store.clone(),
            });
        }
        let mut files = Vec::with_capacity(refs.len());
        // Refs of one repository whose paths nest (`a` and `a/b`) cannot both be shown: the
        // first in this (sorted) order is, the others are reported.
        let mut shown: Vec<(&str, Vec<String>, &str)> = Vec::new();
        let mut left_out = Vec::new();
        for ((repo, revision), (_, model, commit)) in &refs {
            let Some(segments) = ref_segments(revision) else {
                continue;
            };
            let nests = |(r, s, _): &&(&str, Vec<String>, &str)| {
                *r == repo.as_str() && (s.starts_with(&segments) || segments.starts_with(s))
            };
            if let Some((_, _, other)) = shown.iter().find(nests) {
                left_out.push(LeftOutRef {
                    model: model.to_string(),
                    repo: repo.clone(),
                    revision: revision.clone(),
                    shown: other.to_string(),
                });
                continue;
            }
            let mut path = self.dir.clone();
            path.extend([repo_folder(repo), "refs".into()]);
            path.extend(segments.iter().cloned());
            files.push(InlineFile {
                path,
                content: Arc::from(commit.as_bytes()),
            });
            shown.push((repo.as_str(), segments, revision.as_str()));
        }
        for r in &left_out {
            if !self.left_out.contains(r) {
                tracing::warn!(
                    model = %r.model,
                    repo = %r.repo,
                    revision = %r.revision,
                    shown = %r.shown,
                    "the Hugging Face cache view cannot show this ref: its path nests with another ref of the repository (refs/<ref> is a file); resolve the model by commit or by the other ref"
                );
            }
        }
        self.left_out = left_out;
        (entries, files)
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    use super::super::{Attr, FsCore, FsError, Kind, ROOT_INO};
    use super::*;
    use modelfs_core::artifact::{FileDigest, Manifest, ManifestEntry, Sha256Digest};
    use modelfs_core::store::{Store, StoreId};

    const C1: &str = "1111111111111111111111111111111111111111";
    const C2: &str = "2222222222222222222222222222222222222222";

    struct Fixture {
        _dir: tempfile::TempDir,
        core: FsCore,
        stores: Vec<Arc<StoreHandle>>,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let core = FsCore::new();
        let stores = (1..=2)
            .map(|i| {
                let s = Store::open(dir.path().join(format!("s{i}"))).unwrap();
                core.store_handle(&StoreId::from_seq(i), s)
            })
            .collect();
        Fixture {
            _dir: dir,
            core,
            stores,
        }
    }

    fn artifact(
        store: &Store,
        commit: &str,
        completed_at: u64,
        files: &[(&str, &[u8])],
    ) -> Arc<StoredArtifact> {
        let mut entries = Vec::new();
        for (path, data) in files {
            let sha = Sha256Digest::of(data);
            std::fs::write(store.blob_path(&sha), data).unwrap();
            entries.push(ManifestEntry {
                path: path.to_string(),
                size: data.len() as u64,
                digest: FileDigest::Sha256(sha.0),
            });
        }
        let manifest = Manifest::new(commit.into(), entries).unwrap();
        let blobs = manifest
            .entries()
            .map(|e| match e.digest {
                FileDigest::Sha256(d) => Sha256Digest(d),
                _ => unreachable!(),
            })
            .collect();
        Arc::new(StoredArtifact::new(manifest, blobs, completed_at).unwrap())
    }

    fn served(
        model: &str,
        repo: &str,
        revision: &str,
        a: &Arc<StoredArtifact>,
        s: &Arc<StoreHandle>,
    ) -> HfServed {
        HfServed {
            model: model.into(),
            repo: repo.into(),
            revision: revision.into(),
            artifact: a.clone(),
            store: s.clone(),
            pending: None,
        }
    }

    fn resolve(core: &FsCore, path: &str) -> Result<Attr, FsError> {
        let mut attr = core.getattr(ROOT_INO)?;
        for seg in path.split('/').filter(|s| !s.is_empty()) {
            attr = core.lookup(attr.ino, OsStr::new(seg))?;
        }
        Ok(attr)
    }

    fn read(core: &FsCore, path: &str) -> Result<Vec<u8>, FsError> {
        let attr = resolve(core, path)?;
        let (fh, _) = core.open(attr.ino)?;
        let data = core.read(fh, 0, 1 << 20);
        core.release(fh);
        data
    }

    fn names(core: &FsCore, path: &str) -> Vec<String> {
        let ino = resolve(core, path).unwrap().ino;
        let mut out = Vec::new();
        core.readdir(ino, 0, |e| {
            out.push(e.name);
            false
        })
        .unwrap();
        out.retain(|n| n != "." && n != "..");
        out.sort();
        out
    }

    fn apply(f: &Fixture, view: &mut HfCacheView, models: &[HfServed], now: Instant) {
        let (entries, files) = view.update(models, now);
        f.core.apply_with_files(&entries, &files).unwrap();
    }

    #[test]
    fn layout_refs_snapshots_and_sharing() {
        let f = fixture();
        let (s1, s2) = (&f.stores[0], &f.stores[1]);
        let a1 = artifact(
            &s1.store,
            C1,
            10,
            &[("config.json", b"{}"), ("w/x.bin", b"xx")],
        );
        let a1_in_s2 = artifact(
            &s2.store,
            C1,
            10,
            &[("config.json", b"{}"), ("w/x.bin", b"xx")],
        );
        let a2 = artifact(&s1.store, C2, 20, &[("config.json", b"{\"v\":2}")]);
        let mut view = HfCacheView::new(vec![".hf-cache".into()], Duration::ZERO);
        let now = Instant::now();
        apply(
            &f,
            &mut view,
            &[
                served("b", "org/m", "main", &a1_in_s2, s2),
                served("a", "org/m", "main", &a1, s1),
                served("c", "org/m", "v2", &a2, s1),
                served("d", "org/m", C2, &a2, s1),
                served("e", "solo", "main", &a2, s1),
            ],
            now,
        );
        assert_eq!(
            names(&f.core, ".hf-cache"),
            ["models--org--m", "models--solo"]
        );
        assert_eq!(
            names(&f.core, ".hf-cache/models--org--m"),
            ["refs", "snapshots"]
        );
        assert_eq!(
            names(&f.core, ".hf-cache/models--org--m/snapshots"),
            [C1, C2],
            "a commit pinned by several models appears once"
        );
        assert_eq!(
            names(&f.core, ".hf-cache/models--org--m/refs"),
            ["main", "v2"],
            "a revision that is the commit has no ref"
        );
        let main = resolve(&f.core, ".hf-cache/models--org--m/refs/main").unwrap();
        assert_eq!((main.kind, main.size, main.perm), (Kind::File, 40, 0o444));
        assert_eq!(
            read(&f.core, ".hf-cache/models--org--m/refs/main").unwrap(),
            C1.as_bytes()
        );
        assert_eq!(
            read(&f.core, ".hf-cache/models--org--m/refs/v2").unwrap(),
            C2.as_bytes()
        );
        assert_eq!(
            read(
                &f.core,
                &format!(".hf-cache/models--org--m/snapshots/{C1}/w/x.bin")
            )
            .unwrap(),
            b"xx"
        );
        let snap_file = resolve(
            &f.core,
            &format!(".hf-cache/models--org--m/snapshots/{C1}/w/x.bin"),
        )
        .unwrap();
        let (fh, blob) = f.core.open(snap_file.ino).unwrap();
        assert_eq!(
            blob.store.as_ref().unwrap().id,
            StoreId::from_seq(1),
            "served from the store of the first model by key"
        );
        f.core.release(fh);
        assert!(matches!(
            f.core.readdir(main.ino, 0, |_| false),
            Err(FsError::NotDir)
        ));
        assert!(matches!(
            f.core.lookup(main.ino, OsStr::new("x")),
            Err(FsError::NotFound | FsError::NotDir)
        ));
    }

    #[test]
    fn moved_ref_is_a_new_inode_and_the_old_one_keeps_its_content() {
        let f = fixture();
        let s1 = &f.stores[0];
        let a1 = artifact(&s1.store, C1, 10, &[("f", b"one")]);
        let a2 = artifact(&s1.store, C2, 20, &[("f", b"two")]);
        let mut view = HfCacheView::new(vec!["c".into()], Duration::ZERO);
        let now = Instant::now();
        apply(&f, &mut view, &[served("m", "o/r", "main", &a1, s1)], now);
        let before = resolve(&f.core, "c/models--o--r/refs/main").unwrap();
        let (old_fh, _) = f.core.open(before.ino).unwrap();

        apply(&f, &mut view, &[served("m", "o/r", "main", &a2, s1)], now);
        let after = resolve(&f.core, "c/models--o--r/refs/main").unwrap();
        assert_ne!(before.ino, after.ino, "new content, new inode");
        assert_eq!(
            read(&f.core, "c/models--o--r/refs/main").unwrap(),
            C2.as_bytes()
        );
        assert_eq!(f.core.read(old_fh, 0, 100).unwrap(), C1.as_bytes());
        assert_eq!(f.core.getattr(before.ino).unwrap().size, 40);
        let (fh, _) = f.core.open(before.ino).unwrap();
        assert_eq!(
            f.core.read(fh, 0, 100).unwrap(),
            C1.as_bytes(),
            "a kernel holding the old inode still reads the old commit"
        );
        assert_eq!(names(&f.core, "c/models--o--r/snapshots"), [C2]);

        // Newest completion wins when one name resolved to two commits.
        apply(
            &f,
            &mut view,
            &[
                served("a", "o/r", "main", &a2, s1),
                served("b", "o/r", "main", &a1, s1),
            ],
            now,
        );
        assert_eq!(
            read(&f.core, "c/models--o--r/refs/main").unwrap(),
            C2.as_bytes()
        );
        assert_eq!(names(&f.core, "c/models--o--r/snapshots"), [C1, C2]);
    }

    #[test]
    fn pending_snapshots_yield_to_complete_ones_name_free_refs_only_and_never_linger() {
        let f = fixture();
        let s1 = &f.stores[0];
        let a1 = artifact(&s1.store, C1, 10, &[("f", b"one")]);
        let a2 = artifact(&s1.store, C2, 20, &[("f", b"two")]);
        let waiting = Arc::new(PendingFiles::all_waiting(1));
        let pending = |model: &str, a: &Arc<StoredArtifact>| HfServed {
            pending: Some(waiting.clone()),
            ..served(model, "o/r", "main", a, s1)
        };
        let ref_of = |files: &[InlineFile]| -> Vec<String> {
            files
                .iter()
                .map(|f| String::from_utf8(f.content.to_vec()).unwrap())
                .collect()
        };
        let mut view = HfCacheView::new(vec!["c".into()], Duration::from_secs(60));
        let t0 = Instant::now();
        // Alone, a pending snapshot is shown pending, and the ref names it.
        let (entries, files) = view.update(&[pending("p", &a2)], t0);
        assert_eq!(entries.len(), 1);
        assert_eq!(ref_of(&files), [C2]);
        let path = view.snapshot_path("o/r", C2);
        assert_eq!(view.pending().get(&path), Some(&waiting));
        // A complete model of the same ref keeps it (and a complete snapshot of the same
        // commit wins: not pending).
        let (_, files) = view.update(
            &[pending("p", &a2), served("m", "o/r", "main", &a1, s1)],
            t0,
        );
        assert_eq!(ref_of(&files), [C1], "the complete revision keeps the ref");
        assert_eq!(view.pending().len(), 1);
        let (_, files) = view.update(
            &[pending("p", &a2), served("m", "o/r", "main", &a2, s1)],
            t0,
        );
        assert_eq!(ref_of(&files), [C2]);
        assert!(view.pending().is_empty(), "the complete snapshot wins");
        // A pending snapshot that leaves does not linger.
        view.update(&[pending("p", &a2)], t0);
        let (entries, files) = view.update(&[], t0);
        assert!(entries.iter().all(|e| e.path != path), "{entries:?}");
        assert!(files.is_empty());
        assert!(view.pending().is_empty());
    }

    #[test]
    fn snapshots_linger_refs_do_not() {
        let f = fixture();
        let s1 = &f.stores[0];
        let a1 = artifact(&s1.store, C1, 10, &[("f", b"one")]);
        let a2 = artifact(&s1.store, C2, 20, &[("f", b"two")]);
        let mut view = HfCacheView::new(vec!["c".into()], Duration::from_secs(60));
        let t0 = Instant::now();
        apply(&f, &mut view, &[served("m", "o/r", "main", &a1, s1)], t0);
        apply(&f, &mut view, &[served("m", "o/r", "main", &a2, s1)], t0);
        assert_eq!(
            names(&f.core, "c/models--o--r/snapshots"),
            [C1, C2],
            "the old snapshot lingers after a revision change"
        );
        assert_eq!(
            read(&f.core, &format!("c/models--o--r/snapshots/{C1}/f")).unwrap(),
            b"one"
        );
        assert!(!view.expired(t0 + Duration::from_secs(59)));
        assert!(view.expired(t0 + Duration::from_secs(60)));

        // Deletion: the ref goes at once, the snapshot after the linger period.
        apply(&f, &mut view, &[], t0 + Duration::from_secs(1));
        assert!(matches!(
            resolve(&f.core, "c/models--o--r/refs/main"),
            Err(FsError::NotFound)
        ));
        assert_eq!(names(&f.core, "c/models--o--r/snapshots"), [C1, C2]);
        assert!(
            f.core.store_in_use(&StoreId::from_seq(1)),
            "a lingering snapshot holds its store"
        );
        apply(&f, &mut view, &[], t0 + Duration::from_secs(61));
        assert!(matches!(resolve(&f.core, "c"), Err(FsError::NotFound)));

        // A snapshot that comes back stops lingering.
        apply(&f, &mut view, &[served("m", "o/r", "main", &a1, s1)], t0);
        apply(&f, &mut view, &[], t0);
        apply(&f, &mut view, &[served("m", "o/r", "main", &a1, s1)], t0);
        assert!(!view.expired(t0 + Duration::from_secs(3600)));
    }

    /// A reader that resolves the ref and then reads the snapshot it names, while the ref
    /// flips between two commits: it always finds the snapshot and the right bytes.
    #[test]
    fn concurrent_reader_never_sees_a_half_updated_view() {
        let f = Arc::new(fixture());
        let s1 = f.stores[0].clone();
        let a1 = artifact(&s1.store, C1, 10, &[("f", b"one"), ("g/h", b"1")]);
        let a2 = artifact(&s1.store, C2, 20, &[("f", b"two"), ("g/h", b"2")]);
        let mut view = HfCacheView::new(vec!["c".into()], Duration::from_secs(60));
        let now = Instant::now();
        apply(&f, &mut view, &[served("m", "o/r", "main", &a1, &s1)], now);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (f, stop) = (f.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut seen = std::collections::BTreeSet::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let commit = read(&f.core, "c/models--o--r/refs/main").unwrap();
                    let commit = String::from_utf8(commit).unwrap();
                    let base = format!("c/models--o--r/snapshots/{commit}");
                    let want: (&[u8], &[u8]) = if commit == C1 {
                        (b"one", b"1")
                    } else {
                        (b"two", b"2")
                    };
                    assert_eq!(read(&f.core, &format!("{base}/f")).unwrap(), want.0);
                    assert_eq!(read(&f.core, &format!("{base}/g/h")).unwrap(), want.1);
                    seen.insert(commit);
                }
                seen
            })
        };
        for i in 0..400 {
            let a = if i % 2 == 0 { &a2 } else { &a1 };
            apply(&f, &mut view, &[served("m", "o/r", "main", a, &s1)], now);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let seen = reader.join().expect("reader saw an error");
        assert!(!seen.is_empty());
    }

    #[test]
    fn odd_revisions_and_clashes() {
        let f = fixture();
        let s1 = &f.stores[0];
        let a1 = artifact(&s1.store, C1, 10, &[("f", b"one")]);
        let not_a_commit = artifact(&s1.store, "v1", 10, &[("g", b"g")]);
        let mut view = HfCacheView::new(vec!["c".into()], Duration::ZERO);
        apply(
            &f,
            &mut view,
            &[
                served("a", "o/r", "refs/pr/1", &a1, s1),
                served("b", "o/r", "feature", &a1, s1),
                served("c", "o/r", "feature/x", &a1, s1),
                served("d", "o/r", "./x", &a1, s1),
                served("e", "o/s", "main", &not_a_commit, s1),
            ],
            Instant::now(),
        );
        assert_eq!(
            read(&f.core, "c/models--o--r/refs/refs/pr/1").unwrap(),
            C1.as_bytes(),
            "a revision with '/' is a nested ref, as the library writes it"
        );
        assert_eq!(
            read(&f.core, "c/models--o--r/refs/feature").unwrap(),
            C1.as_bytes()
        );
        assert_eq!(names(&f.core, "c/models--o--r/refs"), ["feature", "refs"]);
        assert_eq!(
            view.left_out(),
            [LeftOutRef {
                model: "c".into(),
                repo: "o/r".into(),
                revision: "feature/x".into(),
                shown: "feature".into(),
            }],
            "the ref that nests with `feature` is reported, not dropped silently"
        );
        assert_eq!(
            names(&f.core, "c"),
            ["models--o--r"],
            "no commit, no snapshot"
        );
    }

    #[test]
    fn inline_files_never_shadow_models() {
        let f = fixture();
        let s1 = &f.stores[0];
        let a1 = artifact(&s1.store, C1, 10, &[("f", b"one")]);
        let entry = MountEntry {
            path: vec!["x".into(), "m".into()],
            artifact: a1.clone(),
            store: s1.clone(),
        };
        let file = |p: &str| InlineFile {
            path: p.split('/').map(str::to_string).collect(),
            content: Arc::from(&b"c"[..]),
        };
        f.core
            .apply_with_files(
                &[entry],
                &[
                    file("x"),
                    file("x/m"),
                    file("x/m/f"),
                    file("x/n"),
                    file("x/n"),
                    file("x/n/o"),
                ],
            )
            .unwrap();
        assert_eq!(names(&f.core, "x"), ["m", "n"]);
        assert_eq!(read(&f.core, "x/m/f").unwrap(), b"one");
        assert_eq!(read(&f.core, "x/n").unwrap(), b"c");
    }

    #[test]
    fn conflicts_with_the_view_directory() {
        let seg = |p: &str| -> Vec<String> { p.split('/').map(str::to_string).collect() };
        assert!(path_conflict(&seg(".hf-cache/x"), &seg(".hf-cache")).is_some());
        assert!(path_conflict(&seg(".hf-cache"), &seg(".hf-cache")).is_some());
        assert!(path_conflict(&seg("a"), &seg("a/cache")).is_some());
        assert!(path_conflict(&seg(".hf-cache2"), &seg(".hf-cache")).is_none());
        assert!(path_conflict(&seg("a/b"), &seg("a/cache")).is_none());
        assert!(path_conflict(&seg("a"), &[]).is_none());
        assert_eq!(repo_folder("org/name"), "models--org--name");
        assert_eq!(repo_folder("gpt2"), "models--gpt2");
    }
}
