#!/usr/bin/env bash
# Packs what tests/cuda/gpu-check.sh needs on a lent GPU machine that has no
# cargo and no network and takes at most 64 MiB of files per call (see the
# comment at the top of gpu-check.sh): run here, then carry `.gpu-a` with
# the first call (`gpu-check.sh kernels`) and `.gpu-b` with the second
# (`gpu-check.sh model`), on the same warm machine.
#
#   .gpu-a/bins.tar.xz   flotilla, the bench example and flotilla-cuda's
#                        test binaries (release, stripped)
#   .gpu-a/built-at      the path they were built at (tests find their
#                        fixtures there; gpu-check.sh links it)
#   .gpu-a/tiny/         the tiny models of tests/reference/tiny.py
#   .gpu-a/whl/          the openai client, jsonschema and what they need
#                        (tests/openai_client.py, tests/structured_outputs.py, tests/tool_calls.py),
#                        Python 3.12 wheels
#   .gpu-a/model.part1   the default model's first bytes,
#   .gpu-b/model.part2   its rest (with model.path, and model.sha256 as the
#                        cache keeps it)
#
# Needs the default model in the cache (`flotilla serve` once) and the CI
# venv's Python (`target/ci-venv`, made by .ci/run) for the tiny models.
set -euo pipefail
cd "$(dirname "$0")/../.."
part1_bytes=${PART1_BYTES:-42000000}
for d in .gpu-a .gpu-b; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >>.git/info/exclude
done
rm -rf .gpu-a .gpu-b
mkdir -p .gpu-a/whl .gpu-a/tiny .gpu-b

json=$(mktemp)
# Bins and examples separately: a target flag such as --examples builds
# only those targets, which once left a stale `flotilla` in the pack.
cargo build --release -p flotilla
cargo build --release -p flotilla-cuda --examples
cargo test --release -p flotilla-cuda --no-run --message-format=json >"$json"
stage=$(mktemp -d)
cp target/release/flotilla target/release/examples/bench "$stage/"
python3 - "$json" "$stage" <<'PY'
import json, shutil, sys
names = {"gpu": "gpu", "nvrtc": "nvrtc", "flotilla_cuda": "cuda-unit"}
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        shutil.copy(m["executable"], f"{sys.argv[2]}/{names[m['target']['name']]}")
PY
strip "$stage"/*
tar -C "$stage" -cf - . | xz -T0 -6 >.gpu-a/bins.tar.xz
rm -rf "$stage" "$json"
pwd >.gpu-a/built-at

py=${FLOTILLA_PYTHON:-target/ci-venv/bin/python}
for arch in llama3 qwen2 gemma3 llama; do
  "$py" tests/reference/tiny.py --arch "$arch" --no-ablations --out ".gpu-a/tiny/$arch" >/dev/null
done

# The versions CI's venv runs tests/openai_client.py with.
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .gpu-a/whl \
  openai==2.54.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 anyio==4.16.0 \
  certifi==2026.10.19.post1 h11==0.16.0 httpcore==1.0.9 httpx==0.29.0 idna==3.20 \
  typing-extensions==4.16.0 tqdm==4.70.1 jsonschema==4.26.0 \
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0

model=$(./target/release/flotilla fetch-model 2>/dev/null | tail -1 || true)
[ -f "$model" ] || model=$(ls "${FLOTILLA_CACHE_DIR:-$HOME/.cache/flotilla}"/models/*/SmolLM2-135M-Instruct.Q4_1.gguf | head -1)
echo "$(basename "$(dirname "$model")")/$(basename "$model")" >.gpu-b/model.path
cp "$model.sha256" .gpu-b/model.sha256 # the cache's own record: hash and size
head -c "$part1_bytes" "$model" >.gpu-a/model.part1
tail -c +"$((part1_bytes + 1))" "$model" >.gpu-b/model.part2
# With GEMMA=1, Gemma 3 270M too (253 MB), in parts that each fit a call
# with the working tree: .gpu-g1 (with the binaries) .. .gpu-gN, carried
# one per call in order, for `gpu-check.sh gemma` with the last.
dirs=".gpu-a .gpu-b"
if [ "${GEMMA:-0}" = 1 ]; then
  gemma=$(./target/release/flotilla fetch-model --model gemma3-270m 2>/dev/null | tail -1)
  rm -rf .gpu-g*
  part=52000000
  size=$(stat -c %s "$gemma")
  n=$(( (size + part - 1) / part ))
  for i in $(seq 1 "$n"); do
    d=.gpu-g$i
    grep -qx "/$d/" .git/info/exclude || echo "/$d/" >>.git/info/exclude
    mkdir -p "$d"
    dd if="$gemma" of="$d/gemma.part$i" iflag=skip_bytes,count_bytes \
      skip=$(( (i - 1) * part )) count="$part" status=none
    dirs="$dirs $d"
  done
  cp .gpu-a/bins.tar.xz .gpu-a/built-at .gpu-g1/
  cp "$gemma.sha256" ".gpu-g$n/gemma.sha256"
  echo "$n" >".gpu-g$n/gemma.parts"
fi
tracked=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
for d in $dirs; do
  total=$((tracked + $(du -sb "$d" | cut -f1)))
  echo "$d: $total bytes with the working tree (limit 67108864)"
  [ "$total" -lt 67108864 ]
done
