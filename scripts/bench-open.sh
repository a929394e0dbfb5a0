#!/usr/bin/env bash
# Where an open + read 4 KiB + close through the mount goes: the same loop natively and through
# the mount, next to operations that isolate the parts of it:
#   statfs         one FUSE round trip with an empty handler (never cached by the kernel);
#   stat           answered by the kernel from cached attributes (no round trip);
#   open+close     OPEN (synchronous) and RELEASE (asynchronous for the caller);
#   open+read+close  the above plus a 4 KiB read (passthrough: the kernel reads the blob;
#                  read-through: page cache, kept between opens).
# For each FUSE worker count in THREADS (default "1 2 8") and each passthrough mode, on one
# model of FILES (default 2000) files of 4 KiB; with PLACEMENTS="any one-cpu" (the default) each
# also with the daemon and the loop confined to one CPU (taskset -c 0): the difference is what
# the wakeups on the other CPU cost (two per round trip). Times are per operation, median of 7 passes
# over all files, from a Python loop (its own overhead is in the native figures too).
# Each case runs for every FUSE transport in TRANSPORTS (default "dev uring"): /dev/fuse, and FUSE
# over io_uring (per-CPU queues; the script turns on the fuse module parameter enable_uring for the
# run and restores it after). `serve` starts a keeper, which polls the io_uring rings with an SQ
# thread of its own (`modelfs_fuse_ring::kept`); "uring-own" is io_uring without a keeper
# (`--no-keeper`: the mount server's own rings, as before the keeper polled them). For kept rings
# the line ends with the CPU time the keeper's SQ thread used during the loop and during the 10 s
# idle that follows.
# Needs root. Usage: scripts/bench-open.sh [binary]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-}
FILES=${FILES:-2000}
THREADS=${THREADS:-"1 2 8"}
PLACEMENTS=${PLACEMENTS:-"any one-cpu"}
TRANSPORTS=${TRANSPORTS:-"dev uring"}
# shellcheck source=scripts/fuse-uring.sh
. scripts/fuse-uring.sh
if [[ " $TRANSPORTS " == *" uring"* ]]; then
    uring_param_on
fi
if [ -z "$BIN" ]; then
    cargo build --release --quiet
    BIN=target/release/modelfs
fi
PY=${PYTHON:-python3}
WORK=$(mktemp -d /var/tmp/modelfs-open.XXXXXX)
PORT=$((20000 + RANDOM % 20000))
PID=
cleanup() {
    if [ -n "$PID" ]; then kill -INT "$PID" 2>/dev/null && wait "$PID" 2>/dev/null || true; fi
    umount -l "$WORK/mnt" 2>/dev/null || true
    rm -rf "$WORK"
    uring_param_restore
}
trap cleanup EXIT
mkdir -p "$WORK/src" "$WORK/models"
for i in $(seq 1 "$FILES"); do head -c 4096 /dev/urandom >"$WORK/src/f$i"; done
cp -a "$WORK/src" "$WORK/native"
cat >"$WORK/models/m.yaml" <<YAML
apiVersion: ome.io/v1beta1
kind: ClusterBaseModel
metadata: {name: bench}
spec:
  storage: {storageUri: "local://$WORK/src", path: bench}
YAML

sq_ticks() { # CPU time (clock ticks) of the keeper's SQ threads (iou-sqp-*) of this run
    local total=0 t
    for t in /proc/[0-9]*/task/[0-9]*; do
        [[ "$(cat "$t/comm" 2>/dev/null)" == iou-sqp-* ]] || continue
        tr '\0' ' ' <"${t%/task/*}/cmdline" 2>/dev/null | grep -q -- "$WORK" || continue
        total=$((total + $(awk '{print $14 + $15}' "$t/stat" 2>/dev/null || echo 0)))
    done
    echo "$total"
}

loop() { # loop <dir> [taskset prefix...]: one line "statfs stat open+close open+read+close" in us
    local dir=$1
    shift
    "$@" "$PY" - "$dir" <<'PY'
import os, sys, time
d = sys.argv[1]
files = [os.path.join(d, f) for f in sorted(os.listdir(d))]
def per_op(op, rounds=7):
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        for f in files:
            op(f)
        samples.append((time.perf_counter() - t) / len(files))
    samples.sort()
    return samples[len(samples) // 2] * 1e6
def statfs(f): os.statvfs(d)
def stat(f): os.stat(f)
def open_close(f): os.close(os.open(f, os.O_RDONLY))
def open_read_close(f):
    fd = os.open(f, os.O_RDONLY)
    os.read(fd, 4096)
    os.close(fd)
for op in (stat, open_read_close):  # warm: dentries, attributes, page cache
    per_op(op, 1)
print(" ".join(f"{per_op(op):.2f}" for op in (statfs, stat, open_close, open_read_close)))
PY
}

echo "machine: $(nproc) cores, kernel $(uname -r); $FILES files of 4 KiB; per operation, us; load average $(cut -d' ' -f1-3 /proc/loadavg)"
for placement in $PLACEMENTS; do
    if [ "$placement" = one-cpu ]; then PIN=(taskset -c 0); else PIN=(); fi
    read -r N_SF N_ST N_OC N_ORC <<<"$(loop "$WORK/native" "${PIN[@]}")"
    printf '%-50s statfs %6s  stat %6s  open+close %6s  open+read+close %6s\n' "native, $placement" "$N_SF" "$N_ST" "$N_OC" "$N_ORC"
    for transport in $TRANSPORTS; do
    for mode in always never; do
        for threads in $THREADS; do
            EXTRA=()
            flag=$transport
            if [ "$transport" = uring-own ]; then EXTRA=(--no-keeper); flag=uring; fi
            "${PIN[@]}" "$BIN" serve --mount "$WORK/mnt" --state "$WORK/state" --models "$WORK/models" \
                --listen "127.0.0.1:$PORT" --passthrough "$mode" --fuse-threads "$threads" \
                --fuse-transport "$flag" "${EXTRA[@]}" >>"$WORK/daemon.log" 2>&1 &
            PID=$!
            for _ in $(seq 1 600); do
                if curl -sf "127.0.0.1:$PORT/v1/models" | grep -q '"status": *"Ready"'; then break; fi
                sleep 0.2
            done
            T0=$(sq_ticks); S0=$(date +%s.%N)
            read -r SF ST OC ORC <<<"$(loop "$WORK/mnt/bench" "${PIN[@]}")"
            T1=$(sq_ticks); S1=$(date +%s.%N)
            SQ=""
            if [ "$transport" = uring ]; then
                sleep 10
                T2=$(sq_ticks)
                HZ=$(getconf CLK_TCK)
                SQ=$(awk -v a="$T0" -v b="$T1" -v c="$T2" -v s="$S0" -v e="$S1" -v hz="$HZ" \
                    'BEGIN { printf "  SQ thread: %.0f%% of a CPU in the loop, %.1f%% idle", 100 * (b - a) / hz / (e - s), 100 * (c - b) / hz / 10 }')
            fi
            label="$transport, $([ "$mode" = always ] && echo passthrough || echo read-through), $threads threads, $placement"
            printf '%-50s statfs %6s  stat %6s  open+close %6s  open+read+close %6s  (%sx native)%s\n' \
                "$label" "$SF" "$ST" "$OC" "$ORC" "$(awk -v a="$ORC" -v b="$N_ORC" 'BEGIN { printf "%.1f", a / b }')" "$SQ"
            # SIGINT: the end of the mount (SIGTERM would hand it on to a successor).
            kill -INT "$PID"; wait "$PID" 2>/dev/null || true; PID=
        done
    done
    done
done
