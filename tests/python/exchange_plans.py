"""The guard's exchange plan for every combination of the settings that choose it, on every path
a guard can be on: one JSON line each, {"overrides", "world", "on_gpu", "backend",
"host_exchange" (what the guard passes for it), "fused"}
and either "plan" (ExchangePlan.summary()) or "refused" (the one-line error) or "guard_refuses"
(a setting only lockstep's own trainer takes). tests/test_exchange_plan.cpp computes the
trainer's plan for each line and compares. Usage: exchange_plans.py OUT.jsonl"""
import itertools
import json
import sys

import torch  # noqa: F401  (lockstep._C links against its libraries)
from lockstep import _C
from lockstep.torch import ConfigError, harness_only_refusal, plan_of

AXES = [
    ("skip.exchange", ["auto", "record", "table"]),
    ("skip.device_decision", ["auto", "on", "off"]),
    ("skip.scope", ["step", "rank"]),
    ("skip.replay", ["off", "self"]),
    ("diagnostics.replay_every", ["0", "10"]),
    ("skip.adaptive_clip", ["off", "adagc"]),
    ("skip.spike_moment_reset", ["false", "true"]),
    ("lr_scheduler.on_skip", ["advance", "hold"]),
]
# (world, device type, process group backend, fused optimizer), as SkipGuard derives its path
PATHS = [(1, "cpu", "", True), (2, "cpu", "gloo", True), (2, "cpu", "gloo", False),
         (2, "cuda", "nccl", True), (2, "cuda", "nccl", False), (2, "cuda", "gloo", True),
         (4, "cuda", "cpu:gloo,cuda:nccl", True)]


def line(overrides, world, device_type, backend, fused):
    out = {"overrides": overrides, "world": world, "on_gpu": device_type == "cuda",
           "backend": backend, "fused": fused}
    host_exchange = plan_of(_Recorder(), device_type, backend, fused)
    out["host_exchange"] = host_exchange
    try:
        core = _C.Core("", "<plans>", overrides, 0, world, ["w"], "", "host", "cpu")
        refusal = harness_only_refusal(json.loads(core.config_json()))
        if refusal:
            out["guard_refuses"] = refusal
            return out
        out["plan"] = plan_of(core, device_type, backend, fused).summary()
    except ConfigError as e:
        out["refused"] = str(e)
    return out


class _Recorder:  # stands in for the core to learn the host_exchange the guard passes
    def plan(self, on_gpu, host_exchange, fused):
        return host_exchange


def main(path):
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for values in itertools.product(*(v for _, v in AXES)):
            overrides = [["skip.enabled", "true"]] + [[k, v] for (k, _), v in zip(AXES, values)]
            for world, device_type, backend, fused in PATHS:
                f.write(json.dumps(line(overrides, world, device_type, backend, fused)) + "\n")
                n += 1
    print(f"exchange_plans: {n} combinations written to {path}")


if __name__ == "__main__":
    main(sys.argv[1])
