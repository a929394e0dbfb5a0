//! The `/dev/fuse` transport: threads that read requests from the connection's descriptor and
//! write the answers back, over the same [`Handler`] as the ring.
//!
//! # Why not `fuser`'s loop
//! `fuser` 0.18 mounts and answers `FUSE_INIT`, and that is all it is used for: its loop can
//! only run on a connection it initialized itself, so a mount server that resumes a connection
//! another process initialized (a restart or an upgrade, see the mount crate's `takeover`
//! module) needs a loop of its own. Serving fresh and resumed connections with the same loop
//! keeps one code path, and lets both transports share one answer layer: a transport decodes
//! requests and encodes replies, the handler decides.
//!
//! # The wire
//! Each `read(2)` returns one whole request: `struct fuse_in_header`, the operation's fixed
//! input (`fuse_open_in`, `fuse_read_in`, ...: [`op_in_len`]) and then its variable part (a
//! name). The request is handed to the handler exactly as the ring hands it (the fixed input
//! zero-padded to the ring's 128 bytes), so a handler cannot tell the transports apart. Every
//! request but `FORGET`, `BATCH_FORGET` and `INTERRUPT` gets exactly one reply:
//! `struct fuse_out_header` (length, negative errno, the request's `unique`) and the data, in
//! one `write(2)`. Several threads read the same descriptor; the kernel gives each request to
//! one of them.
//!
//! `INTERRUPT` is not acted on: every answer here comes from memory or one `pread`, so the
//! interrupted request is answered at once anyway.
//!
//! # The end of a connection
//! `read` fails with `ENODEV` once the connection is gone (unmounted everywhere, or aborted
//! through `fusectl`); each thread then ends and reports why ([`Ended`]), so the mount server
//! notices its session dying instead of answering health checks for a dead mount.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::abi::{self, opcode, InHeader};
use crate::ring::{call_handler, Handler, Reply, Request, REQUEST_PAYLOAD_MAX};

/// Why a `/dev/fuse` thread stopped serving.
#[derive(Debug)]
pub enum Ended {
    /// The connection is gone (`ENODEV`): unmounted everywhere or aborted.
    Connection,
    /// Reading or writing failed for another reason.
    Failed(io::Error),
}

#[derive(Clone, Debug)]
pub struct DevConfig {
    pub threads: usize,
    /// Bytes of each thread's request and reply buffers: at least the connection's largest
    /// request or reply (`max_write`, `max_pages * page size`) plus the headers.
    pub buffer_size: usize,
}

/// The serving threads of one connection.
pub struct RunningDev {
    threads: Vec<JoinHandle<()>>,
    ended: Mutex<mpsc::Receiver<Ended>>,
}

/// Starts `config.threads` threads answering requests read from `dev`.
pub fn serve_dev(
    dev: Arc<OwnedFd>,
    handler: Arc<dyn Handler>,
    config: &DevConfig,
) -> io::Result<RunningDev> {
    let (tx, rx) = mpsc::channel();
    let mut threads = Vec::new();
    for n in 0..config.threads.max(1) {
        let dev = dev.clone();
        let handler = handler.clone();
        let tx = tx.clone();
        let size = config
            .buffer_size
            .max(abi::IN_HEADER_LEN + 128 + REQUEST_PAYLOAD_MAX)
            .max(8192);
        threads.push(
            std::thread::Builder::new()
                .name(format!("fuse-dev-{n}"))
                .spawn(move || {
                    let ended = serve(&dev, &*handler, size);
                    let _ = tx.send(ended);
                })?,
        );
    }
    Ok(RunningDev {
        threads,
        ended: Mutex::new(rx),
    })
}

impl RunningDev {
    /// Waits up to `timeout` for a thread to end; why it ended.
    pub fn wait_ended(&self, timeout: Duration) -> Option<Ended> {
        let rx = self.ended.lock().unwrap_or_else(|p| p.into_inner());
        rx.recv_timeout(timeout).ok()
    }

    /// Waits for every thread to end (after the connection ended).
    pub fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// Bytes of the fixed input of each operation, after `struct fuse_in_header` (kernel
/// `include/uapi/linux/fuse.h`); the rest of a request is its variable part. Operations not
/// listed take everything up to 128 bytes (they are answered `ENOSYS` whatever they carry).
pub fn op_in_len(op: u32) -> usize {
    match op {
        opcode::LOOKUP | opcode::UNLINK | opcode::RMDIR | opcode::SYMLINK | opcode::STATFS => 0,
        opcode::REMOVEXATTR | opcode::READLINK | opcode::DESTROY => 0,
        opcode::OPEN | opcode::OPENDIR | opcode::GETXATTR | opcode::LISTXATTR => 8,
        opcode::SETXATTR | opcode::MKDIR | opcode::RENAME | opcode::LINK | opcode::ACCESS => 8,
        opcode::FORGET | opcode::BATCH_FORGET | opcode::INTERRUPT | opcode::SYNCFS => 8,
        opcode::GETATTR | opcode::MKNOD | opcode::CREATE | opcode::RENAME2 | opcode::FSYNC => 16,
        opcode::FSYNCDIR | opcode::BMAP | opcode::TMPFILE => 16,
        opcode::RELEASE | opcode::RELEASEDIR | opcode::FLUSH | opcode::POLL | opcode::LSEEK => 24,
        opcode::STATX => 24,
        opcode::IOCTL | opcode::FALLOCATE => 32,
        opcode::READ | opcode::WRITE | opcode::READDIR | opcode::READDIRPLUS => 40,
        opcode::GETLK | opcode::SETLK | opcode::SETLKW => 48,
        opcode::COPY_FILE_RANGE => 56,
        opcode::SETATTR => 88,
        _ => 128,
    }
}

fn errno_of(e: rustix::io::Errno) -> i32 {
    e.raw_os_error()
}

fn serve(dev: &OwnedFd, handler: &dyn Handler, size: usize) -> Ended {
    let mut request = vec![0u8; size];
    let mut out = vec![0u8; size];
    let mut failed_in_a_row = 0u32;
    loop {
        let n = match rustix::io::read(dev, &mut request) {
            Ok(n) => n,
            Err(e) => match errno_of(e) {
                // Interrupted, or a request the kernel dropped before we could read it.
                libc::EINTR | libc::EAGAIN | libc::ENOENT => continue,
                libc::ENODEV => return Ended::Connection,
                // A bug on one side (a buffer smaller than the negotiated requests, say): the
                // thread keeps its place rather than leave the connection with one reader
                // fewer, and gives up only if it keeps failing.
                _ => {
                    failed_in_a_row += 1;
                    tracing::error!(error = %e, failed_in_a_row, "reading a FUSE request failed");
                    if failed_in_a_row >= 100 {
                        return Ended::Failed(e.into());
                    }
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            },
        };
        failed_in_a_row = 0;
        if n < abi::IN_HEADER_LEN {
            tracing::error!(bytes = n, "short FUSE request ignored");
            continue;
        }
        let header = InHeader::parse(&request[..abi::IN_HEADER_LEN]);
        let body = &request[abi::IN_HEADER_LEN..n];
        match header.opcode {
            opcode::FORGET => {
                if body.len() >= 8 {
                    handler.forget(header.nodeid, abi::u64_at(body, 0));
                }
                continue;
            }
            opcode::BATCH_FORGET => {
                let count = if body.len() >= 4 {
                    abi::u32_at(body, 0) as usize
                } else {
                    0
                };
                for entry in body.get(8..).unwrap_or(&[]).chunks_exact(16).take(count) {
                    handler.forget(abi::u64_at(entry, 0), abi::u64_at(entry, 8));
                }
                continue;
            }
            opcode::INTERRUPT => continue,
            _ => {}
        }
        let fixed = op_in_len(header.opcode).min(body.len());
        let mut op_in = [0u8; 128];
        op_in[..fixed.min(128)].copy_from_slice(&body[..fixed.min(128)]);
        let rest = &body[fixed..];
        let payload = &rest[..rest.len().min(REQUEST_PAYLOAD_MAX)];
        let req = Request {
            header,
            op_in: &op_in,
            payload,
        };
        let (len, error) = {
            let mut reply = Reply::new(&mut out[abi::OUT_HEADER_LEN..]);
            call_handler(handler, &req, &mut reply);
            reply.outcome()
        };
        let total = abi::OUT_HEADER_LEN + len;
        abi::put_u32(&mut out, 0, total as u32);
        abi::put_u32(&mut out, 4, error as u32);
        abi::put_u64(&mut out, 8, header.unique);
        if let Err(e) = rustix::io::write(dev, &out[..total]) {
            match errno_of(e) {
                // The request was interrupted or its caller is gone.
                libc::ENOENT => {}
                libc::ENODEV => return Ended::Connection,
                _ => {
                    tracing::error!(opcode = header.opcode, error = %e, "writing a FUSE reply failed")
                }
            }
        }
    }
}

/// Notifications to the kernel on a connection's `/dev/fuse` descriptor (`unique` 0, the
/// notification code in the error field). They may be sent from any thread that is not
/// answering a request of the same connection.
#[derive(Clone)]
pub struct Notifier {
    dev: Arc<OwnedFd>,
}

const NOTIFY_INVAL_INODE: u32 = 2;
const NOTIFY_INVAL_ENTRY: u32 = 3;
const NOTIFY_DELETE: u32 = 6;
const NOTIFY_RESEND: u32 = 7;

impl Notifier {
    pub fn new(dev: Arc<OwnedFd>) -> Self {
        Self { dev }
    }

    fn send(&self, code: u32, body: &[&[u8]]) -> io::Result<()> {
        let len = abi::OUT_HEADER_LEN + body.iter().map(|b| b.len()).sum::<usize>();
        let mut msg = Vec::with_capacity(len);
        msg.extend_from_slice(&(len as u32).to_le_bytes());
        msg.extend_from_slice(&code.to_le_bytes());
        msg.extend_from_slice(&0u64.to_le_bytes());
        for b in body {
            msg.extend_from_slice(b);
        }
        let n = rustix::io::write(&*self.dev, &msg)?;
        if n != msg.len() {
            return Err(io::Error::other("short FUSE notification write"));
        }
        Ok(())
    }

    /// Drops the kernel's cached attributes and pages of `ino` (`FUSE_NOTIFY_INVAL_INODE`).
    pub fn inval_inode(&self, ino: u64) -> io::Result<()> {
        let mut b = [0u8; 24];
        abi::put_u64(&mut b, 0, ino);
        self.send(NOTIFY_INVAL_INODE, &[&b])
    }

    /// Drops the kernel's cached entry `name` in `parent` (`FUSE_NOTIFY_INVAL_ENTRY`).
    pub fn inval_entry(&self, parent: u64, name: &[u8]) -> io::Result<()> {
        let mut b = [0u8; 16];
        abi::put_u64(&mut b, 0, parent);
        abi::put_u32(&mut b, 8, name.len() as u32);
        self.send(NOTIFY_INVAL_ENTRY, &[&b, name, &[0]])
    }

    /// Tells the kernel that `name` (inode `child`) left `parent` (`FUSE_NOTIFY_DELETE`).
    pub fn delete(&self, parent: u64, child: u64, name: &[u8]) -> io::Result<()> {
        let mut b = [0u8; 24];
        abi::put_u64(&mut b, 0, parent);
        abi::put_u64(&mut b, 8, child);
        abi::put_u32(&mut b, 16, name.len() as u32);
        self.send(NOTIFY_DELETE, &[&b, name, &[0]])
    }

    /// Asks the kernel to queue again every request that was read from this connection but
    /// never answered (`FUSE_NOTIFY_RESEND`, Linux >= 6.9): what a process that died while
    /// answering had taken.
    pub fn resend(&self) -> io::Result<()> {
        self.send(NOTIFY_RESEND, &[])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_inputs_match_the_kernel_structs() {
        // sizeof(struct fuse_read_in), fuse_open_in, fuse_release_in, fuse_getattr_in.
        assert_eq!(op_in_len(opcode::READ), 40);
        assert_eq!(op_in_len(opcode::OPEN), 8);
        assert_eq!(op_in_len(opcode::RELEASE), 24);
        assert_eq!(op_in_len(opcode::GETATTR), 16);
        assert_eq!(
            op_in_len(opcode::LOOKUP),
            0,
            "a lookup carries only the name"
        );
        assert_eq!(op_in_len(opcode::IOCTL), 32);
        assert_eq!(op_in_len(9999), 128);
    }
}
