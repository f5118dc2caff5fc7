#!/usr/bin/env bash
# Data-parallel figures on the CPU (issue 4): tokens/s of the embedded default model on 1, 2 and
# 4 ranks, ddp and sharded, at the same per-rank batch (so the step time against 1 rank is the
# data-parallel overhead), then the per-rank peak resident memory of a larger model, where the
# sharded optimizer state (1/W of the AdamW moments and master weights) shows. Every run's
# parameters must end bitwise equal on all ranks (their CRC32s are compared).
#
#   launch/bench_ranks.sh [STEPS=150]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
steps="${1:-150}"
bin="${LOCKSTEP_BUILD_DIR:-$root/build}/bin"
[[ -x "$bin/lockstep" && -x "$bin/lockstep-run" ]] || { echo "bench_ranks: build first (launch/setup.sh)" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# Runs one job; prints "tokens_per_s ms_per_step max_peak_rss_mib crc_agreement".
run() {  # run RANKS MODE STEPS ARGS...
  local n="$1" mode="$2" s="$3"
  shift 3
  rm -rf "$tmp/run"
  local args=(train --job.dump_folder "$tmp/run" --training.steps "$s" --checkpoint.enable false
              --metrics.log_freq "$s" --training.threads 1 --parallelism.mode "$mode" "$@")
  if [[ "$n" == 1 ]]; then
    "$bin/lockstep" "${args[@]}" >/dev/null 2>&1 || { echo "bench_ranks: run failed: ${args[*]}" >&2; exit 1; }
  else
    "$bin/lockstep-run" --nproc-per-node "$n" -- "$bin/lockstep" "${args[@]}" >/dev/null 2>&1 \
      || { echo "bench_ranks: run failed on $n ranks: ${args[*]}" >&2; exit 1; }
  fi
  python3 - "$tmp/run" "$n" <<'PY'
import json, re, sys
run, n = sys.argv[1], int(sys.argv[2])
m = json.loads(open(f"{run}/metrics.jsonl").read().splitlines()[-1])
peaks, crcs = [], set()
for r in range(n):
    done = [l for l in open(f"{run}/logs/rank{r}.log") if "done:" in l][-1]
    peaks.append(float(re.search(r"peak resident memory (\d+) MiB", done).group(1)))
    crcs.add(re.search(r"parameters crc32 (\w+)", done).group(1))
print(f'{m["tokens_per_s"]:.0f} {m["ms_per_step"]:.1f} {max(peaks):.0f} {"equal" if len(crcs) == 1 else "DIFFER"}')
PY
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%F)"
echo "throughput: embedded default model (0.45 M parameters), per-rank batch 16 x 64 tokens, 1 thread per rank, gloo over loopback, $steps steps"
printf '%-6s %-8s %12s %9s %18s %8s\n' ranks mode tokens/s ms/step "step vs 1 rank" weights
base=""
for n in 1 2 4; do
  for mode in ddp sharded; do
    [[ "$n" == 1 && "$mode" == sharded ]] && continue
    read -r tps ms rss crc < <(run "$n" "$mode" "$steps")
    [[ -z "$base" ]] && base="$ms"
    printf '%-6s %-8s %12s %9s %17.2fx %8s\n' "$n" "$mode" "$tps" "$ms" "$(python3 -c "print($ms / $base)")" "$crc"
  done
done

big=(--model.dim 512 --model.n_layers 4 --model.n_heads 8 --training.local_batch_size 2 --training.seq_len 64)
# glibc keeps freed heap memory resident and raises its mmap threshold as large blocks come
# and go, so RSS would show allocator history more than live tensors; a fixed threshold makes
# every tensor above 256 KiB its own mapping, returned to the system when freed.
export MALLOC_MMAP_THRESHOLD_=262144
echo
echo "memory (MALLOC_MMAP_THRESHOLD_=$MALLOC_MMAP_THRESHOLD_): dim 512, 4 layers (12.8 M parameters; AdamW moments 102 MB per rank in ddp), batch 2 x 64, 10 steps"
printf '%-6s %-8s %22s %8s\n' ranks mode "peak RSS per rank (MiB)" weights
for n in 1 2 4; do
  for mode in ddp sharded; do
    [[ "$n" == 1 && "$mode" == sharded ]] && continue
    read -r tps ms rss crc < <(run "$n" "$mode" 10 "${big[@]}")
    printf '%-6s %-8s %22s %8s\n' "$n" "$mode" "$rss" "$crc"
  done
done
