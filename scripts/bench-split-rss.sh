#!/usr/bin/env bash
# Memory of the two processes of `modelfs serve`: N local:// models (default 1,000) of F small
# files each (default 100; every model its own content, so N artifacts and N stores), all
# AlwaysDownload. Prints VmRSS of the mount server and of the agent right after every model is
# Ready (after importing them) with their peaks during the import (VmHWM), then again after a
# restart of both (records and the persisted mapping loaded, nothing imported), then after the
# agent alone is killed and restarted, then after a `find -printf %s` over the whole mount
# (the mount server builds the directory tree of every model it is asked about). Each line also
# gives the node's cost, the sum of both processes' PSS (shared pages counted once).
# Needs root. Usage: scripts/bench-split-rss.sh [models] [files] [binary]
# The binary defaults to a release build (built here); pass target/debug/modelfs to measure a
# debug build.
# Environment:
#   PHASES="restart agent find"         which of the phases after the import to run
#   SMAPS=1                             also split each RSS by kind (binary, anonymous, stacks)
#   KILL_AT_END=1                       SIGKILL both processes at the end (a heap profiler then
#                                       shows what was in use as not freed)
#   FUSE_TRANSPORT=auto|dev|uring       the mount server's --fuse-transport (default auto); uring
#                                       turns on the fuse module parameter enable_uring for the
#                                       run and restores it after
#   SERVER_WRAP / AGENT_WRAP            a command prefix (e.g. "heaptrack -o /tmp/agent"): then
#                                       `modelfs mount-server` and `modelfs agent` are started
#                                       as two processes instead of `modelfs serve`
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1000}
F=${2:-100}
BIN=${3:-}
PHASES=${PHASES-restart agent find}
if [ -z "$BIN" ]; then
    cargo build --release --quiet
    BIN=target/release/modelfs
fi
BIN=$(realpath "$BIN")
WORK=$(mktemp -d /var/tmp/modelfs-rss.XXXXXX)
PORT=$((20000 + RANDOM % 20000))
PID=
APID=
FUSE_TRANSPORT=${FUSE_TRANSPORT:-auto}
# shellcheck source=scripts/fuse-uring.sh
. scripts/fuse-uring.sh
if [ "$FUSE_TRANSPORT" = uring ]; then
    uring_param_on
fi
cleanup() {
    [ -n "$APID" ] && kill "$APID" 2>/dev/null && wait "$APID" 2>/dev/null || true
    [ -n "$PID" ] && kill -INT "$PID" 2>/dev/null && wait "$PID" 2>/dev/null || true
    umount -l "$WORK/mnt" 2>/dev/null || true
    rm -rf "$WORK"
    uring_param_restore
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
            name = f"sub/f{j:06}.txt" if j % 2 else f"f{j:06}.bin"
            with open(os.path.join(d, name), "wb") as f:
                f.write((b"model %d file %d\n" % (i, j)) * (8 + j % 50))
        docs.append("apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\n"
                    f"metadata: {{name: m{i:05}}}\n"
                    f"spec: {{storage: {{storageUri: 'local://{d}', downloadPolicy: AlwaysDownload}}}}\n")
    with open(os.path.join(work, "models", f"m{start // 100:03}.yaml"), "w") as f:
        f.write("---\n".join(docs))
PY

SOCKET="$WORK/agent.sock"
start() {
    if [ -n "${SERVER_WRAP:-}${AGENT_WRAP:-}" ]; then
        # shellcheck disable=SC2086
        ${SERVER_WRAP:-} "$BIN" mount-server --mount "$WORK/mnt" --state "$WORK/state" \
            --mount-socket "$SOCKET" --fuse-transport "$FUSE_TRANSPORT" >>"$WORK/log" 2>&1 &
        PID=$!
        start_agent
    else
        "$BIN" serve --mount "$WORK/mnt" --state "$WORK/state" --models "$WORK/models" \
            --listen "127.0.0.1:$PORT" --fuse-transport "$FUSE_TRANSPORT" >>"$WORK/log" 2>&1 &
        PID=$!
    fi
}
start_agent() {
    # shellcheck disable=SC2086
    ${AGENT_WRAP:-} "$BIN" agent --mount "$WORK/mnt" --state "$WORK/state" --models "$WORK/models" \
        --listen "127.0.0.1:$PORT" --mount-socket "$SOCKET" >>"$WORK/agent.log" 2>&1 &
    APID=$!
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
# The modelfs process running subcommand $1 on this run's state (below a wrapper such as
# heaptrack, if any).
modelfs_pid() {
    local p
    for p in /proc/[0-9]*; do
        [ "$(readlink "$p/exe" 2>/dev/null)" = "$BIN" ] || continue
        tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -q -- " $1 .*--state $WORK/state" || continue
        echo "${p#/proc/}"
        return
    done
}
server_pid() {
    if [ -n "$APID" ]; then modelfs_pid mount-server; else echo "$PID"; fi
}
agent_pid() { modelfs_pid agent; }
mem() {
    [ -n "$1" ] && [ -e /proc/"$1"/status ] || { echo "-"; return; }
    awk '/VmRSS/ {r = $2} /VmHWM/ {h = $2} END {printf "%.1f MiB (peak %.1f MiB)", r / 1024, h / 1024}' /proc/"$1"/status
}
# Resident memory by kind (SMAPS=1): the binary's own pages, heap and other anonymous memory,
# thread stacks, other files.
breakdown() {
    [ -n "$1" ] && [ -e /proc/"$1"/smaps ] || return 0
    awk -v bin="$BIN" '
        /^[0-9a-f]+-[0-9a-f]+ / { name = $6; kind = (name == bin) ? "binary" : (name == "[heap]" || name == "") ? "anon" : (name ~ /^\[stack/) ? "stack" : "files" }
        /^Rss:/ { kb[kind] += $2 }
        END { printf "binary %.1f, anon+heap %.1f, stacks %.1f, other files %.1f MiB", kb["binary"]/1024, kb["anon"]/1024, kb["stack"]/1024, kb["files"]/1024 }
    ' /proc/"$1"/smaps
    echo ", $(ls /proc/"$1"/task | wc -l) threads"
}
# The node's cost: the sum of both processes' proportional set sizes. Both run the same
# executable, so the binary's pages that both touch are resident once but in both RSS figures;
# PSS counts each shared page once, split between its users.
pss_sum() {
    local total=0 p kb
    for p in "$@"; do
        [ -n "$p" ] && [ -e /proc/"$p"/smaps_rollup ] || continue
        kb=$(awk '/^Pss:/ {print $2}' /proc/"$p"/smaps_rollup)
        total=$((total + kb))
    done
    awk -v kb="$total" 'BEGIN {printf "%.1f MiB", kb / 1024}'
}
report() {
    sleep 5
    echo "  $1: mount server $(mem "$(server_pid)"), agent $(mem "$(agent_pid)"); node (sum of PSS) $(pss_sum "$(server_pid)" "$(agent_pid)")"
    if [ -n "${SMAPS:-}" ]; then
        echo "    mount server: $(breakdown "$(server_pid)")"
        echo "    agent: $(breakdown "$(agent_pid)")"
    fi
}
stop_all() {
    # The modelfs processes themselves: a wrapper may not pass the signal on.
    if [ -n "$APID" ]; then kill -TERM "$(agent_pid)"; wait "$APID" || true; APID=; fi
    kill -TERM "$(server_pid)"; wait "$PID" || true
}

echo "$N models x $F files ($BIN), load average $(cut -d' ' -f1-3 /proc/loadavg), kernel $(uname -r)"
start
sleep 3
report "empty (models not yet imported)"
wait_ready
report "after importing"
for phase in $PHASES; do
    case $phase in
    restart)
        stop_all
        start
        wait_ready
        report "after a restart of both"
        ;;
    agent)
        old=$(agent_pid)
        kill -KILL "$old"
        if [ -n "$APID" ]; then wait "$APID" || true; start_agent; fi
        while [ "$(agent_pid)" = "$old" ] || [ -z "$(agent_pid)" ]; do sleep 0.2; done
        wait_ready
        report "after the agent alone was killed and restarted"
        ;;
    find)
        echo "  find -printf %s over the mount: $(find "$WORK/mnt" -printf '%s\n' | wc -l) entries"
        report "after find over the mount"
        ;;
    esac
done
echo "load average $(cut -d' ' -f1-3 /proc/loadavg)"
if [ -n "${KILL_AT_END:-}" ]; then
    # A profiler then reports what was in use at the end as not freed.
    kill -KILL "$(agent_pid)" "$(server_pid)" || true
    [ -n "$APID" ] && { wait "$APID" || true; APID=; }
    wait "$PID" || true
    PID=
else
    stop_all
fi
