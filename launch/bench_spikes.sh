#!/usr/bin/env bash
# The spike benchmark (issue 28): does a policy end a run better? A small Llama on real text (the
# King James Bible from Debian's bible-kjv package, byte-level shards by `lockstep data shard`),
# trained clean, with injected bad data (random NaN-loss samples and x1000 loss spikes, 1 % of
# steps), spiky (x20 loss spikes, the gradient with them, on 5 % of steps: nothing nonfinite, so
# the policies that cannot skip finish too) and unstable (no fault: a recipe whose gradient norm
# spikes on its own — bf16 compute, no warm-up, constant lr, beta2 0.999, no weight decay), under
# each policy, several seeds each. LOCKSTEP_BENCH_CONDITIONS="clean bad" runs some of them (the
# table summarises every condition whose runs are in the work folder). Printed per policy and condition: runs that
# ended without finishing (a guard or the stock abort on a nonfinite value), loss spikes (rule
# below), steps skipped and clipped, the final validation loss (mean and spread over the runs
# that finished) and tokens/s, with the machine and sizes.
#
#   launch/bench_spikes.sh [--smoke]     # --smoke: clean and bad, 1 seed, 30 steps of 4 x 64
#                                        # tokens, faults on 10 %: under 30 s (ctest runs it)
#
# More seeds: LOCKSTEP_BENCH_FIRST_SEED=4 LOCKSTEP_BENCH_SEEDS=9 runs seeds 4 to 9 beside the runs
# already in the work folder; the table counts every seed whose run is there.
#
# Loss spike: a taken step whose training loss exceeds 1.3 x the median of the 20 steps before
# it; grad-norm spike: one whose gradient norm exceeds 10 x theirs; steps with an injected fault
# left out. Policies (all with AdamW, lr 3e-2, cosine decay):
#   none       no clip, no skip (a nonfinite value aborts, as PyTorch's loop would crash)
#   max_norm   training.max_norm = 1.0, no skip (torchtitan's defence; it aborts on nonfinite)
#   olmo_skip  skip on a 6-sigma z-score over 128 steps, global spikes skipped too (OLMo-core's
#              rule; lockstep keeps outliers out of the window where OLMo-core keeps them in)
#   lockstep   today's default: skip local anomalies, take global spikes clipped to the window
#   zclip      skip.adaptive_clip = "zclip" (ZClip's EMA clip; local anomalies still skipped)
#   adagc      skip.adaptive_clip = "adagc" (AdaGC's per-tensor clip; local anomalies skipped)
#   +reset     the same with skip.spike_moment_reset (SPAM's reset of the moments a global
#              spike hit), for the policies that skip or clip global spikes
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${LOCKSTEP_BUILD_DIR:-$root/build}/bin"
[[ -x "$bin/lockstep" ]] || { echo "bench_spikes: build first (launch/setup.sh)" >&2; exit 1; }
smoke=0
[[ "${1:-}" == "--smoke" ]] && smoke=1
steps=$((smoke ? 30 : 600))
batch=$((smoke ? 4 : 16))
seeds="${LOCKSTEP_BENCH_SEEDS:-$((smoke ? 1 : 3))}"
first_seed="${LOCKSTEP_BENCH_FIRST_SEED:-1}"
fault_p=$([[ $smoke == 1 ]] && echo 0.1 || echo 0.01)  # the smoke's 30 steps still meet faults
work="${LOCKSTEP_BENCH_DIR:-$root/build/bench-spikes}"
mkdir -p "$work/runs"

if ! command -v bible >/dev/null; then
  if [[ $(id -u) -ne 0 ]]; then
    echo "bench_spikes: the corpus is Debian's bible-kjv; install it (apt-get install bible-kjv)" >&2
    exit 1
  fi
  apt-get install -y -q bible-kjv >/dev/null
fi
if [[ ! -s "$work/data/train_000001.bin" ]]; then
  bible -f "gen1:1-rev22:21" | sed 's/^[^ ]* //' >"$work/kjv.txt"  # verses without references
  rm -rf "$work/data"
  "$bin/lockstep" data shard "$work/data" --from "$work/kjv.txt" >/dev/null
fi

job=(--model.name llama --model.vocab_size 256 --model.dim 64 --model.n_layers 2
     --model.n_heads 4 --model.max_seq_len 64 --training.seq_len 64
     --training.local_batch_size "$batch" --training.steps "$steps" --training.threads 1
     --optimizer.lr 3e-2 --lr_scheduler.warmup_steps 20 --lr_scheduler.decay_type cosine
     --data.source file --data.path "$work/data/train_000001.bin"
     --validation.enable true --validation.dataset_path "$work/data/val_000000.bin"
     --validation.freq "$steps" --validation.steps $((smoke ? 2 : 16))
     --checkpoint.enable false --metrics.log_freq 1)
declare -A policy=(
  [none]="--skip.enabled false --training.max_norm 0"
  [max_norm]="--skip.enabled false --training.max_norm 1.0"
  [olmo_skip]="--skip.enabled true --skip.on_global_spike skip --skip.window 128 --training.max_norm 1.0"
  [lockstep]="--skip.enabled true --training.max_norm 1.0"
  [zclip]="--skip.enabled true --skip.adaptive_clip zclip --training.max_norm 1.0"
  [adagc]="--skip.enabled true --skip.adaptive_clip adagc --training.max_norm 1.0"
)
for p in olmo_skip lockstep adagc; do policy[$p+reset]="${policy[$p]} --skip.spike_moment_reset true"; done
order=(none max_norm olmo_skip olmo_skip+reset lockstep lockstep+reset zclip adagc adagc+reset)

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "job: Llama dim 64 x 2 layers (byte vocabulary), $batch x 64 tokens a step, $steps steps, 1 rank x 1 thread, seeds $first_seed to $seeds; corpus $(wc -c <"$work/kjv.txt") bytes of the King James Bible"
default_conditions=$([[ $smoke == 1 ]] && echo "clean bad" || echo "clean bad spiky unstable")
read -r -a conditions <<<"${LOCKSTEP_BENCH_CONDITIONS:-$default_conditions}"
unstable=(--training.mixed_precision_param bfloat16 --lr_scheduler.warmup_steps 0
          --lr_scheduler.decay_type constant --optimizer.beta2 0.999 --optimizer.weight_decay 0)
for cond in "${conditions[@]}"; do
  for name in "${order[@]}"; do
    for ((seed = first_seed; seed <= seeds; ++seed)); do
      run="$work/runs/$cond-$name-$seed"
      rm -rf "$run"
      faults=()
      [[ $cond == unstable ]] && faults=("${unstable[@]}")
      [[ $cond == bad ]] && faults=(--fault.random_p "$fault_p" --fault.random_seed "$seed"
                                    --fault.random_kinds "nan_loss, spike")
      [[ $cond == spiky ]] && faults=(--fault.random_p 0.05 --fault.random_seed "$seed"
                                      --fault.random_kinds spike --fault.spike_factor 20)
      # shellcheck disable=SC2086
      "$bin/lockstep" config faults --ranks 1 "${job[@]}" ${policy[$name]} "${faults[@]}" \
        --training.seed "$seed" >"$work/faults-$cond-$seed.jsonl"
      set +e
      # shellcheck disable=SC2086
      "$bin/lockstep" train --job.dump_folder "$run" "${job[@]}" ${policy[$name]} \
        "${faults[@]}" --training.seed "$seed" >"$run.log" 2>&1
      echo $? >"$run.exit"
      set -e
    done
  done
done

python3 - "$work" "$seeds" "${order[@]}" <<'PY'
import json, os, statistics, sys
work, seeds, order = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def records(run):
    path = f"{run}/metrics.jsonl"
    return [json.loads(l) for l in open(path)] if os.path.exists(path) else []

def spikes(steps, faulty, key, factor):
    n = 0
    for i in range(20, len(steps)):
        s = steps[i]
        if s["step"] in faulty or s["decision"] not in ("step", "clip"):
            continue
        before = [r[key] for r in steps[i - 20:i] if isinstance(r[key], float)]
        if before and s[key] > factor * statistics.median(before):
            n += 1
    return n

print("| condition | policy | runs finished | loss spikes | grad-norm spikes | skipped | clipped | tensor clips | moment resets | final val loss | tok/s |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for cond in ("clean", "bad", "spiky", "unstable"):
    if not os.path.exists(f"{work}/runs/{cond}-{order[0]}-1.exit"):
        continue
    for name in order:
        done, spk, gspk, skip, clip, tclip, reset, val, tps = 0, [], [], [], [], [], [], [], []
        ran = [s for s in range(1, seeds + 1) if os.path.exists(f"{work}/runs/{cond}-{name}-{s}.exit")]
        for seed in ran:
            run = f"{work}/runs/{cond}-{name}-{seed}"
            faulty = {json.loads(l)["step"] for l in open(f"{work}/faults-{cond}-{seed}.jsonl")}
            recs = records(run)
            steps = [r for r in recs if "event" not in r and isinstance(r.get("loss"), float)]
            vals = [r["val_loss"] for r in recs if r.get("event") == "validation"]
            if open(f"{run}.exit").read().strip() == "0" and vals:
                done += 1
                val.append(vals[-1])
            spk.append(spikes(steps, faulty, "loss", 1.3))
            gspk.append(spikes(steps, faulty, "grad_norm", 10.0))
            if steps:
                skip.append(steps[-1]["skipped_steps"])
                clip.append(steps[-1].get("clipped_steps", 0))
                tclip.append(steps[-1].get("tensor_clips", 0))
                reset.append(steps[-1].get("moment_resets", 0))
                tps.append(statistics.mean(r["tokens_per_s"] for r in steps))
        mean = lambda x: statistics.mean(x) if x else float("nan")
        spread = f" ± {statistics.pstdev(val):.3f}" if len(val) > 1 else ""
        print(f"| {cond} | {name} | {done} of {len(ran)} | {mean(spk):.1f} | {mean(gspk):.1f} | "
              f"{mean(skip):.1f} | "
              f"{mean(clip):.1f} | {mean(tclip):.1f} | {mean(reset):.1f} | "
              f"{mean(val):.3f}{spread} | {mean(tps):.0f} |")
PY
