//! Unix socket paths of any length.
//!
//! A socket address holds at most 107 bytes of path (`sun_path` is 108 with its NUL), and the
//! default sockets live below `--state` (`<state>/<own dir>/agent.sock`, `keeper.sock`), which
//! an operator may well put deeper than that. A path that does not fit is reached through its
//! directory instead: the directory is opened (`O_PATH`) and the socket is named
//! `/proc/self/fd/<n>/<name>`, which the kernel resolves like any other path, from that
//! descriptor. The descriptor lives as long as the [`SocketPath`], which is only needed for the
//! `bind` or `connect` itself: a bound socket is the inode in the directory, whatever name
//! reached it.
//!
//! Not `chdir` into the directory and a relative name: the working directory belongs to the
//! whole process, and every other thread resolves its relative paths against it meanwhile.
//! Not abstract sockets: they have no file permissions, and the sockets' 0600 mode and 0700
//! directories are part of who may talk to the mount server and the keeper.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

/// The longest path a socket address holds (without its NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// A name for a socket path that fits a socket address (see the module docs).
#[derive(Debug)]
pub struct SocketPath {
    path: PathBuf,
    /// The socket's directory when it is reached through `/proc/self/fd`.
    _dir: Option<OwnedFd>,
}

impl SocketPath {
    /// `path` itself when it fits, else `/proc/self/fd/<n>/<name>` with its directory opened.
    /// An error when even that does not fit (a file name of nearly 100 bytes), or when the
    /// directory cannot be opened.
    pub fn new(path: &Path) -> io::Result<Self> {
        if path.as_os_str().len() <= MAX_SOCKET_PATH {
            return Ok(Self {
                path: path.to_path_buf(),
                _dir: None,
            });
        }
        let too_long = || {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the socket name of {} is too long for a socket address ({} bytes at most)",
                    path.display(),
                    MAX_SOCKET_PATH
                ),
            )
        };
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(too_long());
        };
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        let dir = rustix::fs::open(
            parent,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| {
            io::Error::new(
                io::Error::from(e).kind(),
                format!("opening {} (the socket's directory): {e}", parent.display()),
            )
        })?;
        let short = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name);
        if short.as_os_str().as_bytes().len() > MAX_SOCKET_PATH {
            return Err(too_long());
        }
        Ok(Self {
            path: short,
            _dir: Some(dir),
        })
    }

    /// The name to bind or connect to.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::{UnixListener, UnixStream};

    use super::*;

    /// A socket 150 bytes deep is bound and reached through its directory; a short one by
    /// its own name.
    #[test]
    fn a_long_socket_path_is_bound_and_connected_through_its_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let mut dir = tmp.path().to_path_buf();
        while dir.as_os_str().len() < 140 {
            dir.push("deeper-directory");
        }
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("agent.sock");
        assert!(path.as_os_str().len() > 150, "{}", path.display());
        assert!(UnixListener::bind(&path).is_err(), "too long for sun_path");

        let bind = SocketPath::new(&path).unwrap();
        assert!(bind.path().starts_with("/proc/self/fd/"));
        let listener = UnixListener::bind(bind.path()).unwrap();
        drop(bind);
        use std::os::unix::fs::FileTypeExt;
        let bound = std::fs::symlink_metadata(&path).unwrap();
        assert!(
            bound.file_type().is_socket(),
            "the socket is at its long path"
        );
        let connect = SocketPath::new(&path).unwrap();
        let mut client = UnixStream::connect(connect.path()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        std::io::Write::write_all(&mut client, b"hello").unwrap();
        let mut got = [0u8; 5];
        std::io::Read::read_exact(&mut server, &mut got).unwrap();
        assert_eq!(&got, b"hello");

        let short = tmp.path().join("s.sock");
        assert_eq!(SocketPath::new(&short).unwrap().path(), short);
        let name = "n".repeat(120);
        let e = SocketPath::new(&tmp.path().join(name)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    }
}
