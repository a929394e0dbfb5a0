#!/usr/bin/env bash
# Import throughput and memory: M local:// models of F small files each (default 1 x 100,000),
# imported by a running daemon until all are Ready, against the native baseline in the same run:
# `cp -a` of the same source trees plus `sync`. Page cache dropped (after a sync) before each.
# Prints wall seconds, the ratio, and the daemon's RSS: peak during the import (VmHWM) and at
# steady state 10 s after the last model turned Ready.
#
# Needs root. Usage: scripts/bench-import.sh [models] [files-per-model] [mode] [binary]
#   mode: 0644 (default: files owned by root and writable by their owner: copied into the store)
#         or 0444 (read-only for everyone and owned by root: hard-linked, see crates/agent/src/source/local.rs)
#   binary defaults to a release build (built here).
# Files are 1 to 100 bytes (about 50 on average), 1,000 per directory, every model its own
# source directory with its own bytes; models are ClusterBaseModels in manifest files of 50.
set -euo pipefail
cd "$(dirname "$0")/.."
M=${1:-1}
F=${2:-100000}
MODE=${3:-0644}
BIN=${4:-}
if [ -z "$BIN" ]; then
    cargo build --release --quiet --bin modelfs
    BIN=target/release/modelfs
fi
WORK=$(mktemp -d /var/tmp/modelfs-import.XXXXXX)
PORT=$((20000 + RANDOM % 20000))
PID=
cleanup() {
    [ -n "$PID" ] && kill -INT "$PID" 2>/dev/null && wait "$PID" 2>/dev/null || true
    umount -l "$WORK/mnt" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

python3 - "$WORK" "$M" "$F" "$MODE" <<'PY'
import os, random, sys
work, m, f, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4], 8)
rng = random.Random(12)
for i in range(m):
    root = os.path.join(work, "src", f"m{i:05}")
    for j in range(f):
        d = os.path.join(root, f"d{j // 1000:03}")
        if j % 1000 == 0:
            os.makedirs(d, exist_ok=True)
        p = os.path.join(d, f"f{j:06}.txt")
        with open(p, "wb") as out:
            out.write(b"%d/%d " % (i, j) + bytes(rng.randrange(97, 123) for _ in range(rng.randrange(1, 90))))
        os.chmod(p, mode)
os.makedirs(os.path.join(work, "models"))
os.makedirs(os.path.join(work, "pending"))
for start in range(0, m, 50):
    docs = [
        "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\n"
        f"metadata: {{name: m{i:05}}}\n"
        f"spec: {{storage: {{storageUri: 'local://{work}/src/m{i:05}'}}}}\n"
        for i in range(start, min(m, start + 50))
    ]
    with open(os.path.join(work, "pending", f"models-{start // 50:04}.yaml"), "w") as out:
        out.write("---\n".join(docs))
PY
BYTES=$(find "$WORK/src" -type f -printf '%s\n' | awk '{s += $1} END {print s}')
echo "tree: $M models x $F files, $BYTES bytes, mode $MODE; kernel $(uname -r), $(nproc) cores"

drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }

# Native baseline.
drop_caches
t0=$(date +%s.%N)
cp -a "$WORK/src" "$WORK/native"
sync
t1=$(date +%s.%N)
NATIVE=$(python3 -c "print(f'{$t1 - $t0:.2f}')")
rm -rf "$WORK/native"
echo "cp -a + sync: $NATIVE s"

# modelfs.
drop_caches
"$BIN" serve --mount "$WORK/mnt" --state "$WORK/state" --models "$WORK/models" \
    --listen "127.0.0.1:$PORT" >"$WORK/log" 2>&1 &
PID=$!
for _ in $(seq 1 600); do
    curl -sf "127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && break
    sleep 0.1
done
rss() { awk -v k="$1:" '$1 == k {print $2}' "/proc/$PID/status"; }
BEFORE_KB=$(rss VmRSS)
t0=$(date +%s.%N)
mv "$WORK"/pending/*.yaml "$WORK/models/"
ready=0
for _ in $(seq 1 36000); do
    ready=$(curl -sf "127.0.0.1:$PORT/v1/models" 2>/dev/null | python3 -c "
import json, sys
d = json.load(sys.stdin)
print(sum(1 for v in d.values() if v.get('status') == 'Ready'))" 2>/dev/null || echo 0)
    [ "$ready" -ge "$M" ] && break
    sleep 0.2
done
t1=$(date +%s.%N)
[ "$ready" -ge "$M" ] || { echo "timeout: $ready of $M Ready" >&2; tail -5 "$WORK/log" >&2; exit 1; }
MODELFS=$(python3 -c "print(f'{$t1 - $t0:.2f}')")
PEAK_KB=$(rss VmHWM)
sleep 10
STEADY_KB=$(rss VmRSS)
linked=$(curl -sf "127.0.0.1:$PORT/metrics" | awk '$1 ~ /^modelfs_local_linked_files_total/ {s += $2} END {print s + 0}')
python3 -c "
n, b = $M * $F, $BYTES
print(f'modelfs import until all Ready: $MODELFS s ({$MODELFS / $NATIVE:.2f}x cp -a + sync), {n / $MODELFS:,.0f} files/s, hard-linked files: $linked')
print(f'RSS: before {$BEFORE_KB / 1024:.1f} MiB, peak during import {$PEAK_KB / 1024:.1f} MiB, steady {$STEADY_KB / 1024:.1f} MiB')
print(f'steady RSS above the empty daemon per file: {($STEADY_KB - $BEFORE_KB) * 1024 / n:.0f} bytes')"
