//! The journal of what the kernel holds from this connection beyond inode numbers: open file
//! handles (`fh`, with their inode) and registered passthrough backing ids (per inode).
//!
//! # Why
//! A mount server that resumes a connection another process served (see `crate::takeover`)
//! must answer `READ` and `RELEASE` for every handle the kernel still holds, and must give a
//! new open of an inode the backing id the inode's open handles already use (the kernel
//! refuses a second backing file per inode with `EBUSY`); ids it never learns of would stay
//! registered, holding their blobs open, for the life of the connection. Inode numbers are
//! stable (derived from the persisted mapping), so an inode and a handle number are all a
//! successor needs to reopen a handle's blob.
//!
//! # Layout
//! Fixed 32-byte records in a memory file (`memfd`) that travels with the connection's
//! descriptor: `kind` (u32: 0 free, 1 handle, 2 backing id), `backing` (u32), `key` (u64: the
//! handle for kind 1, the inode for kind 2), `ino` (u64), 8 reserved bytes. A record is
//! written with one `pwrite` when a handle opens or an id is registered, and zeroed when it
//! goes: no system call beyond that on the data path, and a process killed at any moment
//! leaves every record either whole or free (a 32-byte aligned `pwrite` to a memory file
//! is not torn by the death of the writer). Freed records are reused.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Mutex;

const RECORD: usize = 32;
const KIND_HANDLE: u32 = 1;
const KIND_BACKING: u32 = 2;

/// A record read back by a successor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    Handle { fh: u64, ino: u64 },
    Backing { ino: u64, id: u32 },
}

pub struct Journal {
    file: OwnedFd,
    slots: Mutex<Slots>,
}

#[derive(Default)]
struct Slots {
    /// (kind, key) -> record index.
    used: HashMap<(u32, u64), u32>,
    free: Vec<u32>,
    next: u32,
}

impl Journal {
    /// A new, empty journal.
    pub fn create() -> io::Result<Self> {
        let file = rustix::fs::memfd_create("modelfs-journal", rustix::fs::MemfdFlags::CLOEXEC)?;
        Ok(Self {
            file,
            slots: Mutex::new(Slots::default()),
        })
    }

    /// Takes over a journal another process wrote; returns it and its records.
    pub fn adopt(file: OwnedFd) -> io::Result<(Self, Vec<Entry>)> {
        let len = rustix::fs::fstat(&file)?.st_size as usize;
        let mut bytes = vec![0u8; len - len % RECORD];
        let mut done = 0;
        while done < bytes.len() {
            let n = rustix::io::pread(&file, &mut bytes[done..], done as u64)?;
            if n == 0 {
                break;
            }
            done += n;
        }
        let mut slots = Slots::default();
        let mut entries = Vec::new();
        for (i, r) in bytes[..done - done % RECORD]
            .chunks_exact(RECORD)
            .enumerate()
        {
            let i = i as u32;
            slots.next = i + 1;
            let kind = u32::from_le_bytes(r[0..4].try_into().expect("4 bytes"));
            let backing = u32::from_le_bytes(r[4..8].try_into().expect("4 bytes"));
            let key = u64::from_le_bytes(r[8..16].try_into().expect("8 bytes"));
            let ino = u64::from_le_bytes(r[16..24].try_into().expect("8 bytes"));
            let entry = match kind {
                KIND_HANDLE => Entry::Handle { fh: key, ino },
                KIND_BACKING => Entry::Backing {
                    ino: key,
                    id: backing,
                },
                _ => {
                    slots.free.push(i);
                    continue;
                }
            };
            slots.used.insert((kind, key), i);
            entries.push(entry);
        }
        Ok((
            Self {
                file,
                slots: Mutex::new(slots),
            },
            entries,
        ))
    }

    /// The memory file, to hand on with the connection.
    pub fn file(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        // Nothing under this lock can leave the slots half-changed.
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self, index: u32, record: &[u8; RECORD]) -> io::Result<()> {
        let n = rustix::io::pwrite(&self.file, record, u64::from(index) * RECORD as u64)?;
        if n != RECORD {
            return Err(io::Error::other("short journal write"));
        }
        Ok(())
    }

    fn put(&self, kind: u32, key: u64, ino: u64, backing: u32) -> io::Result<()> {
        let index = {
            let mut s = self.lock();
            match s.used.get(&(kind, key)) {
                Some(&i) => i,
                None => {
                    let i = s.free.pop().unwrap_or_else(|| {
                        s.next += 1;
                        s.next - 1
                    });
                    s.used.insert((kind, key), i);
                    i
                }
            }
        };
        let mut r = [0u8; RECORD];
        r[0..4].copy_from_slice(&kind.to_le_bytes());
        r[4..8].copy_from_slice(&backing.to_le_bytes());
        r[8..16].copy_from_slice(&key.to_le_bytes());
        r[16..24].copy_from_slice(&ino.to_le_bytes());
        self.write(index, &r)
    }

    fn clear(&self, kind: u32, key: u64) -> io::Result<()> {
        let index = self.lock().used.remove(&(kind, key));
        let Some(index) = index else {
            return Ok(());
        };
        let result = self.write(index, &[0u8; RECORD]);
        self.lock().free.push(index);
        result
    }

    pub fn handle_opened(&self, fh: u64, ino: u64) -> io::Result<()> {
        self.put(KIND_HANDLE, fh, ino, 0)
    }

    pub fn handle_released(&self, fh: u64) -> io::Result<()> {
        self.clear(KIND_HANDLE, fh)
    }

    pub fn backing_registered(&self, ino: u64, id: u32) -> io::Result<()> {
        self.put(KIND_BACKING, ino, ino, id)
    }

    pub fn backing_closed(&self, ino: u64) -> io::Result<()> {
        self.clear(KIND_BACKING, ino)
    }

    /// Records in use (for tests and metrics).
    pub fn len(&self) -> usize {
        self.lock().used.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn reopen(j: &Journal) -> (Journal, Vec<Entry>) {
        Journal::adopt(j.file().try_clone_to_owned().expect("dup")).expect("adopt")
    }

    #[test]
    fn a_successor_reads_back_what_is_open_and_nothing_released() {
        let j = Journal::create().expect("memfd");
        j.handle_opened(7, 100).unwrap();
        j.handle_opened(8, 100).unwrap();
        j.backing_registered(100, 3).unwrap();
        j.handle_opened(9, 200).unwrap();
        j.handle_released(8).unwrap();
        let (k, mut entries) = reopen(&j);
        entries.sort_by_key(|e| format!("{e:?}"));
        assert_eq!(
            entries,
            vec![
                Entry::Backing { ino: 100, id: 3 },
                Entry::Handle { fh: 7, ino: 100 },
                Entry::Handle { fh: 9, ino: 200 },
            ]
        );
        // The successor goes on writing into the same file: its records and frees reach the
        // next one in turn.
        k.handle_released(7).unwrap();
        k.backing_closed(100).unwrap();
        k.handle_opened(10, 300).unwrap();
        let (_, entries) = Journal::adopt(k.file.as_fd().try_clone_to_owned().unwrap()).unwrap();
        assert_eq!(
            entries,
            vec![
                Entry::Handle { fh: 10, ino: 300 },
                Entry::Handle { fh: 9, ino: 200 }
            ]
            .into_iter()
            .filter(|e| entries.contains(e))
            .collect::<Vec<_>>()
        );
        assert_eq!(entries.len(), 2);
        assert_eq!(k.len(), 2);
    }

    #[test]
    fn freed_records_are_reused() {
        let j = Journal::create().expect("memfd");
        for fh in 0..100 {
            j.handle_opened(fh, fh).unwrap();
            j.handle_released(fh).unwrap();
        }
        let size = rustix::fs::fstat(&j.file).unwrap().st_size;
        assert_eq!(size as usize, RECORD, "one record reused 100 times");
        assert!(j.is_empty());
    }
}
