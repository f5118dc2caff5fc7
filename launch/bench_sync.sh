#!/usr/bin/env bash
# The gradient sync (issue: a GPU step without host syncs, overlap), on CPU ranks over Gloo:
#
#  1. Overlap: a model whose gradient collective is a large part of the step (GPT, dim 512,
#     4 layers, 12.9 M parameters = 52 MB of fp32 gradient; 4 x 64 tokens per rank), 2 ranks
#     under lockstep-run, parallelism.overlap false vs true in interleaved rounds, ddp and
#     sharded, 4 MiB buckets. Printed: median ms/step per side, the ratio, and the comm fraction
#     (sync_ms / ms_per_step without overlap: the time the step waits for the collective after
#     backward). With RATE (e.g. 4gbit) the loopback is also shaped to that rate with a tc
#     token bucket (root only; removed at exit), so the wire rather than the CPU bounds the
#     transfer, as between machines: on 2 vCPUs the unshaped loopback transfer is itself CPU
#     work, which an overlapped collective takes from backward.
#  2. The decision's cost vs world size 1, 2, 4, 8 (the default model; ranks beyond the cores
#     oversubscribe them): decision_ms = check [A] + check [B] + the stats all-gather + decide.
#
#   launch/bench_sync.sh [ROUNDS=3] [STEPS=30] [RATE]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bench_common.sh"
bench_init bench_sync
rounds="${1:-3}"
steps="${2:-30}"
rate="${3:-}"
model="--model.dim 512 --model.n_layers 4 --model.n_heads 8 --training.local_batch_size 4 --training.seq_len 64"

one() {  # one run on $1 ranks with the rest as arguments; prints "ms_per_step sync_ms decision_ms"
  local world="$1"
  shift
  rm -rf "$tmp/run"
  "$bin/lockstep-run" --nproc-per-node "$world" -- "$bin/lockstep" train --job.dump_folder "$tmp/run" \
    --checkpoint.enable false --diagnostics.verify_every 0 "$@" >"$tmp/log" 2>&1 ||
    { echo "bench_sync: a run failed: $*" >&2; tail -3 "$tmp/log" >&2; exit 1; }
  python3 -c '
import json, sys
m = json.loads(open(sys.argv[1]).read().splitlines()[-1])
print(m["ms_per_step"], m["sync_ms"], m["decision_ms"])' "$tmp/run/metrics.jsonl"
}

overlap() {  # $1: the condition's name; rounds of off/on for ddp and sharded
  for mode in ddp sharded; do
    : >"$tmp/off" && : >"$tmp/on"
    for ((i = 0; i < rounds; ++i)); do
      for side in off on; do
        # shellcheck disable=SC2086
        one 2 $model --training.steps "$steps" --metrics.log_freq "$steps" --parallelism.mode "$mode" \
          --parallelism.bucket_mb 4 --parallelism.overlap "$([[ $side == on ]] && echo true || echo false)" >>"$tmp/$side"
      done
    done
    python3 - "$tmp" "$1" "$mode" <<'PY'
import statistics, sys
tmp, cond, mode = sys.argv[1:]
rows = lambda n: [[float(x) for x in l.split()] for l in open(f"{tmp}/{n}") if l.strip()]
med = lambda n, i: statistics.median(r[i] for r in rows(n))
off, on = med("off", 0), med("on", 0)
print(f"{cond:>22} {mode:>8}: overlap off {off:7.1f} ms/step (sync {med('off', 1):6.1f} ms, comm "
      f"fraction {med('off', 1) / off * 100:4.1f} %), on {on:7.1f} ms/step (sync wait "
      f"{med('on', 1):6.1f} ms): {on / off:.3f}x")
PY
  done
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "cpu flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_bf16|avx512_fp16|amx_bf16|amx_tile)$' | tr '\n' ' ')"
echo "overlap: GPT dim 512 x 4 layers (12.9 M parameters, 52 MB fp32 gradient), 2 ranks x 1 thread (gloo), local batch 4 x 64 tokens, bucket 4 MiB, $steps steps per run, median of $rounds interleaved rounds"
overlap "loopback"
if [[ -n "$rate" ]]; then
  if shape_loopback "$rate"; then
    overlap "loopback shaped $rate"
    unshape_loopback
  fi
fi

echo "decision cost vs world size: default model, 40 steps, decision_ms (check [A] + check [B] + stats all-gather + decide) of the last 20"
for world in 1 2 4 8; do
  echo "  $world rank(s): $(one "$world" --training.steps 40 --metrics.log_freq 20 | awk '{printf "%.3f ms/step decision, %.1f ms/step total (%.2f %%)", $3, $1, 100 * $3 / $1}')"
done
