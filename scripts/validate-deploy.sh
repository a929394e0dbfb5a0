#!/bin/sh
# Validates deploy/ offline. Needs Python 3; installs kubernetes-validate (which brings
# jsonschema and PyYAML) into .venv on first use. Extra arguments go to validate_deploy.py
# (for example --crds DIR, repeatable).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
venv="${VENV:-$root/.venv}"
if ! "$venv/bin/python" -c "import kubernetes_validate, jsonschema, yaml" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet kubernetes-validate
fi
exec "$venv/bin/python" "$root/scripts/validate_deploy.py" "$@"
