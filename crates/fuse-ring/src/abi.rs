//! The parts of the FUSE wire format a read-only filesystem answers over the ring: the request
//! header, the per-operation input structures it reads and the reply structures it writes
//! (`include/uapi/linux/fuse.h`, protocol 7.42 for the ring layout). Everything here is plain
//! little-endian byte layout, encoded and decoded by offset, so this module needs no `unsafe`.
//!
//! Reply sizes matter more than over `/dev/fuse`: the kernel copies the ring's payload into the
//! request's output arguments and refuses a fixed-size reply of any other length, so each
//! encoder writes exactly its structure's size.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Operation codes (`enum fuse_opcode`) the ring dispatches on; any other is answered `ENOSYS`.
pub mod opcode {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const SETXATTR: u32 = 21;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const REMOVEXATTR: u32 = 24;
    pub const FLUSH: u32 = 25;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const GETLK: u32 = 31;
    pub const SETLK: u32 = 32;
    pub const SETLKW: u32 = 33;
    pub const ACCESS: u32 = 34;
    pub const CREATE: u32 = 35;
    pub const INTERRUPT: u32 = 36;
    pub const BMAP: u32 = 37;
    pub const DESTROY: u32 = 38;
    pub const IOCTL: u32 = 39;
    pub const POLL: u32 = 40;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
    pub const READDIRPLUS: u32 = 44;
    pub const RENAME2: u32 = 45;
    pub const LSEEK: u32 = 46;
    pub const COPY_FILE_RANGE: u32 = 47;
    pub const SYNCFS: u32 = 50;
    pub const TMPFILE: u32 = 51;
    pub const STATX: u32 = 52;
}

/// `FOPEN_*` flags of an open reply.
pub mod fopen {
    pub const KEEP_CACHE: u32 = 1 << 1;
    pub const NOFLUSH: u32 = 1 << 5;
    pub const PASSTHROUGH: u32 = 1 << 7;
}

/// Size of `struct fuse_in_header`.
pub const IN_HEADER_LEN: usize = 40;
/// Size of `struct fuse_out_header`.
pub const OUT_HEADER_LEN: usize = 16;
/// Size of `struct fuse_attr`.
pub const ATTR_LEN: usize = 88;
/// Size of `struct fuse_entry_out`.
pub const ENTRY_OUT_LEN: usize = 40 + ATTR_LEN;
/// Size of `struct fuse_attr_out`.
pub const ATTR_OUT_LEN: usize = 16 + ATTR_LEN;
/// Size of `struct fuse_open_out`.
pub const OPEN_OUT_LEN: usize = 16;
/// Size of `struct fuse_statfs_out` (`struct fuse_kstatfs`).
pub const STATFS_OUT_LEN: usize = 80;
/// Size of `struct fuse_getxattr_out`.
pub const GETXATTR_OUT_LEN: usize = 8;
/// Size of `struct fuse_dirent` without its name.
const DIRENT_LEN: usize = 24;

/// `struct fuse_uring_req_header`: the in/out header area, the per-operation input area and
/// `struct fuse_uring_ent_in_out`.
pub const RING_HEADER_LEN: usize = 128 + 128 + 32;
/// Offset of the per-operation input (`op_in`) in the ring header.
pub const RING_OP_IN: usize = 128;
/// Offset of `struct fuse_uring_ent_in_out` in the ring header.
pub const RING_ENT: usize = 256;
/// Offset of `payload_sz` in the ring header.
pub const RING_PAYLOAD_SZ: usize = RING_ENT + 16;

pub fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(word)
}

pub fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(word)
}

pub(crate) fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// `struct fuse_in_header`, the fields a handler uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InHeader {
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

impl InHeader {
    pub fn parse(b: &[u8]) -> Self {
        Self {
            opcode: u32_at(b, 4),
            unique: u64_at(b, 8),
            nodeid: u64_at(b, 16),
            uid: u32_at(b, 24),
            gid: u32_at(b, 28),
            pid: u32_at(b, 32),
        }
    }
}

/// The fields of `struct fuse_read_in` (`READ`, `READDIR`, `READDIRPLUS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadIn {
    pub fh: u64,
    pub offset: u64,
    pub size: u32,
}

impl ReadIn {
    pub fn parse(op_in: &[u8]) -> Self {
        Self {
            fh: u64_at(op_in, 0),
            offset: u64_at(op_in, 8),
            size: u32_at(op_in, 16),
        }
    }
}

/// `struct fuse_open_in`: the `open(2)` flags.
pub fn open_in_flags(op_in: &[u8]) -> i32 {
    u32_at(op_in, 0) as i32
}

/// `struct fuse_release_in`: the file handle.
pub fn release_in_fh(op_in: &[u8]) -> u64 {
    u64_at(op_in, 0)
}

/// `struct fuse_getxattr_in`: the size of the caller's buffer (`LISTXATTR`, `GETXATTR`).
pub fn getxattr_in_size(op_in: &[u8]) -> u32 {
    u32_at(op_in, 0)
}

/// A name argument (`LOOKUP`): the payload up to its terminating NUL.
pub fn name_arg(payload: &[u8]) -> &[u8] {
    let end = payload
        .iter()
        .position(|&c| c == 0)
        .unwrap_or(payload.len());
    &payload[..end]
}

/// What goes into `struct fuse_attr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileAttr {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub mtime: SystemTime,
    /// Type and permission bits (`S_IFREG | 0o444`).
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub blksize: u32,
}

fn split_time(t: SystemTime) -> (u64, u32) {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    (d.as_secs(), d.subsec_nanos())
}

/// Writes `struct fuse_attr` (88 bytes) at the start of `b`: atime and ctime equal mtime.
pub fn encode_attr(b: &mut [u8], a: &FileAttr) {
    let (secs, nsecs) = split_time(a.mtime);
    put_u64(b, 0, a.ino);
    put_u64(b, 8, a.size);
    put_u64(b, 16, a.blocks);
    put_u64(b, 24, secs);
    put_u64(b, 32, secs);
    put_u64(b, 40, secs);
    put_u32(b, 48, nsecs);
    put_u32(b, 52, nsecs);
    put_u32(b, 56, nsecs);
    put_u32(b, 60, a.mode);
    put_u32(b, 64, a.nlink);
    put_u32(b, 68, a.uid);
    put_u32(b, 72, a.gid);
    put_u32(b, 76, 0);
    put_u32(b, 80, a.blksize);
    put_u32(b, 84, 0);
}

/// Writes `struct fuse_entry_out` (128 bytes) at the start of `b`.
pub fn encode_entry(b: &mut [u8], ttl: Duration, attr: &FileAttr) {
    put_u64(b, 0, attr.ino);
    put_u64(b, 8, 0);
    put_u64(b, 16, ttl.as_secs());
    put_u64(b, 24, ttl.as_secs());
    put_u32(b, 32, ttl.subsec_nanos());
    put_u32(b, 36, ttl.subsec_nanos());
    encode_attr(&mut b[40..ENTRY_OUT_LEN], attr);
}

/// Writes `struct fuse_attr_out` (104 bytes) at the start of `b`.
pub fn encode_attr_out(b: &mut [u8], ttl: Duration, attr: &FileAttr) {
    put_u64(b, 0, ttl.as_secs());
    put_u32(b, 8, ttl.subsec_nanos());
    put_u32(b, 12, 0);
    encode_attr(&mut b[16..ATTR_OUT_LEN], attr);
}

/// Writes `struct fuse_open_out` (16 bytes) at the start of `b`.
pub fn encode_open(b: &mut [u8], fh: u64, flags: u32, backing_id: u32) {
    put_u64(b, 0, fh);
    put_u32(b, 8, flags);
    put_u32(b, 12, backing_id);
}

/// What goes into `struct fuse_kstatfs`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Statfs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

/// Writes `struct fuse_statfs_out` (80 bytes) at the start of `b`.
pub fn encode_statfs(b: &mut [u8], s: &Statfs) {
    b[..STATFS_OUT_LEN].fill(0);
    put_u64(b, 0, s.blocks);
    put_u64(b, 8, s.bfree);
    put_u64(b, 16, s.bavail);
    put_u64(b, 24, s.files);
    put_u64(b, 32, s.ffree);
    put_u32(b, 40, s.bsize);
    put_u32(b, 44, s.namelen);
    put_u32(b, 48, s.frsize);
}

/// `DT_*` directory entry types.
pub const DT_DIR: u32 = 4;
pub const DT_REG: u32 = 8;

fn dirent_len(name: &[u8]) -> usize {
    (DIRENT_LEN + name.len() + 7) & !7
}

/// Appends `struct fuse_dirent` for one entry to `b[*len..]` if it fits; returns false when it
/// does not (the listing is full).
pub fn push_dirent(
    b: &mut [u8],
    len: &mut usize,
    ino: u64,
    offset: u64,
    typ: u32,
    name: &[u8],
) -> bool {
    let size = dirent_len(name);
    if b.len() < *len + size {
        return false;
    }
    let e = &mut b[*len..*len + size];
    put_u64(e, 0, ino);
    put_u64(e, 8, offset);
    put_u32(e, 16, name.len() as u32);
    put_u32(e, 20, typ);
    e[DIRENT_LEN..DIRENT_LEN + name.len()].copy_from_slice(name);
    e[DIRENT_LEN + name.len()..].fill(0);
    *len += size;
    true
}

/// Appends `struct fuse_direntplus` (an entry reply and a dirent) for one entry to `b[*len..]`
/// if it fits; returns false when it does not.
pub fn push_direntplus(
    b: &mut [u8],
    len: &mut usize,
    offset: u64,
    typ: u32,
    name: &[u8],
    ttl: Duration,
    attr: &FileAttr,
) -> bool {
    let size = ENTRY_OUT_LEN + dirent_len(name);
    if b.len() < *len + size {
        return false;
    }
    encode_entry(&mut b[*len..], ttl, attr);
    let mut at = *len + ENTRY_OUT_LEN;
    let fits = push_dirent(b, &mut at, attr.ino, offset, typ, name);
    debug_assert!(fits, "the size was checked above");
    *len = at;
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr() -> FileAttr {
        FileAttr {
            ino: 0x0102_0304_0506_0708,
            size: 4096,
            blocks: 8,
            mtime: UNIX_EPOCH + Duration::new(1_700_000_000, 123),
            mode: 0o100444,
            nlink: 1,
            uid: 0,
            gid: 0,
            blksize: 1 << 20,
        }
    }

    #[test]
    fn an_entry_reply_has_the_kernel_layout() {
        let mut b = vec![0xffu8; ENTRY_OUT_LEN];
        encode_entry(&mut b, Duration::new(60, 5), &attr());
        assert_eq!(u64_at(&b, 0), 0x0102_0304_0506_0708, "nodeid");
        assert_eq!(u64_at(&b, 8), 0, "generation");
        assert_eq!(u64_at(&b, 16), 60, "entry_valid");
        assert_eq!(u32_at(&b, 36), 5, "attr_valid_nsec");
        assert_eq!(u64_at(&b, 40), 0x0102_0304_0506_0708, "attr.ino");
        assert_eq!(u64_at(&b, 48), 4096, "attr.size");
        assert_eq!(u64_at(&b, 64), 1_700_000_000, "attr.atime");
        assert_eq!(u32_at(&b, 40 + 52), 123, "attr.mtimensec");
        assert_eq!(u32_at(&b, 40 + 60), 0o100444, "attr.mode");
        assert_eq!(u32_at(&b, 40 + 80), 1 << 20, "attr.blksize");
    }

    #[test]
    fn directory_entries_are_padded_to_eight_bytes_and_stop_when_full() {
        let mut b = vec![0u8; 64];
        let mut len = 0;
        assert!(push_dirent(&mut b, &mut len, 7, 1, DT_REG, b"config.json"));
        assert_eq!(len, 40, "24 + 11 rounded up to 8");
        assert_eq!(u32_at(&b, 16), 11);
        assert_eq!(&b[24..35], b"config.json");
        assert!(!push_dirent(
            &mut b,
            &mut len,
            8,
            2,
            DT_REG,
            b"model.safetensors"
        ));
        assert_eq!(len, 40, "an entry that does not fit is left out whole");

        let mut b = vec![0u8; 4096];
        let mut len = 0;
        let a = attr();
        assert!(push_direntplus(
            &mut b,
            &mut len,
            3,
            DT_REG,
            b"a",
            Duration::from_secs(1),
            &a
        ));
        assert_eq!(len, ENTRY_OUT_LEN + 32);
        assert_eq!(u64_at(&b, ENTRY_OUT_LEN), a.ino, "dirent.ino");
        assert_eq!(u64_at(&b, ENTRY_OUT_LEN + 8), 3, "dirent.off");
    }

    #[test]
    fn request_fields_are_read_at_their_offsets() {
        let mut h = vec![0u8; IN_HEADER_LEN];
        put_u32(&mut h, 0, 40);
        put_u32(&mut h, 4, opcode::OPEN);
        put_u64(&mut h, 8, 99);
        put_u64(&mut h, 16, 5);
        put_u32(&mut h, 24, 1000);
        put_u32(&mut h, 32, 4242);
        let parsed = InHeader::parse(&h);
        assert_eq!(parsed.opcode, opcode::OPEN);
        assert_eq!(parsed.unique, 99);
        assert_eq!(parsed.nodeid, 5);
        assert_eq!(parsed.uid, 1000);
        assert_eq!(parsed.pid, 4242);
        assert_eq!(name_arg(b"model.safetensors\0"), b"model.safetensors");
        let mut r = vec![0u8; 40];
        put_u64(&mut r, 0, 11);
        put_u64(&mut r, 8, 4096);
        put_u32(&mut r, 16, 8192);
        assert_eq!(
            ReadIn::parse(&r),
            ReadIn {
                fh: 11,
                offset: 4096,
                size: 8192
            }
        );
    }
}
