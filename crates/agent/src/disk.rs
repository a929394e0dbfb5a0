//! The disk under the stores (SPEC section 12): the budget, what the filesystem says, and
//! where the store sits relative to the models root.
//!
//! # The budget
//! `--disk-budget` is either a size (`500G`, `2TiB`, plain bytes) that the stores may use in
//! all, or a percentage of the filesystem (`90%`, the default) that the filesystem may be
//! filled to, whoever fills it. Free space under the budget is then
//!
//! * a size `B`: `min(B - stores, available)`: the stores stay within `B`, and never count
//!   on more than the filesystem has;
//! * a percentage `p`: `available - (1 - p) * (used + available)`: the last `1 - p` of the
//!   filesystem is a safety margin left to everyone else (logs, images, another writer), so
//!   a full budget never means a full disk.
//!
//! `available` is `statvfs`'s `f_bavail` (what an unprivileged writer may still use) and
//! `used` is `f_blocks - f_bfree`. The percentage is of `used + available`, the part of the
//! filesystem writers can ever have, not of `f_blocks`: blocks reserved for root (5% on ext4
//! by default, far more on some volumes) are never usable, and counting them would turn the
//! margin into a refusal of every fetch. Fetches already admitted but not finished have their
//! remaining bytes subtracted by the caller ([`DiskState::free_for_new_fetch`]), so two fetches
//! that each fit alone are not both admitted into room for one.
//!
//! # Placement
//! A hard link (adoption of an old agent's files, the store splits) needs one filesystem
//! *reached through one mount* (`link(2)` returns `EXDEV` across mounts, even of the same
//! filesystem). [`Placement`] compares the mount ids (`statx` `STATX_MNT_ID`) of the state
//! directory and of the directory underneath the models root, and the filesystems (device
//! numbers), and the daemon states at start which is the case: the same mount (adoption is a
//! hard link), or not (adoption copies: the cost in bytes is the old tree's size, stated).

use std::fmt;
use std::os::fd::AsFd;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// `--disk-budget`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DiskBudget {
    /// The stores may use this many bytes in all.
    Bytes(u64),
    /// The filesystem may be filled to this share of its size (0 < p <= 100).
    Percent(f64),
}

/// The default budget: fill the filesystem to 90% at most.
pub const DEFAULT_DISK_BUDGET: DiskBudget = DiskBudget::Percent(90.0);

impl Default for DiskBudget {
    fn default() -> Self {
        DEFAULT_DISK_BUDGET
    }
}

impl fmt::Display for DiskBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DiskBudget::Bytes(n) => write!(f, "{n}"),
            DiskBudget::Percent(p) => write!(f, "{p}%"),
        }
    }
}

impl FromStr for DiskBudget {
    type Err = String;

    /// `90%`, `12.5%`; `1073741824`; `500G`, `500GB` (decimal, as Kubernetes quantities);
    /// `500Gi`, `500GiB` (binary). Units K, M, G, T, P, E.
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let bad = || {
            format!(
                "{s:?} is not a disk budget: give a size (500G, 2TiB, 1073741824) or a \
                 percentage of the filesystem (90%)"
            )
        };
        if let Some(p) = t.strip_suffix('%') {
            let p: f64 = p.trim().parse().map_err(|_| bad())?;
            if !(p > 0.0 && p <= 100.0) {
                return Err(format!(
                    "{s:?}: a percentage budget must be above 0% and at most 100%"
                ));
            }
            return Ok(DiskBudget::Percent(p));
        }
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let unit = unit.trim();
        let num: f64 = num.parse().map_err(|_| bad())?;
        let (letter, rest) = match unit.chars().next() {
            None => (None, ""),
            Some(c) => (Some(c.to_ascii_uppercase()), &unit[1..]),
        };
        let power = match letter {
            None => 0,
            Some('K') => 1,
            Some('M') => 2,
            Some('G') => 3,
            Some('T') => 4,
            Some('P') => 5,
            Some('E') => 6,
            Some('B') if rest.is_empty() => 0,
            _ => return Err(bad()),
        };
        let base: f64 = match rest {
            "" | "B" | "b" => 1000.0,
            "i" | "iB" | "ib" => 1024.0,
            _ => return Err(bad()),
        };
        let bytes = num * base.powi(power);
        if !bytes.is_finite() || bytes < 1.0 || bytes >= u64::MAX as f64 {
            return Err(format!("{s:?}: a size budget must be at least one byte"));
        }
        Ok(DiskBudget::Bytes(bytes as u64))
    }
}

/// What `statvfs` says of one filesystem, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsSpace {
    pub size: u64,
    /// Free for an unprivileged writer (`f_bavail`).
    pub available: u64,
    /// Used by anyone (`size - f_bfree`).
    pub used: u64,
}

impl FsSpace {
    /// What writers can ever have: used plus available (not the blocks reserved for root).
    pub fn usable(&self) -> u64 {
        self.used.saturating_add(self.available)
    }

    pub fn of(path: &Path) -> std::io::Result<Self> {
        let v = rustix::fs::statvfs(path)?;
        let unit = if v.f_frsize > 0 {
            v.f_frsize
        } else {
            v.f_bsize
        };
        Ok(Self {
            size: v.f_blocks.saturating_mul(unit),
            available: v.f_bavail.saturating_mul(unit),
            used: v.f_blocks.saturating_sub(v.f_bfree).saturating_mul(unit),
        })
    }
}

impl DiskBudget {
    /// The budget in bytes on a filesystem of `fs.size`.
    pub fn limit(&self, fs: &FsSpace) -> u64 {
        match *self {
            DiskBudget::Bytes(n) => n,
            DiskBudget::Percent(p) => (fs.usable() as f64 * p / 100.0) as u64,
        }
    }

    /// Bytes the stores may still write (see the module docs), `stores` being what they use.
    pub fn free(&self, fs: &FsSpace, stores: u64) -> u64 {
        match *self {
            DiskBudget::Bytes(n) => n.saturating_sub(stores).min(fs.available),
            DiskBudget::Percent(_) => {
                let margin = fs.usable().saturating_sub(self.limit(fs));
                fs.available.saturating_sub(margin)
            }
        }
    }
}

/// The disk as last measured: the document of `/v1/disk` and the source of the disk metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskState {
    /// The state directory (stores, records).
    pub state_dir: String,
    /// `--disk-budget` as given.
    pub budget: String,
    /// The budget in bytes.
    pub budget_bytes: u64,
    /// The filesystem of the state directory.
    pub filesystem: FsSpace,
    /// Bytes the stores use (blocks on disk; a blob linked into two stores counts twice).
    pub stores_bytes: u64,
    /// Of those, bytes of stores kept by the reserve label that serve nothing.
    pub reserved_bytes: u64,
    /// Of those, bytes of stores that serve nothing and wait for their grace period.
    pub releasable_bytes: u64,
    /// Bytes the fetches admitted so far will still write.
    pub committed_bytes: u64,
    /// Bytes free under the budget (net of nothing: see [`Self::free_for_new_fetch`]).
    pub free_bytes: u64,
    /// The largest fetch refused for space, if any is waiting: bytes it lacks.
    pub shortfall_bytes: u64,
}

/// The file in the state directory that keeps the last measured [`DiskState`], so that
/// `modelfs status --state` prints the disk line while the daemon is down.
pub const DISK_FILE: &str = "disk.json";

impl DiskState {
    /// This state with the filesystem measured again (`fs`), as `modelfs status --state`
    /// shows the saved one: the stores' bytes are as the daemon last counted them (a pass over
    /// the stores is its work), the budget in bytes and what is free under it follow the
    /// filesystem now, computed as the daemon computes them.
    pub fn with_filesystem(&self, fs: FsSpace) -> Self {
        let budget = self.budget.parse::<DiskBudget>().ok();
        Self {
            budget_bytes: budget.map(|b| b.limit(&fs)).unwrap_or(fs.size),
            free_bytes: budget
                .map(|b| b.free(&fs, self.stores_bytes))
                .unwrap_or(fs.available),
            filesystem: fs,
            ..self.clone()
        }
    }

    /// What of this state is worth saving again to [`DISK_FILE`] when it changes: not the
    /// filesystem's free bytes (they move with every write of anyone; the reader measures
    /// them), nor what admitted fetches still write (it moves with every tick of a fetch).
    pub fn saved_part(&self) -> (String, u64, u64, u64, u64) {
        (
            self.budget.clone(),
            self.stores_bytes,
            self.reserved_bytes,
            self.releasable_bytes,
            self.shortfall_bytes,
        )
    }

    /// One line for `modelfs status`.
    pub fn summary(&self) -> String {
        let h = crate::reconciler::decide::space::human_bytes;
        let mut line = format!(
            "disk: {} free under the budget ({} = {}); stores use {}, {} of it reserved, {} releasable; filesystem {} available of {}",
            h(self.free_for_new_fetch()),
            self.budget,
            h(self.budget_bytes),
            h(self.stores_bytes),
            h(self.reserved_bytes),
            h(self.releasable_bytes),
            h(self.filesystem.available),
            h(self.filesystem.size),
        );
        if self.shortfall_bytes > 0 {
            line.push_str(&format!(
                "; a refused fetch lacks {}",
                h(self.shortfall_bytes)
            ));
        }
        line
    }

    /// What a new fetch may use: free under the budget, minus what admitted fetches will
    /// still write.
    pub fn free_for_new_fetch(&self) -> u64 {
        self.free_bytes.saturating_sub(self.committed_bytes)
    }
}

/// Where the state directory and the models root are, as a hard link sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Placement {
    pub state_mount_id: u64,
    pub state_dev: (u32, u32),
    pub models_root_mount_id: u64,
    pub models_root_dev: (u32, u32),
    pub state_free: u64,
    pub models_root_free: u64,
}

impl Placement {
    /// Measures the state directory (`state`) and the directory underneath the models root
    /// (`under`: a descriptor opened before the mount covered it, or the path itself).
    pub fn measure(state: &Path, under: impl AsFd) -> std::io::Result<Self> {
        use rustix::fs::{AtFlags, StatxFlags, CWD};
        let flags = StatxFlags::MNT_ID | StatxFlags::BASIC_STATS;
        let s = rustix::fs::statx(CWD, state, AtFlags::empty(), flags)?;
        let u = rustix::fs::statx(under.as_fd(), "", AtFlags::EMPTY_PATH, flags)?;
        let free = |fd: rustix::fs::StatVfs| {
            let unit = if fd.f_frsize > 0 {
                fd.f_frsize
            } else {
                fd.f_bsize
            };
            fd.f_bavail.saturating_mul(unit)
        };
        Ok(Self {
            state_mount_id: s.stx_mnt_id,
            state_dev: (s.stx_dev_major, s.stx_dev_minor),
            models_root_mount_id: u.stx_mnt_id,
            models_root_dev: (u.stx_dev_major, u.stx_dev_minor),
            state_free: free(rustix::fs::statvfs(state)?),
            models_root_free: free(rustix::fs::fstatvfs(under.as_fd())?),
        })
    }

    /// Same mount: adoption and store splits are hard links.
    pub fn links(&self) -> bool {
        self.state_mount_id == self.models_root_mount_id
    }

    /// Same filesystem (maybe through two mounts).
    pub fn same_filesystem(&self) -> bool {
        self.state_dev == self.models_root_dev
    }
}

/// The default state directory for a models root: `<parent>/.modelfs-<name>`, beside it on
/// the same filesystem (the large disk on GPU nodes), and never below it (the mount would
/// hide it). `None` for a root without a parent or a name (`/`).
pub fn default_state_dir(models_root: &Path) -> Option<std::path::PathBuf> {
    let name = models_root.file_name()?;
    let parent = models_root.parent()?;
    let mut dir = std::ffi::OsString::from(".modelfs-");
    dir.push(name);
    Some(parent.join(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_parsing_table() {
        let cases: [(&str, Result<DiskBudget, ()>); 16] = [
            ("90%", Ok(DiskBudget::Percent(90.0))),
            (" 12.5 % ", Ok(DiskBudget::Percent(12.5))),
            ("100%", Ok(DiskBudget::Percent(100.0))),
            ("0%", Err(())),
            ("101%", Err(())),
            ("1073741824", Ok(DiskBudget::Bytes(1 << 30))),
            ("500G", Ok(DiskBudget::Bytes(500_000_000_000))),
            ("500GB", Ok(DiskBudget::Bytes(500_000_000_000))),
            ("2TiB", Ok(DiskBudget::Bytes(2 << 40))),
            ("2Ti", Ok(DiskBudget::Bytes(2 << 40))),
            ("64m", Ok(DiskBudget::Bytes(64_000_000))),
            ("1.5Gi", Ok(DiskBudget::Bytes(3 << 29))),
            ("10B", Ok(DiskBudget::Bytes(10))),
            ("", Err(())),
            ("lots", Err(())),
            ("5X", Err(())),
        ];
        for (text, want) in cases {
            let got = text.parse::<DiskBudget>().map_err(|_| ());
            assert_eq!(got, want, "{text:?}");
        }
        assert!("0".parse::<DiskBudget>().is_err());
        let e = "lots".parse::<DiskBudget>().unwrap_err();
        assert!(e.contains("500G") && e.contains("90%"), "{e}");
    }

    #[test]
    fn free_under_the_budget_table() {
        let fs = FsSpace {
            size: 1000,
            available: 300,
            used: 700,
        };
        // (budget, stores, free)
        let cases = [
            // 90% of 1000: a margin of 100 stays free for everyone else.
            (DiskBudget::Percent(90.0), 0, 200),
            (DiskBudget::Percent(50.0), 0, 0),
            (DiskBudget::Percent(100.0), 500, 300),
            // A size: what the stores may still use, never more than is available.
            (DiskBudget::Bytes(600), 500, 100),
            (DiskBudget::Bytes(6000), 500, 300),
            (DiskBudget::Bytes(400), 500, 0),
        ];
        for (budget, stores, free) in cases {
            assert_eq!(budget.free(&fs, stores), free, "{budget} with {stores}");
        }
        assert_eq!(DiskBudget::Percent(90.0).limit(&fs), 900);
        assert_eq!(DiskBudget::Bytes(7).limit(&fs), 7);
        // Blocks reserved for root (size 2000, of which 1000 nobody but root may use) are no
        // part of the percentage: the margin is 10% of what writers can have.
        let reserved = FsSpace {
            size: 2000,
            available: 300,
            used: 700,
        };
        assert_eq!(DiskBudget::Percent(90.0).limit(&reserved), 900);
        assert_eq!(DiskBudget::Percent(90.0).free(&reserved, 0), 200);
    }

    #[test]
    fn default_state_dir_sits_beside_the_models_root() {
        assert_eq!(
            default_state_dir(Path::new("/raid/models")),
            Some("/raid/.modelfs-models".into())
        );
        assert_eq!(
            default_state_dir(Path::new("/mnt/data/models/")),
            Some("/mnt/data/.modelfs-models".into())
        );
        assert_eq!(default_state_dir(Path::new("/")), None);
    }

    #[test]
    fn placement_of_one_directory_links() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("models");
        std::fs::create_dir(&sub).unwrap();
        let under = std::fs::File::open(&sub).unwrap();
        let p = Placement::measure(dir.path(), &under).unwrap();
        assert!(p.links() && p.same_filesystem(), "{p:?}");
        assert!(p.state_free > 0);
    }
}
