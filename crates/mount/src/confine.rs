//! The directory underneath the mount, as handed to agents: reachable, and nothing above it.
//!
//! The mount server opens the directory its mount covers before mounting and hands a
//! descriptor of it to each agent (adoption reads an old agent's files there, and in the
//! Kubernetes layout links them into the state directory beside it: see the agent's `adopt`).
//! A descriptor carries its mount with it: from a plain one, `..` leads out of the models
//! root, up the mount server's volume and into the mount server's own mount namespace (its
//! root filesystem, its `/dev`, its other volumes), which the agent, the unprivileged side of
//! the split (SPEC section 8), must never reach.
//!
//! So agents get the directory inside a private copy of its mount: `open_tree(OPEN_TREE_CLONE)`
//! makes a detached mount that no namespace holds, without the mounts below it (the FUSE mount
//! on top of the directory is not part of it: the copy shows the underlay, as the plain
//! descriptor did). `..` at the root of a detached mount stays where it is, so the agent
//! reaches the copy's root and what lies below it, nothing else. The copy is of the whole
//! mount the directory is on, from that mount's root: a state directory on the same mount
//! (beside the models root in the deployed layout, whose mount server mounts the models root's
//! parent as one volume) stays reachable for hard links (`UnderMount::link_root_for` in the
//! agent), and nothing on other mounts is.
//!
//! The copy lives while any descriptor into it is open (the server keeps the copy's own
//! descriptor for its life; an agent keeps its directory descriptor). Making the copy needs
//! `CAP_SYS_ADMIN`, which the mount server has because it mounts; where it cannot be made the
//! server hands the plain descriptor and says so in its log.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{AtFlags, Mode, OFlags, StatxFlags};
use rustix::mount::{open_tree, OpenTreeFlags};

/// The directory underneath the mount inside a detached copy of its mount (module docs).
#[derive(Debug)]
pub struct ConfinedDir {
    /// The copy's own descriptor: the copy is dissolved when the last descriptor into it
    /// closes; kept so that it outlives every agent connection of this process.
    _tree: OwnedFd,
    dir: OwnedFd,
}

impl ConfinedDir {
    /// Makes the copy for `under`, the directory underneath the mount.
    pub fn new(under: BorrowedFd<'_>) -> io::Result<Self> {
        let flags = StatxFlags::MNT_ID | StatxFlags::BASIC_STATS;
        // Up from the directory to the root of its mount, noting each directory on the way.
        let mut chain = vec![identity(under, flags)?];
        let mut top = under.try_clone_to_owned()?;
        loop {
            let parent = rustix::fs::openat(
                &top,
                "..",
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            let up = identity(parent.as_fd(), flags)?;
            let here = *chain.last().expect("the directory itself");
            if up.mnt != here.mnt || up.id == here.id || chain.len() > MAX_DEPTH {
                break;
            }
            chain.push(up);
            top = parent;
        }
        let tree = open_tree(
            &top,
            "",
            OpenTreeFlags::OPEN_TREE_CLONE
                | OpenTreeFlags::OPEN_TREE_CLOEXEC
                | OpenTreeFlags::AT_EMPTY_PATH,
        )?;
        // And down again inside the copy, by the same directories.
        let mut dir = open_dir(&tree, ".")?;
        for step in chain.iter().rev().skip(1) {
            dir = child_with_id(&dir, step.id, flags)?.ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    "the directory underneath the mount moved while its mount was copied",
                )
            })?;
        }
        Ok(Self { _tree: tree, dir })
    }

    /// The plain descriptor, where no copy can be made (no `CAP_SYS_ADMIN`, a kernel without
    /// `open_tree`): what agents were handed before copies; the caller logs why.
    pub fn unconfined(under: BorrowedFd<'_>) -> io::Result<Self> {
        Ok(Self {
            _tree: under.try_clone_to_owned()?,
            dir: under.try_clone_to_owned()?,
        })
    }

    /// The directory, to hand to an agent.
    pub fn dir(&self) -> BorrowedFd<'_> {
        self.dir.as_fd()
    }
}

/// Deepest directory below its mount's root that is copied from the top (a bound on the walk
/// up; model roots sit a few levels deep).
const MAX_DEPTH: usize = 64;

#[derive(Clone, Copy, PartialEq)]
struct Identity {
    mnt: u64,
    id: (u32, u32, u64),
}

fn identity(fd: BorrowedFd<'_>, flags: StatxFlags) -> io::Result<Identity> {
    let st = rustix::fs::statx(fd, "", AtFlags::EMPTY_PATH, flags)?;
    Ok(Identity {
        mnt: st.stx_mnt_id,
        id: (st.stx_dev_major, st.stx_dev_minor, st.stx_ino),
    })
}

fn open_dir(at: &OwnedFd, name: &str) -> io::Result<OwnedFd> {
    Ok(rustix::fs::openat(
        at,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// The directory entry of `tree` whose device and inode are `want`, opened.
fn child_with_id(
    tree: &OwnedFd,
    want: (u32, u32, u64),
    flags: StatxFlags,
) -> io::Result<Option<OwnedFd>> {
    let listing = open_dir(tree, ".")?;
    for entry in rustix::fs::Dir::read_from(&listing)? {
        let entry = entry?;
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        let Ok(st) = rustix::fs::statx(tree, name, AtFlags::SYMLINK_NOFOLLOW, flags) else {
            continue;
        };
        if (st.stx_dev_major, st.stx_dev_minor, st.stx_ino) != want {
            continue;
        }
        let dir = rustix::fs::openat(
            tree,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        // Checked again on the open descriptor: the name may have changed hands.
        let st = rustix::fs::statx(&dir, "", AtFlags::EMPTY_PATH, flags)?;
        if (st.stx_dev_major, st.stx_dev_minor, st.stx_ino) == want {
            return Ok(Some(dir));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    use std::path::Path;

    fn ino_at(at: BorrowedFd<'_>, path: &str) -> u64 {
        rustix::fs::statat(at, path, AtFlags::SYMLINK_NOFOLLOW)
            .unwrap()
            .st_ino
    }

    fn open(path: &Path) -> OwnedFd {
        rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .unwrap()
    }

    /// In a private mount namespace: a volume (`raid`, a tmpfs) holding the models root and
    /// the state directory, with a mount stacked on the models root as the FUSE mount is, and a
    /// models root that is a mount's root of its own. See [`child`].
    #[test]
    fn the_handed_directory_reaches_its_mount_and_nothing_above() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: mounting and copying mounts need root");
            return;
        }
        let top = tempfile::tempdir().unwrap();
        std::fs::write(top.path().join("above"), b"outside").unwrap();
        let status = std::process::Command::new("unshare")
            .args(["-m", "--propagation", "private", "sh", "-c"])
            .arg(concat!(
                "set -e; mkdir \"$1/raid\" \"$1/own\"; mount -t tmpfs raid \"$1/raid\"; ",
                "mount -t tmpfs own \"$1/own\"; mkdir -p \"$1/raid/models\" \"$1/raid/.modelfs-models\"; ",
                "echo underlay > \"$1/raid/models/old-file\"; ",
                "exec \"$2\" --exact confine::tests::child --ignored --nocapture --test-threads 1"
            ))
            .arg("sh")
            .arg(top.path())
            .arg(std::env::current_exe().unwrap())
            .env("MODELFS_CONFINE_CHILD", top.path())
            .status()
            .unwrap();
        assert!(status.success(), "the checks in the namespace failed");
    }

    /// Runs only inside the namespace of
    /// [`the_handed_directory_reaches_its_mount_and_nothing_above`].
    #[test]
    #[ignore = "runs only inside the namespace the test above makes"]
    fn child() {
        let Some(top) = std::env::var_os("MODELFS_CONFINE_CHILD") else {
            return;
        };
        let top = Path::new(&top);
        let (raid, models) = (top.join("raid"), top.join("raid/models"));
        let under = open(&models);
        let underlay_ino = std::fs::metadata(&models).unwrap().ino();
        // The mount on top, made after the directory underneath was opened.
        let stacked = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "fuse-stand-in"])
            .arg(&models)
            .status()
            .unwrap();
        assert!(stacked.success());
        let confined = ConfinedDir::new(under.as_fd()).unwrap();
        let dir = confined.dir();
        assert_eq!(ino_at(dir, "."), underlay_ino);
        let old = format!("/proc/self/fd/{}/old-file", dir.as_raw_fd());
        assert_eq!(std::fs::read(old).unwrap(), b"underlay\n");
        let volume = std::fs::metadata(&raid).unwrap().ino();
        assert_eq!(ino_at(dir, ".."), volume);
        assert_eq!(ino_at(dir, "../.."), volume, "`..` left the copy");
        assert_eq!(ino_at(dir, "../../../../.."), volume, "`..` left the copy");
        assert!(rustix::fs::statat(dir, "../../above", AtFlags::empty()).is_err());
        assert!(rustix::fs::statat(dir, "../.modelfs-models", AtFlags::empty()).is_ok());
        // The plain descriptor, by contrast, walks out of the volume.
        let top_ino = std::fs::metadata(top).unwrap().ino();
        assert_eq!(ino_at(under.as_fd(), "../.."), top_ino);

        // A models root that is its mount's root is confined to itself.
        let own = open(&top.join("own"));
        let confined = ConfinedDir::new(own.as_fd()).unwrap();
        let root = ino_at(confined.dir(), ".");
        assert_eq!(ino_at(confined.dir(), ".."), root, "`..` left the copy");
        assert_eq!(ino_at(confined.dir(), "../.."), root, "`..` left the copy");
    }
}
