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
# CUDA toolkit or from PyPI (installed here into target/gpu-venv if absent).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-target/gpu-check}
mkdir -p "$out"

nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv | tee "$out/device.csv"

if ! ldconfig -p | grep -q libnvrtc.so.12 || ! ldconfig -p | grep -q libcublas.so.12; then
  python3 -m venv target/gpu-venv
  target/gpu-venv/bin/pip install --quiet --disable-pip-version-check \
    nvidia-cuda-nvrtc-cu12 nvidia-cublas-cu12
  site=$(target/gpu-venv/bin/python -c 'import site; print(site.getsitepackages()[0])')
  export LD_LIBRARY_PATH="$site/nvidia/cuda_nvrtc/lib:$site/nvidia/cublas/lib:${LD_LIBRARY_PATH:-}"
fi

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
