#!/usr/bin/env bash
# Quick start, command 2: install what is missing (the test-only set too: tests/requirements.txt),
# build everything, run every test (ctest).
# Extra arguments go to ctest (e.g. -R Config, -L gpu).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/launch/setup.sh" --tests
cd "${LOCKSTEP_BUILD_DIR:-$root/build}"
# A fresh build folder has no timings, and ctest would start the tests in the order they were
# declared, a minute-long one last; tests/ctest_costs.txt (the seconds of the tests over 5 s, from
# a run of the whole suite: cp Testing/Temporary/CTestCostData.txt after one to refresh it) starts
# the longest first. Later runs use their own timings.
costs=Testing/Temporary/CTestCostData.txt
[[ -f "$costs" ]] || { mkdir -p Testing/Temporary && cp "$root/tests/ctest_costs.txt" "$costs"; }
# 3 jobs on 2 cores: the multi-rank tests spend part of their time in start-up, timeouts and
# waits on each other's collectives, which a third job fills (the suite passes under load:
# launch/test_under_load.sh).
exec ctest --output-on-failure --timeout 600 -j "${LOCKSTEP_TEST_JOBS:-3}" "$@"
