#!/usr/bin/env bash
# Adoption of an old agent's files with the store beside the models root (the default
# --state) versus on another filesystem, side by side (BENCHMARKS.md, "Adoption without a
# copy").
#
# Generates an old-agent tree of SIZE_MIB (default 2048) under a models root, as OME's agent
# leaves it (`<root>/<path>/<files>`, root-owned, 0644), and serves the same files from the
# loopback hub (modelfs-hub) as hf://bench/model. The models roots live on an ext4 filesystem
# of their own (a loop device), so `df` sees nothing but the daemon. Then, for each placement:
#   same:  --mount $FS/s/models, no --state (default: $FS/s/.modelfs-models);
#   other: --mount $FS/o/models, --state on a tmpfs (another filesystem);
#   split: the shipped Kubernetes layout (deploy/base): `modelfs mount-server` and `modelfs
#          agent` as separate processes, the server seeing --mount and --state through one
#          mount (their parent), the agent in a mount namespace of its own where they are two
#          bind mounts (two hostPath volumes of one disk);
# starts `modelfs serve` (or the two processes), waits for the model to be Ready, and reports:
# `df` of the models root's filesystem and of the state's before and after, bytes the agent
# read from storage (/proc/<agent>/io read_bytes, page cache dropped before), bytes the hub
# served (0: nothing downloaded), and the start-up placement line.
#
# Usage: benches/adopt-zero-copy.sh
# Env:   SIZE_MIB (default 2048), WORK (default a new temp dir), PROFILE (release|debug,
#        default release), CARGO_TARGET_DIR (default target), NO_BUILD (set: use the binaries
#        as they are).
# Needs root (mounts FUSE and a tmpfs, drops the page cache).
set -euo pipefail

SIZE_MIB=${SIZE_MIB:-2048}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
PROFILE=${PROFILE:-release}
WORK=${WORK:-$(mktemp -d /tmp/mfs-adopt.XXXXXX)}

if [[ -n ${NO_BUILD:-} ]]; then
  :
elif [[ $PROFILE == release ]]; then
  cargo build --release --quiet -p modelfs -p modelfs-devhub --bin modelfs --bin modelfs-hub
else
  cargo build --quiet -p modelfs -p modelfs-devhub --bin modelfs --bin modelfs-hub
fi
BIN=$TARGET/$PROFILE/modelfs
HUB=$TARGET/$PROFILE/modelfs-hub

cleanup() {
  [[ -n ${A_PID:-} ]] && kill -TERM "$A_PID" 2>/dev/null && wait "$A_PID" 2>/dev/null || true
  [[ -n ${D_PID:-} ]] && kill -INT "$D_PID" 2>/dev/null && wait "$D_PID" 2>/dev/null || true
  [[ -n ${HUB_PID:-} ]] && kill "$HUB_PID" 2>/dev/null || true
  for m in "$FS/s/models" "$FS/o/models" "$FS/k/models" "$WORK/other-state" "$FS"; do
    umount -l "$m" 2>/dev/null || true
  done
}
trap cleanup EXIT

# --- the files: 4 shards, a config ----------------------------------------------------------
SRC=$WORK/src
if [[ ! -f $WORK/.src-complete ]]; then
  rm -rf "$SRC" && mkdir -p "$SRC"
  shard=$((SIZE_MIB / 4))
  for i in 1 2 3 4; do
    head -c $((shard << 20)) /dev/urandom >"$SRC/model-0000$i-of-00004.safetensors"
  done
  printf '{"architectures":["LlamaForCausalLM"],"model_type":"llama"}\n' >"$SRC/config.json"
  touch "$WORK/.src-complete"
fi
TOTAL=$(find "$SRC" -type f -printf '%s\n' | awk '{s+=$1} END {printf "%.0f", s}')

"$HUB" --repo "bench/model=$SRC" >"$WORK/hub.out" 2>"$WORK/hub.err" &
HUB_PID=$!
for _ in $(seq 1 3000); do grep -q listening "$WORK/hub.out" 2>/dev/null && break; sleep 0.2; done
URL=$(sed -n 's/^listening //p' "$WORK/hub.out")
[[ -n $URL ]] || { echo "hub did not start"; cat "$WORK/hub.err"; exit 1; }
hub_bytes() { curl -s "$URL/_hub/stats" | jq -r .bytes_served; }

# The filesystem of the models roots: ext4 on a loop device, room for three old trees.
FS=$WORK/f
mkdir -p "$FS"
rm -f "$WORK/fs.img"
truncate -s $((4 * SIZE_MIB + 1024))M "$WORK/fs.img"
mkfs.ext4 -q -F "$WORK/fs.img"
mount -o loop "$WORK/fs.img" "$FS"

drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
used_kib() { df --output=used -k "$1" | tail -1 | tr -d ' '; }

run() {
  local name=$1 state_flag=$2 state_dir=$3
  local short=${name:0:1}
  [[ $name == split ]] && short=k
  local base=$FS/$short models=$FS/$short/models
  rm -rf "$base" && mkdir -p "$models/llama"
  # The old agent's download: a copy of the files at the model's path.
  cp "$SRC"/* "$models/llama/"
  chmod 0644 "$models/llama"/*
  mkdir -p "$base/manifests"
  cat >"$base/manifests/m.yaml" <<EOF
apiVersion: ome.io/v1beta1
kind: ClusterBaseModel
metadata:
  name: llama
spec:
  storage:
    storageUri: hf://bench/model
    downloadPolicy: AlwaysDownload
    path: $models/llama
EOF
  drop_caches
  local models_before state_before hub_before
  models_before=$(used_kib "$base")
  mkdir -p "$state_dir"
  state_before=$(used_kib "$state_dir")
  hub_before=$(hub_bytes)
  local port=$((20000 + RANDOM % 20000))
  local start end
  start=$(date +%s.%N)
  local agent=""
  if [[ $name == split ]]; then
    # Both append to one log (O_APPEND: neither overwrites the other's lines).
    : >"$base/daemon.log"
    "$BIN" mount-server --mount "$models" --state "$state_dir" --no-keeper \
      --mount-socket "$base/agent.sock" >>"$base/daemon.log" 2>&1 &
    D_PID=$!
    for _ in $(seq 1 300); do grep -q 'waiting for the agent' "$base/daemon.log" && break; sleep 0.1; done
    # The agent's pod: the models root (with the FUSE mount on it) and the state directory are
    # two volumes, each a bind mount of its own.
    unshare --mount --propagation private sh -c \
      'mount --rbind "$1" "$1" && mount --bind "$2" "$2" && shift 2 && exec "$@"' sh \
      "$models" "$state_dir" "$BIN" agent --mount "$models" --state "$state_dir" \
      --models "$base/manifests" --listen "127.0.0.1:$port" --hf-endpoint "$URL" \
      --mount-socket "$base/agent.sock" >>"$base/daemon.log" 2>&1 &
    A_PID=$!
    agent=$A_PID
  else
    # shellcheck disable=SC2086
    "$BIN" serve --mount "$models" $state_flag --models "$base/manifests" \
      --listen "127.0.0.1:$port" --hf-endpoint "$URL" --no-keeper >"$base/daemon.log" 2>&1 &
    D_PID=$!
  fi
  for _ in $(seq 1 6000); do
    [[ -z $agent ]] && agent=$(pgrep -P "$D_PID" -f ' agent ' | head -1 || true)
    if curl -s "127.0.0.1:$port/v1/models" | jq -e '.["clusterbasemodel.llama"].status == "Ready"' >/dev/null 2>&1; then
      break
    fi
    sleep 0.1
  done
  end=$(date +%s.%N)
  local read_bytes
  read_bytes=$(awk '/^read_bytes/ {print $2}' "/proc/$agent/io")
  sync
  local models_after state_after hub_after
  models_after=$(used_kib "$base")
  state_after=$(used_kib "$state_dir")
  hub_after=$(hub_bytes)
  if [[ -n ${A_PID:-} ]]; then kill -TERM "$A_PID"; wait "$A_PID" 2>/dev/null || true; fi
  A_PID=""
  kill -INT "$D_PID"; wait "$D_PID" 2>/dev/null || true
  D_PID=""
  local same_fs
  same_fs=$([[ $(stat -c %d "$base") == $(stat -c %d "$state_dir") ]] && echo yes || echo no)
  printf '%-6s state=%s (same filesystem: %s)\n' "$name" "$state_dir" "$same_fs"
  if [[ $same_fs == yes ]]; then
    printf '       df of the filesystem: %+d KiB\n' $((models_after - models_before))
  else
    printf '       df of the models root: %+d KiB, of the state: %+d KiB\n' \
      $((models_after - models_before)) $((state_after - state_before))
  fi
  printf '       agent read from storage: %d MiB of %d MiB adopted (%.2fx); hub served %d bytes\n' \
    $((read_bytes >> 20)) $((TOTAL >> 20)) "$(echo "$read_bytes / $TOTAL" | bc -l)" \
    $((hub_after - hub_before))
  printf '       Ready after %.1f s\n' "$(echo "$end - $start" | bc -l)"
  grep -o 'the store and the models root [^"]*' "$base/daemon.log" | head -1 | sed 's/^/       log: /' || true
  grep -o 'adoption_copies=[^ ]*' "$base/daemon.log" | head -1 | sed 's/^/       /' || true
  # Kept beside the work directory: the filesystem holding $base is unmounted on exit.
  cp "$base/daemon.log" "$WORK/$name.log"
}

echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB RAM, kernel $(uname -r)"
echo "models roots on: $(df --output=fstype "$FS" | tail -1 | tr -d ' ') (loop device, $((4 * SIZE_MIB + 1024)) MiB)"
echo "adopting $((TOTAL >> 20)) MiB (5 files) left by an old agent"
run same "" "$FS/s/.modelfs-models"
mkdir -p "$WORK/other-state"
mount -t tmpfs -o size=$((SIZE_MIB + 512))m modelfs-bench-state "$WORK/other-state"
run other "--state $WORK/other-state" "$WORK/other-state"
run split "" "$FS/k/.modelfs-models"
