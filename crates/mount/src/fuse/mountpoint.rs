//! Mountpoint housekeeping: stale mounts of a crashed daemon, lazy detach, read-ahead.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long a modelfs mount found at the mountpoint may take to answer `statfs` before it counts
/// as held but unserved ([`MountpointError::Unanswered`]). A serving daemon answers in
/// microseconds (no disk behind a `statfs`); a mount whose server is dead answers `ENOTCONN` at
/// once. Only a connection that a process holds without serving it makes the request wait.
pub const STALE_PROBE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum MountpointError {
    #[error("{path} is already served by a live modelfs mount; stop that daemon first")]
    AlreadyMounted { path: PathBuf },
    /// A modelfs mount whose connection is alive but answers nothing: a keeper holds it for a
    /// mount server that is not running (one of another state directory: this daemon looked
    /// for its keeper in its own), or its daemon hangs. Waiting would hang this start for good;
    /// detaching it would take the mount from whoever may still resume it.
    #[error(
        "{shown} is a modelfs mount that did not answer within {secs} s: a keeper of another \
         state directory holds it for a mount server that is not running, or its daemon hangs; \
         end it with `modelfs unmount --mount {shown} --state <its state directory>` \
         (or `umount -l {shown}`), or start with that state directory to resume it",
        shown = .path.display(),
        secs = .waited.as_secs()
    )]
    Unanswered { path: PathBuf, waited: Duration },
    #[error("preparing mountpoint {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// What `/proc/<pid>/mountinfo` says of the topmost mount at a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountLine {
    pub fstype: String,
    pub source: String,
    /// The mount's device number (`st_dev` of its root).
    pub dev: Option<u64>,
}

impl MountLine {
    /// Whether it is a modelfs FUSE mount.
    pub fn is_modelfs(&self) -> bool {
        (self.fstype == "fuse" || self.fstype.starts_with("fuse.")) && self.source == "modelfs"
    }
}

/// The topmost mount at exactly `path` (absolute, as mountinfo spells it), from the text of a
/// `/proc/<pid>/mountinfo`: later lines are mounted on top of earlier ones.
pub fn topmost_mount(mountinfo: &str, path: &Path) -> Option<MountLine> {
    let wanted = path.to_string_lossy();
    let mut found = None;
    for line in mountinfo.lines() {
        let mut fields = line.split(' ');
        let (Some(devno), Some(mount_point)) = (fields.nth(2), fields.nth(1)) else {
            continue;
        };
        if unescape_mountinfo(mount_point) != wanted {
            continue;
        }
        let Some(tail) = line.split(" - ").nth(1) else {
            continue;
        };
        let mut fields = tail.split(' ');
        found = Some(MountLine {
            fstype: fields.next().unwrap_or_default().to_string(),
            source: fields.next().map(unescape_mountinfo).unwrap_or_default(),
            dev: devno
                .split_once(':')
                .and_then(|(ma, mi)| Some(libc::makedev(ma.parse().ok()?, mi.parse().ok()?))),
        });
    }
    found
}

/// The topmost mount at `path`, from this process's mount table; read without touching the
/// mount itself (a `stat` of a connection no process serves waits until one does).
fn mount_info(path: &Path) -> Option<MountLine> {
    topmost_mount(&std::fs::read_to_string("/proc/self/mountinfo").ok()?, path)
}

/// The device number of the topmost mount at exactly `path`, if it is a modelfs FUSE mount.
pub fn mount_info_dev(path: &Path) -> Option<u64> {
    mount_info(path).filter(MountLine::is_modelfs)?.dev
}

/// `statfs` always reaches the FUSE daemon (no kernel cache answers it), so it tells a live
/// mount from a dead one; `stat` of the root may be answered from cached attributes.
/// `Ok(None)`: no answer within `timeout` (the request goes on waiting in a thread of its own,
/// which the kernel ends when the process exits).
fn statfs_within(path: &Path, timeout: Duration) -> io::Result<Option<()>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let probed = path.to_path_buf();
    std::thread::Builder::new()
        .name("mount-probe".into())
        .spawn(move || {
            let _ = tx.send(rustix::fs::statfs(&probed).map(drop));
        })?;
    match rx.recv_timeout(timeout) {
        Ok(answer) => answer.map(Some).map_err(io::Error::from),
        Err(_) => Ok(None),
    }
}

fn unescape_mountinfo(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

pub(crate) fn detach(path: &Path) -> io::Result<()> {
    rustix::mount::unmount(path, rustix::mount::UnmountFlags::DETACH).map_err(io::Error::from)
}

/// Whether a request's error says the daemon behind the mount is gone: `ENOTCONN` once the
/// connection is aborted; `ECONNABORTED` or `ECANCELED` for a request made while a dead
/// daemon's io_uring queues were still being torn down (the kernel does that after the process
/// exits, and ends such requests with one of those). A live modelfs daemon answers neither.
pub(crate) fn is_dead_connection(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED)
    )
}

/// Detaches a mount left behind by a crashed daemon (its connection is dead, see
/// `is_dead_connection`).
/// Returns whether one was cleaned. A live modelfs mount here is an error: the daemon must not
/// stack on top of it; so is one that does not answer within [`STALE_PROBE_TIMEOUT`] (see
/// [`MountpointError::Unanswered`]). Another filesystem mounted here is the directory the
/// daemon mounts over (in a container the models root is a bind mount of the host directory),
/// not an error.
pub fn clean_stale_mount(path: &Path) -> Result<bool, MountpointError> {
    clean_stale_mount_within(path, STALE_PROBE_TIMEOUT)
}

/// [`clean_stale_mount`] with another bound on the wait for an answer.
pub fn clean_stale_mount_within(path: &Path, timeout: Duration) -> Result<bool, MountpointError> {
    let io_err = |source| MountpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut cleaned = false;
    // Repeated crashes can leave several dead mounts stacked on one directory.
    for _ in 0..16 {
        let Some(line) = mount_info(path) else {
            return Ok(cleaned);
        };
        if !line.is_modelfs() {
            tracing::debug!(path = %path.display(), fstype = line.fstype, "mounting over a mount of another filesystem");
            return Ok(cleaned);
        }
        match statfs_within(path, timeout) {
            Ok(None) => {
                return Err(MountpointError::Unanswered {
                    path: path.to_path_buf(),
                    waited: timeout,
                })
            }
            Err(e) if is_dead_connection(&e) => {
                tracing::warn!(path = %path.display(), "cleaning up a stale mount of a crashed daemon");
                detach(path).map_err(io_err)?;
                cleaned = true;
            }
            Ok(Some(())) => {
                return Err(MountpointError::AlreadyMounted {
                    path: path.to_path_buf(),
                })
            }
            Err(e) => return Err(io_err(e)),
        }
    }
    Ok(cleaned)
}

/// Cleans a stale mount and makes sure the directory exists.
pub(crate) fn prepare(path: &Path) -> Result<(), MountpointError> {
    clean_stale_mount(path)?;
    std::fs::create_dir_all(path).map_err(|source| MountpointError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Sets `/sys/class/bdi/<major>:<minor>/read_ahead_kb` for the mount's anonymous device.
pub(crate) fn set_read_ahead(dev: u64, kb: u32) -> io::Result<()> {
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    std::fs::write(
        format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb"),
        kb.to_string(),
    )
}
