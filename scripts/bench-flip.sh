#!/usr/bin/env bash
# Flip latency: T-02 (a model with its own copy switches to ReuseIfExists onto another holder)
# for models of 10, 1,000 and 10,000 files, measured inside the daemon from the desired-state
# change to the new mapping being live (histogram modelfs_mapping_update_seconds), plus bytes
# downloaded and on disk; next to the symlink design's cost for a change that re-downloads
# (delete the tree, fetch it again; here a local copy, a lower bound for a download).
# Needs root. Usage: scripts/bench-flip.sh [reps] [binary]
# The binary defaults to a release build (built here). SIZES="10000" measures one size only.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-5}
BIN=${2:-}
if [ -z "$BIN" ]; then
    cargo build --release --quiet --bin modelfs
    BIN=target/release/modelfs
fi
WORK=$(mktemp -d /var/tmp/modelfs-flip.XXXXXX)
PORT=$((20000 + RANDOM % 20000))
PID=
cleanup() {
    [ -n "$PID" ] && kill -INT "$PID" 2>/dev/null && wait "$PID" 2>/dev/null || true
    umount -l "$WORK/mnt" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

metric() { curl -sf "127.0.0.1:$PORT/metrics" | awk -v m="$1" '$1 == m {print $2}'; }
wait_for() {
    for _ in $(seq 1 6000); do
        if curl -sf "127.0.0.1:$PORT/v1/models" | python3 -c "import json,sys; d=json.load(sys.stdin); sys.exit(0 if ($1) else 1)"; then return; fi
        sleep 0.05
    done
    echo "timeout waiting for: $1" >&2; exit 1
}

echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, kernel $(uname -r)"
printf '%-7s %-10s %-14s %-14s %-12s %-16s %-14s\n' files bytes flip_median flip_max fetched on_disk_after symlink_redo
for N in ${SIZES:-10 1000 10000}; do
    SRC=$WORK/src-$N
    mkdir -p "$SRC"
    python3 - "$SRC" "$N" <<'PY'
import os, sys
root, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    d = os.path.join(root, f"d{i // 100:03}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"f{i:05}.bin"), "wb") as f:
        f.write(os.urandom(4096))
PY
    BYTES=$(du -sb "$SRC" | cut -f1)
    samples=()
    for rep in $(seq 1 "$REPS"); do
        rm -rf "$WORK/state" "$WORK/models"; mkdir -p "$WORK/models"
        cat > "$WORK/models/m.yaml" <<YAML
apiVersion: ome.io/v1beta1
kind: ClusterBaseModel
metadata: {name: holder}
spec: {storage: {storageUri: "local://$SRC", downloadPolicy: AlwaysDownload}}
---
apiVersion: ome.io/v1beta1
kind: BaseModel
metadata: {name: m, namespace: ns}
spec: {storage: {storageUri: "local://$SRC", downloadPolicy: AlwaysDownload}}
YAML
        "$BIN" serve --mount "$WORK/mnt" --state "$WORK/state" --models "$WORK/models" \
            --listen "127.0.0.1:$PORT" --gc-grace-secs 1 >"$WORK/daemon.log" 2>&1 &
        PID=$!
        wait_for "all(e['status']=='Ready' for e in d.values()) and len(d)==2"
        c0=$(metric modelfs_mapping_update_seconds_count); s0=$(metric modelfs_mapping_update_seconds_sum)
        f0=$(curl -sf "127.0.0.1:$PORT/metrics" | awk '/^modelfs_fetched_bytes_total/ {s+=$2} END {print s+0}')
        sed -i '0,/AlwaysDownload/! s/AlwaysDownload/ReuseIfExists/' "$WORK/models/m.yaml"
        wait_for "'clusterbasemodel.holder' in d['ns.basemodel.m']['config']['artifact']['parentPath']"
        c1=$(metric modelfs_mapping_update_seconds_count); s1=$(metric modelfs_mapping_update_seconds_sum)
        f1=$(curl -sf "127.0.0.1:$PORT/metrics" | awk '/^modelfs_fetched_bytes_total/ {s+=$2} END {print s+0}')
        samples+=("$(python3 -c "print(($s1 - $s0) / max(1, $c1 - $c0))")")
        FETCHED=$(python3 -c "print(int($f1 - $f0))")
        # The released copy goes after the 1 s grace: wait for it (a `du` while it goes fails).
        for _ in $(seq 1 600); do
            [ "$(find "$WORK/state/stores" -mindepth 1 -maxdepth 1 | wc -l)" -le 1 ] && break
            sleep 0.1
        done
        ONDISK=$(du -sb "$WORK/state/stores" | cut -f1)
        kill -INT "$PID"; wait "$PID" || true; PID=
    done
    # The symlink design's re-download: delete the tree, fetch it again.
    REDO=$( { /usr/bin/time -f %e bash -c "rm -rf '$WORK/copy' && cp -r '$SRC' '$WORK/copy' && sync" ; } 2>&1 )
    read -r MED MAX < <(printf '%s\n' "${samples[@]}" | sort -g | awk '{a[NR]=$1} END {printf "%.6f %.6f\n", a[int((NR+1)/2)], a[NR]}')
    printf '%-7s %-10s %-14s %-14s %-12s %-16s %-14s\n' "$N" "$BYTES" "${MED}s" "${MAX}s" "$FETCHED" "$ONDISK" "${REDO}s+${BYTES}B"
done
