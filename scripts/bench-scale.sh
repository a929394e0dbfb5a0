#!/usr/bin/env bash
# Scale benchmark: N local:// models x M small files, with the native baseline measured in the
# same run on the same disk.
#
# Native: `cp -a` of the source tree + `sync`; `find` (names) and `find -printf %s` (names and
# sizes: one stat per file) over the copy, cold (caches dropped) and warm; stat and
# open + read 4 KiB + close per file (a Python loop over a sample of the files, warm; the
# loop's own cost is in both figures).
# modelfs: time from start to all N models Ready, peak and steady RSS, the same walks and file
# operations through the mount (the first walk after the mount is the cold one), the size of
# the status document and the latency of `GET /v1/models` (p50 and p99 of GETS requests), RSS of
# the mount server and of the agent (`serve` runs the agent as its child), then SIGKILL of the
# agent alone and the time until the restarted agent reports all N Ready, then SIGKILL of the
# mount server (the agent dies with it) and the time from the restart until a model file is
# served again and until all N are Ready.
#
# Needs root (mount, drop_caches). Usage:
#   scripts/bench-scale.sh [models] [files_per_model] [binary]
# Environment: BASE_BIN=<older modelfs binary> also measures the walks and file operations with
# that binary on the same state (a restart, no import) for a before/after comparison;
# SAMPLE=<files> caps the files timed per operation (default 2000, evenly spread);
# RT=1 (the default) runs the walks and per-file loops, and the daemon while they run, at
# real-time priority (chrt -f 10), so that other work on a shared machine does not blur them;
# imports and restarts run at normal priority (the load average is printed);
# GETS=<n> requests of `GET /v1/models` for its latency percentiles (default 100);
# IMPORT_TIMEOUT=<seconds> gives up waiting for Ready (default 3600; the figures so far are
# printed), or with PARTIAL=1 goes on with the models Ready by then.
# FUSE_TRANSPORT=auto|dev|uring (default auto) is passed as --fuse-transport; with uring the
# script turns on the fuse module parameter enable_uring for the run and restores it after.
# The binary defaults to a release build (built here).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1000}
M=${2:-100}
BIN=${3:-}
SAMPLE=${SAMPLE:-2000}
GETS=${GETS:-100}
IMPORT_TIMEOUT=${IMPORT_TIMEOUT:-3600}
if [ -z "$BIN" ]; then
    cargo build --release --quiet
    BIN=target/release/modelfs
fi
WORK=$(mktemp -d /var/tmp/modelfs-scale.XXXXXX)
PORT=$((20000 + RANDOM % 20000))
PID=
stop_daemon() { # SIGTERM, then SIGKILL if the daemon has not exited after 30 s
    kill -INT "$PID" 2>/dev/null || true
    for _ in $(seq 1 150); do kill -0 "$PID" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$PID" 2>/dev/null; then
        echo "daemon still running 30 s after SIGTERM; SIGKILL" >&2
        kill -9 "$PID" 2>/dev/null || true
    fi
    wait "$PID" 2>/dev/null || true
    PID=
}
FUSE_TRANSPORT=${FUSE_TRANSPORT:-auto}
# shellcheck source=scripts/fuse-uring.sh
. scripts/fuse-uring.sh
if [ "$FUSE_TRANSPORT" = uring ]; then
    uring_param_on
fi
cleanup() {
    if [ -n "$PID" ]; then stop_daemon; fi
    umount -l "$WORK/mnt" 2>/dev/null || true
    rm -rf "$WORK"
    uring_param_restore
}
trap cleanup EXIT

RT=${RT:-1}
rt() { if [ "$RT" = 1 ]; then chrt -f 10 "$@"; else "$@"; fi; }
rt_daemon() { if [ "$RT" = 1 ]; then chrt -f -a -p 10 "$PID" >/dev/null; fi; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "-" }'; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
rss_mib() { # rss_mib <VmRSS|VmHWM> [pid]: of the mount server unless a pid is given
    awk -v k="$1:" '$1 == k { printf "%.0f", $2 / 1024 }' "/proc/${2:-$PID}/status"
}
agent_pid() { pgrep -P "$PID" -f ' agent ' | head -n 1; }
agent_rss() { local a; a=$(agent_pid); if [ -n "$a" ]; then rss_mib "$1" "$a"; else echo -; fi; }
ready_count() {
    curl -sf "127.0.0.1:$PORT/metrics" 2>/dev/null |
        awk '/^modelfs_models\{.*status="Ready"/ { s += $NF } END { print s + 0 }'
}

echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB RAM, kernel $(uname -r), $(df -T /var/tmp | awk 'NR == 2 {print $2}') on $(df /var/tmp | awk 'NR == 2 {print $1}')"
echo "FUSE transport: $FUSE_TRANSPORT (enable_uring=$(cat "$URING_PARAM" 2>/dev/null || echo absent)); RT=$RT"
echo "models: $N x $M files; binary: $BIN; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"

# Source trees: model i has config.json, M/2 files at its root and the rest in shards/, with
# distinct small contents (every model its own artifact). Models sit two levels deep
# (org<i mod 100>/m<i>), in manifest files of 100 ClusterBaseModels.
mkdir -p "$WORK/src" "$WORK/models"
t=$(now)
python3 - "$WORK" "$N" "$M" <<'PY'
import os, sys
work, n, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    d = os.path.join(work, "src", f"m{i:05}")
    os.makedirs(os.path.join(d, "shards"))
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"model_type": "bench", "seed": %d}\n' % i)
    for j in range(1, m):
        sub = "shards/" if j % 2 else ""
        with open(os.path.join(d, f"{sub}part-{j:05}.bin"), "w") as f:
            f.write(f"model {i} file {j}\n" * (1 + (i + j) % 4))
for start in range(0, n, 100):
    docs = []
    for i in range(start, min(n, start + 100)):
        docs.append(
            "apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\n"
            f"metadata: {{name: m{i:05}}}\n"
            f"spec: {{storage: {{storageUri: 'local://{work}/src/m{i:05}', "
            f"path: org{i % 100:02}/m{i:05}}}}}\n")
    with open(os.path.join(work, "models", f"m{start // 100:03}.yaml"), "w") as f:
        f.write("---\n".join(docs))
PY
FILES=$(find "$WORK/src" -type f | wc -l)
BYTES=$(du -sb "$WORK/src" | cut -f1)
echo "generated $FILES files ($BYTES bytes with directories) in $(since "$t") s"

# --- native baseline -------------------------------------------------------------------------
drop
t=$(now); cp -a "$WORK/src" "$WORK/native"; sync; NATIVE_COPY=$(since "$t")
walk() { # walk <dir> <label>: cold and warm find, names only and with sizes
    local dir=$1 t c w cs ws
    drop; t=$(now); rt find "$dir" >/dev/null; c=$(since "$t")
    t=$(now); rt find "$dir" >/dev/null; w=$(since "$t")
    drop; t=$(now); rt find "$dir" -printf '%s\n' >/dev/null; cs=$(since "$t")
    t=$(now); rt find "$dir" -printf '%s\n' >/dev/null; ws=$(since "$t")
    echo "$c $w $cs $ws"
}
read -r NF_COLD NF_WARM NFS_COLD NFS_WARM <<<"$(walk "$WORK/native")"
fsops() { # fsops <native dir> <mount dir>: "stat_native stat_mount orc_native orc_mount" in us
    rt python3 - "$1" "$2" "$SAMPLE" <<'PY'
import os, sys, time
def files(root):
    out = []
    for d, _, names in os.walk(root):
        out.extend(os.path.join(d, n) for n in names)
    out.sort()
    return out
def stat(f): os.stat(f)
def open_read_close(f):
    fd = os.open(f, os.O_RDONLY)
    os.read(fd, 4096)
    os.close(fd)
def per_op(fs, op, rounds=7):
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        for f in fs:
            op(f)
        samples.append((time.perf_counter() - t) / len(fs))
    samples.sort()
    return samples[len(samples) // 2] * 1e6
sample = int(sys.argv[3])
trees = []
for root in sys.argv[1:3]:
    fs = files(root)
    fs = fs[::max(1, len(fs) // sample)]
    for op in (stat, open_read_close):  # warm: dentries, attributes, page cache
        per_op(fs, op, 1)
    trees.append(fs)
n, m = trees
print(f"{per_op(n, stat):.2f} {per_op(m, stat):.2f} "
      f"{per_op(n, open_read_close):.2f} {per_op(m, open_read_close):.2f}")
PY
}
echo "native: cp -a + sync ${NATIVE_COPY} s; find cold ${NF_COLD} s, warm ${NF_WARM} s; find -printf %s cold ${NFS_COLD} s, warm ${NFS_WARM} s"

# --- modelfs ---------------------------------------------------------------------------------
start() { # start <binary>
    "$1" serve --mount "$WORK/mnt" --state "$WORK/state" --models "$WORK/models" \
        --listen "127.0.0.1:$PORT" --fuse-transport "$FUSE_TRANSPORT" >>"$WORK/daemon.log" 2>&1 &
    PID=$!
}
get_latency() { # size and p50/p99 latency of GETS requests of GET /v1/models
    local size
    size=$(curl -sf "127.0.0.1:$PORT/v1/models" | wc -c)
    for _ in $(seq 1 "$GETS"); do curl -s -o /dev/null -w '%{time_total}\n' "127.0.0.1:$PORT/v1/models"; done |
        sort -g | awk -v size="$size" -v n="$GETS" '{ v[NR] = $1 } END {
            i50 = int(NR * 0.5 + 0.5); i99 = int(NR * 0.99 + 0.5); if (i50 < 1) i50 = 1; if (i99 < 1) i99 = 1
            printf "%d bytes, %d requests: p50 %.4f s, p99 %.4f s", size, n, v[i50], v[i99] }'
}
wait_ready() { # wait_ready <start time>: polls the Ready gauge (cheap for the daemon)
    local peak=0 r
    while :; do
        r=$(rss_mib VmRSS 2>/dev/null || echo 0)
        [ "${r:-0}" -gt "$peak" ] && peak=$r
        [ "$(ready_count)" -ge "$N" ] && break
        if [ "$(awk -v a="$1" -v b="$(now)" 'BEGIN { print (b - a > '"$IMPORT_TIMEOUT"') }')" = 1 ]; then
            echo "timeout: $(ready_count) of $N Ready after ${IMPORT_TIMEOUT} s; RSS: mount server $(rss_mib VmRSS) MiB," \
                "agent $(agent_rss VmRSS) MiB (peak $(agent_rss VmHWM) MiB); status.json $(stat -c %s "$WORK/state/status.json" 2>/dev/null) bytes; GET /v1/models $(get_latency)" >&2
            return 1
        fi
        sleep 0.2
    done
    echo "$peak"
}
drop
t=$(now); start "$BIN"
if ! PEAK_SAMPLED=$(wait_ready "$t"); then
    if [ "${PARTIAL:-0}" != 1 ]; then tail -n 20 "$WORK/daemon.log" >&2; exit 1; fi
    # PARTIAL=1: go on with the models Ready by now (the rest keep importing meanwhile, so
    # every later figure is taken beside that import).
    N=$(ready_count)
    echo "PARTIAL=1: continuing with the $N models Ready so far" >&2
fi
IMPORT=$(since "$t")
RSS_READY=$(rss_mib VmRSS); HWM=$(rss_mib VmHWM); rt_daemon
echo "modelfs: all $N Ready in ${IMPORT} s ($(ratio "$IMPORT" "$NATIVE_COPY")x cp -a + sync); RSS at Ready ${RSS_READY} MiB, peak ${HWM} MiB (mount server); agent $(agent_rss VmRSS) MiB, peak $(agent_rss VmHWM) MiB"

mwalk() { # the first walk of a fresh mount is cold; drop_caches also drops FUSE's dentries
    local dir=$1 t c w cs ws
    drop; t=$(now); rt find "$dir" >/dev/null; c=$(since "$t")
    t=$(now); rt find "$dir" >/dev/null; w=$(since "$t")
    drop; t=$(now); rt find "$dir" -printf '%s\n' >/dev/null; cs=$(since "$t")
    t=$(now); rt find "$dir" -printf '%s\n' >/dev/null; ws=$(since "$t")
    echo "$c $w $cs $ws"
}
lookups() { curl -sf "127.0.0.1:$PORT/metrics" | awk '/^modelfs_fuse_requests_total\{op="lookup"\}/ { print $NF }'; }
L0=$(lookups)
read -r MF_COLD MF_WARM MFS_COLD MFS_WARM <<<"$(mwalk "$WORK/mnt")"
L1=$(lookups)
echo "modelfs: find cold ${MF_COLD} s ($(ratio "$MF_COLD" "$NF_COLD")x), warm ${MF_WARM} s ($(ratio "$MF_WARM" "$NF_WARM")x); find -printf %s cold ${MFS_COLD} s ($(ratio "$MFS_COLD" "$NFS_COLD")x), warm ${MFS_WARM} s ($(ratio "$MFS_WARM" "$NFS_WARM")x); LOOKUPs during the walks: $(awk -v a="${L0:-0}" -v b="${L1:-0}" 'BEGIN { print b - a }')"
read -r ST_N ST_M ORC_N ORC_M <<<"$(fsops "$WORK/native" "$WORK/mnt")"
echo "per file (${SAMPLE} files, warm): stat native ${ST_N} us, mount ${ST_M} us ($(ratio "$ST_M" "$ST_N")x); open+read 4KiB+close native ${ORC_N} us, mount ${ORC_M} us ($(ratio "$ORC_M" "$ORC_N")x)"
RSS_AFTER=$(rss_mib VmRSS)
STATUS_FILE=$(stat -c %s "$WORK/state/status.json")
echo "status: GET /v1/models $(get_latency); status.json ${STATUS_FILE} bytes; RSS after the walks: mount server ${RSS_AFTER} MiB, agent $(agent_rss VmRSS) MiB"

# The agent alone: the supervisor restarts it, the mount keeps serving.
AGENT=$(agent_pid)
t=$(now); kill -9 "$AGENT"
while [ "$(agent_pid)" = "$AGENT" ]; do sleep 0.05; done
wait_ready "$t" >/dev/null || { tail -n 20 "$WORK/daemon.log" >&2; exit 1; }
echo "modelfs: agent SIGKILLed, restarted by the mount server, all $N Ready in $(since "$t") s; mount server RSS $(rss_mib VmRSS) MiB, agent $(agent_rss VmRSS) MiB"

# The mount server: the agent dies with it; a new `serve` remounts and serves the persisted
# mapping before its agent has started.
PROBE="$WORK/mnt/org00/m00000/config.json"  # model 0 (see the generator above)
kill -9 "$PID"; wait "$PID" 2>/dev/null || true; PID=
t=$(now); start "$BIN"
until head -c 1 "$PROBE" >/dev/null 2>&1; do sleep 0.01; done
SERVING=$(since "$t")
wait_ready "$t" >/dev/null || { tail -n 20 "$WORK/daemon.log" >&2; exit 1; }
RESTART=$(since "$t")
echo "modelfs: mount server SIGKILLed, restart to a model file served ${SERVING} s, to all $N Ready ${RESTART} s; RSS after restart: mount server $(rss_mib VmRSS) MiB, agent $(agent_rss VmRSS) MiB"

if [ -n "${BASE_BIN:-}" ]; then
    stop_daemon
    t=$(now); start "$BASE_BIN"
    wait_ready "$t" >/dev/null || exit 1
    rt_daemon
    read -r BF_COLD BF_WARM BFS_COLD BFS_WARM <<<"$(mwalk "$WORK/mnt")"
    echo "base binary: restart to Ready $(since "$t") s; find cold ${BF_COLD} s ($(ratio "$BF_COLD" "$NF_COLD")x), warm ${BF_WARM} s; find -printf %s cold ${BFS_COLD} s ($(ratio "$BFS_COLD" "$NFS_COLD")x), warm ${BFS_WARM} s"
    read -r _ BST_M _ BORC_M <<<"$(fsops "$WORK/native" "$WORK/mnt")"
    echo "base binary per file: stat ${BST_M} us ($(ratio "$BST_M" "$ST_N")x); open+read 4KiB+close ${BORC_M} us ($(ratio "$BORC_M" "$ORC_N")x)"
fi
