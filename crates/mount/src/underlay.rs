//! Traps in the underlay: what a container sees at a model path while the mount is not there.
//!
//! OME's inference pods bind `spec.storage.path` as a plain `hostPath` volume. After a node
//! reboot kubelet starts them again, possibly before the mount server has mounted: the bind
//! then takes whatever lies at that path in the directory underneath the mount point (the
//! underlay): an old agent's files, possibly of another revision, or, since the hostPath has
//! no `type`, an empty directory the container runtime creates. The inference server would
//! load the wrong weights or none, with no error anywhere.
//!
//! So while the mount server serves, it keeps a *trap* in the underlay at each served model
//! path: a regular file ([`TRAP_CONTENT`]: one line saying what it is), parent directories
//! created as needed. A bind of a regular file onto a container's directory target fails
//! (`ENOTDIR`), and so does kubelet's check of a `hostPath` of `type: Directory`: the
//! container does not start, kubelet retries it, and once the mount is there the path is a
//! directory of the mount again and the next start succeeds. The underlay is reached through
//! the descriptor of the mount point's directory opened before mounting (the same one handed
//! to agents for adoption), so the mount itself is never touched.
//!
//! What lies at a model path is made a trap as follows; nothing is ever deleted but an empty
//! directory or a trap:
//! * nothing: the trap is created;
//! * a trap: left as it is;
//! * an empty directory: removed, the trap put in its place;
//! * a directory that holds the served model itself: every file of its manifest is there and
//!   is the very inode of the store's blob (files adopted by hard link from an old agent, or a
//!   `local://` source below the models root, imported by hard link): left in place. A
//!   container that binds it before the mount is there reads the bytes the mount would serve,
//!   and a `local://` source stays where its model object says it is (another model reading
//!   it, now or after a change of its spec, still finds it);
//! * anything else (a directory with an old agent's other files, a symlink such as OME's
//!   `ReuseIfExists` links, another file): renamed to a hidden sibling
//!   `.<name>.modelfs-aside-<unix seconds>` (logged), the trap put in its place.
//!
//! The same holds for a parent directory of a model path that is not a directory. Traps
//! follow the mapping ([`keep_in_step`], called wherever the server applies one, including the
//! persisted mapping at start, before mounting): a new path gets its trap, a path that left
//! the mapping loses it (only if it still is a trap). A trap is written to a temporary name,
//! synced, and renamed into place, so a power cut leaves a trap or nothing, never a part of one.
//!
//! Every step works on one name relative to an open directory, never following a symlink
//! (`O_NOFOLLOW`, `AT_SYMLINK_NOFOLLOW`, no-replace renames), so nothing in the underlay can
//! lead a step outside it.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{SystemTime, UNIX_EPOCH};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags, ResolveFlags};
use rustix::io::Errno;

/// The content of a trap.
pub const TRAP_CONTENT: &str = "This path is served by the modelfs mount, which is not mounted now: a container that binds it does not start until it is.\n";

/// Part of the hidden name a displaced entry gets.
const ASIDE_MARK: &str = ".modelfs-aside-";

/// Suffix of the temporary name a trap is written under.
const TEMP_SUFFIX: &str = ".modelfs-trap";

/// Longest part of a displaced entry's own name kept in its hidden name (the whole must stay
/// within NAME_MAX, 255 bytes).
const ASIDE_NAME_MAX: usize = 200;

/// A trap that could not be placed or removed.
#[derive(Debug, thiserror::Error)]
#[error("trap at {path}: {action}: {source}")]
pub struct TrapError {
    pub path: String,
    pub action: &'static str,
    #[source]
    pub source: io::Error,
}

/// What [`place`] found and did.
#[derive(Debug, PartialEq, Eq)]
pub enum Placed {
    /// The trap was there already.
    Present,
    /// Nothing was there; the trap was created.
    Created,
    /// An empty directory was replaced.
    ReplacedEmptyDir,
    /// A directory holding the served model's own blobs was left in place (module docs).
    ServedFilesInPlace,
    /// Entries (the model path itself or a parent) were renamed to these hidden names, relative
    /// to the underlay, and the trap created.
    MovedAside(Vec<String>),
}

fn valid(segment: &str) -> bool {
    !segment.is_empty() && segment != "." && segment != ".." && !segment.contains(['/', '\0'])
}

struct Walk<'a> {
    path: &'a [String],
    moved: Vec<String>,
}

impl Walk<'_> {
    fn error(&self, action: &'static str, source: impl Into<io::Error>) -> TrapError {
        TrapError {
            path: self.path.join("/"),
            action,
            source: source.into(),
        }
    }

    /// Renames `name` in `dir` (the directory of `parents`) to a free hidden sibling name.
    fn move_aside(
        &mut self,
        dir: BorrowedFd<'_>,
        parents: &[String],
        name: &str,
    ) -> Result<(), TrapError> {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut kept = name.len().min(ASIDE_NAME_MAX);
        while !name.is_char_boundary(kept) {
            kept -= 1;
        }
        let base = format!(".{}{ASIDE_MARK}{secs}", &name[..kept]);
        for n in 0..1000u32 {
            let aside = if n == 0 {
                base.clone()
            } else {
                format!("{base}-{n}")
            };
            match rustix::fs::renameat_with(dir, name, dir, aside.as_str(), RenameFlags::NOREPLACE)
            {
                Ok(()) => {
                    let mut shown: Vec<&str> = parents.iter().map(String::as_str).collect();
                    shown.push(&aside);
                    self.moved.push(shown.join("/"));
                    return Ok(());
                }
                Err(Errno::EXIST) => continue,
                Err(e) => return Err(self.error("moving aside", e)),
            }
        }
        Err(self.error("moving aside", io::Error::other("no free hidden name left")))
    }
}

fn open_dir(dir: BorrowedFd<'_>, name: &str) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// Whether `name` in `dir` is a regular file holding exactly [`TRAP_CONTENT`].
fn is_trap(dir: BorrowedFd<'_>, name: &str) -> io::Result<bool> {
    let stat = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(s) => s,
        Err(Errno::NOENT) => return Ok(false),
        Err(e) => return Err(e.into()),
    };
    if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile
        || stat.st_size != TRAP_CONTENT.len() as i64
    {
        return Ok(false);
    }
    let fd = rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut buf = vec![0u8; TRAP_CONTENT.len() + 1];
    let mut got = 0;
    while got < buf.len() {
        match rustix::io::read(&fd, &mut buf[got..])? {
            0 => break,
            n => got += n,
        }
    }
    Ok(&buf[..got] == TRAP_CONTENT.as_bytes())
}

/// Writes a trap under a temporary name, syncs it, renames it to `name` and syncs `dir`.
fn write_trap(dir: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    let mut kept = name.len().min(ASIDE_NAME_MAX);
    while !name.is_char_boundary(kept) {
        kept -= 1;
    }
    let temp = format!(".{}{TEMP_SUFFIX}", &name[..kept]);
    let fd = rustix::fs::openat(
        dir,
        temp.as_str(),
        OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o444),
    )?;
    let mut written = 0;
    let bytes = TRAP_CONTENT.as_bytes();
    while written < bytes.len() {
        written += rustix::io::write(&fd, &bytes[written..])?;
    }
    rustix::fs::fsync(&fd)?;
    drop(fd);
    rustix::fs::renameat(dir, temp.as_str(), dir, name)?;
    rustix::fs::fsync(dir)?;
    Ok(())
}

/// Whether `dir` holds every file of `files` (path relative to `dir`, path of the store's
/// blob) as the blob's own inode, reached without following a symlink. False for no files.
pub fn holds_blobs<'a>(
    dir: BorrowedFd<'_>,
    files: impl IntoIterator<Item = (&'a str, std::path::PathBuf)>,
) -> bool {
    let mut any = false;
    for (rel, blob) in files {
        let Ok(fd) = rustix::fs::openat2(
            dir,
            rel,
            OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS,
        ) else {
            return false;
        };
        let (Ok(here), Ok(there)) = (rustix::fs::fstat(&fd), rustix::fs::stat(&blob)) else {
            return false;
        };
        if FileType::from_raw_mode(here.st_mode) != FileType::RegularFile
            || (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino)
        {
            return false;
        }
        any = true;
    }
    any
}

/// Makes the entry at `path` (segments, relative to `under`) a trap (module docs). `served`
/// says whether a non-empty directory there holds the served model's own files (then it is
/// left in place; see [`holds_blobs`]).
pub fn place(
    under: BorrowedFd<'_>,
    path: &[String],
    served: impl Fn(BorrowedFd<'_>) -> bool,
) -> Result<Placed, TrapError> {
    let mut walk = Walk {
        path,
        moved: Vec::new(),
    };
    let Some((name, parents)) = path.split_last() else {
        return Err(walk.error("checking the path", Errno::INVAL));
    };
    if !path.iter().all(|s| valid(s)) {
        return Err(walk.error("checking the path", Errno::INVAL));
    }
    let mut dir = open_dir(under, ".").map_err(|e| walk.error("opening the underlay", e))?;
    for (i, segment) in parents.iter().enumerate() {
        let above = &parents[..i];
        dir = match open_dir(dir.as_fd(), segment) {
            Ok(fd) => fd,
            Err(e) => {
                match e {
                    Errno::NOENT => {}
                    // A symlink (ELOOP with O_NOFOLLOW) or another file where a directory is
                    // needed.
                    Errno::LOOP | Errno::NOTDIR => walk.move_aside(dir.as_fd(), above, segment)?,
                    e => return Err(walk.error("opening a parent directory", e)),
                }
                match rustix::fs::mkdirat(dir.as_fd(), segment.as_str(), Mode::from_raw_mode(0o755))
                {
                    Ok(()) | Err(Errno::EXIST) => {}
                    Err(e) => return Err(walk.error("creating a parent directory", e)),
                }
                open_dir(dir.as_fd(), segment)
                    .map_err(|e| walk.error("opening a parent directory", e))?
            }
        };
    }
    let dir = dir.as_fd();
    let placed = match rustix::fs::statat(dir, name.as_str(), AtFlags::SYMLINK_NOFOLLOW) {
        Err(Errno::NOENT) => Placed::Created,
        Err(e) => return Err(walk.error("looking at the model path", e)),
        Ok(stat) => match FileType::from_raw_mode(stat.st_mode) {
            FileType::RegularFile
                if is_trap(dir, name).map_err(|e| walk.error("reading the trap", e))? =>
            {
                return Ok(Placed::Present)
            }
            FileType::Directory => {
                match rustix::fs::unlinkat(dir, name.as_str(), AtFlags::REMOVEDIR) {
                    Ok(()) => Placed::ReplacedEmptyDir,
                    Err(Errno::NOTEMPTY | Errno::EXIST) => {
                        let kept = open_dir(dir, name).is_ok_and(|d| served(d.as_fd()));
                        if kept {
                            return Ok(if walk.moved.is_empty() {
                                Placed::ServedFilesInPlace
                            } else {
                                Placed::MovedAside(walk.moved)
                            });
                        }
                        walk.move_aside(dir, parents, name)?;
                        Placed::MovedAside(Vec::new())
                    }
                    Err(e) => return Err(walk.error("removing an empty directory", e)),
                }
            }
            _ => {
                walk.move_aside(dir, parents, name)?;
                Placed::MovedAside(Vec::new())
            }
        },
    };
    write_trap(dir, name).map_err(|e| walk.error("writing the trap", e))?;
    Ok(if walk.moved.is_empty() {
        placed
    } else {
        Placed::MovedAside(walk.moved)
    })
}

/// Removes the trap at `path` if there is one there (anything else is left alone); returns
/// whether it did. Parent directories stay.
pub fn remove(under: BorrowedFd<'_>, path: &[String]) -> Result<bool, TrapError> {
    let walk = Walk {
        path,
        moved: Vec::new(),
    };
    let Some((name, parents)) = path.split_last() else {
        return Ok(false);
    };
    if !path.iter().all(|s| valid(s)) {
        return Ok(false);
    }
    let mut dir = open_dir(under, ".").map_err(|e| walk.error("opening the underlay", e))?;
    for segment in parents {
        dir = match open_dir(dir.as_fd(), segment) {
            Ok(fd) => fd,
            Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP) => return Ok(false),
            Err(e) => return Err(walk.error("opening a parent directory", e)),
        };
    }
    if !is_trap(dir.as_fd(), name).map_err(|e| walk.error("reading the trap", e))? {
        return Ok(false);
    }
    match rustix::fs::unlinkat(dir.as_fd(), name.as_str(), AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => Ok(true),
        Err(e) => Err(walk.error("removing the trap", e)),
    }
}

/// Keeps the traps in step with a mapping that serves `wanted` (model path, what is served
/// there: the artifact): `trapped` (what was dealt with so far, empty at start) gets a trap
/// placed for each new path or path whose artifact changed (a directory left in place for
/// the old one is moved aside now), and loses the traps of paths no longer named.
/// `served(path, dir)`: whether the directory at a path holds the model served there (see
/// [`place`]). What fails is logged and tried again with the next mapping; it never stops a
/// mapping from being served.
pub fn keep_in_step<'a, K: PartialEq + Clone>(
    under: BorrowedFd<'_>,
    trapped: &mut HashMap<Vec<String>, K>,
    wanted: impl IntoIterator<Item = (&'a Vec<String>, K)>,
    served: impl Fn(&[String], BorrowedFd<'_>) -> bool,
) {
    let wanted: HashMap<&Vec<String>, K> = wanted.into_iter().collect();
    let dropped: Vec<Vec<String>> = trapped
        .keys()
        .filter(|p| !wanted.contains_key(p))
        .cloned()
        .collect();
    for path in dropped {
        match remove(under, &path) {
            Ok(_) => {
                trapped.remove(&path);
            }
            Err(e) => tracing::warn!(error = %e, "removing the trap of a path no longer served"),
        }
    }
    for (path, what) in wanted {
        if trapped.get(path) == Some(&what) {
            continue;
        }
        match place(under, path, |dir| served(path, dir)) {
            Ok(placed) => {
                if let Placed::MovedAside(names) = &placed {
                    tracing::warn!(
                        path = %path.join("/"),
                        moved_to = ?names,
                        "what lay beneath the mount at a served path was moved aside for its trap (nothing deleted)"
                    );
                }
                trapped.insert(path.clone(), what);
            }
            Err(e) => tracing::error!(
                error = %e,
                "no trap beneath the mount at a served path: after a reboot, a container could start on the underlay there"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use std::path::Path;

    fn p(s: &str) -> Vec<String> {
        s.split('/').map(str::to_owned).collect()
    }

    fn under(root: &Path) -> OwnedFd {
        rustix::fs::open(
            root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .unwrap()
    }

    fn place_plain(under: BorrowedFd<'_>, path: &[String]) -> Result<Placed, TrapError> {
        place(under, path, |_| false)
    }

    fn is_trap_at(path: &Path) -> bool {
        std::fs::symlink_metadata(path).unwrap().is_file()
            && std::fs::read_to_string(path).unwrap() == TRAP_CONTENT
    }

    /// Names in `dir` starting with `prefix`.
    fn hidden(dir: &Path, prefix: &str) -> Vec<std::path::PathBuf> {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
            .map(|e| e.path())
            .collect()
    }

    #[test]
    fn missing_and_empty_paths_become_traps_once() {
        let tmp = tempfile::tempdir().unwrap();
        let fd = under(tmp.path());
        assert_eq!(
            place_plain(fd.as_fd(), &p("org/a")).unwrap(),
            Placed::Created
        );
        assert!(is_trap_at(&tmp.path().join("org/a")));
        assert_eq!(
            place_plain(fd.as_fd(), &p("org/a")).unwrap(),
            Placed::Present
        );
        std::fs::create_dir_all(tmp.path().join("org/b")).unwrap();
        assert_eq!(
            place_plain(fd.as_fd(), &p("org/b")).unwrap(),
            Placed::ReplacedEmptyDir
        );
        assert!(is_trap_at(&tmp.path().join("org/b")));
        // No temporary file is left beside them.
        assert!(hidden(&tmp.path().join("org"), ".").is_empty());
    }

    #[test]
    fn old_files_symlinks_and_foreign_files_are_moved_aside_not_deleted() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::create_dir_all(root.join("org/old/sub")).unwrap();
        std::fs::write(root.join("org/old/sub/w.bin"), b"stale").unwrap();
        std::fs::create_dir_all(root.join("shared/m")).unwrap();
        symlink("../shared/m", root.join("org/link")).unwrap();
        std::fs::write(root.join("org/file"), b"not a trap").unwrap();
        let fd = under(root);
        for (name, content) in [("old", None), ("link", None), ("file", Some("not a trap"))] {
            let placed = place_plain(fd.as_fd(), &p(&format!("org/{name}"))).unwrap();
            let Placed::MovedAside(names) = placed else {
                panic!("{name}: {placed:?}");
            };
            assert_eq!(names.len(), 1, "{names:?}");
            assert!(names[0].starts_with(&format!("org/.{name}{ASIDE_MARK}")));
            assert!(is_trap_at(&root.join("org").join(name)));
            let aside = root.join(&names[0]);
            match content {
                Some(c) => assert_eq!(std::fs::read_to_string(&aside).unwrap(), c),
                None if name == "old" => {
                    assert_eq!(std::fs::read(aside.join("sub/w.bin")).unwrap(), b"stale")
                }
                None => assert_eq!(
                    std::fs::read_link(&aside).unwrap(),
                    Path::new("../shared/m")
                ),
            }
        }
        // The link's target was not touched.
        assert!(root.join("shared/m").is_dir());
    }

    #[test]
    fn a_parent_that_is_not_a_directory_is_moved_aside() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::create_dir_all(root.join("elsewhere")).unwrap();
        symlink(root.join("elsewhere"), root.join("team")).unwrap();
        let fd = under(root);
        let placed = place_plain(fd.as_fd(), &p("team/m")).unwrap();
        let Placed::MovedAside(names) = placed else {
            panic!("{placed:?}");
        };
        assert!(names[0].starts_with(&format!(".team{ASIDE_MARK}")));
        assert!(std::fs::symlink_metadata(root.join("team"))
            .unwrap()
            .is_dir());
        assert!(is_trap_at(&root.join("team/m")));
        // Nothing was written through the link.
        assert_eq!(
            std::fs::read_dir(root.join("elsewhere")).unwrap().count(),
            0
        );
    }

    #[test]
    fn only_traps_are_removed_and_traps_follow_the_mapping() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let fd = under(root);
        let mut trapped = HashMap::new();
        let (a, b, c) = (p("x/a"), p("x/b"), p("y"));
        keep_in_step(fd.as_fd(), &mut trapped, [(&a, 1), (&b, 1)], |_, _| false);
        assert!(is_trap_at(&root.join("x/a")) && is_trap_at(&root.join("x/b")));
        keep_in_step(fd.as_fd(), &mut trapped, [(&b, 1), (&c, 1)], |_, _| false);
        assert!(!root.join("x/a").exists());
        assert!(is_trap_at(&root.join("x/b")) && is_trap_at(&root.join("y")));
        assert_eq!(trapped, HashMap::from([(b.clone(), 1), (c.clone(), 1)]));
        // A directory left in place for one artifact is looked at again for the next.
        std::fs::remove_file(root.join("x/b")).unwrap();
        std::fs::create_dir_all(root.join("x/b/w")).unwrap();
        keep_in_step(fd.as_fd(), &mut trapped, [(&b, 1), (&c, 1)], |_, _| true);
        assert!(
            root.join("x/b/w").is_dir(),
            "unchanged: not looked at again"
        );
        keep_in_step(fd.as_fd(), &mut trapped, [(&b, 2), (&c, 1)], |_, _| false);
        assert!(is_trap_at(&root.join("x/b")));
        assert_eq!(hidden(&root.join("x"), ".b.modelfs-aside-").len(), 1);
        // A file that is not a trap is never removed.
        std::fs::remove_file(root.join("y")).unwrap();
        std::fs::write(root.join("y"), b"data").unwrap();
        assert!(!remove(fd.as_fd(), &c).unwrap());
        assert_eq!(std::fs::read(root.join("y")).unwrap(), b"data");
        assert!(remove(fd.as_fd(), &b).unwrap());
        assert!(!root.join("x/b").exists());
    }

    #[test]
    fn a_directory_of_the_served_blobs_themselves_stays() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let blobs = root.join("store");
        std::fs::create_dir_all(&blobs).unwrap();
        std::fs::write(blobs.join("b1"), b"one").unwrap();
        std::fs::write(blobs.join("b2"), b"two").unwrap();
        std::fs::create_dir_all(root.join("m/sub")).unwrap();
        std::fs::hard_link(blobs.join("b1"), root.join("m/a")).unwrap();
        std::fs::hard_link(blobs.join("b2"), root.join("m/sub/b")).unwrap();
        let files = || [("a", blobs.join("b1")), ("sub/b", blobs.join("b2"))];
        let fd = under(root);
        let m = open_dir(fd.as_fd(), "m").unwrap();
        assert!(holds_blobs(m.as_fd(), files()));
        assert_eq!(
            place(fd.as_fd(), &p("m"), |d| holds_blobs(d, files())).unwrap(),
            Placed::ServedFilesInPlace
        );
        assert_eq!(std::fs::read(root.join("m/sub/b")).unwrap(), b"two");
        // A copy with the same bytes is another inode: not the served blobs.
        std::fs::remove_file(root.join("m/a")).unwrap();
        std::fs::write(root.join("m/a"), b"one").unwrap();
        assert!(!holds_blobs(m.as_fd(), files()));
        // Neither is a path through a symlink, nor no files at all.
        std::fs::remove_file(root.join("m/a")).unwrap();
        symlink(blobs.join("b1"), root.join("m/a")).unwrap();
        assert!(!holds_blobs(m.as_fd(), files()));
        assert!(!holds_blobs(m.as_fd(), []));
        let placed = place(fd.as_fd(), &p("m"), |d| holds_blobs(d, files())).unwrap();
        assert!(matches!(placed, Placed::MovedAside(_)), "{placed:?}");
        assert!(is_trap_at(&root.join("m")));
    }

    #[test]
    fn bad_paths_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let fd = under(tmp.path());
        for bad in [vec![], p("a/../b"), p("a/./b"), vec!["a/b".to_owned()]] {
            assert!(place_plain(fd.as_fd(), &bad).is_err(), "{bad:?}");
        }
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }
}
