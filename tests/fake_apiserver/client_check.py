"""Drives the fake API server with the official Kubernetes Python client.

Every step states what the real API server does; the script exits non-zero with the step that
differs. Argument: the kubeconfig path. Prints one JSON line with the watch events seen.
"""

import json
import sys
import threading

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

config.load_kube_config(config_file=sys.argv[1])
core = client.CoreV1Api()
custom = client.CustomObjectsApi()
G, V = "ome.io", "v1beta1"
FINALIZER = "basemodels.ome.io/finalizer"


def check(condition, what):
    if not condition:
        raise SystemExit("FAIL: " + what)


def api_error(call, *args, **kwargs):
    try:
        call(*args, **kwargs)
    except ApiException as error:
        return error.status
    raise SystemExit(f"FAIL: {call.__name__} succeeded but should not have")


# --- ConfigMaps: create, get, list with a label selector, replace, stale replace, patch -----
made = core.create_namespaced_config_map(
    "ome",
    client.V1ConfigMap(
        metadata=client.V1ObjectMeta(
            name="node-x", labels={"models.ome/basemodel-status": "true"}
        ),
        data={"a": "1"},
    ),
)
first_rv = made.metadata.resource_version
check(first_rv, "create returns a resourceVersion")
check(
    api_error(
        core.create_namespaced_config_map,
        "ome",
        client.V1ConfigMap(metadata=client.V1ObjectMeta(name="node-x")),
    )
    == 409,
    "creating an existing name is 409 AlreadyExists",
)
got = core.read_namespaced_config_map("node-x", "ome")
check(got.data == {"a": "1"}, "get returns the data")
listed = core.list_namespaced_config_map(
    "ome", label_selector="models.ome/basemodel-status=true"
)
check([i.metadata.name for i in listed.items] == ["node-x"], "label selector matches")
check(
    core.list_namespaced_config_map("ome", label_selector="models.ome/basemodel-status=false").items
    == [],
    "label selector excludes",
)
got.data["b"] = "2"
replaced = core.replace_namespaced_config_map("node-x", "ome", got)
check(replaced.metadata.resource_version != first_rv, "replace bumps resourceVersion")
got.metadata.resource_version = first_rv
got.data["c"] = "3"
check(
    api_error(core.replace_namespaced_config_map, "node-x", "ome", got) == 409,
    "replace with a stale resourceVersion is 409",
)
patched = core.patch_namespaced_config_map("node-x", "ome", {"data": {"c": "3"}})
check(patched.data == {"a": "1", "b": "2", "c": "3"}, "strategic merge patch merges data")
check(
    api_error(core.read_namespaced_config_map, "absent", "ome") == 404, "get of absent is 404"
)

# --- BaseModel with a finalizer, watched from before its creation ---------------------------
start = custom.list_namespaced_custom_object(G, V, "team", "basemodels")
events = []
watch_done = threading.Event()


def watcher():
    w = watch.Watch()
    for event in w.stream(
        custom.list_namespaced_custom_object,
        G,
        V,
        "team",
        "basemodels",
        resource_version=start["metadata"]["resourceVersion"],
        timeout_seconds=30,
    ):
        obj = event["object"]
        events.append(
            {
                "type": event["type"],
                "name": obj["metadata"]["name"],
                "deleting": "deletionTimestamp" in obj["metadata"],
                "finalizers": obj["metadata"].get("finalizers", []),
            }
        )
        if event["type"] == "DELETED":
            w.stop()
    watch_done.set()


thread = threading.Thread(target=watcher, daemon=True)
thread.start()

model = {
    "apiVersion": "ome.io/v1beta1",
    "kind": "BaseModel",
    "metadata": {"name": "m"},
    "spec": {"storage": {"storageUri": "hf://org/m"}},
}
bm = custom.create_namespaced_custom_object(G, V, "team", "basemodels", model)
check(bm["metadata"]["generation"] == 1, "generation starts at 1")
check(bm["metadata"].get("uid"), "create assigns a uid")
bm = custom.patch_namespaced_custom_object(
    G, V, "team", "basemodels", "m", {"metadata": {"finalizers": [FINALIZER]}}
)
check(bm["metadata"]["finalizers"] == [FINALIZER], "merge patch sets finalizers")
check(bm["metadata"]["generation"] == 1, "a metadata change keeps the generation")
bm = custom.patch_namespaced_custom_object(
    G, V, "team", "basemodels", "m", {"spec": {"storage": {"downloadPolicy": "ReuseIfExists"}}}
)
check(bm["metadata"]["generation"] == 2, "a spec change bumps the generation")
stale = dict(bm)
stale["metadata"] = dict(bm["metadata"], resourceVersion=first_rv)
check(
    api_error(custom.replace_namespaced_custom_object, G, V, "team", "basemodels", "m", stale)
    == 409,
    "replace of a custom object with a stale resourceVersion is 409",
)

before_delete = bm["metadata"]["resourceVersion"]
custom.delete_namespaced_custom_object(G, V, "team", "basemodels", "m")
deleting = custom.get_namespaced_custom_object(G, V, "team", "basemodels", "m")
check("deletionTimestamp" in deleting["metadata"], "DELETE with a finalizer sets deletionTimestamp")
check(deleting["metadata"]["finalizers"] == [FINALIZER], "DELETE keeps the finalizers")
check(
    deleting["metadata"]["resourceVersion"] != before_delete,
    "setting deletionTimestamp is a write (new resourceVersion)",
)
check(deleting["metadata"]["generation"] == 3, "setting deletionTimestamp bumps the generation")
custom.delete_namespaced_custom_object(G, V, "team", "basemodels", "m")
again = custom.get_namespaced_custom_object(G, V, "team", "basemodels", "m")
check(
    again["metadata"]["resourceVersion"] == deleting["metadata"]["resourceVersion"],
    "a second DELETE changes nothing",
)
check(
    api_error(
        custom.patch_namespaced_custom_object,
        G,
        V,
        "team",
        "basemodels",
        "m",
        {"metadata": {"finalizers": [FINALIZER, "example.com/other"]}},
    )
    == 422,
    "adding a finalizer to an object being deleted is refused",
)
kept = custom.patch_namespaced_custom_object(
    G, V, "team", "basemodels", "m", {"metadata": {"deletionTimestamp": None, "labels": {"x": "y"}}}
)
check(
    kept["metadata"].get("deletionTimestamp") == deleting["metadata"]["deletionTimestamp"],
    "a client cannot clear deletionTimestamp",
)
# OME's controller removes its finalizer with an Update of the object it read.
kept["metadata"]["finalizers"] = []
custom.replace_namespaced_custom_object(G, V, "team", "basemodels", "m", kept)
check(
    api_error(custom.get_namespaced_custom_object, G, V, "team", "basemodels", "m") == 404,
    "the object is gone once its last finalizer is removed",
)
check(watch_done.wait(20), "the watch ends with a DELETED event")

# --- ClusterBaseModel: preconditions, and DELETE without finalizers removes at once ---------
cbm = custom.create_cluster_custom_object(
    G,
    V,
    "clusterbasemodels",
    {
        "apiVersion": "ome.io/v1beta1",
        "kind": "ClusterBaseModel",
        "metadata": {"name": "c", "finalizers": ["clusterbasemodels.ome.io/finalizer"]},
        "spec": {"storage": {"storageUri": "vendor://x"}},
    },
)
check(
    api_error(
        custom.delete_cluster_custom_object,
        G,
        V,
        "clusterbasemodels",
        "c",
        body=client.V1DeleteOptions(preconditions=client.V1Preconditions(resource_version="1")),
    )
    == 409,
    "DELETE with a stale resourceVersion precondition is 409",
)
custom.delete_cluster_custom_object(G, V, "clusterbasemodels", "c")
c = custom.get_cluster_custom_object(G, V, "clusterbasemodels", "c")
check("deletionTimestamp" in c["metadata"], "cluster-scoped DELETE with a finalizer waits")
custom.patch_cluster_custom_object(
    G, V, "clusterbasemodels", "c", {"metadata": {"finalizers": None}}
)
check(
    api_error(custom.get_cluster_custom_object, G, V, "clusterbasemodels", "c") == 404,
    "a patch that drops the finalizers removes the object",
)
custom.create_cluster_custom_object(
    G,
    V,
    "clusterbasemodels",
    {"apiVersion": "ome.io/v1beta1", "kind": "ClusterBaseModel", "metadata": {"name": "plain"}},
)
custom.delete_cluster_custom_object(G, V, "clusterbasemodels", "plain")
check(
    api_error(custom.get_cluster_custom_object, G, V, "clusterbasemodels", "plain") == 404,
    "DELETE without finalizers removes at once",
)

print(json.dumps(events))
