#!/usr/bin/env bash
# fsdp (ZeRO-3) and activation recomputation on CPU ranks over Gloo:
#
#  1. Memory: a Llama whose training state dominates (dim 512, 8 blocks, vocab 32,000: 60 M
#     parameters, 16 bytes each in ddp), 1 sequence of 64 tokens a rank, in ddp, sharded and
#     fsdp (overlap on) at 1, 2 and 4 ranks (4 oversubscribe 2 cores). Printed per run: the
#     largest peak resident memory of any rank during training (the peak restarts after setup),
#     the memory plan's total for it (`lockstep config check`'s per-rank plan), and their ratio.
#     No allocator settings: the trainer's malloc is jemalloc (as a user runs it; `lockstep
#     version` says which).
#  2. Recomputation's memory: one rank, the Llama with dim 256, 4 blocks, seq 2048 x 2, with
#     activation_checkpoint.mode none, selective (every 2nd block) and full: peak and plan.
#  3. Step time, same run: fsdp against sharded on 2 ranks (the 60 M model, 4 x 64 tokens a
#     rank), fsdp with parallelism.prefetch off, in interleaved rounds; and recomputation's cost
#     (full against none, one rank, model of part 2 at seq 512). With RATE (e.g. 4gbit) the
#     loopback is shaped to that rate (tc token bucket, root only; removed at exit), so the wire
#     rather than the CPU bounds the transfers, as between machines.
#
#   launch/bench_fsdp.sh [ROUNDS=3] [STEPS=6] [RATE]    (LOCKSTEP_BENCH_PARTS="memory" or "speed": one part)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bench_common.sh"
bench_init bench_fsdp
rounds="${1:-3}"
steps="${2:-6}"
rate="${3:-}"
big="--model.name llama --model.dim 512 --model.n_layers 8 --model.n_heads 8 --model.vocab_size 32000
     --model.multiple_of 256 --training.seq_len 64 --training.threads 1"
long="--model.name llama --model.dim 256 --model.n_layers 4 --model.n_heads 4 --model.vocab_size 256
      --model.multiple_of 256 --training.threads 1"

# One run on $1 ranks with the rest as arguments. Prints "peak_mib plan_mib ms_per_step": the
# largest training peak of any rank, the plan's total per rank, the median step time.
one() {
  local world="$1"
  shift
  rm -rf "$tmp/run"
  "$bin/lockstep-run" --nproc-per-node "$world" -- "$bin/lockstep" train --job.dump_folder "$tmp/run" \
    --checkpoint.enable false --diagnostics.verify_every 0 "$@" >"$tmp/log" 2>&1 ||
    { echo "bench_fsdp: a run failed: $*" >&2; tail -3 "$tmp/log" >&2; exit 1; }
  python3 - "$tmp/run" "$world" <<'PY'
import json, re, statistics, sys
run, world = sys.argv[1], int(sys.argv[2])
mib = lambda text: float(text.split()[0]) * (1024 if text.split()[1] == "GiB" else 1)
peak, plan = 0.0, 0.0
for r in range(world):
    log = open(f"{run}/logs/rank{r}.log").read()
    peak = max(peak, float(re.findall(r"peak resident memory (\d+) MiB", log)[-1]))
    # the plan's parts (state, activations, runtime), to a tenth of a MiB
    parts = re.search(r"memory plan per rank: .*?\(([0-9.]+ [MG]iB) of state.*?, ([0-9.]+ [MG]iB) of "
                      r"activations, ([0-9.]+ [MG]iB) of runtime\)", log).groups()
    plan = sum(mib(x) for x in parts)
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if "ms_per_step" in l]
print(peak, plan, statistics.median(r["ms_per_step"] for r in rows[1:] or rows))
PY
}

machine() {
  echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
    "flags: $(grep -m1 -o -w -E 'avx512f|avx512_bf16|avx2' /proc/cpuinfo | sort -u | xargs)," \
    "$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
}

memory() {
  echo "== 1. peak resident memory per rank in training (60 M-parameter Llama, 1 x 64 tokens a rank)"
  printf "%-8s %5s %12s %12s %8s\n" mode ranks "measured" "plan" "ratio"
  for mode in ddp sharded fsdp; do
    for world in 1 2 4; do
      # shellcheck disable=SC2086
      read -r peak plan _ < <(one "$world" $big --training.local_batch_size 1 --training.steps 3 \
        --parallelism.mode "$mode" --parallelism.overlap "$([[ $mode == fsdp ]] && echo true || echo false)")
      printf "%-8s %5d %8.0f MiB %8.0f MiB %8.2f\n" "$mode" "$world" "$peak" "$plan" \
        "$(python3 -c "print($peak / $plan)")"
    done
  done
  echo "== 2. activation recomputation, one rank (Llama dim 256, 4 blocks, 2 x 2048 tokens)"
  printf "%-10s %12s %12s %8s\n" mode "measured" "plan" "ratio"
  for ac in none selective full; do
    # shellcheck disable=SC2086
    read -r peak plan _ < <(one 1 $long --training.local_batch_size 2 --training.seq_len 2048 \
      --model.max_seq_len 2048 --training.steps 2 --activation_checkpoint.mode "$ac")
    printf "%-10s %8.0f MiB %8.0f MiB %8.2f\n" "$ac" "$peak" "$plan" "$(python3 -c "print($peak / $plan)")"
  done
}

speed() {
  echo "== 3. step time, median ms/step over $rounds interleaved rounds of $steps steps${rate:+, loopback shaped to $rate}"
  : >"$tmp/sharded" && : >"$tmp/fsdp" && : >"$tmp/noprefetch" && : >"$tmp/none" && : >"$tmp/full"
  for ((i = 0; i < rounds; ++i)); do
    # shellcheck disable=SC2086
    {
      one 2 $big --training.local_batch_size 4 --training.steps "$steps" --parallelism.mode sharded >>"$tmp/sharded"
      one 2 $big --training.local_batch_size 4 --training.steps "$steps" --parallelism.mode fsdp \
        --parallelism.overlap true >>"$tmp/fsdp"
      one 2 $big --training.local_batch_size 4 --training.steps "$steps" --parallelism.mode fsdp \
        --parallelism.overlap true --parallelism.prefetch false >>"$tmp/noprefetch"
      one 1 $long --training.local_batch_size 2 --training.seq_len 512 --model.max_seq_len 512 \
        --training.steps "$steps" >>"$tmp/none"
      one 1 $long --training.local_batch_size 2 --training.seq_len 512 --model.max_seq_len 512 \
        --training.steps "$steps" --activation_checkpoint.mode full >>"$tmp/full"
    }
  done
  python3 - "$tmp" <<'PY'
import statistics, sys
tmp = sys.argv[1]
med = lambda n: statistics.median(float(l.split()[2]) for l in open(f"{tmp}/{n}") if l.strip())
s, f, n, a, c = (med(x) for x in ("sharded", "fsdp", "noprefetch", "none", "full"))
print(f"2 ranks, 60 M Llama, 4 x 64 tokens a rank: sharded {s:.0f} ms, fsdp {f:.0f} ms "
      f"(x{f / s:.2f}), fsdp without prefetch {n:.0f} ms (x{n / s:.2f}; prefetch saves x{n / f:.2f})")
print(f"1 rank, Llama dim 256 x 4 blocks, 2 x 512 tokens: no recomputation {a:.0f} ms, "
      f"full recomputation {c:.0f} ms (x{c / a:.2f})")
PY
}

parts="${LOCKSTEP_BENCH_PARTS:-memory speed}"
machine
if [[ $parts == *memory* ]]; then memory; fi
if [[ -n "$rate" ]] && ! shape_loopback "$rate"; then rate=""; fi
if [[ $parts == *speed* ]]; then speed; fi
