#!/usr/bin/env bash
# Compiles lockstep's CUDA path against a CUDA build of torch (torch==2.14.1 from the wheel, in a
# cached virtualenv) with the machine's nvcc, so GPU code cannot rot on machines without a GPU.
# Nothing built here needs a GPU to compile; `lockstep version` runs as a smoke test.
#   LOCKSTEP_CUDA_TORCH=/path/to/cuda/torch-or-libtorch  skips the virtualenv.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${LOCKSTEP_CACHE:-$HOME/.cache/lockstep}"
pin="${LOCKSTEP_CUDA_TORCH_VERSION:-2.14.1}"
die() { printf 'lockstep build_cuda: error: %s\n' "$*" >&2; exit 1; }

# The toolkit root is where nvcc really lives (PATH may hold a wrapper script elsewhere);
# LibTorch's CMake files find the CUDA libraries from it.
nvcc="${CUDACXX:-}"
[[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
[[ -z "$nvcc" ]] && nvcc="$(command -v nvcc || true)"
[[ -n "$nvcc" ]] || die "nvcc not found; install the CUDA toolkit or set CUDACXX"
cuda_root="${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$nvcc")")")}"
[[ -f "$cuda_root/include/cuda_runtime.h" ]] || die "no include/cuda_runtime.h under $cuda_root; set CUDA_HOME to the toolkit"

torch_dir="${LOCKSTEP_CUDA_TORCH:-}"
if [[ -z "$torch_dir" ]]; then
  venv="$cache/venv-cuda-$pin"
  if ! "$venv/bin/python" -c "import torch; assert torch.version.cuda" 2>/dev/null; then
    echo "lockstep build_cuda: installing torch==$pin (CUDA build) into $venv"
    python3 -m venv "$venv" || die "python3 -m venv failed"
    "$venv/bin/pip" install -q --disable-pip-version-check "torch==$pin" 2>&1 \
      | { grep -v "^WARNING: Location" || true; } || die "pip install torch==$pin failed"
  fi
  torch_dir=$("$venv/bin/python" -c 'import torch, os; print(os.path.dirname(torch.__file__))' 2>/dev/null)
fi

export LOCKSTEP_TORCH="$torch_dir"
export LOCKSTEP_BUILD_DIR="${LOCKSTEP_CUDA_BUILD_DIR:-$root/build-cuda}"
export LOCKSTEP_CMAKE_ARGS="-DLOCKSTEP_CUDA=ON -DCMAKE_CUDA_COMPILER=$cuda_root/bin/nvcc -DCUDA_TOOLKIT_ROOT_DIR=$cuda_root -DCUDAToolkit_ROOT=$cuda_root ${LOCKSTEP_CUDA_CMAKE_ARGS:-}"
"$root/launch/setup.sh" --tests  # the test-only set too: it runs the gpu tests, and python3-dev
# gives the CUDA package below its Python.h
# The PyTorch package with its CUDA kernels, against the same torch (compiled, not run here).
if [[ -n "${venv:-}" ]]; then
  log="$LOCKSTEP_BUILD_DIR/python-package.log"
  "$venv/bin/python" -c "import setuptools" 2>/dev/null \
    || "$venv/bin/pip" install -q --disable-pip-version-check setuptools >/dev/null \
    || die "pip install setuptools into $venv failed (the PyTorch package's build needs it)"
  CUDA_HOME="$cuda_root" "$root/launch/build_python.sh" "$venv/bin/python" \
    "$LOCKSTEP_BUILD_DIR/python" >"$log" 2>&1 \
    || { tail -30 "$log" >&2; die "building the CUDA PyTorch package failed (log: $log)"; }
  echo "lockstep build_cuda: PyTorch package built ($(ls "$LOCKSTEP_BUILD_DIR"/python/lib/lockstep/_C*.so))"
fi
"$LOCKSTEP_BUILD_DIR/bin/lockstep" version
# The gpu-labelled tests run on a GPU machine (launch/gpu_check.sh); here they must skip cleanly.
(cd "$LOCKSTEP_BUILD_DIR" && ctest -L gpu --output-on-failure)
