//! The agent's side of the socket: [`RemoteMount`] is the reconciler's [`MountSink`]. The
//! reconciler applies every mapping to the agent's own [`FsCore`] (no kernel behind it) and
//! calls [`MountSink::invalidate`]; this side then sends that core's last mapping to the mount
//! server, which computes its own kernel invalidations. One thread keeps the connection:
//! connect, `hello`, the whole mapping, then every change; after any failure it reconnects
//! and sends the whole mapping again, with the manifests of only those artifacts the server's
//! `welcome` did not list as held (see [`modelfs_mount::protocol`]).
//!
//! # What the status may call Ready
//! A model is `Ready` (node label, ConfigMap, `GET /v1/models`) only while the mount server
//! serves it ([`MountSink::not_serving`], asked by the reconciler whenever it builds the
//! status). Two things take that away:
//! * **Not confirmed.** The server answers every `apply` with `applied` (its sequence number
//!   and the entries it refused). Each `apply` in flight keeps the snapshot of the mapping it
//!   carried (the core's `Arc`, no copy); the snapshot the server confirmed, less its refused
//!   entries, is the set of paths it serves. A mapping the reconciler applied but the server
//!   has not confirmed yet (it is slow, or away: [`MountSink::invalidate`] waits for the
//!   confirmation at most `CONFIRM_WAIT`) serves nothing new: its new models stay `Updating`
//!   until the confirmation arrives, then they turn `Ready`.
//! * **Unreachable.** When the connection is lost, the models the server confirmed stay
//!   `Ready` for the grace period (`--mount-server-grace-secs`, default 10 s: a few times what
//!   a restart of the mount server takes, during which it serves its persisted mapping and
//!   the mount keeps answering). Past it, every model is reported `Updating` until a server
//!   is back and has confirmed a mapping again.
//!
//! Why `Updating` and not removing the label or saying `Failed` (OME, `sgl-project/ome`):
//! InferenceService and BenchmarkJob pods get the node selector
//! `models.ome.io/<model key>: Ready` (`AddNodeSelectorForModelReadyNode` in
//! `pkg/controller/v1beta1/inferenceservice/utils`). A node selector is checked when a pod is
//! scheduled and admitted, never against running pods, so any other value stops new pods from
//! landing on the node and evicts none. The BaseModel controllers read the ConfigMap entry's
//! `status`: `Ready` adds the node to the model's `nodesReady`, `Failed` to `nodesFailed`,
//! `Updating` to neither (a model on its way), and a missing entry is what a deleted model
//! leaves (its finalizer waits for entries to go or say `Deleted`). `Updating` is the one value
//! that is true here (the model is on disk and will be served again) and raises no failure,
//! and the entry keeps its config. Each change is written at once (a change of status is not
//! rate-limited) and is published as an Event on the model object, as any other transition.
//!
//! Memory: nothing here copies the mapping. What to send (again, after a reconnect) is the
//! core's last applied entries, whose artifacts are the reconciler's own `Arc`s, and a message
//! is serialized straight onto the socket through a small buffer. After a restart of either
//! side the server already holds every manifest (its persisted mapping, or the mapping it kept
//! serving), so the reconnect costs neither side a second copy of them: sending them again
//! made the mount server parse tens of MB of JSON into a second set of manifests, a peak its
//! heap kept as resident memory.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, BufRead, BufReader, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::metrics::Metrics;
use modelfs_core::artifact::{ArtifactId, StoredArtifact};
use modelfs_mount::protocol::{
    self, AgentMessage, RefusedEntry, ServerMessage, WireEntry, WireMapping, WireUsage,
    PROTOCOL_VERSION,
};
use modelfs_mount::vfs::{AppliedMapping, FsCore, Invalidation, RemoteUsage};
use modelfs_mount::{MountSink, ServingListener};
use serde::Serialize;

/// What the server said when it accepted the agent.
#[derive(Debug)]
pub struct Welcome {
    pub server: String,
    pub mount_dev: u64,
    pub passthrough: bool,
    /// The directory underneath the mount (see [`crate::adopt`]).
    pub under: OwnedFd,
    /// Artifacts the server already holds: not sent on this connection unless they leave
    /// the mapping and come back (protocol module docs).
    pub held: HashSet<ArtifactId>,
    /// The protocol version the server chose.
    pub protocol: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("mount server socket {path}: {source}")]
    Unavailable { path: PathBuf, source: io::Error },
    #[error("mount server refused the agent: {0}")]
    Refused(String),
    #[error("mount server protocol error: {0}")]
    Protocol(String),
}

/// Connects and says hello with `version` (tests use other versions); returns the stream, the
/// welcome, and bytes already read past it.
pub fn handshake(
    socket: &Path,
    version: u32,
) -> Result<(UnixStream, Welcome, Vec<u8>), ConnectError> {
    let unavailable = |source| ConnectError::Unavailable {
        path: socket.to_path_buf(),
        source,
    };
    let short = modelfs_mount::sockpath::SocketPath::new(socket).map_err(unavailable)?;
    let mut stream = UnixStream::connect(short.path()).map_err(unavailable)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(unavailable)?;
    protocol::write_message(
        &mut stream,
        &AgentMessage::Hello {
            protocol: version,
            protocol_min: Some(protocol::PROTOCOL_MIN.min(version)),
            agent: env!("CARGO_PKG_VERSION").to_string(),
            held_artifacts: true,
        },
    )
    .map_err(unavailable)?;
    // The welcome carries the descriptor: read it with recvmsg, then the line as usual.
    let mut buf = vec![0u8; 64 * 1024];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        &stream,
        &mut [IoSliceMut::new(&mut buf)],
        &mut control,
        rustix::net::RecvFlags::CMSG_CLOEXEC,
    )
    .map_err(|e| unavailable(e.into()))?;
    let mut under = None;
    for message in control.drain() {
        if let rustix::net::RecvAncillaryMessage::ScmRights(fds) = message {
            for fd in fds {
                under.get_or_insert(fd);
            }
        }
    }
    buf.truncate(got.bytes);
    if buf.is_empty() {
        return Err(ConnectError::Protocol(
            "connection closed before the welcome".into(),
        ));
    }
    let mut reader =
        BufReader::new(io::Cursor::new(buf).chain(stream.try_clone().map_err(unavailable)?));
    // Longer than a hello: it lists the artifacts the server holds.
    let line = protocol::read_line(&mut reader, protocol::MAX_MESSAGE_BYTES)
        .map_err(|e| ConnectError::Protocol(e.to_string()))?
        .ok_or_else(|| ConnectError::Protocol("connection closed before the welcome".into()))?;
    let message: ServerMessage =
        serde_json::from_slice(&line).map_err(|e| ConnectError::Protocol(e.to_string()))?;
    let welcome = match message {
        ServerMessage::Welcome {
            protocol,
            server,
            mount_dev,
            passthrough,
            artifacts,
        } => {
            if protocol > version || protocol < protocol::PROTOCOL_MIN.min(version) {
                return Err(ConnectError::Protocol(format!(
                    "server answered with protocol version {protocol}, outside the versions this agent speaks ({} to {version})",
                    protocol::PROTOCOL_MIN.min(version)
                )));
            }
            Welcome {
                server,
                mount_dev,
                passthrough,
                under: under.ok_or_else(|| {
                    ConnectError::Protocol("welcome without the models root descriptor".into())
                })?,
                held: artifacts.into_iter().collect(),
                protocol,
            }
        }
        ServerMessage::Refused { reason } => return Err(ConnectError::Refused(reason)),
        other => return Err(ConnectError::Protocol(format!("unexpected {other:?}"))),
    };
    // Whatever the buffered reader took past the welcome line belongs to later messages.
    let rest = reader.buffer().to_vec();
    stream.set_read_timeout(None).map_err(unavailable)?;
    Ok((stream, welcome, rest))
}

#[derive(Default)]
struct Progress {
    /// The mapping changed since it was last sent.
    dirty: bool,
    /// The connection broke.
    broken: bool,
    /// Last `apply` sent, and the last the server confirmed (with its generation).
    sent_seq: u64,
    applied_seq: u64,
    applied_generation: u64,
    /// Sequence number and mapping of each `apply` not yet confirmed (the mapping's own
    /// generation is the agent core's), and the generation of the last confirmed one.
    in_flight: Vec<(u64, Arc<AppliedMapping>)>,
    confirmed_local: u64,
    /// A connection is up (a welcome was received and it has not broken since).
    connected: bool,
}

struct Shared {
    core: Arc<FsCore>,
    socket: PathBuf,
    progress: Mutex<Progress>,
    wake: Condvar,
    /// Device of the mount as the current server reports it (health checks compare it).
    mount_dev: Arc<AtomicU64>,
    /// Refusals already logged, so a refused entry is logged once per reason.
    logged_refusals: Mutex<HashSet<(Vec<String>, String)>>,
    metrics: Arc<Metrics>,
    /// The server instance and FUSE counters it reported last.
    stats: Mutex<(u64, BTreeMap<String, u64>)>,
    /// Where refused entries are reported (the reconciler: the models become `Failed`).
    refusal_listener: Mutex<Option<modelfs_mount::RefusalListener>>,
    /// What the server serves, as far as this side knows (module docs).
    serving: Mutex<Serving>,
    /// Told when `serving` changes (the reconciler: it publishes the status again).
    serving_listener: Mutex<Option<ServingListener>>,
    /// How long models stay `Ready` after the connection is lost.
    grace: Duration,
}

/// What the mount server serves, as far as the agent knows (module docs).
#[derive(Debug, Default)]
struct Serving {
    /// Path -> artifact of every entry of the last mapping the server confirmed, less the
    /// entries it refused.
    confirmed: HashMap<Vec<String>, ArtifactId>,
    /// The server has been unreachable for longer than the grace period and has not
    /// confirmed a mapping since.
    withdrawn: bool,
}

/// Why a model is not `Ready` although the reconciler placed it (the status entry's reason).
pub const NOT_CONFIRMED: &str = "waiting for the mount server to confirm that it serves this model";
/// The same, while the mount server is away past the grace period.
pub const UNREACHABLE: &str = "the mount server is unreachable";

/// Default of `--mount-server-grace-secs`.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);

impl Shared {
    fn notify_serving(&self) {
        if let Some(listener) = &*self.serving_listener.lock().expect("serving listener") {
            listener();
        }
    }

    /// The server confirmed `applied` (refusing `refused`; all of it with `failed`: then it
    /// still serves what it served, so only entries confirmed before and unchanged stay).
    fn confirm(&self, applied: &AppliedMapping, refused: &[RefusedEntry], failed: bool) {
        let refused: HashSet<&[String]> = refused.iter().map(|r| r.path.as_slice()).collect();
        let mut serving = self.serving.lock().expect("serving");
        let confirmed: HashMap<Vec<String>, ArtifactId> = applied
            .entries
            .iter()
            .filter(|e| {
                if failed {
                    serving.confirmed.get(&e.path) == Some(&e.artifact.id)
                } else {
                    !refused.contains(e.path.as_slice())
                }
            })
            .map(|e| (e.path.clone(), e.artifact.id.clone()))
            .collect();
        let changed = serving.withdrawn || serving.confirmed != confirmed;
        if serving.withdrawn {
            tracing::info!(
                models = confirmed.len(),
                "the mount server confirmed its mapping again; its models are Ready again"
            );
        }
        serving.confirmed = confirmed;
        serving.withdrawn = false;
        drop(serving);
        if changed {
            self.notify_serving();
        }
    }

    /// The server has been away for `away`, longer than the grace period.
    fn withdraw(&self, away: Duration) {
        let mut serving = self.serving.lock().expect("serving");
        if serving.withdrawn {
            return;
        }
        serving.withdrawn = true;
        drop(serving);
        tracing::warn!(
            away_ms = away.as_millis() as u64,
            grace_ms = self.grace.as_millis() as u64,
            "the mount server is unreachable past the grace period; its models are no longer reported Ready"
        );
        self.notify_serving();
    }
}

/// The agent's mount sink (module docs).
pub struct RemoteMount {
    shared: Arc<Shared>,
}

/// Longest wait for the server to confirm a mapping before the reconciler carries on (the
/// models it adds are not `Ready` until the confirmation arrives: module docs).
const CONFIRM_WAIT: Duration = Duration::from_secs(5);

impl MountSink for RemoteMount {
    /// Sends the new mapping and waits (bounded) until the server serves it, so that what the
    /// status reports as Ready is visible in the mount. While the server is away nothing
    /// waits: the mapping goes out on reconnect.
    fn invalidate(&self, list: Vec<Invalidation>) {
        // No kernel on this side: the agent's retired slots stop pinning stores at once; the
        // server reports its own.
        self.shared.core.detach_all(&list);
        let target = self.shared.core.last_applied().generation;
        let deadline = Instant::now() + CONFIRM_WAIT;
        let mut p = self.shared.progress.lock().expect("progress");
        p.dirty = true;
        self.shared.wake.notify_all();
        while p.connected && !p.broken && p.confirmed_local < target {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    "the mount server has not confirmed the new mapping yet; carrying on"
                );
                break;
            }
            p = self.shared.wake.wait_timeout(p, left).expect("progress").0;
        }
    }

    fn on_refused(&self, listener: modelfs_mount::RefusalListener) {
        *self.shared.refusal_listener.lock().expect("listener") = Some(listener);
    }

    fn not_serving(&self, path: &[String]) -> Option<&'static str> {
        let serving = self.shared.serving.lock().expect("serving");
        if serving.withdrawn {
            Some(UNREACHABLE)
        } else if !serving.confirmed.contains_key(path) {
            Some(NOT_CONFIRMED)
        } else {
            None
        }
    }

    fn on_serving_changed(&self, listener: ServingListener) {
        *self
            .shared
            .serving_listener
            .lock()
            .expect("serving listener") = Some(listener);
    }
}

impl RemoteMount {
    /// Waits for the mount server (logging once while it is away), then keeps the connection
    /// in a background thread. Returns with the first welcome: the agent needs its descriptor
    /// of the models root before it starts. `grace`: how long models stay `Ready` while the
    /// server is unreachable (module docs).
    pub fn connect(
        core: Arc<FsCore>,
        metrics: Arc<Metrics>,
        socket: &Path,
        grace: Duration,
    ) -> Result<(Arc<RemoteMount>, Welcome, Arc<AtomicU64>), ConnectError> {
        core.set_remote_unknown();
        let mut logged = false;
        let (stream, mut welcome, rest) = loop {
            match handshake(socket, PROTOCOL_VERSION) {
                Ok(x) => break x,
                Err(ConnectError::Unavailable { .. }) | Err(ConnectError::Protocol(_)) => {
                    if !logged {
                        tracing::info!(socket = %socket.display(), "waiting for the mount server");
                        logged = true;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(e),
            }
        };
        tracing::info!(server = %welcome.server, passthrough = welcome.passthrough, "connected to the mount server");
        let mount_dev = Arc::new(AtomicU64::new(welcome.mount_dev));
        let shared = Arc::new(Shared {
            core,
            socket: socket.to_path_buf(),
            progress: Mutex::new(Progress {
                dirty: true,
                connected: true,
                ..Default::default()
            }),
            wake: Condvar::new(),
            mount_dev: mount_dev.clone(),
            logged_refusals: Mutex::new(HashSet::new()),
            metrics,
            stats: Mutex::new((0, BTreeMap::new())),
            refusal_listener: Mutex::new(None),
            serving: Mutex::new(Serving::default()),
            serving_listener: Mutex::new(None),
            grace,
        });
        let thread_shared = shared.clone();
        let held = (std::mem::take(&mut welcome.held), welcome.protocol);
        std::thread::Builder::new()
            .name("mount-client".into())
            .spawn(move || connection_loop(thread_shared, stream, rest, held))
            .map_err(|e| ConnectError::Unavailable {
                path: socket.to_path_buf(),
                source: e,
            })?;
        Ok((Arc::new(RemoteMount { shared }), welcome, mount_dev))
    }
}

fn connection_loop(
    shared: Arc<Shared>,
    mut stream: UnixStream,
    mut rest: Vec<u8>,
    mut held: (HashSet<ArtifactId>, u32),
) {
    loop {
        let connection = run_connection(
            &shared,
            &stream,
            std::mem::take(&mut rest),
            std::mem::take(&mut held),
        );
        if let Err(e) = connection {
            tracing::warn!(error = %e, "mount server connection lost; reconnecting");
        }
        shared.core.set_remote_unknown();
        {
            let mut p = shared.progress.lock().expect("progress");
            p.connected = false;
            shared.wake.notify_all();
        }
        let _ = stream.shutdown(std::net::Shutdown::Both);
        let started = Instant::now();
        let mut logged = false;
        loop {
            match handshake(&shared.socket, PROTOCOL_VERSION) {
                Ok((s, welcome, r)) => {
                    tracing::info!(server = %welcome.server, after_ms = started.elapsed().as_millis() as u64, "reconnected to the mount server");
                    shared.mount_dev.store(welcome.mount_dev, Ordering::Relaxed);
                    stream = s;
                    rest = r;
                    held = (welcome.held, welcome.protocol);
                    break;
                }
                Err(e) => {
                    if !logged {
                        tracing::warn!(error = %e, "mount server unavailable; retrying");
                        logged = true;
                    }
                    if started.elapsed() >= shared.grace {
                        shared.withdraw(started.elapsed());
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        let mut p = shared.progress.lock().expect("progress");
        *p = Progress {
            dirty: true,
            connected: true,
            sent_seq: p.sent_seq,
            confirmed_local: p.confirmed_local,
            ..Default::default()
        };
    }
}

/// One connection: a reader thread for the server's messages, this thread sends mappings.
/// `held`: the artifacts the server's welcome said it holds, and the protocol version it chose.
fn run_connection(
    shared: &Arc<Shared>,
    stream: &UnixStream,
    rest: Vec<u8>,
    (held, protocol): (HashSet<ArtifactId>, u32),
) -> io::Result<()> {
    let reader_stream = stream.try_clone()?;
    let reader_shared = shared.clone();
    let reader = std::thread::Builder::new()
        .name("mount-client-read".into())
        .spawn(move || {
            let mut r = BufReader::new(io::Cursor::new(rest).chain(reader_stream));
            let result = read_loop(&reader_shared, &mut r);
            let mut p = reader_shared.progress.lock().expect("progress");
            p.broken = true;
            reader_shared.wake.notify_all();
            result
        })?;
    // Artifacts the server knows on this connection (protocol module docs), and whether the
    // copy it has is the listing of a pending entry (replaced by the complete artifact when
    // the entry completes). A server older than pending entries is sent none of them.
    let mut sent_artifacts: HashMap<ArtifactId, bool> =
        held.into_iter().map(|id| (id, false)).collect();
    let pending_ok = protocol >= protocol::PROTOCOL_PENDING;
    let mut writer = stream.try_clone()?;
    let result = loop {
        let (seq, applied) = {
            let mut p = shared.progress.lock().expect("progress");
            while !p.dirty && !p.broken {
                p = shared.wake.wait(p).expect("progress");
            }
            if p.broken {
                break Err(io::Error::other("connection closed by the mount server"));
            }
            p.dirty = false;
            let applied = shared.core.last_applied();
            if applied.generation == 0 {
                // The reconciler has not built a mapping yet: an empty one would unmount
                // every model the server serves from its persisted mapping.
                continue;
            }
            p.sent_seq += 1;
            let seq = p.sent_seq;
            p.in_flight.push((seq, applied.clone()));
            (seq, applied)
        };
        // Until the server confirms this mapping, its uses are not known.
        shared.core.set_remote_unknown();
        let mut artifacts = Vec::new();
        let mut entries = Vec::with_capacity(applied.entries.len());
        for e in &applied.entries {
            let pending = applied.pending.get(&e.path);
            if pending.is_some() && !pending_ok {
                continue;
            }
            let listing = pending.is_some();
            if sent_artifacts.insert(e.artifact.id.clone(), listing) != Some(listing) {
                artifacts.push(&*e.artifact);
            }
            entries.push(WireEntry {
                path: e.path.clone(),
                artifact: e.artifact.id.clone(),
                store: e.store.id.clone(),
                pending: pending.map(|p| (**p).clone()),
            });
        }
        // The server forgets the artifacts this mapping does not name; so does this side.
        let named: HashSet<&ArtifactId> = entries.iter().map(|e| &e.artifact).collect();
        sent_artifacts.retain(|id, _| named.contains(id));
        let message = ApplyMessage::Apply {
            seq,
            artifacts,
            mapping: WireMapping {
                entries,
                files: modelfs_mount::server::wire_files(&applied.files),
                dirs: applied.dirs.clone(),
            },
        };
        if let Err(e) = write_streamed(&mut writer, &message) {
            break Err(e);
        }
    };
    let _ = stream.shutdown(std::net::Shutdown::Both);
    let _ = reader.join();
    result
}

/// [`AgentMessage::Apply`] with the artifacts borrowed from the mapping: the same JSON, without
/// a copy of every manifest sent (after a reconnect, all of them at once).
#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum ApplyMessage<'a> {
    Apply {
        seq: u64,
        artifacts: Vec<&'a StoredArtifact>,
        mapping: WireMapping,
    },
}

/// Writes one message line as it is serialized, through a small buffer, instead of building
/// the whole line first (tens of MB for the whole mapping of 100,000 files).
fn write_streamed<M: Serialize>(stream: &mut UnixStream, message: &M) -> io::Result<()> {
    let mut w = io::BufWriter::with_capacity(64 * 1024, stream);
    serde_json::to_writer(&mut w, message).map_err(io::Error::other)?;
    w.write_all(b"\n")?;
    w.flush()
}

fn read_loop<R: BufRead>(shared: &Shared, r: &mut R) -> io::Result<()> {
    while let Some(message) =
        protocol::read_message::<_, ServerMessage>(r, protocol::MAX_MESSAGE_BYTES)?
    {
        match message {
            ServerMessage::Applied {
                seq,
                generation,
                refused,
                error,
            } => {
                // Reported before the mapping counts as confirmed, so the reconciler hears of
                // the refusals before it carries on from this mapping.
                if !refused.is_empty() {
                    if let Some(listener) = &*shared.refusal_listener.lock().expect("listener") {
                        listener(refused.clone());
                    }
                }
                // The confirmed mapping counts as served before the reconciler, woken below,
                // publishes the status of the models it holds.
                let confirmed = {
                    let p = shared.progress.lock().expect("progress");
                    p.in_flight
                        .iter()
                        .filter(|(s, _)| *s <= seq)
                        .max_by_key(|(s, _)| *s)
                        .map(|(_, mapping)| mapping.clone())
                };
                if let Some(mapping) = &confirmed {
                    shared.confirm(mapping, &refused, error.is_some());
                }
                {
                    let mut p = shared.progress.lock().expect("progress");
                    p.applied_seq = seq;
                    p.applied_generation = generation;
                    if let Some(mapping) = &confirmed {
                        p.confirmed_local = p.confirmed_local.max(mapping.generation);
                    }
                    p.in_flight.retain(|(s, _)| *s > seq);
                    shared.wake.notify_all();
                }
                if let Some(e) = error {
                    tracing::error!(error = %e, "the mount server refused the mapping");
                }
                let mut logged = shared.logged_refusals.lock().expect("refusals");
                let now: HashSet<(Vec<String>, String)> =
                    refused.into_iter().map(|r| (r.path, r.reason)).collect();
                for (path, reason) in now.difference(&logged) {
                    tracing::error!(path = %path.join("/"), %reason, "the mount server does not serve this model");
                }
                *logged = now;
            }
            ServerMessage::Usage(usage) => {
                let p = shared.progress.lock().expect("progress");
                if p.applied_seq == p.sent_seq && usage.generation >= p.applied_generation {
                    shared.core.set_remote_usage(remote_usage(usage));
                }
            }
            ServerMessage::Stats { instance, counters } => {
                let mut last = shared.stats.lock().expect("stats");
                if last.0 != instance {
                    *last = (instance, BTreeMap::new());
                }
                shared.metrics.fuse.add_snapshot(&last.1, &counters);
                last.1 = counters;
            }
            ServerMessage::Wanted {
                path,
                artifact,
                file,
            } => shared.core.tell_wanted(&path, &artifact, file as usize),
            ServerMessage::Welcome { .. } | ServerMessage::Refused { .. } => {
                return Err(io::Error::other("unexpected handshake message"));
            }
        }
    }
    Ok(())
}

fn remote_usage(usage: WireUsage) -> RemoteUsage {
    RemoteUsage {
        known: true,
        stores: usage.stores.into_iter().collect(),
        blobs: usage
            .blobs
            .into_iter()
            .map(|(s, b)| (s, b.into_iter().collect()))
            .collect::<HashMap<_, _>>(),
        epoch: usage.epoch,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use modelfs_core::artifact::{FileDigest, Manifest, ManifestEntry, Sha256Digest};
    use modelfs_core::store::StoreId;

    /// The borrowed form the agent writes is the protocol's `apply`, byte for byte.
    #[test]
    fn a_streamed_apply_is_the_protocol_message() {
        let manifest = Manifest::new(
            "r".into(),
            vec![ManifestEntry {
                path: "a/b.bin".into(),
                size: 3,
                digest: FileDigest::Sha256([7; 32]),
            }],
        )
        .unwrap();
        let artifact = StoredArtifact::new(manifest, vec![Sha256Digest([9; 32])], 5).unwrap();
        let mapping = WireMapping {
            entries: vec![WireEntry {
                path: vec!["org".into(), "m".into()],
                artifact: artifact.id.clone(),
                store: StoreId::from_seq(1),
                pending: None,
            }],
            files: Vec::new(),
            dirs: Vec::new(),
        };
        let borrowed = serde_json::to_vec(&ApplyMessage::Apply {
            seq: 4,
            artifacts: vec![&artifact],
            mapping: mapping.clone(),
        })
        .unwrap();
        let owned = serde_json::to_vec(&AgentMessage::Apply {
            seq: 4,
            artifacts: vec![artifact.clone()],
            mapping,
        })
        .unwrap();
        assert_eq!(
            String::from_utf8(borrowed).unwrap(),
            String::from_utf8(owned).unwrap()
        );
    }
}
