#!/usr/bin/env bash
# Installs what lockstep needs, then configures and builds it with CMake + Ninja. Idempotent: a
# second run only rebuilds what changed.
#
#   launch/setup.sh              # what the demo needs: Debian packages, torch (LibTorch comes
#                                # from the wheel), matplotlib (`lockstep report`) and setuptools
#                                # (the PyTorch package's build) in .venv
#   launch/setup.sh --tests      # and the test-only set (launch/test.sh): bible-kjv,
#                                # tests/requirements.txt in one pip call, the torchtitan tree in
#                                # .titan/, the PyTorch package installed into .venv (the README's
#                                # `.venv/bin/pip install --no-build-isolation .`)
#   LOCKSTEP_TORCH=/opt/libtorch launch/setup.sh   # any LibTorch 2.11-2.14 (a libtorch folder,
#                                # a torch package folder, or its share/cmake folder)
#   LOCKSTEP_BUILD_DIR=build-x LOCKSTEP_CMAKE_ARGS="-DLOCKSTEP_CUDA=ON" launch/setup.sh
#
set -euo pipefail

LOCKSTEP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCKSTEP_BUILD_DIR="${LOCKSTEP_BUILD_DIR:-$LOCKSTEP_ROOT/build}"
export LOCKSTEP_BUILD_DIR
TORCH_PIN="${LOCKSTEP_TORCH_VERSION:-2.13.0}"
tests=0
[[ "${1:-}" == "--tests" ]] && tests=1
venv="$LOCKSTEP_ROOT/.venv"

say() { printf 'lockstep setup: %s\n' "$*"; }
die() { printf 'lockstep setup: error: %s\n' "$*" >&2; exit 1; }

# --- Debian packages -------------------------------------------------------
APT_PACKAGES=(cmake ninja-build g++ ccache lld pkg-config libcli11-dev libspdlog-dev libfmt-dev
  libtomlplusplus-dev nlohmann-json3-dev libgtest-dev libgmock-dev openmpi-bin libopenmpi-dev
  libgloo-dev python3-venv libjemalloc-dev  # jemalloc: the trainer's malloc (CMakeLists.txt)
  python3-dev  # Python.h for the PyTorch package (setup.py; the README's pip install)
  libssl-dev)  # OpenSSL's HMAC for the digest cache's keyed entries (src/data/digest.cpp)
((tests)) && APT_PACKAGES+=(bible-kjv)  # the spike benchmark's corpus (its smoke runs in ctest)
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
  apt_log="$(mktemp)"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    >"$apt_log" 2>&1 || { tail -20 "$apt_log" >&2; die "apt-get install ${missing[*]} failed"; }
  rm -f "$apt_log"
fi

# --- Python: .venv holds torch (LibTorch for the build) and a pinned requirements file ------
torch_ok() {  # prints torch's cmake prefix if python $1 has torch 2.11-2.14
  "$1" - 2>/dev/null <<'PY'
import torch, torch.utils
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
assert (major, minor) >= (2, 11) and (major, minor) <= (2, 14)
print(torch.utils.cmake_prefix_path)
PY
}
# pip_quiet ARGS...: pip install into .venv, without the mirror's "Location ignored" warnings.
pip_quiet() {
  "$venv/bin/pip" install -q --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "^WARNING: Location" || true; }
}
# pip_install REQUIREMENTS [torch]: one pip call for the file (and torch==TORCH_PIN too, when
# asked and .venv has none), skipped when .venv already holds exactly that file's pins (a copy of
# it beside .venv says so).
pip_install() {
  local reqs="$1" stamp="$venv/.lockstep-$(basename "$(dirname "$1")")-requirements"
  local torch=()
  if [[ "${2:-}" == torch ]]; then
    "$venv/bin/python" -c "import torch" 2>/dev/null || torch=("torch==$TORCH_PIN")
  fi
  if ((${#torch[@]} == 0)) && cmp -s "$reqs" "$stamp"; then return; fi
  say "installing ${torch[*]:+${torch[*]} and }${reqs#"$LOCKSTEP_ROOT"/} into .venv"
  pip_quiet "${torch[@]}" -r "$reqs" || die "pip install -r $reqs failed; see the lines above"
  cp "$reqs" "$stamp"
}
if [[ ! -x "$venv/bin/python" ]]; then
  say "creating .venv"
  python3 -m venv "$venv" || die "python3 -m venv failed; install python3-venv"
fi
# torch: LibTorch for the build, unless LOCKSTEP_TORCH names one; the tests need it either way.
pip_install "$LOCKSTEP_ROOT/launch/requirements.txt" "$([[ -z "${LOCKSTEP_TORCH:-}" ]] && echo torch)"
((tests)) && pip_install "$LOCKSTEP_ROOT/tests/requirements.txt" torch
TORCH_PREFIX=""
if [[ -n "${LOCKSTEP_TORCH:-}" ]]; then
  for cand in "$LOCKSTEP_TORCH/share/cmake" "$LOCKSTEP_TORCH"; do
    [[ -f "$cand/Torch/TorchConfig.cmake" ]] && TORCH_PREFIX="$cand" && break
  done
  [[ -n "$TORCH_PREFIX" ]] || die "LOCKSTEP_TORCH=$LOCKSTEP_TORCH holds no share/cmake/Torch/TorchConfig.cmake; point it at a LibTorch folder"
else
  TORCH_PREFIX=$(torch_ok "$venv/bin/python") \
    || die "the torch in .venv is not 2.11-2.14; remove .venv, or set LOCKSTEP_TORCH to a LibTorch folder"
fi

# torchtitan for the guard's torchtitan example and its tests (tests/python/titan_guard.py), in
# .titan/ apart from .venv (python/examples/torchtitan-requirements.txt says why).
# It installs while the build compiles (mostly unpacking: it costs the build little), and the
# build's end waits for it.
titan_pins="$LOCKSTEP_ROOT/python/examples/torchtitan-requirements.txt"
titan_job=""
titan_log="$LOCKSTEP_ROOT/.titan-install.log"
if ((tests)) && [[ "$(cat "$LOCKSTEP_ROOT/.titan/.pins" 2>/dev/null)" != "$(cat "$titan_pins")" ]]; then
  say "installing torchtitan into .titan (python/examples/torchtitan-requirements.txt), beside the build"
  rm -rf "$LOCKSTEP_ROOT/.titan"
  (pip_quiet --no-deps --target "$LOCKSTEP_ROOT/.titan" -r "$titan_pins" >"$titan_log" 2>&1 \
    && cp "$titan_pins" "$LOCKSTEP_ROOT/.titan/.pins") &
  titan_job=$!
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
if [[ -n "$titan_job" ]] && ! wait "$titan_job"; then
  cat "$titan_log" >&2
  die "pip install of torchtitan into .titan failed (the torchtitan example's test needs it; log: $titan_log)"
fi
rm -f "$titan_log"

# The PyTorch package (lockstep.torch, setup.py) installed into .venv with the README's own
# command, so the tests import what a user installs (ninja rebuilds only what changed, in
# build-python/). A LibTorch folder given by LOCKSTEP_TORCH has no Python.
if ((tests)) && [[ -z "${LOCKSTEP_TORCH:-}" ]]; then
  log="$LOCKSTEP_BUILD_DIR/python-package.log"
  rm -f "$LOCKSTEP_ROOT"/python/lockstep/_C*.so  # an in-place build of older versions
  (cd "$LOCKSTEP_ROOT" && "$venv/bin/pip" install --disable-pip-version-check --no-build-isolation .) \
    >"$log" 2>&1 || { tail -30 "$log" >&2; die "installing the PyTorch package failed (log: $log)"; }
fi
