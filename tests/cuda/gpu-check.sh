#!/usr/bin/env bash
# Everything about the CUDA backend that needs a GPU:
#
#   tests/cuda/gpu-check.sh [STAGE...]    stages: kernels model bench serve
#                                         gemma profile, or all (the default)
#
# kernels: the device and driver; every kernel through NVRTC for this
#   device; crates/cuda's tests that need no model file: paged attention
#   (f16 and int8 KV, past 256 positions) against a plain reference, the
#   dequantisers against the CPU's, every architecture's tiny model against
#   the f64 reference (norms, RoPE, GeGLU, sliding windows, sampling on the
#   device).
# model: the default model's logits against the f64 reference, greedy
#   tokens against the CPU backend, a mixed batch, KV blocks moved between
#   the backends.
# bench: the bench example (prefill and decode at batch 1..256, achieved
#   bandwidth, f16 and int8 KV) beside a device-to-device copy.
# serve: `flotilla serve --device cuda:0` driven by tests/openai_client.py,
#   tests/structured_outputs.py and tests/tool_calls.py, then by `flotilla bench` at 32 and 256
#   streams and at 32 chat streams plain and under a JSON schema (f16 and
#   int8 KV).
# gemma: Gemma 3 270M's greedy tokens against the CPU backend (the model
#   travels in parts, see pack.sh's GEMMA=1).
# profile: each kernel's GPU time over a few decode steps (ncu).
# Every step runs even when an earlier one failed; the summary at the end
# names each step's result and the exit status is 1 if any failed. A test
# that skips (no device, no NVRTC) fails here (FLOTILLA_REQUIRE_GPU=1).
#
# Where cargo is at hand the binaries are built here. The lent H200 machines
# (driver 580, CUDA 13, cuBLAS and NVRTC in their Python's nvidia packages)
# have no cargo and no network and take 64 MiB of files per call:
# tests/cuda/pack.sh packs the binaries, the model and the Python wheels into
# .gpu-a and .gpu-b; carry .gpu-a with `gpu-check.sh kernels` and .gpu-b with
# `gpu-check.sh model bench serve` on the same warm machine. Results go under $OUT
# (default target/gpu-check), at most 8 files.
set -uo pipefail
cd "$(dirname "$0")/../.."
stages=${*:-all}
out=${OUT:-target/gpu-check}
mkdir -p "$out"
root=$PWD
summary=()
step() { # step NAME LOG COMMAND...: runs it (its output also to LOG unless -), records the result
  local name=$1 log=$2
  shift 2
  echo "== $name"
  if [ "$log" = - ]; then "$@"; else "$@" 2>&1 | tee "$log"; fi
  if [ "${PIPESTATUS[0]}" = 0 ]; then summary+=("ok      $name"); else summary+=("FAILED  $name"); fi
}

# cudarc looks for libnvrtc/libcublas as .so, .so.12, .so.11...: a CUDA 13
# install has .so.13 only, so link the unversioned names to what is there.
libs=/tmp/flotilla-gpu-libs
mkdir -p "$libs"
find_lib() { # the first of: the loader's cache, any Python's nvidia packages
  ldconfig -p | awk -v n="$1" '$1 ~ "^"n {print $NF; exit}'
  python3 - "$1" <<'PY' 2>/dev/null
import glob, site, sys
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for f in sorted(glob.glob(f"{d}/nvidia/**/{sys.argv[1]}*", recursive=True)):
        print(f); sys.exit()
PY
}
dirs=
for lib in libnvrtc.so libcublas.so libcublasLt.so; do
  path=$(find_lib "$lib" | head -1)
  if [ -z "$path" ] && command -v cargo >/dev/null; then
    cuda_major=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1)
    python3 -m venv target/gpu-venv
    target/gpu-venv/bin/pip install --quiet --disable-pip-version-check \
      "nvidia-cuda-nvrtc-cu${cuda_major}" "nvidia-cublas-cu${cuda_major}"
    path=$(target/gpu-venv/bin/python - "$lib" <<'PY'
import glob, site, sys
for d in site.getsitepackages():
    for f in sorted(glob.glob(f"{d}/nvidia/**/{sys.argv[1]}*", recursive=True)):
        print(f); sys.exit()
PY
)
  fi
  echo "$lib -> ${path:-not found}"
  [ -n "$path" ] || continue
  ln -sf "$path" "$libs/$lib"
  ln -sf "$path" "$libs/$lib.12"
  dirs="$dirs:$(dirname "$path")" # NVRTC loads its builtins from there
done
export LD_LIBRARY_PATH="$libs$dirs:${LD_LIBRARY_PATH:-}"
export FLOTILLA_REQUIRE_GPU=1 FLOTILLA_REQUIRE_NVRTC=1

# Gemma's first part carries the binaries when .gpu-a does not.
[ -f .gpu-a/bins.tar.xz ] || [ ! -f /tmp/flotilla-gpu-g/bins.tar.xz ] || {
  mkdir -p .gpu-a && cp /tmp/flotilla-gpu-g/bins.tar.xz /tmp/flotilla-gpu-g/built-at .gpu-a/
}
if [ -f .gpu-a/bins.tar.xz ]; then
  bin=/tmp/flotilla-gpu-bins
  if [ ! -x "$bin/gpu" ]; then
    mkdir -p "$bin"
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
      .gpu-a/bins.tar.xz "$bin"
  fi
  built_at=$(cat .gpu-a/built-at)
  if [ "$built_at" != "$root" ] && [ ! -e "$built_at" ]; then
    mkdir -p "$(dirname "$built_at")" && ln -s "$root" "$built_at"
  fi
  export FLOTILLA_TINY_MODELS=$root/.gpu-a/tiny
  cuda_tests() { # the three test binaries with the same filters
    local rc=0
    for t in cuda-unit nvrtc gpu; do timeout 300 "$bin/$t" "$@" || rc=1; done
    return $rc
  }
else
  cargo build --release -p flotilla 2>&1 | tail -1
  cargo build --release -p flotilla-cuda --examples 2>&1 | tail -1
  bin=target/release
  cp target/release/examples/bench target/release/bench
  cuda_tests() { timeout 900 cargo test --release -p flotilla-cuda -- "$@"; }
fi
# The one test that skips where a driver is present is the no-driver one.
no_skips() { ! grep -n "SKIPPED" "$1" | grep -v "this machine has a CUDA driver"; }

want() { [[ " $stages " == *" $1 "* ]] || [[ " $stages " == *" all "* ]]; }

if want kernels; then
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap,clocks.max.sm,clocks.max.mem --format=csv
    nvidia-smi | head -4
    uname -a
    nproc
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    ls -l "$libs"
  } >"$out/device.txt" 2>&1
  cat "$out/device.txt"
  step "kernel tests" "$out/kernels.log" cuda_tests --nocapture --skip default_model \
    --skip greedy_tokens --skip kv_blocks --skip mixed_batch --skip gemma3
  step "no kernel test skipped" - no_skips "$out/kernels.log"
fi

# The default model, from the packed halves where they were carried.
if [ -f .gpu-b/model.part2 ]; then
  export FLOTILLA_CACHE_DIR=/tmp/flotilla-cache
  model=$FLOTILLA_CACHE_DIR/models/$(cat .gpu-b/model.path)
  if [ ! -f "$model" ]; then
    mkdir -p "$(dirname "$model")"
    cat .gpu-a/model.part1 .gpu-b/model.part2 >"$model.tmp"
    echo "$(head -1 .gpu-b/model.sha256 | cut -d' ' -f1)  $model.tmp" | sha256sum -c --quiet &&
      mv "$model.tmp" "$model" && cp .gpu-b/model.sha256 "$model.sha256"
  fi
fi

if want model; then
  step "model tests" "$out/model-tests.log" cuda_tests --nocapture default_model \
    greedy_tokens_match_the_cpu kv_blocks mixed_batch --skip gemma3
  step "no model test skipped" - no_skips "$out/model-tests.log"
fi

if want bench; then
  bench() {
    python3 - <<'PY' || true
import torch
if torch.cuda.is_available():
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
    for _ in range(3): b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20): b.copy_(a)
    e.record(); torch.cuda.synchronize()
    ms = s.elapsed_time(e) / 20
    print(f"device-to-device copy of 1 GiB (torch): {2 * n / ms / 1e6:.0f} GB/s read+written")
PY
    for dtype in f16 int8; do timeout 200 "$bin/bench" --kv-cache-dtype $dtype || return 1; done
  }
  step "bench example" "$out/bench.md" bench
fi

if want serve; then
  if [ -d .gpu-a/whl ] && [ ! -d /tmp/flotilla-site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/flotilla-site .gpu-a/whl/*.whl
  fi
  [ -d /tmp/flotilla-site ] && export PYTHONPATH=/tmp/flotilla-site
  port=18091
  device=${FLOTILLA_GPU_CHECK_DEVICE:-cuda:0} # cpu only to try this script without a GPU
  pid=
  trap '[ -n "$pid" ] && kill $pid 2>/dev/null' EXIT
  serve() { # ARGS...: flotilla serve on $port, waits until ready
    echo "### flotilla serve --device $device $*" >>"$out/serve.log"
    "$bin/flotilla" serve --device "$device" --port $port "$@" >>"$out/serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 180); do
      curl -sf "http://127.0.0.1:$port/ready" >/dev/null && return 0
      kill -0 $pid 2>/dev/null || return 1
      sleep 1
    done
    return 1
  }
  stop() { kill $pid 2>/dev/null; wait $pid 2>/dev/null; pid=; }
  # The repository's openai-client test, against the default config (API keys on).
  step "serve --device $device (default config) ready" - serve
  client() {
    export OPENAI_BASE_URL="http://127.0.0.1:$port/v1" OPENAI_API_KEY=sk-flotilla-paid-example
    python3 tests/openai_client.py && python3 tests/structured_outputs.py &&
      python3 tests/tool_calls.py &&
      curl -sf "http://127.0.0.1:$port/ready"
  }
  step "openai client" "$out/client.log" client
  stop
  # Serving throughput at 32 and 256 streams, f16 and int8 KV.
  : >"$out/load.md"
  for dtype in ${KV_DTYPES:-f16 int8}; do
    step "serve --device $device --kv-cache-dtype $dtype ready" - serve --no-auth \
      --kv-cache-dtype $dtype --max-num-seqs 256 --max-num-batched-tokens 4096
    load() {
      local rc=0
      for c in 32 256; do
        echo "### flotilla bench, $c streams, $dtype KV"
        "$bin/flotilla" bench --url "http://127.0.0.1:$port" --concurrency $c \
          --requests $((c * 4)) --max-tokens 128 --duration-s 90 --quiet \
          --label "flotilla $device $dtype KV, $c streams" || rc=1
      done
      echo "### flotilla bench, 32 streams, $dtype KV, chat, plain and under tests/bench/bench-schema.json"
      for schema in "" tests/bench/bench-schema.json; do
        "$bin/flotilla" bench --url "http://127.0.0.1:$port" --concurrency 32 --chat \
          --requests 128 --max-tokens 128 --duration-s 90 --quiet ${schema:+--json-schema $schema} \
          ${schema:+--ignore-eos false} --label "flotilla $device $dtype KV, 32 chat ${schema:-plain}" || rc=1
      done
      curl -s "http://127.0.0.1:$port/metrics" | grep -E '^flotilla_(kv_cache|requests_total)'
      return $rc
    }
    step "flotilla bench 32 and 256 streams, $dtype KV" "$out/load.$dtype.md" load
    cat "$out/load.$dtype.md" >>"$out/load.md" && rm "$out/load.$dtype.md"
    stop
  done
fi

# Gemma 3 270M on the device against the CPU backend (greedy, teacher
# forced), from the parts pack.sh (GEMMA=1) split it into: each call
# carries one .gpu-gN; every call with this stage stashes what it has in
# /tmp/flotilla-gpu-g, and the one that completes the file runs the test.
if want gemma; then
  mkdir -p /tmp/flotilla-gpu-g
  for d in .gpu-g*; do [ -d "$d" ] && cp "$d"/* /tmp/flotilla-gpu-g/; done
  g=/tmp/flotilla-gpu-g
  if [ -f $g/gemma.parts ]; then
    gemma_test() {
      local n model=/tmp/gemma-3-270m-q4_k_m.gguf
      n=$(cat $g/gemma.parts)
      for i in $(seq 1 "$n"); do cat "$g/gemma.part$i"; done >"$model"
      echo "$(head -1 $g/gemma.sha256 | cut -d' ' -f1)  $model" | sha256sum -c --quiet || return 1
      FLOTILLA_TEST_GEMMA3=$model cuda_tests --nocapture gemma3_greedy
    }
    step "Gemma 3 270M greedy tokens against the CPU backend" "$out/gemma.log" gemma_test
    step "no gemma test skipped" - no_skips "$out/gemma.log"
  else
    echo "gemma: parts stashed: $(ls $g | tr '\n' ' ')"
  fi
fi

# Where a decode step's time goes: each kernel's GPU time (Nsight Compute,
# one metric, clocks as found) over a few decode steps at batch 1.
if want profile; then
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
  profile() {
    [ -n "$ncu" ] || { echo "no ncu"; return 1; }
    timeout 150 "$ncu" --clock-control none --metrics gpu__time_duration.sum \
      --print-summary per-kernel --launch-skip 3000 --launch-count 800 \
      "$bin/bench" --batches 1
  }
  step "profile (ncu)" "$out/profile.txt" profile
fi

printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
! grep -q FAILED "$out/summary.txt"
