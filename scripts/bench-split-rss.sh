#!/usr/bin/env bash
# Memory of the two processes of `modelfs serve`: N local:// models (default 1,000) of F small
# files each (default 100; every model its own content, so N artifacts and N stores), all
# AlwaysDownload. Prints VmRSS of the mount server and of the agent right after every model is
# Ready (after importing them), then again after a restart of both (records and the persisted
# mapping loaded, nothing imported), then after the agent alone is killed and restarted.
# Needs root. Usage: scripts/bench-split-rss.sh [models] [files] [binary]
# The binary defaults to a release build (built here); pass target/debug/modelfs to measure a
# debug build.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1000}
F=${2:-100}
BIN=${3:-}
if [ -z "$BIN" ]; then
    cargo build --release --quiet
    BIN=target/release/modelfs
fi
WORK=$(mktemp -d /var/tmp/modelfs-rss.XXXXXX)
PORT=$((20000 + RANDOM % 20000))
PID=
cleanup() {
    [ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null || true
    umount -l "$WORK/mnt" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

python3 - "$WORK" "$N" "$F" <<'PY'
import os, sys
work, n, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(os.path.join(work, "models"), exist_ok=True)
for start in range(0, n, 100):
    docs = []
    for i in range(start, min(n, start + 100)):
        d = os.path.join(work, "src", f"m{i:05}")
        os.makedirs(os.path.join(d, "sub"), exist_ok=True)
        for j in range(files):
            name = f"sub/f{j:03}.txt" if j % 2 else f"f{j:03}.bin"
            with open(os.path.join(d, name), "wb") as f:
                f.write((b"model %d file %d\n" % (i, j)) * (8 + j % 50))
        docs.append("apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\n"
                    f"metadata: {{name: m{i:05}}}\n"
                    f"spec: {{storage: {{storageUri: 'local://{d}', downloadPolicy: AlwaysDownload}}}}\n")
    with open(os.path.join(work, "models", f"m{start // 100:03}.yaml"), "w") as f:
        f.write("---\n".join(docs))
PY

start() {
    "$BIN" serve --mount "$WORK/mnt" --state "$WORK/state" --models "$WORK/models" \
        --listen "127.0.0.1:$PORT" >>"$WORK/log" 2>&1 &
    PID=$!
}
ready_count() {
    curl -s "127.0.0.1:$PORT/v1/models" 2>/dev/null | python3 -c '
import json, sys
try:
    d = json.load(sys.stdin)
except Exception:
    print(0); sys.exit()
print(sum(1 for v in d.values() if v.get("status") == "Ready"))'
}
wait_ready() {
    local t0=$SECONDS
    while [ "$(ready_count)" -lt "$N" ]; do
        sleep 1
        if [ $((SECONDS - t0)) -gt 3600 ]; then echo "not Ready after an hour" >&2; exit 1; fi
    done
    echo "  all $N Ready after $((SECONDS - t0)) s"
}
agent_pid() { cat /proc/"$PID"/task/*/children | tr ' ' '\n' | grep -v '^$' | head -1; }
rss() { awk '/VmRSS/ {printf "%.1f MiB", $2 / 1024}' /proc/"$1"/status; }
report() {
    sleep 2
    local a
    a=$(agent_pid)
    echo "  $1: mount server $(rss "$PID"), agent $(rss "$a")"
}

echo "$N models x $F files ($BIN)"
start
wait_ready
report "after importing"
kill -TERM "$PID"; wait "$PID" || true
start
wait_ready
report "after a restart of both"
old=$(agent_pid)
kill -KILL "$old"
while [ "$(agent_pid)" = "$old" ] || [ -z "$(agent_pid)" ]; do sleep 0.2; done
wait_ready
report "after the agent alone was killed and restarted"
