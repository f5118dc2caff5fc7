#!/usr/bin/env bash
# Quick start, command 1: install what is missing, build, and train the embedded default job.
# Extra arguments go to `lockstep train` (e.g. --config FILE, --training.steps 50).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCKSTEP_BUILD_TARGETS=lockstep "$root/launch/setup.sh"
exec "${LOCKSTEP_BUILD_DIR:-$root/build}/bin/lockstep" train "$@"
