//! The liveness probe of a mount (`modelfs probe`): does the modelfs FUSE mount at a path
//! answer?
//!
//! A mount can be gone (unmounted from outside: the path is the bare directory again), be
//! something else (another filesystem mounted there), or be there and not answer: its
//! connection aborted (`/sys/fs/fuse/connections/<n>/abort`) or its daemon dead (every
//! request fails with `ENOTCONN`), or its daemon hung (requests never come back). The probe
//! fails in each case:
//! 1. the topmost mount at the path in `/proc/self/mountinfo` must be `fuse` (or `fuse.*`)
//!    with source `modelfs` (this reads no file of the mount);
//! 2. `statfs` of the mount (never answered from a kernel cache: it reaches the daemon),
//!    `stat` of its root, the first entry of its root listing (a served path, when there is
//!    one) and `stat` of that entry must all succeed.
//!
//! Step 2 runs in a thread of its own, and the probe gives up on it after the timeout: a
//! request to a hung daemon would block the caller forever (the thread is left behind; the
//! probe process exits right after, which ends it).

use crate::fuse::topmost_mount;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Why a mount failed the probe.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{path} is not a mount point (the modelfs mount is gone)")]
    NotMounted { path: PathBuf },
    #[error("{path} is a {fstype} mount of {source_name:?}, not a modelfs FUSE mount")]
    Foreign {
        path: PathBuf,
        fstype: String,
        source_name: String,
    },
    #[error("{path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        source: io::Error,
    },
    #[error("{path}: no answer within {timeout:?} (the mount is hung)")]
    Timeout { path: PathBuf, timeout: Duration },
}

/// What a passed probe saw.
#[derive(Debug)]
pub struct ProbeReport {
    /// The entry of the root that was looked at (none when the mount serves nothing).
    pub entry: Option<String>,
    pub elapsed: Duration,
}

/// Probes the mount at `mount` (absolute), giving up after `timeout` (module docs).
pub fn probe(mount: &Path, timeout: Duration) -> Result<ProbeReport, ProbeError> {
    let started = Instant::now();
    let mountinfo =
        std::fs::read_to_string("/proc/self/mountinfo").map_err(|source| ProbeError::Io {
            path: mount.to_path_buf(),
            what: "reading /proc/self/mountinfo",
            source,
        })?;
    match topmost_mount(&mountinfo, mount) {
        None => {
            return Err(ProbeError::NotMounted {
                path: mount.to_path_buf(),
            })
        }
        Some(line) if !line.is_modelfs() => {
            return Err(ProbeError::Foreign {
                path: mount.to_path_buf(),
                fstype: line.fstype,
                source_name: line.source,
            })
        }
        Some(_) => {}
    }
    let (tx, rx) = mpsc::channel();
    let root = mount.to_path_buf();
    std::thread::Builder::new()
        .name("probe".into())
        .spawn(move || {
            let _ = tx.send(look(&root));
        })
        .map_err(|source| ProbeError::Io {
            path: mount.to_path_buf(),
            what: "starting the probe thread",
            source,
        })?;
    match rx.recv_timeout(timeout.saturating_sub(started.elapsed())) {
        Ok(Ok(entry)) => Ok(ProbeReport {
            entry,
            elapsed: started.elapsed(),
        }),
        Ok(Err((what, source))) => Err(ProbeError::Io {
            path: mount.to_path_buf(),
            what,
            source,
        }),
        Err(_) => Err(ProbeError::Timeout {
            path: mount.to_path_buf(),
            timeout,
        }),
    }
}

/// The requests of step 2 (module docs); the first entry of the root, if any.
fn look(root: &Path) -> Result<Option<String>, (&'static str, io::Error)> {
    rustix::fs::statfs(root).map_err(|e| ("statfs", e.into()))?;
    std::fs::metadata(root).map_err(|e| ("stat of the root", e))?;
    let first = std::fs::read_dir(root)
        .map_err(|e| ("listing the root", e))?
        .next()
        .transpose()
        .map_err(|e| ("listing the root", e))?;
    let Some(first) = first else {
        return Ok(None);
    };
    std::fs::symlink_metadata(first.path()).map_err(|e| ("stat of a served path", e))?;
    Ok(Some(first.file_name().to_string_lossy().into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &str = "\
22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
90 22 0:50 / /mnt/models rw,relatime shared:40 - ext4 /dev/vdb rw
91 90 0:51 / /mnt/models rw,nosuid,nodev,relatime shared:41 - fuse modelfs ro,user_id=0
92 22 0:52 / /mnt/with\\040space rw - fuse.modelfs modelfs ro
93 22 0:53 / /mnt/other rw - fuse.sshfs host:/x rw
";

    #[test]
    fn the_topmost_mount_decides() {
        let top = topmost_mount(INFO, Path::new("/mnt/models")).unwrap();
        assert!(top.is_modelfs());
        assert_eq!(top.dev, Some(libc::makedev(0, 51)));
        assert!(topmost_mount(INFO, Path::new("/mnt/with space"))
            .unwrap()
            .is_modelfs());
        assert!(!topmost_mount(INFO, Path::new("/mnt/other"))
            .unwrap()
            .is_modelfs());
        assert!(topmost_mount(INFO, Path::new("/mnt")).is_none());
        // The ext4 mount beneath, alone, is not modelfs.
        assert!(
            !topmost_mount(&INFO[..INFO.find("91 ").unwrap()], Path::new("/mnt/models"))
                .unwrap()
                .is_modelfs()
        );
    }

    #[test]
    fn a_plain_directory_is_not_mounted() {
        let tmp = tempfile::tempdir().unwrap();
        let e = probe(tmp.path(), Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, ProbeError::NotMounted { .. }), "{e}");
    }
}
