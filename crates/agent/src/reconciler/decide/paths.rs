//! The one path-conflict rule (SPEC section 4): which models may be served at which paths
//! below the mount. The reconciler applies it through [`super::decide`]; the filesystem core
//! only keeps a defensive check that refuses a mapping breaking it (a bug upstream), never a
//! decision of its own. Pure: no I/O.

use std::collections::HashMap;

use modelfs_core::artifact::ArtifactId;
use modelfs_ome::{ModelKey, MountPath};

/// What a path claim serves, as far as the equal-path rule needs to know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimArtifact {
    /// Served, or resolved and about to be served.
    Known(ArtifactId),
    /// Being resolved now: it may turn out equal to a neighbour's artifact or not, so a later
    /// claim on the same path waits for it instead of guessing.
    Pending,
    /// Not known and not being found out (the model failed before resolving): equal paths
    /// cannot be compared, so they are not (yet) a conflict, and nobody waits for it.
    Unknown,
}

/// Which of a model's two possible claims this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimKind {
    /// Where the mount serves the model now.
    Served,
    /// Where its spec wants it (a new model, or a path or source change not yet applied).
    Wanted,
}

/// One model's claim on a path below the mount. A model has a served claim, a wanted claim, or
/// both (while it moves); its own claims never conflict with each other.
#[derive(Clone, Debug)]
pub struct PathClaim {
    pub key: ModelKey,
    /// Creation order of the model (`ModelRecord::seq`).
    pub seq: u64,
    pub kind: ClaimKind,
    pub path: MountPath,
    pub artifact: ClaimArtifact,
}

/// The rule's answer for one claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathVerdict {
    Clear,
    /// An earlier claim on the same path is still resolving: decide once its artifact is known.
    Wait {
        on: ModelKey,
    },
    /// The claim loses to an earlier one; `reason` names it.
    Conflict {
        with: ModelKey,
        reason: String,
    },
}

/// The one path-conflict rule (SPEC section 4). Two models whose paths nest, or whose paths are
/// equal with different artifacts, conflict, and the *later* one loses: later means larger
/// `(seq, key)`, that is creation order as the daemon first saw the models (persisted in the
/// records, so it survives restarts), and key order among models that arrived in one batch.
/// Equal paths with the same artifact are allowed. A claim that loses does not block anyone
/// (a model nested inside a loser is judged against the winners only).
///
/// The verdicts depend only on the set of claims, never on the order they are passed in or the
/// order in which fetches finish: the reconciler applies this before every placement, on every
/// fetch completion and after every event, so what the mount serves never depends on timing.
/// Returns one verdict per claim, in input order. O(claims x path depth).
pub fn path_verdicts(claims: &[PathClaim]) -> Vec<PathVerdict> {
    let mut order: Vec<usize> = (0..claims.len()).collect();
    order.sort_by(|&a, &b| {
        (claims[a].seq, &claims[a].key, claims[a].kind as u8).cmp(&(
            claims[b].seq,
            &claims[b].key,
            claims[b].kind as u8,
        ))
    });
    // Accepted claims by exact path, and by every proper prefix of their path.
    let mut at: HashMap<&[String], Vec<usize>> = HashMap::new();
    let mut below: HashMap<&[String], Vec<usize>> = HashMap::new();
    let mut out = vec![PathVerdict::Clear; claims.len()];
    for i in order {
        let c = &claims[i];
        let segs = c.path.segments();
        let other = |j: &&usize| claims[**j].key != c.key;
        let nest = (1..segs.len())
            .find_map(|n| at.get(&segs[..n]).and_then(|v| v.iter().find(other)))
            .or_else(|| below.get(segs).and_then(|v| v.iter().find(other)));
        let verdict = if let Some(&j) = nest {
            PathVerdict::Conflict {
                with: claims[j].key.clone(),
                reason: format!(
                    "path {} nests with path {} of {}",
                    c.path, claims[j].path, claims[j].key
                ),
            }
        } else {
            let mut verdict = PathVerdict::Clear;
            for &j in at.get(segs).into_iter().flatten().filter(|j| other(j)) {
                match (&claims[j].artifact, &c.artifact) {
                    (ClaimArtifact::Known(a), ClaimArtifact::Known(b)) if a != b => {
                        verdict = PathVerdict::Conflict {
                            with: claims[j].key.clone(),
                            reason: format!(
                                "path {} is already used by {} with a different artifact",
                                c.path, claims[j].key
                            ),
                        };
                        break;
                    }
                    (ClaimArtifact::Pending, _) if verdict == PathVerdict::Clear => {
                        verdict = PathVerdict::Wait {
                            on: claims[j].key.clone(),
                        };
                    }
                    _ => {}
                }
            }
            verdict
        };
        if !matches!(verdict, PathVerdict::Conflict { .. }) {
            at.entry(segs).or_default().push(i);
            for n in 1..segs.len() {
                below.entry(&segs[..n]).or_default().push(i);
            }
        }
        out[i] = verdict;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconciler::decide::tests::{art, key};

    fn claim(
        name: &str,
        seq: u64,
        kind: ClaimKind,
        path: &str,
        artifact: ClaimArtifact,
    ) -> PathClaim {
        PathClaim {
            key: key(name),
            seq,
            kind,
            path: MountPath::from_relative(path).unwrap(),
            artifact,
        }
    }

    /// The verdict of each claim as text: `clear`, `wait <key>` or `conflict <key>: <reason>`.
    fn verdict_text(v: &PathVerdict) -> String {
        match v {
            PathVerdict::Clear => "clear".into(),
            PathVerdict::Wait { on } => format!("wait {on}"),
            PathVerdict::Conflict { with, reason } => format!("conflict {with}: {reason}"),
        }
    }

    #[test]
    fn path_rule_table() {
        use ClaimArtifact::{Known, Pending, Unknown};
        use ClaimKind::{Served, Wanted};
        let k = |n: u8| Known(art(n));
        // (what, claims as (name, seq, kind, path, artifact), expected verdict prefix per claim)
        #[allow(clippy::type_complexity)]
        let cases: Vec<(&str, Vec<(&str, u64, ClaimKind, &str, ClaimArtifact)>, Vec<&str>)> = vec![
            (
                "equal paths, different artifacts, one batch: the later key loses",
                vec![("a", 1, Wanted, "x", k(1)), ("b", 2, Wanted, "x", k(2))],
                vec!["clear", "conflict clusterbasemodel.a: path x is already used by clusterbasemodel.a with a different artifact"],
            ),
            (
                "equal paths, same artifact: allowed",
                vec![("a", 1, Served, "x", k(1)), ("b", 2, Wanted, "x", k(1))],
                vec!["clear", "clear"],
            ),
            (
                "a later model inside an earlier one loses, whatever the earlier one's state",
                vec![("a", 1, Wanted, "x", Unknown), ("b", 2, Wanted, "x/y", k(1))],
                vec!["clear", "conflict clusterbasemodel.a: path x/y nests with path x of clusterbasemodel.a"],
            ),
            (
                "a later model around an earlier one loses",
                vec![("a", 1, Served, "x/y/z", k(1)), ("b", 2, Wanted, "x", Pending)],
                vec!["clear", "conflict clusterbasemodel.a: path x nests with path x/y/z"],
            ),
            (
                "nesting is segment-wise",
                vec![("a", 1, Served, "a/b", k(1)), ("b", 2, Served, "a/bc", k(2))],
                vec!["clear", "clear"],
            ),
            (
                "an earlier claim still resolving on the same path: the later one waits",
                vec![("a", 1, Wanted, "x", Pending), ("b", 2, Wanted, "x", k(1))],
                vec!["clear", "wait clusterbasemodel.a"],
            ),
            (
                "an earlier model that failed before resolving: equal paths cannot conflict yet",
                vec![("a", 1, Wanted, "x", Unknown), ("b", 2, Served, "x", k(1))],
                vec!["clear", "clear"],
            ),
            (
                "a loser blocks nobody",
                vec![
                    ("a", 1, Served, "p/q", k(1)),
                    ("b", 2, Wanted, "p", k(1)),
                    ("c", 3, Wanted, "p/r", k(1)),
                ],
                vec!["clear", "conflict clusterbasemodel.a", "clear"],
            ),
            (
                "a conflict beats a wait",
                vec![
                    ("a", 1, Wanted, "x", Pending),
                    ("b", 2, Served, "x", k(1)),
                    ("c", 3, Wanted, "x", k(2)),
                ],
                vec!["clear", "wait clusterbasemodel.a", "conflict clusterbasemodel.b"],
            ),
            (
                "creation order decides before key order",
                vec![("z", 1, Served, "x", k(1)), ("a", 2, Served, "x", k(2))],
                vec!["clear", "conflict clusterbasemodel.z"],
            ),
            (
                "a model moving into its own subtree does not conflict with itself",
                vec![
                    ("a", 1, Served, "x", k(1)),
                    ("a", 1, Wanted, "x/y", k(1)),
                    ("b", 2, Wanted, "x", k(1)),
                ],
                vec!["clear", "clear", "conflict clusterbasemodel.a: path x nests with path x/y"],
            ),
            (
                "an earlier model resolving to another artifact unseats a later served one",
                vec![("b", 2, Served, "x", k(2)), ("a", 1, Wanted, "x", k(1))],
                vec!["conflict clusterbasemodel.a", "clear"],
            ),
            (
                "restart with two served models on one path: the earlier one stays",
                vec![("b", 7, Served, "m", k(2)), ("a", 3, Served, "m", k(1))],
                vec!["conflict clusterbasemodel.a", "clear"],
            ),
        ];
        for (what, spec, expect) in cases {
            let claims: Vec<PathClaim> = spec
                .into_iter()
                .map(|(n, seq, kind, p, a)| claim(n, seq, kind, p, a))
                .collect();
            let got: Vec<String> = path_verdicts(&claims).iter().map(verdict_text).collect();
            for (g, e) in got.iter().zip(&expect) {
                assert!(g.starts_with(e), "{what}: got {got:?}, want {expect:?}");
            }
            // Any arrival order gives the same verdicts.
            for shift in 1..claims.len() {
                let mut rotated = claims.clone();
                rotated.rotate_left(shift);
                let again: Vec<String> = path_verdicts(&rotated).iter().map(verdict_text).collect();
                let mut back = again.clone();
                back.rotate_right(shift);
                assert_eq!(back, got, "{what}: order of arrival changed the verdicts");
            }
        }
    }
}
