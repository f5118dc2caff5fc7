#!/usr/bin/env bash
# Coverage-guided fuzzing of the config loader and the data readers (libFuzzer + ASan + UBSan,
# harnesses and seed corpora in tests/fuzz). Installs clang if missing, builds build-fuzz/,
# runs each harness for SECONDS on a copy of its seed corpus and prints executions, coverage
# and crashes. Exits non-zero when a harness crashes (its input is kept in build-fuzz/crashes/).
#
#   launch/fuzz.sh [SECONDS=600]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-600}"
out="${LOCKSTEP_FUZZ_DIR:-$root/build-fuzz}"
die() { printf 'lockstep fuzz: error: %s\n' "$*" >&2; exit 1; }

cxx="$(command -v clang++-14 || command -v clang++ || true)"
if [[ -z "$cxx" ]] || ! echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, long){return 0;}' \
    | "$cxx" -x c++ -fsanitize=fuzzer - -o /dev/null 2>/dev/null; then
  [[ $(id -u) == 0 ]] || die "clang with libFuzzer is missing; install clang-14 libclang-rt-14-dev"
  echo "lockstep fuzz: installing clang-14 and libFuzzer (apt)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang-14 libclang-rt-14-dev; } \
    >/dev/null || die "apt-get install clang-14 libclang-rt-14-dev failed"
  cxx="$(command -v clang++-14)"
fi
cmake -S "$root/tests/fuzz" -B "$out" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" >/dev/null \
  || die "cmake configure of tests/fuzz failed"
cmake --build "$out" >/dev/null || die "building the fuzz targets failed"

mkdir -p "$out/crashes"
status=0
for target in config data; do
  corpus="$out/corpus-$target"
  mkdir -p "$corpus"
  cp -n "$root/tests/fuzz/corpus/$target/"* "$corpus/" 2>/dev/null || true
  log="$out/fuzz_$target.log"
  echo "lockstep fuzz: fuzz_$target for $seconds s"
  if "$out/fuzz_$target" -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$out/crashes/$target-" "$corpus" >"$log" 2>&1; then
    result="no crash"
  else
    result="CRASH (see $log and $out/crashes/)"
    status=1
  fi
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo "?")
  printf 'fuzz_%-7s %10s executions in %s s, %s coverage points, corpus %s inputs: %s\n' \
    "$target" "$execs" "$seconds" "$cov" "$(ls "$corpus" | wc -l)" "$result"
done
exit $status
