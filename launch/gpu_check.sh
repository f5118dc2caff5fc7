#!/usr/bin/env bash
# Builds lockstep on a GPU machine that has CUDA, nvcc, CMake, Ninja and a CUDA torch (in its
# python3) but no package registry, runs every `gpu`-labelled test and the GPU benchmarks, and
# writes the results into OUT_DIR. The other build dependencies come from .gpu-deps/debs
# (made by launch/gpu_deps.sh on a machine with Debian's registry), unpacked without dpkg.
# A GPU lease is short: every stage has a time cap, the stages run most-wanted first, and a
# stage that would start after LOCKSTEP_GPU_DEADLINE seconds (default 540) is skipped and says so.
#   launch/gpu_check.sh OUT_DIR
set -uo pipefail
out="${1:?usage: launch/gpu_check.sh OUT_DIR}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${LOCKSTEP_GPU_BUILD_DIR:-$root/build-gpu}"
deadline="${LOCKSTEP_GPU_DEADLINE:-540}"
mkdir -p "$out"
log() { printf '[gpu_check %(%H:%M:%S)T +%ds] %s\n' -1 "$SECONDS" "$*" | tee -a "$out/summary.txt"; }
status=0
# capped SECONDS CMD...: runs CMD for at most SECONDS, and never past the deadline.
capped() {
  local cap="$1" left=$((deadline - SECONDS))
  shift
  ((left < cap)) && cap=$left
  if ((cap < 5)); then
    log "out of time, skipped: $*"
    return 124
  fi
  timeout -k 5 "$cap" "$@"
}

# --- dependencies carried as Debian packages -----------------------------------------------
deps="$root/.gpu-deps"
prefix_path=""
if compgen -G "$deps/debs/*.deb" >/dev/null; then
  mkdir -p "$deps/root"
  for d in "$deps"/debs/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$d" "$deps/root"
    else  # a .deb is an ar archive holding data.tar.{xz,zst,gz}
      member=$(ar t "$d" | grep '^data.tar')
      case "$member" in
        *.xz) flag=-J ;; *.zst) flag=--zstd ;; *.gz) flag=-z ;; *) flag= ;;
      esac
      ar p "$d" "$member" | tar -x $flag -C "$deps/root" -f -
    fi
  done
  prefix_path="$deps/root/usr"
  export LD_LIBRARY_PATH="$deps/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  log "using carried packages: $(ls "$deps/debs" | tr '\n' ' ')"
fi

torch_dir=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))') || {
  log "python3 has no torch"; exit 1; }
nvcc_path=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
cuda_root=$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")
log "torch $(python3 -c 'import torch; print(torch.__version__)') at $torch_dir; CUDA at $cuda_root"
{ nvidia-smi; } >"$out/nvidia-smi.txt" 2>&1

# --- build ---------------------------------------------------------------------------------
if ! cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_dir/share/cmake;$prefix_path" \
    -DLOCKSTEP_CUDA=ON -DLOCKSTEP_MPI=OFF -DTORCH_CUDA_ARCH_LIST=9.0 \
    -DCMAKE_CUDA_COMPILER="$cuda_root/bin/nvcc" -DCUDA_TOOLKIT_ROOT_DIR="$cuda_root" \
    -DCUDAToolkit_ROOT="$cuda_root" -DCMAKE_EXE_LINKER_FLAGS=-rdynamic \
    >"$out/configure.log" 2>&1; then
  log "configure FAILED (configure.log)"; tail -30 "$out/configure.log"; exit 1
fi
start=$SECONDS
if ! cmake --build "$build" -j "$(nproc)" --target lockstep lockstep-run lockstep_gpu_tests \
    >"$out/build.log" 2>&1; then
  log "build FAILED (build.log)"; grep -E "error|FAILED" "$out/build.log" | head -30; exit 1
fi
log "built in $((SECONDS - start)) s"
"$build/bin/lockstep" version >"$out/version.txt" 2>&1
cat "$out/version.txt"

# --- GPU tests: each in its own process (as ctest runs them), three at a time ------------------
tests=$("$build/bin/lockstep_gpu_tests" --gtest_list_tests | awk '/^[^ ]/ {suite=$1} /^  / {print suite $1}')
mkdir -p "$out/tests"
one_test() {  # NAME: PASS / FAIL / SKIP, its log in tests/NAME.log
  local name="$1" rc
  timeout -k 5 150 "$build/bin/lockstep_gpu_tests" --gtest_filter="$name" >"$out/tests/$name.log" 2>&1
  rc=$?
  if ((rc != 0)); then echo "FAIL $name (exit $rc)"
  elif grep -q '\[  SKIPPED \]' "$out/tests/$name.log"; then echo "SKIP $name"
  else echo "PASS $name"; fi
}
export -f one_test
export build out
capped 300 xargs -P 3 -I{} bash -c 'one_test {}' <<<"$tests" >"$out/gpu_tests.txt" 2>&1
sort -o "$out/gpu_tests.txt" "$out/gpu_tests.txt"
grep -q '^FAIL' "$out/gpu_tests.txt" && status=1
log "gpu tests: $(grep -c '^PASS' "$out/gpu_tests.txt") passed, $(grep -c '^FAIL' "$out/gpu_tests.txt") failed, $(grep -c '^SKIP' "$out/gpu_tests.txt") skipped of $(wc -w <<<"$tests")"
grep -v '^PASS' "$out/gpu_tests.txt" | tee -a "$out/summary.txt"

# --- the training loop on the GPU ---------------------------------------------------------
capped 90 "$build/bin/lockstep" train --training.device cuda --job.dump_folder "$build/run-gpu" \
  --checkpoint.load_step 0 --training.steps 200 --metrics.log_freq 50 >"$out/train_gpu.log" 2>&1 \
  || status=1
tail -3 "$out/train_gpu.log" | tee -a "$out/summary.txt"

# --- host syncs per step, and where they are --------------------------------------------------
# LOCKSTEP_CUDA_SYNC_DEBUG=warn prints every synchronizing CUDA operation of a step (from the
# third step of a process on) with its stack: the prints of a 30-step run minus those of a
# 10-step run, over 20, are the syncs of one clean step; the stacks of the 30-step run, grouped,
# say where they are.
sync_run() {  # LOG STEPS ARGS...: one watched run's output into LOG
  local file="$1" steps="$2"
  shift 2
  rm -rf "$build/run-sync"
  capped 60 env LOCKSTEP_CUDA_SYNC_DEBUG=warn "$build/bin/lockstep" train --training.device cuda \
    --job.dump_folder "$build/run-sync" --checkpoint.enable false --metrics.log_freq 1000 \
    --training.steps "$steps" "$@" >"$file" 2>&1
}
# On a GPU every one of these is decided on the device (skip.device_decision = "auto") and read
# a step later, but the first, which the host decides (one read of the table per step).
for side in "--skip.enabled true --skip.device_decision off" "--skip.enabled false" \
    "--skip.enabled true" "--skip.enabled true --skip.on_global_spike skip" \
    "--skip.enabled true --training.mixed_precision_param bfloat16"; do
  # shellcheck disable=SC2086
  sync_run "$out/sync_10.log" 10 $side
  # shellcheck disable=SC2086
  sync_run "$out/sync_30.log" 30 $side
  a=$(grep -c "synchronizing CUDA operation" "$out/sync_10.log")
  b=$(grep -c "synchronizing CUDA operation" "$out/sync_30.log")
  log "host syncs per clean step ($side): $(python3 -c "print(($b - $a) / 20)") (10 steps $a, 30 steps $b)"
  python3 - "$out/sync_30.log" "$side" <<'PY' >>"$out/sync_sites.txt"
import collections, re, sys
text, side = open(sys.argv[1]).read(), sys.argv[2]
sites = collections.Counter()
for block in text.split("lockstep: host sync: called a synchronizing CUDA operation")[1:]:
    frames = [l.strip() for l in block.strip().splitlines()[:32] if "lockstep" in l]
    sites[" <- ".join(re.sub(r"\s*\+\s*0x[0-9a-f]+.*$", "", f) for f in frames[:4]) or "?"] += 1
plain = text.count("synchronizing CUDA operation") - sum(sites.values())
print(f"== {side}: 30 steps (28 watched)")
for site, n in sites.most_common():
    print(f"{n:5d}  {site}")
if plain:
    print(f"{plain:5d}  (on another thread: no stack)")
PY
done
cat "$out/sync_sites.txt"

# --- the check kernel's DRAM bandwidth, read by Nsight Compute ----------------------------------
if command -v ncu >/dev/null; then
  capped 90 ncu --kernel-name regex:check --launch-count 3 \
    --metrics dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum \
    "$build/bin/lockstep" bench gradcheck --device cuda --sizes 1024 --dtypes fp32 bf16 \
    --layouts few --min-seconds 0.05 >"$out/ncu_gradcheck.txt" 2>&1 || status=1
  log "ncu: $(grep -E 'dram__throughput|gpu__time_duration' "$out/ncu_gradcheck.txt" | head -4 | tr -s ' ' | tr '\n' ';')"
else
  log "no ncu on PATH: DRAM bandwidth not read"
fi

# --- the check's benchmark ----------------------------------------------------------------------
capped 60 "$build/bin/lockstep" bench gradcheck --device cuda --dtypes fp32 bf16 --layouts few \
  --sizes 1 16 256 1024 4096 --min-seconds 0.2 >"$out/bench_gradcheck.txt" 2>&1 || status=1
# 10,000 tensors: the per-tensor baselines are slow there, so fewer sizes
capped 45 "$build/bin/lockstep" bench gradcheck --device cuda --dtypes fp32 --layouts many \
  --sizes 1 256 4096 --min-seconds 0.2 2>&1 | tail -n +4 >>"$out/bench_gradcheck.txt" || status=1
cat "$out/bench_gradcheck.txt"

# --- the skip machinery's cost on the GPU -------------------------------------------------------
skip_cost() {  # ARGS...: ms/step of 300 steps (the metrics' last record)
  rm -rf "$build/run-skip"
  capped 40 "$build/bin/lockstep" train --training.device cuda --job.dump_folder "$build/run-skip" \
    --checkpoint.enable false --training.steps 300 --metrics.log_freq 300 "$@" >/dev/null 2>&1 \
    || { echo nan; return; }
  python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["ms_per_step"])' \
    "$build/run-skip/metrics.jsonl"
}
ratio() { python3 -c "print(round((float('$1') + float('$2')) / (float('$3') + float('$4')), 3))"; }
host=(--skip.enabled true --skip.device_decision off)  # the host decides (one sync per step)
off1=$(skip_cost --skip.enabled false) on1=$(skip_cost --skip.enabled true) h1=$(skip_cost "${host[@]}")
off2=$(skip_cost --skip.enabled false) on2=$(skip_cost --skip.enabled true) h2=$(skip_cost "${host[@]}")
log "skip machinery on vs off, both decided on the device (default model, 300 steps, two interleaved rounds): off $off1 / $off2 ms, on $on1 / $on2 ms, ratio $(ratio "$on1" "$on2" "$off1" "$off2")"
log "skip on, decided on the device vs on the host: device $on1 / $on2 ms, host $h1 / $h2 ms, ratio $(ratio "$on1" "$on2" "$h1" "$h2")"

# --- sanitizers: the in-process gpu tests once under memcheck and once under racecheck ---------
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    capped 75 compute-sanitizer --tool "$tool" --error-exitcode 1 \
      "$build/bin/lockstep_gpu_tests" --gtest_filter='GradCheckCuda.*:DecisionCoreCuda.*' \
      >"$out/sanitizer_$tool.log" 2>&1 || status=1
    log "compute-sanitizer $tool: $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$out/sanitizer_$tool.log" | tail -2 | tr '\n' ' ')"
  done
else
  log "no compute-sanitizer on PATH: memcheck and racecheck skipped"
fi
# --- a larger GPT in bf16 and fp32 (TF32), and a 0.8 B Llama in bf16: tokens/s and MFU ----------
# (the trainer's MFU: torchtitan's FLOPs per token against the known peak of this GPU)
gpt_model=(--model.dim 1024 --model.n_layers 12 --model.n_heads 16 --model.max_seq_len 1024
           --training.seq_len 1024 --training.local_batch_size 8 --checkpoint.enable false
           --training.steps 60 --metrics.log_freq 20)
llama_model=(--model.name llama --model.dim 2048 --model.n_layers 16 --model.n_heads 16
             --model.n_kv_heads 8 --model.rope_theta 500000 --model.max_seq_len 2048
             --training.seq_len 2048 --training.local_batch_size 4 --checkpoint.enable false
             --training.steps 40 --metrics.log_freq 10)
throughput() {  # name, log: the last progress line's tok/s and MFU
  python3 - "$2" "$1" <<'PY' | tee -a "$out/summary.txt"
import re, sys
text, name = open(sys.argv[1]).read(), sys.argv[2]
params = re.search(r"model \w+, ([\d,]+) parameters", text)
tok_s = re.findall(r"tok/s (\d+)", text)
mfu = re.findall(r"MFU ([\d.]+)%", text)
print(f"{name}: {params.group(1) if params else '?'} parameters, "
      f"{tok_s[-1] if tok_s else '?'} tok/s, MFU {mfu[-1] + '%' if mfu else '?'}")
PY
}
for precision in bfloat16 float32; do
  capped 60 "$build/bin/lockstep" train --training.device cuda \
    --training.mixed_precision_param "$precision" "${gpt_model[@]}" \
    --job.dump_folder "$build/run-gpu-$precision" >"$out/train_gpu_$precision.log" 2>&1 || status=1
  throughput "GPT seq 1024 batch 8 $precision" "$out/train_gpu_$precision.log"
done
capped 60 "$build/bin/lockstep" train --training.device cuda --training.mixed_precision_param bfloat16 \
  "${llama_model[@]}" --job.dump_folder "$build/run-gpu-llama" >"$out/train_gpu_llama.log" 2>&1 \
  || status=1
throughput "Llama seq 2048 batch 4 bfloat16" "$out/train_gpu_llama.log"

log "done, status $status"
exit $status
