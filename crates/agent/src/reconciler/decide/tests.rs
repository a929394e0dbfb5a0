//! Table-driven tests of the decision core: each case is a set of records, one event, and the
//! records (as parents, owners and garbage) it must leave, for every case of SPEC sections 3
//! and 4. The path rule's own table is in `paths.rs`, placement's unit tests in `placement.rs`.

use std::time::Duration;

use super::*;
use modelfs_core::artifact::Sha256Digest;
use modelfs_ome::{DownloadPolicy, ModelKind};

use DownloadPolicy::{AlwaysDownload as Always, ReuseIfExists as Reuse};

/// Artifact `n` of the tables (also used by the path rule's and placement's own tests).
pub(super) fn art(n: u8) -> ArtifactId {
    ArtifactId(Sha256Digest([n; 32]))
}

/// `"x"` is the ClusterBaseModel x, `"ns/x"` the BaseModel x of namespace ns.
pub(super) fn key(name: &str) -> ModelKey {
    match name.split_once('/') {
        Some((ns, n)) => ModelKey::new(ModelKind::BaseModel, Some(ns), n).unwrap(),
        None => ModelKey::new(ModelKind::ClusterBaseModel, None, name).unwrap(),
    }
}

/// Short name of a key, as written in the tables.
fn short(k: &ModelKey) -> String {
    let s = k.as_str();
    match s.strip_prefix("clusterbasemodel.") {
        Some(n) => n.to_string(),
        None => s.replacen(".basemodel.", "/", 1),
    }
}

/// How a model starts in a case.
#[derive(Clone, Copy)]
enum Setup {
    /// Ready, owning a store that holds the artifact, served from it.
    Holder(&'static str, u8),
    /// Owns a store with the artifact but is not Ready (downloading a new revision, failed).
    HolderNotReady(&'static str, u8),
    /// Ready, served from the store of the named model (same artifact).
    Child(&'static str, &'static str),
    /// Known, serving nothing yet.
    New(&'static str),
    /// A store kept by the reserve label after its owner (of this namespace, `""` for a cluster
    /// model) was deleted.
    Reserved(&'static str, u8),
    /// The holder carries the reserve label.
    HolderReserving(&'static str, u8),
}

fn ns_of(name: &str) -> Option<String> {
    name.split_once('/').map(|(ns, _)| ns.to_string())
}

fn add_model(r: &mut Records, name: &str, phase: ModelPhase) -> ModelKey {
    let k = key(name);
    let seq = r.allocate_model_seq();
    let mut rec = ModelRecord::new(seq, name.to_string(), ns_of(name), phase);
    rec.path = name.to_string();
    rec.fingerprint = format!("fp-{name}");
    r.insert_model(k.clone(), rec);
    k
}

fn build(setup: &[Setup]) -> Records {
    let mut r = Records::default();
    for s in setup {
        match *s {
            Setup::Holder(n, a) | Setup::HolderNotReady(n, a) | Setup::HolderReserving(n, a) => {
                let phase = if matches!(s, Setup::HolderNotReady(..)) {
                    ModelPhase::Updating
                } else {
                    ModelPhase::Ready
                };
                let k = add_model(&mut r, n, phase);
                let id = r.allocate_store(&k);
                r.store_mut(&id).unwrap().artifacts.insert(art(a));
                let mut rec = r.model_mut(&k).unwrap();
                rec.store = Some(id);
                rec.artifact = Some(art(a));
                rec.served_path = Some(n.to_string());
                rec.reserve = matches!(s, Setup::HolderReserving(..));
            }
            Setup::Child(n, of) => {
                let parent = r.models()[&key(of)].clone();
                let k = add_model(&mut r, n, ModelPhase::Ready);
                let mut rec = r.model_mut(&k).unwrap();
                rec.policy = Reuse;
                rec.store = parent.store;
                rec.artifact = parent.artifact;
                rec.served_path = Some(n.to_string());
            }
            Setup::New(n) => {
                add_model(&mut r, n, ModelPhase::Updating);
            }
            Setup::Reserved(ns, a) => {
                let gone = key("gone");
                let id = r.allocate_store(&gone);
                let mut s = r.store_mut(&id).unwrap();
                s.owner = None;
                s.reserved = true;
                s.last_owner_namespace = (!ns.is_empty()).then(|| ns.to_string());
                s.artifacts.insert(art(a));
            }
        }
    }
    r
}

/// The world as the tables state it: each model's parent (`-` when it serves nothing; by short
/// name), then
/// each store's owner (`released`, `reserved`), with `garbage` when garbage collection may
/// take it.
fn summary(r: &Records) -> Vec<String> {
    let mut out = Vec::new();
    for k in r.models().keys() {
        let parent = parent_of(r, k).map_or("-".to_string(), short);
        out.push(format!("{} <- {parent}", short(k)));
    }
    out.sort();
    let garbage = garbage_stores(r, |_| false);
    for (id, s) in r.stores() {
        let owner = match (&s.owner, s.reserved) {
            (Some(o), _) => short(o),
            (None, true) => "reserved".into(),
            (None, false) => "released".into(),
        };
        let g = if garbage.contains(id) { " garbage" } else { "" };
        out.push(format!("{id}: {owner}{g}"));
    }
    out
}

/// What a model's spec asks in the tables: served at its name, from source "src".
fn want(name: &str, policy: DownloadPolicy, a: u8) -> Want {
    Want {
        policy,
        artifact: art(a),
        sha: "rev".into(),
        path: MountPath::from_relative(name).unwrap(),
        source: "src".into(),
        parameters: None,
    }
}

/// Runs a model's change to `policy` with `artifact` known through [`decide`], as the actor
/// does: the artifact is known; a fetch it asks for completes at once (and the links of any
/// split succeed), reported as [`Fact::Fetched`]. Returns the placement as text.
fn apply(r: &mut Records, name: &str, policy: DownloadPolicy, a: u8) -> String {
    let k = key(name);
    r.model_mut(&k).unwrap().policy = policy;
    let event = Fact::ArtifactKnown {
        key: k,
        want: want(name, policy, a),
        in_flight: InFlight::default(),
        claims: Vec::new(),
        space: None,
    };
    let effects = decide(r, &event).effects;
    let placed = effects.iter().find_map(|e| match e {
        Effect::Fetch { .. } => Some("fetch".to_string()),
        Effect::Served { store, .. } => Some(format!("serve {store}")),
        Effect::Wait { on, .. } => Some(format!("wait {}", short(on))),
        _ => None,
    });
    run(r, &effects, &want(name, policy, a));
    placed.unwrap_or_default()
}

/// Executes effects as the actor does, with every fetch completing at once with `want` and
/// every link succeeding; the outcomes go back through [`decide`].
fn run(r: &mut Records, effects: &[Effect], want: &Want) {
    for e in effects {
        let outcome = match e {
            Effect::LinkStore(split) => Fact::SplitLinked {
                split: split.clone(),
                result: Ok(()),
            },
            Effect::Fetch { key, store, .. } => Fact::Fetched {
                key: key.clone(),
                store: store.clone(),
                artifact: want.artifact.clone(),
                want: Some(want.clone()),
                claims: Vec::new(),
            },
            _ => continue,
        };
        let more = decide(r, &outcome).effects;
        run(r, &more, want);
    }
}

enum Change {
    /// A model changes to this policy and resolves to this artifact.
    Apply(&'static str, DownloadPolicy, u8),
    Delete(&'static str),
}

#[test]
fn policy_changes_and_deletion() {
    use Change::*;
    use Setup::*;
    #[allow(clippy::type_complexity)]
    let cases: Vec<(&str, Vec<Setup>, Change, &str, Vec<&str>)> =
        vec![
        // ----- 3.1 placement of a new model
        (
            "AlwaysDownload: own store, its own parent",
            vec![Holder("p", 1), New("m")],
            Apply("m", Always, 1),
            "fetch",
            vec!["m <- m", "p <- p", "s00000001: p", "s00000002: m"],
        ),
        (
            "ReuseIfExists with a Ready holder in scope: mapped, zero bytes",
            vec![Holder("p", 1), New("ns/m")],
            Apply("ns/m", Reuse, 1),
            "serve s00000001",
            vec!["ns/m <- p", "p <- p", "s00000001: p"],
        ),
        (
            "ReuseIfExists: a cluster model never reuses a namespaced copy",
            vec![Holder("ns/p", 1), New("m")],
            Apply("m", Reuse, 1),
            "fetch",
            vec!["m <- m", "ns/p <- ns/p", "s00000001: ns/p", "s00000002: m"],
        ),
        (
            "ReuseIfExists: no reuse across namespaces",
            vec![Holder("a/p", 1), New("b/m")],
            Apply("b/m", Reuse, 1),
            "fetch",
            vec!["a/p <- a/p", "b/m <- b/m", "s00000001: a/p", "s00000002: b/m"],
        ),
        (
            "ReuseIfExists: same namespace reuses",
            vec![Holder("a/p", 1), New("a/m")],
            Apply("a/m", Reuse, 1),
            "serve s00000001",
            vec!["a/m <- a/p", "a/p <- a/p", "s00000001: a/p"],
        ),
        (
            "ReuseIfExists: another revision is not the same artifact",
            vec![Holder("p", 1), New("m")],
            Apply("m", Reuse, 2),
            "fetch",
            vec!["m <- m", "p <- p", "s00000001: p", "s00000002: m"],
        ),
        (
            "ReuseIfExists: a holder that is not Ready is no candidate",
            vec![HolderNotReady("p", 1), New("m")],
            Apply("m", Reuse, 1),
            "fetch",
            vec!["m <- m", "p <- p", "s00000001: p", "s00000002: m"],
        ),
        (
            "ReuseIfExists: most children first",
            vec![Holder("a", 1), Holder("b", 1), Child("c", "b"), New("m")],
            Apply("m", Reuse, 1),
            "serve s00000002",
            vec!["a <- a", "b <- b", "c <- b", "m <- b", "s00000001: a", "s00000002: b"],
        ),
        (
            "ReuseIfExists: ties broken by key, never by hash order",
            vec![Holder("b", 1), Holder("a", 1), New("m")],
            Apply("m", Reuse, 1),
            "serve s00000002",
            vec!["a <- a", "b <- b", "m <- a", "s00000001: b", "s00000002: a"],
        ),
        (
            "a reserved store is reused and adopted",
            vec![Reserved("", 1), New("ns/m")],
            Apply("ns/m", Reuse, 1),
            "serve s00000001",
            vec!["ns/m <- ns/m", "s00000001: ns/m"],
        ),
        (
            "a reserved store keeps its last owner's scope",
            vec![Reserved("a", 1), New("b/m")],
            Apply("b/m", Reuse, 1),
            "fetch",
            vec!["b/m <- b/m", "s00000001: reserved", "s00000002: b/m"],
        ),
        // ----- 3.2 policy changes
        (
            "T-01 child to AlwaysDownload: own copy, then the flip; the parent drops it",
            vec![Holder("p", 1), Child("c", "p")],
            Apply("c", Always, 1),
            "fetch",
            vec!["c <- c", "p <- p", "s00000001: p", "s00000002: c"],
        ),
        (
            "T-02 own copy to ReuseIfExists: flips to the other holder, copy released",
            vec![Holder("p", 1), Holder("m", 1)],
            Apply("m", Reuse, 1),
            "serve s00000001",
            vec!["m <- p", "p <- p", "s00000001: p", "s00000002: released garbage"],
        ),
        (
            "T-02 with no other holder in scope: no operation",
            vec![Holder("a/p", 1), Holder("b/m", 1)],
            Apply("b/m", Reuse, 1),
            "serve s00000002",
            vec!["a/p <- a/p", "b/m <- b/m", "s00000001: a/p", "s00000002: b/m"],
        ),
        (
            "T-03 parent to AlwaysDownload: no operation, children stay",
            vec![Holder("p", 1), Child("c", "p")],
            Apply("p", Always, 1),
            "serve s00000001",
            vec!["c <- p", "p <- p", "s00000001: p"],
        ),
        (
            "T-04 parent to ReuseIfExists: it and its children move, no chain; copy released",
            vec![
                Holder("q", 1),
                Holder("p", 1),
                Child("c1", "p"),
                Child("ns/c2", "p"),
            ],
            Apply("p", Reuse, 1),
            "serve s00000001",
            vec![
                "c1 <- q",
                "ns/c2 <- q",
                "p <- q",
                "q <- q",
                "s00000001: q",
                "s00000002: released garbage",
            ],
        ),
        (
            "T-04 with no other holder: no operation",
            vec![Holder("p", 1), Child("c", "p")],
            Apply("p", Reuse, 1),
            "serve s00000001",
            vec!["c <- p", "p <- p", "s00000001: p"],
        ),
        // ----- 3.3 other changes
        (
            "revision change of a parent: children keep the old store, the parent a new one",
            vec![Holder("p", 1), Child("c", "p")],
            Apply("p", Always, 2),
            "fetch",
            vec!["c <- c", "p <- p", "s00000001: c", "s00000002: p"],
        ),
        (
            "revision change with no children: fetched into the same store, old revision pruned",
            vec![Holder("p", 1)],
            Apply("p", Always, 2),
            "fetch",
            vec!["p <- p", "s00000001: p"],
        ),
        (
            "deleting a child: the parent drops it",
            vec![Holder("p", 1), Child("c", "p")],
            Delete("c"),
            "",
            vec!["p <- p", "s00000001: p"],
        ),
        (
            "deleting a parent: ownership passes to a child, the others follow",
            vec![Holder("p", 1), Child("c2", "p"), Child("c1", "p")],
            Delete("p"),
            "",
            vec!["c1 <- c1", "c2 <- c1", "s00000001: c1"],
        ),
        (
            "deleting a parent: a cluster child is preferred (in every child's scope)",
            vec![Holder("p", 1), Child("a/x", "p"), Child("z", "p")],
            Delete("p"),
            "",
            vec!["a/x <- z", "z <- z", "s00000001: z"],
        ),
        (
            "deleting a cluster parent of two namespaces' children: no cross-tenant parent",
            vec![Holder("p", 1), Child("a/x", "p"), Child("b/y", "p")],
            Delete("p"),
            "",
            vec!["a/x <- a/x", "b/y <- b/y", "s00000001: a/x", "s00000002: b/y"],
        ),
        (
            "deleting the last user: the store is garbage",
            vec![Holder("p", 1)],
            Delete("p"),
            "",
            vec!["s00000001: released garbage"],
        ),
        (
            "deleting the last user with the reserve label: kept",
            vec![HolderReserving("p", 1)],
            Delete("p"),
            "",
            vec!["s00000001: reserved"],
        ),
    ];
    for (what, setup, event, placed, records) in cases {
        let mut r = build(&setup);
        let got_placed = match event {
            Apply(name, policy, a) => apply(&mut r, name, policy, a),
            Delete(name) => {
                let effects = decide(&mut r, &Fact::Deleted { key: key(name) }).effects;
                run(&mut r, &effects, &want(name, Always, 0));
                String::new()
            }
        };
        assert_eq!(got_placed, placed, "{what}: placement");
        assert_eq!(summary(&r), records, "{what}");
    }
}

#[test]
fn t01_keeps_serving_from_the_parent_until_the_flip() {
    let mut r = build(&[Setup::Holder("p", 1), Setup::Child("c", "p")]);
    let c = key("c");
    r.model_mut(&c).unwrap().policy = Always;
    assert_eq!(
        place(&r, &c, Always, &art(1), &InFlight::default()),
        Placement::Fetch
    );
    let target = fetch_target(&mut r, &c, &art(1));
    assert_eq!(
        target.effects,
        vec![Effect::SaveRecords],
        "the new store is recorded before its directory exists"
    );
    // Fetching: still the parent's child.
    assert_eq!(parent_of(&r, &c), Some(&key("p")));
    assert_eq!(children_of(&r, &key("p")), vec![&c]);
    r.store_mut(&target.store).unwrap().artifacts.insert(art(1));
    let (changed, effects) = serve(
        &mut r,
        &c,
        Serve {
            store: target.store,
            artifact: art(1),
            sha: "rev".into(),
            path: "c".into(),
            source: "src".into(),
            parameters: None,
        },
    );
    assert!(changed && effects.is_empty());
    assert_eq!(parent_of(&r, &c), Some(&c));
    assert!(children_of(&r, &key("p")).is_empty());
}

#[test]
fn single_flight_waits_for_an_in_scope_fetch_or_resolve() {
    let r = build(&[
        Setup::New("first"),
        Setup::New("ns/second"),
        Setup::New("other/third"),
    ]);
    let fetching = |k: &str| InFlight {
        fetching: BTreeMap::from([(key(k), art(1))]),
        ..Default::default()
    };
    let resolving = |k: &str| InFlight {
        resolving_same_source: vec![key(k)],
        ..Default::default()
    };
    #[allow(clippy::type_complexity)]
    let cases: Vec<(&str, &str, DownloadPolicy, InFlight, Placement)> = vec![
        (
            "a namespaced model waits for a cluster fetch",
            "ns/second",
            Reuse,
            fetching("first"),
            Placement::Wait(key("first")),
        ),
        (
            "AlwaysDownload never waits",
            "ns/second",
            Always,
            fetching("first"),
            Placement::Fetch,
        ),
        (
            "a cluster model does not wait for a namespaced fetch",
            "first",
            Reuse,
            fetching("ns/second"),
            Placement::Fetch,
        ),
        (
            "no waiting across namespaces",
            "other/third",
            Reuse,
            fetching("ns/second"),
            Placement::Fetch,
        ),
        (
            "another revision's fetch is not waited for",
            "ns/second",
            Reuse,
            InFlight {
                fetching: BTreeMap::from([(key("first"), art(2))]),
                ..Default::default()
            },
            Placement::Fetch,
        ),
        (
            "a model of the same source still resolving is waited for",
            "ns/second",
            Reuse,
            resolving("first"),
            Placement::Wait(key("first")),
        ),
        (
            "its own resolve is not waited for",
            "first",
            Reuse,
            resolving("first"),
            Placement::Fetch,
        ),
    ];
    for (what, who, policy, in_flight, want) in cases {
        assert_eq!(
            place(&r, &key(who), policy, &art(1), &in_flight),
            want,
            "{what}"
        );
    }
}

#[test]
fn a_failed_split_leaves_the_children_where_they_were() {
    let mut r = build(&[
        Setup::Holder("p", 1),
        Setup::Child("a/x", "p"),
        Setup::Child("b/y", "p"),
        Setup::Child("b/z", "p"),
    ]);
    let effects = delete(&mut r, &key("p"));
    let splits: Vec<&Split> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::LinkStore(s) => Some(s),
            _ => None,
        })
        .collect();
    assert_eq!(splits.len(), 1);
    assert_eq!(splits[0].members, vec![key("b/y"), key("b/z")]);
    assert_eq!(splits[0].artifacts, BTreeSet::from([art(1)]));
    assert_eq!(
        effects[0],
        Effect::SaveRecords,
        "recorded before the directory"
    );
    let split = splits[0].clone();
    finish_split(&mut r, &split, Err("disk full".into()));
    assert_eq!(
        summary(&r),
        vec![
            "a/x <- a/x",
            "b/y <- a/x",
            "b/z <- a/x",
            "s00000001: a/x",
            "s00000002: released garbage",
        ]
    );
}

#[test]
fn garbage_eligibility() {
    let mut r = build(&[
        Setup::Holder("owned", 1),
        Setup::Reserved("", 1),
        Setup::Holder("gone", 1),
        Setup::Holder("busy", 1),
    ]);
    // s3 and s4 lose their owners; s4 is busy (an open file, a fetch).
    for k in ["gone", "busy"] {
        delete(&mut r, &key(k));
    }
    let busy = StoreId::from_seq(4);
    let got = garbage_stores(&r, |s| *s == busy);
    assert_eq!(
        got,
        vec![StoreId::from_seq(3)],
        "owned, reserved and busy stay"
    );
    // A store without owner that still serves a model (a split that failed halfway) stays.
    let orphan_user = add_model(&mut r, "user", ModelPhase::Ready);
    r.model_mut(&orphan_user).unwrap().store = Some(StoreId::from_seq(3));
    assert!(garbage_stores(&r, |s| *s == busy).is_empty());
}

#[test]
fn recovery_drops_placements_on_incomplete_artifacts() {
    let mut r = build(&[
        Setup::Holder("ok", 1),
        Setup::Holder("torn", 2),
        Setup::Child("c", "torn"),
    ]);
    r.store_mut(&StoreId::from_seq(2)).unwrap().owner = Some(key("ghost"));
    let torn_store = StoreId::from_seq(2);
    let forgotten = recover(&mut r, |a, s| !(*a == art(2) && *s == torn_store));
    assert_eq!(forgotten, vec![(torn_store.clone(), art(2))]);
    for (name, phase, served) in [
        ("ok", ModelPhase::Ready, true),
        ("torn", ModelPhase::Updating, false),
        ("c", ModelPhase::Updating, false),
    ] {
        let rec = &r.models()[&key(name)];
        assert_eq!(rec.phase, phase, "{name}");
        assert_eq!(rec.store.is_some(), served, "{name}");
    }
    assert_eq!(
        r.stores()[&torn_store].owner,
        None,
        "an owner without a record is cleared"
    );
}

#[test]
fn claims_follow_records_and_work() {
    let mut r = build(&[
        Setup::Holder("a", 1),
        Setup::New("b"),
        Setup::Holder("c", 1),
    ]);
    // c moves to another path; b is invalid and claims nothing.
    r.model_mut(&key("c")).unwrap().path = "d".into();
    r.model_mut(&key("b")).unwrap().fingerprint = "invalid:00".into();
    let idle = |_: &ModelKey| Wanted {
        working: false,
        artifact: ClaimArtifact::Unknown,
    };
    let text = |claims: Vec<PathClaim>| -> Vec<String> {
        claims
            .iter()
            .map(|c| format!("{} {:?} {}", short(&c.key), c.kind, c.path))
            .collect()
    };
    assert_eq!(
        text(claims(&r, r.models().keys(), idle)),
        vec!["a Served a", "c Served c", "c Wanted d"],
        "a settled model claims only where it is served"
    );
    let working = |k: &ModelKey| Wanted {
        working: *k == key("a"),
        artifact: ClaimArtifact::Pending,
    };
    assert_eq!(
        text(claims(&r, r.models().keys(), working)),
        vec!["a Served a", "a Wanted a", "c Served c", "c Wanted d"],
        "work in progress claims its wanted path too"
    );
    // The verdict of a new claim against the others: nesting needs no artifact.
    let verdict = verdict_for(
        claims(&r, r.models().keys(), idle),
        &key("b"),
        2,
        &MountPath::from_relative("a/x").unwrap(),
        ClaimArtifact::Pending,
    );
    assert!(
        matches!(verdict, PathVerdict::Conflict { ref with, .. } if *with == key("a")),
        "{verdict:?}"
    );
}

#[test]
fn retry_delay_doubles_with_jitter_and_a_cap() {
    let base = Duration::from_secs(2);
    let max = Duration::from_secs(300);
    for (attempts, jitter, want) in [
        (1, 1.0, 4),
        (1, 0.0, 2),
        (2, 1.0, 8),
        (3, 0.5, 12),
        (10, 1.0, 300),
        (40, 0.0, 150),
    ] {
        assert_eq!(
            retry_delay(base, max, attempts, jitter),
            Duration::from_secs(want),
            "attempt {attempts}, jitter {jitter}"
        );
    }
}

/// An effect as the effect tables write it.
fn effect_text(e: &Effect) -> String {
    match e {
        Effect::SaveRecords => "save".into(),
        Effect::LinkStore(s) => format!(
            "link {} -> {} for {}",
            s.from,
            s.to,
            s.members.iter().map(short).collect::<Vec<_>>().join(",")
        ),
        Effect::Fetch { key, store, seed } => match seed {
            Some(seed) => format!("fetch {} into {store} seeded from {seed}", short(key)),
            None => format!("fetch {} into {store}", short(key)),
        },
        Effect::Wait { key, on, reason } => {
            format!("{} waits for {} ({reason:?})", short(key), short(on))
        }
        Effect::LosePath { key, reason, .. } => format!("{} loses the path: {reason}", short(key)),
        Effect::Served {
            key,
            store,
            changed,
        } => format!(
            "{} served from {store}{}",
            short(key),
            if *changed { "" } else { " (unchanged)" }
        ),
        Effect::Remap => "remap".into(),
        Effect::Fail { key, reason, retry } => {
            format!("{} fails ({retry:?}): {reason}", short(key))
        }
        Effect::Forgotten { store, artifact } => {
            let n = artifact.0 .0[0];
            format!("{store} forgets artifact {n}")
        }
        Effect::Turn { key } => format!("{} gets its turn", short(key)),
        Effect::Stop { key } => format!("{} stops", short(key)),
        Effect::Start { key, new } => {
            format!("{} starts{}", short(key), if *new { " (new)" } else { "" })
        }
        Effect::Invalid { key, reason } => format!("{} invalid: {reason}", short(key)),
        Effect::Retry { key } => format!("{} retries", short(key)),
        Effect::Refresh { key } => format!("{} refreshes", short(key)),
        Effect::Wake { key } => format!("{} wakes", short(key)),
        Effect::Current { key } => format!("{} current", short(key)),
        Effect::Resolve { key } => format!("{} resolves", short(key)),
        Effect::FilesElsewhere { key } => format!("{} files elsewhere", short(key)),
    }
}

/// Every model's claims, none of them working (for the path rule in the effect tables).
fn all_claims(r: &Records) -> Vec<PathClaim> {
    claims(r, r.models().keys(), |_| Wanted {
        working: false,
        artifact: ClaimArtifact::Unknown,
    })
}

/// The decision core's entry point driven with (records, event) rows: the effects each event
/// asks the actor for, in order, and the records it leaves, for every kind of event the actor
/// sends (SPEC sections 3 and 4).
#[test]
fn decide_effects_table() {
    use Setup::*;
    fn s(n: u64) -> StoreId {
        StoreId::from_seq(n)
    }
    let ready_at = |name: &str, path: &str, a: u8| Want {
        path: MountPath::from_relative(path).unwrap(),
        ..want(name, Always, a)
    };
    struct Row {
        what: &'static str,
        setup: Vec<Setup>,
        /// Changes the records before the event (a path, a policy).
        tweak: fn(&mut Records),
        event: Box<dyn Fn(&Records) -> Fact>,
        effects: Vec<&'static str>,
        records: Vec<&'static str>,
    }
    let none: fn(&mut Records) = |_| {};
    let rows = vec![
        Row {
            what: "3.1 new model, AlwaysDownload: the store is recorded before it is fetched into",
            setup: vec![New("m")],
            tweak: none,
            event: Box::new(move |_| Fact::ArtifactKnown {
                key: key("m"),
                want: want("m", Always, 1),
                in_flight: InFlight::default(),
                claims: Vec::new(),
                space: None,
            }),
            effects: vec!["save", "fetch m into s00000001"],
            // Served by nothing until the fetch completes; the new store is its own.
            records: vec!["m <- -", "s00000001: m"],
        },
        Row {
            what: "12 admission: a fetch that fits under the budget is started as without one",
            setup: vec![New("m")],
            tweak: none,
            event: Box::new(move |_| Fact::ArtifactKnown {
                key: key("m"),
                want: want("m", Always, 1),
                in_flight: InFlight::default(),
                claims: Vec::new(),
                space: Some(Space {
                    free: 10 << 30,
                    needed: 10 << 30,
                }),
            }),
            effects: vec!["save", "fetch m into s00000001"],
            records: vec!["m <- -", "s00000001: m"],
        },
        Row {
            what: "12 admission: a fetch that cannot fit is not started and no store is made",
            setup: vec![New("m")],
            tweak: none,
            event: Box::new(move |_| Fact::ArtifactKnown {
                key: key("m"),
                want: want("m", Always, 1),
                in_flight: InFlight::default(),
                claims: Vec::new(),
                space: Some(Space {
                    free: 120 << 30,
                    needed: 412 << 30,
                }),
            }),
            effects: vec![
                "m fails (Space { needed: 442381631488 }): InsufficientStorage: needs 412 GiB, 120 GiB free under the budget",
            ],
            records: vec!["m <- -"],
        },
        Row {
            what: "12 admission: a Ready holder serves a ReuseIfExists model even with no space",
            setup: vec![Holder("p", 1), New("m")],
            tweak: none,
            event: Box::new(|_| Fact::ArtifactKnown {
                key: key("m"),
                want: want("m", Reuse, 1),
                in_flight: InFlight::default(),
                claims: Vec::new(),
                space: Some(Space { free: 0, needed: 1 }),
            }),
            effects: vec!["m served from s00000001", "remap"],
            records: vec!["m <- p", "p <- p", "s00000001: p"],
        },
        Row {
            what: "3.1 ReuseIfExists with a Ready holder: served at once, mapping rebuilt",
            setup: vec![Holder("p", 1), New("m")],
            tweak: none,
            event: Box::new(|_| Fact::ArtifactKnown {
                key: key("m"),
                want: want("m", Reuse, 1),
                in_flight: InFlight::default(),
                claims: Vec::new(),
                space: None,
            }),
            effects: vec!["m served from s00000001", "remap"],
            records: vec!["m <- p", "p <- p", "s00000001: p"],
        },
        Row {
            what: "3.1 single flight: waits for the in-scope fetch of the same artifact",
            setup: vec![New("p"), New("m")],
            tweak: none,
            event: Box::new(|_| Fact::ArtifactKnown {
                key: key("m"),
                want: want("m", Reuse, 1),
                in_flight: InFlight {
                    fetching: BTreeMap::from([(key("p"), art(1))]),
                    ..Default::default()
                },
                claims: Vec::new(),
                space: None,
            }),
            effects: vec!["m waits for p (SameArtifact)"],
            records: vec!["m <- -", "p <- -"],
        },
        Row {
            what: "4 nesting paths: the later model loses, naming the earlier",
            setup: vec![Holder("p", 1), New("m")],
            tweak: |r| r.model_mut(&key("m")).unwrap().path = "p/inner".into(),
            event: Box::new(move |r| Fact::ArtifactKnown {
                key: key("m"),
                want: ready_at("m", "p/inner", 2),
                in_flight: InFlight::default(),
                claims: all_claims(r),
                space: None,
            }),
            effects: vec!["m loses the path: path p/inner nests with path p of clusterbasemodel.p"],
            records: vec!["m <- -", "p <- p", "s00000001: p"],
        },
        Row {
            what: "4 equal paths, same artifact: no conflict (served from the holder)",
            setup: vec![Holder("p", 1), New("m")],
            tweak: |r| r.model_mut(&key("m")).unwrap().path = "p".into(),
            event: Box::new(move |r| Fact::ArtifactKnown {
                key: key("m"),
                want: Want {
                    policy: Reuse,
                    ..ready_at("m", "p", 1)
                },
                in_flight: InFlight::default(),
                claims: all_claims(r),
                space: None,
            }),
            effects: vec!["m served from s00000001", "remap"],
            records: vec!["m <- p", "p <- p", "s00000001: p"],
        },
        Row {
            what: "3.2 T-01 fetch complete: the flip to the own copy; the parent drops the child",
            setup: vec![Holder("p", 1), Child("c", "p")],
            tweak: |r| {
                r.allocate_store(&key("c"));
            },
            event: Box::new(|_| Fact::Fetched {
                key: key("c"),
                store: s(2),
                artifact: art(1),
                want: Some(want("c", Always, 1)),
                claims: Vec::new(),
            }),
            effects: vec!["c served from s00000002", "remap"],
            records: vec!["c <- c", "p <- p", "s00000001: p", "s00000002: c"],
        },
        Row {
            what: "3.2 T-02: flips to the other holder, the own copy is released",
            setup: vec![Holder("p", 1), Holder("m", 1)],
            tweak: none,
            event: Box::new(|_| Fact::ArtifactKnown {
                key: key("m"),
                want: want("m", Reuse, 1),
                in_flight: InFlight::default(),
                claims: Vec::new(),
                space: None,
            }),
            effects: vec!["m served from s00000001", "remap"],
            records: vec![
                "m <- p",
                "p <- p",
                "s00000001: p",
                "s00000002: released garbage",
            ],
        },
        Row {
            what: "3.2 T-03: a parent to AlwaysDownload serves its own copy, unchanged",
            setup: vec![Holder("p", 1), Child("c", "p")],
            tweak: none,
            event: Box::new(|_| Fact::ArtifactKnown {
                key: key("p"),
                want: want("p", Always, 1),
                in_flight: InFlight::default(),
                claims: Vec::new(),
                space: None,
            }),
            effects: vec!["p served from s00000001 (unchanged)", "remap"],
            records: vec!["c <- p", "p <- p", "s00000001: p"],
        },
        Row {
            what: "3.2 T-04: a parent and its children move to the other holder",
            setup: vec![Holder("q", 1), Holder("p", 1), Child("c", "p")],
            tweak: none,
            event: Box::new(|_| Fact::ArtifactKnown {
                key: key("p"),
                want: want("p", Reuse, 1),
                in_flight: InFlight::default(),
                claims: Vec::new(),
                space: None,
            }),
            effects: vec!["p served from s00000001", "remap"],
            records: vec![
                "c <- q",
                "p <- q",
                "q <- q",
                "s00000001: q",
                "s00000002: released garbage",
            ],
        },
        Row {
            what: "3.3 new revision of a parent: children keep the old store, new store seeded",
            setup: vec![Holder("p", 1), Child("c", "p")],
            tweak: none,
            event: Box::new(|_| Fact::ArtifactKnown {
                key: key("p"),
                want: want("p", Always, 2),
                in_flight: InFlight::default(),
                claims: Vec::new(),
                space: None,
            }),
            effects: vec!["save", "fetch p into s00000002 seeded from s00000001"],
            records: vec!["c <- c", "p <- c", "s00000001: c", "s00000002: p"],
        },
        Row {
            what: "3.3 a stale fetch is recorded as data, never served",
            setup: vec![Holder("p", 1)],
            tweak: none,
            event: Box::new(|_| Fact::Fetched {
                key: key("p"),
                store: s(1),
                artifact: art(2),
                want: None,
                claims: Vec::new(),
            }),
            effects: vec![],
            records: vec!["p <- p", "s00000001: p"],
        },
        Row {
            what: "3.3 deleting a cluster parent of two namespaces' children: split by links",
            setup: vec![Holder("p", 1), Child("a/x", "p"), Child("b/y", "p")],
            tweak: none,
            event: Box::new(|_| Fact::Deleted { key: key("p") }),
            effects: vec!["save", "link s00000001 -> s00000002 for b/y", "remap"],
            records: vec![
                "a/x <- a/x",
                "b/y <- a/x",
                "s00000001: a/x",
                "s00000002: b/y",
            ],
        },
        Row {
            what: "3.3 deleting the last user: garbage",
            setup: vec![Holder("p", 1)],
            tweak: none,
            event: Box::new(|_| Fact::Deleted { key: key("p") }),
            effects: vec!["remap"],
            records: vec!["s00000001: released garbage"],
        },
        Row {
            what: "vendor source: Ready with nothing mapped, its copy passes to its child",
            setup: vec![Holder("p", 1), Child("c", "p")],
            tweak: none,
            event: Box::new(|_| Fact::NoFiles {
                key: key("p"),
                source: "vendor://x".into(),
            }),
            effects: vec!["remap"],
            records: vec!["c <- c", "p <- -", "s00000001: c"],
        },
        Row {
            what: "a split that could not be linked leaves the members on the old store",
            setup: vec![Holder("p", 1), Child("a/x", "p"), Child("b/y", "p")],
            tweak: |r| {
                let effects = delete(r, &key("p"));
                assert_eq!(effects.len(), 2);
            },
            event: Box::new(|_| Fact::SplitLinked {
                split: Split {
                    from: s(1),
                    to: s(2),
                    members: vec![key("b/y")],
                    artifacts: BTreeSet::from([art(1)]),
                },
                result: Err("disk full".into()),
            }),
            effects: vec![],
            records: vec![
                "a/x <- a/x",
                "b/y <- a/x",
                "s00000001: a/x",
                "s00000002: released garbage",
            ],
        },
        Row {
            what: "start-up: an incomplete artifact is forgotten and its models fetched again",
            setup: vec![Holder("p", 1), Child("c", "p"), Holder("q", 2)],
            tweak: none,
            event: Box::new(move |_| Fact::Recovered {
                incomplete: BTreeSet::from([(s(1), art(1))]),
            }),
            effects: vec!["s00000001 forgets artifact 1"],
            records: vec!["c <- -", "p <- -", "q <- q", "s00000001: p", "s00000002: q"],
        },
        Row {
            what: "mount server refusal, blobs missing: the copy forgets the artifact, every \
                   model on it fails and is retried",
            setup: vec![Holder("p", 1), Child("c", "p"), Holder("q", 2)],
            tweak: none,
            event: Box::new(move |_| Fact::MountRefused {
                refused: vec![(key("p"), "blob x is missing".into())],
                incomplete: BTreeSet::from([(s(1), art(1))]),
                working: BTreeSet::new(),
            }),
            effects: vec![
                "s00000001 forgets artifact 1",
                "c fails (MountRefused): the mount server refused to serve it: blob x is missing",
                "p fails (MountRefused): the mount server refused to serve it: blob x is missing",
                "remap",
            ],
            records: vec!["c <- -", "p <- -", "q <- q", "s00000001: p", "s00000002: q"],
        },
        Row {
            what: "mount server refusal of a complete copy: only that model fails; one with a \
                   change in progress is only unmapped",
            setup: vec![Holder("p", 1), Child("c", "p"), Holder("q", 2)],
            tweak: none,
            event: Box::new(move |_| Fact::MountRefused {
                refused: vec![
                    (key("c"), "store gone".into()),
                    (key("q"), "store gone".into()),
                ],
                incomplete: BTreeSet::new(),
                working: BTreeSet::from([key("q")]),
            }),
            effects: vec![
                "c fails (MountRefused): the mount server refused to serve it: store gone",
                "remap",
            ],
            records: vec!["c <- -", "p <- p", "q <- -", "s00000001: p", "s00000002: q"],
        },
        Row {
            what: "4 settle: of two served models whose paths nest (old records), the later \
                   is unmapped and loses; its store is kept",
            setup: vec![Holder("p", 1), Holder("m", 2)],
            tweak: |r| {
                let mut m = r.model_mut(&key("m")).unwrap();
                m.path = "p/inner".into();
                m.served_path = Some("p/inner".into());
            },
            event: Box::new(|r| Fact::SettlePaths {
                claims: all_claims(r),
                working: BTreeSet::new(),
                losers: BTreeSet::new(),
            }),
            effects: vec![
                "m loses the path: path p/inner nests with path p of clusterbasemodel.p",
                "remap",
            ],
            records: vec!["m <- -", "p <- p", "s00000001: p", "s00000002: m"],
        },
        Row {
            what: "4 settle: work on a path that now nests with a served model stops",
            setup: vec![Holder("p", 1), New("m")],
            tweak: |r| r.model_mut(&key("m")).unwrap().path = "p/x".into(),
            event: Box::new(|r| Fact::SettlePaths {
                claims: all_claims(r),
                working: BTreeSet::from([key("m")]),
                losers: BTreeSet::new(),
            }),
            effects: vec!["m loses the path: path p/x nests with path p of clusterbasemodel.p"],
            records: vec!["m <- -", "p <- p", "s00000001: p"],
        },
        Row {
            what: "4 settle: a loser the rule clears gets its turn",
            setup: vec![Holder("p", 1), New("m")],
            tweak: none,
            event: Box::new(|r| Fact::SettlePaths {
                claims: all_claims(r),
                working: BTreeSet::new(),
                losers: BTreeSet::from([key("m")]),
            }),
            effects: vec!["m gets its turn"],
            records: vec!["m <- -", "p <- p", "s00000001: p"],
        },
    ];
    let mut failures = Vec::new();
    for row in rows {
        let mut r = build(&row.setup);
        (row.tweak)(&mut r);
        let event = (row.event)(&r);
        let got: Vec<String> = decide(&mut r, &event)
            .effects
            .iter()
            .map(effect_text)
            .collect();
        let records = summary(&r);
        if got != row.effects || records != row.records {
            failures.push(format!(
                "{}:\n  effects {got:?}\n     want {:?}\n  records {records:?}\n     want {:?}",
                row.what, row.effects, row.records
            ));
        }
        assert_eq!(
            r.index(),
            &crate::reconciler::records::RecordsIndex::build(r.models(), r.stores()),
            "{}: index",
            row.what
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
