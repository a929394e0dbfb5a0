#!/usr/bin/env bash
# Object-store download benchmark: modelfs (an s3:// model's time to Ready) against boto3's
# transfer manager with its default configuration (10 concurrent requests, 8 MiB parts: what
# `aws s3 sync` runs) and against parallel curl (the ceiling of server + disk), all from the same
# loopback moto S3 server on the same machine: 2 GiB of weights plus a few hundred small files.
#
# The weights are BIG_FILES shards (default 16 of 128 MiB), not one 2 GiB object: moto answers
# every GET, ranged or not, by reading and copying the whole object in Python, so with one
# 2 GiB object each 8 MiB range costs about as much as the whole file and the figures measure
# moto's range handling, not the clients (boto3's transfer manager needed over 30 minutes).
# Sharded weights are also how large models are published.
#
# Usage: scripts/bench-objstore.sh [runs]
# Env:   BIG_MIB (default 2048), BIG_FILES (default 16), SMALL_FILES (default 300),
#        WORK (scratch dir, default a new
#        temp dir; the generated files are kept there between invocations), MODELFS_FLAGS
#        (extra `modelfs serve` flags), PYTHON (default .venv/bin/python, with moto[server] and
#        boto3: scripts/requirements-objstore.txt), CARGO_TARGET_DIR (default target),
#        TOOLS (default "curl boto3 modelfs").
# Needs root (drops the page cache before every run, mounts FUSE), curl, jq, bc.
set -euo pipefail

RUNS=${1:-3}
BIG_MIB=${BIG_MIB:-2048}
BIG_FILES=${BIG_FILES:-16}
SMALL_FILES=${SMALL_FILES:-300}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
WORK=${WORK:-$(mktemp -d /tmp/modelfs-bench-s3.XXXXXX)}
MODELFS_FLAGS=${MODELFS_FLAGS:-}
TOOLS=${TOOLS:-curl boto3 modelfs}
CLIENT=$ROOT/tests/objstore_common/objstore_client.py
BUCKET=bench
PREFIX=model

if [[ " $TOOLS " == *" modelfs "* ]]; then
  cargo build --release --quiet --bin modelfs
fi
BIN=$TARGET/release/modelfs

cleanup() {
  [[ -n ${MOTO_PID:-} ]] && kill "$MOTO_PID" 2>/dev/null || true
  [[ -n ${D_PID:-} ]] && kill -INT "$D_PID" 2>/dev/null || true
  umount -l "$WORK/mnt" 2>/dev/null || true
}
trap cleanup EXIT

# --- the model ----------------------------------------------------------------------------------
REPO=$WORK/repo
LAYOUT="$BIG_MIB MiB in $BIG_FILES, $SMALL_FILES small"
if [[ "$(cat "$WORK/repo.complete" 2>/dev/null)" != "$LAYOUT" ]]; then
  rm -rf "$REPO"
  mkdir -p "$REPO/weights"
  for i in $(seq 1 "$BIG_FILES"); do
    head -c $(((BIG_MIB << 20) / BIG_FILES)) /dev/urandom \
      >"$REPO/weights/model-$(printf %05d "$i")-of-$(printf %05d "$BIG_FILES").safetensors"
  done
  for i in $(seq 1 "$SMALL_FILES"); do
    d=$REPO/files/d$((i % 17))
    mkdir -p "$d"
    head -c $((1024 + (i * 7919) % 60000)) /dev/urandom >"$d/f$i.json"
  done
  echo "$LAYOUT" >"$WORK/repo.complete"
fi
TOTAL=$(find "$REPO" -type f -printf '%s\n' | awk '{s+=$1} END {printf "%.0f", s}')
NFILES=$(find "$REPO" -type f | wc -l)

# --- the server: moto on a free loopback port, the model uploaded with boto3 ---------------------
PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
S3=http://127.0.0.1:$PORT
env -u HTTP_PROXY -u HTTPS_PROXY -u ALL_PROXY "$(dirname "$PYTHON")/moto_server" -H 127.0.0.1 -p "$PORT" \
  >"$WORK/moto.log" 2>&1 &
MOTO_PID=$!
for _ in $(seq 1 300); do curl -s -o /dev/null "$S3/" && break; sleep 0.1; done
s3client() { "$PYTHON" "$CLIENT" --kind s3 --endpoint "$S3" "$@"; }
s3client mkbucket "$BUCKET"
# public-read: curl reads the objects without signing (moto does not check signatures anyway).
# 256 MiB parts: moto assembles a multipart upload in Python; few parts keep that short.
s3client --acl public-read --part-mib 256 upload-dir "$BUCKET" "$PREFIX/" "$REPO" >/dev/null
listed=$(s3client list "$BUCKET" "$PREFIX/" | jq length)
[[ $listed == "$NFILES" ]] || { echo "uploaded $listed of $NFILES files"; exit 1; }

drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
# CPU ticks of process $1 and its running children (modelfs serve runs the agent as its child;
# a running child's time is not in the parent's cutime/cstime).
cpu_ticks() {
  local p sum=0
  for p in "$1" $(pgrep -P "$1"); do
    sum=$((sum + $(awk '{print $14 + $15 + $16 + $17}' "/proc/$p/stat" 2>/dev/null || echo 0)))
  done
  echo "$sum"
}
TICK=$(getconf CLK_TCK)

# --- ceiling: parallel curl, one plain GET per file (the fewest requests moto can be asked), 8 at
# a time, shards first ------------------------------------------------------------------------------
bench_curl() {
  local out=$WORK/curl
  rm -rf "$out" && mkdir -p "$out"
  drop_caches
  /usr/bin/time -f "%e %U %S" -o "$WORK/time" bash -c '
    set -e
    base=$1; out=$2; repo=$3
    (cd "$repo" && find weights -type f && find files -type f) |
      xargs -P 8 -I{} curl -sf --create-dirs -o "$out/{}" "$base/{}"
    sync
  ' _ "$S3/$BUCKET/$PREFIX" "$out" "$REPO"
  local got
  got=$(find "$out" -type f -printf '%s\n' | awk '{s+=$1} END {printf "%.0f", s}')
  [[ $got == "$TOTAL" ]] || { echo "curl fetched $got of $TOTAL bytes"; exit 1; }
  read -r wall user sys <"$WORK/time"
  echo "curl $wall $(echo "$user + $sys" | bc)"
}

# --- boto3's transfer manager, default configuration ----------------------------------------------
bench_boto3() {
  local out=$WORK/boto3
  rm -rf "$out" && mkdir -p "$out"
  drop_caches
  /usr/bin/time -f "%e %U %S" -o "$WORK/time" bash -c '
    "$1" "$2" --kind s3 --endpoint "$3" transfer-dir "$4" "$5/" "$6" >/dev/null
    sync  # modelfs fsyncs every blob before it is Ready; count the same durability here
  ' _ "$PYTHON" "$CLIENT" "$S3" "$BUCKET" "$PREFIX" "$out"
  local n
  n=$(find "$out" -type f | wc -l)
  [[ $n == "$NFILES" ]] || { echo "boto3 fetched $n of $NFILES files"; exit 1; }
  read -r wall user sys <"$WORK/time"
  echo "boto3 $wall $(echo "$user + $sys" | bc)"
}

# --- modelfs ------------------------------------------------------------------------------------
bench_modelfs() {
  rm -rf "$WORK/state" "$WORK/models" && mkdir -p "$WORK/models" "$WORK/mnt"
  umount -l "$WORK/mnt" 2>/dev/null || true
  local port
  port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  # shellcheck disable=SC2086
  AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test AWS_REGION=us-east-1 AWS_DEFAULT_REGION=us-east-1 \
    AWS_ENDPOINT_URL=$S3 AWS_ENDPOINT=$S3 AWS_ALLOW_HTTP=true \
    "$BIN" serve --mount "$WORK/mnt" --state "$WORK/state" --models "$WORK/models" \
    --listen "127.0.0.1:$port" $MODELFS_FLAGS 2>"$WORK/modelfs.log" &
  D_PID=$!
  for _ in $(seq 1 100); do curl -sf "127.0.0.1:$port/healthz" >/dev/null && break; sleep 0.1; done
  drop_caches
  local c0 t0 t1 c1 s
  c0=$(cpu_ticks "$D_PID")
  t0=$(date +%s.%N)
  printf 'apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: bench\nspec:\n  storage:\n    storageUri: s3://%s/%s\n' \
    "$BUCKET" "$PREFIX" >"$WORK/models/.m.tmp"
  mv "$WORK/models/.m.tmp" "$WORK/models/m.yaml"
  while :; do
    s=$(curl -sf "127.0.0.1:$port/v1/models" | jq -r '.["clusterbasemodel.bench"].status // ""')
    [[ $s == Ready ]] && break
    [[ $s == Failed ]] && { curl -s "127.0.0.1:$port/v1/models"; exit 1; }
    sleep 0.02
  done
  t1=$(date +%s.%N)
  c1=$(cpu_ticks "$D_PID")
  local n
  n=$(find "$WORK/mnt/bench" -type f | wc -l)
  [[ $n == "$NFILES" ]] || { echo "modelfs serves $n of $NFILES files"; exit 1; }
  kill -INT "$D_PID"; wait "$D_PID" 2>/dev/null || true; D_PID=
  echo "modelfs $(echo "$t1 - $t0" | bc) $(echo "scale=2; ($c1 - $c0) / $TICK" | bc)"
}

echo "# model: $NFILES files, $TOTAL bytes; runs: $RUNS; machine: $(nproc) cores, kernel $(uname -r)"
echo "# server: moto_server $("$PYTHON" -c 'import moto; print(moto.__version__)'), boto3 $("$PYTHON" -c 'import boto3; print(boto3.__version__)')"
echo "# load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for _ in $(seq 1 "$RUNS"); do
  for t in $TOOLS; do
    case $t in
      curl) bench_curl ;;
      boto3) bench_boto3 ;;
      modelfs) bench_modelfs ;;
    esac
  done
done | tee "$WORK/results"
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"

# Median wall time and CPU seconds per tool, throughput, and ratios to boto3 and to curl.
awk -v total="$TOTAL" '
  { wall[$1] = wall[$1] " " $2; cpu[$1] = cpu[$1] " " $3 }
  function median(s,   a, n, i, j, t) {
    n = split(s, a, " ")
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  END {
    ref = ("boto3" in wall) ? median(wall["boto3"]) : 0
    top = ("curl" in wall) ? median(wall["curl"]) : 0
    printf "| tool | wall s (median) | MB/s | CPU s (median) | speed vs boto3 | speed vs curl |\n|---|---|---|---|---|---|\n"
    split("curl boto3 modelfs", order, " ")
    for (k = 1; k <= 3; k++) {
      t = order[k]
      if (!(t in wall)) continue
      w = median(wall[t]); c = median(cpu[t])
      printf "| %s | %.2f | %.0f | %.2f | %s | %s |\n", t, w, total / w / 1e6, c,
        ref ? sprintf("%.2fx", ref / w) : "-", top ? sprintf("%.2fx", top / w) : "-"
    }
  }' "$WORK/results"
