"""SkipGuard's bad input: every mistake is one lockstep.torch.ConfigError line naming the key or
file and the fix, raised before anything is written (no run_dir appears).

    python tests/python/guard_inputs.py WORK_DIR
"""
import os
import shutil
import sys

import torch

import lockstep.torch as lt


def refused(expect, *args, **kwargs):
    try:
        lt.SkipGuard(*args, **kwargs)
    except lt.ConfigError as e:
        message = str(e)
        assert expect in message and "\n" not in message, f"{expect!r} not in {message!r}"
        return
    raise AssertionError(f"accepted: {args} {kwargs}")


def main():
    work = sys.argv[1]
    shutil.rmtree(work, ignore_errors=True)
    run_dir = os.path.join(work, "run")
    opt = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())
    refused("config file: cannot read '/nonexistent/lockstep.toml'", opt,
            "/nonexistent/lockstep.toml", run_dir=run_dir)
    refused("'optimizer.lr' is your trainer's setting, not the guard's", opt,
            {"optimizer": {"lr": 0.1}}, run_dir=run_dir)
    refused("invalid value for 'skip.scope': 'rank' needs lockstep's own trainer", opt,
            run_dir=run_dir, skip_enabled=True, skip_scope="rank")
    sgd = torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1)
    refused("invalid value for 'skip.spike_moment_reset': true needs Adam or AdamW moments", sgd,
            run_dir=run_dir, skip_enabled=True, skip_spike_moment_reset=True)
    refused("invalid value for 'skip.max_consecutive_tokens': 4096 needs lockstep's own trainer",
            opt, run_dir=run_dir, skip_max_consecutive_tokens=4096)
    refused("invalid value for 'skip.max_grad_norm'", opt, {"skip.max_grad_norm": -1},
            run_dir=run_dir)
    refused("unknown config key 'skip.enbled'", opt, run_dir=run_dir, skip_enbled=True)
    refused("needs a fused optimizer", opt, run_dir=run_dir, skip_device_decision="on")
    assert not os.path.exists(run_dir), "a refused guard wrote its run_dir"
    guard = lt.SkipGuard(opt, {"skip": {"enabled": True}}, run_dir=run_dir)  # one process
    assert os.path.isdir(os.path.join(run_dir, "diagnostics")) and guard.world == 1
    mismatched_samples(opt, os.path.join(work, "samples"))
    print("guard inputs: ok")


def mismatched_samples(opt, run_dir):
    """sample_ids shorter than sample_losses on an anomalous step: refused naming the rank (the
    C++ side read past the ids and wrote a pointer-like id into the events and the quarantine)."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    guard = lt.SkipGuard(opt, {"skip": {"enabled": True}}, run_dir=run_dir)
    loss = model(torch.ones(2, 4)).sum() * float("nan")
    loss.backward()
    try:
        guard.step(loss, sample_ids=[7], sample_losses=[1.0, float("nan")])
    except RuntimeError as e:
        assert "rank 0 gave 1 sample ids and 2 sample losses" in str(e), str(e)
        return
    raise AssertionError("1 sample id with 2 sample losses was accepted")


if __name__ == "__main__":
    main()
