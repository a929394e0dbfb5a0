//! `modelfs-mount`: the mount side of modelfs. The FUSE-free filesystem core ([`vfs`]: mapping
//! table, trees, inodes, open files), the thin `fuser` adapter over it ([`fuse`]) and its
//! counters ([`metrics`]), and the mount server process ([`server`], [`protocol`],
//! [`supervise`]) that holds the FUSE session while the agent comes and goes, keeps traps
//! beneath the mount against the boot race ([`underlay`]) and is probed for liveness
//! ([`probe`]).
//!
//! # Place in the workspace
//!
//! It depends on `modelfs-core` (artifacts, blob stores) and on nothing that speaks to a
//! network: no HTTP client or server, no Kubernetes client, no object-store client, no async
//! runtime; nor does it know OME's types. Cargo enforces what the design promises: the process
//! that must never die runs only this code (and std, fuser, rustix). The agent (`modelfs-agent`) depends on this
//! crate, never the other way: it applies mappings to its own [`vfs::FsCore`] and speaks
//! [`protocol`] to the server; the mount side owns the [`MountSink`] trait the agent's
//! reconciler sends changes to.
//!
//! # Two processes, one mount
//!
//! The **mount server** holds the FUSE session, the mapping and the open files; the **agent**
//! (reconciler, sources, Kubernetes, HTTP) tells it what to serve.
//!
//! # Why
//! OME's inference pods mount their model's hostPath without mount propagation: a pod keeps the
//! mount instance it started with. If the process holding the FUSE connection dies, every new
//! open in every running pod fails with `ENOTCONN` until the pod is recreated. Everything that
//! can crash or needs upgrading (network, YAML, Kubernetes watches, downloads, GC) therefore
//! lives in the agent; the mount server does no network I/O and parses nothing but its own
//! state and the agent's messages. The agent can crash, restart or be upgraded: the mount, its
//! inode numbers and every open handle stay, and new models wait until it is back.
//!
//! # The socket
//! A unix stream socket (default `<state>/mount-server/agent.sock`), itself 0600, and the
//! peer's uid checked with `SO_PEERCRED` on every connection: only root may change what the
//! node serves. A missing directory for it is created 0700; an existing one (`--mount-socket`
//! in a shared directory) keeps its mode. Whatever sits at the path must be a stale socket,
//! which is replaced; anything else is refused and left alone (`server::bind_socket` binds in
//! a private directory and renames the socket into place without replacing anything). The protocol ([`protocol`]) is versioned and checked
//! at `hello`; a mismatch is refused with a reason naming both versions. The agent sends the
//! whole mapping after every (re)connect and after every change: applying a mapping twice
//! changes nothing, so no state is lost whichever side restarts. The newest connection wins
//! (an upgraded agent may connect while the old one is still exiting).
//!
//! # What the server checks
//! Each entry names a path, an artifact (whose manifest travels at most once per connection,
//! not at all if the server already serves it, and is validated as a source's would be, its id
//! checked against its digest) and a store id. An
//! entry whose store is missing, whose blobs are not all present with their sizes (checked once
//! per (store, artifact) while served: a mapping that names a served pair again costs no
//! system call), or whose path is invalid is left out with a reason
//! (`applied.refused`, logged by both sides); the other models are served. A mapping the core
//! refuses as a whole (conflicting paths) leaves the served mapping as it was.
//!
//! # What the server opens: the privilege boundary
//! The mount server runs privileged (`CAP_SYS_ADMIN` for the mount and passthrough) and serves
//! every file to every user of the node, from stores the agent writes. So nothing the agent
//! can put in the state directory may make it serve, stat or wait on anything else:
//! * `stores/` is opened once at start beneath the state directory without following links
//!   (`StateDir::anchored`); every blob is resolved beneath that descriptor with
//!   `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` and
//!   `O_NOFOLLOW`, so a symbolic link anywhere on the path (the store's directory, `blobs/`,
//!   the blob) fails the lookup instead of leading to another file;
//! * the blob is first opened `O_PATH`, which runs no device driver's open and never waits
//!   on a FIFO, and must be a regular file of its manifest entry's size before that same
//!   inode is opened for reading (`Store::open_blob`);
//! * the same rules apply when an entry enters the mapping, when the persisted mapping is
//!   checked after a restart, and on every open (the check at apply is not trusted for later:
//!   the agent may swap a blob afterwards);
//! * a refusal names the blob and the rule it broke, never the size, owner or type of what a
//!   planted entry would have led to;
//! * the server's own files (`mount-server/`: lock, inode log, persisted mapping and
//!   artifacts) are opened, replaced and removed beneath one descriptor of that directory the
//!   same way ([`owndir`]); the directory must be the server's and is made 0700, so a link
//!   planted there never makes the server truncate, read or replace a file elsewhere.
//!
//! Hard links. A link the agent makes to another file passes every path rule, so what protects
//! the bytes is who can write the inode. fs-verity would seal a blob's bytes, but it needs a
//! kernel built with it and a filesystem created with the `verity` feature: this project's
//! nodes (Linux 6.18, ext4) have neither (`CONFIG_FS_VERITY` is not set;
//! `/sys/fs/ext4/features` lists no `verity`), so it cannot be relied on. Hashing every blob
//! served on trust after a restart would cost minutes per terabyte before the first open. The
//! rule is ownership: a blob must be owned by root (or the server's own user) and writable by
//! neither its group nor others (`mode & 0o022 == 0`; a POSIX ACL granting a user write shows
//! in the group bits), so no user can change its bytes through any other name it has. The
//! agent's adoption and `local://` imports link only inodes that already meet that rule and
//! take their write bits away (others are copied), and blobs are published `0444`. Link
//! counts are not checked: blobs are legitimately shared between stores, and with the old
//! agent's files, by hard links. What the ownership rule does not stop is the agent (root in
//! its container) linking a root-owned, read-only file of the right size from elsewhere: it can
//! link only files it can reach through its own mounts (`linkat` refuses to cross mount
//! points), which it can read and copy into a blob anyway, so the link gives it nothing more.
//!
//! # Persisted mapping
//! Every applied mapping is written to `<state>/mount-server/mapping.json` (artifacts in
//! `artifacts/<id>.json`, written once, before the mapping that names them; atomic renames;
//! an artifact no longer named is removed after the mapping that dropped it is written). The
//! server remembers what it wrote, so an apply writes only new artifacts (one directory sync
//! for all of them), rewrites the mapping only when it changed and removes only the artifacts
//! it dropped: no system call per served model, which made an import of N models cost O(N^2)
//! in the server. Files of that directory no mapping names (a stray, a write a crash cut short)
//! are removed when the server starts.
//!
//! A restarted mount server cleans the stale mount, serves that mapping and remounts before
//! any agent speaks. Its entries are served on trust: their blobs were all found when the
//! mapping was applied, and nothing removes a blob the server may serve while it runs (garbage
//! collection runs in the agent, which counts every store as in use until the server has
//! confirmed the agent's mapping and reported its own uses; `modelfs gc` refuses while a mount
//! server holds the state directory). What could still take one (`modelfs gc` while no server
//! ran, a hand, a disk) is found right after the mount: a background thread checks the blobs
//! of every entry so served (a stat per file: 100,000 at 10,000 models x 10 files, no longer
//! between the restart and the first file served); an entry
//! whose store or blob is gone is then dropped from the served and persisted mapping with the
//! reason logged. Until that check is done an agent's mapping waits, so the refusals it hears
//! back come from a real check.
//!
//! # Garbage collection across the socket
//! The agent's reconciler still applies every mapping to its own [`crate::vfs::FsCore`] (no
//! kernel behind it, so it never builds a directory tree: its slots share the reconciler's
//! artifacts) and asks it what is in use; the agent's `mount_client::RemoteMount` sends the mapping and
//! feeds the server's usage reports into that core ([`crate::vfs::RemoteUsage`]): the stores held
//! by open files and retired slots the kernel was not yet told about, with the blobs those may
//! read. Until the server has confirmed the latest mapping and reported after it (and whenever
//! it is away) every store counts as in use: GC waits, it never guesses.
//!
//! # Kernel references across a mount server restart
//! The FUSE connection outlives the mount server process ([`takeover`]): a keeper process
//! holds a duplicate of its `/dev/fuse` descriptor, and a restarted or upgraded server resumes
//! it instead of mounting afresh. `fuser` 0.18 cannot adopt an initialized connection
//! (`Session::from_fd` always waits for a `FUSE_INIT` the kernel sends once per connection,
//! it has no `FUSE_NOTIFY_RESEND`, and it passes on none of the per-connection state a
//! successor needs), so it is kept for what its API does (mounting and answering `INIT`) and
//! the project's own loop serves every connection ([`fuse`]). What the kernel holds beyond a
//! connection's descriptor is made recoverable: inode numbers through the inode log
//! (`<state>/mount-server/inodes.log`, written before a mapping that shows new numbers to the
//! kernel is swapped in: [`vfs::InodeRecord`]), open file handles and passthrough backing ids
//! through the journal that travels with the descriptor ([`fuse::journal`]), and requests read
//! but not answered through `FUSE_NOTIFY_RESEND` (over io_uring: through the entries' buffers,
//! which a successor maps at the same address). Over io_uring the rings themselves are the
//! keeper's (polled by its SQ threads), so a request that arrives while no server runs waits
//! in them instead of failing ([`takeover`], "io_uring"); a keeper that cannot make them
//! leaves `--fuse-transport auto` on `/dev/fuse`.
//!
//! # Standalone
//! `modelfs serve` is still one command: it runs the mount server and supervises
//! `modelfs agent` (same arguments) as its child ([`supervise`]): restarted with backoff, each
//! death logged with its reason, killed with its parent (`PR_SET_PDEATHSIG`). It starts a
//! keeper of its own, so a SIGKILL of `serve` is survived as well: the same command started
//! again resumes the mount.

#![forbid(unsafe_code)]

pub mod confine;
pub mod fuse;
pub mod metrics;
pub mod owndir;
pub mod probe;
pub mod protocol;
pub mod server;
pub mod sockpath;
pub mod supervise;
pub mod takeover;
pub mod underlay;
pub mod vfs;

use crate::vfs::Invalidation;

/// Where mapping changes go after the reconciler applied them to its core: the kernel's caches
/// (an in-process FUSE mount), or the mount server (the agent's `mount_client::RemoteMount`).
pub trait MountSink: Send + Sync {
    fn invalidate(&self, list: Vec<Invalidation>);

    /// Registers where entries of the mapping that the mount side refuses to serve are
    /// reported (the mount server checks each entry's store and blobs; see the module docs).
    /// An in-process mount applies the agent's own core, which never refuses single entries.
    fn on_refused(&self, _listener: RefusalListener) {}

    /// Why the mount side does not serve the mapping entry at `path` now, if it does not: the
    /// mount server has not confirmed a mapping that holds it, or has been unreachable for
    /// longer than the agent's grace period. `None` for an entry it serves. An in-process
    /// mount serves whatever was applied to it.
    fn not_serving(&self, _path: &[String]) -> Option<&'static str> {
        None
    }

    /// Registers what is called when [`MountSink::not_serving`] may answer differently
    /// (called on the connection's thread: it must not block).
    fn on_serving_changed(&self, _listener: ServingListener) {}
}

/// Told that what the mount side serves changed (see [`MountSink::on_serving_changed`]).
pub type ServingListener = Box<dyn Fn() + Send + Sync>;

/// Receives the entries of an applied mapping that the mount server left out, with its
/// reasons (called on the connection's thread: it must not block).
pub type RefusalListener = Box<dyn Fn(Vec<protocol::RefusedEntry>) + Send + Sync>;

impl MountSink for crate::fuse::MountHandle {
    fn invalidate(&self, list: Vec<Invalidation>) {
        crate::fuse::MountHandle::invalidate(self, list)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use crate::vfs::{FsCore, RemoteUsage};
    use modelfs_core::artifact::Sha256Digest;
    use modelfs_core::store::StoreId;

    #[test]
    fn remote_uses_hold_stores_and_blobs_until_reported_gone() {
        let core = FsCore::new();
        let store = StoreId::from_seq(1);
        assert!(
            !core.store_in_use(&store),
            "an in-process core has no remote user"
        );
        let epoch = core.usage_epoch();
        core.set_remote_unknown();
        assert!(
            core.store_in_use(&store),
            "unknown remote uses hold every store"
        );
        assert_ne!(core.usage_epoch(), epoch);
        let blob = Sha256Digest::of(b"held");
        core.set_remote_usage(RemoteUsage {
            known: true,
            stores: HashSet::from([store.clone()]),
            blobs: HashMap::from([(store.clone(), HashSet::from([blob]))]),
            epoch: 1,
        });
        assert!(core.store_in_use(&store));
        assert!(!core.store_in_use(&StoreId::from_seq(2)));
        assert!(core.blobs_in_use()[&store].contains(&blob));
        let epoch = core.usage_epoch();
        core.set_remote_usage(RemoteUsage::default());
        assert!(!core.store_in_use(&store), "the open file was closed");
        assert!(!core.blobs_in_use().contains_key(&store));
        assert_ne!(
            core.usage_epoch(),
            epoch,
            "a use that ended wakes garbage collection"
        );
        // The same uses reported again after a file was opened and closed in between: the
        // remote's epoch moved, so a use may have ended.
        let epoch = core.usage_epoch();
        core.set_remote_usage(RemoteUsage {
            epoch: 7,
            ..RemoteUsage::default()
        });
        assert_ne!(
            core.usage_epoch(),
            epoch,
            "an open and close between two reports wakes garbage collection"
        );
        let epoch = core.usage_epoch();
        core.set_remote_usage(RemoteUsage {
            epoch: 7,
            ..RemoteUsage::default()
        });
        assert_eq!(
            core.usage_epoch(),
            epoch,
            "the same report again changes nothing"
        );
    }
}
