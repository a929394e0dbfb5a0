#!/usr/bin/env bash
# Serving while downloading: time from a model declared to a loader done reading it, with the
# loopback hub throttled to a fixed bandwidth, (a) download then load (the model appears once
# every file verified, `--no-serve-while-downloading`) against (b) progressive (the default in
# standalone mode: the listing at once, each file readable once verified). The loader reads a
# generated multi-shard safetensors model shard by shard with `safetensors` (every tensor
# materialized) plus a fixed processing cost per GB that stands for host-to-GPU copies. Also
# measured, for the bound max(download, load): the download alone (a's time to Ready) and the
# load alone (the loader on the complete model, page cache dropped).
#
# Usage: benches/progressive-load.sh [runs]
# Env:   SHARDS (default 8), SHARD_MIB (default 64), RATE_MIB (hub bandwidth, MiB/s, default
#        64), LOAD_SEC_PER_GB (default 16: about the download time), PROFILE (release or
#        debug, default release), WORK (scratch dir), PYTHON (default .venv/bin/python),
#        BIN and HUB (prebuilt `modelfs` and `modelfs-hub` binaries: nothing is built).
#        With RUST_LOG=info,modelfs_agent=debug,modelfs_mount=debug the daemon's log of the
#        last progressive run ($WORK/modelfs.log) has the per-file steps, summed at the end.
# Needs root (mounts FUSE, drops the page cache).
set -euo pipefail

RUNS=${1:-3}
SHARDS=${SHARDS:-8}
SHARD_MIB=${SHARD_MIB:-64}
RATE_MIB=${RATE_MIB:-64}
LOAD_SEC_PER_GB=${LOAD_SEC_PER_GB:-16}
PROFILE=${PROFILE:-release}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
WORK=${WORK:-$(mktemp -d /tmp/modelfs-bench-progressive.XXXXXX)}

if [[ -z ${BIN:-} ]]; then
  if [[ $PROFILE == release ]]; then
    cargo build --release --quiet -p modelfs -p modelfs-devhub --bin modelfs --bin modelfs-hub
  else
    cargo build --quiet -p modelfs -p modelfs-devhub --bin modelfs --bin modelfs-hub
  fi
  BIN=$TARGET/$PROFILE/modelfs
  HUB=$TARGET/$PROFILE/modelfs-hub
fi
HUB=${HUB:-$(dirname "$BIN")/modelfs-hub}

cleanup() {
  [[ -n ${HUB_PID:-} ]] && kill "$HUB_PID" 2>/dev/null || true
  [[ -n ${D_PID:-} ]] && kill "$D_PID" 2>/dev/null || true
  umount -l "$WORK/mnt" 2>/dev/null || true
}
trap cleanup EXIT

# --- the model: configs, a tokenizer, an index and SHARDS safetensors shards ----------------
MODEL=$WORK/model
if [[ ! -f $WORK/model.complete ]]; then
  rm -rf "$MODEL" && mkdir -p "$MODEL"
  "$PYTHON" - "$MODEL" "$SHARDS" "$SHARD_MIB" <<'EOF'
import json, os, sys
import numpy as np
from safetensors.numpy import save_file

out, shards, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(7)
weight_map = {}
tensors_per_shard = 4
rows = (mib << 20) // 4 // tensors_per_shard // 1024
for s in range(1, shards + 1):
    name = f"model-{s:05d}-of-{shards:05d}.safetensors"
    tensors = {}
    for t in range(tensors_per_shard):
        key = f"layers.{(s - 1) * tensors_per_shard + t}.weight"
        tensors[key] = rng.standard_normal((rows, 1024), dtype=np.float32)
        weight_map[key] = name
    save_file(tensors, os.path.join(out, name))
json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024},
          open(os.path.join(out, "config.json"), "w"))
json.dump({"version": "1.0", "model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(5000)}}},
          open(os.path.join(out, "tokenizer.json"), "w"))
json.dump({"metadata": {}, "weight_map": weight_map},
          open(os.path.join(out, "model.safetensors.index.json"), "w"))
EOF
  touch "$WORK/model.complete"
fi
TOTAL=$(find "$MODEL" -type f -printf '%s\n' | awk '{s+=$1} END {printf "%.0f", s}')

# --- the loader -----------------------------------------------------------------------------
# Waits for the index (a progressive listing shows it before it verified: opening waits), then
# reads every shard in name order with safetensors, every tensor materialized, plus the fixed
# cost per GB. Prints "<first tensor s> <done s>" since the epoch.
cat >"$WORK/loader.py" <<'EOF'
import glob, json, os, sys, time
import numpy as np
from safetensors import safe_open

d, per_gb = sys.argv[1], float(sys.argv[2])
index = os.path.join(d, "model.safetensors.index.json")
while not os.path.exists(index):
    time.sleep(0.01)
shards = sorted(set(json.load(open(index))["weight_map"].values()))
first = None
for name in shards:
    with safe_open(os.path.join(d, name), framework="np") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            float(np.asarray(t).ravel()[-1])
            if first is None:
                first = time.time()
            time.sleep(t.nbytes / 1e9 * per_gb)
print(f"{first:.3f} {time.time():.3f}")
EOF

"$HUB" --repo "bench/model=$MODEL" --rate-bytes-per-sec $((RATE_MIB << 20)) \
  >"$WORK/hub.out" 2>"$WORK/hub.err" &
HUB_PID=$!
for _ in $(seq 1 600); do grep -q listening "$WORK/hub.out" 2>/dev/null && break; sleep 0.2; done
URL=$(sed -n 's/^listening //p' "$WORK/hub.out")
[[ -n $URL ]] || { echo "hub did not start"; cat "$WORK/hub.err"; exit 1; }

drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }

# start_daemon FLAGS...: a fresh daemon on empty state; sets PORT and D_PID. No keeper: the
# mount ends with each daemon (a keeper would hold it for a successor on the old state).
start_daemon() {
  rm -rf "$WORK/state" "$WORK/models" && mkdir -p "$WORK/models" "$WORK/mnt"
  umount -l "$WORK/mnt" 2>/dev/null || true
  PORT=$((20000 + RANDOM % 20000))
  "$BIN" serve --mount "$WORK/mnt" --state "$WORK/state" --models "$WORK/models" \
    --listen "127.0.0.1:$PORT" --hf-endpoint "$URL" --no-keeper "$@" 2>"$WORK/modelfs.log" &
  D_PID=$!
  for _ in $(seq 1 100); do curl -sf "127.0.0.1:$PORT/healthz" >/dev/null && break; sleep 0.1; done
  drop_caches
}

stop_daemon() { kill "$D_PID"; wait "$D_PID" 2>/dev/null || true; D_PID=; }

declare_model() {
  printf 'apiVersion: ome.io/v1beta1\nkind: ClusterBaseModel\nmetadata:\n  name: bench\nspec:\n  storage:\n    storageUri: hf://bench/model\n' \
    >"$WORK/models/.m.tmp"
  mv "$WORK/models/.m.tmp" "$WORK/models/m.yaml"
}

wait_ready() {
  while :; do
    s=$(curl -sf "127.0.0.1:$PORT/v1/models" | jq -r '.["clusterbasemodel.bench"].status // ""')
    [[ $s == Ready ]] && return
    [[ $s == Failed ]] && { curl -s "127.0.0.1:$PORT/v1/models"; exit 1; }
    sleep 0.02
  done
}

# (a) download, then load: Ready, then the loader. Also the load alone, on the complete model.
bench_download_then_load() {
  start_daemon --no-serve-while-downloading
  local t0 t1 out
  t0=$(date +%s.%N)
  declare_model
  wait_ready
  t1=$(date +%s.%N)
  out=$("$PYTHON" "$WORK/loader.py" "$WORK/mnt/bench" "$LOAD_SEC_PER_GB")
  read -r first done <<<"$out"
  echo "download $(echo "$t1 - $t0" | bc)"
  echo "download_then_load $(echo "$done - $t0" | bc) $(echo "$first - $t0" | bc)"
  drop_caches
  t0=$(date +%s.%N)
  out=$("$PYTHON" "$WORK/loader.py" "$WORK/mnt/bench" "$LOAD_SEC_PER_GB")
  read -r first done <<<"$out"
  echo "load $(echo "$done - $t0" | bc) $(echo "$first - $t0" | bc)"
  stop_daemon
}

# (b) progressive: the loader starts as soon as the model is declared.
bench_progressive() {
  start_daemon
  local t0 out
  t0=$(date +%s.%N)
  declare_model
  out=$("$PYTHON" "$WORK/loader.py" "$WORK/mnt/bench" "$LOAD_SEC_PER_GB")
  read -r first done <<<"$out"
  echo "progressive $(echo "$done - $t0" | bc) $(echo "$first - $t0" | bc)"
  wait_ready
  stop_daemon
}

echo "# model: $SHARDS shards of $SHARD_MIB MiB, $TOTAL bytes; hub at $RATE_MIB MiB/s; load cost $LOAD_SEC_PER_GB s/GB; $PROFILE build; runs: $RUNS"
echo "# machine: $(nproc) cores, kernel $(uname -r); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for _ in $(seq 1 "$RUNS"); do
  bench_download_then_load
  bench_progressive
done | tee "$WORK/results"
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"

# Medians; the bound max(download, load) and the ratios the issue asks for.
awk '
  { t[$1] = t[$1] " " $2; if (NF > 2) f[$1] = f[$1] " " $3 }
  function median(s,   a, n, i, j, x) {
    n = split(s, a, " ")
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] + 0 < a[i] + 0) { x = a[i]; a[i] = a[j]; a[j] = x }
    return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  END {
    dl = median(t["download"]); ld = median(t["load"]); bound = (dl > ld) ? dl : ld
    a = median(t["download_then_load"]); b = median(t["progressive"])
    printf "| measure | median s |\n|---|---|\n"
    printf "| download alone (declared to Ready) | %.2f |\n", dl
    printf "| load alone (complete model, cold cache) | %.2f |\n", ld
    printf "| max(download, load) | %.2f |\n", bound
    printf "| (a) download then load: declared to loader done | %.2f |\n", a
    printf "| (b) progressive: declared to loader done | %.2f |\n", b
    printf "| (a) time to first tensor | %.2f |\n", median(f["download_then_load"])
    printf "| (b) time to first tensor | %.2f |\n", median(f["progressive"])
    printf "\n(b) / max(download, load) = %.2f (aim <= 1.15); (a) / (b) = %.2f (aim >= 1.6)\n", b / bound, a / b
  }' "$WORK/results"

# The per-file steps of the last progressive run, if its log has them (RUST_LOG above): for
# each weight file, its transfer, the steps from its last byte to its blob published (writes
# behind the network, digest check with sync and rename, alias record), the lag until a
# mapping showed it verified, the open's wait, and the link's idle time before the next file.
if grep -q 'pipeline: file verified' "$WORK/modelfs.log" 2>/dev/null; then
  "$PYTHON" - "$WORK/modelfs.log" <<'EOF2'
import re, sys, datetime
ansi = re.compile(r"\x1b\[[0-9;]*m")
def ts(line):
    return datetime.datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp()
def field(line, name):
    m = re.search(r"\b" + name + r"=(\S+)", line)
    return m and m.group(1).strip('"')
files, lag, waited = {}, {}, {}
for line in open(sys.argv[1], errors="replace"):
    line = ansi.sub("", line)
    if "a mapping shows a file verified" in line:
        lag[field(line, "file")] = int(field(line, "lag_ms"))
    elif "file verified" in line:
        f = {k: int(field(line, k)) for k in ("receive_ms", "write_behind_ms", "commit_ms", "record_ms")}
        f["end"] = ts(line)
        files[field(line, "path")] = f
    elif "an open waited for its file to verify" in line:
        waited[field(line, "file")] = int(field(line, "waited_ms"))
weights = sorted(p for p in files if p.endswith(".safetensors"))
print("\n| file | receive ms | write behind ms | sync+rename ms | record ms | to mapping ms | open waited ms | link idle before ms |")
print("|---|---|---|---|---|---|---|---|")
tot = [0] * 7
prev_received = None
for p in weights:
    f = files[p]
    steps = f["write_behind_ms"] + f["commit_ms"] + f["record_ms"]
    start = f["end"] - (f["receive_ms"] + steps) / 1000
    idle = 0 if prev_received is None else max(0, round((start - prev_received) * 1000))
    prev_received = start + f["receive_ms"] / 1000
    row = [f["receive_ms"], f["write_behind_ms"], f["commit_ms"], f["record_ms"], lag.get(p, 0), waited.get(p, 0), idle]
    tot = [a + b for a, b in zip(tot, row)]
    print(f"| {p} | " + " | ".join(str(x) for x in row) + " |")
print("| sum | " + " | ".join(str(x) for x in tot) + " |")
EOF2
fi
