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
    # the trainer's rule (decide/exchange_plan.h): AdaGC takes the record on the host, and the
    # device's per-tensor policies need every rank's sums each step (the table)
    refused("invalid value for 'skip.exchange': \"record\", but skip.device_decision = \"on\" "
            "with the per-tensor policies", opt, run_dir=run_dir, skip_enabled=True,
            skip_adaptive_clip="adagc", skip_exchange="record", skip_device_decision="on")
    refused("needs a fused optimizer", opt, run_dir=run_dir, skip_device_decision="on")
    # "auto" means what it means in lockstep's trainer (one rule, in C++): the device decides
    # only for gradients on a GPU; "on" forces it (here on the CPU)
    fused = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters(), fused=True)
    assert not lt.SkipGuard(fused).on_device
    assert lt.SkipGuard(fused, skip_device_decision="on").on_device
    assert not os.path.exists(run_dir), "a refused guard wrote its run_dir"
    guard = lt.SkipGuard(opt, {"skip": {"enabled": True}}, run_dir=run_dir)  # one process
    assert os.path.isdir(os.path.join(run_dir, "diagnostics")) and guard.world == 1
    misuses(os.path.join(work, "misuses"))
    finish_checks_lengths(os.path.join(work, "lengths"))
    other_world_size()
    unwritable_events(os.path.join(work, "unwritable"))
    print("guard inputs: ok")


def misused(expect, guard, loss, **kwargs):
    """guard.step(loss, **kwargs) raises MisuseError naming rank 0 and `expect`, in one line,
    and nothing of the step counts."""
    before = guard.counters
    try:
        guard.step(loss, **kwargs)
    except lt.MisuseError as e:
        message = str(e)
        assert message.startswith("lockstep guard: rank 0 ") and expect in message, message
        assert "\n" not in message, message
        assert guard.counters == before, (guard.counters, before)
        return
    raise AssertionError(f"accepted: {expect}")


def misuses(run_dir):
    """Each mistake of a loop migrated to the guard is refused at the step where it happens,
    before anything is applied or counted; the loop goes on once it is fixed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (1 + n))
    guard = lt.SkipGuard(opt, {"skip": {"enabled": True}}, run_dir=run_dir, scheduler=sched)

    def backward():
        opt.zero_grad()
        loss = model(torch.ones(2, 4)).pow(2).mean()
        loss.backward()
        return loss

    misused("with no gradients (2 parameters, none with .grad)", guard, torch.tensor(1.0))
    loss = backward()
    misused("passed a Python number as the loss", guard, loss.item())
    misused("passed a loss of 2 elements", guard, torch.ones(2))
    misused("passed sample_ids without sample_losses", guard, loss, sample_ids=[1, 2])
    misused("passed sample_losses without sample_ids", guard, loss, sample_losses=[1.0, 2.0])
    misused("passed 1 sample ids and 2 sample losses", guard, loss, sample_ids=[7],
            sample_losses=[1.0, float("nan")])
    v = guard.step(loss, sample_ids=[1, 2], sample_losses=[1.0, 2.0])
    assert v.step == 1 and v.decision == "step" and v.ready, v
    weights = [p.detach().clone() for p in model.parameters()]
    try:  # the leftover optimizer.step() of a migrated loop: refused before it runs
        opt.step()
        raise AssertionError("optimizer.step() outside guard.step was accepted")
    except lt.MisuseError as e:
        assert "rank 0 called optimizer.step() outside guard.step (after the guard's step 1)" \
            in str(e), str(e)
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters())), "it stepped"
    sched.step()  # the scheduler passed to the guard, stepped by the loop too
    misused("called scheduler.step() outside guard.step (1 time(s)", guard, backward())
    opt.zero_grad()
    misused("with no gradients", guard, torch.tensor(1.0))  # after zero_grad()
    guard.close()  # gives the optimizer back
    opt.step()


def finish_checks_lengths(run_dir):
    """The C++ side checks every length that comes from Python: a sample table whose ids and
    losses differ in length (it read past the ids and wrote a pointer-like id into the events
    and the quarantine) and a check buffer of the wrong size are refused naming what was
    expected."""
    model = torch.nn.Linear(4, 4)
    guard = lt.SkipGuard(torch.optim.AdamW(model.parameters()), {"skip": {"enabled": True}},
                         run_dir=run_dir)
    table = torch.zeros(1, len(lt._C.STATS_FIELDS), dtype=torch.float64)
    table[0, 0] = 3  # nonfinite elements: an anomalous step
    v = guard.core.decide(table)
    samples = lt._C.SampleTable()
    samples.ids, samples.losses = [[7]], [[1.0, float("nan")]]
    mine = lt._C.LocalStep()
    for expect, call in [
            ("rank 0 gave 1 sample ids and 2 sample losses",
             lambda: guard.core.finish(v, table, mine, samples, 0.1, 0)),
            ("the stats table: shape [2, 9]; expected [1, 9]",
             lambda: guard.core.decide(torch.zeros(2, 9, dtype=torch.float64))),
            ("per-tensor index 5 of target 0: outside the 2 values",
             lambda: lt._C.apply_tensor_values([torch.ones(3)], [5], torch.ones(2), 0))]:
        try:
            call()
            raise AssertionError(f"accepted: {expect}")
        except (ValueError, RuntimeError) as e:
            assert expect in str(e), str(e)
    mine.shard_stats = torch.zeros(4, dtype=torch.float64)
    try:
        guard.core.finish(v, table, mine, lt._C.SampleTable(), 0.1, 0)
        raise AssertionError("a check buffer of 4 values for 2 parameters was accepted")
    except ValueError as e:
        assert "shard_stats: 4 values; expected 7" in str(e), str(e)
    assert not os.path.exists(os.path.join(run_dir, "diagnostics", "rank0.jsonl")), "wrote events"


def unwritable_events(run_dir):
    """An event file that cannot be written (here a folder stands where it goes; a full disk
    alike) is named in one warning, once, and training goes on (it raised out of guard.step)."""
    import logging
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    guard = lt.SkipGuard(opt, {"skip": {"enabled": True}}, run_dir=run_dir)
    os.makedirs(os.path.join(run_dir, "diagnostics", "rank0.jsonl"))
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    lt.log.addHandler(handler)
    for _ in range(2):  # two skipped steps: two events that cannot be written
        opt.zero_grad()
        (model(torch.ones(2, 4)).sum() * float("nan")).backward()
        assert guard.step(torch.tensor(float("nan"))).decision == "skip"
    lt.log.removeHandler(handler)
    warned = [m for m in seen if "cannot write the diagnostics events" in m]
    assert len(warned) == 1 and "training goes on" in warned[0], seen
    assert guard.skipped_steps == 2


def other_world_size():
    """A guard state saved by 2 ranks loads into one process: the counters and global windows
    carry over (each rank's own windows fill again), with a line saying so; what is not a guard
    state is refused in one line."""
    import logging
    two = lt._C.Core("", "<two ranks>", [("skip.enabled", "true")], 0, 2, [], "", "host", "cpu")
    table = torch.zeros(2, len(lt._C.STATS_FIELDS), dtype=torch.float64)
    table[:, 1], table[:, 4] = 0.5, 3.0  # sum of squares, loss
    for _ in range(3):
        two.finish(two.decide(table), table, lt._C.LocalStep(), lt._C.SampleTable(), 0.1, 8)
    state = {"lockstep": two.state(), "step": 3}
    guard = lt.SkipGuard(torch.optim.AdamW(torch.nn.Linear(4, 4).parameters()), skip_enabled=True)
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    lt.log.addHandler(handler)
    guard.load_state_dict(state)
    lt.log.removeHandler(handler)
    assert guard.counters["step"] == 3 and guard.counters["tokens_seen"] == 24, guard.counters
    assert any("state saved by 2 rank(s), loaded on 1" in m for m in seen), seen
    try:
        guard.load_state_dict({"lockstep": "not json", "step": 1})
        raise AssertionError("a state that is not JSON was accepted")
    except ValueError as e:
        assert str(e).startswith("guard state: not a lockstep guard state"), str(e)


if __name__ == "__main__":
    main()
