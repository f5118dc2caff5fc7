#!/usr/bin/env bash
# Quick start, command 1: install what is missing, build, and run the skip demo on the built-in
# default job (configs/default.toml): 2 CPU ranks under lockstep-run, skipping on with peer
# replay, and four faults injected: a bad sample on rank 1 (its loss NaN at step 120), a
# transient device fault on rank 0 (a flipped exponent bit at step 160), a bad batch on rank 0
# (a x1000 loss spike at step 200) and a spike on both ranks (instability, step 240). The run
# completes: the bad batches are skipped (cause data), the transient fault is repaired by the
# replay, the global spike is taken clipped; `lockstep diag` names the culprit ranks, causes and
# sample ids, quarantines the bad sample (a quarantine file) and names the spiked batch as
# suspect, and `lockstep report` draws outputs/default/report.png.
# Extra arguments go to `lockstep train` (e.g. --training.steps 50, --checkpoint.load_step 0).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOCKSTEP_BUILD_TARGETS="lockstep lockstep-run" "$root/launch/setup.sh"
bin="${LOCKSTEP_BUILD_DIR:-$root/build}/bin"
run_dir="$root/outputs/default"
"$bin/lockstep-run" --nproc-per-node 2 -- "$bin/lockstep" train --job.dump_folder "$run_dir" \
  --skip.enabled true --skip.replay peer \
  --fault.inject "nan_loss@120:1, transient_flip@160:0, spike@200:0, spike@240:0, spike@240:1" "$@"
"$bin/lockstep" diag "$run_dir"
"$bin/lockstep" report "$run_dir"
