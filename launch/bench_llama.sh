#!/usr/bin/env bash
# The Llama model on the CPU (issue 14): tokens/s of lockstep's llama (torchtitan's debug model
# shape, configs/llama3_debug.toml: dim 256, 6 layers, 16 heads, seq 128, batch 8) on one rank
# with 2 threads, in float32 and bfloat16, against Hugging Face transformers' LlamaForCausalLM
# of the same shape trained in plain PyTorch eager (launch/reference_llama.py; bf16 under
# torch.autocast), measured in the same run. Rounds are interleaved and the median counts; the
# first WARMUP steps of every run are not timed.
#   launch/bench_llama.sh [ROUNDS=3] [STEPS=20]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds="${1:-3}"
steps="${2:-20}"
warmup=5
bin="${LOCKSTEP_BUILD_DIR:-$root/build}/bin"
python="$root/.venv/bin/python"
[[ -x "$bin/lockstep" ]] || { echo "bench_llama: build first (launch/setup.sh)" >&2; exit 1; }
"$python" -c "import transformers" 2>/dev/null || { echo "bench_llama: $python has no transformers; run launch/setup.sh --tests" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
results="$tmp/results.jsonl"

run_lockstep() {  # PRECISION
  rm -rf "$tmp/run"
  "$bin/lockstep" train --config "$root/configs/llama3_debug.toml" --job.dump_folder "$tmp/run" \
    --data.source synthetic --validation.enable false --checkpoint.enable false \
    --training.steps $((warmup + steps)) --metrics.log_freq "$warmup" --training.threads 2 \
    --training.mixed_precision_param "$1" >"$tmp/out" 2>&1 \
    || { cat "$tmp/out" >&2; echo "bench_llama: lockstep failed" >&2; exit 1; }
  "$python" - "$tmp/run" "$1" "$warmup" >>"$results" <<'PY'
import json, sys
run, precision, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3])
m = [r for r in map(json.loads, open(f"{run}/metrics.jsonl")) if "event" not in r]
first = next(r for r in m if r["step"] == warmup)
last = m[-1]
print(json.dumps({"trainer": "lockstep", "precision": precision,
                  "tokens_per_s": (last["tokens_seen"] - first["tokens_seen"]) / (last["elapsed_s"] - first["elapsed_s"])}))
PY
}

run_reference() {  # PRECISION
  "$python" "$root/launch/reference_llama.py" --dim 256 --layers 6 --heads 16 --ffn 768 --seq 128 \
    --batch 8 --steps $((warmup + steps)) --warmup "$warmup" --precision "$1" --threads 2 >>"$results"
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%F)"
echo "cpu flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_bf16|avx512_fp16|amx_bf16|amx_tile)$' | tr '\n' ' ')"
"$python" -c "import torch, transformers; print('pytorch', torch.__version__, '| transformers', transformers.__version__)"
echo "llama 5.2 M parameters (dim 256, 6 layers, 16 heads, ffn 768, vocab 256), seq 128 x batch 8, 1 rank, 2 threads; $rounds interleaved rounds of $warmup untimed + $steps timed steps"
for ((round = 1; round <= rounds; ++round)); do
  for precision in float32 bfloat16; do
    run_lockstep "$precision"
    run_reference "$precision"
  done
  echo "round $round of $rounds done" >&2
done
"$python" - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
med = lambda t, p: statistics.median(r["tokens_per_s"] for r in rows if r["trainer"] == t and r["precision"] == p)
print(f'{"precision":<9} | {"lockstep tok/s":>14} | {"transformers tok/s":>18} | {"lockstep / transformers":>23}')
for p in ("float32", "bfloat16"):
    a, b = med("lockstep", p), med("transformers", p)
    print(f'{p:<9} | {a:>14.0f} | {b:>18.0f} | {a / b:>22.2f}x')
PY
