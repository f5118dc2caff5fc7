#!/usr/bin/env bash
# Quick start, command 2: install what is missing (the test-only set too: tests/requirements.txt),
# build everything, run every test (ctest).
# Extra arguments go to ctest (e.g. -R Config, -L gpu).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/launch/setup.sh" --tests
cd "${LOCKSTEP_BUILD_DIR:-$root/build}"
exec ctest --output-on-failure --timeout 600 -j "${LOCKSTEP_TEST_JOBS:-2}" "$@"
