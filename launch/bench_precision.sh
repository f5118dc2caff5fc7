#!/usr/bin/env bash
# Mixed-precision figures on the CPU (issue 12): tokens/s and peak resident memory per rank of
# lockstep in float32, bfloat16 and float16 (dynamic loss scaling), on the default job and on a
# dim-512 x 4-layer GPT, on 1 and 2 ranks; as ratios to lockstep fp32 measured in the same run,
# and, on one rank, to a plain PyTorch eager trainer of the same GPT (launch/reference_gpt.py;
# fp32, and bf16 / fp16 under torch.autocast). Rounds are interleaved (every configuration once
# per round) and the median round counts. The first WARMUP steps of every run are not timed.
#
#   launch/bench_precision.sh [ROUNDS=3] [STEPS=20]
# fp16 has no fast matrix product on CPUs without AVX512-FP16 (about 50x slower than fp32
# here): its dim-512 runs take 2 timed steps, in the first round only.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds="${1:-3}"
steps="${2:-20}"
warmup=5
bin="${LOCKSTEP_BUILD_DIR:-$root/build}/bin"
python="$root/.venv/bin/python"
[[ -x "$bin/lockstep" && -x "$bin/lockstep-run" ]] || { echo "bench_precision: build first (launch/setup.sh)" >&2; exit 1; }
"$python" -c "import torch" 2>/dev/null || { echo "bench_precision: $python has no torch; run launch/setup.sh --tests" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
results="$tmp/results.jsonl"

declare -A model_args=(
  [default]=""
  [gpt512]="--model.dim 512 --model.n_layers 4 --model.n_heads 8 --training.seq_len 128 --training.local_batch_size 8"
)
declare -A ref_args=(
  [default]="--dim 128 --layers 2 --heads 4 --seq 64 --batch 16"
  [gpt512]="--dim 512 --layers 4 --heads 8 --seq 128 --batch 8"
)

# lockstep on RANKS ranks: appends {"trainer": "lockstep", ...} with the timed tokens/s (from
# metrics.jsonl: the steps after the first WARMUP) and the largest per-rank peak RSS.
run_lockstep() {  # MODEL RANKS PRECISION TIMED_STEPS
  local model="$1" n="$2" precision="$3" timed="$4"
  local threads=$((2 / n)) scale=none
  [[ "$precision" == float16 ]] && scale=dynamic
  rm -rf "$tmp/run"
  # shellcheck disable=SC2206
  local args=(train --job.dump_folder "$tmp/run" --training.steps $((warmup + timed))
              --metrics.log_freq "$warmup" --checkpoint.enable false --training.threads "$threads"
              --training.mixed_precision_param "$precision" --training.loss_scale "$scale"
              ${model_args[$model]})
  if [[ "$n" == 1 ]]; then
    "$bin/lockstep" "${args[@]}" >"$tmp/out" 2>&1
  else
    "$bin/lockstep-run" --nproc-per-node "$n" -- "$bin/lockstep" "${args[@]}" >"$tmp/out" 2>&1
  fi || { cat "$tmp/out" >&2; echo "bench_precision: run failed: ${args[*]}" >&2; exit 1; }
  "$python" - "$tmp/run" "$n" "$model" "$precision" "$warmup" >>"$results" <<'PY'
import json, re, sys
run, n, model, precision, warmup = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
m = [r for r in map(json.loads, open(f"{run}/metrics.jsonl")) if "event" not in r]
first = next(r for r in m if r["step"] == warmup)
last = m[-1]
tokens = last["tokens_seen"] - first["tokens_seen"]
peaks = []
for r in range(n):
    done = [l for l in open(f"{run}/logs/rank{r}.log") if "done:" in l][-1]
    peaks.append(float(re.search(r"peak resident memory (\d+) MiB", done).group(1)))
print(json.dumps({"trainer": "lockstep", "model": model, "ranks": n, "precision": precision,
                  "tokens_per_s": tokens / (last["elapsed_s"] - first["elapsed_s"]),
                  "peak_rss_mib": max(peaks), "final_loss": last["loss"]}))
PY
}

run_reference() {  # MODEL PRECISION TIMED_STEPS
  local model="$1" precision="$2" timed="$3"
  # shellcheck disable=SC2086
  "$python" "$root/launch/reference_gpt.py" ${ref_args[$model]} --steps "$timed" \
    --warmup-steps "$warmup" --precision "$precision" --threads 2 \
    | "$python" -c "import json,sys; r=json.loads(sys.stdin.read()); r.update(model='$model', ranks=1, trainer='pytorch'); print(json.dumps(r))" \
    >>"$results"
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%F)"
echo "cpu flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_bf16|avx512_fp16|amx_bf16|amx_tile)$' | tr '\n' ' ')"
"$python" -c "import torch; print('pytorch', torch.__version__, '| lockstep', end=' ')"; "$bin/lockstep" version | head -2 | tr '\n' ' '; echo
echo "$rounds interleaved rounds, $warmup untimed + $steps timed steps per run (fp16 dim 512: 2 timed, first round); 1 rank = 2 threads, 2 ranks = 1 thread each (gloo)"
for ((round = 1; round <= rounds; ++round)); do
  for model in default gpt512; do
    for precision in float32 bfloat16 float16; do
      timed="$steps"
      if [[ "$precision" == float16 && "$model" == gpt512 ]]; then
        ((round == 1)) || continue
        timed=2
      fi
      run_lockstep "$model" 1 "$precision" "$timed"
      [[ "$precision" == float16 && "$model" == gpt512 ]] || run_lockstep "$model" 2 "$precision" "$timed"
      run_reference "$model" "$precision" "$timed"
    done
  done
  echo "round $round of $rounds done" >&2
done

"$python" - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def med(**key):
    xs = [r for r in rows if all(r[k] == v for k, v in key.items())]
    return (statistics.median(r["tokens_per_s"] for r in xs), max(r["peak_rss_mib"] for r in xs), len(xs)) if xs else None
print(f'{"model":<8} {"ranks":>5} {"precision":<9} | {"tok/s":>8} {"peak MiB/rank":>13} {"runs":>4} | {"x lockstep fp32":>15} | {"pytorch tok/s":>13} {"x pytorch":>9}')
for model in ("default", "gpt512"):
    for n in (1, 2):
        base = med(trainer="lockstep", model=model, ranks=n, precision="float32")
        for p in ("float32", "bfloat16", "float16"):
            r = med(trainer="lockstep", model=model, ranks=n, precision=p)
            if not r: continue
            ref = med(trainer="pytorch", model=model, precision=p) if n == 1 else None
            ref_s = f'{ref[0]:>13.0f} {r[0] / ref[0]:>8.2f}x' if ref else f'{"-":>13} {"-":>9}'
            print(f'{model:<8} {n:>5} {p:<9} | {r[0]:>8.0f} {r[1]:>13.0f} {r[2]:>4} | {r[0] / base[0]:>14.2f}x | {ref_s}')
PY
