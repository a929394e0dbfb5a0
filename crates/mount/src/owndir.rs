//! The mount server's own directory, `<state>/mount-server`: its lock, the inode log, the
//! persisted mapping and the artifacts it names. The directory is opened once beneath the state
//! directory without following links, and every file in it is opened, created, renamed and
//! removed beneath that descriptor the same way (`openat2` with `RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`, `O_NOFOLLOW`).
//!
//! # Why
//! The state directory is written by the agent, which does not run with the server's
//! privileges. A link planted at `mount-server` or at a name inside it (`inodes.log ->
//! /etc/passwd`, `mapping.json -> /root/secret`) would otherwise make the privileged server
//! truncate, append to, read, chmod or replace a file elsewhere. Here:
//! * a link anywhere on the way is refused (`ELOOP`), with the path in the error;
//! * where a file is expected, anything but a regular file is refused (a FIFO would block the
//!   server at open or read: files are opened `O_NONBLOCK`, then checked with `fstat`);
//! * the directory (and `artifacts/` in it) must belong to the server's user; its mode is set
//!   to 0700 on the descriptor, so after that nobody else can plant anything inside it;
//! * a file is replaced by writing a new temporary file (`O_EXCL`) and renaming it over the
//!   name, which replaces a planted link itself, never its target.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};

/// The name of the server's directory below the state directory.
pub const NAME: &str = "mount-server";

const RESOLVE: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS);

/// A directory of the server's own, opened without following links (module docs).
#[derive(Debug)]
pub struct OwnDir {
    fd: OwnedFd,
    path: PathBuf,
}

impl OwnDir {
    /// Opens `<state>/mount-server`, creating it (0700) if missing. The state directory is the
    /// path the operator gave; nothing below it is followed.
    pub fn open(state: &Path) -> io::Result<Self> {
        let root = rustix::fs::open(
            state,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| with_path(e, state))?;
        Self::open_in(&root, state, NAME)
    }

    /// The directory `name` inside this one, created (0700) if missing.
    pub fn subdir(&self, name: &str) -> io::Result<Self> {
        Self::open_in(&self.fd, &self.path, name)
    }

    fn open_in(parent: &OwnedFd, parent_path: &Path, name: &str) -> io::Result<Self> {
        check_name(name)?;
        let path = parent_path.join(name);
        match rustix::fs::mkdirat(parent, name, Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(with_path(e, &path)),
        }
        let fd = rustix::fs::openat2(
            parent,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
            RESOLVE,
        )
        .map_err(|e| refusal(parent, name, &path, e))?;
        let st = rustix::fs::fstat(&fd)?;
        let me = rustix::process::geteuid().as_raw();
        if st.st_uid != me {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{} belongs to uid {}, not to this server's uid {me}: refusing to keep \
                     files in it",
                    path.display(),
                    st.st_uid
                ),
            ));
        }
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o700))?;
        Ok(Self { fd, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens the regular file `name` with `flags` (`O_CREAT` creates it with `mode`). A link,
    /// or anything but a regular file, is refused.
    pub fn open_file(&self, name: &str, flags: OFlags, mode: u32) -> io::Result<File> {
        check_name(name)?;
        let path = self.path.join(name);
        let fd = rustix::fs::openat2(
            &self.fd,
            name,
            flags | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode),
            RESOLVE,
        )
        .map_err(|e| refusal(&self.fd, name, &path, e))?;
        let st = rustix::fs::fstat(&fd)?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} is not a regular file: refused", path.display()),
            ));
        }
        Ok(File::from(fd))
    }

    /// The bytes of the regular file `name` (`NotFound` if there is none).
    pub fn read(&self, name: &str) -> io::Result<Vec<u8>> {
        let mut bytes = Vec::new();
        self.open_file(name, OFlags::RDONLY, 0)?
            .read_to_end(&mut bytes)?;
        Ok(bytes)
    }

    /// Replaces each `(name, bytes)` so that a crash leaves the old or the new content: every
    /// temporary file is written (0600), then all are fsynced, then each is renamed over its
    /// name. The caller calls [`OwnDir::sync`] when the renames must survive a power loss.
    pub fn replace_all<B: AsRef<[u8]>>(&self, files: &[(String, B)]) -> io::Result<()> {
        let mut tmps = Vec::with_capacity(files.len());
        let result = (|| {
            let mut open = Vec::with_capacity(files.len());
            for (name, bytes) in files {
                check_name(name)?;
                let tmp = format!(".{name}.tmp.{}", std::process::id());
                let _ = rustix::fs::unlinkat(&self.fd, tmp.as_str(), rustix::fs::AtFlags::empty());
                let mut f =
                    self.open_file(&tmp, OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL, 0o600)?;
                tmps.push(tmp);
                f.write_all(bytes.as_ref())?;
                open.push(f);
            }
            for f in &open {
                f.sync_all()?;
            }
            for ((name, _), tmp) in files.iter().zip(&tmps) {
                rustix::fs::renameat(&self.fd, tmp.as_str(), &self.fd, name.as_str())
                    .map_err(|e| with_path(e, &self.path.join(name)))?;
            }
            Ok(())
        })();
        if result.is_err() {
            // A partial temporary file on a full disk would keep the space the retry needs.
            for tmp in &tmps {
                let _ = rustix::fs::unlinkat(&self.fd, tmp.as_str(), rustix::fs::AtFlags::empty());
            }
        }
        result
    }

    /// [`OwnDir::replace_all`] of one file, then [`OwnDir::sync`].
    pub fn atomic_write(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        self.replace_all(&[(name.to_string(), bytes)])?;
        self.sync()
    }

    /// fsyncs the directory, so that renames and creations in it survive a power loss.
    pub fn sync(&self) -> io::Result<()> {
        Ok(rustix::fs::fsync(&self.fd)?)
    }

    /// Removes the entry `name` (a link itself, never its target).
    pub fn remove(&self, name: &str) -> io::Result<()> {
        check_name(name)?;
        rustix::fs::unlinkat(&self.fd, name, rustix::fs::AtFlags::empty())
            .map_err(|e| with_path(e, &self.path.join(name)))
    }

    /// The names in the directory (`.` and `..` left out).
    pub fn names(&self) -> io::Result<Vec<String>> {
        let dir = rustix::fs::Dir::read_from(&self.fd)?;
        let mut out = Vec::new();
        for entry in dir {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name != "." && name != ".." {
                out.push(name);
            }
        }
        Ok(out)
    }
}

/// A name of one component: no `/`, not `.` or `..`, not empty.
fn check_name(name: &str) -> io::Result<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a file name"),
        ));
    }
    Ok(())
}

/// Why `name` in `dir` could not be opened: a link there is named as such (`O_NOFOLLOW` with
/// `O_DIRECTORY` answers `ENOTDIR` for one).
fn refusal(dir: &OwnedFd, name: &str, path: &Path, e: rustix::io::Errno) -> io::Error {
    let link = rustix::fs::statat(dir, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
        .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Symlink);
    if link {
        return io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is a link: refused, links are not followed in the server's own directory",
                path.display()
            ),
        );
    }
    with_path(e, path)
}

/// An error of an operation on `path`, the path named in it (`ELOOP` says what it means here).
fn with_path(e: rustix::io::Errno, path: &Path) -> io::Error {
    let what = if e == rustix::io::Errno::LOOP || e == rustix::io::Errno::XDEV {
        " (a link on the way: refused, links are not followed in the server's own directory)"
    } else {
        ""
    };
    io::Error::new(
        io::Error::from(e).kind(),
        format!("{}: {e}{what}", path.display()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn a_link_planted_in_the_servers_own_directory_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        std::fs::create_dir(&state).unwrap();
        let outside = tmp.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o755)).unwrap();
        let secret = outside.join("secret");
        std::fs::write(&secret, b"not the server's").unwrap();

        // The directory itself a link: refused; nothing created or chmodded at its target.
        std::os::unix::fs::symlink(&outside, state.join(NAME)).unwrap();
        let e = OwnDir::open(&state).unwrap_err().to_string();
        assert!(e.contains("mount-server") && e.contains("link"), "{e}");
        assert_eq!(mode(&outside), 0o755);
        std::fs::remove_file(state.join(NAME)).unwrap();

        let own = OwnDir::open(&state).unwrap();
        assert_eq!(mode(&state.join(NAME)), 0o700);
        let dir = state.join(NAME);
        // A link at a file's name: reading, appending and locking through it are refused, and
        // the file it points at keeps its bytes.
        for name in ["mapping.json", "inodes.log", "lock"] {
            std::os::unix::fs::symlink(&secret, dir.join(name)).unwrap();
        }
        let e = own.read("mapping.json").unwrap_err().to_string();
        assert!(e.contains("mapping.json") && e.contains("link"), "{e}");
        let append = OFlags::WRONLY | OFlags::APPEND | OFlags::CREATE;
        assert!(own.open_file("inodes.log", append, 0o600).is_err());
        assert!(own
            .open_file("lock", OFlags::WRONLY | OFlags::CREATE, 0o600)
            .is_err());
        assert_eq!(std::fs::read(&secret).unwrap(), b"not the server's");
        // Replacing a name replaces the link itself.
        own.atomic_write("mapping.json", b"{}").unwrap();
        assert_eq!(own.read("mapping.json").unwrap(), b"{}");
        assert!(std::fs::symlink_metadata(dir.join("mapping.json"))
            .unwrap()
            .is_file());
        assert_eq!(std::fs::read(&secret).unwrap(), b"not the server's");
        own.remove("inodes.log").unwrap();
        assert!(secret.exists(), "removing a link leaves its target");

        // A FIFO where a file is expected: refused at once, without blocking.
        rustix::fs::mknodat(
            rustix::fs::CWD,
            dir.join("fifo"),
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let e = own.read("fifo").unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");

        // A link at a subdirectory, and names that are not one component.
        std::os::unix::fs::symlink(&outside, dir.join("artifacts")).unwrap();
        assert!(own.subdir("artifacts").is_err());
        std::fs::remove_file(dir.join("artifacts")).unwrap();
        let artifacts = own.subdir("artifacts").unwrap();
        artifacts
            .replace_all(&[("a.json".to_string(), b"1".to_vec())])
            .unwrap();
        assert_eq!(artifacts.names().unwrap(), ["a.json"]);
        for bad in ["", ".", "..", "../secret", "a/b"] {
            assert!(own.read(bad).is_err(), "{bad:?}");
        }

        // A directory that is not the server's: refused, its mode kept.
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        rustix::fs::chown(
            &dir,
            Some(rustix::process::Uid::from_raw(65534)),
            Some(rustix::process::Gid::from_raw(65534)),
        )
        .unwrap();
        let e = OwnDir::open(&state).unwrap_err().to_string();
        assert!(e.contains("uid 65534"), "{e}");
        assert_eq!(std::fs::metadata(&dir).unwrap().uid(), 65534);
        assert_eq!(mode(&dir), 0o777);
    }
}
