//! The filesystem core: everything the mount answers, without FUSE.
//!
//! # Mapping
//! The set of mounted models is one immutable [`Mapping`] snapshot behind an `ArcSwap`. A change
//! (a model appears, disappears, or is re-pointed to another store) builds a new snapshot and
//! swaps it in one atomic store, so every request sees either the old or the new set, never a
//! mix. Building a snapshot is O(models + path segments): the per-file trees are immutable and
//! shared, so re-pointing a 10,000-file model costs the same as a 10-file one.
//!
//! # Memory
//! Per file, the core adds nothing to the artifact it is given until the kernel asks: a slot
//! shares the mapping's `Arc<StoredArtifact>` and builds its [`ModelTree`] on the first
//! request that needs it. Blob uses (garbage collection) are read from the artifact. So the
//! agent's core, which no kernel talks to, holds no tree at all, and the mount server holds
//! trees only for the models walked since they were mapped, at 8 bytes a file (see
//! [`tree`]).
//!
//! # Inode numbers
//! `ino = slot << 32 | node`. A *slot* is one (model path, artifact) pair, numbered on first use
//! and never renumbered while mounted; `node` is the breadth-first, name-ordered index in the
//! artifact's tree. Slot 0 holds the synthesized directories above model roots (the mount root
//! is `1`, as FUSE requires), numbered per path. Consequences:
//! * re-pointing a model to another store with the same artifact keeps every inode and attribute:
//!   nothing in the kernel needs invalidating, open files keep reading;
//! * a model whose artifact changes gets a new slot, so stale kernel entries can never show new
//!   sizes under old inode numbers;
//! * a slot never comes back: a (path, artifact) mounted again after it left gets a new slot, so
//!   an inode number the kernel was told is deleted never turns live again;
//! * lookups by inode are two array/hash indexings, no global per-file table.
//!
//! # Retired slots
//! A slot that leaves the mapping is *retired*: [`FsCore::apply`] returns a `notify_delete` for
//! each of its entries (deepest first, so the kernel drops the inodes' link counts and sends
//! `FORGET` when their last user goes, instead of keeping them cached until memory runs short),
//! then an [`Invalidation::Detach`]. Until the detach, opens through entries the kernel cached
//! still work on the store the slot was served from (a path walk that raced the change). After
//! it the slot pins no store: lookups and opens of its inodes answer `ESTALE` (the kernel retries
//! a path walk that meets one, with revalidation), so garbage collection depends only on the
//! mapping and open files, never on when the kernel forgets an inode, and no later access can
//! read a removed blob. The slot itself (metadata only) lives until the kernel forgets it.
//!
//! # Open files and stores
//! An open file holds an [`OpenBlob`], which holds the [`StoreHandle`] of the store it was opened
//! on. Stores are interned by id as weak references: a store is in use exactly while some mapping,
//! retired slot not yet detached, or open file holds its handle. Garbage collection asks [`FsCore::store_in_use`].
//! Open files are one table ([`handles`]): each handle's blob and how the kernel reads it (an
//! inode's passthrough registration holds the blob it was made from, and so its store).
//!
//! # Inline files
//! Besides model trees, a mapping can hold small files whose bytes live in the mapping itself
//! ([`InlineFile`]: the `refs/<revision>` files of the Hugging Face cache view, see
//! [`hf_cache`]). They sit in synthesized directories and are numbered like them (slot 0), one
//! inode per (path, content) pair: new content is a new inode, so the kernel can never show new
//! bytes under an old inode or old bytes under a new one, and an inode whose file left the
//! mapping stays answerable (its old content) for a kernel that still holds it, as long as the
//! retired files (those no longer in the mapping) hold at most [`RETIRED_INLINE_BYTES`] in all:
//! beyond that the oldest retired ones are forgotten, so a mapping whose files keep changing
//! cannot grow the process without bound (the kernel is never told when it drops an inline
//! inode; a forgotten one answers `ENOENT`, as a file that is gone). Opening one
//! gives a sealed memfd holding the content, so the FUSE adapter treats it as any other file
//! (passthrough or read-through).
//!
//! # Serving while downloading
//! An entry applied with [`PendingFiles`] ([`FsCore::apply_with_pending`]) shows its complete
//! listing while its files verify one by one; an open of a file not yet verified waits for it
//! (see [`pending`]).
//!
//! # Empty directories
//! A mapping can also name directories that exist with nothing in them (read-only, as every
//! synthesized directory): the paths of models whose files the serving runtime brings
//! (`vendor://`), so that a pod binding such a path finds a directory. One that clashes with a
//! model root, an inline file or a path below either is left out.

pub mod handles;
pub mod hf_cache;
pub mod pending;
pub mod tree;

// Locks here are taken poison-tolerant: a panic in one request handler (answered EIO by the
// transport) must not turn every later request into an error. Every holder leaves the guarded
// state consistent at each point it could panic (no multi-step update spans one).
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;

use modelfs_core::artifact::{ArtifactId, Sha256Digest, StoredArtifact};
use modelfs_core::store::{Store, StoreId};

pub use handles::{Backing, Mode, OpenedHandle, Released, Restored, Unregistered};
pub use pending::{PendingFile, PendingFiles, DEFAULT_PENDING_WAIT};
pub use tree::{ModelTree, NodeKind};

/// What a plain `readdir` passes where `readdirplus` passes attributes (never sent).
const PLACEHOLDER_ATTR: Attr = Attr {
    ino: 0,
    kind: Kind::File,
    size: 0,
    perm: 0,
    nlink: 0,
    mtime: UNIX_EPOCH,
    immutable: true,
};

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
    /// An inode of a model that left the mount after the kernel was told so: it can never
    /// be read again (the kernel retries a path walk that meets it, with revalidation).
    #[error("stale inode of a removed model")]
    Stale,
    #[error("too many models mounted over the daemon's lifetime")]
    OutOfInodes,
    /// A download of a file an open was waiting for failed verification (the agent fetches
    /// it again; a later open waits for that attempt).
    #[error("{file} of model {model} failed verification while the open waited")]
    VerifyFailed { model: String, file: String },
    /// A file that did not verify within the open deadline ([`FsCore::set_pending_wait`]).
    #[error("{file} of model {model} was not verified within {waited:?}")]
    NotVerifiedInTime {
        model: String,
        file: String,
        waited: Duration,
    },
    /// A mapping with an empty, duplicate or nesting path: the reconciler's path rule
    /// guarantees none, so this is a bug upstream; the mapping is left unchanged.
    #[error("mapping refused: {0}")]
    Conflict(String),
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
            FsError::Stale => libc::ESTALE,
            FsError::OutOfInodes => libc::ENOSPC,
            FsError::VerifyFailed { .. } => libc::EIO,
            FsError::NotVerifiedInTime { .. } => libc::ETIMEDOUT,
            FsError::Conflict(_) => libc::EINVAL,
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

/// A kernel cache entry to drop after a mapping change, in the order to send them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Invalidation {
    /// The inode `child`, named `name` in directory `parent`, is gone for good
    /// (`FUSE_NOTIFY_DELETE`): the kernel unhashes the entry and drops the inode's link count,
    /// so it forgets the inode as soon as its last user (an open file, a working directory)
    /// lets go, instead of keeping it cached until memory runs short.
    Delete {
        parent: u64,
        child: u64,
        name: String,
    },
    /// The dentry `name` in directory `parent`.
    Entry { parent: u64, name: String },
    /// The attributes and cached contents of an inode.
    Inode { ino: u64 },
    /// Not a kernel message: every notification before it has been delivered, so the retired
    /// slot stops pinning its store ([`FsCore::detach`]).
    Detach { slot: u32 },
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
    /// sha256 of the content.
    pub blob: Sha256Digest,
    /// `None` for an [`InlineFile`], whose bytes are not in any store.
    pub store: Option<Arc<StoreHandle>>,
}

/// One model to mount.
#[derive(Clone, Debug)]
pub struct MountEntry {
    /// Path below the mount, as segments (validated by the manifest layer).
    pub path: Vec<String>,
    pub artifact: Arc<StoredArtifact>,
    pub store: Arc<StoreHandle>,
}

/// A small file whose bytes the mapping holds (see the module documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InlineFile {
    /// Path below the mount, as segments.
    pub path: Vec<String>,
    pub content: Arc<[u8]>,
}

/// One (path, artifact) pair's tree, alive while mounted or referenced by the kernel.
#[derive(Debug)]
struct Slot {
    id: u32,
    /// Shared with the mapping's entry (and the agent's records): the slot adds no per-file
    /// state of its own until the kernel asks for the tree.
    artifact: Arc<StoredArtifact>,
    /// Built on the first request that needs it (see [`Slot::tree`]).
    tree: OnceLock<ModelTree>,
    mtime: SystemTime,
    /// Lookup count the kernel holds on this slot's inodes (FUSE `lookup` minus `forget`).
    kernel_refs: AtomicU64,
    state: Mutex<SlotState>,
}

/// Life of a slot once it leaves the mapping. A slot never comes back: the same (path,
/// artifact) mounted again gets a new slot, so the kernel never sees a deleted inode number
/// live again.
#[derive(Debug)]
enum SlotState {
    /// In the current mapping (its store is the mapping's).
    Live,
    /// Left the mapping; the kernel has not been told yet, so a path walk may still reach its
    /// inodes through cached entries: opens keep working on what it was served from last.
    Retired(Served),
    /// The kernel was told its entries are gone. It pins no store (open files hold their own):
    /// lookups and opens of its inodes fail with `ESTALE`, so nothing can read a blob that
    /// garbage collection may remove. Metadata (`getattr`) still answers for open files.
    Detached,
}

impl Slot {
    /// The directory tree, built on first use. Only the kernel's requests need it (lookups,
    /// attributes, listings, opens): a core that no kernel talks to (the agent's, see
    /// [`crate`]) never builds one, and the mount server builds the trees of the
    /// models that are actually walked. Blob uses come from the artifact itself.
    fn tree(&self) -> &ModelTree {
        self.tree
            .get_or_init(|| ModelTree::from_artifact(&self.artifact))
    }

    fn retired_store(&self) -> Option<Arc<StoreHandle>> {
        self.retired().map(|s| s.store)
    }

    fn retired(&self) -> Option<Served> {
        match &*self.state.lock().unwrap_or_else(PoisonError::into_inner) {
            SlotState::Retired(s) => Some(s.clone()),
            _ => None,
        }
    }

    fn is_live(&self) -> bool {
        matches!(
            *self.state.lock().unwrap_or_else(PoisonError::into_inner),
            SlotState::Live
        )
    }

    fn is_detached(&self) -> bool {
        matches!(
            *self.state.lock().unwrap_or_else(PoisonError::into_inner),
            SlotState::Detached
        )
    }
}

#[derive(Debug)]
struct SynthDir {
    parent: u64,
    name: String,
    /// Children by inode (readdir order, offset = ino + 2) and by name (lookup).
    by_ino: BTreeMap<u64, (String, Kind)>,
    by_name: HashMap<String, u64>,
    subdirs: u32,
    /// Moves whenever the listing changes (see [`stamp_synth_mtimes`]): the kernel keeps
    /// directory listings cached (the FUSE adapter answers no `OPENDIR`) and drops a cached
    /// listing at the next `opendir` whose directory shows another mtime than when it was cached.
    mtime: SystemTime,
}

#[derive(Debug)]
struct MountedModel {
    slot: Arc<Slot>,
    store: Arc<StoreHandle>,
    path: Vec<String>,
    /// The entry's artifact and pending files as this mapping has them (the slot keeps the
    /// artifact it was created with, which serves names and sizes only: see [`pending`]).
    artifact: Arc<StoredArtifact>,
    pending: Option<Arc<PendingFiles>>,
}

/// Where a slot's bytes come from: the store, the artifact whose blobs hold them and, while
/// the artifact is fetched, which of its files verified.
#[derive(Clone, Debug)]
struct Served {
    store: Arc<StoreHandle>,
    artifact: Arc<StoredArtifact>,
    pending: Option<Arc<PendingFiles>>,
}

impl Served {
    /// The blobs the slot may read through this.
    fn blobs(&self) -> Vec<Sha256Digest> {
        match &self.pending {
            Some(p) => p.verified_blobs().collect(),
            None => self.artifact.blobs().collect(),
        }
    }
}

impl MountedModel {
    fn served(&self) -> Served {
        Served {
            store: self.store.clone(),
            artifact: self.artifact.clone(),
            pending: self.pending.clone(),
        }
    }
}

/// An immutable snapshot of what is mounted.
#[derive(Debug, Default)]
pub struct Mapping {
    generation: u64,
    synth: HashMap<u64, SynthDir>,
    models: HashMap<u32, MountedModel>,
}

/// An inode number the core gave out: what a successor process needs to give the same numbers
/// to the same paths (the kernel holds them across a takeover, see `crate::takeover`). Numbers
/// are never reused: a successor also continues the counters past every number recorded.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum InodeRecord {
    Dir {
        path: Vec<String>,
        ino: u64,
    },
    Slot {
        path: Vec<String>,
        artifact: ArtifactId,
        slot: u32,
    },
    File {
        path: Vec<String>,
        content: Vec<u8>,
        ino: u64,
    },
}

/// Where the core writes the inode numbers it gives out, before the mapping that shows them
/// to the kernel is swapped in (a write-ahead log: no number reaches the kernel unrecorded).
pub type InodeLog = Box<dyn Fn(&[InodeRecord]) -> io::Result<()> + Send + Sync>;

#[derive(Default)]
struct Registries {
    /// Numbers given out since they were last written to the inode log.
    fresh: Vec<InodeRecord>,
    synth_ids: HashMap<Vec<String>, u64>,
    slot_ids: HashMap<(Vec<String>, ArtifactId), u32>,
    inline_ids: HashMap<(Vec<String>, Arc<[u8]>), u64>,
    next_synth: u64,
    next_slot: u32,
}

/// Most bytes the inline files that left the mapping keep (see the module docs).
pub const RETIRED_INLINE_BYTES: usize = 1 << 20;

/// Inline files by inode: those of the current mapping, and retired ones, oldest first.
#[derive(Default)]
struct InlineFiles {
    files: HashMap<u64, InlineFile>,
    live: HashSet<u64>,
    retired: VecDeque<u64>,
    retired_bytes: usize,
}

impl InlineFiles {
    fn content(&self, ino: u64) -> Option<&Arc<[u8]>> {
        self.files.get(&ino).map(|f| &f.content)
    }

    fn len_of(&self, ino: u64) -> usize {
        self.files.get(&ino).map_or(0, |f| f.content.len())
    }

    /// Makes `live` the mapping's files: the others retire, and the oldest retired ones are
    /// forgotten (with their number in `ids`, so the same file mapped again gets a new inode)
    /// while the retired ones hold more than [`RETIRED_INLINE_BYTES`].
    fn set_live(&mut self, live: HashSet<u64>, ids: &mut HashMap<(Vec<String>, Arc<[u8]>), u64>) {
        if self.retired.iter().any(|i| live.contains(i)) {
            self.retired.retain(|i| !live.contains(i));
            self.retired_bytes = self.retired.iter().map(|i| self.len_of(*i)).sum();
        }
        let mut leaving: Vec<u64> = self.live.difference(&live).copied().collect();
        leaving.sort_unstable();
        for ino in leaving {
            self.retired_bytes += self.len_of(ino);
            self.retired.push_back(ino);
        }
        self.live = live;
        while self.retired_bytes > RETIRED_INLINE_BYTES {
            let Some(ino) = self.retired.pop_front() else {
                break;
            };
            if let Some(f) = self.files.remove(&ino) {
                self.retired_bytes -= f.content.len();
                ids.remove(&(f.path, f.content));
            }
        }
    }
}

pub struct FsCore {
    inode_log: Mutex<Option<InodeLog>>,
    mapping: ArcSwap<Mapping>,
    /// Slots of the current mapping plus retired slots the kernel still references.
    slots: RwLock<HashMap<u32, Arc<Slot>>>,
    registries: Mutex<Registries>,
    stores: Mutex<HashMap<StoreId, Weak<StoreHandle>>>,
    /// Open handles and how the kernel reads them ([`handles`]).
    handles: RwLock<handles::HandleTable>,
    /// The inline files of the mapping and the retired ones still kept (see the module docs).
    inline: RwLock<InlineFiles>,
    /// Shown as the mtime of synthesized directories.
    started: SystemTime,
    /// Serialises `apply` calls (readers never take it).
    apply_lock: Mutex<()>,
    /// Bumped whenever a use of stores or blobs may have ended (a mapping change, a released
    /// file, a retired slot forgotten by the kernel): garbage collection runs when it moved.
    usage_epoch: AtomicU64,
    /// The entries and files of the last successful [`FsCore::apply_with_files`]: what the
    /// agent sends to the mount server ([`crate`]).
    last_applied: Mutex<Arc<AppliedMapping>>,
    /// Uses of stores that another process serving this mapping reports (the mount server's
    /// open files and retired slots, seen from the agent).
    remote: RwLock<RemoteUsage>,
    /// Mapping swaps, for opens waiting on a file not yet verified ([`pending`]).
    changes: pending::Changes,
    /// How long such an open waits.
    pending_wait: Mutex<Duration>,
    /// Told (model path, manifest entry) when an open starts waiting on a file, so that the
    /// fetch takes it next.
    wanted: RwLock<Option<WantedHook>>,
    /// Bumped when whoever the hook tells forgot what it was told (a new agent connected):
    /// every waiting open tells it again ([`FsCore::repeat_wanted`]).
    wanted_epoch: AtomicU64,
}

/// See [`FsCore::set_wanted_hook`].
pub type WantedHook = Box<dyn Fn(&[String], &ArtifactId, usize) + Send + Sync>;

/// What a mapping was built from (see [`FsCore::last_applied`]).
#[derive(Debug, Default)]
pub struct AppliedMapping {
    pub generation: u64,
    pub entries: Vec<MountEntry>,
    pub files: Vec<InlineFile>,
    /// The pending files of entries served while downloading, by model path.
    pub pending: HashMap<Vec<String>, Arc<PendingFiles>>,
    /// Empty directories (module docs), as given.
    pub dirs: Vec<Vec<String>>,
}

/// What the mount may still read ([`FsCore::blob_uses`]): the artifacts of its slots by
/// store, shared with the slots rather than copied, and single blobs (open files, the remote
/// server's report). Garbage collection asks for one store's set at a time
/// ([`BlobUses::of`]): a set of every blob of every store was 100,000 digests (about 4 MiB) at
/// 1,000 models x 100 files, built on every pass, and that peak stayed in the agent's
/// resident heap.
#[derive(Debug, Default)]
pub struct BlobUses {
    pub artifacts: HashMap<StoreId, Vec<Arc<StoredArtifact>>>,
    pub blobs: HashMap<StoreId, HashSet<Sha256Digest>>,
}

impl BlobUses {
    /// The blobs of `store` the mount may still read.
    pub fn of(&self, store: &StoreId) -> HashSet<Sha256Digest> {
        let mut out = self.blobs.get(store).cloned().unwrap_or_default();
        for a in self.artifacts.get(store).into_iter().flatten() {
            out.extend(a.blobs());
        }
        out
    }
}

/// Uses of stores held by another process that serves the same mapping (the mount server, as
/// the agent sees it): its open files and retired slots, beyond what the mapping itself uses.
/// `known: false` (no report yet, the mount server away, or a mapping sent but not yet
/// confirmed) makes every store count as in use, so garbage collection waits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteUsage {
    pub known: bool,
    pub stores: HashSet<StoreId>,
    pub blobs: HashMap<StoreId, HashSet<Sha256Digest>>,
    /// The remote's own usage epoch when it measured: a report whose epoch moved counts as a
    /// use that may have ended even if the uses look the same, so a file opened and closed
    /// between two reports still wakes garbage collection.
    pub epoch: u64,
}

impl Default for RemoteUsage {
    /// An in-process core has no remote user.
    fn default() -> Self {
        Self {
            known: true,
            stores: HashSet::new(),
            blobs: HashMap::new(),
            epoch: 0,
        }
    }
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
            handles: RwLock::new(handles::HandleTable::default()),
            inline: RwLock::new(InlineFiles::default()),
            started,
            apply_lock: Mutex::new(()),
            usage_epoch: AtomicU64::new(0),
            last_applied: Mutex::new(Arc::new(AppliedMapping::default())),
            changes: pending::Changes::default(),
            pending_wait: Mutex::new(DEFAULT_PENDING_WAIT),
            wanted: RwLock::new(None),
            wanted_epoch: AtomicU64::new(0),
            remote: RwLock::new(RemoteUsage::default()),
            inode_log: Mutex::new(None),
        }
    }

    /// Installs the inode log (see [`InodeRecord`]); numbers given out before it was
    /// installed are written with the next apply.
    pub fn set_inode_log(&self, log: InodeLog) {
        *self.inode_log.lock().unwrap_or_else(|p| p.into_inner()) = Some(log);
    }

    /// Every entry and listing of the synthesized directories, as invalidations: what a
    /// resumed connection's kernel caches may hold from mappings this process never saw (its
    /// predecessor may have died between a mapping change and the invalidations it called for).
    /// Model trees need none: their content never changes under an inode number.
    pub fn synthesized_invalidations(&self) -> Vec<Invalidation> {
        let mapping = self.mapping.load();
        let mut out = Vec::new();
        for (ino, dir) in &mapping.synth {
            for name in dir.by_name.keys() {
                out.push(Invalidation::Entry {
                    parent: *ino,
                    name: name.clone(),
                });
            }
        }
        out.extend(mapping.synth.keys().map(|&ino| Invalidation::Inode { ino }));
        out
    }

    /// Gives the numbers a previous process gave out to the same paths again, and continues
    /// the counters past them. Call before the first apply.
    pub fn restore_inodes(&self, records: impl IntoIterator<Item = InodeRecord>) {
        let mut reg = self
            .registries
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for r in records {
            match r {
                InodeRecord::Dir { path, ino } => {
                    reg.next_synth = reg.next_synth.max(ino + 1);
                    reg.synth_ids.insert(path, ino);
                }
                InodeRecord::Slot {
                    path,
                    artifact,
                    slot,
                } => {
                    reg.next_slot = reg.next_slot.max(slot + 1);
                    reg.slot_ids.insert((path, artifact), slot);
                }
                InodeRecord::File { path, content, ino } => {
                    reg.next_synth = reg.next_synth.max(ino + 1);
                    reg.inline_ids.insert((path, content.into()), ino);
                }
            }
        }
    }

    /// The entries and files of the last mapping applied.
    pub fn last_applied(&self) -> Arc<AppliedMapping> {
        self.last_applied
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Replaces what the remote server reports (see [`RemoteUsage`]); a change counts as a use
    /// that may have ended.
    pub fn set_remote_usage(&self, usage: RemoteUsage) {
        let mut remote = self.remote.write().unwrap_or_else(PoisonError::into_inner);
        if *remote != usage {
            *remote = usage;
            self.usage_epoch.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// The remote server's uses are unknown until its next report: every store counts as used.
    pub fn set_remote_unknown(&self) {
        let mut remote = self.remote.write().unwrap_or_else(PoisonError::into_inner);
        if remote.known {
            remote.known = false;
            self.usage_epoch.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Uses beyond the current mapping, for a remote peer that knows the mapping: the stores
    /// held by open files or retired slots not yet detached, and the blobs those may read. Of
    /// the mapping's own stores only the ids are listed (the peer derives their blobs itself).
    pub fn usage_beyond_mapping(&self) -> RemoteUsage {
        let mut out = RemoteUsage::default();
        let mapping = self.mapping.load();
        for m in mapping.models.values() {
            out.stores.insert(m.store.id.clone());
        }
        {
            let slots = self.slots.read().unwrap_or_else(PoisonError::into_inner);
            for slot in slots.values() {
                if mapping.models.contains_key(&slot.id) {
                    continue;
                }
                let Some(served) = slot.retired() else {
                    continue;
                };
                out.stores.insert(served.store.id.clone());
                out.blobs
                    .entry(served.store.id.clone())
                    .or_default()
                    .extend(served.blobs());
            }
        }
        for h in self.table().blobs() {
            if let Some(store) = &h.store {
                out.stores.insert(store.id.clone());
                out.blobs
                    .entry(store.id.clone())
                    .or_default()
                    .insert(h.blob);
            }
        }
        out
    }

    /// Whether an open of `blob.ino` now would open this same blob: the inode's model is in the
    /// mapping and served from the blob's store. The FUSE adapter keeps a released file's
    /// passthrough registration (and with it the blob's descriptor) only while this holds, so a
    /// model that left the mapping, or moved to another store, while its file was open does
    /// not keep the old blob on disk once the file is closed.
    pub fn still_serves(&self, blob: &OpenBlob) -> bool {
        let Some(store) = &blob.store else {
            return false;
        };
        let (slot_id, _) = split_ino(blob.ino);
        let mapping = self.mapping.load();
        mapping
            .models
            .get(&slot_id)
            .is_some_and(|m| m.store.id == store.id)
    }

    /// Something outside the core (a registration handed out of the handle table, see
    /// [`Unregistered`]) stopped holding an [`OpenBlob`]: its store may have lost its last user.
    pub fn note_use_ended(&self) {
        self.usage_epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// Changes whenever a use of a store or blob may have ended (see `usage_epoch`).
    pub fn usage_epoch(&self) -> u64 {
        self.usage_epoch.load(Ordering::Acquire)
    }

    /// The interned handle of a store. Every user of one store shares one handle, so its
    /// liveness answers [`FsCore::store_in_use`].
    pub fn store_handle(&self, id: &StoreId, store: Store) -> Arc<StoreHandle> {
        let mut stores = self.stores.lock().unwrap_or_else(PoisonError::into_inner);
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

    /// True while a mapping, a retained slot or an open file uses the store (here or in the
    /// remote server, see [`RemoteUsage`]).
    pub fn store_in_use(&self, id: &StoreId) -> bool {
        {
            let remote = self.remote.read().unwrap_or_else(PoisonError::into_inner);
            if !remote.known || remote.stores.contains(id) {
                return true;
            }
        }
        let mut stores = self.stores.lock().unwrap_or_else(PoisonError::into_inner);
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
    /// never removes these. One pass over the slots for all stores; the slots' blobs are not
    /// copied (see [`BlobUses`]).
    pub fn blob_uses(&self) -> BlobUses {
        let mut out = BlobUses::default();
        let mapping = self.mapping.load();
        let slots = self.slots.read().unwrap_or_else(PoisonError::into_inner);
        for slot in slots.values() {
            let served = match mapping.models.get(&slot.id) {
                Some(m) => m.served(),
                None => match slot.retired() {
                    Some(s) => s,
                    None => continue,
                },
            };
            // A pending entry's artifact lists files whose blobs are not all known yet: only
            // its verified blobs are uses (see [`pending`]).
            match &served.pending {
                Some(p) => out
                    .blobs
                    .entry(served.store.id.clone())
                    .or_default()
                    .extend(p.verified_blobs()),
                None => out
                    .artifacts
                    .entry(served.store.id.clone())
                    .or_default()
                    .push(served.artifact.clone()),
            }
        }
        for h in self.table().blobs() {
            if let Some(store) = &h.store {
                out.blobs
                    .entry(store.id.clone())
                    .or_default()
                    .insert(h.blob);
            }
        }
        // While the remote server's uses are unknown the last report still counts (and
        // `store_in_use` holds every store).
        let remote = self.remote.read().unwrap_or_else(PoisonError::into_inner);
        for (store, blobs) in &remote.blobs {
            out.blobs
                .entry(store.clone())
                .or_default()
                .extend(blobs.iter().copied());
        }
        out
    }

    /// [`FsCore::blob_uses`] as one set of blobs per store.
    pub fn blobs_in_use(&self) -> HashMap<StoreId, HashSet<Sha256Digest>> {
        let uses = self.blob_uses();
        let stores: HashSet<&StoreId> = uses.artifacts.keys().chain(uses.blobs.keys()).collect();
        stores
            .into_iter()
            .map(|s| (s.clone(), uses.of(s)))
            .collect()
    }

    pub fn generation(&self) -> u64 {
        self.mapping.load().generation
    }

    /// Replaces the set of mounted models. Entries must have distinct, non-empty, non-nesting
    /// paths (the reconciler's path rule guarantees it); otherwise the whole call fails with
    /// [`FsError::Conflict`] and the mapping stays as it was: never half-applied, nothing
    /// silently dropped. Returns the kernel cache entries to invalidate, to be sent after this
    /// call returns.
    pub fn apply(&self, entries: &[MountEntry]) -> Result<Vec<Invalidation>, FsError> {
        self.apply_with_files(entries, &[])
    }

    /// [`FsCore::apply`] with inline files in the same snapshot. A file whose path is taken by
    /// or nests with a model or another file is skipped (the first of two equal paths wins).
    pub fn apply_with_files(
        &self,
        entries: &[MountEntry],
        files: &[InlineFile],
    ) -> Result<Vec<Invalidation>, FsError> {
        self.apply_mapping(entries, files, &[])
    }

    /// [`FsCore::apply_with_files`] with empty directories (module docs).
    pub fn apply_mapping(
        &self,
        entries: &[MountEntry],
        files: &[InlineFile],
        dirs: &[Vec<String>],
    ) -> Result<Vec<Invalidation>, FsError> {
        self.apply_with_pending(entries, files, dirs, &HashMap::new())
    }

    /// [`FsCore::apply_mapping`] where the entries at the paths of `pending` are served
    /// while downloading: their listing is complete, their files readable as they verify
    /// ([`pending`]). Pending files whose count differs from the entry's manifest refuse the
    /// whole mapping.
    pub fn apply_with_pending(
        &self,
        entries: &[MountEntry],
        files: &[InlineFile],
        dirs: &[Vec<String>],
        pending: &HashMap<Vec<String>, Arc<PendingFiles>>,
    ) -> Result<Vec<Invalidation>, FsError> {
        let inv = self.swap_mapping(entries, files, dirs, pending)?;
        *self
            .last_applied
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Arc::new(AppliedMapping {
            generation: self.generation(),
            entries: entries.to_vec(),
            files: files.to_vec(),
            pending: entries
                .iter()
                .filter_map(|e| Some((e.path.clone(), pending.get(&e.path)?.clone())))
                .collect(),
            dirs: dirs.to_vec(),
        });
        // Opens waiting on a pending file decide again against the new mapping.
        self.changes.bump();
        Ok(inv)
    }

    /// How long an open of a file not yet verified waits ([`pending`]).
    pub fn set_pending_wait(&self, wait: Duration) {
        *self
            .pending_wait
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = wait;
    }

    /// Sets what is told when an open starts waiting on a file not yet verified: the model's
    /// path, its artifact and the file's manifest index (the mount server tells the agent,
    /// whose fetch takes that file next).
    pub fn set_wanted_hook(&self, hook: WantedHook) {
        *self.wanted.write().unwrap_or_else(PoisonError::into_inner) = Some(hook);
    }

    /// Every open waiting on a file tells the hook again, once: the agent it told before is
    /// gone (a restart), and the new one fetches in loader order until it hears which files
    /// opens wait on.
    pub fn repeat_wanted(&self) {
        self.wanted_epoch.fetch_add(1, Ordering::SeqCst);
        self.changes.bump();
    }

    /// Calls the hook of [`FsCore::set_wanted_hook`] (the agent's core, told by the mount
    /// server that an open there waits on a file).
    pub fn tell_wanted(&self, path: &[String], artifact: &ArtifactId, file: usize) {
        if let Some(hook) = &*self.wanted.read().unwrap_or_else(PoisonError::into_inner) {
            hook(path, artifact, file);
        }
    }

    fn swap_mapping(
        &self,
        entries: &[MountEntry],
        files: &[InlineFile],
        dirs: &[Vec<String>],
        pending: &HashMap<Vec<String>, Arc<PendingFiles>>,
    ) -> Result<Vec<Invalidation>, FsError> {
        check_paths(entries)?;
        for e in entries {
            if let Some(p) = pending.get(&e.path) {
                if p.len() != e.artifact.manifest.len() {
                    return Err(FsError::Conflict(format!(
                        "{}: {} pending file states for a manifest of {} files",
                        e.path.join("/"),
                        p.len(),
                        e.artifact.manifest.len()
                    )));
                }
            }
        }
        let _serial = self
            .apply_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let old = self.mapping.load_full();
        let mut reg = self
            .registries
            .lock()
            .unwrap_or_else(PoisonError::into_inner);

        // Slots first: they are the only O(files) part, and only for new (path, artifact) pairs.
        let mut planned: Vec<(Vec<String>, u32, &MountEntry)> = Vec::with_capacity(entries.len());
        for e in entries {
            let key = (e.path.clone(), e.artifact.id.clone());
            let slot = match reg.slot_ids.get(&key) {
                Some(s) => *s,
                None => {
                    if reg.next_slot > MAX_SLOT {
                        return Err(FsError::OutOfInodes);
                    }
                    let s = reg.next_slot;
                    reg.next_slot += 1;
                    reg.fresh.push(InodeRecord::Slot {
                        path: key.0.clone(),
                        artifact: key.1.clone(),
                        slot: s,
                    });
                    reg.slot_ids.insert(key, s);
                    s
                }
            };
            planned.push((e.path.clone(), slot, e));
        }

        let mut deletes = Vec::new();
        let mut detaches = Vec::new();
        let mut new = Mapping {
            generation: old.generation + 1,
            synth: HashMap::new(),
            models: HashMap::new(),
        };
        new.synth
            .insert(ROOT_INO, SynthDir::new(ROOT_INO, String::new()));
        {
            let mut slots = self.slots.write().unwrap_or_else(PoisonError::into_inner);
            for (path, slot_id, entry) in &planned {
                let slot = slots
                    .entry(*slot_id)
                    .or_insert_with(|| {
                        Arc::new(Slot {
                            id: *slot_id,
                            artifact: entry.artifact.clone(),
                            tree: OnceLock::new(),
                            mtime: UNIX_EPOCH + Duration::from_secs(entry.artifact.completed_at),
                            kernel_refs: AtomicU64::new(0),
                            state: Mutex::new(SlotState::Live),
                        })
                    })
                    .clone();
                let parent = Self::synthesize_parents(&mut reg, &mut new, path);
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
                        artifact: entry.artifact.clone(),
                        pending: pending.get(path).cloned(),
                    },
                );
            }

            // Retire slots that left the mapping (forgetting the ones the kernel no longer
            // holds) and tell the kernel their entries are gone, deepest first so that every
            // entry is still findable when its turn comes; then detach them.
            for (id, m) in &old.models {
                if !new.models.contains_key(id) {
                    *m.slot.state.lock().unwrap_or_else(PoisonError::into_inner) =
                        SlotState::Retired(m.served());
                    reg.slot_ids
                        .remove(&(m.path.clone(), m.slot.artifact.id.clone()));
                    if m.slot.kernel_refs.load(Ordering::Acquire) == 0 {
                        slots.remove(id);
                    }
                    let parent = reg
                        .synth_ids
                        .get(&m.path[..m.path.len() - 1])
                        .copied()
                        .unwrap_or(ROOT_INO);
                    deletes.extend(delete_tree(&m.slot, parent, &m.path[m.path.len() - 1]));
                    detaches.push(Invalidation::Detach { slot: *id });
                }
            }
        }
        self.place_inline_files(&mut reg, &mut new, &planned, files);
        Self::place_empty_dirs(&mut reg, &mut new, &planned, files, dirs);
        if !reg.fresh.is_empty() {
            if let Some(log) = &*self.inode_log.lock().unwrap_or_else(|p| p.into_inner()) {
                // Kept for the next apply if the write fails: this one is refused, so none of
                // the new numbers reaches the kernel.
                log(&reg.fresh).map_err(|source| FsError::Io {
                    context: "recording inode numbers".into(),
                    source,
                })?;
            }
            reg.fresh.clear();
        }
        drop(reg);

        stamp_synth_mtimes(&old, &mut new, SystemTime::now());
        let mut invalidations = deletes;
        invalidations.extend(diff(&old, &new));
        invalidations.extend(detaches);
        self.mapping.store(Arc::new(new));
        self.usage_epoch.fetch_add(1, Ordering::AcqRel);
        Ok(invalidations)
    }

    /// Adds `files` to `new`, below synthesized directories, skipping any whose path clashes
    /// with a model root, a directory on the way to one, or an earlier file.
    fn place_inline_files(
        &self,
        reg: &mut Registries,
        new: &mut Mapping,
        planned: &[(Vec<String>, u32, &MountEntry)],
        files: &[InlineFile],
    ) {
        let mut inline = self.inline.write().unwrap_or_else(PoisonError::into_inner);
        if files.is_empty() && inline.live.is_empty() {
            return;
        }
        let mut live = HashSet::with_capacity(files.len());
        // Paths that must stay directories (every proper prefix of a taken path) and paths
        // taken by a model root or a file: O(total segments).
        let mut dirs: HashSet<&[String]> = HashSet::new();
        let mut leaves: HashSet<&[String]> = HashSet::new();
        for (path, _, _) in planned {
            leaves.insert(path);
            for depth in 1..path.len() {
                dirs.insert(&path[..depth]);
            }
        }
        for f in files {
            let path = f.path.as_slice();
            let clash = path.is_empty()
                || dirs.contains(path)
                || (1..=path.len()).any(|depth| leaves.contains(&path[..depth]));
            if clash {
                continue;
            }
            leaves.insert(path);
            for depth in 1..path.len() {
                dirs.insert(&path[..depth]);
            }
            let parent = Self::synthesize_parents(reg, new, path);
            let key = (f.path.clone(), f.content.clone());
            let before = reg.next_synth;
            let ino = intern(&mut reg.inline_ids, &mut reg.next_synth, key);
            if ino >= before {
                reg.fresh.push(InodeRecord::File {
                    path: f.path.clone(),
                    content: f.content.to_vec(),
                    ino,
                });
            }
            inline.files.entry(ino).or_insert_with(|| f.clone());
            live.insert(ino);
            new.synth.get_mut(&parent).expect("parent synthesized").add(
                ino,
                path[path.len() - 1].clone(),
                Kind::File,
            );
        }
        inline.set_live(live, &mut reg.inline_ids);
    }

    /// Adds the empty directories `dirs` to `new`, skipping any that is empty, has an invalid
    /// segment, or lies at or below a model root or an inline file.
    fn place_empty_dirs(
        reg: &mut Registries,
        new: &mut Mapping,
        planned: &[(Vec<String>, u32, &MountEntry)],
        files: &[InlineFile],
        dirs: &[Vec<String>],
    ) {
        if dirs.is_empty() {
            return;
        }
        let leaves: HashSet<&[String]> = planned
            .iter()
            .map(|(path, _, _)| path.as_slice())
            .chain(files.iter().map(|f| f.path.as_slice()))
            .collect();
        for dir in dirs {
            let clash = dir.is_empty()
                || dir
                    .iter()
                    .any(|s| s.is_empty() || s == "." || s == ".." || s.contains(['/', '\0']))
                || (1..=dir.len()).any(|depth| leaves.contains(&dir[..depth]));
            if clash {
                continue;
            }
            // Every proper prefix of `dir` plus one more segment: `dir` itself included.
            let mut with_child = dir.clone();
            with_child.push(String::new());
            Self::synthesize_parents(reg, new, &with_child);
        }
    }

    /// Synthesized directories for every proper prefix of `path`; returns the innermost.
    fn synthesize_parents(reg: &mut Registries, new: &mut Mapping, path: &[String]) -> u64 {
        let mut parent = ROOT_INO;
        for depth in 1..path.len() {
            let prefix = path[..depth].to_vec();
            let name = prefix[depth - 1].clone();
            let before = reg.next_synth;
            let ino = intern(&mut reg.synth_ids, &mut reg.next_synth, prefix.clone());
            if ino >= before {
                reg.fresh.push(InodeRecord::Dir { path: prefix, ino });
            }
            new.synth
                .entry(ino)
                .or_insert_with(|| SynthDir::new(parent, name.clone()));
            new.synth
                .get_mut(&parent)
                .expect("parent synthesized first")
                .add(ino, name, Kind::Dir);
            parent = ino;
        }
        parent
    }

    fn inline_attr(&self, ino: u64) -> Option<Attr> {
        let inline = self.inline.read().unwrap_or_else(PoisonError::into_inner);
        let content = inline.content(ino)?;
        Some(Attr {
            ino,
            kind: Kind::File,
            size: content.len() as u64,
            perm: 0o444,
            nlink: 1,
            mtime: self.started,
            // One content per inode, for ever.
            immutable: true,
        })
    }

    /// The kernel has been told that a retired slot's entries are gone (every notification
    /// queued before its [`Invalidation::Detach`] was delivered): the slot stops pinning its
    /// store, so garbage collection depends on open files and the mapping only, never on when
    /// the kernel gets round to `FORGET`. A slot still in the mapping is left alone.
    pub fn detach(&self, slot_id: u32) {
        let mut slots = self.slots.write().unwrap_or_else(PoisonError::into_inner);
        let Some(slot) = slots.get(&slot_id) else {
            return;
        };
        {
            let mut state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
            if matches!(*state, SlotState::Live) {
                return;
            }
            *state = SlotState::Detached;
        }
        if slot.kernel_refs.load(Ordering::Acquire) == 0 {
            slots.remove(&slot_id);
        }
    }

    /// Detaches every slot named in `list` at once (no kernel to tell: unit tests, or a
    /// daemon without a mount).
    pub fn detach_all(&self, list: &[Invalidation]) {
        for inv in list {
            if let Invalidation::Detach { slot } = inv {
                self.detach(*slot);
            }
        }
    }

    /// Retired slots still known (the kernel holds some of their inodes), and how many of
    /// them still pin a store.
    pub fn retired_slots(&self) -> (usize, usize) {
        let mapping = self.mapping.load();
        let slots = self.slots.read().unwrap_or_else(PoisonError::into_inner);
        let retired = slots
            .keys()
            .filter(|id| !mapping.models.contains_key(id))
            .count();
        let pinning = slots
            .values()
            .filter(|s| s.retired_store().is_some())
            .count();
        (retired, pinning)
    }

    fn slot(&self, id: u32) -> Option<Arc<Slot>> {
        self.slots
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id)
            .cloned()
    }

    fn synth_attr(&self, ino: u64, dir: &SynthDir) -> Attr {
        Attr {
            ino,
            kind: Kind::Dir,
            size: 0,
            perm: 0o555,
            nlink: 2 + dir.subdirs,
            mtime: dir.mtime.max(self.started),
            immutable: false,
        }
    }

    fn node_attr(slot: &Slot, node: u32) -> Result<Attr, FsError> {
        let n = slot.tree().node(node).ok_or(FsError::NotFound)?;
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
                if let Some(d) = mapping.synth.get(&child) {
                    return Ok(self.synth_attr(child, d));
                }
                return self.inline_attr(child).ok_or(FsError::NotFound);
            }
            let m = mapping.models.get(&child_slot).ok_or(FsError::NotFound)?;
            m.slot.kernel_refs.fetch_add(1, Ordering::AcqRel);
            return Self::node_attr(&m.slot, ModelTree::ROOT);
        }
        let slot = self.slot(slot_id).ok_or(FsError::NotFound)?;
        if slot.is_detached() {
            return Err(FsError::Stale);
        }
        let children_of = slot.tree().node(node).ok_or(FsError::NotFound)?;
        if !matches!(children_of.kind, NodeKind::Dir { .. }) {
            return Err(FsError::NotDir);
        }
        let child = slot.tree().child(node, name).ok_or(FsError::NotFound)?;
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
            let slots = self.slots.read().unwrap_or_else(PoisonError::into_inner);
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
            left == 0 && !slot.is_live()
        };
        if drop_it {
            let mut slots = self.slots.write().unwrap_or_else(PoisonError::into_inner);
            // Re-check under the write lock: a lookup may have raced in, or the slot may have
            // come back into the mapping.
            if let Some(slot) = slots.get(&slot_id) {
                if slot.kernel_refs.load(Ordering::Acquire) == 0 && !slot.is_live() {
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
            if let Some(dir) = mapping.synth.get(&ino) {
                return Ok(self.synth_attr(ino, dir));
            }
            return self.inline_attr(ino).ok_or(FsError::NotFound);
        }
        let slot = self.slot(slot_id).ok_or(FsError::NotFound)?;
        Self::node_attr(&slot, node)
    }

    /// Calls `add` for each entry after `offset` until it returns `true` (buffer full: that
    /// entry was not taken).
    /// Offsets: `.` is 1, `..` is 2, any other entry `ino + 2`; entries come in inode order, so
    /// resuming after an offset is stable even while synthesized directories change.
    pub fn readdir(
        &self,
        ino: u64,
        offset: u64,
        mut add: impl FnMut(DirEntry) -> bool,
    ) -> Result<(), FsError> {
        self.list(ino, offset, false, |e, _| add(e))
    }

    /// `READDIRPLUS`: [`FsCore::readdir`] with each entry's attributes, so a tree walk needs
    /// no `lookup` per entry. The kernel links every returned entry except `.` and `..` into
    /// its cache and takes one lookup reference on it, exactly as for a `lookup`; so each
    /// entry `add` takes (returns `false`) counts one kernel reference, balanced by `forget`.
    /// Like a lookup, it answers `ESTALE` in a detached slot (the kernel must not gain new
    /// references to inodes of a removed model).
    pub fn readdirplus(
        &self,
        ino: u64,
        offset: u64,
        add: impl FnMut(DirEntry, &Attr) -> bool,
    ) -> Result<(), FsError> {
        self.list(ino, offset, true, add)
    }

    /// The one directory listing behind `readdir` and `readdirplus`. With `plus`, attributes
    /// come from the same mapping snapshot and slot as the entries, and references are counted
    /// only for entries taken. Without it, `add` gets a placeholder attribute.
    fn list(
        &self,
        ino: u64,
        offset: u64,
        plus: bool,
        mut add: impl FnMut(DirEntry, &Attr) -> bool,
    ) -> Result<(), FsError> {
        let (slot_id, node) = split_ino(ino);
        // The kernel links no inode for the dots, so their attributes only fill the record.
        let dots = |own: Attr, parent: u64, add: &mut dyn FnMut(DirEntry, &Attr) -> bool| -> bool {
            if offset < 1
                && add(
                    DirEntry {
                        ino,
                        offset: 1,
                        kind: Kind::Dir,
                        name: ".".into(),
                    },
                    &own,
                )
            {
                return true;
            }
            offset < 2
                && add(
                    DirEntry {
                        ino: parent,
                        offset: 2,
                        kind: Kind::Dir,
                        name: "..".into(),
                    },
                    &Attr { ino: parent, ..own },
                )
        };
        let after = offset.saturating_sub(2);
        if slot_id == 0 {
            let mapping = self.mapping.load();
            let Some(dir) = mapping.synth.get(&ino) else {
                return Err(if self.inline_attr(ino).is_some() {
                    FsError::NotDir
                } else {
                    FsError::NotFound
                });
            };
            if dots(self.synth_attr(ino, dir), dir.parent, &mut add) {
                return Ok(());
            }
            for (child, (name, kind)) in dir.by_ino.range(after + 1..) {
                let (child_slot, _) = split_ino(*child);
                let (attr, model) = if !plus {
                    (PLACEHOLDER_ATTR, None)
                } else if child_slot != 0 {
                    let Some(m) = mapping.models.get(&child_slot) else {
                        continue;
                    };
                    (Self::node_attr(&m.slot, ModelTree::ROOT)?, Some(&m.slot))
                } else if let Some(d) = mapping.synth.get(child) {
                    (self.synth_attr(*child, d), None)
                } else if let Some(a) = self.inline_attr(*child) {
                    (a, None)
                } else {
                    continue;
                };
                let entry = DirEntry {
                    ino: *child,
                    offset: child + 2,
                    kind: *kind,
                    name: name.clone(),
                };
                if add(entry, &attr) {
                    break;
                }
                if let Some(slot) = model {
                    slot.kernel_refs.fetch_add(1, Ordering::AcqRel);
                }
            }
            return Ok(());
        }
        let slot = self.slot(slot_id).ok_or(FsError::NotFound)?;
        if plus && slot.is_detached() {
            return Err(FsError::Stale);
        }
        let children = slot.tree().children(node).ok_or(FsError::NotDir)?;
        let parent = if node == ModelTree::ROOT {
            self.model_parent_dir(slot_id)
        } else {
            model_ino(
                slot_id,
                slot.tree().node(node).map(|n| n.parent).unwrap_or(0),
            )
        };
        if dots(Self::node_attr(&slot, node)?, parent, &mut add) {
            return Ok(());
        }
        // Children are contiguous and ascending: resume after `after`.
        let first_after = match after.checked_sub(model_ino(slot_id, 0)) {
            Some(d) => u32::try_from(d + 1).unwrap_or(u32::MAX),
            None => 0,
        };
        for child in children.start.max(first_after)..children.end {
            let n = slot.tree().node(child).ok_or(FsError::NotFound)?;
            let child_ino = model_ino(slot_id, child);
            let kind = match n.kind {
                NodeKind::Dir { .. } => Kind::Dir,
                NodeKind::File { .. } => Kind::File,
            };
            let attr = if plus {
                Self::node_attr(&slot, child)?
            } else {
                PLACEHOLDER_ATTR
            };
            let entry = DirEntry {
                ino: child_ino,
                offset: child_ino + 2,
                kind,
                name: n.name.to_string(),
            };
            if add(entry, &attr) {
                break;
            }
            if plus {
                slot.kernel_refs.fetch_add(1, Ordering::AcqRel);
            }
        }
        Ok(())
    }

    fn model_parent_dir(&self, slot_id: u32) -> u64 {
        let mapping = self.mapping.load();
        let Some(m) = mapping.models.get(&slot_id) else {
            return ROOT_INO;
        };
        let reg = self
            .registries
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        reg.synth_ids
            .get(&m.path[..m.path.len() - 1])
            .copied()
            .unwrap_or(ROOT_INO)
    }

    /// Opens a file's blob for reading: the blob of the store the model is served from *now*.
    /// A handle made of it ([`handles`]) keeps reading that blob whatever happens to the
    /// mapping later. A file of a model served while downloading that has not verified yet is
    /// waited for (see [`pending`]): nothing is opened before it verified.
    fn open_blob(&self, ino: u64) -> Result<OpenBlob, FsError> {
        let (slot_id, node) = split_ino(ino);
        if slot_id == 0 {
            return self.open_inline(ino);
        }
        let wait = *self
            .pending_wait
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let began = Instant::now();
        let deadline = began + wait;
        // The file's failure count when this open began waiting on it.
        let mut waiting_since: Option<u32> = None;
        // The epoch of `wanted_epoch` this open last told the wanted hook in.
        let mut told_epoch: Option<u64> = None;
        loop {
            // Read before the mapping: a swap after this read ends the wait below at once.
            let seen = self.changes.now();
            let (slot, served, path) = {
                let mapping = self.mapping.load();
                match mapping.models.get(&slot_id) {
                    Some(m) => (m.slot.clone(), m.served(), Some(m.path.clone())),
                    None => {
                        // A retired slot the kernel can still reach through cached entries:
                        // what it was served from until the kernel has been told, then
                        // nothing. A wait ends here at once: its model left the mapping.
                        let gone = || {
                            if waiting_since.is_some() {
                                FsError::NotFound
                            } else {
                                FsError::Stale
                            }
                        };
                        let slot = self.slot(slot_id).ok_or_else(gone)?;
                        let served = slot.retired().ok_or_else(gone)?;
                        (slot, served, None)
                    }
                }
            };
            let tree = slot.tree();
            let n = tree.node(node).ok_or(FsError::NotFound)?;
            let size = match n.kind {
                NodeKind::File { size, .. } => size,
                NodeKind::Dir { .. } => return Err(FsError::IsDir),
            };
            let index = tree.entry_index(node).ok_or(FsError::NotFound)?;
            let blob = match served.pending.as_ref().and_then(|p| p.get(index)) {
                None => served.artifact.blob(index),
                Some(PendingFile::Verified(blob)) => blob,
                Some(PendingFile::Waiting { failures }) => {
                    let file = || served.artifact.manifest.entry(index).path.to_string();
                    let Some(path) = path else {
                        // Retired while its file was not verified: never readable through it.
                        return Err(FsError::NotFound);
                    };
                    // Told at the first wait, and again whenever the hook's listener forgot.
                    let epoch = self.wanted_epoch.load(Ordering::SeqCst);
                    if told_epoch != Some(epoch) {
                        told_epoch = Some(epoch);
                        if let Some(hook) =
                            &*self.wanted.read().unwrap_or_else(PoisonError::into_inner)
                        {
                            hook(&path, &served.artifact.id, index);
                        }
                    }
                    match waiting_since {
                        None => waiting_since = Some(failures),
                        Some(before) if failures > before => {
                            return Err(FsError::VerifyFailed {
                                model: path.join("/"),
                                file: file(),
                            })
                        }
                        Some(_) => {}
                    }
                    if Instant::now() >= deadline {
                        let (model, file) = (path.join("/"), file());
                        tracing::warn!(%model, %file, waited_secs = wait.as_secs_f64(), "an open gave up waiting for a file to verify");
                        return Err(FsError::NotVerifiedInTime {
                            model,
                            file,
                            waited: wait,
                        });
                    }
                    self.changes.wait(seen, deadline);
                    continue;
                }
            };
            // Beneath the store's descriptor, without following links, a regular file of the
            // entry's size that only root can write (`Store::open_blob`): the agent writes the
            // stores, and nothing it plants there may make this process serve another file.
            if let (Some(path), Some(_)) = (&path, waiting_since) {
                tracing::debug!(model = %path.join("/"), file = %served.artifact.manifest.entry(index).path, waited_ms = began.elapsed().as_millis() as u64, "an open waited for its file to verify");
            }
            let store = served.store;
            let file = store
                .store
                .open_blob(&blob, size)
                .map_err(|refused| FsError::Io {
                    context: format!("blob {blob} of store {}", store.id),
                    source: io::Error::other(refused),
                })?;
            return Ok(OpenBlob {
                file,
                size,
                ino,
                blob,
                store: Some(store),
            });
        }
    }

    fn open_inline(&self, ino: u64) -> Result<OpenBlob, FsError> {
        let content = self
            .inline
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .content(ino)
            .cloned();
        let Some(content) = content else {
            return Err(if self.getattr(ino).is_ok() {
                FsError::IsDir
            } else {
                FsError::NotFound
            });
        };
        let file = sealed_memfd(&content).map_err(|source| FsError::Io {
            context: format!("creating the memory file of inode {ino}"),
            source,
        })?;
        Ok(OpenBlob {
            file,
            size: content.len() as u64,
            ino,
            blob: Sha256Digest::of(&content),
            store: None,
        })
    }

    /// Reads up to `size` bytes at `offset`; short only at end of file.
    pub fn read(&self, fh: u64, offset: u64, size: u32) -> Result<Vec<u8>, FsError> {
        let blob = self.table().get(fh).ok_or(FsError::BadHandle)?;
        let len = blob.size.saturating_sub(offset).min(u64::from(size)) as usize;
        let mut buf = vec![0u8; len];
        let done = read_blob(&blob, offset, &mut buf)?;
        buf.truncate(done);
        Ok(buf)
    }

    /// [`FsCore::read`] into the caller's buffer (the io_uring transport reads straight into
    /// the ring's payload); returns the bytes read, fewer than `buf.len()` only at the end of
    /// the file.
    pub fn read_into(&self, fh: u64, offset: u64, buf: &mut [u8]) -> Result<usize, FsError> {
        let blob = self.table().get(fh).ok_or(FsError::BadHandle)?;
        read_blob(&blob, offset, buf)
    }
}

/// Refuses entries with an empty path, or two entries whose paths are equal or nest.
/// O(entries x depth).
fn check_paths(entries: &[MountEntry]) -> Result<(), FsError> {
    let mut exact: HashSet<&[String]> = HashSet::new();
    let mut prefixes: HashSet<&[String]> = HashSet::new();
    for e in entries {
        if e.path.is_empty() {
            return Err(FsError::Conflict("an entry has an empty path".into()));
        }
        if !exact.insert(&e.path) {
            return Err(FsError::Conflict(format!(
                "path {} appears twice",
                e.path.join("/")
            )));
        }
        for n in 1..e.path.len() {
            prefixes.insert(&e.path[..n]);
        }
    }
    for e in entries {
        if prefixes.contains(e.path.as_slice())
            || (1..e.path.len()).any(|n| exact.contains(&e.path[..n]))
        {
            return Err(FsError::Conflict(format!(
                "path {} nests with another entry",
                e.path.join("/")
            )));
        }
    }
    Ok(())
}

impl SynthDir {
    fn new(parent: u64, name: String) -> Self {
        Self {
            parent,
            name,
            by_ino: BTreeMap::new(),
            by_name: HashMap::new(),
            subdirs: 0,
            mtime: UNIX_EPOCH,
        }
    }

    fn add(&mut self, ino: u64, name: String, kind: Kind) {
        if self.by_name.insert(name.clone(), ino).is_none() {
            self.by_ino.insert(ino, (name, kind));
            if kind == Kind::Dir {
                self.subdirs += 1;
            }
        }
    }
}

/// The inode number `ids` gives `key`, numbering a new key with the next synthesized inode.
/// Numbers are never reused while mounted, so the kernel never sees an inode change meaning.
fn intern<K: std::hash::Hash + Eq>(ids: &mut HashMap<K, u64>, next: &mut u64, key: K) -> u64 {
    *ids.entry(key).or_insert_with(|| {
        let ino = *next;
        *next += 1;
        ino
    })
}

/// An anonymous memory file holding `content`, sealed against any change (a passthrough
/// backing file must not change under the kernel).
fn sealed_memfd(content: &[u8]) -> io::Result<File> {
    use rustix::fs::{MemfdFlags, SealFlags};
    let fd = rustix::fs::memfd_create(
        "modelfs-inline",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )?;
    let file = File::from(fd);
    file.write_all_at(content, 0)?;
    rustix::fs::fcntl_add_seals(
        &file,
        SealFlags::SEAL | SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE,
    )?;
    Ok(file)
}

/// `FUSE_NOTIFY_DELETE` for every entry of a retired slot, children before their directory
/// (the kernel deletes a directory entry only once it has no children cached), ending with the
/// model root in its synthesized parent `parent`. Entries the kernel never cached cost one
/// `ENOENT` answer each.
fn delete_tree(slot: &Slot, parent: u64, root_name: &str) -> Vec<Invalidation> {
    // A tree never built was never asked for: the kernel holds none of its inodes below the
    // root (lookups and `readdirplus` build it before handing any out).
    let Some(tree) = slot.tree.get() else {
        return vec![Invalidation::Delete {
            parent,
            child: model_ino(slot.id, ModelTree::ROOT),
            name: root_name.to_string(),
        }];
    };
    let mut out = Vec::with_capacity(tree.len());
    for idx in (1..tree.len() as u32).rev() {
        if let Some(n) = tree.node(idx) {
            out.push(Invalidation::Delete {
                parent: model_ino(slot.id, n.parent),
                child: model_ino(slot.id, idx),
                name: n.name.to_string(),
            });
        }
    }
    out.push(Invalidation::Delete {
        parent,
        child: model_ino(slot.id, ModelTree::ROOT),
        name: root_name.to_string(),
    });
    out
}

/// Gives each synthesized directory of `new` the mtime it had in `old` if its listing is the
/// same, else `now`, and always a later one than before for a changed listing (two changes
/// within the clock's resolution still differ). The kernel compares a directory's mtime with the
/// one its cached listing was taken at: a listing cached from a reply that raced a change (read
/// before the swap, parsed after the invalidation) is dropped once the directory's attributes
/// are refreshed, which the invalidation forces.
fn stamp_synth_mtimes(old: &Mapping, new: &mut Mapping, now: SystemTime) {
    for (ino, dir) in &mut new.synth {
        dir.mtime = match old.synth.get(ino) {
            Some(before) if before.by_ino == dir.by_ino => before.mtime,
            Some(before) => now.max(before.mtime + Duration::from_nanos(1)),
            None => now,
        };
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
        _ => 1,
    });
    out.dedup();
    out
}

/// Reads `blob` from `offset` into `buf` until it is full or the blob ends; the bytes read.
fn read_blob(blob: &OpenBlob, offset: u64, buf: &mut [u8]) -> Result<usize, FsError> {
    let len = blob.size.saturating_sub(offset).min(buf.len() as u64) as usize;
    let mut done = 0;
    while done < len {
        match blob.file.read_at(&mut buf[done..len], offset + done as u64) {
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
    Ok(done)
}

#[cfg(test)]
mod tests;
