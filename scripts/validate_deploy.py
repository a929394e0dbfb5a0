#!/usr/bin/env python3
"""Offline validation of deploy/: renders the kustomize base, validates every object against
the Kubernetes OpenAPI schemas (kubernetes-validate, strict), validates the example model
objects against the CRDs' openAPIV3Schema, and checks the properties the daemon depends on.

It also checks the CRDs that `modelfs crd` generates from the Rust types: it runs the built
binary (--modelfs, else the newest $CARGO_TARGET_DIR/*/modelfs or target/*/modelfs), validates
the generated CRD objects with kubernetes-validate, compares them with deploy/crds/, and
validates deploy/examples and every OME fixture model (ome-models/**/*.yaml) against the
generated schemas. --skip-generated-crds leaves this step out.

Exits non-zero if anything failed, listing every problem."""

import argparse
import copy
import os
import pathlib
import re
import subprocess
import sys

import jsonschema
import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
KUSTOMIZE_FIELDS = {"apiVersion", "kind", "namespace", "resources", "images", "patches"}


def load_all(path):
    with open(path, encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc]


def strategic_merge(target, patch):
    """A strategic merge patch as kubectl applies it to the fields deploy/ patches: maps merge
    key by key; lists of maps that all have a `name` (containers, env, volumes, volumeMounts,
    ports) merge by name, appending new names; other lists and scalars are replaced."""
    if isinstance(target, dict) and isinstance(patch, dict):
        out = dict(target)
        for key, value in patch.items():
            out[key] = strategic_merge(target[key], value) if key in target else copy.deepcopy(value)
        return out
    named = lambda items: isinstance(items, list) and all(isinstance(i, dict) and "name" in i for i in items)
    if named(target) and named(patch):
        out = [dict(i) for i in target]
        for item in patch:
            at = next((n for n, old in enumerate(out) if old["name"] == item["name"]), None)
            if at is None:
                out.append(copy.deepcopy(item))
            else:
                out[at] = strategic_merge(out[at], item)
        return out
    return copy.deepcopy(patch)


def apply_patches(directory, kustomization, objects):
    """`patches:` entries with a `path` to a strategic merge patch, matched by kind and name."""
    for entry in kustomization.get("patches", []):
        if set(entry) != {"path"}:
            raise SystemExit(f"{directory}: only `patches: - path:` entries can be rendered here: {entry}")
        for patch in load_all(directory / entry["path"]):
            matches = [n for n, o in enumerate(objects)
                       if o["kind"] == patch["kind"] and o["metadata"]["name"] == patch["metadata"]["name"]]
            if len(matches) != 1:
                raise SystemExit(f"{directory / entry['path']}: patch for {patch['kind']}/"
                                 f"{patch['metadata']['name']} matches {len(matches)} objects")
            objects[matches[0]] = strategic_merge(objects[matches[0]], patch)
    return objects


def render_kustomization(directory):
    """The subset of kustomize deploy/ uses: resources (files or directories), namespace,
    images, and strategic merge patches (`patches: - path:`)."""
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
    objects = apply_patches(directory, kustomization, objects)
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
    """Three DaemonSets: the keeper (`keeper`: holds each mount's FUSE connection, `OnDelete`
    so that it is never restarted with the others), the mount server (`mount-server`:
    privileged, /dev/fuse, the models root as a Bidirectional hostPath, the keeper's socket,
    a liveness probe, no preStop: SIGTERM hands the mount on) and the agent (`agent --kube`:
    probes, NODE_NAME, rolled out freely), sharing the state directory and the socket
    directory as hostPaths."""
    daemonsets = [o for o in objects if o["kind"] == "DaemonSet"]
    by_role = {}
    for ds in daemonsets:
        args = ds["spec"]["template"]["spec"]["containers"][0].get("args", [])
        by_role.setdefault(args[0] if args else "", []).append(ds)
    if (
        len(daemonsets) != 3
        or len(by_role.get("mount-server", [])) != 1
        or len(by_role.get("agent", [])) != 1
        or len(by_role.get("keeper", [])) != 1
    ):
        problems.append(f"expected one keeper, one mount-server and one agent DaemonSet, found {sorted(by_role)}")
        return

    def parts(ds):
        pod = ds["spec"]["template"]["spec"]
        container = pod["containers"][0]
        mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        args = container.get("args", [])

        def arg(name):
            return next((a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")), None)

        def host_path(directory):
            """The volume mount that holds `directory` (the deepest whose mountPath is it or a
            parent of it) and the host path it reaches there, or (None, None)."""
            if not directory:
                return None, None
            inside = lambda m: directory == m["mountPath"] or directory.startswith(m["mountPath"].rstrip("/") + "/")
            found = sorted((m for m in mounts.values() if inside(m)), key=lambda m: len(m["mountPath"]))
            if not found:
                return None, None
            mount = found[-1]
            host = volumes.get(mount["name"], {}).get("hostPath", {}).get("path")
            if host is not None:
                host = host.rstrip("/") + directory[len(mount["mountPath"].rstrip("/")):]
            return mount, host

        return container, mounts, args, arg, host_path

    server, s_mounts, s_args, s_arg, s_host = parts(by_role["mount-server"][0])
    agent, a_mounts, a_args, a_arg, a_host = parts(by_role["agent"][0])
    keeper, k_mounts, k_args, k_arg, k_host = parts(by_role["keeper"][0])
    name = by_role["mount-server"][0]["metadata"]["name"]
    if by_role["keeper"][0]["spec"].get("updateStrategy", {}).get("type") != "OnDelete":
        problems.append("the keeper must use updateStrategy OnDelete (never restarted with the mount server)")
    k_socket, s_socket = k_arg("socket"), s_arg("keeper-socket")
    if not k_socket or k_socket != s_socket:
        problems.append("the mount server's --keeper-socket must be the keeper's --socket")
    else:
        k_dir, s_dir = k_host(k_socket.rsplit("/", 1)[0])[1], s_host(s_socket.rsplit("/", 1)[0])[1]
        if k_dir is None or k_dir != s_dir:
            problems.append("the keeper socket's directory must be the same hostPath in both DaemonSets")
    if "probe" not in " ".join(server.get("livenessProbe", {}).get("exec", {}).get("command", [])):
        problems.append(f"{name}: the mount server's livenessProbe must run modelfs probe")
    if not server.get("securityContext", {}).get("privileged"):
        problems.append(f"{name}: the mount server must be privileged (FUSE, passthrough)")
    models, models_host = s_host(s_arg("mount"))
    if not models or models.get("mountPropagation") != "Bidirectional":
        problems.append("the --mount directory must be a volume with Bidirectional propagation")
    elif models_host is None:
        problems.append("the models root must be a hostPath volume")
    if not any(m["mountPath"] == "/dev/fuse" for m in s_mounts.values()):
        problems.append("/dev/fuse must be mounted")
    if "preStop" in server.get("lifecycle", {}):
        problems.append("the mount server must have no preStop: SIGTERM hands the mount on, it never unmounts")

    agent_models, agent_models_host = a_host(a_arg("mount"))
    if agent_models_host != models_host or (agent_models or {}).get("mountPropagation") != "HostToContainer":
        problems.append("the agent must see the models root (same hostPath, HostToContainer)")
    if agent.get("securityContext", {}).get("privileged"):
        problems.append("the agent must not be privileged (the mount belongs to the mount server)")
    for what in ("state", "mount-socket"):
        s_dir, a_dir = s_arg(what), a_arg(what)
        if what == "mount-socket":
            s_dir = s_dir and s_dir.rsplit("/", 1)[0]
            a_dir = a_dir and a_dir.rsplit("/", 1)[0]
        s_path, a_path = s_host(s_dir)[1], a_host(a_dir)[1]
        if s_path is None or s_path != a_path or s_arg(what) != a_arg(what):
            problems.append(f"--{what} must be the same hostPath in both DaemonSets")
    state_volume, state_host = s_host(s_arg("state"))
    if models_host and state_host and state_host.rstrip("/").rsplit("/", 1)[0] != models_host.rstrip("/").rsplit("/", 1)[0]:
        problems.append("the state directory must be a hostPath beside the models root (its disk; SPEC 12)")
    # A hard link needs one mount: adoption links the old files into the stores only when the
    # mount server reaches the models root and the state directory through one volume.
    if models and state_volume and models["name"] != state_volume["name"]:
        problems.append("the mount server must reach the models root and the state directory through one "
                        "volume (their common parent), or adopting old files copies them")
    env = {e["name"]: e for e in agent.get("env", [])}
    if env.get("NODE_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "spec.nodeName":
        problems.append("NODE_NAME must come from the downward API (spec.nodeName)")
    if "--kube" not in a_args:
        problems.append("the agent must run with --kube")
    for probe, path in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
        if agent.get(probe, {}).get("httpGet", {}).get("path") != path:
            problems.append(f"{probe} must GET {path}")


def check_env_references(name, objects, problems):
    """Kubernetes expands `$(VAR)` in env values only from variables defined before them, and
    in args from any of the container's variables; a name it does not know stays literal."""
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []):
            defined = []
            for env in container.get("env", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", env.get("value", "")):
                    if ref not in defined:
                        problems.append(f"{name}: {obj['kind']}/{obj['metadata']['name']} env {env['name']} "
                                        f"uses $({ref}), which is not defined before it")
                defined.append(env["name"])
            for arg in container.get("args", []) + container.get("command", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    if ref not in defined:
                        problems.append(f"{name}: {obj['kind']}/{obj['metadata']['name']} arg {arg} "
                                        f"uses $({ref}), which the container does not define")
            volumes = {v["name"] for v in pod.get("volumes", [])}
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    problems.append(f"{name}: volumeMount {mount['name']} has no volume")


def check_modelfs_env(name, objects, modelfs, problems):
    """Every MODELFS_* variable a manifest sets must be one that `modelfs serve` reads (clap
    lists them in --help), so that a renamed flag cannot leave an overlay silently inert."""
    wanted = sorted({env["name"] for obj in objects
                     for container in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
                     for env in container.get("env", []) if env["name"].startswith("MODELFS_")})
    if not wanted or modelfs is None:
        return
    result = subprocess.run([str(modelfs), "serve", "--help"], capture_output=True, text=True, check=False)
    for var in wanted:
        if f"env: {var}" not in result.stdout:
            problems.append(f"{name}: {var} is not read by `modelfs serve` (see `modelfs serve --help`)")


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


def fixtures_dir():
    """$MODELFS_FIXTURES_DIR, else ../shared/fixtures next to the repository (as the Rust tests)."""
    configured = os.environ.get("MODELFS_FIXTURES_DIR")
    return pathlib.Path(configured) if configured else ROOT.parent / "shared" / "fixtures"


def fixtures_required():
    """Whether a missing fixture is a failure (CI sets MODELFS_REQUIRE_FIXTURES=1)."""
    return os.environ.get("MODELFS_REQUIRE_FIXTURES", "") not in ("", "0")


def find_modelfs(explicit):
    """The binary to run: --modelfs, else the newest modelfs under the cargo target directory."""
    if explicit:
        return explicit
    target_dirs = [pathlib.Path(os.environ["CARGO_TARGET_DIR"])] if os.environ.get("CARGO_TARGET_DIR") else []
    target_dirs.append(ROOT / "target")
    candidates = [p for d in target_dirs for p in d.glob("*/modelfs") if p.is_file()]
    if not candidates:
        return None
    return max(candidates, key=lambda p: p.stat().st_mtime)


def to_json_schema(node):
    """A CRD's OpenAPI v3 schema as JSON Schema, with the API server's semantics: `nullable`
    admits null, and an object with declared properties that does not preserve unknown fields
    rejects other fields (kubectl's strict field validation)."""
    out = {k: v for k, v in node.items()
           if k not in ("nullable", "properties", "items", "additionalProperties")
           and not k.startswith("x-kubernetes-")}
    if "properties" in node:
        out["properties"] = {name: to_json_schema(sub) for name, sub in node["properties"].items()}
    if "items" in node:
        out["items"] = to_json_schema(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(node["additionalProperties"])
    elif ("properties" in node and "additionalProperties" not in node
          and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    if node.get("nullable"):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = out["enum"] + [None]
    return out


def model_documents(paths):
    """(path, document) for every BaseModel / ClusterBaseModel in the given YAML files."""
    models = []
    for path in paths:
        for doc in load_all(path):
            if isinstance(doc, dict) and doc.get("apiVersion") == "ome.io/v1beta1":
                models.append((path, doc))
    return models


def check_generated_crds(modelfs, kubernetes_version, examples, problems):
    """Runs `modelfs crd` and checks its output; returns a one-line summary."""
    try:
        result = subprocess.run([str(modelfs), "crd"], capture_output=True, text=True, check=False)
    except OSError as error:
        problems.append(f"cannot run {modelfs} crd: {error}")
        return None
    if result.returncode != 0:
        problems.append(f"{modelfs} crd exited with {result.returncode}: {result.stderr.strip()}")
        return None
    crds = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    names = sorted(crd.get("metadata", {}).get("name", "?") for crd in crds)
    if names != ["basemodels.ome.io", "clusterbasemodels.ome.io"]:
        problems.append(f"`modelfs crd` printed {names}, expected basemodels.ome.io and clusterbasemodels.ome.io")
        return None

    for crd in crds:
        try:
            kubernetes_validate.validate(copy.deepcopy(crd), kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            problems.append(f"generated CRD {crd['metadata']['name']}: {error.message} at {list(error.path)}")

    committed = {}
    for path in sorted((ROOT / "deploy" / "crds").glob("*.yaml")):
        for doc in load_all(path):
            committed[doc["metadata"]["name"]] = (path, doc)
    for crd in crds:
        name = crd["metadata"]["name"]
        if name not in committed:
            problems.append(f"deploy/crds/ has no {name}; regenerate with `cargo run -- crd --output-dir deploy/crds`")
        elif committed[name][1] != crd:
            problems.append(f"{committed[name][0].relative_to(ROOT)} differs from `modelfs crd`; "
                            "regenerate with `cargo run -- crd --output-dir deploy/crds`")

    validators = {}
    for crd in crds:
        for version in crd["spec"]["versions"]:
            key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
            schema = to_json_schema(version["schema"]["openAPIV3Schema"])
            validators[key] = jsonschema.Draft7Validator(schema)

    # The schemas must reject what the API server rejects, or passing means nothing.
    broken = {"apiVersion": "ome.io/v1beta1", "kind": "BaseModel", "metadata": {"name": "x"},
              "spec": {"storage": {"downloadPolicy": "Sometimes", "nodeSelector": {"a": 1}},
                       "maxTokens": "many", "modelFormat": {}}}
    errors = list(validators[("ome.io/v1beta1", "BaseModel")].iter_errors(broken))
    if len(errors) < 5:
        problems.append(f"the generated BaseModel schema accepts invalid objects ({len(errors)} of 5 errors found)")

    fixtures = fixtures_dir() / "ome-models"
    fixture_paths = sorted(fixtures.rglob("*.yaml"))
    if not fixture_paths:
        required = fixtures_required()
        message = (f"no OME fixture models under {fixtures}: the OME manifests are not validated "
                   "(set MODELFS_FIXTURES_DIR to a directory holding ome-models/)")
        if required:
            problems.append(message)
        else:
            print(f"skipped: {message}", file=sys.stderr)
    models = [(p, d) for p, d in examples if d.get("apiVersion") == "ome.io/v1beta1"]
    models += model_documents(fixture_paths)
    for path, doc in models:
        validator = validators.get((doc["apiVersion"], doc["kind"]))
        if validator is None:
            problems.append(f"{path}: no generated CRD for {doc['apiVersion']} {doc['kind']}")
            continue
        for error in validator.iter_errors(doc):
            problems.append(f"{path}: invalid against the generated {doc['kind']} CRD: "
                            f"{error.message} at {'.'.join(str(p) for p in error.path)}")
    return f"{len(crds)} generated CRDs, {len(models)} model objects valid against them"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--crds", type=pathlib.Path, action="append", default=[],
                        help="directory of CRD YAML files for the example model objects")
    parser.add_argument("--kubernetes-version", default="1.34.0")
    parser.add_argument("--modelfs", type=pathlib.Path,
                        help="modelfs binary whose `crd` output to check (default: newest target/*/modelfs)")
    parser.add_argument("--skip-generated-crds", action="store_true",
                        help="do not check the CRDs generated by `modelfs crd`")
    args = parser.parse_args()
    problems = []

    base = render_kustomization(ROOT / "deploy" / "base")
    examples = []
    for path in sorted((ROOT / "deploy" / "examples").glob("*.yaml")):
        examples.extend((path, doc) for doc in load_all(path))

    crds = []
    for path in sorted((ROOT / "deploy" / "crds").glob("*.yaml")):
        crds.extend(load_all(path))

    for obj in base + crds + [doc for _, doc in examples if doc["apiVersion"] != "ome.io/v1beta1"]:
        try:
            kubernetes_validate.validate(copy.deepcopy(obj), args.kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {error.message} at {list(error.path)}")
        except kubernetes_validate.SchemaNotFoundError as error:
            problems.append(f"{obj['kind']}: no schema ({error})")

    check_daemonset(base, problems)
    check_env_references("deploy/base", base, problems)
    check_inference_example([doc for _, doc in examples], problems)

    # Optional overlays (deploy/overlays/*): valid objects, and still a working daemon.
    overlays = {}
    for directory in sorted((ROOT / "deploy" / "overlays").glob("*/")):
        name = f"deploy/overlays/{directory.name}"
        overlays[name] = objects = render_kustomization(directory)
        for obj in objects:
            try:
                kubernetes_validate.validate(copy.deepcopy(obj), args.kubernetes_version, strict=True)
            except kubernetes_validate.ValidationError as error:
                problems.append(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {error.message} at {list(error.path)}")
        overlay_problems = []
        check_daemonset(objects, overlay_problems)
        problems.extend(f"{name}: {p}" for p in overlay_problems)
        check_env_references(name, objects, problems)

    crd_dirs = args.crds or [fixtures_dir() / "ome-crds"]
    schemas = {}
    for crd_dir in crd_dirs:
        schemas.update(crd_schemas(crd_dir))
    models = [(p, d) for p, d in examples if d["apiVersion"] == "ome.io/v1beta1"]
    if models and not schemas:
        message = (f"no CRDs found in {[str(d) for d in crd_dirs]}: the examples are not validated "
                   "against OME's CRDs (set MODELFS_FIXTURES_DIR to a directory holding ome-crds/, "
                   "or pass --crds)")
        if args.crds or fixtures_required():
            problems.append(message)
        else:
            print(f"skipped: {message}", file=sys.stderr)
            models = []
    for path, doc in models:
        schema = schemas.get((doc["apiVersion"], doc["kind"]))
        if schema is None:
            problems.append(f"{path.name}: no CRD for {doc['apiVersion']} {doc['kind']}")
            continue
        for error in jsonschema.Draft7Validator(schema).iter_errors(doc):
            problems.append(f"{path.name}: {error.message} at {list(error.path)}")

    generated = None
    if not args.skip_generated_crds:
        modelfs = find_modelfs(args.modelfs)
        if modelfs is None:
            problems.append("no modelfs binary to check the generated CRDs: build it (`cargo build`), "
                            "pass --modelfs PATH, or pass --skip-generated-crds")
        else:
            generated = check_generated_crds(modelfs, args.kubernetes_version, examples, problems)
            for name, objects in [("deploy/base", base)] + list(overlays.items()):
                check_modelfs_env(name, objects, modelfs, problems)

    if problems:
        print("deploy/ validation failed:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    print(f"deploy/ valid: {len(base)} base objects, {len(crds)} CRDs, {len(examples)} example objects, "
          f"overlays: {', '.join(overlays) or 'none'}")
    if generated:
        print(f"modelfs crd valid: {generated}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
