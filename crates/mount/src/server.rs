//! The mount server process: FUSE session, mapping, open files, the persisted mapping and the
//! agent socket (module docs of [`crate`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, BufReader, IoSlice};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::protocol::{
    self, AgentMessage, RefusedEntry, ServerMessage, WireEntry, WireFile, WireMapping, WireUsage,
    PROTOCOL_VERSION,
};
use crate::confine::ConfinedDir;
use crate::fuse::{FuseConfig, MountHandle};
use crate::metrics::FuseMetrics;
use crate::owndir::OwnDir;
use crate::vfs::{FsCore, InlineFile, MountEntry, PendingFile, PendingFiles};
use modelfs_core::artifact::{ArtifactId, Sha256Digest, StoredArtifact};
use modelfs_core::store::{BlobRefused, StateDir, Store, StoreId};

/// How often the usage of stores is compared with what the agent was last told.
const USAGE_POLL: Duration = Duration::from_millis(100);

/// Longest wait for an agent's `hello`.
const HELLO_DEADLINE: Duration = Duration::from_secs(10);
/// Most agent connections served at once (one thread each). One agent holds one; the rest is
/// room for an agent reconnecting before its old connection's end is seen, and for probes.
/// A connection beyond it is told why and closed at once, without a thread.
pub const MAX_CONNECTIONS: usize = 16;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub mount: PathBuf,
    pub state: PathBuf,
    pub socket: PathBuf,
    pub fuse: FuseConfig,
    /// The keeper's socket (see [`crate::takeover`]); `None`: the mount does not outlive this
    /// process.
    pub keeper: Option<PathBuf>,
}

/// Longest wait at start for the previous mount server of the same mount to be gone.
const PREDECESSOR_WAIT: Duration = Duration::from_secs(15);

/// Longest wait, when handing on, for the keeper to hold the current session.
const HANDOVER_DEPOSIT_WAIT: Duration = Duration::from_secs(2);

/// The mapping file: what was applied last, served again after a restart before any agent
/// speaks. Entries served while downloading are in it with every file waiting (the states
/// change with each verified file and are the agent's to tell again): after a restart their
/// listing stays, opens there wait (those the kernel resends included), and no byte of them
/// is served before the agent's next mapping names it verified.
#[derive(Debug, Default, Serialize, Deserialize)]
struct PersistedMapping {
    protocol: u32,
    mapping: WireMapping,
}

/// The mapping the last apply accepted (refused entries left out) and what of it is on disk.
/// Held for the whole of an apply, which it serializes. Persisting a mapping writes only the
/// artifacts not yet on disk and removes only those no longer named: no look at the directory
/// per apply, whatever the number of models.
#[derive(Default)]
struct Accepted {
    mapping: WireMapping,
    /// `mapping.json` holds `mapping`.
    mapping_written: bool,
    /// Artifacts whose `artifacts/<id>.json` is written and its directory synced.
    artifact_files: HashSet<ArtifactId>,
    /// Listings of pending entries whose `artifacts/<id>.listing.json` is written (apart
    /// from the complete artifact of the same id, which replaces the listing when the fetch
    /// completes and must never be taken for it).
    listing_files: HashSet<ArtifactId>,
}

/// The server's own directory below the state directory.
pub fn own_dir(state: &Path) -> PathBuf {
    state.join(crate::owndir::NAME)
}

/// The default socket path for a state directory.
pub fn default_socket(state: &Path) -> PathBuf {
    own_dir(state).join("agent.sock")
}

/// An agent connection the server talks to.
struct Peer {
    id: u64,
    /// The protocol version negotiated with it.
    protocol: u32,
    writer: Mutex<UnixStream>,
    /// (usage epoch, generation) last reported to it.
    reported: Mutex<Option<(u64, u64)>>,
    /// FUSE counters last reported to it.
    stats: Mutex<BTreeMap<String, u64>>,
}

impl Peer {
    fn send(&self, message: &ServerMessage) -> io::Result<()> {
        let mut w = self.writer.lock().expect("peer writer");
        protocol::write_message(&mut *w, message)
    }
}

struct Shared {
    core: Arc<FsCore>,
    state: StateDir,
    /// `<state>/mount-server` and its `artifacts/` ([`crate::owndir`]).
    own: OwnDir,
    artifacts_dir: OwnDir,
    under: OwnedFd,
    /// `under` as handed to agents: nothing above it reachable ([`crate::confine`]).
    under_for_agents: ConfinedDir,
    /// Model paths (and the artifact there) with a trap beneath the mount
    /// ([`crate::underlay`]).
    trapped: Mutex<HashMap<Vec<String>, ArtifactId>>,
    mount: Mutex<Option<Arc<MountHandle>>>,
    mount_dev: AtomicU64,
    passthrough: AtomicBool,
    /// Artifacts of the mapping being served.
    served_artifacts: Mutex<HashMap<ArtifactId, Arc<StoredArtifact>>>,
    /// (store, artifact) pairs whose blobs were all found when they entered the mapping (or,
    /// after a restart, when the mapping that was persisted entered it; see `check_persisted`).
    verified: Mutex<HashSet<(StoreId, ArtifactId)>>,
    accepted: Mutex<Accepted>,
    /// True while the blobs of the persisted mapping served at start are being checked; an
    /// agent's mapping waits until they are (`wait_checked`).
    checking: Mutex<bool>,
    checked: Condvar,
    peer: Mutex<Option<Arc<Peer>>>,
    next_peer: AtomicU64,
    stopping: AtomicBool,
    metrics: Arc<FuseMetrics>,
    /// Tells this server's counters from a restarted one's.
    instance: u64,
    /// What a fresh mount needs (the session may die and be mounted again).
    mountpoint: PathBuf,
    fuse: FuseConfig,
    keeper: Option<PathBuf>,
    holder: Mutex<Option<crate::takeover::Holder>>,
    /// Verified blobs of pending entries found in their stores (so that each apply checks
    /// only the files that verified since the last one).
    pending_checked: Mutex<HashSet<(StoreId, Sha256Digest)>>,
}

/// A running mount server. [`MountServer::shutdown`] unmounts.
pub struct MountServer {
    shared: Arc<Shared>,
    socket: PathBuf,
    _lock: std::fs::File,
}

fn valid_segment(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\0'])
}

fn valid_store_id(id: &StoreId) -> bool {
    let s = id.as_str();
    !s.is_empty()
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// A manifest that arrived over the socket (or from the persisted file) passes the same
/// validation as one from a source, and its id must be its digest.
fn check_artifact(a: StoredArtifact) -> Result<Arc<StoredArtifact>, String> {
    // Validated in place: a manifest of 100,000 entries is not copied. Its blobs were checked
    // against its entries when it was read.
    let id = a.id.clone();
    if let Err(e) = a.manifest.validate() {
        return Err(format!("artifact {id}: {e}"));
    }
    if a.manifest.id() != id {
        return Err(format!("artifact {id}: id is not its manifest's digest"));
    }
    Ok(Arc::new(a))
}

impl MountServer {
    /// Cleans a stale mount, opens the directory underneath, serves the persisted mapping,
    /// mounts, checks the persisted mapping's blobs in the background, and listens on the
    /// socket.
    pub fn start(config: ServerConfig, metrics: Arc<FuseMetrics>) -> anyhow::Result<Self> {
        use anyhow::Context;
        modelfs_core::store::fsutil::create_dirs(&config.state)
            .with_context(|| format!("creating {}", config.state.display()))?;
        // Stores are reached beneath one descriptor, without following links (module docs).
        let state = StateDir::open(&config.state)
            .and_then(StateDir::anchored)
            .with_context(|| format!("opening state directory {}", config.state.display()))?;
        // The server's own files are reached beneath one descriptor, without following links
        // ([`crate::owndir`]).
        let own = OwnDir::open(&config.state)
            .with_context(|| format!("opening {}", own_dir(&config.state).display()))?;
        let artifacts_dir = own
            .subdir("artifacts")
            .with_context(|| format!("opening {}/artifacts", own.path().display()))?;
        let lock = lock_file(&own)?;

        // A connection kept by the keeper is resumed; else a fresh mount.
        let taken = match &config.keeper {
            Some(keeper) => take_session(keeper, &config.mount),
            None => None,
        };
        let under = match &taken {
            Some(t) => t.taken.under.try_clone()?,
            None => {
                crate::fuse::clean_stale_mount(&config.mount)
                    .with_context(|| format!("preparing {}", config.mount.display()))?;
                std::fs::create_dir_all(&config.mount)
                    .with_context(|| format!("creating {}", config.mount.display()))?;
                // The directory the mount is about to cover: handed to agents for adoption.
                rustix::fs::open(
                    &config.mount,
                    rustix::fs::OFlags::RDONLY
                        | rustix::fs::OFlags::DIRECTORY
                        | rustix::fs::OFlags::CLOEXEC,
                    rustix::fs::Mode::empty(),
                )
                .with_context(|| format!("opening {}", config.mount.display()))?
            }
        };

        let core = Arc::new(FsCore::new());
        // The inode numbers the kernel may hold: a resumed connection gets the same numbers
        // for the same paths; a fresh one starts a new log.
        let inodes = open_inode_log(&own, &core, taken.is_some())
            .with_context(|| format!("opening {}/inodes.log", own.path().display()))?;
        core.set_inode_log(inodes);
        let shared = Arc::new(Shared {
            core: core.clone(),
            state,
            own,
            artifacts_dir,
            under_for_agents: match ConfinedDir::new(under.as_fd()) {
                Ok(confined) => confined,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot make a private copy of the models root's mount; agents get the plain directory underneath the mount, from which `..` leads out of it");
                    ConfinedDir::unconfined(under.as_fd())?
                }
            },
            under,
            trapped: Mutex::new(HashMap::new()),
            mount: Mutex::new(None),
            mount_dev: AtomicU64::new(0),
            passthrough: AtomicBool::new(false),
            served_artifacts: Mutex::new(HashMap::new()),
            verified: Mutex::new(HashSet::new()),
            accepted: Mutex::new(Accepted::default()),
            checking: Mutex::new(false),
            checked: Condvar::new(),
            peer: Mutex::new(None),
            next_peer: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            metrics: metrics.clone(),
            instance: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
                ^ u64::from(std::process::id()),
            mountpoint: config.mount.clone(),
            fuse: config.fuse.clone(),
            keeper: config.keeper.clone(),
            holder: Mutex::new(None),
            pending_checked: Mutex::new(HashSet::new()),
        });
        core.set_pending_wait(config.fuse.pending_wait);
        // An open waiting on a file not yet verified: the agent fetches it next.
        let weak = Arc::downgrade(&shared);
        core.set_wanted_hook(Box::new(move |path, artifact, file| {
            let Some(shared) = weak.upgrade() else {
                return;
            };
            let peer = shared.peer.lock().expect("peer").clone();
            if let Some(peer) = peer.filter(|p| p.protocol >= protocol::PROTOCOL_PENDING) {
                let wanted = ServerMessage::Wanted {
                    path: path.to_vec(),
                    artifact: artifact.clone(),
                    file: file as u32,
                };
                if let Err(e) = peer.send(&wanted) {
                    tracing::debug!(error = %e, "telling the agent which file an open waits on");
                }
            }
        }));
        let started = Instant::now();
        let mut trusted = Vec::new();
        match shared.load_persisted() {
            Ok(Some((artifacts, mapping))) => {
                // Its entries were checked when they were applied: served at once, their
                // blobs checked again once mounted (`check_persisted`).
                shared.verified.lock().expect("verified").extend(
                    mapping
                        .entries
                        .iter()
                        .filter(|e| e.pending.is_none() && artifacts.contains_key(&e.artifact))
                        .map(|e| (e.store.clone(), e.artifact.clone())),
                );
                let (refused, error) = shared.apply(&artifacts, &mapping);
                for r in &refused {
                    tracing::error!(path = %r.path.join("/"), reason = %r.reason, "persisted mapping entry not served");
                }
                let mut verified = shared.verified.lock().expect("verified");
                if let Some(e) = error {
                    tracing::error!(error = %e, "persisted mapping refused");
                    verified.clear();
                } else {
                    tracing::info!(
                        models = mapping.entries.len() - refused.len(),
                        elapsed_ms = started.elapsed().as_millis() as u64,
                        "serving the persisted mapping"
                    );
                }
                trusted.extend(verified.iter().cloned());
            }
            Ok(None) => {}
            Err(e) => tracing::error!(error = %e, "persisted mapping unreadable; starting empty"),
        }

        let mount = match taken {
            Some(t) => {
                let remount = t.remount;
                let mount = crate::fuse::resume(
                    core,
                    metrics,
                    &config.mount,
                    config.fuse.clone(),
                    t.taken.handover,
                )
                .with_context(|| format!("resuming the mount at {}", config.mount.display()))?;
                // The previous process may have died between a mapping change and its
                // invalidations: the kernel forgets every synthesized entry and listing.
                mount.invalidate(shared.core.synthesized_invalidations());
                if remount {
                    mount.mount_again().with_context(|| {
                        format!("mounting the kept connection at {}", config.mount.display())
                    })?;
                }
                // Over io_uring, requests made while no process served wait for a request on
                // their CPU (see the method).
                mount.fetch_queued_ring_requests();
                tracing::info!(
                    mount = %config.mount.display(),
                    previous = %t.taken.meta.server,
                    open_files = mount.journal_len(),
                    remounted = remount,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "resumed the FUSE connection of the previous mount server"
                );
                Arc::new(mount)
            }
            None => Arc::new(
                crate::fuse::mount(core, metrics, &config.mount, config.fuse.clone())
                    .with_context(|| format!("mounting {}", config.mount.display()))?,
            ),
        };
        tracing::info!(
            mount = %config.mount.display(),
            passthrough = mount.passthrough_active(),
            uring = mount.uring_active(),
            "mounted"
        );
        shared
            .passthrough
            .store(mount.passthrough_active(), Ordering::Relaxed);
        shared
            .mount_dev
            .store(mount.connection().dev, Ordering::Relaxed);
        if let Some(keeper) = &config.keeper {
            let deposit = shared.deposit(&mount)?;
            let stop_shared = shared.clone();
            let holder = crate::takeover::Holder::start(keeper.clone(), deposit, move |event| {
                tracing::info!(
                    ?event,
                    "the keeper released the mount; unmounting and exiting"
                );
                let _ = stop_shared.stop_and_unmount();
                std::process::exit(0);
            })?;
            *shared.holder.lock().expect("holder") = Some(holder);
        }
        *shared.mount.lock().expect("mount slot") = Some(mount);
        if !trusted.is_empty() {
            *shared.checking.lock().expect("checking") = true;
            let check_shared = shared.clone();
            std::thread::Builder::new()
                .name("check-persisted".into())
                .spawn(move || check_shared.check_persisted(trusted))?;
        }

        let listener = bind_socket(&config.socket)
            .with_context(|| format!("listening on {}", config.socket.display()))?;
        tracing::info!(socket = %config.socket.display(), "waiting for the agent");
        let accept_shared = shared.clone();
        std::thread::Builder::new()
            .name("agent-accept".into())
            .spawn(move || accept_loop(accept_shared, listener))?;
        let usage_shared = shared.clone();
        std::thread::Builder::new()
            .name("agent-usage".into())
            .spawn(move || usage_loop(usage_shared))?;
        let watch_shared = shared.clone();
        std::thread::Builder::new()
            .name("session-watch".into())
            .spawn(move || watch_session(watch_shared))?;
        Ok(Self {
            shared,
            socket: config.socket,
            _lock: lock,
        })
    }

    /// Stops answering agents, unmounts (lazily if files are still open) and drops the
    /// keeper's copy of the session: the explicit end of the mount.
    pub fn shutdown(&self) -> io::Result<()> {
        let _ = std::fs::remove_file(&self.socket);
        self.shared.stop_and_unmount()
    }

    /// Hands the mount on: makes sure the keeper holds the current session, then returns
    /// without unmounting; the caller exits and a successor resumes the connection (requests
    /// this process read and did not answer are resent to it). Without a keeper the mount
    /// cannot outlive the process: then it unmounts, as [`MountServer::shutdown`].
    pub fn hand_on(&self) -> io::Result<()> {
        self.shared.stopping.store(true, Ordering::Relaxed);
        let holder = self.shared.holder.lock().expect("holder");
        match holder.as_ref() {
            Some(h) if h.wait_deposited(HANDOVER_DEPOSIT_WAIT) => {
                tracing::info!("the keeper holds the mount; handing it on");
                Ok(())
            }
            _ => {
                drop(holder);
                tracing::warn!("no keeper holds the mount; unmounting instead of handing it on");
                self.shutdown()
            }
        }
    }

    /// The mount being served (tests, metrics).
    pub fn mount(&self) -> Option<Arc<MountHandle>> {
        self.shared.mount.lock().expect("mount slot").clone()
    }
}

/// Opens the inode log (see [`crate::vfs::InodeRecord`]): replayed into `core` when the
/// connection is resumed, emptied for a fresh one. Records are JSON lines, one per apply that
/// gave out numbers, appended before that mapping is swapped in.
fn open_inode_log(own: &OwnDir, core: &FsCore, resumed: bool) -> io::Result<crate::vfs::InodeLog> {
    use std::io::Write;
    const NAME: &str = "inodes.log";
    if resumed {
        match own.read(NAME) {
            Ok(bytes) => {
                let mut count = 0usize;
                for line in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
                    match serde_json::from_slice::<Vec<crate::vfs::InodeRecord>>(line) {
                        Ok(records) => {
                            count += records.len();
                            core.restore_inodes(records);
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "an inode log line is unreadable; skipped")
                        }
                    }
                }
                tracing::info!(
                    records = count,
                    "inode numbers of the resumed connection restored"
                );
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                tracing::warn!("no inode log: numbers the kernel holds may not resolve");
            }
            Err(e) => return Err(e),
        }
    }
    let file = own.open_file(
        NAME,
        rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::APPEND | rustix::fs::OFlags::CREATE,
        0o600,
    )?;
    if !resumed {
        file.set_len(0)?;
    }
    let file = Mutex::new(file);
    Ok(Box::new(move |records| {
        let mut line = serde_json::to_vec(records).map_err(io::Error::other)?;
        line.push(b'\n');
        file.lock()
            .unwrap_or_else(|p| p.into_inner())
            .write_all(&line)
    }))
}

/// A session taken from the keeper, and whether it must be mounted at the path again.
struct TakenSession {
    taken: crate::takeover::Taken,
    remount: bool,
}

/// The keeper's session for `mount`, if it can be resumed: its connection is alive and is the
/// mount at the path (or nothing is mounted there: then it is mounted again). A keeper that
/// is away or holds nothing means a fresh mount; so does a session whose connection died.
fn take_session(keeper: &Path, mount: &Path) -> Option<TakenSession> {
    let taken = match crate::takeover::take(keeper, mount, PREDECESSOR_WAIT) {
        Ok(Some(t)) => t,
        Ok(None) => {
            tracing::info!("the keeper holds no session for this mount; mounting afresh");
            return None;
        }
        Err(e) => {
            tracing::warn!(error = %e, "no session from the keeper; mounting afresh");
            return None;
        }
    };
    if crate::takeover::connection_dead(&taken.handover.dev) {
        tracing::warn!("the kept connection has ended; mounting afresh");
        return None;
    }
    match crate::fuse::mount_info_dev(mount) {
        Some(dev) if dev == taken.meta.connection.dev => Some(TakenSession {
            taken,
            remount: false,
        }),
        None => Some(TakenSession {
            taken,
            remount: true,
        }),
        Some(_) => {
            tracing::warn!("another modelfs mount covers the kept one; mounting afresh");
            None
        }
    }
}

/// Notices the FUSE session dying and recovers: a connection that ended (aborted through
/// `fusectl`, or unmounted everywhere) is replaced by a fresh mount; a mount removed from
/// the path while pods keep the connection is mounted there again. A fresh mount that keeps
/// failing ends the process (its supervisor restarts it).
fn watch_session(shared: Arc<Shared>) {
    let mut failures = 0u32;
    loop {
        if shared.stopping.load(Ordering::Relaxed) {
            return;
        }
        let Some(mount) = shared.mount.lock().expect("mount slot").clone() else {
            return;
        };
        match mount.wait_ended(Duration::from_millis(500)) {
            Some(modelfs_fuse_ring::Ended::Failed(e)) => {
                // One thread gave up on a connection that is still there (see the transport):
                // the process exits for a restart, which resumes the connection.
                tracing::error!(error = %e, "a FUSE thread failed for good; exiting for a restart");
                std::process::exit(70);
            }
            Some(ended) => {
                if shared.stopping.load(Ordering::Relaxed) {
                    return;
                }
                tracing::error!(?ended, "the FUSE connection ended; mounting afresh");
                shared.metrics.request("session_restart");
                match crate::fuse::mount(
                    shared.core.clone(),
                    shared.metrics.clone(),
                    &shared.mountpoint,
                    shared.fuse.clone(),
                ) {
                    Ok(fresh) => {
                        failures = 0;
                        let fresh = Arc::new(fresh);
                        shared
                            .mount_dev
                            .store(fresh.connection().dev, Ordering::Relaxed);
                        if let Some(holder) = shared.holder.lock().expect("holder").as_ref() {
                            match shared.deposit(&fresh) {
                                Ok(d) => holder.replace(d),
                                Err(e) => {
                                    tracing::error!(error = %e, "the new session cannot be handed to the keeper")
                                }
                            }
                        }
                        *shared.mount.lock().expect("mount slot") = Some(fresh.clone());
                        // Every kernel cache of the old connection is gone with it.
                        fresh.invalidate(Vec::new());
                        // The agent knows the mount by its device number (its health check):
                        // it reconnects and hears the new one in its welcome.
                        if let Some(peer) = shared.peer.lock().expect("peer").take() {
                            let _ = peer
                                .writer
                                .lock()
                                .expect("peer writer")
                                .shutdown(std::net::Shutdown::Both);
                        }
                        tracing::info!(mount = %shared.mountpoint.display(), "mounted afresh");
                    }
                    Err(e) => {
                        failures += 1;
                        tracing::error!(error = %e, failures, "mounting afresh failed");
                        if failures >= 5 {
                            tracing::error!(
                                "the mount cannot be recovered here; exiting for a restart"
                            );
                            std::process::exit(70);
                        }
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
            }
            None => {
                if shared.stopping.load(Ordering::Relaxed) {
                    return;
                }
                let here = crate::fuse::mount_info_dev(&shared.mountpoint);
                if here != Some(mount.connection().dev) {
                    tracing::warn!(mount = %shared.mountpoint.display(), "the mount was removed from outside; mounting the same connection there again");
                    if let Err(e) = mount.mount_again() {
                        tracing::error!(error = %e, "mounting the connection again failed");
                    } else {
                        shared.metrics.request("remount");
                    }
                }
            }
        }
    }
}

/// Whether a mount server holds the lock of this state directory (it may be serving blobs of
/// stores no record names any more, and files may be open through it).
pub fn running(state: &Path) -> bool {
    let path = own_dir(state).join("lock");
    match std::fs::OpenOptions::new().write(true).open(&path) {
        Ok(file) => {
            rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockShared).is_err()
        }
        Err(_) => false,
    }
}

fn lock_file(own: &OwnDir) -> anyhow::Result<std::fs::File> {
    let path = own.path().join("lock");
    let file = own.open_file(
        "lock",
        rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CREATE,
        0o600,
    )?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).map_err(
        |_| {
            anyhow::anyhow!(
                "another mount server is using {} (lock {})",
                own.path().display(),
                path.display()
            )
        },
    )?;
    Ok(file)
}

/// Binds the agent socket at `path`: mode 0600, and the peer's uid is checked again on every
/// connection (SO_PEERCRED), in case either was loosened.
/// * A missing directory is created 0700: the server's own, only root may enter. An existing
///   one is used as it is and its mode is never changed (it may be a shared directory such as
///   a sticky `/tmp`, or a hostPath others use).
/// * Whatever sits at `path` must be a socket no server listens on (a stale one of an earlier
///   server, replaced); anything else (a file, a directory, a symbolic link, a live socket) is
///   refused with a reason and left as it is.
/// * The socket is bound in a private directory beside `path`, made 0600 there and then renamed
///   into place without replacing anything, so it is never reachable at `path` with looser
///   permissions, and nothing that appeared at `path` meanwhile is replaced.
fn bind_socket(path: &Path) -> io::Result<UnixListener> {
    use std::os::unix::fs::{DirBuilderExt, FileTypeExt};
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .ok_or_else(|| io::Error::other("socket path has no directory"))?;
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::other("socket path has no file name"))?
        .to_string_lossy()
        .into_owned();
    match std::fs::metadata(parent) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(io::Error::other(format!(
                "{} is not a directory",
                parent.display()
            )))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)?,
        Err(e) => return Err(e),
    }
    let stale = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if UnixStream::connect(crate::sockpath::SocketPath::new(path)?.path()).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("another server listens on {}", path.display()),
                ));
            }
            true
        }
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{} exists and is not a socket; it is left as it is",
                    path.display()
                ),
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(e) => return Err(e),
    };
    let private = parent.join(format!(
        ".{name}.{}.{}",
        std::process::id(),
        unique_suffix()
    ));
    std::fs::DirBuilder::new().mode(0o700).create(&private)?;
    let bound = (|| {
        let inner = private.join(&name);
        let listener = UnixListener::bind(crate::sockpath::SocketPath::new(&inner)?.path())?;
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o600))?;
        if stale {
            match std::fs::remove_file(path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        rustix::fs::renameat_with(
            rustix::fs::CWD,
            &inner,
            rustix::fs::CWD,
            path,
            rustix::fs::RenameFlags::NOREPLACE,
        )
        .map_err(|e| {
            io::Error::new(
                io::Error::from(e).kind(),
                format!("placing the socket at {}: {e}", path.display()),
            )
        })?;
        Ok(listener)
    })();
    let _ = std::fs::remove_file(private.join(&name));
    let _ = std::fs::remove_dir(&private);
    bound
}

/// A suffix that tells this server's temporary socket directory from any other.
fn unique_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn accept_loop(shared: Arc<Shared>, listener: UnixListener) {
    let active = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for stream in listener.incoming() {
        if shared.stopping.load(Ordering::Relaxed) {
            return;
        }
        match stream {
            Ok(mut stream) => {
                if active.load(Ordering::Acquire) >= MAX_CONNECTIONS {
                    // Answered from this thread: the line fits the socket's buffer, and the
                    // timeout bounds the write should it not.
                    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
                    let _ = refuse(
                        &mut stream,
                        format!(
                            "too many connections: this mount server serves at most \
                             {MAX_CONNECTIONS} agent connections at once"
                        ),
                    );
                    continue;
                }
                active.fetch_add(1, Ordering::AcqRel);
                let slot = ConnectionSlot(active.clone());
                let shared = shared.clone();
                let spawned =
                    std::thread::Builder::new()
                        .name("agent-conn".into())
                        .spawn(move || {
                            let _slot = slot;
                            if let Err(e) = serve_peer(&shared, stream) {
                                tracing::warn!(error = %e, "agent connection ended");
                            }
                        });
                if let Err(e) = spawned {
                    // The closure (and with it the slot) was dropped.
                    tracing::warn!(error = %e, "no thread for an agent connection");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting an agent connection");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// One connection counted against [`MAX_CONNECTIONS`]; released when its thread ends, however
/// it ends.
struct ConnectionSlot(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn refuse(stream: &mut UnixStream, reason: String) -> io::Result<()> {
    tracing::warn!(%reason, "agent connection refused");
    protocol::write_message(stream, &ServerMessage::Refused { reason })
}

fn serve_peer(shared: &Arc<Shared>, mut stream: UnixStream) -> io::Result<()> {
    let cred = rustix::net::sockopt::socket_peercred(&stream)?;
    if cred.uid.as_raw() != 0 {
        return refuse(
            &mut stream,
            format!(
                "peer uid {} (pid {}) is not root: only root may tell the mount server what to serve",
                cred.uid.as_raw(),
                cred.pid.as_raw_nonzero()
            ),
        );
    }
    stream.set_read_timeout(Some(HELLO_DEADLINE))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let Some(line) = protocol::read_line(&mut reader, protocol::MAX_HELLO_BYTES)? else {
        return Ok(());
    };
    let version = match protocol::hello_range(&line) {
        Ok(theirs) => match protocol::negotiate((protocol::PROTOCOL_MIN, PROTOCOL_VERSION), theirs) {
            Some(v) => v,
            None => {
                return refuse(
                    &mut stream,
                    format!(
                        "no common protocol version: the agent speaks protocol version {} (oldest {}), this mount server (modelfs {}) speaks version {PROTOCOL_VERSION} (oldest {})",
                        theirs.1,
                        theirs.0,
                        env!("CARGO_PKG_VERSION"),
                        protocol::PROTOCOL_MIN,
                    ),
                )
            }
        },
        Err(reason) => return refuse(&mut stream, reason),
    };
    let (agent, held_artifacts) = match serde_json::from_slice::<AgentMessage>(&line) {
        Ok(AgentMessage::Hello {
            agent,
            held_artifacts,
            ..
        }) => (agent, held_artifacts),
        _ => return refuse(&mut stream, "malformed hello".into()),
    };
    stream.set_read_timeout(None)?;
    // Artifacts known on this connection: those served now, named in the welcome, so an agent
    // that reconnects need not send them (protocol module docs), then those it sends.
    let mut artifacts = HashMap::new();
    if held_artifacts {
        artifacts = shared.served_artifacts.lock().expect("served").clone();
    }
    let peer = Arc::new(Peer {
        id: shared.next_peer.fetch_add(1, Ordering::Relaxed),
        protocol: version,
        writer: Mutex::new(stream.try_clone()?),
        reported: Mutex::new(None),
        stats: Mutex::new(BTreeMap::new()),
    });
    {
        // The newest agent wins: an upgraded agent may connect before the old one is gone.
        // "Newest" is the order of the welcomes: the peer is registered before its welcome is
        // sent (and holds its writer meanwhile, so no usage report can come first), so a
        // connection that saw its welcome earlier can never displace a later one.
        let writer = peer.writer.lock().expect("peer writer");
        if let Some(old) = shared.peer.lock().expect("peer").replace(peer.clone()) {
            let _ = old
                .writer
                .lock()
                .expect("peer writer")
                .shutdown(std::net::Shutdown::Both);
        }
        if let Err(e) = send_welcome(
            shared,
            &writer,
            version,
            artifacts.keys().cloned().collect(),
        ) {
            drop(writer);
            let mut current = shared.peer.lock().expect("peer");
            if current.as_ref().is_some_and(|p| p.id == peer.id) {
                *current = None;
            }
            return Err(e);
        }
    }
    tracing::info!(agent = %agent, pid = cred.pid.as_raw_nonzero(), "agent connected");
    // Opens waiting on files of pending entries told the agent before this one: once this
    // agent's mapping is applied (it names the entries it still fetches), they tell it again.
    let mut first_apply = true;
    let result = loop {
        let message = match protocol::read_message::<_, AgentMessage>(
            &mut reader,
            protocol::MAX_MESSAGE_BYTES,
        ) {
            Ok(Some(m)) => m,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        match message {
            AgentMessage::Hello { .. } => {
                tracing::warn!("agent sent hello twice; ignored");
            }
            AgentMessage::Apply {
                seq,
                artifacts: new,
                mapping,
            } => {
                let mut refused = Vec::new();
                for a in new {
                    // One copy per artifact: an agent that reconnects sends every manifest
                    // again, and the served slots keep the one they have (already checked).
                    let same = shared
                        .served_artifacts
                        .lock()
                        .expect("served")
                        .get(&a.id)
                        .filter(|served| ***served == a)
                        .cloned();
                    match same.map_or_else(|| check_artifact(a), Ok) {
                        Ok(a) => {
                            artifacts.insert(a.id.clone(), a);
                        }
                        Err(reason) => {
                            tracing::error!(%reason, "artifact refused");
                        }
                    }
                }
                shared.wait_checked();
                let (more, error) = shared.apply(&artifacts, &mapping);
                refused.extend(more);
                // The agent forgets the same ones (protocol module docs).
                let named: HashSet<&ArtifactId> =
                    mapping.entries.iter().map(|e| &e.artifact).collect();
                artifacts.retain(|id, _| named.contains(id));
                let generation = shared.core.generation();
                peer.send(&ServerMessage::Applied {
                    seq,
                    generation,
                    refused,
                    error,
                })?;
                shared.report_usage(&peer, generation, true)?;
                if std::mem::take(&mut first_apply) {
                    shared.core.repeat_wanted();
                }
            }
        }
    };
    let mut current = shared.peer.lock().expect("peer");
    if current.as_ref().is_some_and(|p| p.id == peer.id) {
        *current = None;
        tracing::info!("agent disconnected; serving the last mapping");
    }
    result
}

fn send_welcome(
    shared: &Shared,
    stream: &UnixStream,
    protocol: u32,
    artifacts: Vec<ArtifactId>,
) -> io::Result<()> {
    let welcome = ServerMessage::Welcome {
        protocol,
        server: env!("CARGO_PKG_VERSION").to_string(),
        mount_dev: shared.mount_dev.load(Ordering::Relaxed),
        passthrough: shared.passthrough.load(Ordering::Relaxed),
        artifacts,
    };
    let mut bytes = serde_json::to_vec(&welcome).map_err(io::Error::other)?;
    bytes.push(b'\n');
    let fds = [shared.under_for_agents.dir()];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
    control.push(rustix::net::SendAncillaryMessage::ScmRights(&fds));
    let sent = rustix::net::sendmsg(
        stream,
        &[IoSlice::new(&bytes)],
        &mut control,
        rustix::net::SendFlags::NOSIGNAL,
    )?;
    if sent < bytes.len() {
        // The descriptor went with the first byte; the rest follows as plain data.
        use std::io::Write;
        let mut s = stream;
        s.write_all(&bytes[sent..])?;
    }
    Ok(())
}

fn usage_loop(shared: Arc<Shared>) {
    while !shared.stopping.load(Ordering::Relaxed) {
        std::thread::sleep(USAGE_POLL);
        let peer = shared.peer.lock().expect("peer").clone();
        if let Some(peer) = peer {
            let generation = shared.core.generation();
            if let Err(e) = shared.report_usage(&peer, generation, false) {
                tracing::debug!(error = %e, "usage report not delivered");
            }
            let counters = shared.metrics.snapshot();
            let changed = {
                let mut last = peer.stats.lock().expect("stats");
                let changed = *last != counters;
                *last = counters.clone();
                changed
            };
            if changed {
                let _ = peer.send(&ServerMessage::Stats {
                    instance: shared.instance,
                    counters,
                });
            }
        }
    }
}

impl Shared {
    /// The session as the keeper should hold it.
    fn deposit(&self, mount: &MountHandle) -> io::Result<crate::takeover::Deposit> {
        let handover = mount.handover()?;
        Ok(crate::takeover::Deposit {
            meta: crate::takeover::SessionMeta {
                mountpoint: self.mountpoint.clone(),
                connection: handover.connection,
                server: env!("CARGO_PKG_VERSION").to_string(),
            },
            dev: handover.dev,
            journal: handover.journal,
            under: self.under.try_clone()?,
            ring: handover.ring,
            kept_rings: mount.kept_rings(),
        })
    }

    /// Stops answering agents, unmounts and drops the keeper's copy of the session.
    fn stop_and_unmount(&self) -> io::Result<()> {
        self.stopping.store(true, Ordering::Relaxed);
        if let Some(peer) = self.peer.lock().expect("peer").take() {
            let _ = peer
                .writer
                .lock()
                .expect("peer writer")
                .shutdown(std::net::Shutdown::Both);
        }
        if let Some(holder) = self.holder.lock().expect("holder").take() {
            holder.close();
        }
        let mount = self.mount.lock().expect("mount slot").take();
        let result = match mount {
            Some(m) => m.unmount(),
            None => Ok(()),
        };
        if let Some(keeper) = &self.keeper {
            if let Err(e) = crate::takeover::release(keeper, &self.mountpoint) {
                tracing::debug!(error = %e, "the keeper did not release the session");
            }
        }
        result
    }

    /// Sends the uses of stores when they changed since the last report (or always).
    fn report_usage(&self, peer: &Peer, generation: u64, always: bool) -> io::Result<()> {
        let epoch = self.core.usage_epoch();
        {
            let mut reported = peer.reported.lock().expect("reported");
            if !always && *reported == Some((epoch, generation)) {
                return Ok(());
            }
            *reported = Some((epoch, generation));
        }
        let usage = self.core.usage_beyond_mapping();
        let mut stores: Vec<StoreId> = usage.stores.into_iter().collect();
        stores.sort();
        let blobs = usage
            .blobs
            .into_iter()
            .map(|(s, b)| {
                let mut b: Vec<_> = b.into_iter().collect();
                b.sort();
                (s, b)
            })
            .collect::<BTreeMap<_, _>>();
        peer.send(&ServerMessage::Usage(WireUsage {
            generation,
            stores,
            blobs,
            epoch,
        }))
    }

    /// Applies a mapping: entries that cannot be served (unknown artifact, missing store or
    /// blob, bad path) are left out with a reason; the others are served in one swap and the
    /// result is persisted. A mapping the core refuses as a whole leaves the old one.
    fn apply(
        &self,
        artifacts: &HashMap<ArtifactId, Arc<StoredArtifact>>,
        mapping: &WireMapping,
    ) -> (Vec<RefusedEntry>, Option<String>) {
        let mut accepted = self.accepted.lock().expect("accepted");
        self.apply_locked(&mut accepted, artifacts, mapping)
    }

    fn apply_locked(
        &self,
        last: &mut Accepted,
        artifacts: &HashMap<ArtifactId, Arc<StoredArtifact>>,
        mapping: &WireMapping,
    ) -> (Vec<RefusedEntry>, Option<String>) {
        let started = Instant::now();
        let mut refused = Vec::new();
        let mut entries = Vec::with_capacity(mapping.entries.len());
        let mut accepted = Vec::with_capacity(mapping.entries.len());
        let mut used_artifacts = HashMap::new();
        // Held for the whole apply (not copied): applies are serialized anyway.
        let mut served = self.served_artifacts.lock().expect("served");
        let mut verified = self.verified.lock().expect("verified");
        let mut now_verified = HashSet::new();
        let mut pending = HashMap::new();
        let mut pending_checked = self.pending_checked.lock().expect("pending checked");
        let mut now_checked = HashSet::new();
        let mut listings = HashMap::new();
        for e in &mapping.entries {
            if let Some(p) = &e.pending {
                match self.pending_entry(e, p, artifacts, &served, &pending_checked) {
                    Ok((entry, checked)) => {
                        // Not listed as held (the agent sends the listing again). Persisted
                        // with every file waiting: a restarted server shows the listing and
                        // keeps the opens a restart resent waiting until the agent says
                        // which files verified; it serves no byte of it before.
                        pending.insert(e.path.clone(), Arc::new(p.clone()));
                        now_checked.extend(checked);
                        listings.insert(e.artifact.clone(), entry.artifact.clone());
                        accepted.push(WireEntry {
                            pending: Some(PendingFiles::all_waiting(p.len())),
                            ..e.clone()
                        });
                        entries.push(entry);
                    }
                    Err(reason) => refused.push(RefusedEntry {
                        path: e.path.clone(),
                        reason,
                    }),
                }
                continue;
            }
            match self.entry(e, artifacts, &served, &verified) {
                Ok(entry) => {
                    now_verified.insert((e.store.clone(), e.artifact.clone()));
                    used_artifacts.insert(e.artifact.clone(), entry.artifact.clone());
                    entries.push(entry);
                    accepted.push(e.clone());
                }
                Err(reason) => refused.push(RefusedEntry {
                    path: e.path.clone(),
                    reason,
                }),
            }
        }
        let mut files = Vec::new();
        let mut accepted_files = Vec::new();
        for f in &mapping.files {
            if f.path.iter().all(|s| valid_segment(s)) && !f.path.is_empty() {
                files.push(InlineFile {
                    path: f.path.clone(),
                    content: f.content.clone().into(),
                });
                accepted_files.push(f.clone());
            } else {
                refused.push(RefusedEntry {
                    path: f.path.clone(),
                    reason: "invalid path".into(),
                });
            }
        }
        let checked = started.elapsed();
        let dirs: Vec<Vec<String>> = mapping
            .dirs
            .iter()
            .filter(|d| !d.is_empty() && d.iter().all(|s| valid_segment(s)))
            .cloned()
            .collect();
        let inv = match self
            .core
            .apply_with_pending(&entries, &files, &dirs, &pending)
        {
            Ok(inv) => inv,
            Err(e) => return (refused, Some(e.to_string())),
        };
        *pending_checked = now_checked;
        drop(pending_checked);
        let swapped = started.elapsed();
        match &*self.mount.lock().expect("mount slot") {
            Some(m) => m.invalidate(inv),
            None => self.core.detach_all(&inv),
        }
        let invalidated = started.elapsed();
        *verified = now_verified;
        drop(verified);
        *served = used_artifacts;
        let persisted = WireMapping {
            entries: accepted,
            files: accepted_files,
            dirs,
        };
        let served_at: HashMap<&[String], &MountEntry> =
            entries.iter().map(|e| (e.path.as_slice(), e)).collect();
        crate::underlay::keep_in_step(
            self.under.as_fd(),
            &mut self.trapped.lock().expect("trapped"),
            persisted
                .entries
                .iter()
                .filter(|e| e.pending.is_none())
                .map(|e| (&e.path, e.artifact.clone())),
            |path, dir| {
                served_at.get(path).is_some_and(|e| {
                    let files = e
                        .artifact
                        .files()
                        .map(|(file, blob)| (file.path, e.store.store.blob_path(&blob)));
                    crate::underlay::holds_blobs(dir, files)
                })
            },
        );
        if let Err(e) = self.persist(last, persisted, &served, &listings) {
            tracing::error!(error = %e, "persisting the mapping failed; a restart would serve an older one");
        }
        drop(served);
        for r in &refused {
            tracing::error!(path = %r.path.join("/"), reason = %r.reason, "mapping entry refused");
        }
        tracing::debug!(
            entries = mapping.entries.len(),
            refused = refused.len(),
            check_us = checked.as_micros() as u64,
            swap_us = (swapped - checked).as_micros() as u64,
            invalidate_us = (invalidated - swapped).as_micros() as u64,
            persist_us = (started.elapsed() - invalidated).as_micros() as u64,
            elapsed_us = started.elapsed().as_micros() as u64,
            "mapping applied"
        );
        (refused, None)
    }

    fn entry(
        &self,
        e: &WireEntry,
        artifacts: &HashMap<ArtifactId, Arc<StoredArtifact>>,
        served: &HashMap<ArtifactId, Arc<StoredArtifact>>,
        verified: &HashSet<(StoreId, ArtifactId)>,
    ) -> Result<MountEntry, String> {
        let artifact = wire_entry_artifact(e, artifacts, served)?;
        // A pair already checked costs no system call: its store's handle is the served one
        // (or, at start, a path: `check_persisted` looks at the disk once mounted).
        let store = if verified.contains(&(e.store.clone(), e.artifact.clone())) {
            self.state.store_unchecked(&e.store)
        } else {
            self.check_blobs(&e.store, &artifact)?
        };
        Ok(MountEntry {
            path: e.path.clone(),
            artifact,
            store: self.core.store_handle(&e.store, store),
        })
    }

    /// A pending entry: its artifact (which lists the files) and store, with every file it
    /// names verified present in the store (those in `checked` were found by an earlier
    /// apply). Returns the blobs found.
    fn pending_entry(
        &self,
        e: &WireEntry,
        pending: &PendingFiles,
        artifacts: &HashMap<ArtifactId, Arc<StoredArtifact>>,
        served: &HashMap<ArtifactId, Arc<StoredArtifact>>,
        checked: &HashSet<(StoreId, Sha256Digest)>,
    ) -> Result<(MountEntry, Vec<(StoreId, Sha256Digest)>), String> {
        let artifact = wire_entry_artifact(e, artifacts, served)?;
        if pending.len() != artifact.manifest.len() {
            return Err(format!(
                "{} file states for an artifact of {} files",
                pending.len(),
                artifact.manifest.len()
            ));
        }
        let store = self
            .state
            .existing_store(&e.store)
            .ok_or_else(|| format!("store {} does not exist", e.store))?;
        let mut found = Vec::new();
        for (i, state) in pending.iter().enumerate() {
            let PendingFile::Verified(blob) = state else {
                continue;
            };
            let key = (e.store.clone(), blob);
            if !checked.contains(&key) {
                let entry = artifact.manifest.entry(i);
                store.check_blob(&blob, entry.size).map_err(|refused| {
                    format!(
                        "blob {blob} of verified file {} in store {} is {refused}",
                        entry.path, e.store
                    )
                })?;
            }
            found.push(key);
        }
        Ok((
            MountEntry {
                path: e.path.clone(),
                artifact,
                store: self.core.store_handle(&e.store, store),
            },
            found,
        ))
    }

    /// The store, if it exists and holds every blob of the artifact with its size.
    fn check_blobs(&self, id: &StoreId, artifact: &StoredArtifact) -> Result<Store, String> {
        let store = self
            .state
            .existing_store(id)
            .ok_or_else(|| format!("store {id} does not exist"))?;
        // Beneath the anchored `stores/` descriptor, links not followed, a regular file of its
        // size owned by root and writable by nobody else (`Store::check_blob`); a reason names
        // the entry, never what a planted link leads to.
        for (entry, blob) in artifact.files() {
            match store.check_blob(&blob, entry.size) {
                Ok(()) => {}
                Err(BlobRefused::Missing) => {
                    return Err(format!(
                        "blob {blob} of {} ({} bytes) is missing from store {id}",
                        entry.path, entry.size
                    ))
                }
                Err(refused) => {
                    return Err(format!(
                        "blob {blob} of {} in store {id} is {refused}",
                        entry.path
                    ))
                }
            }
        }
        Ok(store)
    }

    /// Checks the blobs of the entries of the persisted mapping, served at start on trust
    /// (`trusted`: their (store, artifact) pairs), while the mount already answers. Entries
    /// whose store or blobs are gone lose their trust and the current mapping is applied
    /// again, which leaves them out with the reason logged. An agent's mapping waits until
    /// this is done, so what it hears back is the result of a real check.
    fn check_persisted(&self, trusted: Vec<(StoreId, ArtifactId)>) {
        /// Lets agents' mappings through however the check ends.
        struct Done<'a>(&'a Shared);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                *self.0.checking.lock().expect("checking") = false;
                self.0.checked.notify_all();
            }
        }
        let _done = Done(self);
        let started = Instant::now();
        let artifacts = self.served_artifacts.lock().expect("served").clone();
        let mut lost = Vec::new();
        for (store, id) in &trusted {
            let Some(artifact) = artifacts.get(id) else {
                continue;
            };
            if let Err(reason) = self.check_blobs(store, artifact) {
                tracing::error!(%store, artifact = %id, %reason, "an entry of the persisted mapping is broken; no longer served");
                lost.push((store.clone(), id.clone()));
            }
        }
        if !lost.is_empty() {
            let mut accepted = self.accepted.lock().expect("accepted");
            {
                let mut verified = self.verified.lock().expect("verified");
                for pair in &lost {
                    verified.remove(pair);
                }
            }
            let mapping = accepted.mapping.clone();
            let artifacts = self.served_artifacts.lock().expect("served").clone();
            let (_, error) = self.apply_locked(&mut accepted, &artifacts, &mapping);
            if let Some(e) = error {
                tracing::error!(error = %e, "the mapping without the broken entries was refused");
            }
        }
        tracing::info!(
            entries = trusted.len(),
            broken = lost.len(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "persisted mapping checked"
        );
    }

    /// Returns once the persisted mapping's blobs are checked (at once if they were).
    fn wait_checked(&self) {
        let mut checking = self.checking.lock().expect("checking");
        while *checking {
            checking = self.checked.wait(checking).expect("checking");
        }
    }

    const MAPPING: &'static str = "mapping.json";

    fn artifact_name(id: &ArtifactId) -> String {
        format!("{id}.json")
    }

    fn listing_name(id: &ArtifactId) -> String {
        format!("{id}.listing.json")
    }

    /// Artifacts first (each written once: those `last` does not record as written, their
    /// directory synced once for all), then the mapping that names them (not rewritten when it
    /// is the one on disk), then the artifacts no longer named are removed: a crash anywhere
    /// leaves a mapping whose artifacts exist. Files no mapping names (a stray, or a temporary
    /// file of a write a crash cut short) are removed at start (`load_persisted`).
    fn persist(
        &self,
        last: &mut Accepted,
        mapping: WireMapping,
        artifacts: &HashMap<ArtifactId, Arc<StoredArtifact>>,
        listings: &HashMap<ArtifactId, Arc<StoredArtifact>>,
    ) -> io::Result<()> {
        let unchanged = last.mapping_written && last.mapping == mapping;
        last.mapping = mapping;
        if !unchanged {
            last.mapping_written = false;
        }
        let new: Vec<(&ArtifactId, &Arc<StoredArtifact>)> = artifacts
            .iter()
            .filter(|(id, _)| !last.artifact_files.contains(*id))
            .collect();
        for batch in new.chunks(WRITE_BATCH) {
            let files: Vec<(String, Vec<u8>)> = batch
                .iter()
                .map(|(id, a)| {
                    serde_json::to_vec(&***a)
                        .map(|bytes| (Self::artifact_name(id), bytes))
                        .map_err(io::Error::other)
                })
                .collect::<io::Result<_>>()?;
            self.artifacts_dir.replace_all(&files)?;
        }
        if !new.is_empty() {
            self.artifacts_dir.sync()?;
            last.artifact_files
                .extend(new.into_iter().map(|(id, _)| id.clone()));
        }
        let new_listings: Vec<(String, Vec<u8>)> = listings
            .iter()
            .filter(|(id, _)| !last.listing_files.contains(*id))
            .map(|(id, a)| {
                serde_json::to_vec(&**a)
                    .map(|bytes| (Self::listing_name(id), bytes))
                    .map_err(io::Error::other)
            })
            .collect::<io::Result<_>>()?;
        if !new_listings.is_empty() {
            self.artifacts_dir.replace_all(&new_listings)?;
            self.artifacts_dir.sync()?;
            last.listing_files.extend(listings.keys().cloned());
        }
        if !unchanged {
            let doc = PersistedMapping {
                protocol: PROTOCOL_VERSION,
                mapping: last.mapping.clone(),
            };
            let bytes = serde_json::to_vec(&doc).map_err(io::Error::other)?;
            self.own.atomic_write(Self::MAPPING, &bytes)?;
            last.mapping_written = true;
        }
        self.remove_unnamed(
            &mut last.listing_files,
            |id| listings.contains_key(id),
            Self::listing_name,
            "removing a persisted listing no mapping names",
        );
        if last.artifact_files.len() > artifacts.len() {
            self.remove_unnamed(
                &mut last.artifact_files,
                |id| artifacts.contains_key(id),
                Self::artifact_name,
                "removing a persisted artifact no mapping names",
            );
        }
        Ok(())
    }

    /// Removes the files of `written` (artifacts or listings this process persisted) that the
    /// mapping no longer names (`named` answers false), forgetting each one removed or gone.
    fn remove_unnamed(
        &self,
        written: &mut HashSet<ArtifactId>,
        named: impl Fn(&ArtifactId) -> bool,
        file_name: fn(&ArtifactId) -> String,
        failure: &'static str,
    ) {
        let stale: Vec<ArtifactId> = written.iter().filter(|id| !named(id)).cloned().collect();
        for id in stale {
            match self.artifacts_dir.remove(&file_name(&id)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    tracing::warn!(artifact = %id, error = %e, "{failure}");
                }
                _ => {
                    written.remove(&id);
                }
            }
        }
    }

    /// Reads the persisted mapping and its artifacts and records them as what is on disk;
    /// every other file of the artifacts directory is removed (a mapping persisted later
    /// removes only what it wrote).
    #[allow(clippy::type_complexity)]
    fn load_persisted(
        &self,
    ) -> io::Result<Option<(HashMap<ArtifactId, Arc<StoredArtifact>>, WireMapping)>> {
        let loaded = self.read_persisted();
        let empty = HashMap::new();
        let kept = match &loaded {
            Ok(Some((artifacts, _))) => artifacts,
            _ => &empty,
        };
        let (complete, listed) = match &loaded {
            Ok(Some((_, mapping))) => persisted_files(mapping, kept),
            _ => Default::default(),
        };
        let names: HashSet<String> = complete
            .iter()
            .map(Self::artifact_name)
            .chain(listed.iter().map(Self::listing_name))
            .collect();
        for name in self.artifacts_dir.names()? {
            if !names.contains(&name) {
                let _ = self.artifacts_dir.remove(&name);
            }
        }
        if let Ok(Some((_, mapping))) = &loaded {
            let mut last = self.accepted.lock().expect("accepted");
            last.artifact_files = complete;
            last.listing_files = listed;
            last.mapping = mapping.clone();
            last.mapping_written = true;
        }
        loaded
    }

    #[allow(clippy::type_complexity)]
    fn read_persisted(
        &self,
    ) -> io::Result<Option<(HashMap<ArtifactId, Arc<StoredArtifact>>, WireMapping)>> {
        let bytes = match self.own.read(Self::MAPPING) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let doc: PersistedMapping = serde_json::from_slice(&bytes)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        let mut artifacts = HashMap::new();
        // Complete entries first: a pending entry of an artifact complete elsewhere lists its
        // files from the complete artifact (every file waits either way).
        let mut order: Vec<&WireEntry> = doc.mapping.entries.iter().collect();
        order.sort_by_key(|e| e.pending.is_some());
        for e in order {
            if artifacts.contains_key(&e.artifact) {
                continue;
            }
            let name = match e.pending {
                None => Self::artifact_name(&e.artifact),
                Some(_) => Self::listing_name(&e.artifact),
            };
            let loaded = self
                .artifacts_dir
                .read(&name)
                .map_err(|err| err.to_string())
                .and_then(|b| {
                    serde_json::from_slice::<StoredArtifact>(&b).map_err(|err| err.to_string())
                })
                .and_then(check_artifact);
            match loaded {
                Ok(a) => {
                    artifacts.insert(e.artifact.clone(), a);
                }
                Err(err) => {
                    tracing::error!(artifact = %e.artifact, error = %err, "persisted artifact unreadable")
                }
            }
        }
        Ok(Some((artifacts, doc.mapping)))
    }
}

/// The artifacts a persisted mapping's files are: complete artifacts (`<id>.json`) of its
/// complete entries, and listings (`<id>.listing.json`) of its pending entries, among those
/// `loaded`.
fn persisted_files(
    mapping: &WireMapping,
    loaded: &HashMap<ArtifactId, Arc<StoredArtifact>>,
) -> (HashSet<ArtifactId>, HashSet<ArtifactId>) {
    let mut complete = HashSet::new();
    let mut listed = HashSet::new();
    for e in mapping
        .entries
        .iter()
        .filter(|e| loaded.contains_key(&e.artifact))
    {
        match e.pending {
            None => complete.insert(e.artifact.clone()),
            Some(_) => listed.insert(e.artifact.clone()),
        };
    }
    // A listing whose artifact a complete entry supplied was not read (and need not stay).
    listed.retain(|id| !complete.contains(id));
    (complete, listed)
}

/// Files written by `fsutil::replace_all_synced` at a time (each is open until all are synced).
const WRITE_BATCH: usize = 256;

/// For tests and the `WireFile` conversion on the agent side.
pub fn wire_files(files: &[InlineFile]) -> Vec<WireFile> {
    files
        .iter()
        .map(|f| WireFile {
            path: f.path.clone(),
            content: f.content.to_vec(),
        })
        .collect()
}

/// A mapping entry's path and store id checked, and its artifact: one sent with this mapping
/// or one already served.
fn wire_entry_artifact(
    e: &WireEntry,
    artifacts: &HashMap<ArtifactId, Arc<StoredArtifact>>,
    served: &HashMap<ArtifactId, Arc<StoredArtifact>>,
) -> Result<Arc<StoredArtifact>, String> {
    if e.path.is_empty() || !e.path.iter().all(|s| valid_segment(s)) {
        return Err("invalid path".into());
    }
    if !valid_store_id(&e.store) {
        return Err(format!("invalid store id {:?}", e.store.as_str()));
    }
    artifacts
        .get(&e.artifact)
        .or_else(|| served.get(&e.artifact))
        .cloned()
        .ok_or_else(|| format!("artifact {} was never sent", e.artifact))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileTypeExt;
    use std::os::unix::fs::MetadataExt;

    fn mode(path: &Path) -> u32 {
        std::fs::symlink_metadata(path).unwrap().mode() & 0o7777
    }

    /// `--mount-socket` in a shared sticky directory: the directory keeps its mode (and sticky
    /// bit), the socket is 0600 and nothing but it is left there.
    #[test]
    fn a_socket_in_an_existing_directory_leaves_its_mode_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let shared = tmp.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let path = shared.join("agent.sock");
        let listener = bind_socket(&path).unwrap();
        assert_eq!(mode(&shared), 0o1777, "the directory's mode changed");
        assert!(std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_socket());
        assert_eq!(mode(&path), 0o600);
        let names: Vec<_> = std::fs::read_dir(&shared).unwrap().flatten().collect();
        assert_eq!(names.len(), 1, "only the socket: {names:?}");
        // The renamed socket is the listener's.
        let _client = UnixStream::connect(&path).unwrap();
        listener.accept().unwrap();
        // A live socket is not taken over by a second server.
        let err = bind_socket(&path).unwrap_err();
        assert!(err.to_string().contains("another server listens"), "{err}");
        drop(listener);
        // A stale one (its server gone) is replaced.
        let _again = bind_socket(&path).unwrap();
        assert_eq!(mode(&shared), 0o1777);
    }

    /// A missing directory is the server's own: created 0700.
    #[test]
    fn a_missing_socket_directory_is_created_private() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("run/modelfs/agent.sock");
        let _listener = bind_socket(&path).unwrap();
        assert_eq!(mode(&tmp.path().join("run/modelfs")), 0o700);
        assert_eq!(mode(&path), 0o600);
    }

    /// Anything at the path that is not a socket is refused with a reason and left as it was:
    /// a file, a directory, a symbolic link (to a file or to a socket).
    #[test]
    fn a_socket_path_holding_anything_else_is_refused_and_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("important.conf");
        std::fs::write(&file, b"keep me").unwrap();
        let err = bind_socket(&file).unwrap_err();
        assert!(err.to_string().contains("is not a socket"), "{err}");
        assert_eq!(std::fs::read(&file).unwrap(), b"keep me");

        let dir = tmp.path().join("a-dir");
        std::fs::create_dir(&dir).unwrap();
        assert!(bind_socket(&dir).is_err());
        assert!(dir.is_dir());

        let stale = tmp.path().join("stale.sock");
        drop(UnixListener::bind(&stale).unwrap());
        for target in [&file, &stale] {
            let link = tmp.path().join("link.sock");
            std::os::unix::fs::symlink(target, &link).unwrap();
            let err = bind_socket(&link).unwrap_err();
            assert!(err.to_string().contains("is not a socket"), "{err}");
            assert!(std::fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink());
            std::fs::remove_file(&link).unwrap();
        }
        assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
        // No temporary directory left behind by the refusals.
        let mut names: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["a-dir", "important.conf", "stale.sock"]);
    }
}
