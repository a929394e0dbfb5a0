#!/usr/bin/env bash
# The mount server at N models: what an import costs it per mapping applied, and how long a
# SIGKILLed mount server takes to serve a model file again.
#
# N local:// models (default 1,000) of F small files each (default 10; every model its own
# content, so N artifacts and N stores) are imported by `modelfs serve` (the mount server with
# its agent as a child). Printed:
# * import: time to all N Ready; the mount server's CPU time (user + system, its own, not the
#   agent's) during the import, the agent's count of mapping changes
#   (`modelfs_mapping_changes_total`, each sent to the server at most once: the agent coalesces
#   changes made while an apply is in flight) and the CPU time per change; with a build that
#   logs each apply at debug level (`mapping applied`, `elapsed_us`), the number of applies the
#   server logged and their mean, median and largest duration;
# * restart: RESTARTS times (default 3), SIGKILL of the mount server (its agent dies with it)
#   and a new `serve` on the same state; the time from the start of the new process until a
#   file of the last model reads (`head -c 1`), each and their median, and after the last one
#   the time until all N are Ready again. Warm, then cold (`drop_caches` before each restart,
#   as after a node's reboot or when the page cache was taken by other work).
# With OTHER_BIN=<binary> the restarts are timed again with that binary on the same state (no
# import: the persisted mapping and the stores are the ones the first binary wrote).
# PERF=<file> records the first restart's mount server with `perf record -g` into that file.
#
# Needs root. Usage: scripts/bench-server-restart.sh [models] [files] [binary]
# The binary defaults to a release build (built here). Copy it elsewhere first if a rebuild may
# happen during the run.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1000}
F=${2:-10}
BIN=${3:-}
RESTARTS=${RESTARTS:-3}
if [ -z "$BIN" ]; then
    cargo build --release --quiet
    BIN=target/release/modelfs
fi
BIN=$(realpath "$BIN")
WORK=$(mktemp -d /var/tmp/modelfs-restart.XXXXXX)
PORT=$((20000 + RANDOM % 20000))
PID=
stop() {
    [ -n "$PID" ] || return 0
    kill -TERM "$PID" 2>/dev/null || true
    wait "$PID" 2>/dev/null || true
    PID=
}
cleanup() {
    # The end of the mount (SIGINT), not a hand-on to the keeper.
    if [ -n "$PID" ]; then kill -INT "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; PID=; fi
    umount -l "$WORK/mnt" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'; }

python3 - "$WORK" "$N" "$F" <<'PY'
import os, sys
work, n, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(os.path.join(work, "models"))
for start in range(0, n, 100):
    docs = []
    for i in range(start, min(n, start + 100)):
        d = os.path.join(work, "src", f"m{i:05}")
        os.makedirs(os.path.join(d, "sub"))
        for j in range(files):
            name = f"sub/f{j:04}.bin" if j % 2 else f"f{j:04}.bin"
            with open(os.path.join(d, name), "wb") as f:
                f.write(b"model %d file %d\n" % (i, j))
        docs.append("apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\n"
                    f"metadata: {{name: m{i:05}}}\n"
                    f"spec: {{storage: {{storageUri: 'local://{d}', path: m{i:05}}}}}\n")
    with open(os.path.join(work, "models", f"m{start // 100:03}.yaml"), "w") as f:
        f.write("---\n".join(docs))
PY
PROBE="$WORK/mnt/m$(printf %05d $((N - 1)))/f0000.bin"

start() { # start <binary> [wrapper...]
    local bin=$1
    shift
    RUST_LOG=${RUST_LOG:-info,modelfs_mount::server=debug} "$@" "$bin" serve --mount "$WORK/mnt" \
        --state "$WORK/state" --models "$WORK/models" --listen "127.0.0.1:$PORT" \
        >>"$WORK/log" 2>&1 &
    PID=$!
}
# The mount server's process (below a wrapper, if any): the one that runs `serve` on this state.
server_pid() {
    local p
    for p in /proc/[0-9]*; do
        tr '\0' ' ' 2>/dev/null <"$p/cmdline" | grep -q -- "serve --mount $WORK/mnt " || continue
        [ "$(readlink "$p/exe" 2>/dev/null)" = "$1" ] || continue
        echo "${p#/proc/}"
        return
    done
}
metric() {
    curl -sf "127.0.0.1:$PORT/metrics" 2>/dev/null | awk -v m="$1" '$1 ~ "^"m { s += $NF } END { print s + 0 }'
}
ready_count() { metric 'modelfs_models\{.*status="Ready"'; }
wait_ready() {
    local t0=$1
    while [ "$(ready_count)" -lt "$N" ]; do
        sleep 0.2
        if [ "$(awk -v a="$t0" -v b="$(now)" 'BEGIN { print (b - a > 3600) }')" = 1 ]; then
            echo "not all Ready after an hour" >&2
            exit 1
        fi
    done
}
cpu_s() { # user + system seconds of a process (not its children)
    awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); printf "%.2f", ($12 + $13) / hz }' "/proc/$1/stat"
}
median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

echo "$N models x $F files; binary $BIN; $(nproc) cores, kernel $(uname -r); load average $(cut -d' ' -f1-3 /proc/loadavg)"
: >"$WORK/log"
t=$(now)
start "$BIN"
wait_ready "$t"
IMPORT=$(since "$t")
SPID=$(server_pid "$BIN")
CPU=$(cpu_s "$SPID")
CHANGES=$(metric 'modelfs_mapping_changes_total')
echo "import: all $N Ready after $IMPORT s; mount server CPU $CPU s over $CHANGES mapping changes" \
    "($(awk -v c="$CPU" -v n="$CHANGES" 'BEGIN { printf "%.2f", n ? c * 1000 / n : 0 }') ms a change)"
grep 'mapping applied' "$WORK/log" | sed -n 's/.*elapsed_us=\([0-9]*\).*/\1/p' >"$WORK/applies" || true
if [ -s "$WORK/applies" ]; then
    # By phase: checking entries, the core's swap, kernel invalidations, persisting.
    echo "  mean by phase (ms): $(grep 'mapping applied' "$WORK/log" | awk '{
        for (i = 1; i <= NF; i++) { split($i, kv, "="); if (kv[1] ~ /_us$/) { s[kv[1]] += kv[2] } }
        n++ } END { printf "check %.2f, swap %.2f, invalidate %.2f, persist %.2f", s["check_us"] / n / 1000,
        s["swap_us"] / n / 1000, s["invalidate_us"] / n / 1000, s["persist_us"] / n / 1000 }')"
    echo "  applies logged by the mount server: $(wc -l <"$WORK/applies"), mean $(awk '{ s += $1 } END { printf "%.2f", s / NR / 1000 }' "$WORK/applies") ms," \
        "median $(median <"$WORK/applies" | awk '{ printf "%.2f", $1 / 1000 }') ms, largest $(sort -g "$WORK/applies" | tail -n 1 | awk '{ printf "%.2f", $1 / 1000 }') ms;" \
        "the last 100: mean $(tail -n 100 "$WORK/applies" | awk '{ s += $1 } END { printf "%.2f", s / NR / 1000 }') ms"
fi

restarts() { # restarts <binary> <warm|cold>
    local bin=$1 mode=$2 i times=() t s
    for i in $(seq 1 "$RESTARTS"); do
        kill -KILL "$(server_pid "$bin" || echo "$PID")" 2>/dev/null || true
        wait "$PID" 2>/dev/null || true
        PID=
        if [ "$mode" = cold ]; then sync; echo 3 >/proc/sys/vm/drop_caches; fi
        t=$(now)
        if [ "$i" = 1 ] && [ "$mode" = warm ] && [ -n "${PERF:-}" ]; then
            start "$bin" perf record -q -g -o "$PERF" --
        else
            start "$bin"
        fi
        until head -c 1 "$PROBE" >/dev/null 2>&1; do sleep 0.01; done
        s=$(since "$t")
        times+=("$s")
        if [ "$i" = "$RESTARTS" ]; then
            wait_ready "$t"
            echo "restart ($bin, $mode): a file served after ${times[*]} s (median $(printf '%s\n' "${times[@]}" | median) s); all $N Ready after the last one $(since "$t") s"
        fi
    done
}
restarts "$BIN" warm
restarts "$BIN" cold
if [ -n "${OTHER_BIN:-}" ]; then
    kill -KILL "$(server_pid "$BIN")" 2>/dev/null || true
    OTHER_BIN=$(realpath "$OTHER_BIN")
    restarts "$OTHER_BIN" warm
    restarts "$OTHER_BIN" cold
fi
echo "load average $(cut -d' ' -f1-3 /proc/loadavg)"
