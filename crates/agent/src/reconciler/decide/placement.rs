//! Pure placement decisions (SPEC section 3.1, section 3.2): given the durable records, where
//! should a model be served from? No I/O here, so every rule is unit-tested directly.

use std::collections::BTreeMap;

use crate::reconciler::records::{ModelPhase, Records};
use modelfs_core::artifact::ArtifactId;
use modelfs_core::store::StoreId;
use modelfs_ome::{DownloadPolicy, ModelKey};

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
    let Some(req) = records.models().get(requester) else {
        return Vec::new();
    };
    let own = records.owned_store(requester);
    let mut found: Vec<(usize, String, StoreId)> = Vec::new();
    // Only the stores holding the artifact (an index): a placement never scans every record.
    for id in records.holders_of(artifact) {
        if Some(id) == own {
            continue;
        }
        let store = &records.stores()[id];
        let holder_ns = match &store.owner {
            Some(owner) => {
                let Some(o) = records.models().get(owner) else {
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
        found.push((records.user_count(id), owner, id.clone()));
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
        .and_then(|id| records.stores().get(id))
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
            let req_ns = records
                .models()
                .get(key)
                .and_then(|m| m.namespace.as_deref());
            for (other, other_artifact) in &in_flight.fetching {
                if other == key || other_artifact != artifact {
                    continue;
                }
                let Some(o) = records.models().get(other) else {
                    continue;
                };
                if in_scope(req_ns, o.namespace.as_deref()) {
                    return Placement::Wait(other.clone());
                }
            }
            for other in &in_flight.resolving_same_source {
                let Some(o) = records.models().get(other) else {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconciler::decide::tests::{art, key};
    use crate::reconciler::records::{ModelRecord, StoreRecord};

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
        r.insert_model(k.clone(), rec);
    }

    /// A Ready parent `k` owning a store holding `a`.
    fn add_parent(r: &mut Records, k: &ModelKey, ns: Option<&str>, a: &ArtifactId) -> StoreId {
        let id = r.allocate_store(k);
        r.store_mut(&id).unwrap().artifacts.insert(a.clone());
        add_model(r, k, ns, ModelPhase::Ready, Some(id.clone()));
        r.model_mut(k).unwrap().artifact = Some(a.clone());
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
        let team_b = key("b/m");
        let s_b = add_parent(&mut r, &team_b, Some("b"), &a);
        let me = key("a/m");
        add_model(&mut r, &me, Some("a"), ModelPhase::Updating, None);
        let none = InFlight::default();
        assert_eq!(
            place(&r, &me, DownloadPolicy::ReuseIfExists, &a, &none),
            Placement::Fetch
        );
        let cluster = key("m");
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
        r.model_mut(&cluster).unwrap().phase = ModelPhase::Updating;
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
        let x = key("x");
        let y = key("y");
        let s_y = add_parent(&mut r, &y, None, &a);
        let s_x = add_parent(&mut r, &x, None, &a);
        let me = key("me");
        add_model(&mut r, &me, None, ModelPhase::Updating, None);
        assert_eq!(
            reuse_candidates(&r, &me, &a),
            vec![s_x.clone(), s_y.clone()],
            "tie -> key order"
        );
        let child = key("child");
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
        let first = key("first");
        add_model(&mut r, &first, None, ModelPhase::Updating, None);
        let second = key("ns/second");
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
        let gone = key("gone");
        let id = r.allocate_store(&gone);
        let mut s = r.store_mut(&id).unwrap();
        s.owner = None;
        s.reserved = true;
        s.artifacts.insert(a.clone());
        drop(s);
        let me = key("ns/me");
        add_model(&mut r, &me, Some("ns"), ModelPhase::Updating, None);
        assert_eq!(reuse_candidates(&r, &me, &a), vec![id.clone()]);
        r.store_mut(&id).unwrap().reserved = false;
        assert!(
            reuse_candidates(&r, &me, &a).is_empty(),
            "unreserved orphan is garbage"
        );
        let _ = StoreRecord::default();
    }
}
