#!/usr/bin/env bash
# Quick start, command 1: install what is missing, build, and run the skip demo on the built-in
# default job (configs/default.toml): 2 CPU ranks under lockstep-run, skipping on, a bad batch injected on rank 1
# (a NaN gradient at step 120) and a loss spike on rank 0 at step 200. The run completes, the
# log shows the skips, `lockstep diag` names the culprit ranks and sample ids (and writes a
# quarantine file), and `lockstep report` draws outputs/default/report.png.
# Extra arguments go to `lockstep train` (e.g. --training.steps 50, --checkpoint.load_step 0).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCKSTEP_BUILD_TARGETS="lockstep lockstep-run" "$root/launch/setup.sh"
bin="${LOCKSTEP_BUILD_DIR:-$root/build}/bin"
run_dir="$root/outputs/default"
"$bin/lockstep-run" --nproc-per-node 2 -- "$bin/lockstep" train --job.dump_folder "$run_dir" \
  --skip.enabled true --fault.inject "nan_grad@120:1, spike@200:0" "$@"
"$bin/lockstep" diag "$run_dir"
"$bin/lockstep" report "$run_dir"
