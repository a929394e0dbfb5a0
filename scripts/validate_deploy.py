#!/usr/bin/env python3
"""Offline validation of deploy/: renders the kustomize base, validates every object against
the Kubernetes OpenAPI schemas (kubernetes-validate, strict), validates the example model
objects against the CRDs' openAPIV3Schema, and checks the properties the daemon depends on.
Exits non-zero on the first class of failure found, listing every problem."""

import argparse
import copy
import pathlib
import sys

import jsonschema
import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
KUSTOMIZE_FIELDS = {"apiVersion", "kind", "namespace", "resources", "images"}


def load_all(path):
    with open(path, encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc]


def render_kustomization(directory):
    """The subset of kustomize the base uses: resources, namespace, images."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZE_FIELDS
    if unknown:
        raise SystemExit(f"kustomization uses fields this check cannot render: {sorted(unknown)}")
    objects = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        if path.is_dir():
            objects.extend(render_kustomization(path))
        else:
            objects.extend(load_all(path))
    namespace = kustomization.get("namespace")
    images = {image["name"]: image for image in kustomization.get("images", [])}
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
    for obj in objects:
        if namespace and obj["kind"] not in cluster_scoped:
            obj["metadata"]["namespace"] = namespace
        spec = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            name = container["image"].split(":")[0]
            if name in images:
                image = images[name]
                container["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    return objects


def check_daemonset(objects, problems):
    daemonsets = [o for o in objects if o["kind"] == "DaemonSet"]
    if len(daemonsets) != 1:
        problems.append(f"expected one DaemonSet, found {len(daemonsets)}")
        return
    pod = daemonsets[0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    if not container.get("securityContext", {}).get("privileged"):
        problems.append("DaemonSet container must be privileged (FUSE, passthrough)")
    mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    args = container.get("args", [])
    mount_dir = next((a.split("=", 1)[1] for a in args if a.startswith("--mount=")), None)
    models = [m for m in mounts.values() if m["mountPath"] == mount_dir]
    if not models or models[0].get("mountPropagation") != "Bidirectional":
        problems.append("the --mount directory must be a volume with Bidirectional propagation")
    elif "hostPath" not in volumes.get(models[0]["name"], {}):
        problems.append("the models root must be a hostPath volume")
    if not any(m["mountPath"] == "/dev/fuse" for m in mounts.values()):
        problems.append("/dev/fuse must be mounted")
    state_dir = next((a.split("=", 1)[1] for a in args if a.startswith("--state=")), None)
    state = [m for m in mounts.values() if m["mountPath"] == state_dir]
    if not state or "hostPath" not in volumes.get(state[0]["name"], {}):
        problems.append("the --state directory must be a hostPath volume")
    env = {e["name"]: e for e in container.get("env", [])}
    if env.get("NODE_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "spec.nodeName":
        problems.append("NODE_NAME must come from the downward API (spec.nodeName)")
    if "--kube" not in args:
        problems.append("the daemon must run with --kube")
    for probe, path in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
        if container.get(probe, {}).get("httpGet", {}).get("path") != path:
            problems.append(f"{probe} must GET {path}")
    if "preStop" not in container.get("lifecycle", {}):
        problems.append("a preStop hook must stop the daemon so that it unmounts")


def check_inference_example(objects, problems):
    for obj in objects:
        if obj["kind"] != "Deployment":
            continue
        pod = obj["spec"]["template"]["spec"]
        host_volumes = {v["name"] for v in pod.get("volumes", []) if "hostPath" in v}
        for container in pod["containers"]:
            for mount in container.get("volumeMounts", []):
                if mount["name"] in host_volumes and mount.get("mountPropagation") != "HostToContainer":
                    problems.append(
                        f"{obj['metadata']['name']}: model hostPath mounts need HostToContainer propagation"
                    )


def crd_schemas(crd_dir):
    schemas = {}
    for path in sorted(crd_dir.glob("*.yaml")):
        for crd in load_all(path):
            if crd.get("kind") != "CustomResourceDefinition":
                continue
            group = crd["spec"]["group"]
            for version in crd["spec"]["versions"]:
                key = (f"{group}/{version['name']}", crd["spec"]["names"]["kind"])
                schemas[key] = version["schema"]["openAPIV3Schema"]
    return schemas


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--crds", type=pathlib.Path, action="append", default=[],
                        help="directory of CRD YAML files for the example model objects")
    parser.add_argument("--kubernetes-version", default="1.34.0")
    args = parser.parse_args()
    problems = []

    base = render_kustomization(ROOT / "deploy" / "base")
    examples = []
    for path in sorted((ROOT / "deploy" / "examples").glob("*.yaml")):
        examples.extend((path, doc) for doc in load_all(path))

    for obj in base + [doc for _, doc in examples if doc["apiVersion"] != "ome.io/v1beta1"]:
        try:
            kubernetes_validate.validate(copy.deepcopy(obj), args.kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {error.message} at {list(error.path)}")
        except kubernetes_validate.SchemaNotFoundError as error:
            problems.append(f"{obj['kind']}: no schema ({error})")

    check_daemonset(base, problems)
    check_inference_example([doc for _, doc in examples], problems)

    crd_dirs = args.crds or [ROOT.parent / "shared" / "fixtures" / "ome-crds"]
    schemas = {}
    for crd_dir in crd_dirs:
        schemas.update(crd_schemas(crd_dir))
    models = [(p, d) for p, d in examples if d["apiVersion"] == "ome.io/v1beta1"]
    if models and not schemas:
        problems.append(f"no CRDs found in {[str(d) for d in crd_dirs]}")
    for path, doc in models:
        schema = schemas.get((doc["apiVersion"], doc["kind"]))
        if schema is None:
            problems.append(f"{path.name}: no CRD for {doc['apiVersion']} {doc['kind']}")
            continue
        for error in jsonschema.Draft7Validator(schema).iter_errors(doc):
            problems.append(f"{path.name}: {error.message} at {list(error.path)}")

    if problems:
        print("deploy/ validation failed:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    print(f"deploy/ valid: {len(base)} base objects, {len(examples)} example objects")
    return 0


if __name__ == "__main__":
    sys.exit(main())
