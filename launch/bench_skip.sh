#!/usr/bin/env bash
# Overhead of the skip machinery (issue 5): the default model on 2 CPU ranks under lockstep-run,
# skip machinery on (skip.enabled, z-score detectors, local pre-sync check for attribution) vs
# off (skip.enabled = false, diagnostics.local_check = false; the 64-byte stats all-gather stays:
# it is what makes the stock abort agree). Interleaved rounds in alternating order. Printed per
# side: median wall time of the training loop, median CPU time of both ranks (less sensitive to
# a shared machine's noise), and the decision's own time per step as the trainer measures it
# (checks + stats all-gather + decide, gradient sync excluded), with the machine and sizes.
#
#   launch/bench_skip.sh [ROUNDS=6] [STEPS=150]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds="${1:-6}"
steps="${2:-150}"
bin="${LOCKSTEP_BUILD_DIR:-$root/build}/bin"
[[ -x "$bin/lockstep" && -x "$bin/lockstep-run" ]] || { echo "bench_skip: build first (launch/setup.sh)" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
off=(--skip.enabled false --diagnostics.local_check false)
on=(--skip.enabled true --diagnostics.local_check true)

one() {  # prints "wall_s cpu_s decision_ms ms_per_step" of one 2-rank run
  rm -rf "$tmp/run"
  local t
  t=$( { TIMEFORMAT='%U %S'; time "$bin/lockstep-run" --nproc-per-node 2 -- "$bin/lockstep" train \
      --job.dump_folder "$tmp/run" --training.steps "$steps" --checkpoint.enable false \
      --metrics.log_freq "$steps" "$@" >/dev/null 2>&1; } 2>&1 ) \
    || { echo "bench_skip: the run failed: $*" >&2; exit 1; }
  python3 - "$tmp/run/metrics.jsonl" $t <<'PY'
import json, sys
m = json.loads(open(sys.argv[1]).read().splitlines()[-1])
print(m["elapsed_s"], float(sys.argv[2]) + float(sys.argv[3]), m["decision_ms"], m["ms_per_step"])
PY
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "job: embedded default model (0.45 M parameters), 2 ranks x 1 thread (gloo), local batch 16 x 64 tokens, $steps steps per run, $rounds interleaved rounds"
: >"$tmp/off" && : >"$tmp/on"
for ((i = 0; i < rounds; ++i)); do
  if ((i % 2 == 0)); then one "${off[@]}" >>"$tmp/off"; one "${on[@]}" >>"$tmp/on";
  else one "${on[@]}" >>"$tmp/on"; one "${off[@]}" >>"$tmp/off"; fi
  echo "round $((i + 1)): off $(tail -1 "$tmp/off") | on $(tail -1 "$tmp/on")   (wall s, cpu s, decision ms/step, ms/step)"
done
python3 - "$steps" "$tmp/off" "$tmp/on" <<'PY'
import statistics, sys
steps = int(sys.argv[1])
rows = lambda p: [[float(x) for x in l.split()] for l in open(p) if l.strip()]
off, on = rows(sys.argv[2]), rows(sys.argv[3])
med = lambda rs, i: statistics.median(r[i] for r in rs)
w0, w1 = med(off, 0), med(on, 0)
c0, c1 = med(off, 1), med(on, 1)
d0, d1 = med(off, 2), med(on, 2)
s1 = med(on, 3)
print(f"wall: off {1e3 * w0 / steps:.2f} ms/step, on {1e3 * w1 / steps:.2f} ms/step, on/off {w1 / w0:.3f} "
      f"(off alone spans {min(r[0] for r in off):.2f}..{max(r[0] for r in off):.2f} s: the noise floor)")
print(f"cpu:  off {c0:.2f} s, on {c1:.2f} s, on/off {c1 / c0:.3f}")
print(f"decision, measured in the trainer: off {d0:.3f} ms/step, on {d1:.3f} ms/step; "
      f"the machinery on adds {d1 - d0:.3f} ms to a {s1:.1f} ms step = {(d1 - d0) / s1 * 100:.2f} % (target <= 2 %)")
print("collectives per step: one all-gather of 72 B per rank on both sides; a second one (sample ids) only on anomalous steps")
PY
