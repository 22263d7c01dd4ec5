#!/usr/bin/env bash
# CUDA test-suite + GPU benchmarks in one go, on a GPU machine with torch, triton and nvcc but
# no internet. Usage (from anywhere):
#
#   bash bench/gpu_check.sh OUTDIR [tests|bench|all] [-- gpu_latency args, e.g. --quick]
#
# Wheels: every *.whl under .whl/ (flashinfer-python, apache-tvm-ffi, gguf; docs/gpu.md says
# which and how to fetch them) is installed with --no-index --no-deps into /tmp/site.
# Default model (end-to-end benchmark only): the GGUF of SmolLM2-135M-Instruct, split into
# .whl/model-*/gguf.part-NN with its sha256 in a .whl/model-*/gguf.sha256, is put back
# together into $ADASERVE_CACHE/downloads; without it the end-to-end section is skipped.
#
# GPU_CHECK_TESTS_TIMEOUT / GPU_CHECK_BENCH_TIMEOUT (seconds) cap each part, GPU_CHECK_WORKERS
# sets the pytest workers (default 4).
#
# Writes into OUTDIR: env.txt (GPU, driver, versions), pytest.log + junit.xml (tests),
# gpu_latency.json + gpu_latency.md + bench.log (benchmarks). Both parts run even if the
# other fails; the exit status is non-zero if either did.
set -uo pipefail

out=${1:?usage: bash bench/gpu_check.sh OUTDIR [tests|bench|all] [-- gpu_latency args]}
what=${2:-all}
shift $(( $# >= 2 ? 2 : 1 ))
[ "${1:-}" = "--" ] && shift
case $what in tests|bench|all) ;; *) echo "gpu_check: unknown part '$what'" >&2; exit 2 ;; esac
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 2
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

mapfile -t wheels < <(find .whl -type f -name '*.whl' 2>/dev/null | sort)
if [ ${#wheels[@]} -gt 0 ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${wheels[@]}" || { echo "gpu_check: wheel install failed" >&2; exit 2; }
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

# FlashInfer compiles its kernels with nvcc on first use (JIT); keep them for the whole run.
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-jit}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

export ADASERVE_CACHE=${ADASERVE_CACHE:-/tmp/adaserve-cache}
gguf="$ADASERVE_CACHE/downloads/SmolLM2-135M-Instruct.Q4_1.gguf"
sha=$(find .whl -path '.whl/model-*/gguf.sha256' 2>/dev/null | head -1)
if [ ! -f "$gguf" ] && [ -n "$sha" ]; then
  mkdir -p "$(dirname "$gguf")"
  find .whl -path '.whl/model-*/gguf.part-*' -type f | sort | xargs cat > "$gguf.part"
  if [ "$(sha256sum < "$gguf.part" | cut -d' ' -f1)" = "$(cut -d' ' -f1 "$sha")" ]; then
    mv "$gguf.part" "$gguf"
  else
    echo "gpu_check: default model parts incomplete (sha256 differs); end-to-end is skipped" >&2
    rm -f "$gguf.part"
  fi
fi

# The CUDA test files build tiny checkpoints; without the carried GGUF the test session must not
# try to download the default model (the machine has no internet).
[ -f "$gguf" ] || export ADASERVE_TESTS_WITHOUT_DEFAULT_MODEL=1

{
  nvidia-smi
  nvcc --version | tail -2
  "$py" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  "$py" -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

tests=0
if [ "$what" != bench ]; then
  # Without flashinfer the CUDA tests would skip and pass: make that a failure here.
  if ! "$py" -c "import adaserve.exec.attention.flashinfer" 2>>"$out/env.txt"; then
    echo "gpu_check: adaserve's FlashInfer backend does not import (see env.txt)" >&2
    tests=1
  fi
  # Several pytest workers (pytest-xdist, on the GPU image) JIT-compile FlashInfer's kernels for
  # different dtypes and head sizes side by side instead of one after another.
  workers=()
  "$py" -c "import xdist" 2>/dev/null && workers=(-n "${GPU_CHECK_WORKERS:-4}")
  # GPU_CHECK_TESTS_TIMEOUT (seconds; 0 = none) interrupts pytest like Ctrl-C, so the tests
  # that ran are still reported and the benchmarks still get their turn within one device call.
  timeout -s INT -k 30 "${GPU_CHECK_TESTS_TIMEOUT:-0}" \
    "$py" -m pytest tests/exec/test_flashinfer.py tests/exec/test_cuda_graph.py -v -rs "${workers[@]}" \
    -p no:cacheprovider --junitxml "$out/junit.xml" 2>&1 | tee "$out/pytest.log"
  [ "${PIPESTATUS[0]}" -ne 0 ] && tests=1
fi
bench=0
if [ "$what" != tests ]; then
  timeout -s INT -k 30 "${GPU_CHECK_BENCH_TIMEOUT:-0}" \
    "$py" -m adaserve.bench.gpu_latency --out "$out" "$@" 2>&1 | tee "$out/bench.log"
  bench=${PIPESTATUS[0]}
fi
echo "gpu_check: tests exit $tests, benchmarks exit $bench; results in $out"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
