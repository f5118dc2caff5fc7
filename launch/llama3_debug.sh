#!/usr/bin/env bash
# torchtitan's llama3 debug model on llm.c shards with validation, on 2 CPU ranks: builds what
# is missing, writes byte-level llm.c shards into data/llama3_debug/ (once; from the embedded
# synthetic corpus, or from your text with --text FILE), trains configs/llama3_debug.toml under
# lockstep-run (about 2 minutes on 2 cores), then exports the checkpoint for transformers
# (outputs/llama3_debug/hf) and samples from it.
#   launch/llama3_debug.sh [--text FILE] [--section.key VALUE ...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
text=""
if [[ "${1:-}" == "--text" ]]; then
  [[ -n "${2:-}" ]] || { echo "llama3_debug.sh: --text needs a file" >&2; exit 2; }
  text="$2"
  shift 2
fi
LOCKSTEP_BUILD_TARGETS="lockstep lockstep-run" launch/setup.sh
bin="${LOCKSTEP_BUILD_DIR:-$root/build}/bin"
shards="data/llama3_debug"
if [[ -n "$text" ]]; then
  shards="data/$(basename "${text%.*}")"
  [[ -e "$shards" ]] || "$bin/lockstep" data shard "$shards" --from "$text"
else
  [[ -e "$shards" ]] || "$bin/lockstep" data shard "$shards"
fi
run_dir="outputs/llama3_debug"
"$bin/lockstep-run" --standalone --nproc-per-node 2 "$bin/lockstep" train \
  --config configs/llama3_debug.toml --data.path "$shards/train_*.bin" \
  --validation.dataset_path "$shards/val_*.bin" "$@"
rm -rf "$run_dir/hf"
"$bin/lockstep" export "$run_dir" "$run_dir/hf"
"$bin/lockstep" generate "$run_dir" --prompt "The " --tokens 120
