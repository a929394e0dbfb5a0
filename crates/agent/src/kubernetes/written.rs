//! Which node ConfigMap keys and node labels this daemon has written, kept across restarts.
//!
//! OME's agent removes a key or label only for a model it handles; a model-shaped key that
//! someone added by hand, or that another writer owns, stays. modelfs does the same: the
//! status writer removes a model-shaped key or label only when it is in this set, that is when
//! modelfs wrote it at some time. A key OME's agent wrote for a model modelfs serves now is
//! rewritten by modelfs (its status is modelfs's now), which puts it in the set; one for a
//! model modelfs never served is left as OME's agent would leave a key it does not know.
//!
//! The set is persisted (`<state>/kube-written.json`, written to a temporary file and renamed)
//! *before* a key is written, so a crash between the two can only leave a key recorded that
//! was not written (harmless: removing an absent key is a no-op), never a written key
//! forgotten. A key is dropped from the set only after its removal was written.

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The file's content.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Sets {
    #[serde(default, rename = "configMapKeys")]
    configmap_keys: BTreeSet<String>,
    #[serde(default, rename = "nodeLabels")]
    node_labels: BTreeSet<String>,
}

/// Which of the two objects a key belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Object {
    ConfigMap,
    NodeLabels,
}

/// The keys written so far; in memory only when no file is given (tests of the writer).
#[derive(Debug)]
pub struct Written {
    file: Option<PathBuf>,
    sets: Sets,
}

impl Written {
    /// Loads the set from `file` (absent: empty). An unreadable file is an error: starting
    /// with an empty set would silently leave stale keys behind, one with wrong content
    /// would remove keys that are not ours.
    pub fn load(file: Option<PathBuf>) -> std::io::Result<Self> {
        let sets = match &file {
            None => Sets::default(),
            Some(path) => match std::fs::read(path) {
                Ok(bytes) => serde_json::from_slice(&bytes).map_err(|error| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("{}: {error}", path.display()),
                    )
                })?,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => Sets::default(),
                Err(error) => return Err(error),
            },
        };
        Ok(Self { file, sets })
    }

    /// An empty set saved to `file` from now on (after the file could not be read).
    pub fn empty(file: Option<PathBuf>) -> Self {
        Self {
            file,
            sets: Sets::default(),
        }
    }

    fn set(&self, object: Object) -> &BTreeSet<String> {
        match object {
            Object::ConfigMap => &self.sets.configmap_keys,
            Object::NodeLabels => &self.sets.node_labels,
        }
    }

    fn set_mut(&mut self, object: Object) -> &mut BTreeSet<String> {
        match object {
            Object::ConfigMap => &mut self.sets.configmap_keys,
            Object::NodeLabels => &mut self.sets.node_labels,
        }
    }

    /// Whether this daemon wrote `key` into `object`.
    pub fn contains(&self, object: Object, key: &str) -> bool {
        self.set(object).contains(key)
    }

    /// Records `keys` as written (before writing them) and persists the set if it grew.
    pub fn record<'a>(
        &mut self,
        object: Object,
        keys: impl IntoIterator<Item = &'a String>,
    ) -> std::io::Result<()> {
        let mut grew = false;
        for key in keys {
            grew |= self.set_mut(object).insert(key.clone());
        }
        if grew {
            self.save()?;
        }
        Ok(())
    }

    /// Forgets `keys` (after their removal was written) and persists the set if it shrank.
    pub fn forget<'a>(
        &mut self,
        object: Object,
        keys: impl IntoIterator<Item = &'a String>,
    ) -> std::io::Result<()> {
        let mut shrank = false;
        for key in keys {
            shrank |= self.set_mut(object).remove(key);
        }
        if shrank {
            self.save()?;
        }
        Ok(())
    }

    fn save(&self) -> std::io::Result<()> {
        let Some(path) = &self.file else {
            return Ok(());
        };
        let tmp = path.with_extension("json.tmp");
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(&serde_json::to_vec(&self.sets).map_err(std::io::Error::other)?)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_survive_a_restart_and_are_forgotten_after_removal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kube-written.json");
        let mut written = Written::load(Some(path.clone())).unwrap();
        assert!(!written.contains(Object::ConfigMap, "clusterbasemodel.a"));
        let keys = ["clusterbasemodel.a".to_owned(), "ns.basemodel.b".to_owned()];
        written.record(Object::ConfigMap, &keys).unwrap();
        let label = "models.ome.io/clusterbasemodel.a".to_owned();
        written.record(Object::NodeLabels, [&label]).unwrap();

        let mut again = Written::load(Some(path.clone())).unwrap();
        assert!(again.contains(Object::ConfigMap, "clusterbasemodel.a"));
        assert!(again.contains(Object::ConfigMap, "ns.basemodel.b"));
        assert!(!again.contains(Object::ConfigMap, &label));
        assert!(again.contains(Object::NodeLabels, &label));
        again.forget(Object::ConfigMap, [&keys[0]]).unwrap();

        let last = Written::load(Some(path.clone())).unwrap();
        assert!(!last.contains(Object::ConfigMap, "clusterbasemodel.a"));
        assert!(last.contains(Object::ConfigMap, "ns.basemodel.b"));

        std::fs::write(&path, b"{not json").unwrap();
        let error = Written::load(Some(path.clone())).unwrap_err();
        assert!(error.to_string().contains("kube-written.json"), "{error}");
    }
}
