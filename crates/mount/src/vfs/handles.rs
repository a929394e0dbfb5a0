//! Open file handles: one table of everything an open file holds.
//!
//! # One row per handle
//! Every handle the core gives out is one row, keyed by its number (`fh`): the [`OpenBlob`]
//! it reads, which holds the store it was opened on (see the core's "Open files and stores"),
//! and its inode, which says how the kernel reads it. A handle enters the table in one call
//! ([`FsCore::open_with`], [`FsCore::open`], [`FsCore::restore_inode`]) and leaves it in one
//! ([`FsCore::release`]), so no part of an open file's state can be left behind by, or exist
//! before, its handle. The number and the inode are all a successor process needs to open the
//! handle again (the FUSE adapter journals them, see `crate::fuse::journal`).
//!
//! # One mode per inode
//! The kernel requires every open handle of one inode to be read the same way: all through the
//! daemon (*read-through*, [`FsCore::read`]) or all from one blob registered with it (a
//! [`Backing`]: FUSE passthrough's backing id; a second registration for an inode fails with
//! `EBUSY`, an open whose mode differs from the inode's open handles with `EIO`). So the mode
//! is kept per inode next to its handle count, and a new handle takes the inode's mode: an
//! inode with read-through handles open gets read-through handles until they are all
//! released, an inode with a registration gives it to every new handle. Only an inode with
//! neither may be registered, under the table's lock, so two opens cannot both register it.
//!
//! # Idle registrations
//! After the last handle of a registered inode is released the registration stays *idle* (at
//! most `idle_limit` of them, the least recently released dropped first), so the next open of
//! the inode skips registering the blob again (one ioctl on open and one on release). An idle
//! registration holds its blob open, and with it the blob's store, which only the mapping may
//! keep alive: it turns idle only while its blob is the one the mapping serves
//! ([`FsCore::still_serves`]; else it goes with its last handle), and idle registrations are
//! dropped whenever the mapping changes ([`FsCore::drop_idle_registrations`], called by the
//! FUSE adapter before a change's invalidations are sent and again when a retired slot is
//! detached). A registration shared by handles opened before and after a flip keeps the blob it
//! was made from (same bytes, the other store's file): the kernel reads that file for all of
//! them.
//!
//! # Connections
//! Handle numbers and registrations belong to one kernel connection. A new one
//! ([`FsCore::attach_kernel`]) starts from an empty table: the previous connection's handles can
//! never be read or released again (they would pin their stores forever) and its registrations
//! mean nothing to the new one. Numbers keep increasing across connections, so a late release
//! from the old connection's threads cannot hit a new handle.
//!
//! Leaving the table does not end a registration by itself: what leaves is handed to the caller
//! as [`Unregistered`], which records that (the journal) and then drops it; the drop ends the
//! registration (an ioctl, outside the table's lock).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::{FsCore, FsError, OpenBlob};

/// A blob registered with the kernel so that the kernel serves an inode's reads itself (FUSE
/// passthrough's backing id). Dropping the last reference ends the registration.
pub trait Backing: Send + Sync {
    /// The number the kernel knows the registration by.
    fn id(&self) -> u32;
}

/// How the kernel reads a new handle.
#[derive(Clone)]
pub enum Mode {
    /// Through the daemon ([`FsCore::read`]).
    ReadThrough,
    /// From the registered blob; `reused` when the inode had the registration already.
    Passthrough {
        backing: Arc<dyn Backing>,
        reused: bool,
    },
}

/// A new handle: its number, the blob it reads and how the kernel reads it.
pub struct OpenedHandle {
    pub fh: u64,
    pub blob: Arc<OpenBlob>,
    pub mode: Mode,
}

/// A registration that left the table (module docs): record it, then drop it.
pub struct Unregistered {
    pub ino: u64,
    // Declared first: the registration ends before the blob's descriptor is closed.
    _backing: Arc<dyn Backing>,
    _blob: Option<Arc<OpenBlob>>,
}

/// What [`FsCore::release`] took out of the table.
pub struct Released {
    pub ino: u64,
    /// The inode's registration when it went with this handle, and idle ones beyond the limit.
    pub unregistered: Vec<Unregistered>,
}

/// What [`FsCore::restore_inode`] made of a previous process's handles of one inode.
pub struct Restored {
    /// Handles open again under their numbers.
    pub reopened: usize,
    /// Handles whose blob cannot be opened any more, and why: not in the table, so their reads
    /// fail with `EBADF` and their release changes nothing.
    pub lost: Vec<(u64, FsError)>,
    /// The registration when the inode's blob cannot be had, and idle ones beyond the limit.
    pub unregistered: Vec<Unregistered>,
}

struct Registration {
    backing: Arc<dyn Backing>,
    /// The blob the registration was made from.
    blob: Arc<OpenBlob>,
}

/// The open handles of one inode and the mode they share (module docs).
enum InodeHandles {
    ReadThrough {
        handles: usize,
    },
    Registered {
        registration: Registration,
        handles: usize,
        /// Set while no handle is open: the registration's key in [`HandleTable::idle`].
        idle_since: Option<u64>,
    },
}

/// Every open handle and each inode's mode (module docs). Invariants, kept by every method:
/// each handle's inode has an entry whose count is the number of its handles; a read-through
/// entry has at least one handle; a registered entry is in `idle` exactly when it has none.
pub(super) struct HandleTable {
    files: HashMap<u64, Arc<OpenBlob>>,
    inodes: HashMap<u64, InodeHandles>,
    /// Idle registrations by release order: (sequence number -> inode).
    idle: BTreeMap<u64, u64>,
    next_idle: u64,
    idle_limit: usize,
    next_fh: u64,
}

impl Default for HandleTable {
    fn default() -> Self {
        Self {
            files: HashMap::new(),
            inodes: HashMap::new(),
            idle: BTreeMap::new(),
            next_idle: 0,
            // No kernel yet: nothing is registered, nothing kept idle.
            idle_limit: 0,
            next_fh: 1,
        }
    }
}

impl HandleTable {
    pub(super) fn get(&self, fh: u64) -> Option<Arc<OpenBlob>> {
        self.files.get(&fh).cloned()
    }

    /// The blobs of every open handle.
    pub(super) fn blobs(&self) -> impl Iterator<Item = &Arc<OpenBlob>> {
        self.files.values()
    }

    fn new_fh(&mut self) -> u64 {
        let fh = self.next_fh;
        self.next_fh += 1;
        fh
    }

    /// Adds handle `fh` of `blob.ino`. `registered` is the registration for an inode that has
    /// no entry yet (none: read-through); an inode with an entry keeps its mode.
    fn add(&mut self, fh: u64, blob: Arc<OpenBlob>, registered: Option<Arc<dyn Backing>>) {
        let ino = blob.ino;
        match self.inodes.get_mut(&ino) {
            Some(InodeHandles::ReadThrough { handles }) => *handles += 1,
            Some(InodeHandles::Registered {
                handles,
                idle_since,
                ..
            }) => {
                *handles += 1;
                if let Some(seq) = idle_since.take() {
                    self.idle.remove(&seq);
                }
            }
            None => {
                let entry = match registered {
                    Some(backing) => InodeHandles::Registered {
                        registration: Registration {
                            backing,
                            blob: blob.clone(),
                        },
                        handles: 1,
                        idle_since: None,
                    },
                    None => InodeHandles::ReadThrough { handles: 1 },
                };
                self.inodes.insert(ino, entry);
            }
        }
        self.next_fh = self.next_fh.max(fh + 1);
        self.files.insert(fh, blob);
    }

    /// Takes handle `fh` out; its inode's registration turns idle with its last handle if
    /// `keep` says the blob is still the one served, else goes.
    fn remove(&mut self, fh: u64, keep: impl Fn(&OpenBlob) -> bool) -> Option<Released> {
        let blob = self.files.remove(&fh)?;
        let ino = blob.ino;
        let mut unregistered = Vec::new();
        match self.inodes.get_mut(&ino) {
            Some(InodeHandles::ReadThrough { handles }) => {
                *handles -= 1;
                if *handles == 0 {
                    self.inodes.remove(&ino);
                }
            }
            Some(InodeHandles::Registered {
                registration,
                handles,
                idle_since,
            }) => {
                *handles -= 1;
                if *handles == 0 {
                    if keep(&registration.blob) {
                        let seq = self.next_idle;
                        self.next_idle += 1;
                        *idle_since = Some(seq);
                        self.idle.insert(seq, ino);
                    } else {
                        unregistered.extend(self.unregister(ino));
                    }
                }
            }
            None => {}
        }
        unregistered.extend(self.trim_idle());
        Some(Released { ino, unregistered })
    }

    fn push_idle(&mut self, ino: u64) -> u64 {
        let seq = self.next_idle;
        self.next_idle += 1;
        self.idle.insert(seq, ino);
        seq
    }

    /// Removes `ino`'s entry if it is a registration.
    fn unregister(&mut self, ino: u64) -> Option<Unregistered> {
        match self.inodes.remove(&ino)? {
            InodeHandles::Registered { registration, .. } => Some(Unregistered {
                ino,
                _backing: registration.backing,
                _blob: Some(registration.blob),
            }),
            other => {
                self.inodes.insert(ino, other);
                None
            }
        }
    }

    /// Drops the oldest idle registrations beyond the limit.
    fn trim_idle(&mut self) -> Vec<Unregistered> {
        let mut out = Vec::new();
        while self.idle.len() > self.idle_limit {
            let Some((_, ino)) = self.idle.pop_first() else {
                break;
            };
            out.extend(self.unregister(ino));
        }
        out
    }

    /// Drops every idle registration; those with open handles stay.
    fn drop_idle(&mut self) -> Vec<Unregistered> {
        let idle = std::mem::take(&mut self.idle);
        idle.into_values()
            .filter_map(|ino| self.unregister(ino))
            .collect()
    }

    /// Whether the inode has a registration or handles open, and which.
    fn mode_of(&self, ino: u64) -> Option<Option<Arc<dyn Backing>>> {
        self.inodes.get(&ino).map(|e| match e {
            InodeHandles::ReadThrough { .. } => None,
            InodeHandles::Registered { registration, .. } => Some(registration.backing.clone()),
        })
    }
}

impl FsCore {
    pub(super) fn table(&self) -> std::sync::RwLockReadGuard<'_, HandleTable> {
        self.handles
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn table_mut(&self) -> std::sync::RwLockWriteGuard<'_, HandleTable> {
        self.handles
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A kernel connection starts serving this core (module docs, "Connections"): the table
    /// starts empty, and at most `idle_limit` idle registrations are kept from now on.
    pub fn attach_kernel(&self, idle_limit: usize) {
        let previous = {
            let mut table = self.table_mut();
            let next_fh = table.next_fh;
            std::mem::replace(
                &mut *table,
                HandleTable {
                    idle_limit,
                    next_fh,
                    ..HandleTable::default()
                },
            )
        };
        if !previous.files.is_empty() {
            tracing::info!(
                handles = previous.files.len(),
                "handles of the previous kernel connection dropped"
            );
        }
        // Their stores may have lost their last user.
        drop(previous);
        self.usage_epoch
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    /// Opens `ino` for reading as a new handle (the blob the mapping serves now, see `open_blob`)
    /// in the inode's mode (module docs). `register` is asked for a registration of the blob
    /// when the inode has none; its flag says whether one may be made (false while the inode
    /// has read-through handles open: a registration returned then is dropped). It runs under
    /// the table's lock; its error fails the open, and nothing is added then.
    pub fn open_with(
        &self,
        ino: u64,
        register: impl FnOnce(&OpenBlob, bool) -> Result<Option<Arc<dyn Backing>>, FsError>,
    ) -> Result<OpenedHandle, FsError> {
        let blob = Arc::new(self.open_blob(ino)?);
        let mut table = self.table_mut();
        let mode = match table.mode_of(ino) {
            Some(Some(backing)) => Mode::Passthrough {
                backing,
                reused: true,
            },
            Some(None) => {
                register(&blob, false)?;
                Mode::ReadThrough
            }
            None => match register(&blob, true)? {
                Some(backing) => Mode::Passthrough {
                    backing,
                    reused: false,
                },
                None => Mode::ReadThrough,
            },
        };
        let fh = table.new_fh();
        let registered = match &mode {
            Mode::Passthrough { backing, .. } => Some(backing.clone()),
            Mode::ReadThrough => None,
        };
        table.add(fh, blob.clone(), registered);
        Ok(OpenedHandle { fh, blob, mode })
    }

    /// Opens `ino` as a read-through handle: for readers without a kernel (the agent's
    /// in-process checks, tests). See [`FsCore::open_with`].
    pub fn open(&self, ino: u64) -> Result<(u64, Arc<OpenBlob>), FsError> {
        let opened = self.open_with(ino, |_, _| Ok(None))?;
        Ok((opened.fh, opened.blob))
    }

    /// Takes over one inode's handles and registration from a previous process that served the
    /// same connection (`crate::takeover`): each handle is opened again under the number the
    /// kernel holds (later handles are numbered above every one given, lost ones included),
    /// and the inode is read as before, through `backing` if it had one. Without a handle left
    /// the registration stays idle if the inode still opens (a new open reuses it), else it is
    /// handed back.
    pub fn restore_inode(
        &self,
        ino: u64,
        fhs: &[u64],
        backing: Option<Arc<dyn Backing>>,
    ) -> Restored {
        let mut reopened = Vec::new();
        let mut lost = Vec::new();
        for &fh in fhs {
            if self.table().files.contains_key(&fh) {
                // Taken over once already: a journal holds one record per handle.
                lost.push((fh, FsError::BadHandle));
                continue;
            }
            match self.open_blob(ino) {
                Ok(blob) => reopened.push((fh, Arc::new(blob))),
                Err(e) => lost.push((fh, e)),
            }
        }
        let count = reopened.len();
        // Opened before the lock is taken: an open may wait for a file to verify.
        let idle_blob = match &backing {
            Some(_) if count == 0 => self.open_blob(ino).ok(),
            _ => None,
        };
        let mut table = self.table_mut();
        // Above lost handles too: the kernel still holds them, and will release them.
        if let Some(&top) = fhs.iter().max() {
            table.next_fh = table.next_fh.max(top + 1);
        }
        let mut unregistered = Vec::new();
        for (fh, blob) in reopened {
            table.add(fh, blob, backing.clone());
        }
        if let Some(backing) = backing.filter(|_| count == 0) {
            match idle_blob {
                Some(blob) if table.mode_of(ino).is_none() => {
                    let seq = table.push_idle(ino);
                    table.inodes.insert(
                        ino,
                        InodeHandles::Registered {
                            registration: Registration {
                                backing,
                                blob: Arc::new(blob),
                            },
                            handles: 0,
                            idle_since: Some(seq),
                        },
                    );
                }
                _ => unregistered.push(Unregistered {
                    ino,
                    _backing: backing,
                    _blob: None,
                }),
            }
        }
        unregistered.extend(table.trim_idle());
        Restored {
            reopened: count,
            lost,
            unregistered,
        }
    }

    /// Releases handle `fh` (`None` if it is not open). Its inode's registration turns idle
    /// with its last handle while the mapping still serves its blob, else goes (module docs).
    pub fn release(&self, fh: u64) -> Option<Released> {
        let released = self.table_mut().remove(fh, |blob| self.still_serves(blob));
        self.usage_epoch
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        released
    }

    /// Drops every idle registration (the mapping changed; module docs).
    pub fn drop_idle_registrations(&self) -> Vec<Unregistered> {
        self.table_mut().drop_idle()
    }
}
