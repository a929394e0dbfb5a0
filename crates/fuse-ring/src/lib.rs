//! FUSE over io_uring beside a `fuser` session.
//!
//! # Why
//! Over `/dev/fuse` every request costs two wakeups: the kernel wakes a daemon thread blocked
//! in `read(2)` (the longest-waiting one, on whatever CPU it last ran) and the daemon's reply
//! wakes the caller. On the reference machine each is an inter-processor interrupt, about 18 us,
//! so an `OPEN` costs 35 to 40 us where the daemon's own work is under 5 us. Linux 6.14 added
//! per-CPU request queues served over io_uring (`FUSE_OVER_IO_URING`): a request made on CPU n
//! goes to queue n, whose threads are pinned to CPU n, so both wakeups stay on the caller's CPU.
//! `fuser` 0.18, the project's FUSE library, has no ring transport; this crate is one, kept to
//! the transport so the filesystem logic stays in the mount crate's adapter.
//!
//! # How it fits with fuser
//! `fuser` still mounts, answers `FUSE_INIT` (asking for `FUSE_OVER_IO_URING` when
//! [`prepare`] succeeded) and runs its loop on `/dev/fuse`: the kernel keeps sending `FORGET`
//! and `INTERRUPT` there, and everything else there too if the ring is refused. Once `INIT` is
//! answered the kernel holds every new request until each CPU's queue has an entry registered
//! (or a registration fails, which turns the ring off for the connection and releases them to
//! `/dev/fuse`), so no request is ever answered by both transports and none waits on a ring that
//! will not come: every ring is created before `INIT` ([`prepare`]), and a connection that asked
//! for the ring always gets a registration attempt per queue ([`PreparedRing::start`]).
//!
//! # The protocol (kernel `fs/fuse/dev_uring.c`)
//! Each ring entry is a header buffer (`struct fuse_uring_req_header`: the in/out header, the
//! operation's fixed input, the payload size) and a payload buffer of the connection's largest
//! request (`max(max_write, max_pages * page size)`). `REGISTER` hands both to the kernel as an
//! `IORING_OP_URING_CMD` on the `/dev/fuse` descriptor (128-byte SQEs: the command sits in the
//! SQE's 80-byte area); its completion means a request is in the buffers. The reply is written
//! into the same buffers and `COMMIT_AND_FETCH` returns it and waits for the next request in one
//! submission. Completions with an error mean the connection ended (`ENOTCONN` on unmount or
//! abort, `ECANCELED` when the ring goes away): the thread then exits. Any other error is a bug
//! on one side; the thread logs it and registers its entry again rather than leave its CPU's
//! queue with one entry fewer (a queue without entries would hold that CPU's requests forever).
//!
//! Requests are answered in the thread that received them, one at a time per thread; each CPU's
//! queue has several threads so a blocking read-through `pread` does not hold up the CPU's
//! other requests. The entries' buffers are slots of one shared mapping ([`memory`]) that a
//! process taking the connection over maps at the same address, to answer what a dead process
//! had received; with a keeper process the rings themselves are the keeper's ([`kept`]), so
//! no request fails while no server runs.

pub mod abi;
mod dev;
pub mod kept;
pub mod memory;
mod ring;

pub use dev::{op_in_len, serve_dev, DevConfig, Ended, Notifier, RunningDev};

pub use kept::{create_kept_rings, KeptRings, RingLayout};
pub use memory::RingMemory;
pub use ring::{
    possible_cpus, prepare, prepare_kept, BackingId, Handler, PreparedRing, Reply, Request,
    RunningRing,
};
