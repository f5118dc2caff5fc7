#!/usr/bin/env bash
# Builds the PyTorch package's extension (lockstep._C, setup.py) with torch's own extension build
# against PYTHON's torch into BUILD_DIR/lib (CUDA when that torch has it and nvcc is found),
# incrementally (ninja keeps its objects in BUILD_DIR/temp): launch/build_cuda.sh's CUDA package
# and the GPU script's. Users and the tests install it with
# `.venv/bin/pip install --no-build-isolation .` (launch/setup.sh --tests, docs/pytorch.md).
#   launch/build_python.sh PYTHON BUILD_DIR
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${1:?usage: launch/build_python.sh PYTHON BUILD_DIR}"
out="${2:?usage: launch/build_python.sh PYTHON BUILD_DIR}"
cd "$root"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
# The GPU generations of the CMake build (CMakeLists.txt), unless the caller names others.
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;8.6;8.9;9.0;10.0+PTX}"
"$python" setup.py -q build_ext --build-lib "$out/lib" --build-temp "$out/temp"
