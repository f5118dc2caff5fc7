#!/usr/bin/env bash
# launch/gpu_check.sh's dry run on the CPU (issue 40: its budgets added up to 800 s against its
# 540 s deadline, a helper was used before it was defined, and without .gpu-deps it went on to
# fail at configure): every stage runs in the plan's order, every capped command "takes" its
# whole cap and the last stage still ends within the deadline, no command is missing; without
# the carried packages it stops at once in one line; a plan over its deadline is refused.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bad() { echo "FAIL: $*"; exit 1; }
mkdir -p "$tmp/deps/debs" && : >"$tmp/deps/debs/placeholder.deb"

LOCKSTEP_GPU_DRY_RUN=1 LOCKSTEP_GPU_DEPS="$tmp/deps" "$root/launch/gpu_check.sh" "$tmp/out" \
  >"$tmp/dry.txt" 2>&1
rc=$?
cat "$tmp/dry.txt"
((rc == 0)) || bad "the dry run exited $rc"
grep -q "command not found\|unbound variable" "$tmp/dry.txt" && bad "a command or variable is missing"
order=$(grep -o '== stage [a-z]*' "$tmp/dry.txt" | cut -d' ' -f3 | tr '\n' ' ')
[[ "$order" == "build smoke decide peer syncs fsdp guard sanitize rest " ]] || bad "stage order: $order"
last=$(grep -o '^\[gpu_check +[0-9]*s\] done' "$tmp/dry.txt" | grep -o '[0-9]*')
[[ -n "$last" ]] && ((last <= 540)) || bad "the worst case ends at +${last:-?} s, past the 540 s deadline"
# Every stage's commands ran (as dry-run lines) and none was skipped for time.
grep -q "out of time, skipped" "$tmp/dry.txt" && bad "a command was skipped for time in the worst case"
for s in build smoke decide peer syncs fsdp guard sanitize rest; do
  awk -v s="$s" '/== stage /{cur=$5} /dry run/{seen[cur]=1} END{exit !seen[s]}' "$tmp/dry.txt" ||
    bad "stage $s ran no command"
done

out=$(LOCKSTEP_GPU_DRY_RUN=1 LOCKSTEP_GPU_DEPS="$tmp/none" "$root/launch/gpu_check.sh" "$tmp/out2" 2>&1)
rc=$?
((rc == 1)) || bad "without .gpu-deps: exit $rc"
[[ $(wc -l <<<"$out") == 1 && "$out" == *"run launch/gpu_deps.sh"* ]] || bad "without .gpu-deps: $out"

out=$(LOCKSTEP_GPU_DEADLINE=500 LOCKSTEP_GPU_DRY_RUN=1 LOCKSTEP_GPU_DEPS="$tmp/deps" \
  "$root/launch/gpu_check.sh" "$tmp/out3" 2>&1)
rc=$?
((rc == 2)) && [[ "$out" == *"add up to 540 s, over the deadline of 500 s"* ]] || bad "over budget: exit $rc, $out"
echo "gpu_check dry run: stages in order, worst case +$last s of 540, the stops hold"
