//! Pure placement decisions (SPEC section 3.1, section 3.2): given the durable records, where should a model
//! be served from? And the path-conflict rule (SPEC section 4), the only copy of it. No I/O
//! here, so every rule is unit-tested directly.

use std::collections::{BTreeMap, HashMap};

use crate::artifact::ArtifactId;
use crate::manifest::{DownloadPolicy, ModelKey, MountPath};
use crate::store::{ModelPhase, Records, StoreId};

/// What to do with a model whose artifact is known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Serve from this store, which already holds the artifact complete.
    Serve(StoreId),
    /// Fetch the artifact into the model's own store, then serve from it.
    Fetch,
    /// Another in-scope model is fetching the same artifact: wait for it (single flight).
    Wait(ModelKey),
}

/// Reuse scope (as OME, for tenant isolation): a ClusterBaseModel may reuse only
/// ClusterBaseModels' stores; a BaseModel may reuse ClusterBaseModels' stores and BaseModels'
/// of its own namespace. `None` is a ClusterBaseModel.
pub fn in_scope(requester_ns: Option<&str>, holder_ns: Option<&str>) -> bool {
    match (requester_ns, holder_ns) {
        (_, None) => true,
        (None, Some(_)) => false,
        (Some(r), Some(h)) => r == h,
    }
}

/// Stores that may serve `artifact` to `requester` under `ReuseIfExists`, best first:
/// most users (children plus owner), ties broken by owner key then store id; never hash order.
/// Only stores whose owner is Ready (or reserved stores without an owner) qualify.
pub fn reuse_candidates(
    records: &Records,
    requester: &ModelKey,
    artifact: &ArtifactId,
) -> Vec<StoreId> {
    let Some(req) = records.models.get(requester) else {
        return Vec::new();
    };
    let own = records.owned_store(requester).cloned();
    let mut users: BTreeMap<&StoreId, usize> = BTreeMap::new();
    for m in records.models.values() {
        if let Some(s) = &m.store {
            *users.entry(s).or_default() += 1;
        }
    }
    let mut found: Vec<(usize, String, StoreId)> = Vec::new();
    for (id, store) in &records.stores {
        if Some(id) == own.as_ref() || !store.artifacts.contains(artifact) {
            continue;
        }
        let holder_ns = match &store.owner {
            Some(owner) => {
                let Some(o) = records.models.get(owner) else {
                    continue;
                };
                if o.phase != ModelPhase::Ready || o.store.as_ref() != Some(id) {
                    continue;
                }
                o.namespace.clone()
            }
            None if store.reserved => store.last_owner_namespace.clone(),
            None => continue,
        };
        if !in_scope(req.namespace.as_deref(), holder_ns.as_deref()) {
            continue;
        }
        let owner = store
            .owner
            .as_ref()
            .map(|o| o.to_string())
            .unwrap_or_default();
        found.push((users.get(id).copied().unwrap_or(0), owner, id.clone()));
    }
    found.sort_by(|a, b| {
        b.0.cmp(&a.0)
            .then_with(|| a.1.cmp(&b.1))
            .then_with(|| a.2.cmp(&b.2))
    });
    found.into_iter().map(|(_, _, id)| id).collect()
}

/// Work in flight that single flight must respect.
#[derive(Clone, Debug, Default)]
pub struct InFlight {
    /// Models fetching into their own store, with the artifact each fetches.
    pub fetching: BTreeMap<ModelKey, ArtifactId>,
    /// Models still resolving the same source as the model being placed (their artifact is
    /// probably the same: several teams registering one repository at once).
    pub resolving_same_source: Vec<ModelKey>,
}

/// Decides placement for `key` (whose record exists) once its artifact is known.
pub fn place(
    records: &Records,
    key: &ModelKey,
    policy: DownloadPolicy,
    artifact: &ArtifactId,
    in_flight: &InFlight,
) -> Placement {
    let own = records.owned_store(key);
    let own_has = own
        .and_then(|id| records.stores.get(id))
        .is_some_and(|s| s.artifacts.contains(artifact));
    match policy {
        DownloadPolicy::AlwaysDownload => {
            if own_has {
                Placement::Serve(own.expect("own store").clone())
            } else {
                Placement::Fetch
            }
        }
        DownloadPolicy::ReuseIfExists => {
            if let Some(best) = reuse_candidates(records, key, artifact).into_iter().next() {
                return Placement::Serve(best);
            }
            if own_has {
                return Placement::Serve(own.expect("own store").clone());
            }
            let req_ns = records.models.get(key).and_then(|m| m.namespace.as_deref());
            for (other, other_artifact) in &in_flight.fetching {
                if other == key || other_artifact != artifact {
                    continue;
                }
                let Some(o) = records.models.get(other) else {
                    continue;
                };
                if in_scope(req_ns, o.namespace.as_deref()) {
                    return Placement::Wait(other.clone());
                }
            }
            for other in &in_flight.resolving_same_source {
                let Some(o) = records.models.get(other) else {
                    continue;
                };
                if other != key && in_scope(req_ns, o.namespace.as_deref()) {
                    return Placement::Wait(other.clone());
                }
            }
            Placement::Fetch
        }
    }
}

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
    use crate::artifact::Sha256Digest;
    use crate::manifest::ModelKind;
    use crate::store::{ModelRecord, StoreRecord};

    fn key(ns: Option<&str>, name: &str) -> ModelKey {
        let kind = if ns.is_some() {
            ModelKind::BaseModel
        } else {
            ModelKind::ClusterBaseModel
        };
        ModelKey::new(kind, ns, name).unwrap()
    }

    fn art(n: u8) -> ArtifactId {
        ArtifactId(Sha256Digest([n; 32]))
    }

    fn add_model(
        r: &mut Records,
        k: &ModelKey,
        ns: Option<&str>,
        phase: ModelPhase,
        store: Option<StoreId>,
    ) {
        let seq = r.allocate_model_seq();
        let mut rec = ModelRecord::new(seq, k.to_string(), ns.map(str::to_string), phase);
        rec.policy = DownloadPolicy::ReuseIfExists;
        rec.store = store;
        r.models.insert(k.clone(), rec);
    }

    /// A Ready parent `k` owning a store holding `a`.
    fn add_parent(r: &mut Records, k: &ModelKey, ns: Option<&str>, a: &ArtifactId) -> StoreId {
        let id = r.allocate_store(k);
        r.stores.get_mut(&id).unwrap().artifacts.insert(a.clone());
        add_model(r, k, ns, ModelPhase::Ready, Some(id.clone()));
        r.models.get_mut(k).unwrap().artifact = Some(a.clone());
        id
    }

    #[test]
    fn scope_rules() {
        assert!(in_scope(None, None));
        assert!(
            !in_scope(None, Some("a")),
            "a cluster model never reuses a namespaced copy"
        );
        assert!(in_scope(Some("a"), None));
        assert!(in_scope(Some("a"), Some("a")));
        assert!(!in_scope(Some("a"), Some("b")), "no cross-namespace reuse");
    }

    #[test]
    fn reuse_maps_onto_in_scope_ready_holder_only() {
        let mut r = Records::default();
        let a = art(1);
        let team_b = key(Some("b"), "m");
        let s_b = add_parent(&mut r, &team_b, Some("b"), &a);
        let me = key(Some("a"), "m");
        add_model(&mut r, &me, Some("a"), ModelPhase::Updating, None);
        let none = InFlight::default();
        assert_eq!(
            place(&r, &me, DownloadPolicy::ReuseIfExists, &a, &none),
            Placement::Fetch
        );
        let cluster = key(None, "m");
        let s_c = add_parent(&mut r, &cluster, None, &a);
        assert_eq!(
            place(&r, &me, DownloadPolicy::ReuseIfExists, &a, &none),
            Placement::Serve(s_c.clone())
        );
        assert_eq!(
            place(&r, &me, DownloadPolicy::AlwaysDownload, &a, &none),
            Placement::Fetch
        );
        // A different artifact (another revision) is never a candidate.
        assert_eq!(
            place(&r, &me, DownloadPolicy::ReuseIfExists, &art(2), &none),
            Placement::Fetch
        );
        // Not Ready -> not a candidate.
        r.models.get_mut(&cluster).unwrap().phase = ModelPhase::Updating;
        assert_eq!(
            place(&r, &me, DownloadPolicy::ReuseIfExists, &a, &none),
            Placement::Fetch
        );
        let _ = s_b;
    }

    #[test]
    fn candidate_choice_is_deterministic_most_children_then_key() {
        let mut r = Records::default();
        let a = art(1);
        let x = key(None, "x");
        let y = key(None, "y");
        let s_y = add_parent(&mut r, &y, None, &a);
        let s_x = add_parent(&mut r, &x, None, &a);
        let me = key(None, "me");
        add_model(&mut r, &me, None, ModelPhase::Updating, None);
        assert_eq!(
            reuse_candidates(&r, &me, &a),
            vec![s_x.clone(), s_y.clone()],
            "tie -> key order"
        );
        let child = key(None, "child");
        add_model(&mut r, &child, None, ModelPhase::Ready, Some(s_y.clone()));
        assert_eq!(
            reuse_candidates(&r, &me, &a),
            vec![s_y, s_x],
            "most users first"
        );
    }

    #[test]
    fn single_flight_waits_for_in_scope_fetch() {
        let mut r = Records::default();
        let a = art(1);
        let first = key(None, "first");
        add_model(&mut r, &first, None, ModelPhase::Updating, None);
        let second = key(Some("ns"), "second");
        add_model(&mut r, &second, Some("ns"), ModelPhase::Updating, None);
        let fetching = InFlight {
            fetching: BTreeMap::from([(first.clone(), a.clone())]),
            ..Default::default()
        };
        assert_eq!(
            place(&r, &second, DownloadPolicy::ReuseIfExists, &a, &fetching),
            Placement::Wait(first.clone())
        );
        assert_eq!(
            place(&r, &second, DownloadPolicy::AlwaysDownload, &a, &fetching),
            Placement::Fetch
        );
        // A namespaced fetch is out of scope for a cluster model.
        let fetching = InFlight {
            fetching: BTreeMap::from([(second.clone(), a.clone())]),
            ..Default::default()
        };
        assert_eq!(
            place(&r, &first, DownloadPolicy::ReuseIfExists, &a, &fetching),
            Placement::Fetch
        );
        // A model of the same source still resolving is waited for as well.
        let resolving = InFlight {
            resolving_same_source: vec![first.clone()],
            ..Default::default()
        };
        assert_eq!(
            place(&r, &second, DownloadPolicy::ReuseIfExists, &a, &resolving),
            Placement::Wait(first.clone())
        );
    }

    #[test]
    fn reserved_store_without_owner_is_a_candidate_in_scope() {
        let mut r = Records::default();
        let a = art(3);
        let gone = key(None, "gone");
        let id = r.allocate_store(&gone);
        let s = r.stores.get_mut(&id).unwrap();
        s.owner = None;
        s.reserved = true;
        s.artifacts.insert(a.clone());
        let me = key(Some("ns"), "me");
        add_model(&mut r, &me, Some("ns"), ModelPhase::Updating, None);
        assert_eq!(reuse_candidates(&r, &me, &a), vec![id.clone()]);
        r.stores.get_mut(&id).unwrap().reserved = false;
        assert!(
            reuse_candidates(&r, &me, &a).is_empty(),
            "unreserved orphan is garbage"
        );
        let _ = StoreRecord::default();
    }

    fn claim(
        name: &str,
        seq: u64,
        kind: ClaimKind,
        path: &str,
        artifact: ClaimArtifact,
    ) -> PathClaim {
        PathClaim {
            key: key(None, name),
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
