"""lockstep.torch.SkipGuard on several ranks (torchrun, Gloo): a small Llama in PyTorch, trained
with DDP or FSDP2, with faults on rank 1 at known steps. Checked on every rank: the same
decision at the same step, skips leave parameters and optimizer state bitwise unchanged, the
culprit rank is named (events, `lockstep diag`), a resume from the guard's state_dict
reproduces the rest of the run, and the device path (fused AdamW, found_inf) decides as the
host path.

    torchrun --standalone --nproc-per-node 2 tests/python/guard_ranks.py ddp RUN_DIR
Scenarios: ddp, fsdp, resume, resume-fsdp, misuse, agree, stall, nan-weight, device, adagc,
adagc-device, forms, mesh, mesh-device, resume-mesh, pipeline. Exit 0 and "ok" on success.
"""
import gc
import json
import os
import shutil
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "launch"))
from peer_torch import Llama  # noqa: E402

import lockstep.torch as lt  # noqa: E402

VOCAB, SEQ, BATCH = 64, 16, 4
# Small windows for a short run, so thresholds well above the noise of random-token losses.
SKIP = {"skip": {"enabled": True, "window": 32, "min_history": 6, "loss_zscore": 12,
                 "grad_norm_zscore": 12}}
# The per-tensor policies (adagc, adagc-device): AdaGC after 4 taken steps, SPAM's reset of the
# moments a global spike (skipped) hit.
ADAGC = dict(skip_adaptive_clip="adagc", skip_adagc_warmup=4, skip_spike_moment_reset=True,
             skip_on_global_spike="skip")
# step -> (kind, rank): faults on rank 1
FAULTS = {8: "nan_grad", 12: "nan_loss", 16: "spike"}
# FSDP2: the gradients are reduce-scattered inside backward (no own gradient to poison alone)
FSDP_FAULTS = {8: "nan_loss", 12: "spike", 16: "nan_activation_grad"}


def model():
    torch.manual_seed(0)
    return Llama(VOCAB, 32, 2, 4, 2, SEQ, 10000.0, 16)


def fsdp_model():
    """model() with FSDP2: each block, then the whole."""
    from torch.distributed.fsdp import fully_shard
    m = model()
    for block in m.layers:
        fully_shard(block)
    fully_shard(m)
    return m


def mesh_model(layout):
    """model() on a 2-D mesh of 4 ranks: HSDP (FSDP2 over a (replicate 2, shard 2) mesh), or
    FSDP x TP (Megatron's column/row pairs in each block over "tp", FSDP2 over "dp": the norms
    and embeddings are sharded over each TP rank's dp submesh, copies of each other). Returns
    the model and this rank's data-parallel rank (TP ranks read the same batch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    m = model()
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for block in m.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m, dist.get_rank()
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    col, row = ColwiseParallel(), RowwiseParallel()
    for block in m.layers:
        parallelize_module(block, mesh["tp"], {"wq": col, "wk": col, "wv": col, "wo": row,
                                               "w1": col, "w3": col, "w2": row})
        block.heads //= 2  # each TP rank its heads
        block.kv_heads //= 2
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(m, mesh=mesh["dp"])
    return m, mesh["dp"].get_local_rank()


def reference_norm(m):
    """The whole model's gradient norm in fp64, each element once (DTensor.full_tensor())."""
    total = 0.0
    for p in m.parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        total += g.double().pow(2).sum().item()
    return total ** 0.5


def titan_norm(m, pp_mesh=None):
    """torchtitan 0.3.0's clip_grad_norm_ (its DTensor total norm, the stages' squares added
    over pp_mesh) with no clip: max_norm inf scales every gradient by exactly 1."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".titan"))
    from torchtitan.distributed.utils import clip_grad_norm_
    return clip_grad_norm_(list(m.parameters()), float("inf"), pp_mesh=pp_mesh).item()


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:], list(range(1000 * step + 10 * rank,
                                                     1000 * step + 10 * rank + BATCH))


def forward_backward(m, step, rank, first_param, faults):
    x, y, ids = batch(step, rank)
    logits = m(x)
    per_sample = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none").view(BATCH, SEQ).mean(1)
    kind = faults.get(step) if rank == 1 or faults.get(step) == "spike_all" else None
    handle = None
    if kind == "nan_loss":  # one poisoned sample of rank 1's batch (the third)
        per_sample = per_sample * torch.tensor([1.0, 1.0, float("nan"), 1.0])
    loss = per_sample.mean()
    if kind in ("spike", "spike_all"):  # spike_all: every rank's loss, a global spike
        loss = loss * 1000.0
    elif kind == "nan_grad":  # rank 1's own gradient of one tensor, before any collective
        handle = first_param.register_hook(lambda g: g * float("nan"))
    elif kind == "nan_activation_grad":  # every gradient of rank 1, its loss finite
        handle = logits.register_hook(lambda g: g * float("nan"))
    loss.backward()
    if handle is not None:
        handle.remove()
    return loss, ids, per_sample.detach().tolist()


def snapshot(m, opt):
    def local(t):
        return (t._local_tensor if hasattr(t, "_local_tensor") else t).detach().clone()
    params = [local(p) for p in m.parameters()]
    state = [local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return params + state


def bitwise_equal(a, b):
    def raw(t):
        return t.reshape(-1).view(torch.uint8)
    return len(a) == len(b) and all(torch.equal(raw(x), raw(y)) for x, y in zip(a, b))


def summary(v):
    return (v.decision, list(v.reasons), list(v.culprit_ranks),
            torch.tensor(v.grad_norm, dtype=torch.float64).view(torch.int64).item())


def train(m, opt, guard, steps, rank, first, faults=FAULTS, start=1):
    """Steps start..steps; each verdict says its step. On the device path a verdict is read at
    the next step (not before: no wait), the last one by flush()."""
    verdicts = []
    for step in range(start, steps + 1):
        opt.zero_grad(set_to_none=True)
        loss, ids, losses = forward_backward(m, step, rank, first, faults)
        before = snapshot(m, opt)
        v = guard.step(loss, sample_ids=ids, sample_losses=losses, tokens=BATCH * SEQ)
        assert v.step == step and v.ready != guard.on_device, (v, step)
        assert not verdicts or verdicts[-1].ready, "the previous step's verdict is read"
        if not guard.on_device and v.decision == "skip":
            assert bitwise_equal(before, snapshot(m, opt)), f"step {step}: a skip changed state"
        verdicts.append(v)
    guard.flush()
    return [summary(v) for v in verdicts]


def agreed(decisions):
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, decisions)
    assert all(d == every[0] for d in every), f"ranks decided differently: {every}"


def expect_faults_skipped(decisions, start=1):
    for i, (decision, reasons, culprits, _) in enumerate(decisions):
        step = start + i
        if step in FAULTS:
            assert decision == "skip" and culprits == [1], f"step {step}: {decision} {reasons} {culprits}"
        else:
            assert decision == "step", f"step {step}: {decision} {reasons}"


def diag_names_rank_1(run_dir, events):
    binary = os.environ.get("LOCKSTEP_BIN")
    if dist.get_rank() != 0 or not binary:
        return
    out = subprocess.run([binary, "diag", "--json", run_dir], check=True, capture_output=True,
                         text=True).stdout
    summary = json.loads(out)
    per_rank = {r["rank"]: r["culprit_in"] for r in summary["per_rank"]}
    assert summary["skips"] == events and per_rank.get(1) == events and per_rank.get(0) == 0, \
        (summary["skips"], per_rank)
    assert summary["quarantine"] == [12 * 1000 + 10 + 2], summary["quarantine"]  # the poisoned one


def ddp(run_dir):
    rank = dist.get_rank()
    m = model()
    wrapped = torch.nn.parallel.DistributedDataParallel(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    guard = lt.SkipGuard(opt, SKIP, run_dir=run_dir, model=m, ddp=wrapped)
    decisions = train(wrapped, opt, guard, 20, rank, next(m.parameters()))
    agreed(decisions)
    expect_faults_skipped(decisions)
    assert guard.skipped_steps == 3 and guard.optimizer_steps == 17, guard.counters
    diag_names_rank_1(run_dir, 3)


def fsdp(run_dir):
    rank = dist.get_rank()
    m = fsdp_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    # lr_scheduler.on_skip = "hold": the schedule moves with the updates, not the steps.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (1 + n))
    guard = lt.SkipGuard(opt, SKIP, run_dir=run_dir, model=m, scheduler=sched,
                         lr_scheduler_on_skip="hold")
    decisions = train(m, opt, guard, 20, rank, next(m.parameters()), FSDP_FAULTS)
    agreed(decisions)
    assert sched.last_epoch == guard.optimizer_steps == 17, (sched.last_epoch, guard.counters)
    for i, (decision, reasons, culprits, _) in enumerate(decisions):
        step = i + 1
        if step in (8, 12):  # named by rank 1's own loss
            assert decision == "skip" and culprits == [1], (step, decision, reasons, culprits)
        elif step == 16:  # a gradient after the reduce-scatter names no rank: skipped, unnamed
            assert decision == "skip" and "nonfinite_grad" in reasons, (step, decision, reasons)
        else:
            assert decision == "step", (step, decision, reasons)


def adagc(run_dir):
    """The per-tensor policies in the guard, with FSDP2: AdaGC clips tensors after its warm-up
    and SPAM's reset zeroes the AdamW moments of the tensors a global spike hit (a loss spike on
    every rank at step 12, skipped), the same on every rank; the thresholds ride in the guard's
    state_dict and a guard loaded from it decides the next steps alike."""
    rank = dist.get_rank()
    m = fsdp_model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    guard = lt.SkipGuard(opt, SKIP, run_dir=run_dir, model=m, **ADAGC)
    names = dict(zip(map(id, guard.params), guard.names))
    seen, clipped = [], 0
    for step in range(1, 17):
        opt.zero_grad(set_to_none=True)
        loss, _, _ = forward_backward(m, step, rank, None, {12: "spike_all"})
        before = snapshot(m, opt)[:len(list(m.parameters()))]
        v = guard.step(loss)
        seen.append((step, v.decision, v.tensors_clipped, list(v.moments_reset)))
        clipped += v.tensors_clipped
        if step == 12:
            assert v.decision == "skip" and v.scope == "global" and v.moments_reset, seen[-1]
            assert bitwise_equal(before, snapshot(m, opt)[:len(before)]), "a skip changed weights"
            for p in m.parameters():
                state = opt.state[p]
                zero = all(int(torch.count_nonzero(state[k]._local_tensor)) == 0
                           for k in ("exp_avg", "exp_avg_sq"))
                assert zero == (names[id(p)] in v.moments_reset), (names[id(p)], zero)
        else:
            assert v.decision == "step", seen[-1]
        if step == 14:
            saved = guard.state_dict()
    agreed(seen)
    assert clipped > 0 and guard.counters["tensor_clips"] == clipped, (clipped, guard.counters)
    assert json.loads(saved["lockstep"])["detector"]["tensors"]["taken"] == 13, saved
    other = lt.SkipGuard(opt, SKIP, model=m, **ADAGC)
    other.load_state_dict(saved)
    assert other.core.state() == saved["lockstep"], "the thresholds round-trip"


def adagc_device(run_dir):
    """The per-tensor policies through the fused AdamW (the device path: each tensor's factor and
    reset applied on the device, verdicts read a step late) as on the host, with FSDP2: the same
    decisions, clips and resets at the same steps, and the same bits (no global clip:
    max_norm 0, so grad_scale is 1)."""
    rank = dist.get_rank()
    runs, ends = [], []
    for mode in ("off", "on"):  # "on": on the CPU too ("auto" decides there on the host)
        m = fsdp_model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        guard = lt.SkipGuard(opt, SKIP, model=m, training_max_norm=0.0, skip_device_decision=mode,
                             **ADAGC)
        assert guard.on_device == (mode == "on"), mode
        verdicts = []
        for step in range(1, 17):
            opt.zero_grad(set_to_none=True)
            loss, _, _ = forward_backward(m, step, rank, None, {12: "spike_all"})
            verdicts.append(guard.step(loss))
        guard.flush()
        runs.append([(v.decision, v.tensors_clipped, list(v.moments_reset)) for v in verdicts])
        ends.append(snapshot(m, opt))
    agreed(runs[1])
    assert runs[0] == runs[1], f"host and device decided differently:\n{runs[0]}\n{runs[1]}"
    assert len(runs[1]) == 16 and runs[1][11][0] == "skip" and runs[1][11][2], runs[1][11]
    assert sum(c for _, c, _ in runs[1]) > 0, "AdaGC clipped tensors"
    assert bitwise_equal(ends[0], ends[1]), "host and device paths ended at different bits"


def dcp_save(m, opt, guard, ckpt):
    """docs/pytorch.md's checkpoint recipe: the model, the optimizer and the guard, saved with
    torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optim_state = get_state_dict(m, opt)
    dcp.save({"model": model_state, "optim": optim_state, "guard": guard.state_dict()},
             checkpoint_id=ckpt)


def dcp_load(m, opt, guard, ckpt):
    """What dcp_save saved, loaded into (fresh) `m`, `opt` and `guard`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optim_state = get_state_dict(m, opt)
    state = {"model": model_state, "optim": optim_state, "guard": guard.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    guard.load_state_dict(state["guard"])


def resume(run_dir, shard=False):
    """docs/pytorch.md's checkpoint recipe: at step 10 (mid-window, after a skip) get_state_dict
    of the model and the optimizer and the guard's state_dict, saved with
    torch.distributed.checkpoint; then a fresh model, optimizer and guard (nothing trained
    before loading), set_state_dict from dcp.load, steps 11-20: the same decisions and the
    uninterrupted run's bits. DDP, or FSDP2 (`shard`)."""
    rank = dist.get_rank()
    ckpt = os.path.join(run_dir, "ckpt")

    def fresh():
        m = fsdp_model() if shard else model()
        wrapped = m if shard else torch.nn.parallel.DistributedDataParallel(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        return m, wrapped, opt, lt.SkipGuard(opt, SKIP, model=m, ddp=None if shard else wrapped)

    faults = FSDP_FAULTS if shard else FAULTS
    m, wrapped, opt, guard = fresh()
    first = train(wrapped, opt, guard, 10, rank, next(m.parameters()), faults)
    dcp_save(m, opt, guard, ckpt)
    rest = train(wrapped, opt, guard, 20, rank, next(m.parameters()), faults, start=11)
    end = snapshot(m, opt)

    m2, wrapped2, opt2, guard2 = fresh()
    dcp_load(m2, opt2, guard2, ckpt)
    assert guard2.counters["step"] == 10 and guard2.skipped_steps == 1, guard2.counters
    again = train(wrapped2, opt2, guard2, 20, rank, next(m2.parameters()), faults, start=11)
    assert again == rest, f"resumed decisions differ:\n{again}\n{rest}"
    assert bitwise_equal(end, snapshot(m2, opt2)), "the resumed run ended elsewhere"
    if not shard:
        expect_faults_skipped(first + rest)


def misuse(run_dir):
    """A mistake on one rank only (rank 1) raises MisuseError on every rank at the same step,
    naming rank 1, with no rank waiting in a collective; on the host path and through the fused
    AdamW (found a step later there, and nothing was applied)."""
    rank = dist.get_rank()
    for fused in (False, True):
        m = model()
        wrapped = torch.nn.parallel.DistributedDataParallel(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused)
        guard = lt.SkipGuard(opt, SKIP, model=m, ddp=wrapped, training_max_norm=0.0,
                             skip_device_decision="on" if fused else "off")
        assert guard.on_device == fused
        train(wrapped, opt, guard, 3, rank, next(m.parameters()))
        for step, mistake in ((4, "ids"), (5, "float"), (6, "no-losses")):
            opt.zero_grad(set_to_none=True)
            loss, ids, losses = forward_backward(wrapped, step, rank, None, {})
            weights = snapshot(m, opt)[:len(list(m.parameters()))]
            kwargs = {"sample_ids": ids, "sample_losses": losses}
            if rank == 1 and mistake == "ids":
                kwargs["sample_ids"] = ids[:-1]
            if rank == 1 and mistake == "no-losses":
                kwargs["sample_losses"] = None
            arg = loss.item() if rank == 1 and mistake == "float" else loss
            try:
                guard.step(arg, **kwargs)
                guard.flush()  # the fused path reads the step's misuse with its verdict
                raise AssertionError(f"rank {rank}: {mistake} on rank 1 was accepted")
            except lt.MisuseError as e:
                expect = {"ids": "rank 1 passed 3 sample ids and 4 sample losses",
                          "float": "rank 1 passed a Python number as the loss",
                          "no-losses": "rank 1 passed sample_ids without sample_losses"}[mistake]
                assert str(e).startswith("lockstep guard: " + expect), str(e)
            assert bitwise_equal(weights, snapshot(m, opt)[:len(weights)]), "a misuse stepped"
        twice(wrapped, m, opt, guard, rank)
        del wrapped
        gc.collect()


def twice(wrapped, m, opt, guard, rank):
    """Rank 1 calls guard.step a second time after one backward (rank 0 ran a new one): every
    rank raises MisuseError naming rank 1 and the mistake; no second update, no step counted."""
    opt.zero_grad(set_to_none=True)
    loss, _, _ = forward_backward(wrapped, 7, rank, None, {})
    step = guard.step(loss).step  # the verdict's step, as the message names it
    guard.flush()
    counted = guard.counters["step"]
    weights = snapshot(m, opt)[:len(list(m.parameters()))]
    n = sum(p.grad is not None for p in m.parameters())
    if rank == 0:  # a new backward here, of the module itself (no collective: rank 1 runs
        opt.zero_grad(set_to_none=True)  # none); rank 1 steps again on the same gradients
        loss, _, _ = forward_backward(m, 8, rank, None, {})
    try:
        guard.step(loss)
        guard.flush()
        raise AssertionError(f"rank {rank}: a second guard.step without a backward was accepted")
    except lt.MisuseError as e:
        assert str(e).startswith("lockstep guard: rank 1 called guard.step again without a new "
                                 f"backward (none of its {n} gradients changed since guard step "
                                 f"{step})"), str(e)
    assert bitwise_equal(weights, snapshot(m, opt)[:len(weights)]), "the second step updated"
    assert guard.counters["step"] == counted, (guard.counters, counted)


def refused_everywhere(expect, build):
    """build() raises ConfigError on every rank, in one line containing each of `expect`."""
    try:
        build()
    except lt.ConfigError as e:
        assert all(x in str(e) for x in expect) and "\n" not in str(e), str(e)
        return
    raise AssertionError(f"rank {dist.get_rank()}: accepted, expected {expect}")


def agree(run_dir):
    """The guards of all ranks agree at construction: a setting refused on one rank, another
    threshold, another learning rate or another model raise ConfigError on every rank naming
    the rank, the key and each rank's value (none waits for the others)."""
    rank = dist.get_rank()
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    refused_everywhere(["rank 1: invalid value for 'skip.max_grad_norm'"], lambda: lt.SkipGuard(
        opt, SKIP, model=m, skip_max_grad_norm=-1.0 if rank == 1 else 0.0))
    refused_everywhere(["differ in 'skip.max_grad_norm': rank 0 0.0, rank 1 5.0"],
                       lambda: lt.SkipGuard(opt, SKIP, model=m, skip_max_grad_norm=5.0 * rank))
    refused_everywhere(["'training.max_norm': rank 0 1.0, rank 1 2.0"], lambda: lt.SkipGuard(
        opt, SKIP, model=m, training_max_norm=1.0 + rank))
    other = torch.optim.AdamW(m.parameters(), lr=1e-3 * (1 + rank))
    refused_everywhere(["'optimizer.param_groups[0].lr': rank 0 0.001, rank 1 0.002"],
                       lambda: lt.SkipGuard(other, SKIP, model=m))
    torch.manual_seed(0)
    wider = Llama(VOCAB, 32 + 16 * rank, 2, 4, 2, SEQ, 10000.0, 16)
    refused_everywhere(["'parameters': rank 0 ", "rank 1 parameter 0: tok_embeddings.weight (64, 48)"],
                       lambda: lt.SkipGuard(torch.optim.AdamW(wider.parameters()), SKIP,
                                            model=wider))
    guard = lt.SkipGuard(opt, SKIP, model=m)  # alike: accepted
    assert guard.world == 2


def nan_weight(run_dir):
    """One parameter element of rank 1 turns NaN after step 4 (as a NaN in loaded weights
    would): at step 5 every rank raises StepAborted blaming the model (rank 1's tensor named),
    and nothing is quarantined (issue 42: it skipped into the guard and quarantined samples)."""
    rank = dist.get_rank()
    m = model()
    wrapped = torch.nn.parallel.DistributedDataParallel(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    guard = lt.SkipGuard(opt, SKIP, run_dir=run_dir, model=m, ddp=wrapped)
    train(wrapped, opt, guard, 4, rank, None, {})
    if rank == 1:
        with torch.no_grad():
            m.layers[0].wq.weight.view(-1)[0] = float("nan")
    opt.zero_grad(set_to_none=True)
    loss, ids, losses = forward_backward(wrapped, 5, rank, None, {})
    try:
        guard.step(loss, sample_ids=ids, sample_losses=losses)
        raise AssertionError(f"rank {rank}: a NaN weight was not found")
    except lt.StepAborted as e:
        assert "(nonfinite parameters on rank 1" in str(e) and "the model:" in str(e), str(e)
        if rank == 1:
            assert "layers.0.wq.weight (1 nonfinite)" in str(e), str(e)
    del wrapped
    gc.collect()
    dist.barrier()
    binary = os.environ.get("LOCKSTEP_BIN")
    if rank == 0 and binary:
        summary = json.loads(subprocess.run([binary, "diag", "--json", run_dir], check=True,
                                            capture_output=True, text=True).stdout)
        assert summary["aborts"] == 1 and summary["quarantine"] == [], summary
        assert summary["events"][0]["cause"] == "model", summary["events"][0]


def stall(run_dir):
    """Rank 1 stops calling guard.step after step 3: rank 0 raises StalledRank at step 4 naming
    rank 1, within comm.train_timeout_seconds (here 2 s) and a grace as long, not Gloo's 30
    minutes; then rank 1, told by a file, leaves."""
    rank = dist.get_rank()
    m = model()  # no DDP: each rank's own gradient (rank 1 is absent from no other collective)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    guard = lt.SkipGuard(opt, SKIP, model=m, comm_train_timeout_seconds=2)
    done = os.path.join(run_dir, "rank0-raised")
    os.makedirs(run_dir, exist_ok=True)
    for step in range(1, 5):
        if step == 3:
            state_on_rank0_only(guard, rank, os.path.join(run_dir, "rank0-state-raised"))
        if rank == 1 and step == 4:
            while not os.path.exists(done):  # the event: rank 0 raised (no wait on a duration)
                time.sleep(0.05)
            return
        opt.zero_grad(set_to_none=True)
        loss, _, _ = forward_backward(m, step, rank, None, {})
        try:
            guard.step(loss)
        except lt.StalledRank as e:
            assert rank == 0 and step == 4, (rank, step, str(e))
            assert str(e).startswith("lockstep guard: rank 1 did not reach guard.step 4 within "
                                     "comm.train_timeout_seconds = 2 s"), str(e)
            os.makedirs(run_dir, exist_ok=True)
            open(done, "w").close()
            return
    raise AssertionError(f"rank {rank}: step 4 was taken without rank 1")


def state_on_rank0_only(guard, rank, done):
    """Rank 0 alone calls guard.state_dict() (a collective in the record form): it raises
    StalledRank naming rank 1 within the timeout, not a hang; rank 1 waits for that, and both
    go on stepping."""
    if rank == 1:
        while not os.path.exists(done):
            time.sleep(0.05)
        return
    try:
        guard.state_dict()
        raise AssertionError("state_dict() on rank 0 alone returned")
    except lt.StalledRank as e:
        assert str(e).startswith("lockstep guard: rank 1 did not call guard.state_dict() within "
                                 "comm.train_timeout_seconds = 2 s"), str(e)
    open(done, "w").close()


def mesh(run_dir):
    """On 4 ranks, HSDP and FSDP x TP: the guard's norm equals the fp64 norm of the whole
    model's gradient (each element once) within 1e-6 at every step; a NaN planted after the
    reduction in one copy only of a norm weight (rank 1: tp 1's copy; HSDP: replica 1) is caught
    and skipped on every rank with the parameters and moments bitwise untouched, its count a
    fraction (the copies disagree)."""
    rank = dist.get_rank()
    for layout in ("hsdp", "fsdp-tp"):
        m, data_rank = mesh_model(layout)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        guard = lt.SkipGuard(opt, SKIP, run_dir=os.path.join(run_dir, layout), model=m,
                             training_max_norm=0.0)
        norm = dict(m.named_parameters())["layers.0.ffn_norm.weight"]
        for step in range(1, 9):
            opt.zero_grad(set_to_none=True)
            loss, _, _ = forward_backward(m, step, data_rank, None, {})
            if step == 6 and rank == 1:
                norm.grad._local_tensor[0] = float("nan")
            want = reference_norm(m)
            # torchtitan's norm where its DTensor arithmetic takes the layout: on FSDP x TP its
            # stack of per-tensor norms on two meshes raises ("must have the same mesh")
            titan = titan_norm(m) if layout == "hsdp" and step != 6 else None
            before = snapshot(m, opt)
            v = guard.step(loss)
            if titan is not None:
                assert abs(v.grad_norm - titan) <= 1e-4 * titan, (layout, step, v.grad_norm, titan)
            if step == 6:
                assert v.decision == "skip" and "nonfinite_grad" in v.reasons, (layout, v)
                assert 0 < v.nonfinite < 1, (layout, v.nonfinite)  # one copy of two holds it
                assert bitwise_equal(before, snapshot(m, opt)), f"{layout}: the skip stepped"
            else:
                assert v.decision == "step", (layout, step, v.decision, v.reasons)
                assert abs(v.grad_norm - want) <= 1e-6 * want, (layout, step, v.grad_norm, want)
        agreed([layout, guard.counters["skipped_steps"]])
        guard.close()
        del m, opt, guard
        gc.collect()


def mesh_device(run_dir):
    """On 4 ranks, HSDP and FSDP x TP with the fused AdamW and the per-tensor policies (AdaGC,
    SPAM's reset): the device path (found_inf, grad_scale; each tensor's sums weighed by its
    holders on the device) decides as the host path at every step, the grad norm's bits
    included, and both end at the same bits; the NaN in one copy of a norm weight is skipped."""
    rank = dist.get_rank()
    for layout in ("hsdp", "fsdp-tp"):
        runs, ends = [], []
        for path in ("off", "on"):
            m, data_rank = mesh_model(layout)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
            guard = lt.SkipGuard(opt, SKIP, model=m, training_max_norm=0.0,
                                 skip_device_decision=path, **ADAGC)
            assert guard.on_device == (path == "on")
            norm = dict(m.named_parameters())["layers.0.ffn_norm.weight"]
            verdicts = []
            for step in range(1, 11):
                opt.zero_grad(set_to_none=True)
                loss, _, _ = forward_backward(m, step, data_rank, None, {})
                if step == 8 and rank == 1:
                    norm.grad._local_tensor[0] = float("nan")
                verdicts.append(guard.step(loss))
            guard.flush()
            runs.append([summary(v) for v in verdicts])
            ends.append(snapshot(m, opt))
            guard.close()
        assert runs[0] == runs[1], f"{layout}: host and device decided differently:\n{runs}"
        assert [r[0] for r in runs[1]].count("skip") == 1 and runs[1][7][0] == "skip", runs[1]
        assert bitwise_equal(ends[0], ends[1]), f"{layout}: host and device ended apart"
        agreed(runs[1])
        gc.collect()


def resume_mesh(run_dir):
    """FSDP x TP on 4 ranks, docs/pytorch.md's checkpoint recipe: the model, the optimizer and
    the guard saved with torch.distributed.checkpoint at step 6 (after a skip of a NaN in one copy
    of a norm weight), loaded into fresh objects (their layout exchanged again at construction):
    steps 7-12 take the uninterrupted run's decisions and end at its bits."""
    rank = dist.get_rank()
    ckpt = os.path.join(run_dir, "ckpt")

    def fresh():
        m, data_rank = mesh_model("fsdp-tp")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        return m, opt, lt.SkipGuard(opt, SKIP, model=m), data_rank

    def steps(m, opt, guard, data_rank, first, last):
        norm = dict(m.named_parameters())["layers.0.ffn_norm.weight"]
        out = []
        for step in range(first, last + 1):
            opt.zero_grad(set_to_none=True)
            loss, _, _ = forward_backward(m, step, data_rank, None, {})
            if step in (4, 9) and rank == 1:
                norm.grad._local_tensor[0] = float("nan")
            out.append(summary(guard.step(loss)))
        return out

    m, opt, guard, data_rank = fresh()
    first = steps(m, opt, guard, data_rank, 1, 6)
    dcp_save(m, opt, guard, ckpt)
    rest = steps(m, opt, guard, data_rank, 7, 12)
    end = snapshot(m, opt)
    assert [d for d, *_ in first + rest].count("skip") == 2, first + rest

    m2, opt2, guard2, _ = fresh()
    dcp_load(m2, opt2, guard2, ckpt)
    assert guard2.counters["step"] == 6 and guard2.skipped_steps == 1, guard2.counters
    again = steps(m2, opt2, guard2, data_rank, 7, 12)
    assert again == rest, f"resumed decisions differ:\n{again}\n{rest}"
    assert bitwise_equal(end, snapshot(m2, opt2)), "the resumed run ended elsewhere"
    agreed(again)


class Stage(torch.nn.Module):
    """Pipeline stage `stage` of 2 of model(): the embedding and block 0, or block 1, the norm
    and the output (torchtitan's split: the blocks keep their names, layers.<i>)."""

    def __init__(self, full, stage):
        super().__init__()
        first, last = stage == 0, stage == 1
        self.tok_embeddings = full.tok_embeddings if first else None
        self.layers = torch.nn.ModuleDict({str(stage): full.layers[stage]})
        self.norm, self.output = (full.norm, full.output) if last else (None, None)
        self.register_buffer("cos", full.cos, persistent=False)
        self.register_buffer("sin", full.sin, persistent=False)

    def forward(self, x):
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x, self.cos[:SEQ], self.sin[:SEQ])
        return x if self.output is None else self.output(self.norm(x))


def pipeline_model(skip=SKIP, **overrides):
    """model() in 2 pipeline stages x FSDP2 over 2 data-parallel ranks (a (pp, dp) mesh of 4),
    scheduled by torch.distributed.pipelining's GPipe with 2 micro-batches: the stage module,
    its schedule, the mesh and a guard over the whole mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh["pp"].get_local_rank()
    m = Stage(model(), stage)
    for block in m.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(m, mesh=mesh["dp"])
    pipe = PipelineStage(m, stage, 2, torch.device("cpu"), group=mesh["pp"].get_group())

    def loss_fn(logits, y):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
    schedule = ScheduleGPipe(pipe, n_microbatches=2, loss_fn=loss_fn)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    guard = lt.SkipGuard(opt, skip, model=m, mesh=mesh, training_max_norm=0.0, **overrides)
    return m, schedule, opt, guard, mesh


def pipeline(run_dir):
    """On 4 ranks, 2 pipeline stages x FSDP2: the stage without the loss passes None; the
    guard's norm equals the fp64 norm of the whole model (both stages, each element once)
    within 1e-6 at every step, its loss the last stage's; a NaN planted in stage 0's gradient
    on one rank is skipped by both stages with parameters and moments bitwise untouched; a NaN
    loss on one pipeline's last stage names both of its stages' ranks by their place in the
    mesh (events, `lockstep diag`); a guard whose config differs on a rank of stage 1 is refused
    on every rank by name."""
    from torch.distributed.device_mesh import init_device_mesh
    rank = dist.get_rank()
    probe = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_one = probe["pp"].get_local_rank() == 1
    refused_everywhere(["differ in 'skip.loss_zscore': rank 0 12.0, rank 1 12.0, rank 2 12.0, "
                        "rank 3 9.0"], lambda: pipeline_model(
                            {"skip": {**SKIP["skip"], "loss_zscore": 9.0 if rank == 3 else 12.0}}))
    m, schedule, opt, guard, mesh = pipeline_model(run_dir=run_dir)
    assert guard.places.stage == mesh["pp"].get_local_rank()
    data_rank, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_group()
    named = dict(m.named_parameters())
    for step in range(1, 11):
        opt.zero_grad(set_to_none=True)
        x, y, _ = batch(step, data_rank)
        losses = []
        schedule.step(x, target=y, losses=losses) if stage_one else schedule.step(x)
        loss = torch.stack(losses).mean() if stage_one else None
        if step == 8 and rank == 3:  # the last stage of data-parallel rank 1: a NaN loss
            loss = loss * float("nan")
        if step == 6 and rank == 1:  # stage 0, data-parallel rank 1: its shard of block 0's wq
            named["layers.0.wq.weight"].grad._local_tensor[0, 0] = float("nan")
        want = torch.tensor([reference_norm(m) ** 2], dtype=torch.float64)
        dist.all_reduce(want, group=pp)  # the stages' squares added: the whole model's
        want = want.item() ** 0.5
        titan = titan_norm(m, mesh["pp"]) if step != 6 else None  # (a NaN norm scales by NaN)
        before = snapshot(m, opt)
        v = guard.step(loss)
        if titan is not None:
            assert abs(v.grad_norm - titan) <= 1e-4 * titan, (step, v.grad_norm, titan)
        if step == 6:
            assert v.decision == "skip" and "nonfinite_grad" in v.reasons, v
            # after FSDP2's reduce-scatter: no rank's own gradient to blame (see docs/pytorch.md)
            assert v.nonfinite == 1 and list(v.culprit_ranks) == [], (v.nonfinite, v)
            assert bitwise_equal(before, snapshot(m, opt)), "the skip stepped"
        elif step == 8:  # pipeline dp 1's loss: both of its stages' rows carry it
            assert v.decision == "skip" and list(v.culprit_ranks) == [1, 3], v
        else:
            assert v.decision == "step", (step, v.decision, v.reasons)
            assert abs(v.grad_norm - want) <= 1e-6 * want, (step, v.grad_norm, want)
        agreed([step, v.decision, summary(v)[3]])
    assert guard.skipped_steps == 2 and guard.optimizer_steps == 8, guard.counters
    # stage 0 passing a loss where stage 1 computes it: refused on every rank, nothing applied
    opt.zero_grad(set_to_none=True)
    x, y, _ = batch(11, data_rank)
    losses = []
    schedule.step(x, target=y, losses=losses) if stage_one else schedule.step(x)
    before = snapshot(m, opt)
    try:
        guard.step(torch.stack(losses).mean() if stage_one else torch.tensor(1.0))
        raise AssertionError("a loss on stage 0 was accepted")
    except lt.MisuseError as e:
        assert "rank 0 (and rank 1) passed a loss on pipeline stage 0, where stage 1 computes" \
            in str(e), str(e)
    assert bitwise_equal(before, snapshot(m, opt)) and guard.optimizer_steps == 8
    guard.close()
    binary = os.environ.get("LOCKSTEP_BIN")
    if rank == 0 and binary:  # the culprit by its place in the mesh
        out = subprocess.run([binary, "diag", run_dir], check=True, capture_output=True,
                             text=True).stdout
        assert "culprit rank 1 (pp 0, dp 1), 3 (pp 1, dp 1)" in out and \
            "rank 3 (pp 1, dp 1): culprit in 1 event(s)" in out, out


def device(run_dir):
    """Fused AdamW: the device path (found_inf, grad_scale; read a step late) and the host path
    take the same decisions and end at the same bits (no clip: grad_scale is 1)."""
    rank = dist.get_rank()
    ends, runs = [], []
    for mode in ("off", "on"):  # "on": on the CPU too ("auto" decides there on the host)
        m = model()
        wrapped = torch.nn.parallel.DistributedDataParallel(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        guard = lt.SkipGuard(opt, SKIP, model=m, ddp=wrapped, training_max_norm=0.0,
                             skip_device_decision=mode)
        assert guard.on_device == (mode == "on")
        runs.append(train(wrapped, opt, guard, 20, rank, next(m.parameters())))
        ends.append(snapshot(m, opt))
    agreed(runs[1])
    assert runs[0] == runs[1], f"host and device decided differently:\n{runs[0]}\n{runs[1]}"
    expect_faults_skipped(runs[1])
    assert bitwise_equal(ends[0], ends[1]), "host and device paths ended at different bits"


def forms(run_dir):
    """skip.exchange: the record form (one fixed-size record a step, every rank's row only on a
    step to explain; each rank's detector keeps its own windows) decides as the table form (every
    rank's row every step), on the host path and through the fused AdamW on the device path:
    the same verdicts (the grad norm's bits), the same end bits, every rank's events byte for
    byte. A state_dict saved at step 10 by either form resumes in the other (the record form
    gathers every rank's windows when it saves) and decides the rest as the uninterrupted run."""
    rank = dist.get_rank()
    faults = {**FAULTS, 18: "spike_all"}  # and a global spike: scope "global"

    def run(path, form, d, state=None, start=1, stop=20, trained=None):
        """`trained`: (model, optimizer) to go on with, in a new DDP."""
        if trained is None:
            m = model()
            trained = (m, torch.nn.parallel.DistributedDataParallel(m),
                       torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True))
        m, wrapped, opt = trained
        if wrapped is None:
            wrapped = torch.nn.parallel.DistributedDataParallel(m)
            trained = (m, wrapped, opt)
        guard = lt.SkipGuard(opt, SKIP, run_dir=d, model=m, ddp=wrapped,
                             skip_device_decision=path, skip_exchange=form)
        assert guard._record == (form == "record") and guard.on_device == (path == "on")
        if state is not None:
            guard.load_state_dict(state)
        decisions = train(wrapped, opt, guard, stop, rank, next(m.parameters()), faults, start)
        return decisions, guard, trained

    for path in ("off", "on"):
        runs, ends, events = [], [], []
        for form in ("table", "record"):
            d = os.path.join(run_dir, f"{path}-{form}")
            decisions, guard, (m, _, opt) = run(path, form, d)
            runs.append(decisions)
            ends.append(snapshot(m, opt))
            with open(os.path.join(d, "diagnostics", f"rank{rank}.jsonl"), encoding="utf-8") as f:
                events.append(f.read())
        agreed(runs[1])
        assert runs[0] == runs[1], f"{path}: the forms decided differently:\n{runs[0]}\n{runs[1]}"
        assert [r[0] for r in runs[1]].count("skip") == 3 and runs[1][17][0] == "clip", runs[1]
        assert bitwise_equal(ends[0], ends[1]), f"{path}: the forms ended at different bits"
        assert events[0] == events[1] and events[0].count("\n") >= 4, f"{path}: events differ"
        if path == "on":
            break
        # A resume goes on in a new DDP, whose buckets (and so, on 3 ranks, the bits of its
        # sums) differ from the uninterrupted run's: table -> table is the reference.
        resumed = []
        for saved, loaded in (("table", "table"), ("record", "table"), ("table", "record")):
            d = os.path.join(run_dir, f"resume-{saved}-{loaded}")
            first, guard, (m, _, opt) = run(path, saved, d, stop=10)
            state = guard.state_dict()  # every rank: the record form gathers the windows
            guard.close()
            rest, _, _ = run(path, loaded, d, state, 11, 20, (m, None, opt))
            resumed.append((first + rest, snapshot(m, opt)))
            assert [r[:3] for r in first + rest] == [r[:3] for r in runs[0]], (saved, loaded)
            assert resumed[-1][0] == resumed[0][0], f"{saved} -> {loaded} decided differently"
            assert bitwise_equal(resumed[-1][1], resumed[0][1]), f"{saved} -> {loaded}: other bits"


def main():
    scenario, run_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if dist.get_rank() == 0:  # events append (a resumed run continues its files): start clean
        shutil.rmtree(run_dir, ignore_errors=True)
    dist.barrier()
    try:
        {"ddp": ddp, "fsdp": fsdp, "resume": resume, "device": device,
         "resume-fsdp": lambda d: resume(d, shard=True), "misuse": misuse, "mesh": mesh,
         "agree": agree, "stall": stall, "pipeline": pipeline, "mesh-device": mesh_device, "resume-mesh": resume_mesh, "nan-weight": nan_weight,
         "adagc": adagc, "adagc-device": adagc_device, "forms": forms}[scenario](run_dir)
        gc.collect()  # the scenario's DDP modules go before the process group (Gloo's exit)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"{scenario}: ok")


if __name__ == "__main__":
    main()
