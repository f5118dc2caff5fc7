# Sourced by the multi-rank benchmarks (bench_sync.sh, bench_fsdp.sh): the built binaries, a
# work folder removed at exit, and the loopback shaped to a wire's rate (tc token bucket, root
# only; removed at exit), so that the wire rather than the CPU bounds the transfers.
#   bench_init NAME          sets root, bin, tmp; checks the build
#   shape_loopback RATE      0 when shaped, else says why not (the caller goes on unshaped)
#   unshape_loopback
bench_init() {
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  bin="${LOCKSTEP_BUILD_DIR:-$root/build}/bin"
  [[ -x "$bin/lockstep" && -x "$bin/lockstep-run" ]] || { echo "$1: build first (launch/setup.sh)" >&2; exit 1; }
  tmp="$(mktemp -d)"
  shaped=0
  trap 'unshape_loopback; rm -rf "$tmp"' EXIT
}
shape_loopback() {
  if tc qdisc add dev lo root tbf rate "$1" burst 1mb latency 10ms 2>/dev/null; then
    shaped=1
  else
    echo "cannot shape the loopback with tc (root and the tbf qdisc needed); unshaped" >&2
    return 1
  fi
}
unshape_loopback() {
  if ((shaped)); then tc qdisc del dev lo root 2>/dev/null || true; fi
  shaped=0
}
