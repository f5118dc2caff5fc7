#!/usr/bin/env bash
# Run on a machine with Debian's registry: downloads the Debian packages that launch/gpu_check.sh
# needs on a GPU machine without a package registry (CLI11, nlohmann-json, toml++, spdlog, fmt,
# GoogleTest, the gloo headers, OpenSSL's headers, Python's C headers) into .gpu-deps/debs/ (git-ignored). Carry .gpu-deps to the GPU machine.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$root/.gpu-deps/debs"
cd "$root/.gpu-deps/debs"
pkgs=(libcli11-dev nlohmann-json3-dev libtomlplusplus-dev libtomlplusplus3 libspdlog-dev
  libfmt-dev libgtest-dev libgmock-dev libgloo-dev libjemalloc-dev libjemalloc2 libssl-dev)
# Python's C headers for the PyTorch package (used when the GPU machine's python3 is this version).
pkgs+=("libpython$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-dev")
# The runtime libraries' package names carry their soname version; take the installed ones.
pkgs+=($(dpkg-query -W -f='${db:Status-Abbrev} ${Package}\n' 'libspdlog1*' 'libfmt[0-9]*' 2>/dev/null \
  | awk '$1 == "ii" {print $2}'))
apt-get download "${pkgs[@]}" >/dev/null
ls -1 "$root/.gpu-deps/debs"
