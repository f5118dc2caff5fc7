#!/usr/bin/env bash
# The code's shape, checked (CI runs it; so does ctest, as Code.Shape):
#   - no function in src/, launch/*.cpp or the PyTorch package longer than 80 lines (lizard, from PyPI; setup.sh
#     installs it into .venv),
#   - the training step (issue in src/train.cpp) at most 60 lines, the loop (run) at most 40,
#     src/train.cpp at most 250 lines,
#   - include/lockstep/ (the public API) includes no private header.
# Prints every violation and exits 1 if there is one.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
lizard="$root/.venv/bin/lizard"
[[ -x "$lizard" ]] || lizard="$(command -v lizard || true)"
[[ -n "$lizard" ]] || { echo "lockstep lint: error: lizard not found; run launch/test.sh (it installs tests/requirements.txt into .venv) or pip install lizard" >&2; exit 1; }

status=0
fail() { echo "lockstep lint: $*"; status=1; }

# Function length: lizard's "length" counts every line from the signature to the closing brace.
if ! "$lizard" -l cpp -l python --length 80 --CCN 100000 --arguments 100 --warnings_only src \
    launch/*.cpp python/csrc python/lockstep; then
  fail "functions above 80 lines (listed above); split them"
fi

# The step and the loop, read from lizard's CSV (length is the 5th column, the name the 8th).
csv="$("$lizard" -l cpp --csv src/train.cpp)"
limit() {  # function, maximum lines
  local n
  n=$(awk -F, -v f="\"lockstep::$1\"" '$8 == f {print $5}' <<<"$csv")
  [[ -n "$n" ]] || { fail "src/train.cpp has no function $1"; return; }
  ((n <= $2)) || fail "src/train.cpp: $1 is $n lines, at most $2"
}
limit issue 60
limit run 40
lines=$(wc -l <src/train.cpp)
((lines <= 250)) || fail "src/train.cpp is $lines lines, at most 250"

# The public API stands alone.
if grep -n '#include "' include/lockstep/*.h | grep -v '#include "lockstep/'; then
  fail "include/lockstep/ includes private headers (listed above)"
fi

((status == 0)) && echo "lockstep lint: ok (functions <= 80 lines, issue $(awk -F, '$8 == "\"lockstep::issue\"" {print $5}' <<<"$csv") lines, loop $(awk -F, '$8 == "\"lockstep::run\"" {print $5}' <<<"$csv") lines, src/train.cpp $lines lines)"
exit $status
