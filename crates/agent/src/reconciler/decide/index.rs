//! Every model's wanted and served paths, by path: the path rule for one path looks only at the
//! models whose paths nest with it ([`PathIndex::related`]), not at every model, so a placement
//! costs O(log n + related) however many models the node has.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::reconciler::records::{Records, SmallSet};
use modelfs_ome::{ModelKey, MountPath};

/// Paths (as segments) to the models claiming them, and each model's indexed paths (to drop
/// them when its record changes or goes away).
#[derive(Default)]
pub struct PathIndex {
    by_path: BTreeMap<Vec<String>, SmallSet<ModelKey>>,
    of_model: HashMap<ModelKey, Vec<Vec<String>>>,
}

impl PathIndex {
    /// Indexes `key`'s wanted and served paths as `records` hold them now (after its record
    /// changed them or went away). The index may hold stale entries until the next call
    /// (harmless: claims come from the records), never miss a path.
    pub fn update(&mut self, records: &Records, key: &ModelKey) {
        let mut new: Vec<Vec<String>> = Vec::new();
        if let Some(rec) = records.models().get(key) {
            for p in [Some(rec.path.as_str()), rec.served_path.as_deref()]
                .into_iter()
                .flatten()
            {
                if let Ok(path) = MountPath::from_relative(p) {
                    let segs = path.segments().to_vec();
                    if !new.contains(&segs) {
                        new.push(segs);
                    }
                }
            }
        }
        let old = self.of_model.remove(key).unwrap_or_default();
        for p in old.iter().filter(|p| !new.contains(p)) {
            if let Some(keys) = self.by_path.get_mut(p) {
                keys.remove(key);
                if keys.is_empty() {
                    self.by_path.remove(p);
                }
            }
        }
        for p in &new {
            self.by_path
                .entry(p.clone())
                .or_default()
                .insert(key.clone());
        }
        if !new.is_empty() {
            self.of_model.insert(key.clone(), new);
        }
    }

    /// The models whose claims can decide the rule's verdict at `path`: those at or below its
    /// topmost claimed ancestor (or itself). Paths that do not nest cannot conflict, so the
    /// rest of the state never matters. O(log n + related).
    pub fn related(&self, path: &[String]) -> BTreeSet<ModelKey> {
        let root_len = (1..path.len())
            .find(|&n| self.by_path.contains_key(&path[..n]))
            .unwrap_or(path.len());
        let root = &path[..root_len];
        let mut out = BTreeSet::new();
        for (p, keys) in self.by_path.range(root.to_vec()..) {
            if !p.starts_with(root) {
                break;
            }
            out.extend(keys.iter().cloned());
        }
        out
    }

    /// The models indexed at exactly `path`.
    pub fn at(&self, path: &[String]) -> Option<&SmallSet<ModelKey>> {
        self.by_path.get(path)
    }

    /// Debug builds: the index holds every path of every record.
    #[cfg(debug_assertions)]
    pub fn check(&self, records: &Records) {
        for (key, rec) in records.models() {
            for p in [Some(rec.path.as_str()), rec.served_path.as_deref()]
                .into_iter()
                .flatten()
            {
                if let Ok(path) = MountPath::from_relative(p) {
                    assert!(
                        self.by_path
                            .get(path.segments())
                            .is_some_and(|keys| keys.contains(key)),
                        "path index misses {key} at {p}"
                    );
                }
            }
        }
    }
}
