"""Decides a recorded sequence of stats tables with the PyTorch package (lockstep._C) and writes
each table and its verdict, bits included, one JSON line per step; tests/test_pytorch.cpp
decides the same tables with the harness's own build and compares bit for bit (the package is
compiled by torch's extension build, with its own flags: this is what shows they agree).

    python tests/python/record_decisions.py OUT.jsonl
The sequence: 3 ranks, 400 steps of falling losses and noisy norms; on chosen steps a rank's
nonfinite gradient, a rank's nonfinite loss, a rank's x100 spike, every rank's spike, and a run of
skips long enough to reach the max_consecutive guard's count."""
import json
import math
import random
import struct
import sys

import torch

from lockstep import _C

WORLD, STEPS = 3, 400
OVERRIDES = [("skip.enabled", "true"), ("skip.window", "64"), ("skip.min_history", "16"),
             ("skip.max_consecutive", "6")]


def bits(x):
    return struct.unpack("<q", struct.pack("<d", x))[0]


def table(step, rng):
    rows = []
    for r in range(WORLD):
        loss = 3.0 * math.exp(-step / 300) + rng.gauss(0, 0.02)
        sumsq = (0.5 + rng.gauss(0, 0.03)) ** 2 / WORLD
        nonfinite = 0.0
        if step in (50, 51, 52) and r == 1:
            nonfinite = 7.0
        if step == 90 and r == 2:
            loss = math.nan
        if step in (130, 300) and r == 0:
            loss, sumsq = loss * 100, sumsq * 1e4
        if step in (200, 330):  # every rank at once: a global spike, clipped
            loss, sumsq = loss * 30, sumsq * 900
        if 380 <= step < 387:  # a run of skips: the seventh trips max_consecutive
            nonfinite = 1.0
        row = {"shard_nonfinite": nonfinite, "shard_sumsq": sumsq, "local_nonfinite": nonfinite,
               "local_sumsq": sumsq, "loss": loss,
               "compute_seconds": 0.01 * (r + 1)}  # stragglers' field: no decision reads it
        rows.append([row.get(field, 0.0) for field in _C.STATS_FIELDS])
    return rows


def main():
    core = _C.Core("", "<record>", OVERRIDES, 0, WORLD, [], "", "host", "cpu")
    rng = random.Random(7)
    with open(sys.argv[1], "w", encoding="utf-8") as out:
        out.write(json.dumps({"world": WORLD, "overrides": OVERRIDES}) + "\n")
        for step in range(1, STEPS + 1):
            rows = table(step, rng)
            v = core.decide(torch.tensor(rows, dtype=torch.float64))
            out.write(json.dumps({"table": [[bits(x) for x in row] for row in rows],
                                  "decision": v.decision, "reasons": list(v.reasons),
                                  "culprits": list(v.culprit_ranks), "guard": v.guard,
                                  "grad_norm": bits(v.grad_norm), "loss": bits(v.loss),
                                  "clip": bits(v.clip), "clip_to": bits(v.clip_to)}) + "\n")
            try:
                core.finish(v, torch.tensor(rows, dtype=torch.float64), _C.LocalStep(),
                            _C.SampleTable(), 0.0, 0)
            except RuntimeError:
                pass
            if v.decision == "abort":
                break


if __name__ == "__main__":
    main()
