#!/usr/bin/env bash
# Read-path benchmark: the same large file read natively and through the mount, cold and warm,
# with passthrough and with read-through; then stat and open-read-close of many small files.
# Needs root (mount, drop_caches). Usage: scripts/bench-read.sh [size_mib] [small_files]
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE_MIB=${1:-2048}
SMALL=${2:-2000}
WORK=$(mktemp -d /var/tmp/modelfs-bench.XXXXXX)
PORT=$((20000 + RANDOM % 20000))
BIN=target/release/modelfs
cargo build --release --quiet
cleanup() {
    [ -n "${PID:-}" ] && kill -INT "$PID" 2>/dev/null && wait "$PID" 2>/dev/null || true
    umount -l "$WORK/mnt" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

mkdir -p "$WORK/src/small" "$WORK/models"
head -c $((SIZE_MIB << 20)) /dev/urandom > "$WORK/src/large.bin"
for i in $(seq 1 "$SMALL"); do head -c 4096 /dev/urandom > "$WORK/src/small/f$i"; done
cat > "$WORK/models/m.yaml" <<YAML
apiVersion: ome.io/v1beta1
kind: ClusterBaseModel
metadata: {name: bench}
spec:
  storage: {storageUri: "local://$WORK/src", path: bench}
YAML

start() {
    "$BIN" serve --mount "$WORK/mnt" --state "$WORK/state" --models "$WORK/models" \
        --listen "127.0.0.1:$PORT" --passthrough "$1" >"$WORK/daemon-$1.log" 2>&1 &
    PID=$!
    for _ in $(seq 1 600); do
        if curl -sf "127.0.0.1:$PORT/v1/models" | grep -q '"status": *"Ready"'; then return; fi
        sleep 0.5
    done
    echo "daemon not ready" >&2; cat "$WORK/daemon-$1.log" >&2; exit 1
}
stop() { kill -INT "$PID"; wait "$PID" || true; PID=; }

# GB/s of one sequential dd read (1 MiB blocks).
readrate() {
    dd if="$1" of=/dev/null bs=1M 2>&1 | awk '/copied/ {
        for (i = 1; i <= NF; i++) if ($i ~ /^s,?$/) secs = $(i-1);
        print sprintf("%.2f", ($1 / 1e9) / secs) }'
}
cold() { sync; echo 3 > /proc/sys/vm/drop_caches; readrate "$1"; }
# Warm: best of three runs after one warm-up pass (steady state of the page cache).
warm() { readrate "$1" >/dev/null; for _ in 1 2 3; do readrate "$1"; done | sort -g | tail -n 1; }

echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, kernel $(uname -r)"
echo "file: ${SIZE_MIB} MiB; small files: $SMALL x 4 KiB"
for mode in always never; do
    start "$mode"
    if [ -z "${NATIVE:-}" ]; then
        # Native baseline: the very blob the mount serves, read directly (same bytes, same place
        # on disk, same page cache).
        NATIVE=$(find "$WORK/state/stores" -path '*/blobs/*' -size +1G | head -n 1)
        n_cold=$(cold "$NATIVE"); n_warm=$(warm "$NATIVE")
        echo "native            cold ${n_cold} GB/s  warm ${n_warm} GB/s"
    fi
    M=$WORK/mnt/bench/large.bin
    m_cold=$(cold "$M"); m_warm=$(warm "$M")
    label=$([ "$mode" = always ] && echo passthrough || echo read-through)
    echo "$label $(printf '%*s' $((17 - ${#label})) '')cold ${m_cold} GB/s  warm ${m_warm} GB/s  ratio cold $(echo "$m_cold $n_cold" | awk '{printf "%.2f", $1/$2}') warm $(echo "$m_warm $n_warm" | awk '{printf "%.2f", $1/$2}')"
    MODELFS_BENCH_NATIVE="$WORK/src/small" MODELFS_BENCH_MOUNT="$WORK/mnt/bench/small" \
        cargo bench --quiet --bench fs_ops 2>/dev/null | sed "s/^/metadata ($label) /"
    stop
done
