//! The filesystem core: everything the mount answers, without FUSE.
//!
//! # Mapping
//! The set of mounted models is one immutable [`Mapping`] snapshot behind an `ArcSwap`. A change
//! (a model appears, disappears, or is re-pointed to another store) builds a new snapshot and
//! swaps it in one atomic store, so every request sees either the old or the new set, never a
//! mix. Building a snapshot is O(models + path segments): the per-file trees are immutable and
//! shared, so re-pointing a 10,000-file model costs the same as a 10-file one.
//!
//! # Inode numbers
//! `ino = slot << 32 | node`. A *slot* is one (model path, artifact) pair, numbered on first use
//! and never renumbered while mounted; `node` is the breadth-first, name-ordered index in the
//! artifact's tree. Slot 0 holds the synthesized directories above model roots (the mount root
//! is `1`, as FUSE requires), numbered per path. Consequences:
//! * re-pointing a model to another store with the same artifact keeps every inode and attribute:
//!   nothing in the kernel needs invalidating, open files keep reading;
//! * a model whose artifact changes gets a new slot, so stale kernel entries can never show new
//!   sizes under old inode numbers; the old slot stays answerable until the kernel forgets it;
//! * lookups by inode are two array/hash indexings, no global per-file table.
//!
//! # Open files and stores
//! An open file holds an [`OpenBlob`], which holds the [`StoreHandle`] of the store it was opened
//! on. Stores are interned by id as weak references: a store is in use exactly while some mapping,
//! retained slot or open file holds its handle. Garbage collection asks [`FsCore::store_in_use`].

pub mod tree;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use dashmap::DashMap;

use crate::artifact::{ArtifactId, Sha256Digest, StoredArtifact};
use crate::store::{Store, StoreId};

pub use tree::{ModelTree, NodeKind};

/// Inode of the mount root (fixed by the FUSE protocol).
pub const ROOT_INO: u64 = 1;
const SLOT_SHIFT: u32 = 32;
/// Slots stay below 2^31 so that `ino + 2` (a readdir offset) fits in the kernel's signed loff_t.
const MAX_SLOT: u32 = (1 << 31) - 1;

fn model_ino(slot: u32, node: u32) -> u64 {
    (u64::from(slot) << SLOT_SHIFT) | u64::from(node)
}

fn split_ino(ino: u64) -> (u32, u32) {
    ((ino >> SLOT_SHIFT) as u32, ino as u32)
}

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("read-only filesystem")]
    ReadOnly,
    #[error("stale file handle")]
    BadHandle,
    #[error("too many models mounted over the daemon's lifetime")]
    OutOfInodes,
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
}

impl FsError {
    /// The one errno mapping of the filesystem.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::NotDir => libc::ENOTDIR,
            FsError::IsDir => libc::EISDIR,
            FsError::ReadOnly => libc::EROFS,
            FsError::BadHandle => libc::EBADF,
            FsError::OutOfInodes => libc::ENOSPC,
            FsError::Io { .. } => libc::EIO,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File,
}

/// Attributes of one node as the mount reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub kind: Kind,
    pub size: u64,
    /// 0o555 for directories, 0o444 for files.
    pub perm: u16,
    pub nlink: u32,
    pub mtime: SystemTime,
    /// True for nodes inside a model: they never change under this inode number, so the kernel
    /// may cache them for as long as it likes. Synthesized directories change as models come and
    /// go.
    pub immutable: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: u64,
    /// Offset to resume after this entry.
    pub offset: u64,
    pub kind: Kind,
    pub name: String,
}

/// A kernel cache entry to drop after a mapping change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Invalidation {
    /// The dentry `name` in directory `parent`.
    Entry { parent: u64, name: String },
    /// The attributes and cached contents of an inode.
    Inode { ino: u64 },
}

/// A store as the filesystem sees it: where its blobs are. Liveness of this handle is what makes
/// a store "in use".
#[derive(Debug)]
pub struct StoreHandle {
    pub id: StoreId,
    pub store: Store,
}

/// An open file: the blob's file descriptor and the store it lives in.
#[derive(Debug)]
pub struct OpenBlob {
    pub file: File,
    pub size: u64,
    pub ino: u64,
    pub blob: Sha256Digest,
    pub store: Arc<StoreHandle>,
}

/// One model to mount.
#[derive(Clone, Debug)]
pub struct MountEntry {
    /// Path below the mount, as segments (validated by the manifest layer).
    pub path: Vec<String>,
    pub artifact: Arc<StoredArtifact>,
    pub store: Arc<StoreHandle>,
}

/// One (path, artifact) pair's tree, alive while mounted or referenced by the kernel.
#[derive(Debug)]
struct Slot {
    id: u32,
    tree: Arc<ModelTree>,
    mtime: SystemTime,
    /// Lookup count the kernel holds on this slot's inodes (FUSE `lookup` minus `forget`).
    kernel_refs: AtomicU64,
    /// The store this slot was served from when it left the mapping.
    retired_store: Mutex<Option<Arc<StoreHandle>>>,
}

#[derive(Debug)]
struct SynthDir {
    parent: u64,
    name: String,
    /// Children by inode (readdir order, offset = ino + 2) and by name (lookup).
    by_ino: BTreeMap<u64, (String, Kind)>,
    by_name: HashMap<String, u64>,
}

#[derive(Debug)]
struct MountedModel {
    slot: Arc<Slot>,
    store: Arc<StoreHandle>,
    path: Vec<String>,
}

/// An immutable snapshot of what is mounted.
#[derive(Debug, Default)]
pub struct Mapping {
    generation: u64,
    synth: HashMap<u64, SynthDir>,
    models: HashMap<u32, MountedModel>,
}

#[derive(Default)]
struct Registries {
    synth_ids: HashMap<Vec<String>, u64>,
    slot_ids: HashMap<(Vec<String>, ArtifactId), u32>,
    next_synth: u64,
    next_slot: u32,
}

pub struct FsCore {
    mapping: ArcSwap<Mapping>,
    /// Slots of the current mapping plus retired slots the kernel still references.
    slots: RwLock<HashMap<u32, Arc<Slot>>>,
    registries: Mutex<Registries>,
    stores: Mutex<HashMap<StoreId, Weak<StoreHandle>>>,
    handles: DashMap<u64, Arc<OpenBlob>>,
    next_fh: AtomicU64,
    /// Shown as the mtime of synthesized directories.
    started: SystemTime,
    /// Serialises `apply` calls (readers never take it).
    apply_lock: Mutex<()>,
    /// Bumped whenever a use of stores or blobs may have ended (a mapping change, a released
    /// file, a retired slot forgotten by the kernel): garbage collection runs when it moved.
    usage_epoch: AtomicU64,
}

impl Default for FsCore {
    fn default() -> Self {
        Self::new()
    }
}

impl FsCore {
    pub fn new() -> Self {
        let mut registries = Registries {
            next_synth: ROOT_INO + 1,
            next_slot: 1,
            ..Default::default()
        };
        registries.synth_ids.insert(Vec::new(), ROOT_INO);
        let mut mapping = Mapping::default();
        mapping
            .synth
            .insert(ROOT_INO, SynthDir::new(ROOT_INO, String::new()));
        // Whole seconds: what stat shows must not change between two calls.
        let started = UNIX_EPOCH
            + Duration::from_secs(
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0),
            );
        Self {
            mapping: ArcSwap::from_pointee(mapping),
            slots: RwLock::new(HashMap::new()),
            registries: Mutex::new(registries),
            stores: Mutex::new(HashMap::new()),
            handles: DashMap::new(),
            next_fh: AtomicU64::new(1),
            started,
            apply_lock: Mutex::new(()),
            usage_epoch: AtomicU64::new(0),
        }
    }

    /// Changes whenever a use of a store or blob may have ended (see `usage_epoch`).
    pub fn usage_epoch(&self) -> u64 {
        self.usage_epoch.load(Ordering::Acquire)
    }

    /// The interned handle of a store. Every user of one store shares one handle, so its
    /// liveness answers [`FsCore::store_in_use`].
    pub fn store_handle(&self, id: &StoreId, store: Store) -> Arc<StoreHandle> {
        let mut stores = self.stores.lock().expect("stores lock");
        if let Some(h) = stores.get(id).and_then(Weak::upgrade) {
            return h;
        }
        let h = Arc::new(StoreHandle {
            id: id.clone(),
            store,
        });
        stores.insert(id.clone(), Arc::downgrade(&h));
        h
    }

    /// True while a mapping, a retained slot or an open file uses the store.
    pub fn store_in_use(&self, id: &StoreId) -> bool {
        let mut stores = self.stores.lock().expect("stores lock");
        match stores.get(id).map(Weak::strong_count) {
            Some(0) => {
                stores.remove(id);
                false
            }
            Some(_) => true,
            None => false,
        }
    }

    /// Blobs the mount may still read, per store: those of every slot (the current mapping and
    /// retired slots the kernel still references) and of open files. Blob garbage collection
    /// never removes these. One pass over the trees for all stores.
    pub fn blobs_in_use(&self) -> HashMap<StoreId, HashSet<Sha256Digest>> {
        let mut out: HashMap<StoreId, HashSet<Sha256Digest>> = HashMap::new();
        let mapping = self.mapping.load();
        let slots = self.slots.read().expect("slots lock");
        for slot in slots.values() {
            let store = match mapping.models.get(&slot.id) {
                Some(m) => m.store.id.clone(),
                None => match slot.retired_store.lock().expect("slot lock").as_ref() {
                    Some(s) => s.id.clone(),
                    None => continue,
                },
            };
            let blobs = out.entry(store).or_default();
            for idx in 0..slot.tree.len() as u32 {
                if let Some(NodeKind::File { blob, .. }) = slot.tree.node(idx).map(|n| &n.kind) {
                    blobs.insert(*blob);
                }
            }
        }
        for h in self.handles.iter() {
            out.entry(h.store.id.clone()).or_default().insert(h.blob);
        }
        out
    }

    pub fn generation(&self) -> u64 {
        self.mapping.load().generation
    }

    /// Replaces the set of mounted models. Entries must have distinct, non-nesting paths (the
    /// reconciler guarantees it); an entry violating that is skipped, never half-applied.
    /// Returns the kernel cache entries to invalidate, to be sent after this call returns.
    pub fn apply(&self, entries: &[MountEntry]) -> Result<Vec<Invalidation>, FsError> {
        let _serial = self.apply_lock.lock().expect("apply lock");
        let old = self.mapping.load_full();
        let mut reg = self.registries.lock().expect("registries lock");

        // Slots first: they are the only O(files) part, and only for new (path, artifact) pairs.
        let mut planned: Vec<(Vec<String>, u32, &MountEntry)> = Vec::with_capacity(entries.len());
        let mut taken: HashSet<&[String]> = HashSet::new();
        for e in entries {
            if e.path.is_empty() || !taken.insert(&e.path) {
                continue;
            }
            let key = (e.path.clone(), e.artifact.id.clone());
            let slot = match reg.slot_ids.get(&key) {
                Some(s) => *s,
                None => {
                    if reg.next_slot > MAX_SLOT {
                        return Err(FsError::OutOfInodes);
                    }
                    let s = reg.next_slot;
                    reg.next_slot += 1;
                    reg.slot_ids.insert(key, s);
                    s
                }
            };
            planned.push((e.path.clone(), slot, e));
        }
        // Drop entries that nest inside another (defence in depth, see above).
        let all_paths: Vec<Vec<String>> = planned.iter().map(|p| p.0.clone()).collect();
        planned.retain(|(path, _, _)| {
            !all_paths
                .iter()
                .any(|other| other.len() < path.len() && path.starts_with(other))
                && !all_paths
                    .iter()
                    .any(|other| other.len() > path.len() && other.starts_with(path))
        });

        let mut new = Mapping {
            generation: old.generation + 1,
            synth: HashMap::new(),
            models: HashMap::new(),
        };
        new.synth
            .insert(ROOT_INO, SynthDir::new(ROOT_INO, String::new()));
        {
            let mut slots = self.slots.write().expect("slots lock");
            for (path, slot_id, entry) in &planned {
                let slot = slots
                    .entry(*slot_id)
                    .or_insert_with(|| {
                        Arc::new(Slot {
                            id: *slot_id,
                            tree: Arc::new(ModelTree::from_artifact(&entry.artifact)),
                            mtime: UNIX_EPOCH + Duration::from_secs(entry.artifact.completed_at),
                            kernel_refs: AtomicU64::new(0),
                            retired_store: Mutex::new(None),
                        })
                    })
                    .clone();
                // Synthesized parents.
                let mut parent = ROOT_INO;
                for depth in 1..path.len() {
                    let prefix = path[..depth].to_vec();
                    let name = prefix[depth - 1].clone();
                    let ino = match reg.synth_ids.get(&prefix) {
                        Some(i) => *i,
                        None => {
                            let i = reg.next_synth;
                            reg.next_synth += 1;
                            reg.synth_ids.insert(prefix, i);
                            i
                        }
                    };
                    new.synth
                        .entry(ino)
                        .or_insert_with(|| SynthDir::new(parent, name.clone()));
                    new.synth
                        .get_mut(&parent)
                        .expect("parent synthesized first")
                        .add(ino, name, Kind::Dir);
                    parent = ino;
                }
                let root = model_ino(*slot_id, ModelTree::ROOT);
                new.synth.get_mut(&parent).expect("parent synthesized").add(
                    root,
                    path[path.len() - 1].clone(),
                    Kind::Dir,
                );
                new.models.insert(
                    *slot_id,
                    MountedModel {
                        slot,
                        store: entry.store.clone(),
                        path: path.clone(),
                    },
                );
            }

            // Retire slots that left the mapping; forget the ones the kernel no longer holds.
            for (id, m) in &old.models {
                if !new.models.contains_key(id) {
                    *m.slot.retired_store.lock().expect("slot lock") = Some(m.store.clone());
                    if m.slot.kernel_refs.load(Ordering::Acquire) == 0 {
                        slots.remove(id);
                    }
                }
            }
            for (id, m) in &new.models {
                // A slot that came back is live again.
                *m.slot.retired_store.lock().expect("slot lock") = None;
                debug_assert_eq!(*id, m.slot.id);
            }
        }
        drop(reg);

        let invalidations = diff(&old, &new);
        self.mapping.store(Arc::new(new));
        self.usage_epoch.fetch_add(1, Ordering::AcqRel);
        Ok(invalidations)
    }

    fn slot(&self, id: u32) -> Option<Arc<Slot>> {
        self.slots.read().expect("slots lock").get(&id).cloned()
    }

    fn synth_attr(&self, ino: u64, dir: &SynthDir) -> Attr {
        let subdirs = dir.by_ino.len() as u32;
        Attr {
            ino,
            kind: Kind::Dir,
            size: 0,
            perm: 0o555,
            nlink: 2 + subdirs,
            mtime: self.started,
            immutable: false,
        }
    }

    fn node_attr(slot: &Slot, node: u32) -> Result<Attr, FsError> {
        let n = slot.tree.node(node).ok_or(FsError::NotFound)?;
        let ino = model_ino(slot.id, node);
        Ok(match &n.kind {
            NodeKind::Dir { subdirs, .. } => Attr {
                ino,
                kind: Kind::Dir,
                size: 0,
                perm: 0o555,
                nlink: 2 + subdirs,
                mtime: slot.mtime,
                immutable: true,
            },
            NodeKind::File { size, .. } => Attr {
                ino,
                kind: Kind::File,
                size: *size,
                perm: 0o444,
                nlink: 1,
                mtime: slot.mtime,
                immutable: true,
            },
        })
    }

    /// Looks up `name` in directory `parent`. Counts as one kernel reference on success.
    pub fn lookup(&self, parent: u64, name: &OsStr) -> Result<Attr, FsError> {
        let name = name.to_str().ok_or(FsError::NotFound)?;
        let (slot_id, node) = split_ino(parent);
        if slot_id == 0 {
            let mapping = self.mapping.load();
            let dir = mapping.synth.get(&parent).ok_or(FsError::NotFound)?;
            let child = *dir.by_name.get(name).ok_or(FsError::NotFound)?;
            let (child_slot, _) = split_ino(child);
            if child_slot == 0 {
                let d = mapping.synth.get(&child).ok_or(FsError::NotFound)?;
                return Ok(self.synth_attr(child, d));
            }
            let m = mapping.models.get(&child_slot).ok_or(FsError::NotFound)?;
            m.slot.kernel_refs.fetch_add(1, Ordering::AcqRel);
            return Self::node_attr(&m.slot, ModelTree::ROOT);
        }
        let slot = self.slot(slot_id).ok_or(FsError::NotFound)?;
        let children_of = slot.tree.node(node).ok_or(FsError::NotFound)?;
        if !matches!(children_of.kind, NodeKind::Dir { .. }) {
            return Err(FsError::NotDir);
        }
        let child = slot.tree.child(node, name).ok_or(FsError::NotFound)?;
        slot.kernel_refs.fetch_add(1, Ordering::AcqRel);
        Self::node_attr(&slot, child)
    }

    /// The kernel dropped `n` references to `ino`.
    pub fn forget(&self, ino: u64, n: u64) {
        let (slot_id, _) = split_ino(ino);
        if slot_id == 0 {
            return;
        }
        // Lookups run concurrently under the read lock; the write lock is taken only to drop a
        // retired slot whose last kernel reference just went.
        let drop_it = {
            let slots = self.slots.read().expect("slots lock");
            let Some(slot) = slots.get(&slot_id) else {
                return;
            };
            let left =
                match slot
                    .kernel_refs
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                        Some(r.saturating_sub(n))
                    }) {
                    Ok(before) | Err(before) => before.saturating_sub(n),
                };
            left == 0 && slot.retired_store.lock().expect("slot lock").is_some()
        };
        if drop_it {
            let mut slots = self.slots.write().expect("slots lock");
            // Re-check under the write lock: a lookup may have raced in, or the slot may have
            // come back into the mapping.
            if let Some(slot) = slots.get(&slot_id) {
                if slot.kernel_refs.load(Ordering::Acquire) == 0
                    && slot.retired_store.lock().expect("slot lock").is_some()
                {
                    slots.remove(&slot_id);
                    self.usage_epoch.fetch_add(1, Ordering::AcqRel);
                }
            }
        }
    }

    pub fn getattr(&self, ino: u64) -> Result<Attr, FsError> {
        let (slot_id, node) = split_ino(ino);
        if slot_id == 0 {
            let mapping = self.mapping.load();
            let dir = mapping.synth.get(&ino).ok_or(FsError::NotFound)?;
            return Ok(self.synth_attr(ino, dir));
        }
        let slot = self.slot(slot_id).ok_or(FsError::NotFound)?;
        Self::node_attr(&slot, node)
    }

    /// Calls `add` for each entry after `offset` until it returns `true` (buffer full).
    /// Offsets: `.` is 1, `..` is 2, any other entry `ino + 2`; entries come in inode order, so
    /// resuming after an offset is stable even while synthesized directories change.
    pub fn readdir(
        &self,
        ino: u64,
        offset: u64,
        mut add: impl FnMut(DirEntry) -> bool,
    ) -> Result<(), FsError> {
        let (slot_id, node) = split_ino(ino);
        let dots = |parent: u64, add: &mut dyn FnMut(DirEntry) -> bool| -> bool {
            if offset < 1
                && add(DirEntry {
                    ino,
                    offset: 1,
                    kind: Kind::Dir,
                    name: ".".into(),
                })
            {
                return true;
            }
            offset < 2
                && add(DirEntry {
                    ino: parent,
                    offset: 2,
                    kind: Kind::Dir,
                    name: "..".into(),
                })
        };
        let after = offset.saturating_sub(2);
        if slot_id == 0 {
            let mapping = self.mapping.load();
            let dir = mapping.synth.get(&ino).ok_or(FsError::NotFound)?;
            if dots(dir.parent, &mut add) {
                return Ok(());
            }
            for (child, (name, kind)) in dir.by_ino.range(after + 1..) {
                if add(DirEntry {
                    ino: *child,
                    offset: child + 2,
                    kind: *kind,
                    name: name.clone(),
                }) {
                    break;
                }
            }
            return Ok(());
        }
        let slot = self.slot(slot_id).ok_or(FsError::NotFound)?;
        let children = slot.tree.children(node).ok_or(FsError::NotDir)?;
        let parent = if node == ModelTree::ROOT {
            self.model_parent_dir(slot_id)
        } else {
            model_ino(slot_id, slot.tree.node(node).map(|n| n.parent).unwrap_or(0))
        };
        if dots(parent, &mut add) {
            return Ok(());
        }
        let start = children.partition_point(|c| model_ino(slot_id, *c) <= after);
        for child in &children[start..] {
            let n = slot.tree.node(*child).ok_or(FsError::NotFound)?;
            let child_ino = model_ino(slot_id, *child);
            let kind = match n.kind {
                NodeKind::Dir { .. } => Kind::Dir,
                NodeKind::File { .. } => Kind::File,
            };
            if add(DirEntry {
                ino: child_ino,
                offset: child_ino + 2,
                kind,
                name: n.name.to_string(),
            }) {
                break;
            }
        }
        Ok(())
    }

    fn model_parent_dir(&self, slot_id: u32) -> u64 {
        let mapping = self.mapping.load();
        let Some(m) = mapping.models.get(&slot_id) else {
            return ROOT_INO;
        };
        let reg = self.registries.lock().expect("registries lock");
        reg.synth_ids
            .get(&m.path[..m.path.len() - 1])
            .copied()
            .unwrap_or(ROOT_INO)
    }

    /// Opens a file for reading: the blob of the store the model is served from *now*. The
    /// returned handle keeps reading that blob whatever happens to the mapping later.
    pub fn open(&self, ino: u64) -> Result<(u64, Arc<OpenBlob>), FsError> {
        let (slot_id, node) = split_ino(ino);
        if slot_id == 0 {
            return Err(FsError::IsDir);
        }
        let (slot, store) = {
            let mapping = self.mapping.load();
            match mapping.models.get(&slot_id) {
                Some(m) => (m.slot.clone(), m.store.clone()),
                None => {
                    let slot = self.slot(slot_id).ok_or(FsError::NotFound)?;
                    let store = slot
                        .retired_store
                        .lock()
                        .expect("slot lock")
                        .clone()
                        .ok_or(FsError::NotFound)?;
                    (slot, store)
                }
            }
        };
        let n = slot.tree.node(node).ok_or(FsError::NotFound)?;
        let (size, blob) = match &n.kind {
            NodeKind::File { size, blob } => (*size, *blob),
            NodeKind::Dir { .. } => return Err(FsError::IsDir),
        };
        let path: PathBuf = store.store.blob_path(&blob);
        let file = File::open(&path).map_err(|source| FsError::Io {
            context: format!("opening blob {}", path.display()),
            source,
        })?;
        let blob = Arc::new(OpenBlob {
            file,
            size,
            ino,
            blob,
            store,
        });
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.insert(fh, blob.clone());
        Ok((fh, blob))
    }

    /// Reads up to `size` bytes at `offset`; short only at end of file.
    pub fn read(&self, fh: u64, offset: u64, size: u32) -> Result<Vec<u8>, FsError> {
        let blob = self.handles.get(&fh).ok_or(FsError::BadHandle)?.clone();
        if offset >= blob.size {
            return Ok(Vec::new());
        }
        let len = (blob.size - offset).min(u64::from(size)) as usize;
        let mut buf = vec![0u8; len];
        let mut done = 0;
        while done < len {
            match blob.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(FsError::Io {
                        context: format!("reading blob of inode {}", blob.ino),
                        source,
                    })
                }
            }
        }
        buf.truncate(done);
        Ok(buf)
    }

    pub fn release(&self, fh: u64) {
        self.handles.remove(&fh);
        self.usage_epoch.fetch_add(1, Ordering::AcqRel);
    }
}

impl SynthDir {
    fn new(parent: u64, name: String) -> Self {
        Self {
            parent,
            name,
            by_ino: BTreeMap::new(),
            by_name: HashMap::new(),
        }
    }

    fn add(&mut self, ino: u64, name: String, kind: Kind) {
        if self.by_name.insert(name.clone(), ino).is_none() {
            self.by_ino.insert(ino, (name, kind));
        }
    }
}

/// What the kernel must forget when `old` becomes `new`: entries whose target changed or went
/// away, and directories whose listing changed.
fn diff(old: &Mapping, new: &Mapping) -> Vec<Invalidation> {
    let mut out = Vec::new();
    for (ino, dir) in &old.synth {
        match new.synth.get(ino) {
            None => out.push(Invalidation::Entry {
                parent: dir.parent,
                name: dir.name.clone(),
            }),
            Some(now) => {
                let mut changed = false;
                for (child, (name, _)) in &dir.by_ino {
                    if now.by_name.get(name) != Some(child) {
                        changed = true;
                        if !(*ino == ROOT_INO && name.is_empty()) {
                            out.push(Invalidation::Entry {
                                parent: *ino,
                                name: name.clone(),
                            });
                        }
                    }
                }
                if changed || now.by_ino.len() != dir.by_ino.len() {
                    out.push(Invalidation::Inode { ino: *ino });
                }
            }
        }
    }
    // Removed synthesized directories were reported above; entries inside them go with them.
    out.sort_by_key(|i| match i {
        Invalidation::Entry { .. } => 0,
        Invalidation::Inode { .. } => 1,
    });
    out.dedup();
    out
}

#[cfg(test)]
mod tests;
