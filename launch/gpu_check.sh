#!/usr/bin/env bash
# The GPU lease's plan: builds lockstep on a GPU machine that has CUDA, nvcc, CMake, Ninja and a
# CUDA torch (in its python3) but no package registry, then runs the stages below in order, the
# measurements never made before first. The other build dependencies come from .gpu-deps/debs
# (made by launch/gpu_deps.sh on a machine with Debian's registry), unpacked without dpkg.
#
#   stage     budget s  what
#   build        150    configure and build lockstep, lockstep-run, lockstep_gpu_tests
#   decide       110    the device-decided vs the host-decided step in the same lease, interleaved:
#                       ms/step, the host's blocked time per step, parameters crc32 (must agree):
#                       fp32, bf16, fp16 with dynamic loss scaling, bf16 with overlap on, AdaGC
#                       with the moment reset (the per-tensor policies' kernels)
#   syncs         60    host syncs per clean step, both ways: c10's sync-debug count (30-step run
#                       minus 10-step run) and the host's timed blocking reads (metrics
#                       host_waits, which also sees the event wait sync-debug cannot)
#   fsdp          60    fsdp + full recomputation on one GPU: the 0.76 B Llama at seq 8192 x 16,
#                       which the memory plan refuses without recomputation (it does not fit),
#                       trains with it (tokens/s, MFU, peak memory); and the peer stage's Llama
#                       shape in fsdp + recomputation (tokens/s, against the peer stage's figures)
#   peer         180    the PyTorch peer on the same GPT and Llama shapes, eager and torch.compile
#                       (launch/peer_torch.py), against lockstep: tokens/s and the ratios
#   pytorch      100    the PyTorch package built against this torch (CUDA kernels for sm_90), the
#                       guarded step vs clip_grad_norm_ + optimizer.step() (launch/bench_guard.py):
#                       ms/step ratios, host syncs of a clean guarded step
#   tests         90    every `gpu` test, each in its own process (an empty list fails)
#   sanitize      50    compute-sanitizer memcheck and racecheck on the kernel tests
#   older        rest   measured in earlier leases: ncu of the check kernel, its benchmark, MFU
#
# A stage runs until its budget or LOCKSTEP_GPU_DEADLINE seconds after the start (default 540),
# whichever comes first; a stage with under 5 s left is skipped and says so. Everything lands
# in OUT_DIR, also on failure: summary.txt, each stage's logs, every run folder (runs/).
#   launch/gpu_check.sh OUT_DIR
set -uo pipefail
out="${1:?usage: launch/gpu_check.sh OUT_DIR}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${LOCKSTEP_GPU_BUILD_DIR:-$root/build-gpu}"
deadline="${LOCKSTEP_GPU_DEADLINE:-540}"
runs="$out/runs"
mkdir -p "$out" "$runs"
log() { printf '[gpu_check %(%H:%M:%S)T +%ds] %s\n' -1 "$SECONDS" "$*" | tee -a "$out/summary.txt"; }
status=0
stage_end=$deadline
# stage NAME BUDGET: the stages below it end at SECONDS + BUDGET (or the deadline).
stage() {
  stage_end=$((SECONDS + $2))
  ((stage_end > deadline)) && stage_end=$deadline
  log "== stage $1 (budget $2 s, until +$stage_end s)"
}
# capped SECONDS CMD...: runs CMD for at most SECONDS, never past its stage's end.
capped() {
  local cap="$1" left=$((stage_end - SECONDS))
  shift
  ((left < cap)) && cap=$left
  if ((cap < 5)); then
    log "out of time, skipped: $*"
    return 124
  fi
  timeout -k 5 "$cap" "$@"
}
lockstep() { "$build/bin/lockstep" "$@"; }

# --- build -----------------------------------------------------------------------------------
stage build 150
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
if ! capped 150 cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_dir/share/cmake;$prefix_path" \
    -DLOCKSTEP_CUDA=ON -DLOCKSTEP_MPI=OFF -DTORCH_CUDA_ARCH_LIST=9.0 \
    -DCMAKE_CUDA_COMPILER="$cuda_root/bin/nvcc" -DCUDA_TOOLKIT_ROOT_DIR="$cuda_root" \
    -DCUDAToolkit_ROOT="$cuda_root" -DCMAKE_EXE_LINKER_FLAGS=-rdynamic \
    >"$out/configure.log" 2>&1; then
  log "configure FAILED (configure.log)"; tail -30 "$out/configure.log"; exit 1
fi
start=$SECONDS
if ! capped 150 cmake --build "$build" -j "$(nproc)" --target lockstep lockstep-run \
    lockstep_gpu_tests >"$out/build.log" 2>&1; then
  log "build FAILED (build.log)"; grep -E "error|FAILED" "$out/build.log" | head -30; exit 1
fi
log "built in $((SECONDS - start)) s"
lockstep version >"$out/version.txt" 2>&1
cat "$out/version.txt"

# metric RUN KEY: the mean of KEY over the run's progress records after the first (warm-up).
metric() {
  python3 - "$runs/$1/metrics.jsonl" "$2" <<'PY' 2>/dev/null || echo nan
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"event"' not in l]
vals = [r[sys.argv[2]] for r in rows[1:] or rows if r.get(sys.argv[2]) is not None]
print(f"{sum(vals) / len(vals):.4g}" if vals else "nan")
PY
}
crc_of() { grep -o 'parameters crc32 [0-9a-f]*' "$runs/$1/logs/rank0.log" 2>/dev/null | tail -1 | cut -d' ' -f3; }
# train RUN CAP ARGS...: one single-GPU run into runs/RUN (its log beside it), no checkpoints.
train() {
  local name="$1" cap="$2"
  shift 2
  rm -rf "$runs/$name"
  capped "$cap" "$build/bin/lockstep" train --training.device cuda --job.dump_folder "$runs/$name" \
    --checkpoint.enable false "$@" >"$runs/$name.log" 2>&1
}

# --- decide: the device-decided step against the host-decided one -------------------------------
stage decide 110
decide_configs=("fp32|" "bf16|--training.mixed_precision_param bfloat16"
  "fp16-dynamic|--training.mixed_precision_param float16 --training.loss_scale dynamic"
  "bf16-overlap|--training.mixed_precision_param bfloat16 --parallelism.overlap true"
  "adagc-reset|--skip.adaptive_clip adagc --skip.adagc_warmup 20 --skip.spike_moment_reset true --skip.on_global_spike skip --fault.inject spike@150:0 --fault.spike_factor 100")
for entry in "${decide_configs[@]}"; do
  name="${entry%%|*}" args="${entry#*|}"
  for round in 1 2; do
    for side in device host; do
      mode=on; [[ $side == host ]] && mode=off
      # shellcheck disable=SC2086
      train "decide-$name-$side-$round" 20 --skip.enabled true --skip.device_decision "$mode" \
        --training.steps 300 --metrics.log_freq 100 $args || status=1
    done
  done
  d1=$(metric "decide-$name-device-1" ms_per_step) d2=$(metric "decide-$name-device-2" ms_per_step)
  h1=$(metric "decide-$name-host-1" ms_per_step) h2=$(metric "decide-$name-host-2" ms_per_step)
  same="crc32 $(crc_of "decide-$name-device-1") device, $(crc_of "decide-$name-host-1") host"
  log "decide $name: device $d1 / $d2 ms/step, host $h1 / $h2 ms/step, ratio device/host $(python3 -c "print(round(($d1 + $d2) / ($h1 + $h2), 3))" 2>/dev/null); host blocked $(metric "decide-$name-device-1" host_wait_ms) vs $(metric "decide-$name-host-1" host_wait_ms) ms/step; $same"
done

# --- syncs: host syncs per clean step, both ways ------------------------------------------------
# LOCKSTEP_CUDA_SYNC_DEBUG=warn prints every synchronizing CUDA operation of a step (from the
# third step of a process on) with its stack: a 30-step run's prints minus a 10-step run's, over
# 20, are one clean step's. c10 does not see an event wait; the host's timed blocking reads
# (metrics host_waits, host_wait_ms) do.
stage syncs 60
sync_configs=("host|--skip.enabled true --skip.device_decision off" "device|--skip.enabled true"
  "device-bf16|--skip.enabled true --training.mixed_precision_param bfloat16"
  "skip-off|--skip.enabled false")
for entry in "${sync_configs[@]}"; do
  name="${entry%%|*}" args="${entry#*|}"
  for steps in 10 30; do
    rm -rf "$runs/sync-$name-$steps"
    # shellcheck disable=SC2086
    capped 15 env LOCKSTEP_CUDA_SYNC_DEBUG=warn "$build/bin/lockstep" train --training.device cuda \
      --job.dump_folder "$runs/sync-$name-$steps" --checkpoint.enable false --metrics.log_freq 10 \
      --training.steps "$steps" $args >"$runs/sync-$name-$steps.log" 2>&1 || status=1
  done
  a=$(grep -c "synchronizing CUDA operation" "$runs/sync-$name-10.log")
  b=$(grep -c "synchronizing CUDA operation" "$runs/sync-$name-30.log")
  log "syncs $name: c10 sync-debug $(python3 -c "print(($b - $a) / 20)") per clean step; timed blocking reads $(metric "sync-$name-30" host_waits) per step, $(metric "sync-$name-30" host_wait_ms) ms"
done

# --- fsdp: parameter sharding and recomputation on the GPU (never ran before) -------------------
stage fsdp 60
llama=(--model.name llama --model.dim 2048 --model.n_layers 16 --model.n_heads 16
       --model.n_kv_heads 8 --model.rope_theta 500000 --model.max_seq_len 2048
       --training.seq_len 2048 --training.local_batch_size 4 --training.mixed_precision_param bfloat16)
long=(--model.name llama --model.dim 2048 --model.n_layers 16 --model.n_heads 16 --model.n_kv_heads 8
      --model.rope_theta 500000 --model.max_seq_len 8192 --training.seq_len 8192
      --training.local_batch_size 16 --training.mixed_precision_param bfloat16 --parallelism.mode fsdp)
train fsdp-long-none 10 "${long[@]}" --training.steps 2
log "fsdp 0.76 B Llama, 16 x 8192 tokens, no recomputation: exit $? ($(grep -o 'memory plan: each rank needs about [0-9.]* GiB' "$runs/fsdp-long-none.log" | head -1))"
train fsdp-long-full 40 "${long[@]}" --activation_checkpoint.mode full --training.steps 6 --metrics.log_freq 1 || status=1
log "fsdp 0.76 B Llama, 16 x 8192 tokens, full recomputation: $(last_tok_s fsdp-long-full) tok/s, MFU $(grep -o 'MFU [0-9.]*%' "$runs/fsdp-long-full.log" | tail -1), $(grep -o 'peak resident memory [0-9]* MiB' "$runs/fsdp-long-full.log" | tail -1) (host); $(grep -o 'memory plan per rank: [0-9.]* GiB' "$runs/fsdp-long-full/logs/rank0.log" | head -1)"
train fsdp-llama 25 "${llama[@]}" --parallelism.mode fsdp --activation_checkpoint.mode full --training.steps 20 --metrics.log_freq 10 || status=1
log "fsdp + full recomputation, the peer stage's Llama shape: $(last_tok_s fsdp-llama) tok/s (the peer stage: lockstep ddp and PyTorch on the same shape)"

# --- peer: PyTorch on the same models, eager and torch.compile ----------------------------------
stage peer 180
peer() {  # NAME CAP ARGS...: one peer run's JSON line into runs/NAME.json
  local name="$1" cap="$2"
  shift 2
  capped "$cap" python3 "$root/launch/peer_torch.py" --device cuda "$@" >"$runs/$name.json" \
    2>"$runs/$name.err" || { status=1; log "peer $name failed: $(tail -1 "$runs/$name.err")"; }
}
tok_s() { python3 -c 'import json,sys; print(round(json.loads(open(sys.argv[1]).read().splitlines()[-1])["tokens_per_s"]))' "$runs/$1.json" 2>/dev/null || echo nan; }
last_tok_s() { grep -o 'tok/s [0-9]*' "$runs/$1.log" 2>/dev/null | tail -1 | cut -d' ' -f2; }
gpt=(--model.dim 1024 --model.n_layers 12 --model.n_heads 16 --model.max_seq_len 1024
     --training.seq_len 1024 --training.local_batch_size 8 --training.mixed_precision_param bfloat16)
gpt_peer=(--model gpt --dim 1024 --layers 12 --heads 16 --seq 1024 --batch 8 --precision bfloat16)
llama=(--model.name llama --model.dim 2048 --model.n_layers 16 --model.n_heads 16
       --model.n_kv_heads 8 --model.rope_theta 500000 --model.max_seq_len 2048
       --training.seq_len 2048 --training.local_batch_size 4 --training.mixed_precision_param bfloat16)
llama_peer=(--model llama --dim 2048 --layers 16 --heads 16 --kv-heads 8 --rope-theta 500000
            --seq 2048 --batch 4 --precision bfloat16)
for m in gpt llama; do
  declare -n ours="$m" theirs="${m}_peer"
  train "peer-$m-lockstep" 35 "${ours[@]}" --training.steps 40 --metrics.log_freq 10 || status=1
  peer "peer-$m-eager" 30 "${theirs[@]}" --steps 20 --warmup 5
  peer "peer-$m-compile" 75 "${theirs[@]}" --steps 20 --warmup 5 --compile
  l=$(last_tok_s "peer-$m-lockstep") e=$(tok_s "peer-$m-eager") c=$(tok_s "peer-$m-compile")
  log "peer $m bf16: lockstep ${l:-nan} tok/s, PyTorch eager $e, torch.compile $c; lockstep/eager $(python3 -c "print(round($l / $e, 3))" 2>/dev/null || echo nan), lockstep/compile $(python3 -c "print(round($l / $c, 3))" 2>/dev/null || echo nan)"
  unset -n ours theirs
done

# --- pytorch: the PyTorch package (lockstep.torch) built against this machine's torch, on a GPU --
stage pytorch 100
pkg="$out/pytorch-package"
if CPATH="${prefix_path:+$prefix_path/include}" TORCH_CUDA_ARCH_LIST=9.0 CUDA_HOME="$cuda_root" \
    capped 70 "$root/launch/build_python.sh" python3 "$pkg" >"$out/pytorch-build.log" 2>&1; then
  # The guarded step vs clip_grad_norm_ + optimizer.step() (foreach: host-decided; fused:
  # device-decided) on one GPU, bf16-sized Llama in fp32, and its host syncs (sync debug mode).
  PYTHONPATH="$pkg/lib" capped 60 python3 "$root/launch/bench_guard.py" --device cuda \
    --dim 1024 --layers 8 --heads 16 --kv-heads 8 --vocab 32768 --seq 1024 --batch 8 \
    --steps 15 --warmup 3 >"$out/bench_guard.txt" 2>&1 || status=1
  log "pytorch guard: $(grep -E 'decision|model' "$out/bench_guard.txt" | tr '\n' ' ')"
else
  status=1
  log "pytorch package build FAILED (pytorch-build.log): $(grep -m3 -E 'error' "$out/pytorch-build.log" | tr '\n' ' ')"
fi

# --- tests: every gpu test in its own process (as ctest runs them), three at a time -------------
stage tests 90
tests=$("$build/bin/lockstep_gpu_tests" --gtest_list_tests | awk '/^[^ ]/ {suite=$1} /^  / {print suite $1}')
mkdir -p "$out/tests"
if [[ -z "$tests" ]]; then
  log "gpu tests: FAILED, lockstep_gpu_tests lists no test"
  status=1
else
  one_test() {  # NAME: PASS / FAIL / SKIP, its log in tests/NAME.log
    local name="$1" rc
    timeout -k 5 80 "$build/bin/lockstep_gpu_tests" --gtest_filter="$name" >"$out/tests/$name.log" 2>&1
    rc=$?
    if ((rc != 0)); then echo "FAIL $name (exit $rc)"
    elif grep -q '\[  SKIPPED \]' "$out/tests/$name.log"; then echo "SKIP $name"
    else echo "PASS $name"; fi
  }
  export -f one_test
  export build out
  capped 90 xargs -P 3 -I{} bash -c 'one_test {}' <<<"$tests" >"$out/gpu_tests.txt" 2>&1
  sort -o "$out/gpu_tests.txt" "$out/gpu_tests.txt"
  grep -q '^FAIL' "$out/gpu_tests.txt" && status=1
  ran=$(grep -c '^[A-Z]' "$out/gpu_tests.txt")
  log "gpu tests: $(grep -c '^PASS' "$out/gpu_tests.txt") passed, $(grep -c '^FAIL' "$out/gpu_tests.txt") failed, $(grep -c '^SKIP' "$out/gpu_tests.txt") skipped, $(($(wc -w <<<"$tests") - ran)) not run (time) of $(wc -w <<<"$tests")"
  grep -v '^PASS' "$out/gpu_tests.txt" | tee -a "$out/summary.txt"
fi

# --- sanitize: the kernel tests under memcheck and racecheck, small filters ---------------------
stage sanitize 50
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    capped 25 env LOCKSTEP_TEST_STEPS=200 compute-sanitizer --tool "$tool" --error-exitcode 1 \
      "$build/bin/lockstep_gpu_tests" --gtest_filter='GradCheckCuda.TinyTensorsShardsAndUnalignedViews:GradCheckCuda.EveryDtypeWithPlantedValues:DecisionCoreCuda.*:TensorActionsCuda.*' \
      >"$out/sanitizer_$tool.log" 2>&1 || status=1
    log "compute-sanitizer $tool: $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$out/sanitizer_$tool.log" | tail -2 | tr '\n' ' ')"
  done
else
  log "no compute-sanitizer on PATH: memcheck and racecheck skipped"
fi

# --- older: measured in earlier leases ---------------------------------------------------------
stage older $((deadline - SECONDS))
if command -v ncu >/dev/null; then
  capped 60 ncu --kernel-name regex:check --launch-count 3 \
    --metrics dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum \
    "$build/bin/lockstep" bench gradcheck --device cuda --sizes 1024 --dtypes fp32 bf16 \
    --layouts few --min-seconds 0.05 >"$out/ncu_gradcheck.txt" 2>&1 || status=1
  log "ncu: $(grep -E 'dram__throughput|gpu__time_duration' "$out/ncu_gradcheck.txt" | head -4 | tr -s ' ' | tr '\n' ';')"
fi
capped 45 "$build/bin/lockstep" bench gradcheck --device cuda --dtypes fp32 bf16 --layouts few many \
  --sizes 1 256 4096 --min-seconds 0.2 >"$out/bench_gradcheck.txt" 2>&1 || status=1
tail -n +1 "$out/bench_gradcheck.txt" | head -40
train gpt-fp32 40 "${gpt[@]/bfloat16/float32}" --training.steps 40 --metrics.log_freq 10 || status=1
log "GPT seq 1024 batch 8 fp32 (TF32): $(last_tok_s gpt-fp32) tok/s, MFU $(grep -o 'MFU [0-9.]*%' "$runs/gpt-fp32.log" | tail -1)"

log "done, status $status"
exit $status
