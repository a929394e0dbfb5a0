//! Mountpoint housekeeping: stale mounts of a crashed daemon, lazy detach, read-ahead.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum MountpointError {
    #[error("{path} is already served by a live modelfs mount; stop that daemon first")]
    AlreadyMounted { path: PathBuf },
    #[error("{path} is a mountpoint of another filesystem ({fstype})")]
    ForeignMount { path: PathBuf, fstype: String },
    #[error("preparing mountpoint {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// One line of /proc/self/mountinfo that matters here.
fn mount_fstype(path: &Path) -> Option<String> {
    let canonical = path.to_string_lossy().into_owned();
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut found = None;
    for line in info.lines() {
        let mut fields = line.split(' ');
        let mount_point = fields.nth(4)?;
        if unescape_mountinfo(mount_point) != canonical {
            continue;
        }
        let rest: Vec<&str> = line.split(" - ").nth(1)?.split(' ').collect();
        // Later lines are mounted on top of earlier ones: keep the last.
        found = rest.first().map(|s| s.to_string());
    }
    found
}

fn unescape_mountinfo(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

pub(crate) fn detach(path: &Path) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    let rc = unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Detaches a mount left behind by a crashed daemon (it answers `ENOTCONN`). Returns whether one
/// was cleaned. A live modelfs mount or another filesystem mounted here is an error: the daemon
/// must not stack on top of it.
pub fn clean_stale_mount(path: &Path) -> Result<bool, MountpointError> {
    let io_err = |source| MountpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut cleaned = false;
    // A stale mount can be stacked several times (repeated crashes with lazy unmount failing).
    for _ in 0..16 {
        match std::fs::metadata(path) {
            Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
                tracing::warn!(path = %path.display(), "cleaning up a stale mount of a crashed daemon");
                detach(path).map_err(io_err)?;
                cleaned = true;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(cleaned),
            Err(e) => return Err(io_err(e)),
            Ok(_) => {
                return match mount_fstype(path) {
                    None => Ok(cleaned),
                    Some(t) if t == "fuse.modelfs" => Err(MountpointError::AlreadyMounted {
                        path: path.to_path_buf(),
                    }),
                    Some(t) => Err(MountpointError::ForeignMount {
                        path: path.to_path_buf(),
                        fstype: t,
                    }),
                };
            }
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
pub(crate) fn set_read_ahead(path: &Path, kb: u32) -> io::Result<()> {
    let dev = std::fs::metadata(path)?.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    std::fs::write(
        format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb"),
        kb.to_string(),
    )
}
