#!/usr/bin/env bash
# Idle CPU with many models: N local:// models (default 2,000 in 40 manifest files of 50, from 20
# small source directories, half AlwaysDownload and half ReuseIfExists), all Ready, then the
# daemon's user + system CPU ticks (/proc/<pid>/stat) over a quiet interval (default 30 s).
# Needs root. Usage: scripts/bench-idle.sh [models] [seconds] [binary]
# The binary defaults to a release build (built here); pass target/debug/modelfs to measure a
# debug build.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-2000}
SECS=${2:-30}
BIN=${3:-}
if [ -z "$BIN" ]; then
    cargo build --release --quiet
    BIN=target/release/modelfs
fi
WORK=$(mktemp -d /var/tmp/modelfs-idle.XXXXXX)
PORT=$((20000 + RANDOM % 20000))
PID=
cleanup() {
    [ -n "$PID" ] && kill -INT "$PID" 2>/dev/null && wait "$PID" 2>/dev/null || true
    umount -l "$WORK/mnt" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

mkdir -p "$WORK/models"
python3 - "$WORK" "$N" <<'PY'
import os, sys
work, n = sys.argv[1], int(sys.argv[2])
for s in range(20):
    d = os.path.join(work, "src", f"s{s:02}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"model_type": "tiny", "seed": %d}\n' % s)
    with open(os.path.join(d, "weights.bin"), "wb") as f:
        f.write(bytes([s]) * 4096)
# AlwaysDownload models in models/, ReuseIfExists ones in reuse/ (added once the first half is
# Ready, so they map onto existing copies: the benchmark is about idle, not import order).
per_file = 100
for start in range(0, n, per_file):
    docs = []
    for i in range(start, min(n, start + per_file)):
        policy = "ReuseIfExists" if i % 2 else "AlwaysDownload"
        docs.append((policy,
            "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\n"
            f"metadata: {{name: m{i:05}}}\n"
            f"spec: {{storage: {{storageUri: 'local://{work}/src/s{(i // 2) % 20:02}', "
            f"downloadPolicy: {policy}}}}}\n"
        ))
    for policy, sub in (("AlwaysDownload", "models"), ("ReuseIfExists", "reuse")):
        os.makedirs(os.path.join(work, sub), exist_ok=True)
        with open(os.path.join(work, sub, f"{policy}-{start // per_file:03}.yaml"), "w") as f:
            f.write("---\n".join(d for p, d in docs if p == policy))
PY

"$BIN" serve --mount "$WORK/mnt" --state "$WORK/state" --models "$WORK/models" \
    --listen "127.0.0.1:$PORT" >"$WORK/log" 2>&1 &
PID=$!
wait_ready() {
    for _ in $(seq 1 12000); do
        if curl -sf "127.0.0.1:$PORT/v1/models" 2>/dev/null | python3 -c "
import json, sys
d = json.load(sys.stdin)
ready = sum(1 for v in d.values() if v.get('status') == 'Ready')
sys.exit(0 if ready >= $1 else 1)" 2>/dev/null; then return; fi
        sleep 0.5
    done
    echo "timeout waiting for $1 Ready models" >&2; exit 1
}
wait_ready $(((N + 1) / 2))
mv "$WORK"/reuse/*.yaml "$WORK/models/"
wait_ready "$N"
# Let start-up work (GC passes, the first rescans) settle.
sleep 15
ticks() { awk '{print $14 + $15}' "/proc/$PID/stat"; }
HZ=$(getconf CLK_TCK)
before=$(ticks)
sleep "$SECS"
after=$(ticks)
python3 -c "
ticks = $after - $before
print(f'models: $N, interval: ${SECS} s, CPU ticks: {ticks} (HZ $HZ), CPU: {100 * ticks / $HZ / $SECS:.2f}% of one core')"
echo "log lines during the run: $(wc -l <"$WORK/log")"
