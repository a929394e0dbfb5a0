//! The one answer layer: what every FUSE request is answered, whichever transport carried it.
//! The `/dev/fuse` loop and the io_uring rings of [`modelfs_fuse_ring`] only decode requests
//! and encode replies; [`Answers`] decides (attributes, TTLs, open flags, statfs, xattrs,
//! errors), over the same [`ModelFs`] methods (opening, releasing, the journal of open files),
//! so the transports cannot answer differently and a resumed connection is answered exactly
//! as the one that started it. `fuser` is used for the mount and `FUSE_INIT` only (see the
//! parent module).
//!
//! Operations the mount does not implement are answered without a log line per request
//! (a loader opening files in a loop would write one per `open(2)`) and counted in the
//! metrics as `unsupported`; `IOCTL` is answered `ENOTTY`, what a terminal query such as
//! Python's buffered `open()` expects of a file that is not a terminal.

use std::ffi::OsStr;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;

use modelfs_fuse_ring::abi::{self, fopen, opcode, FileAttr, Statfs};
use modelfs_fuse_ring::{Handler, Reply, Request};

use super::{ModelFs, Opened};
use crate::vfs::{Attr, Kind};

/// Whether the running kernel offers FUSE over io_uring to new connections (the `fuse` module
/// parameter `enable_uring`; absent before Linux 6.14).
pub(super) fn kernel_offers_uring() -> bool {
    std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
        .map(|v| matches!(v.trim(), "Y" | "y" | "1"))
        .unwrap_or(false)
}

/// Bytes of each ring entry's payload buffer: the kernel sizes requests by
/// `max(max_write, max_pages * page size)`, and `init` sets `max_write` to this, which also
/// covers the read-ahead (`fuser` derives `max_pages` from the larger of the two).
pub(super) fn payload_size(read_ahead_kb: u32) -> usize {
    let read_ahead = (read_ahead_kb as usize).saturating_mul(1024);
    read_ahead.max(1 << 20).next_multiple_of(4096)
}

pub(super) struct Answers {
    fs: ModelFs,
    /// The connection's `/dev/fuse` descriptor, for passthrough backing ids.
    dev: Arc<OwnedFd>,
    /// Requests arrive over io_uring (counted apart, so tests and operators see which
    /// transport serves).
    over_ring: bool,
}

impl Answers {
    pub(super) fn new(fs: ModelFs, dev: Arc<OwnedFd>, over_ring: bool) -> Self {
        Self { fs, dev, over_ring }
    }

    fn file_attr(a: &Attr) -> FileAttr {
        let kind = match a.kind {
            Kind::Dir => libc::S_IFDIR,
            Kind::File => libc::S_IFREG,
        };
        FileAttr {
            ino: a.ino,
            size: a.size,
            blocks: a.size.div_ceil(512),
            mtime: a.mtime,
            mode: kind | u32::from(a.perm),
            nlink: a.nlink,
            uid: 0,
            gid: 0,
            // Large buffers for stdio readers: one FUSE request carries at most 1 MiB.
            blksize: 1 << 20,
        }
    }

    fn dirent_type(kind: Kind) -> u32 {
        match kind {
            Kind::Dir => abi::DT_DIR,
            Kind::File => abi::DT_REG,
        }
    }

    fn lookup(&self, parent: u64, name: &[u8], reply: &mut Reply<'_>) {
        self.fs.metrics.request("lookup");
        // The bytes as `fuser` passes them: the core answers a name that is not UTF-8 itself.
        match self.fs.core.lookup(parent, OsStr::from_bytes(name)) {
            Ok(a) => reply.entry(self.fs.ttl(&a), &Self::file_attr(&a)),
            Err(e) => reply.error(self.fs.fail("lookup", &e).code()),
        }
    }

    fn getattr(&self, ino: u64, reply: &mut Reply<'_>) {
        self.fs.metrics.request("getattr");
        match self.fs.core.getattr(ino) {
            Ok(a) => reply.attr(self.fs.ttl(&a), &Self::file_attr(&a)),
            Err(e) => reply.error(self.fs.fail("getattr", &e).code()),
        }
    }

    fn open(&self, ino: u64, flags: i32, reply: &mut Reply<'_>) {
        let opened = self.fs.open_file(ino, flags, |file| {
            modelfs_fuse_ring::BackingId::open(&self.dev, file)
        });
        match opened {
            Ok(Opened::Passthrough { fh, id }) => {
                reply.open(fh, fopen::NOFLUSH | fopen::PASSTHROUGH, id)
            }
            // As on /dev/fuse: content never changes under an inode, nothing is ever written.
            Ok(Opened::ReadThrough { fh }) => reply.open(fh, fopen::KEEP_CACHE | fopen::NOFLUSH, 0),
            Err(e) => reply.error(e.code()),
        }
    }

    fn read(&self, read: abi::ReadIn, reply: &mut Reply<'_>) {
        self.fs.metrics.request("read");
        let mut result = Ok(0);
        // Straight into the ring's payload buffer.
        reply.fill(read.size, |buf, len| {
            result = self.fs.core.read_into(read.fh, read.offset, buf);
            *len = *result.as_ref().unwrap_or(&0);
        });
        match result {
            Ok(n) => {
                self.fs.metrics.read_bytes.inc_by(n as u64);
            }
            Err(e) => reply.error(self.fs.fail("read", &e).code()),
        }
    }

    fn readdir(&self, ino: u64, read: abi::ReadIn, plus: bool, reply: &mut Reply<'_>) {
        let op = if plus { "readdirplus" } else { "readdir" };
        self.fs.metrics.request(op);
        let mut result = Ok(());
        reply.fill(read.size, |buf, len| {
            result = if plus {
                self.fs.core.readdirplus(ino, read.offset, |e, a| {
                    let attr = Self::file_attr(a);
                    let typ = Self::dirent_type(e.kind);
                    !abi::push_direntplus(
                        buf,
                        len,
                        e.offset,
                        typ,
                        e.name.as_bytes(),
                        self.fs.ttl(a),
                        &attr,
                    )
                })
            } else {
                self.fs.core.readdir(ino, read.offset, |e| {
                    !abi::push_dirent(
                        buf,
                        len,
                        e.ino,
                        e.offset,
                        Self::dirent_type(e.kind),
                        e.name.as_bytes(),
                    )
                })
            };
        });
        if let Err(e) = result {
            reply.error(self.fs.fail(op, &e).code());
        }
    }

    fn listxattr(&self, ino: u64, size: u32, reply: &mut Reply<'_>) {
        self.fs.metrics.request("listxattr");
        match self.fs.core.getattr(ino) {
            Ok(_) if size == 0 => reply.xattr_size(0),
            // The empty list.
            Ok(_) => reply.empty(),
            Err(e) => reply.error(self.fs.fail("listxattr", &e).code()),
        }
    }

    /// A writing operation: refused with `EROFS`, counted under the `fuser` handler's name.
    fn read_only(&self, op: &'static str, reply: &mut Reply<'_>) {
        reply.error(self.fs.read_only(op).code());
    }
}

impl Handler for Answers {
    fn forget(&self, ino: u64, nlookup: u64) {
        self.fs.core.forget(ino, nlookup);
    }

    fn handle(&self, req: &Request<'_>, reply: &mut Reply<'_>) {
        if self.over_ring {
            self.fs.metrics.uring_requests.inc();
        }
        let ino = req.header.nodeid;
        match req.header.opcode {
            opcode::LOOKUP => self.lookup(ino, abi::name_arg(req.payload), reply),
            opcode::GETATTR => self.getattr(ino, reply),
            opcode::OPEN => self.open(ino, abi::open_in_flags(req.op_in), reply),
            opcode::READ => self.read(abi::ReadIn::parse(req.op_in), reply),
            opcode::RELEASE => {
                self.fs.release_file(abi::release_in_fh(req.op_in));
                reply.empty();
            }
            opcode::FLUSH => {
                // Opens answer FOPEN_NOFLUSH, so the kernel should never send one.
                self.fs.metrics.request("flush");
                reply.empty();
            }
            // Answered once for the whole mount, as on /dev/fuse (see the parent module).
            opcode::OPENDIR => {
                self.fs.metrics.request("opendir");
                reply.error(libc::ENOSYS);
            }
            opcode::READDIR => self.readdir(ino, abi::ReadIn::parse(req.op_in), false, reply),
            opcode::READDIRPLUS => self.readdir(ino, abi::ReadIn::parse(req.op_in), true, reply),
            opcode::RELEASEDIR => {
                self.fs.metrics.request("releasedir");
                reply.empty();
            }
            opcode::STATFS => {
                self.fs.metrics.request("statfs");
                reply.statfs(&Statfs {
                    bsize: 4096,
                    namelen: 255,
                    frsize: 4096,
                    ..Statfs::default()
                });
            }
            opcode::GETXATTR => {
                self.fs.metrics.request("getxattr");
                reply.error(libc::ENOSYS);
            }
            opcode::LISTXATTR => self.listxattr(ino, abi::getxattr_in_size(req.op_in), reply),
            opcode::SETATTR => self.read_only("setattr", reply),
            opcode::MKNOD => self.read_only("mknod", reply),
            opcode::MKDIR => self.read_only("mkdir", reply),
            opcode::UNLINK => self.read_only("unlink", reply),
            opcode::RMDIR => self.read_only("rmdir", reply),
            opcode::SYMLINK => self.read_only("symlink", reply),
            opcode::RENAME | opcode::RENAME2 => self.read_only("rename", reply),
            opcode::LINK => self.read_only("link", reply),
            opcode::WRITE => self.read_only("write", reply),
            opcode::CREATE => self.read_only("create", reply),
            opcode::SETXATTR => self.read_only("setxattr", reply),
            opcode::REMOVEXATTR => self.read_only("removexattr", reply),
            opcode::FALLOCATE => self.read_only("fallocate", reply),
            // Not a terminal, nor any other device with controls.
            opcode::IOCTL => {
                self.fs.metrics.request("ioctl");
                reply.error(libc::ENOTTY);
            }
            // Everything else is unimplemented (`READLINK`, `ACCESS`, `FSYNC`, `TMPFILE`,
            // `STATX`, ...): the kernel then stops asking or answers for itself. Counted, never
            // logged per request.
            other => {
                self.fs.metrics.request("unsupported");
                tracing::trace!(opcode = other, "unimplemented FUSE operation");
                reply.error(libc::ENOSYS);
            }
        }
    }
}
