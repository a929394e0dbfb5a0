#!/usr/bin/env bash
# The reconciler's benchmarks for two builds side by side in one run: flip latency
# (scripts/bench-flip.sh), an import with single flight at scale (scripts/bench-import-scale.sh)
# and the memory of both processes (scripts/bench-split-rss.sh). The builds alternate round by
# round, so background load falls on both alike. Use it to check that a change inside the agent
# costs nothing: build the old commit and the new one, then compare.
# Needs root. Usage: benches/reconciler-compare.sh OLD_BINARY NEW_BINARY [rounds]
# Environment: FLIP_REPS (default 3), IMPORT_MODELS (default 6000), RSS_MODELS (default 1000),
# RSS_FILES (default 100).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 OLD_BINARY NEW_BINARY [rounds]" >&2; exit 2; }
OLD=$(realpath "$1")
NEW=$(realpath "$2")
ROUNDS=${3:-2}
echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, kernel $(uname -r)"
echo "old: $OLD"
echo "new: $NEW"
for round in $(seq 1 "$ROUNDS"); do
    for which in old new; do
        bin=$OLD; [ "$which" = new ] && bin=$NEW
        echo "== round $round, $which: load average $(cut -d' ' -f1-3 /proc/loadavg)"
        scripts/bench-flip.sh "${FLIP_REPS:-3}" "$bin" | sed "s/^/  [$which flip] /"
        scripts/bench-import-scale.sh "${IMPORT_MODELS:-6000}" "$bin" | sed "s/^/  [$which import] /"
        PHASES="restart" scripts/bench-split-rss.sh "${RSS_MODELS:-1000}" "${RSS_FILES:-100}" "$bin" \
            | sed "s/^/  [$which rss] /"
    done
done
