#!/usr/bin/env bash
# Builds the PyTorch package's extension (lockstep._C, setup.py) with torch's own extension build
# against PYTHON's torch, incrementally (ninja keeps its objects in BUILD_DIR/temp):
#   launch/build_python.sh PYTHON            the CPU package, in place (python/lockstep/_C*.so);
#                                            the tests import it with PYTHONPATH=python
#   launch/build_python.sh PYTHON BUILD_DIR  the package as that torch builds it (CUDA when it
#                                            has CUDA and nvcc is found) into BUILD_DIR/lib
# Users install it with `pip install --no-build-isolation .` (docs/pytorch.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${1:?usage: launch/build_python.sh PYTHON [BUILD_DIR]}"
out="${2:-}"
cd "$root"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
# The GPU generations of the CMake build (CMakeLists.txt), unless the caller names others.
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;8.6;8.9;9.0;10.0+PTX}"
if [[ -z "$out" ]]; then
  LOCKSTEP_CUDA=0 "$python" setup.py -q build_ext --inplace --build-temp build-python/temp
else
  "$python" setup.py -q build_ext --build-lib "$out/lib" --build-temp "$out/temp"
fi
