#!/usr/bin/env bash
# The GPU lease's plan, one shot: builds lockstep on a GPU machine that has CUDA, nvcc, CMake,
# Ninja and a CUDA torch (in its python3) but no package registry, then runs the stages of
# `plan` in order, what never ran on a GPU first. The other build dependencies come from
# .gpu-deps/debs (launch/gpu_deps.sh, on a machine with Debian's registry), unpacked without
# dpkg; without them it stops at once. Each stage runs within its budget, the budgets add up to
# at most the deadline (checked before anything runs), and every command is capped by its
# stage's end. A failed command, a test that fails or does not run, or a device/host CRC
# mismatch makes the exit status 1; everything lands in OUT_DIR (summary.txt, logs, runs/).
#
#   launch/gpu_check.sh OUT_DIR
#   LOCKSTEP_GPU_DEADLINE=540      seconds for the whole plan
#   LOCKSTEP_GPU_DRY_RUN=1         walk every stage without running anything: each capped
#                                  command is logged and "takes" its cap on a virtual clock, so
#                                  the summary shows the worst case fits the deadline
set -uo pipefail
out="${1:?usage: launch/gpu_check.sh OUT_DIR}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${LOCKSTEP_GPU_BUILD_DIR:-$root/build-gpu}"
deps="${LOCKSTEP_GPU_DEPS:-$root/.gpu-deps}"
deadline="${LOCKSTEP_GPU_DEADLINE:-540}"
dry="${LOCKSTEP_GPU_DRY_RUN:-0}"
runs="$out/runs"

# stage|budget s|what — in the order they run.
plan=(
  "build|110|configure and build lockstep, lockstep-run and lockstep_gpu_tests; the PyTorch package then builds in the background (nice, 4 jobs) for the guard stage"
  "smoke|45|every gpu test in its own process, 4 at a time: the check, decision and per-tensor kernels that never ran on a GPU; a test that fails or does not run fails the run"
  "decide|100|the device-decided against the host-decided step: AdaGC + moment reset (the per-tensor kernels, the table form) first, fp16 dynamic, bf16 + overlap, fp32 (the record form's kernels, the default), fp32 with skip.exchange = table, then the 152 M GPT; ms/step, host ms waited, parameters crc32 (a mismatch fails the run)"
  "peer|90|PyTorch on the same GPT (eager, torch.compile) and Llama (eager) against lockstep: tok/s and the ratios"
  "syncs|35|host syncs of a clean step: c10's sync-debug count (30-step run minus 10-step run) and the milliseconds the host waited"
  "fsdp|55|fsdp + full recomputation: the 0.76 B Llama at 16 x 8192 tokens (refused without recomputation) and the peer stage's Llama shape"
  "guard|55|the PyTorch package's guarded step against clip_grad_norm_ + optimizer.step() (launch/bench_guard.py), and its host syncs"
  "sanitize|40|compute-sanitizer memcheck and racecheck on the kernel tests"
  "rest|10|measured in earlier leases: the check kernel's benchmark"
)

# --- bookkeeping -------------------------------------------------------------------------------
mkdir -p "$out" "$runs"
exec 3>&1  # log lines reach the terminal also from commands whose output goes to a file
status=0
clock=0  # the dry run's virtual seconds
now() { if ((dry)); then echo "$clock"; else echo "$SECONDS"; fi; }
log() { printf '[gpu_check +%ds] %s\n' "$(now)" "$*" | tee -a "$out/summary.txt" >&3; }
fail() { status=1; log "FAILED: $*"; }
budget_of() { local s; for s in "${plan[@]}"; do [[ ${s%%|*} == "$1" ]] && { s=${s#*|}; echo "${s%%|*}"; return; }; done; echo 0; }
total=0
for s in "${plan[@]}"; do b=${s#*|}; total=$((total + ${b%%|*})); done
if ((total > deadline)); then
  echo "gpu_check: the stage budgets add up to $total s, over the deadline of $deadline s; shorten a stage in plan" | tee -a "$out/summary.txt"
  exit 2
fi
next=0       # the index in plan of the stage that must start next
stage_end=0
# stage NAME: starts the next stage of plan (in order, or the script is wrong); its commands end
# by now + its budget, never past the deadline.
stage() {
  local want=${plan[$next]%%|*}
  if [[ "$1" != "$want" ]]; then
    echo "gpu_check: stage $1 started where the plan has $want next" | tee -a "$out/summary.txt"
    exit 2
  fi
  next=$((next + 1))
  stage_end=$(($(now) + $(budget_of "$1")))
  ((stage_end > deadline)) && stage_end=$deadline
  log "== stage $1 (budget $(budget_of "$1") s, until +$stage_end s)"
}
# capped SECONDS CMD...: CMD for at most SECONDS, never past its stage's end (dry run: logged,
# and the virtual clock moves by the cap).
capped() {
  local cap="$1" left=$((stage_end - $(now)))
  shift
  ((left < cap)) && cap=$left
  if ((cap < 3)); then
    log "out of time, skipped: $*"
    return 124
  fi
  if ((dry)); then
    log "dry run, ${cap} s: $*"
    clock=$((clock + cap))
    return 0
  fi
  timeout -k 5 "$cap" "$@"
}
# run CMD...: an uncapped step (unpacking, listing); the dry run only logs it.
run() { if ((dry)); then log "dry run: $*"; else "$@"; fi; }
calc() { python3 -c "print($1)" 2>/dev/null || echo nan; }
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
last_tok_s() { grep -o 'tok/s [0-9]*' "$runs/$1.log" 2>/dev/null | tail -1 | cut -d' ' -f2; }
tok_s() { python3 -c 'import json,sys; print(round(json.loads(open(sys.argv[1]).read().splitlines()[-1])["tokens_per_s"]))' "$runs/$1.json" 2>/dev/null || echo nan; }
# train RUN CAP ARGS...: one single-GPU run into runs/RUN (its output beside it), no checkpoints.
train() {
  local name="$1" cap="$2"
  shift 2
  rm -rf "${runs:?}/$name"
  capped "$cap" "$build/bin/lockstep" train --training.device cuda --job.dump_folder "$runs/$name" \
    --checkpoint.enable false "$@" >"$runs/$name.log" 2>&1
}
# peer NAME CAP ARGS...: one PyTorch peer run's JSON line into runs/NAME.json.
peer() {
  local name="$1" cap="$2"
  shift 2
  capped "$cap" python3 "$root/launch/peer_torch.py" --device cuda "$@" >"$runs/$name.json" \
    2>"$runs/$name.err" || fail "peer $name: $(tail -1 "$runs/$name.err" 2>/dev/null)"
}
# one_test NAME: PASS / FAIL / SKIP, its output in tests/NAME.log (xargs runs it).
one_test() {
  local name="$1" rc
  timeout -k 5 40 "$build/bin/lockstep_gpu_tests" --gtest_filter="$name" >"$out/tests/$name.log" 2>&1
  rc=$?
  if ((rc != 0)); then echo "FAIL $name (exit $rc)"
  elif grep -q '\[  SKIPPED \]' "$out/tests/$name.log"; then echo "SKIP $name"
  else echo "PASS $name"; fi
}
export -f one_test
export build out
gpt=(--model.dim 1024 --model.n_layers 12 --model.n_heads 16 --model.max_seq_len 1024
     --training.seq_len 1024 --training.local_batch_size 8 --training.mixed_precision_param bfloat16)
gpt_peer=(--model gpt --dim 1024 --layers 12 --heads 16 --seq 1024 --batch 8 --precision bfloat16)
llama=(--model.name llama --model.dim 2048 --model.n_layers 16 --model.n_heads 16
       --model.n_kv_heads 8 --model.rope_theta 500000 --model.max_seq_len 2048
       --training.seq_len 2048 --training.local_batch_size 4 --training.mixed_precision_param bfloat16)
llama_peer=(--model llama --dim 2048 --layers 16 --heads 16 --kv-heads 8 --rope-theta 500000
            --seq 2048 --batch 4 --precision bfloat16)
long=(--model.name llama --model.dim 2048 --model.n_layers 16 --model.n_heads 16 --model.n_kv_heads 8
      --model.rope_theta 500000 --model.max_seq_len 8192 --training.seq_len 8192
      --training.local_batch_size 16 --training.mixed_precision_param bfloat16 --parallelism.mode fsdp)

# --- what the lease must carry: stop at once without it ----------------------------------------
if ! compgen -G "$deps/debs/*.deb" >/dev/null; then
  echo "gpu_check: no $deps/debs/*.deb: run launch/gpu_deps.sh on a machine with Debian's registry and carry .gpu-deps to this one" | tee -a "$out/summary.txt"
  exit 1
fi
if ((dry)); then
  torch_dir="(dry run)" python_ok=1
else
  torch_dir=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))' 2>/dev/null) || {
    echo "gpu_check: python3 has no torch; this script needs the lease's CUDA torch in python3" | tee -a "$out/summary.txt"
    exit 1
  }
fi
log "plan: $(for s in "${plan[@]}"; do b=${s#*|}; printf '%s %s s, ' "${s%%|*}" "${b%%|*}"; done)total $total s of $deadline"

# --- build -------------------------------------------------------------------------------------
stage build
mkdir -p "$deps/root"
for d in "$deps"/debs/*.deb; do
  if command -v dpkg-deb >/dev/null; then
    run dpkg-deb -x "$d" "$deps/root"
  else  # a .deb is an ar archive holding data.tar.{xz,zst,gz}
    member=$(ar t "$d" | grep '^data.tar')
    case "$member" in
      *.xz) flag=-J ;; *.zst) flag=--zstd ;; *.gz) flag=-z ;; *) flag= ;;
    esac
    ((dry)) || ar p "$d" "$member" | tar -x $flag -C "$deps/root" -f -
  fi
done
prefix_path="$deps/root/usr"
export LD_LIBRARY_PATH="$deps/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
nvcc_path=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
cuda_root=$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")
log "carried: $(ls "$deps/debs" | tr '\n' ' '); torch at $torch_dir; CUDA at $cuda_root"
{ nvidia-smi; } >"$out/nvidia-smi.txt" 2>&1
if ! capped 20 cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_dir/share/cmake;$prefix_path" \
    -DLOCKSTEP_CUDA=ON -DLOCKSTEP_MPI=OFF -DTORCH_CUDA_ARCH_LIST=9.0 \
    -DCMAKE_CUDA_COMPILER="$cuda_root/bin/nvcc" -DCUDA_TOOLKIT_ROOT_DIR="$cuda_root" \
    -DCUDAToolkit_ROOT="$cuda_root" -DCMAKE_EXE_LINKER_FLAGS=-rdynamic \
    >"$out/configure.log" 2>&1; then
  log "configure FAILED (configure.log): $(grep -m3 -E 'Error|error' "$out/configure.log" | tr '\n' ' ')"
  exit 1
fi
if ! capped 90 cmake --build "$build" -j "$(nproc)" --target lockstep lockstep-run \
    lockstep_gpu_tests >"$out/build.log" 2>&1; then
  log "build FAILED (build.log): $(grep -m3 -E 'error|FAILED' "$out/build.log" | tr '\n' ' ')"
  exit 1
fi
((dry)) || "$build/bin/lockstep" version >"$out/version.txt" 2>&1
log "built: $(head -1 "$out/version.txt" 2>/dev/null)"
# The PyTorch package for the guard stage, built while the GPU stages run (niced, 4 jobs). Its
# Python.h is python3's own, else the carried one when python3 is the carried version.
pkg="$out/pytorch-package"
pyinc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)
pyver=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null)
cpath="$deps/root/usr/include/python$pyver:$deps/root/usr/include"
if ((dry)); then
  log "dry run: the PyTorch package builds in the background"
  pkg_pid=""
else
  [[ -f "$pyinc/Python.h" || -f "$deps/root/usr/include/python$pyver/Python.h" ]] ||
    log "no Python.h for python$pyver (neither $pyinc nor carried): the guard stage will fail"
  CPATH="$cpath" TORCH_CUDA_ARCH_LIST=9.0 CUDA_HOME="$cuda_root" MAX_JOBS=4 \
    nice -n 19 "$root/launch/build_python.sh" python3 "$pkg" >"$out/pytorch-build.log" 2>&1 &
  pkg_pid=$!
fi

# --- smoke: every gpu test, the never-run kernels among them ------------------------------------
stage smoke
mkdir -p "$out/tests"
if ((dry)); then
  tests="DryRun.EveryGpuTest"
else
  tests=$("$build/bin/lockstep_gpu_tests" --gtest_list_tests | awk '/^[^ ]/ {suite=$1} /^  / {print suite $1}')
fi
listed=$(wc -w <<<"$tests")
if ((listed == 0)); then
  fail "lockstep_gpu_tests lists no test"
else
  capped 45 xargs -P 4 -I{} bash -c 'one_test {}' <<<"$tests" >"$out/gpu_tests.txt" 2>&1
  ((dry)) && sed 's/^/PASS /' <<<"$tests" >"$out/gpu_tests.txt"
  sort -o "$out/gpu_tests.txt" "$out/gpu_tests.txt"
  passed=$(grep -c '^PASS' "$out/gpu_tests.txt") failed=$(grep -c '^FAIL' "$out/gpu_tests.txt")
  skipped=$(grep -c '^SKIP' "$out/gpu_tests.txt") unrun=$((listed - passed - failed - skipped))
  log "gpu tests: $passed passed, $failed failed, $skipped skipped, $unrun not run of $listed"
  grep -v '^PASS' "$out/gpu_tests.txt" | tee -a "$out/summary.txt"
  ((failed + unrun > 0)) && fail "$failed gpu tests failed, $unrun did not run"
fi

# --- decide: the device-decided step against the host-decided one -------------------------------
stage decide
decide_configs=(
  "adagc-reset|8|150|--skip.adaptive_clip adagc --skip.adagc_warmup 20 --skip.spike_moment_reset true --skip.on_global_spike skip --fault.inject spike@100:0 --fault.spike_factor 100"
  "fp16-dynamic|8|150|--training.mixed_precision_param float16 --training.loss_scale dynamic"
  "bf16-overlap|8|150|--training.mixed_precision_param bfloat16 --parallelism.overlap true"
  "fp32|8|150|"
  "fp32-table|8|150|--skip.exchange table"
  "gpt-152m|10|20|${gpt[*]}")
for entry in "${decide_configs[@]}"; do
  IFS='|' read -r name cap steps args <<<"$entry"
  for side in device host; do
    mode=on; [[ $side == host ]] && mode=off
    # shellcheck disable=SC2086
    train "decide-$name-$side" "$cap" --skip.enabled true --skip.device_decision "$mode" \
      --training.steps "$steps" --metrics.log_freq 10 $args || fail "decide $name $side (runs/decide-$name-$side.log)"
  done
  d=$(metric "decide-$name-device" ms_per_step) h=$(metric "decide-$name-host" ms_per_step)
  cd_=$(crc_of "decide-$name-device") ch=$(crc_of "decide-$name-host")
  log "decide $name: device $d ms/step, host $h ms/step, device/host $(calc "round($d / $h, 3)"); host waited $(metric "decide-$name-device" host_wait_ms) vs $(metric "decide-$name-host" host_wait_ms) ms/step; crc32 ${cd_:-none} device, ${ch:-none} host"
  if ((!dry)) && [[ -z "$cd_" || "$cd_" != "$ch" ]]; then
    fail "decide $name: the device-decided and host-decided parameters differ (crc32 ${cd_:-none} vs ${ch:-none})"
  fi
done

# --- peer: PyTorch on the same models ----------------------------------------------------------
stage peer
train peer-gpt-lockstep 15 "${gpt[@]}" --training.steps 40 --metrics.log_freq 10 || fail "peer-gpt-lockstep"
peer peer-gpt-eager 15 "${gpt_peer[@]}" --steps 20 --warmup 5
peer peer-gpt-compile 35 "${gpt_peer[@]}" --steps 20 --warmup 5 --compile
train peer-llama-lockstep 15 "${llama[@]}" --training.steps 30 --metrics.log_freq 10 || fail "peer-llama-lockstep"
peer peer-llama-eager 10 "${llama_peer[@]}" --steps 15 --warmup 5
l=$(last_tok_s peer-gpt-lockstep) e=$(tok_s peer-gpt-eager) c=$(tok_s peer-gpt-compile)
log "peer gpt bf16: lockstep ${l:-nan} tok/s, PyTorch eager $e, torch.compile $c; lockstep/eager $(calc "round(${l:-0} / $e, 3)"), lockstep/compile $(calc "round(${l:-0} / $c, 3)")"
l=$(last_tok_s peer-llama-lockstep) e=$(tok_s peer-llama-eager)
log "peer llama bf16: lockstep ${l:-nan} tok/s, PyTorch eager $e; lockstep/eager $(calc "round(${l:-0} / $e, 3)")"

# --- syncs: what a clean step waits for ----------------------------------------------------------
# LOCKSTEP_CUDA_SYNC_DEBUG=warn prints every synchronizing CUDA operation from a process's third
# step on: a 30-step run's prints minus a 10-step run's, over 20, are one clean step's. c10 does
# not see an event wait; the milliseconds the host waited (host_wait_ms) do.
stage syncs
sync_configs=("host|--skip.enabled true --skip.device_decision off" "device|--skip.enabled true"
  "device-bf16|--skip.enabled true --training.mixed_precision_param bfloat16"
  "skip-off|--skip.enabled false")
for entry in "${sync_configs[@]}"; do
  name="${entry%%|*}" args="${entry#*|}"
  for steps in 10 30; do
    rm -rf "${runs:?}/sync-$name-$steps"
    # shellcheck disable=SC2086
    capped 4 env LOCKSTEP_CUDA_SYNC_DEBUG=warn "$build/bin/lockstep" train --training.device cuda \
      --job.dump_folder "$runs/sync-$name-$steps" --checkpoint.enable false --metrics.log_freq 10 \
      --training.steps "$steps" $args >"$runs/sync-$name-$steps.log" 2>&1 || fail "sync-$name-$steps"
  done
  a=$(grep -c "synchronizing CUDA operation" "$runs/sync-$name-10.log" 2>/dev/null)
  b=$(grep -c "synchronizing CUDA operation" "$runs/sync-$name-30.log" 2>/dev/null)
  log "syncs $name: c10 sync-debug $(calc "(${b:-0} - ${a:-0}) / 20") per clean step; the host waited $(metric "sync-$name-30" host_wait_ms) ms a step"
done

# --- fsdp: parameter sharding and recomputation on the GPU ----------------------------------------
stage fsdp
train fsdp-long-none 8 "${long[@]}" --training.steps 2
log "fsdp 0.76 B Llama, 16 x 8192 tokens, no recomputation: exit $? ($(grep -o 'memory plan: each rank needs up to [0-9.]* GiB' "$runs/fsdp-long-none.log" 2>/dev/null | head -1))"
train fsdp-long-full 27 "${long[@]}" --activation_checkpoint.mode full --training.steps 6 --metrics.log_freq 1 || fail "fsdp-long-full"
log "fsdp 0.76 B Llama, 16 x 8192 tokens, full recomputation: $(last_tok_s fsdp-long-full) tok/s, $(grep -o 'MFU [0-9.]*%' "$runs/fsdp-long-full.log" 2>/dev/null | tail -1), $(grep -o 'memory plan per rank: up to [0-9.]* GiB' "$runs/fsdp-long-full/logs/rank0.log" 2>/dev/null | head -1)"
train fsdp-llama 20 "${llama[@]}" --parallelism.mode fsdp --activation_checkpoint.mode full --training.steps 20 --metrics.log_freq 10 || fail "fsdp-llama"
log "fsdp + full recomputation, the peer stage's Llama shape: $(last_tok_s fsdp-llama) tok/s (ddp in the peer stage: $(last_tok_s peer-llama-lockstep))"

# --- guard: the PyTorch package on a GPU ------------------------------------------------------------
stage guard
pkg_rc=0
if [[ -n "$pkg_pid" ]]; then
  capped 15 tail --pid="$pkg_pid" -f /dev/null
  if kill -0 "$pkg_pid" 2>/dev/null; then kill "$pkg_pid"; pkg_rc=124; else wait "$pkg_pid"; pkg_rc=$?; fi
fi
if ((pkg_rc == 0)); then
  # foreach: host-decided; fused: device-decided; a Llama in fp32 on one GPU.
  PYTHONPATH="$pkg/lib" capped 40 python3 "$root/launch/bench_guard.py" --device cuda \
    --dim 1024 --layers 8 --heads 16 --kv-heads 8 --vocab 32768 --seq 1024 --batch 8 \
    --steps 15 --warmup 3 >"$out/bench_guard.txt" 2>&1 || fail "bench_guard (bench_guard.txt)"
  log "pytorch guard: $(grep -E 'decision|model' "$out/bench_guard.txt" 2>/dev/null | tr '\n' ' ')"
else
  fail "the PyTorch package did not build (exit $pkg_rc, pytorch-build.log): $(grep -m2 -E 'error|lockstep:' "$out/pytorch-build.log" | tr '\n' ' ')"
fi

# --- sanitize: the kernel tests under memcheck and racecheck ----------------------------------------
stage sanitize
if ((dry)) || command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    capped 20 env LOCKSTEP_TEST_STEPS=200 compute-sanitizer --tool "$tool" --error-exitcode 1 \
      "$build/bin/lockstep_gpu_tests" --gtest_filter='GradCheckCuda.TinyTensorsShardsAndUnalignedViews:GradCheckCuda.EveryDtypeWithPlantedValues:DecisionCoreCuda.*:TensorActionsCuda.*' \
      >"$out/sanitizer_$tool.log" 2>&1 || fail "compute-sanitizer $tool (sanitizer_$tool.log)"
    log "compute-sanitizer $tool: $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$out/sanitizer_$tool.log" 2>/dev/null | tail -2 | tr '\n' ' ')"
  done
else
  fail "no compute-sanitizer on PATH: memcheck and racecheck did not run"
fi

# --- rest: measured in earlier leases ---------------------------------------------------------------
stage rest
capped 10 "$build/bin/lockstep" bench gradcheck --device cuda --dtypes fp32 bf16 --layouts few many \
  --sizes 1 256 4096 --min-seconds 0.2 >"$out/bench_gradcheck.txt" 2>&1 || fail "bench gradcheck"
head -40 "$out/bench_gradcheck.txt" 2>/dev/null

[[ -n "${pkg_pid:-}" ]] && kill "$pkg_pid" 2>/dev/null
if ((next != ${#plan[@]})); then
  echo "gpu_check: $next of ${#plan[@]} stages ran" | tee -a "$out/summary.txt"
  exit 2
fi
log "done, status $status"
exit $status
