#!/usr/bin/env bash
# Hugging Face download benchmark: modelfs against huggingface_hub.snapshot_download from the
# same loopback hub (modelfs-hub), same machine, same repository: one large LFS file plus a few
# hundred small files. The ceiling of hub + disk is measured with parallel curl.
#
# Usage: scripts/bench-hf-download.sh [runs]
# Env:   BIG_MIB (default 2048), SMALL_FILES (default 300), WORK (scratch dir, default a new
#        temp dir), MODELFS_FLAGS (extra `modelfs serve` flags, e.g. tuning sweeps),
#        PYTHON (default .venv/bin/python), CARGO_TARGET_DIR (default target),
#        TOOLS (default "curl huggingface_hub modelfs"; e.g. TOOLS=modelfs for tuning sweeps).
# Needs root (drops the page cache before every run, mounts FUSE).
set -euo pipefail

RUNS=${1:-3}
BIG_MIB=${BIG_MIB:-2048}
SMALL_FILES=${SMALL_FILES:-300}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
WORK=${WORK:-$(mktemp -d /tmp/modelfs-bench-hf.XXXXXX)}
MODELFS_FLAGS=${MODELFS_FLAGS:-}
TOOLS=${TOOLS:-curl huggingface_hub modelfs}

cargo build --release --quiet -p modelfs -p modelfs-devhub --bin modelfs --bin modelfs-hub
BIN=$TARGET/release/modelfs
HUB=$TARGET/release/modelfs-hub

cleanup() {
  [[ -n ${HUB_PID:-} ]] && kill "$HUB_PID" 2>/dev/null || true
  [[ -n ${D_PID:-} ]] && kill -INT "$D_PID" 2>/dev/null || true
  umount -l "$WORK/mnt" 2>/dev/null || true
}
trap cleanup EXIT

# --- the repository -------------------------------------------------------------------------
REPO=$WORK/repo
if [[ ! -f $REPO/.complete ]]; then
  rm -rf "$REPO"
  mkdir -p "$REPO/weights"
  head -c $((BIG_MIB << 20)) /dev/urandom >"$REPO/weights/model.safetensors"
  for i in $(seq 1 "$SMALL_FILES"); do
    d=$REPO/files/d$((i % 17))
    mkdir -p "$d"
    head -c $((1024 + (i * 7919) % 60000)) /dev/urandom >"$d/f$i.json"
  done
  touch "$REPO/.complete"
fi
TOTAL=$(find "$REPO" -type f ! -name .complete -printf '%s\n' | awk '{s+=$1} END {printf "%.0f", s}')
NFILES=$(find "$REPO" -type f ! -name .complete | wc -l)

# The hub lists .complete too; keep it out of the repository it serves.
SERVE=$WORK/serve
rm -rf "$SERVE" && mkdir -p "$SERVE" && cp -al "$REPO/weights" "$REPO/files" "$SERVE/"

"$HUB" --repo "bench/model=$SERVE" >"$WORK/hub.out" 2>"$WORK/hub.err" &
HUB_PID=$!
for _ in $(seq 1 600); do grep -q listening "$WORK/hub.out" 2>/dev/null && break; sleep 0.2; done
URL=$(sed -n 's/^listening //p' "$WORK/hub.out")
[[ -n $URL ]] || { echo "hub did not start"; cat "$WORK/hub.err"; exit 1; }
COMMIT=$(curl -s "$URL/api/models/bench/model/revision/main" | jq -r .sha)

drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
cpu_ticks() { awk '{print $14 + $15 + $16 + $17}' "/proc/$1/stat"; }
TICK=$(getconf CLK_TCK)

# --- ceiling: parallel curl (8 range streams for the big file, 8 at a time for small ones) ----
bench_curl() {
  local out=$WORK/curl
  rm -rf "$out" && mkdir -p "$out"
  drop_caches
  /usr/bin/time -f "%e %U %S" -o "$WORK/time" bash -c '
    set -e
    url=$1; commit=$2; out=$3; size=$4; repo=$5
    n=8; step=$(( (size + n - 1) / n ))
    for i in $(seq 0 $((n - 1))); do
      a=$((i * step)); b=$(( (i + 1) * step - 1 )); ((b >= size)) && b=$((size - 1))
      curl -sf -r "$a-$b" -o "$out/big.$i" "$url/bench/model/resolve/$commit/weights/model.safetensors" &
    done
    (cd "$repo" && find files -type f) | xargs -P 8 -I{} curl -sf --create-dirs -o "$out/{}" "$url/bench/model/resolve/$commit/{}"
    wait
    sync
  ' _ "$URL" "$COMMIT" "$out" "$(stat -c %s "$REPO/weights/model.safetensors")" "$SERVE"
  read -r wall user sys <"$WORK/time"
  echo "curl $wall $(echo "$user + $sys" | bc)"
}

# --- huggingface_hub ----------------------------------------------------------------------------
bench_hf() {
  local out=$WORK/hf
  rm -rf "$out" "$WORK/hf-home"
  drop_caches
  HF_ENDPOINT=$URL HF_HUB_DISABLE_XET=1 HF_HOME=$WORK/hf-home HF_HUB_DISABLE_TELEMETRY=1 \
    HF_HUB_DISABLE_PROGRESS_BARS=1 \
    /usr/bin/time -f "%e %U %S" -o "$WORK/time" bash -c '
"$1" -c "
import sys
from huggingface_hub import snapshot_download
snapshot_download(repo_id=\"bench/model\", local_dir=sys.argv[1], token=False)
" "$2"
sync  # modelfs fsyncs every blob before it is Ready; count the same durability here
' _ "$PYTHON" "$out"
  read -r wall user sys <"$WORK/time"
  local n
  n=$(find "$out" -type f -not -path '*/.cache/*' | wc -l)
  [[ $n == "$NFILES" ]] || { echo "huggingface_hub fetched $n of $NFILES files"; exit 1; }
  echo "huggingface_hub $wall $(echo "$user + $sys" | bc)"
}

# --- modelfs ------------------------------------------------------------------------------------
bench_modelfs() {
  rm -rf "$WORK/state" "$WORK/models" && mkdir -p "$WORK/models" "$WORK/mnt"
  umount -l "$WORK/mnt" 2>/dev/null || true
  local port=$((20000 + RANDOM % 20000))
  # shellcheck disable=SC2086
  "$BIN" serve --mount "$WORK/mnt" --state "$WORK/state" --models "$WORK/models" \
    --listen "127.0.0.1:$port" --hf-endpoint "$URL" $MODELFS_FLAGS 2>"$WORK/modelfs.log" &
  D_PID=$!
  for _ in $(seq 1 100); do curl -sf "127.0.0.1:$port/healthz" >/dev/null && break; sleep 0.1; done
  drop_caches
  local c0 t0 t1 c1
  c0=$(cpu_ticks "$D_PID")
  t0=$(date +%s.%N)
  printf 'apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: bench\nspec:\n  storage:\n    storageUri: hf://bench/model\n' \
    >"$WORK/models/.m.tmp"
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

echo "# repo: $NFILES files, $TOTAL bytes; runs: $RUNS; machine: $(nproc) cores, kernel $(uname -r)"
echo "# load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for _ in $(seq 1 "$RUNS"); do
  for t in $TOOLS; do
    case $t in
      curl) bench_curl ;;
      huggingface_hub) bench_hf ;;
      modelfs) bench_modelfs ;;
    esac
  done
done | tee "$WORK/results"
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"

# Median wall time and CPU seconds per tool, throughput, and ratio to huggingface_hub.
awk -v total="$TOTAL" '
  { wall[$1] = wall[$1] " " $2; cpu[$1] = cpu[$1] " " $3 }
  function median(s,   a, n, i, j, t) {
    n = split(s, a, " ")
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  END {
    hf = ("huggingface_hub" in wall) ? median(wall["huggingface_hub"]) : 0
    printf "| tool | wall s (median) | MB/s | CPU s (median) | speed vs huggingface_hub |\n|---|---|---|---|---|\n"
    split("curl huggingface_hub modelfs", order, " ")
    for (k = 1; k <= 3; k++) {
      t = order[k]
      if (!(t in wall)) continue
      w = median(wall[t]); c = median(cpu[t])
      printf "| %s | %.2f | %.0f | %.2f | %s |\n", t, w, total / w / 1e6, c, hf ? sprintf("%.2fx", hf / w) : "-"
    }
  }' "$WORK/results"
