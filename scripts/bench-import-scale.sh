#!/usr/bin/env bash
# Time until N local:// models of 10 small files each are all Ready, with the reconciler's
# bookkeeping (single flight, the path rule, the mapping) under load: N/2 source directories,
# each used by one AlwaysDownload model and one ReuseIfExists model (which waits for the
# other's import, then maps onto it), all in the models directory before the daemon starts.
# Prints the seconds to all Ready and the daemon's CPU seconds. Needs root.
# Usage: scripts/bench-import-scale.sh [models] [binary]
# The binary defaults to a release build (built here).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1000}
BIN=${2:-}
if [ -z "$BIN" ]; then
    cargo build --release --quiet --bin modelfs
    BIN=target/release/modelfs
fi
WORK=$(mktemp -d /var/tmp/modelfs-scale.XXXXXX)
PORT=$((20000 + RANDOM % 20000))
PID=
cleanup() {
    if [ -n "$PID" ]; then kill -INT "$PID" 2>/dev/null && wait "$PID" 2>/dev/null || true; fi
    umount -l "$WORK/mnt" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

python3 - "$WORK" "$N" <<'PY'
import os, sys
work, n = sys.argv[1], int(sys.argv[2])
os.makedirs(os.path.join(work, "models"))
sources = (n + 1) // 2
for s in range(sources):
    d = os.path.join(work, "src", f"s{s:05}")
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"model_type": "tiny", "seed": %d}\n' % s)
    for k in range(9):
        with open(os.path.join(d, f"part-{k}.bin"), "wb") as f:
            f.write(f"{s}:{k}:".encode() * 64)
per_file = 100
for start in range(0, n, per_file):
    docs = []
    for i in range(start, min(n, start + per_file)):
        policy = "ReuseIfExists" if i % 2 else "AlwaysDownload"
        docs.append(
            "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\n"
            f"metadata: {{name: m{i:05}}}\n"
            f"spec: {{storage: {{storageUri: 'local://{work}/src/s{i // 2:05}', "
            f"downloadPolicy: {policy}}}}}\n")
    with open(os.path.join(work, "models", f"m-{start // per_file:03}.yaml"), "w") as f:
        f.write("---\n".join(docs))
PY

start=$(date +%s.%N)
"$BIN" serve --mount "$WORK/mnt" --state "$WORK/state" --models "$WORK/models" \
    --listen "127.0.0.1:$PORT" >"$WORK/log" 2>&1 &
PID=$!
ready() {
    curl -sf "127.0.0.1:$PORT/v1/models" 2>/dev/null | python3 -c "
import json, sys
try:
    d = json.load(sys.stdin)
except ValueError:
    sys.exit(1)
failed = [k for k, v in d.items() if v.get('status') == 'Failed']
if failed:
    print('failed:', failed[:3], d[failed[0]].get('reason'), file=sys.stderr); sys.exit(2)
sys.exit(0 if sum(v.get('status') == 'Ready' for v in d.values()) >= $N else 1)"
}
while true; do
    rc=0; ready || rc=$?
    [ "$rc" = 0 ] && break
    [ "$rc" = 2 ] && exit 1
    kill -0 "$PID" 2>/dev/null || { echo "daemon exited" >&2; tail "$WORK/log" >&2; exit 1; }
    sleep 0.25
done
end=$(date +%s.%N)
HZ=$(getconf CLK_TCK)
cpu=$(awk '{print $14 + $15}' "/proc/$PID/stat")
python3 -c "print(f'models: $N x 10 files, all Ready after {$end - $start:.1f} s, daemon CPU {$cpu / $HZ:.1f} s')"
