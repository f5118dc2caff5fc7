#!/usr/bin/env bash
# Installs what lockstep needs (Debian packages, LibTorch from the torch wheel), then configures
# and builds it with CMake + Ninja. Idempotent: a second run only rebuilds what changed.
#
#   launch/setup.sh                 # build into build/
#   LOCKSTEP_TORCH=/opt/libtorch launch/setup.sh   # any LibTorch 2.11-2.14 (a libtorch folder,
#                                   # a torch package folder, or its share/cmake folder)
#   LOCKSTEP_BUILD_DIR=build-x LOCKSTEP_CMAKE_ARGS="-DLOCKSTEP_CUDA=ON" launch/setup.sh
#
set -euo pipefail

LOCKSTEP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCKSTEP_BUILD_DIR="${LOCKSTEP_BUILD_DIR:-$LOCKSTEP_ROOT/build}"
export LOCKSTEP_BUILD_DIR
TORCH_PIN="${LOCKSTEP_TORCH_VERSION:-2.13.0}"

say() { printf 'lockstep setup: %s\n' "$*"; }
die() { printf 'lockstep setup: error: %s\n' "$*" >&2; exit 1; }

# --- Debian packages -------------------------------------------------------
APT_PACKAGES=(cmake ninja-build g++ ccache lld pkg-config libcli11-dev libspdlog-dev libfmt-dev
  libtomlplusplus-dev nlohmann-json3-dev libgtest-dev libgmock-dev openmpi-bin libopenmpi-dev libgloo-dev
  python3-venv python3-dev  # python3-dev: Python.h for the PyTorch package (setup.py)
  bible-kjv)  # the spike benchmark's corpus (launch/bench_spikes.sh; its smoke runs in ctest)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || die "missing Debian packages (${missing[*]}) and not root; install them or run as root"
    SUDO="sudo"
  fi
  say "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq || die "apt-get update failed; check the network or apt sources"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
fi

# --- LibTorch ----------------------------------------------------------------
torch_ok() {  # prints torch's cmake prefix if python $1 has torch 2.11-2.14
  "$1" - 2>/dev/null <<'EOF'
import torch, torch.utils
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
assert (major, minor) >= (2, 11) and (major, minor) <= (2, 14)
print(torch.utils.cmake_prefix_path)
EOF
}
TORCH_PREFIX=""
if [[ -n "${LOCKSTEP_TORCH:-}" ]]; then
  for cand in "$LOCKSTEP_TORCH/share/cmake" "$LOCKSTEP_TORCH"; do
    [[ -f "$cand/Torch/TorchConfig.cmake" ]] && TORCH_PREFIX="$cand" && break
  done
  [[ -n "$TORCH_PREFIX" ]] || die "LOCKSTEP_TORCH=$LOCKSTEP_TORCH holds no share/cmake/Torch/TorchConfig.cmake; point it at a LibTorch folder"
elif [[ -x "$LOCKSTEP_ROOT/.venv/bin/python" ]] && TORCH_PREFIX=$(torch_ok "$LOCKSTEP_ROOT/.venv/bin/python"); then
  :
elif command -v python3 >/dev/null && TORCH_PREFIX=$(torch_ok python3); then
  say "using the torch already importable by python3"
else
  say "creating .venv with torch==$TORCH_PIN (LibTorch comes from the wheel)"
  python3 -m venv "$LOCKSTEP_ROOT/.venv" || die "python3 -m venv failed; install python3-venv"
  "$LOCKSTEP_ROOT/.venv/bin/pip" install -q --disable-pip-version-check "torch==$TORCH_PIN" 2>&1 \
    | { grep -v "^WARNING: Location" || true; } \
    || die "pip install torch==$TORCH_PIN failed; set LOCKSTEP_TORCH to a LibTorch folder instead"
  TORCH_PREFIX=$(torch_ok "$LOCKSTEP_ROOT/.venv/bin/python") || die "torch in .venv is not usable"
fi

# --- Python tools in .venv: matplotlib (`lockstep report`), lizard (launch/lint.sh),
# transformers (the export test) -----
if [[ ! -x "$LOCKSTEP_ROOT/.venv/bin/python" ]]; then
  say "creating .venv for lockstep's Python tools"
  python3 -m venv "$LOCKSTEP_ROOT/.venv" || die "python3 -m venv failed; install python3-venv"
fi
# torch and transformers: tests/hf_reference.py loads `lockstep export` folders with them.
if ! "$LOCKSTEP_ROOT/.venv/bin/python" -c "import torch" 2>/dev/null; then
  say "installing torch==$TORCH_PIN into .venv (for the transformers reference test)"
  "$LOCKSTEP_ROOT/.venv/bin/pip" install -q --disable-pip-version-check "torch==$TORCH_PIN" 2>&1 \
    | { grep -v "^WARNING: Location" || true; } || die "pip install torch==$TORCH_PIN failed"
fi
# setuptools: the PyTorch package's build (venvs of Python 3.12+, Debian 13's, come without it).
for tool in matplotlib lizard transformers setuptools tensorboard wandb tokenizers; do
  if ! "$LOCKSTEP_ROOT/.venv/bin/python" -c "import $tool" 2>/dev/null; then
    say "installing $tool into .venv"
    "$LOCKSTEP_ROOT/.venv/bin/pip" install -q --disable-pip-version-check "$tool" 2>&1 \
      | { grep -v "^WARNING: Location" || true; } \
      || die "pip install $tool failed; lockstep report needs matplotlib, launch/lint.sh lizard, the export and import tests transformers, the PyTorch package setuptools, metrics.enable_tensorboard tensorboard, metrics.enable_wandb wandb, data shard --tokenizer tokenizers"
  fi
done

# torchtitan for the guard's torchtitan example and its test (tests/python/titan_guard.py), in
# .titan/ apart from .venv (python/examples/torchtitan-requirements.txt says why).
titan_pins="$LOCKSTEP_ROOT/python/examples/torchtitan-requirements.txt"
if [[ "$(cat "$LOCKSTEP_ROOT/.titan/.pins" 2>/dev/null)" != "$(cat "$titan_pins")" ]]; then
  say "installing torchtitan into .titan (python/examples/torchtitan-requirements.txt)"
  rm -rf "$LOCKSTEP_ROOT/.titan"
  "$LOCKSTEP_ROOT/.venv/bin/pip" install -q --disable-pip-version-check --no-deps \
    --target "$LOCKSTEP_ROOT/.titan" -r "$titan_pins" 2>&1 | { grep -v "^WARNING: Location" || true; } \
    || die "pip install of torchtitan into .titan failed (the torchtitan example's test needs it)"
  cp "$titan_pins" "$LOCKSTEP_ROOT/.titan/.pins"
fi

# --- configure + build -----------------------------------------------------------
mkdir -p "$LOCKSTEP_BUILD_DIR"
stamp="$TORCH_PREFIX ${LOCKSTEP_CMAKE_ARGS:-}"
if [[ ! -f "$LOCKSTEP_BUILD_DIR/build.ninja" || "$(cat "$LOCKSTEP_BUILD_DIR/.lockstep-configured" 2>/dev/null)" != "$stamp" ]]; then
  say "configuring $LOCKSTEP_BUILD_DIR against LibTorch at $TORCH_PREFIX"
  # shellcheck disable=SC2086
  cmake -S "$LOCKSTEP_ROOT" -B "$LOCKSTEP_BUILD_DIR" -G Ninja -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
    ${LOCKSTEP_CMAKE_ARGS:-} >"$LOCKSTEP_BUILD_DIR/configure.log" 2>&1 \
    || { tail -30 "$LOCKSTEP_BUILD_DIR/configure.log" >&2; die "cmake configure failed (log: $LOCKSTEP_BUILD_DIR/configure.log)"; }
  echo "$stamp" >"$LOCKSTEP_BUILD_DIR/.lockstep-configured"
fi
cmake --build "$LOCKSTEP_BUILD_DIR" ${LOCKSTEP_BUILD_TARGETS:+--target $LOCKSTEP_BUILD_TARGETS} \
  || die "build failed"

# The PyTorch package (lockstep.torch, setup.py) against .venv's torch, in place: ctest runs its
# tests with PYTHONPATH=python. (A LibTorch folder given by LOCKSTEP_TORCH has no Python.)
if [[ -z "${LOCKSTEP_TORCH:-}" ]]; then
  log="$LOCKSTEP_BUILD_DIR/python-package.log"
  "$LOCKSTEP_ROOT/launch/build_python.sh" "$LOCKSTEP_ROOT/.venv/bin/python" >"$log" 2>&1 \
    || { tail -30 "$log" >&2; die "building the PyTorch package failed (log: $log)"; }
fi
