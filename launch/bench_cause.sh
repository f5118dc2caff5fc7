#!/usr/bin/env bash
# Cost of telling causes apart (issue: bad data vs unstable model vs faulty hardware): the
# default model on 2 CPU ranks under lockstep-run, skip on, three sides in interleaved rounds:
#   base   skip.scope = "step", no replay: no extra collective
#   rank   skip.scope = "rank": the pre-sync all-gather (64 B per rank) runs every step
#   probe  diagnostics.replay_every = 10: every 10th step one rank recomputes a neighbour's batch
# Printed: median ms/step per side, the pre-sync exchange's latency as the trainer measures it
# (metrics triage_ms), the probe's cost per probe and as a fraction of step time for N = 100
# and 1000 (from the measured cost at N = 10), and the all-gather's own latency (lockstep bench
# comm, 128 B = 64 B x 2 ranks, best of 50), with the machine and sizes.
#
#   launch/bench_cause.sh [ROUNDS=4] [STEPS=200]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds="${1:-4}"
steps="${2:-200}"
bin="${LOCKSTEP_BUILD_DIR:-$root/build}/bin"
[[ -x "$bin/lockstep" && -x "$bin/lockstep-run" ]] || { echo "bench_cause: build first (launch/setup.sh)" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
declare -A side=(
  [base]="--skip.scope step"
  [rank]="--skip.scope rank"
  [probe]="--skip.scope step --diagnostics.replay_every 10")

one() {  # appends "elapsed_s ms_per_step triage_ms replay_ms" of one 2-rank run to $tmp/$1
  rm -rf "$tmp/run"
  # shellcheck disable=SC2086
  "$bin/lockstep-run" --nproc-per-node 2 -- "$bin/lockstep" train --job.dump_folder "$tmp/run" \
    --training.steps "$steps" --checkpoint.enable false --metrics.log_freq "$steps" \
    --skip.enabled true ${side[$1]} >/dev/null 2>&1 || { echo "bench_cause: the $1 run failed" >&2; exit 1; }
  python3 - "$tmp/run/metrics.jsonl" >>"$tmp/$1" <<'PY'
import json, sys
m = json.loads(open(sys.argv[1]).read().splitlines()[-1])
print(m["elapsed_s"], m["ms_per_step"], m["triage_ms"], m["replay_ms"])
PY
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "job: embedded default model (0.45 M parameters), 2 ranks x 1 thread (gloo), local batch 16 x 64 tokens, $steps steps per run, $rounds interleaved rounds"
order=(base rank probe)
for ((i = 0; i < rounds; ++i)); do
  for s in "${order[@]}"; do one "$s"; done
  order=("${order[2]}" "${order[0]}" "${order[1]}")  # rotate who goes first
  echo "round $((i + 1)): base $(tail -1 "$tmp/base") | rank $(tail -1 "$tmp/rank") | probe $(tail -1 "$tmp/probe")   (wall s, ms/step, triage ms/step, replay ms/step)"
done
python3 - "$steps" "$tmp" <<'PY'
import statistics, sys
steps, tmp = int(sys.argv[1]), sys.argv[2]
rows = lambda n: [[float(x) for x in l.split()] for l in open(f"{tmp}/{n}") if l.strip()]
med = lambda n, i: statistics.median(r[i] for r in rows(n))
base, rank, probe = (1e3 * med(n, 0) / steps for n in ("base", "rank", "probe"))
print(f"step time (wall / steps): base {base:.3f} ms, scope=rank {rank:.3f} ms ({rank / base:.3f}x), "
      f"replay_every=10 {probe:.3f} ms ({probe / base:.3f}x)")
print(f"pre-sync exchange (skip.scope = rank or skip.replay on), as the trainer times it: "
      f"{med('rank', 2):.3f} ms per step; it is the first collective after backward, so this "
      f"includes waiting for the slower rank's backward, which the gradient sync absorbs "
      f"without it (hence the step-time ratio above)")
per_probe = max(probe - base, 0.0) * 10  # one probe per 10 steps
print(f"probe: {per_probe:.2f} ms per probe (rank 0's own recomputation: "
      f"{med('probe', 3) * 10 * 2:.2f} ms; it probes every other time); cost as a fraction of step time: "
      f"N=10 {per_probe / (10 * base) * 100:.2f} %, N=100 {per_probe / (100 * base) * 100:.3f} %, "
      f"N=1000 {per_probe / (1000 * base) * 100:.4f} %")
PY
echo "the exchange's own latency (all-gather of 72 B x 2 ranks, best of 50 after warm-up):"
"$bin/lockstep-run" --nproc-per-node 2 -- "$bin/lockstep" bench comm --ops all_gather --sizes 144 \
  --iters 50 2>&1 | grep -E "^(\[rank 0\] )?all_gather"
