#!/usr/bin/env bash
# The timing-sensitive tests under load: two busy loops keep both cores busy while ctest runs
# every test with a wall-clock expectation (a bound on how long something takes, a kill at a
# random moment, a wait for a stop) and the slowest tests. A test here waits for events, and
# every bound it keeps is relative or at least 5x its time on a quiet machine, so it passes on a
# loaded machine too. CI runs it after launch/test.sh. Extra arguments go to ctest.
#   launch/test_under_load.sh            # after launch/test.sh (it builds)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${LOCKSTEP_BUILD_DIR:-$root/build}"
[[ -x "$build/bin/lockstep_tests" ]] || { echo "test_under_load: build first (launch/test.sh)" >&2; exit 1; }

# A wall-clock expectation: a bound on seconds, a kill or signal at a moment, a launcher's grace.
timed='Cli\.AKilledRankMakesTheOtherExitInsteadOfHanging|Cli\.TheRankLogShowsEachProgressLineAtOnce'
timed+='|Cli\.KillDuringTrainingLeavesALoadableCheckpoint|LockstepRun\.AFailedWorkerStopsTheOthersAndIsReported'
timed+='|CommGloo\.AMissingRankTimesOutInsteadOfHanging|Inputs\.|KillRank\.|StallRank\.|Reliability\.Sigterm'
# The slowest on a quiet machine: the ten slowest and the next few (docs/benchmarks.md, "The
# first hour").
slowest='CheckpointProof\.AThreeGigabyteCheckpointStreams|PyTorch\.Torchtitan|Readme\.OutputExcerptsComeFromARealRun'
slowest+='|Bench\.SpikesSmoke|Soak\.|Readme\.DayOneCommandsRun|Llama3Debug\.TrainsOnTwoRanksFromShardsWithValidation'
slowest+='|Precision\.DefaultJobTrainsInBf16AndFp16CloseToFp32'

busy() { while :; do :; done; }
busy & load1=$!
busy & load2=$!
trap 'kill "$load1" "$load2" 2>/dev/null || true' EXIT
echo "test_under_load: two busy loops (pids $load1 $load2) on $(nproc) cores"
cd "$build"
ctest --output-on-failure --timeout 600 -j "${LOCKSTEP_TEST_JOBS:-2}" -R "^($timed|$slowest)" "$@"
