#!/usr/bin/env bash
# Everything about the CUDA backend that needs a GPU, in one run of a few
# minutes (sized for a short lease of one H200):
#   1. the device and driver;
#   2. crates/cuda's tests with a GPU required: every kernel through NVRTC
#      for this device, paged attention against a plain reference, the
#      default model's logits against the f64 reference, greedy tokens
#      against the CPU backend (a skipped test fails here);
#   3. the benchmark: prefill, decode at batch 1 and 64, beside the
#      bandwidth bound of the weights;
#   4. `flotilla serve --device cuda:0` answering one chat completion.
# Needs Rust (cargo) and the NVIDIA driver; NVRTC and cuBLAS come from the
# CUDA toolkit or from PyPI (installed here into target/gpu-venv if absent,
# pinned to the driver's CUDA major version).
#
# The project's lent H200 machines (seen 2026-11) have driver 580 (CUDA 13)
# with the PyPI packages nvidia-cublas and nvidia-cuda-nvrtc for CUDA 13 in
# their Python, but no cargo and no network, and take 64 MiB of files per
# call: there, build the test binaries here (`cargo test --release -p
# flotilla-cuda --no-run`, the bench example), strip them, carry them with
# a model small enough, and run them with the same variables as below.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-target/gpu-check}
mkdir -p "$out"

nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv | tee "$out/device.csv"

# cudarc looks for libnvrtc/libcublas as .so, .so.12, .so.11...: a CUDA 13
# install has .so.13 only, so link the unversioned names to what is there.
cuda_major=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1)
libs=target/gpu-libs
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
for lib in libnvrtc.so libcublas.so libcublasLt.so; do
  path=$(find_lib "$lib" | head -1)
  if [ -z "$path" ]; then
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
  echo "$lib -> $path"
  ln -sf "$path" "$libs/$lib"
  ln -sf "$path" "$libs/$lib.12"
  dirs="${dirs:-}:$(dirname "$path")" # NVRTC loads its builtins from there
done
export LD_LIBRARY_PATH="$PWD/$libs${dirs}:${LD_LIBRARY_PATH:-}"

export FLOTILLA_REQUIRE_GPU=1 FLOTILLA_REQUIRE_NVRTC=1
cargo build --release -p flotilla -p flotilla-cuda --examples --tests 2>&1 | tail -3
cargo test --release -p flotilla-cuda -- --nocapture 2>&1 | tee "$out/tests.log"
cargo run --release -p flotilla-cuda --example bench 2>&1 | tee "$out/bench.md"

port=18091
./target/release/flotilla serve --device cuda:0 --port $port >"$out/serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break
  sleep 1
done
curl -sf "http://127.0.0.1:$port/v1/chat/completions" \
  -H "Authorization: Bearer sk-flotilla-paid-example" -H 'Content-Type: application/json' \
  -d '{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":24,"temperature":0}' \
  | tee "$out/completion.json"
echo
grep -q '"content"' "$out/completion.json"
echo "gpu-check: all passed; figures in $out/bench.md"
