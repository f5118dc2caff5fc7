#!/usr/bin/env bash
# Soak (issue 6): RANKS ranks x STEPS steps under lockstep-run --max-restarts 1 with random
# faults on random ranks (nan and inf gradients, nan losses, x1000 loss spikes caught by
# skip.max_grad_norm; the z-score detectors are off so that every skip is an injected fault), poisoned
# samples, one rank killed with SIGKILL half way (restarted, resumed from the latest checkpoint)
# and a cross-rank parameter checksum every 100 steps. Then it checks and prints:
#   - zero desync (the run would abort) and identical decision logs on all ranks;
#   - every planned fault step skipped with its culprit ranks, every other skip caused by a
#     poisoned sample, and the final skipped_steps counter equal to that count;
#   - rank 0's resident memory flat: the mean of the last 10 % of logged steps within 10 % of
#     the mean of steps 10-20 % (after warm-up), within the longest uninterrupted segment.
#
#   launch/soak.sh [STEPS=2000] [RANKS=4] [RUN_DIR] [--section.key VALUE ...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
steps="${1:-2000}"
ranks="${2:-4}"
run="${3:-$(mktemp -d)/soak}"
shift $(($# < 3 ? $# : 3))  # the rest: more train overrides (e.g. --parallelism.mode sharded)
bin="${LOCKSTEP_BUILD_DIR:-$root/build}/bin"
[[ -x "$bin/lockstep" && -x "$bin/lockstep-run" ]] || { echo "soak: build first (launch/setup.sh)" >&2; exit 1; }
rm -rf "$run"
mkdir -p "$(dirname "$run")"
crash_step=$((steps / 2 + 7))
crash_rank=$((ranks - 1))
args=(--job.dump_folder "$run" --training.steps "$steps" --training.threads 1
      --model.dim 32 --model.n_layers 1 --model.n_heads 2 --model.max_seq_len 32
      --training.seq_len 32 --training.local_batch_size 4 --metrics.log_freq 10
      --data.synthetic_tokens 65536
      --checkpoint.interval 100 --checkpoint.keep_latest_k 2
      --skip.enabled true --skip.max_grad_norm 50 --skip.max_consecutive 0 --skip.max_fraction 0
      --skip.grad_norm_zscore 0 --skip.loss_zscore 0
      --fault.random_p 0.01 --fault.random_seed 2026
      --fault.random_kinds "nan_grad, inf_grad, nan_loss, spike"
      --fault.poison_ids "11, 700, 1500" --fault.inject "crash@$crash_step:$crash_rank"
      --diagnostics.verify_every 100 "$@")

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%F)"
echo "soak: $ranks ranks x $steps steps${*:+ ($*)}, random faults p=0.01 per rank and step, 3 poisoned samples of ~1985 (each drawn once per epoch), rank $crash_rank SIGKILLed at step $crash_step, run dir $run"
# A free port of its own (several soaks may run at once, e.g. under ctest -j), below the kernel's
# ephemeral range so no other process's connection is handed it before the store binds it.
port="${LOCKSTEP_SOAK_PORT:-$(python3 - <<'PY'
import os, random, socket
low, high = 10000, int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for port in random.Random(os.getpid()).sample(range(low, high), 200):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    print(port)
    break
PY
)}"
start=$SECONDS
"$bin/lockstep-run" --nproc-per-node "$ranks" --master-port "$port" --max-restarts 1 -- "$bin/lockstep" train "${args[@]}" \
  >"$run.log" 2>&1 || { tail -20 "$run.log"; echo "soak: FAILED (the run did not complete)" >&2; exit 1; }
echo "soak: finished in $((SECONDS - start)) s"
# The plan without the crash (a crash is not a data fault).
"$bin/lockstep" config faults --ranks "$ranks" "${args[@]}" --fault.inject "" >"$run.plan.jsonl"

python3 - "$run" "$ranks" "$steps" "$run.plan.jsonl" "$run.log" <<'PY'
import collections, json, sys
run, ranks, steps, plan_path, log_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
poison = {11, 700, 1500}
plan = collections.defaultdict(dict)  # step -> {rank: kind}
for line in open(plan_path):
    p = json.loads(line)
    plan[p["step"]][p["rank"]] = p["kind"]

def events(rank):
    out = {}  # by step: a re-run step after the restart replaces its first record
    for line in open(f"{run}/diagnostics/rank{rank}.jsonl"):
        e = json.loads(line)
        out[e["step"]] = (e["decision"], tuple(e["reasons"]), tuple(e["culprit_ranks"]),
                          tuple(e.get("quarantine_sample_ids", [])))
    return out

ok = True
def check(cond, what):
    global ok
    ok &= cond
    print(("ok   " if cond else "FAIL ") + what)

logs = [events(r) for r in range(ranks)]
check(all(l == logs[0] for l in logs), f"decision logs identical on all {ranks} ranks ({len(logs[0])} events)")
check(all(d == "skip" for d, *_ in logs[0].values()), "every event is a skip (no abort, no desync)")
missed = [s for s in plan if s not in logs[0]]
check(not missed, f"every planned fault step skipped ({len(plan)} steps; missed: {missed[:5]})")
# Culprits: every rank with a nonfinite fault; a spike is named when no nonfinite fault hides
# it (the norm is NaN then) and it is the largest of the step's spikes; never a rank without one.
def culprits_ok(s):
    named = set(logs[0][s][2])
    nonfinite = {r for r, k in plan[s].items() if k != "spike"}
    return named and named <= set(plan[s]) and nonfinite <= named
wrong = [s for s in plan if s in logs[0] and not culprits_ok(s)]
check(not wrong, f"the culprit ranks of every planned fault named, no innocent rank blamed (wrong at: {wrong[:5]})")
poison_only = [s for s in logs[0] if s not in plan]
unexplained = [s for s in poison_only if not set(logs[0][s][3]) & poison]
check(not unexplained, f"every other skip ({len(poison_only)}) blames a poisoned sample (unexplained: {unexplained[:5]})")
metrics = [m for m in map(json.loads, open(f"{run}/metrics.jsonl")) if "event" not in m]  # not resume records
final = metrics[-1]
check(final["step"] == steps, f"reached step {steps}")
check(final["skipped_steps"] == len(plan) + len(poison_only),
      f"skipped_steps {final['skipped_steps']} = {len(plan)} planned faults + {len(poison_only)} poisoned batches")
log = open(log_path).read()
check("restarting" in log.lower() or "attempt 2" in log, "the killed rank was restarted (lockstep-run --max-restarts 1)")
check(log.count("resumed from") >= 1, "the restarted job resumed from a checkpoint")
# Resident memory: split the metrics where elapsed_s goes back (the restart), take the longest part.
segments, cur = [], []
for m in metrics:
    if cur and m["elapsed_s"] < cur[-1]["elapsed_s"]:
        segments.append(cur); cur = []
    cur.append(m)
segments.append(cur)
seg = max(segments, key=len)
n = len(seg)
early = [m["rss_mib"] for m in seg[n // 10: max(n // 10 + 1, n // 5)]]
late = [m["rss_mib"] for m in seg[n - max(1, n // 10):]]
e, l = sum(early) / len(early), sum(late) / len(late)
check(abs(l - e) / e <= 0.10, f"rank 0 resident memory flat: {e:.1f} MiB early -> {l:.1f} MiB late ({100 * (l - e) / e:+.1f} %), over {n} logged steps")
print("soak: PASSED" if ok else "soak: FAILED")
sys.exit(0 if ok else 1)
PY
