"""python/examples/torchtitan_guard.py under torchrun on the CPU: torchtitan 0.3.0 (PyPI) trains
its llama3 debug model with FSDP2 over Gloo, its own data loader, tokenizer, lr schedule and
fused AdamW, with lockstep's guard in its optimizer step. Rank 1's loss turns NaN at step 3 and
spikes 30x at step 7. Checked on every rank: the same decisions at the same steps (step 3
skipped, the run goes on where torchtitan alone stops on a nonfinite loss), the skipped step
leaves every rank's FSDP2 shard of the parameters and of the AdamW state bitwise as it was,
and `lockstep diag` names rank 1 from the events.

torchtitan has no CPU mode; titan_cpu.py gives it one and says where.

    torchrun --standalone --nproc-per-node 2 tests/python/titan_guard.py RUN_DIR host|device|resume
"host": the guard decides on the host (skip.device_decision = "off"); "device": torchtitan's fused
AdamW takes the decision's found_inf and grad_scale (the GPU default; here in host memory), the
verdicts read a step later; "resume": a run resumed from torchtitan's step-5 checkpoint decides
and ends as the run that went on. Exit 0 and "ok" on success.
"""
import json
import os
import shutil
import subprocess
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python", "examples"))
sys.path.insert(0, HERE)
from titan_cpu import make_assets, titan_config, titan_on_cpu  # noqa: E402

NAN_STEP, SPIKE_STEP, STEPS, RESUME_AT = 3, 7, 8, 5
GUARD = {"skip": {"enabled": True, "window": 16, "min_history": 3, "loss_zscore": 6,
                  "grad_norm_zscore": 6, "on_global_spike": "clip"},
         "training": {"max_norm": 1.0}}


def local(t):
    return (t._local_tensor if hasattr(t, "_local_tensor") else t).detach().clone()


def faulty_trainer():
    from torchtitan_guard import GuardedTrainer

    class Faulty(GuardedTrainer):
        """Rank 1's loss NaN at NAN_STEP and 30x at SPIKE_STEP (before its backward: its
        gradient carries it into the reduce-scatter); every rank keeps each step's verdict and
        its shards of the parameters and AdamW state."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.verdicts, self.shards = {}, {}
            rank, loss_fn = dist.get_rank(), self.loss_fn

            def poisoned(*a, **k):
                loss, aux = loss_fn(*a, **k)
                if rank == 1 and self.step == NAN_STEP:
                    loss = loss * float("nan")
                if rank == 1 and self.step == SPIKE_STEP:
                    loss = loss * 30.0
                return loss, aux

            self.loss_fn = poisoned

        def keep(self, step):
            v = self.guard.last_verdict
            if v is not None and step >= 1:
                self.verdicts[step] = (v.decision, list(v.reasons), list(v.culprit_ranks))

        def train_step(self, data_iterator):
            super().train_step(data_iterator)
            # the device-decided step (fused AdamW) reads each verdict a step later
            self.keep(self.step - 1 if self.guard.on_device else self.step)
            state = [local(p) for p in self.model_parts[0].parameters()]
            for o in self.optimizers.optimizers:
                for s in o.state.values():
                    state += [local(s[k]) for k in ("exp_avg", "exp_avg_sq", "step")]
            self.shards[self.step] = state

    return Faulty


def run(assets, run_dir, where, checkpoint=False):
    """One torchtitan run of STEPS steps with the faults; returns its trainer, closed."""
    guard = {**GUARD, "skip": {**GUARD["skip"], "device_decision": "on" if where == "device" else "off"}}
    config = titan_config(assets, run_dir, STEPS)
    if checkpoint:  # every RESUME_AT steps, everything (the model, AdamW, data, train_state)
        config.checkpoint.enable, config.checkpoint.interval = True, RESUME_AT
    trainer = faulty_trainer()(config, guard_config=guard)
    assert trainer.guard.on_device == (where == "device"), "the fused AdamW takes found_inf"
    try:
        trainer.train()  # torchtitan alone stops at step 3: "Loss is not finite"
    finally:
        trainer.close()  # reads the last device-decided verdict
    trainer.keep(STEPS)
    return trainer


def same_bits(a, b):
    return len(a) == len(b) and all(
        torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(a, b))


def expect_agreed_skips(trainer, run_dir):
    """Both faults skipped on every rank, culprit rank 1, the skipped steps' shards untouched,
    `lockstep diag` naming rank 1."""
    v = trainer.verdicts
    assert sorted(v) == list(range(1, STEPS + 1)), sorted(v)
    assert v[NAN_STEP][0] == "skip" and "nonfinite_loss" in v[NAN_STEP][1] \
        and v[NAN_STEP][2] == [1], v[NAN_STEP]
    assert v[SPIKE_STEP][0] == "skip" and v[SPIKE_STEP][2] == [1], v[SPIKE_STEP]
    assert all(v[s][0] == "step" for s in v if s not in (NAN_STEP, SPIKE_STEP)), v
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, v)
    assert all(e == every[0] for e in every), f"the ranks decided differently: {every}"
    for skipped in (NAN_STEP, SPIKE_STEP):
        assert same_bits(trainer.shards[skipped - 1], trainer.shards[skipped]), \
            f"step {skipped} changed this rank's shards"
    assert not same_bits(trainer.shards[NAN_STEP + 1], trainer.shards[NAN_STEP])
    assert trainer.guard.skipped_steps == 2, trainer.guard.counters
    binary = os.environ.get("LOCKSTEP_BIN")
    if dist.get_rank() == 0 and binary:
        out = subprocess.run([binary, "diag", "--json", os.path.join(run_dir, "lockstep")],
                             check=True, capture_output=True, text=True).stdout
        per_rank = {r["rank"]: r["culprit_in"] for r in json.loads(out)["per_rank"]}
        assert per_rank.get(1) == 2 and per_rank.get(0) == 0, per_rank


def expect_resume_goes_on(assets, run_dir):
    """A run resumed from torchtitan's step-RESUME_AT checkpoint (the guard's windows and
    counters in its train_state) decides steps RESUME_AT+1.. as the run that went on (the spike
    at SPIKE_STEP is judged against the restored windows) and ends at the same bits."""
    whole = run(assets, os.path.join(run_dir, "whole"), "host", checkpoint=True)
    expect_agreed_skips(whole, os.path.join(run_dir, "whole"))
    resumed_dir = os.path.join(run_dir, "resumed")
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(run_dir, "whole", "checkpoint", f"step-{RESUME_AT}"),
                        os.path.join(resumed_dir, "checkpoint", f"step-{RESUME_AT}"))
    dist.barrier()
    resumed = run(assets, resumed_dir, "host", checkpoint=True)
    later = range(RESUME_AT + 1, STEPS + 1)
    assert sorted(resumed.verdicts) == list(later), sorted(resumed.verdicts)
    assert all(resumed.verdicts[s] == whole.verdicts[s] for s in later), \
        (resumed.verdicts, whole.verdicts)
    assert resumed.guard.skipped_steps == 2 and resumed.guard.counters["step"] == STEPS, \
        resumed.guard.counters
    assert same_bits(resumed.shards[STEPS], whole.shards[STEPS]), "the resumed run ended elsewhere"


def expect_own_flags_taken_out():
    """The example's command line: its two flags out, torchtitan's left in order."""
    from torchtitan_guard import _own_flags

    got = _own_flags(["--module", "llama3", "--lockstep-config=skip.toml", "--config",
                      "llama3_8b", "--lockstep-run-dir", "runs/a", "--training.steps", "5"])
    assert got == ("skip.toml", "runs/a", ["--module", "llama3", "--config", "llama3_8b",
                                          "--training.steps", "5"]), got


def main(run_dir, where):
    expect_own_flags_taken_out()
    titan_on_cpu()
    from torchtitan.tools.logging import init_logger

    init_logger()
    dist.init_process_group("gloo")  # torchtitan then keeps it
    rank = dist.get_rank()
    if rank == 0:  # the guard's events append (a resumed run continues them): start clean
        shutil.rmtree(run_dir, ignore_errors=True)
    dist.barrier()
    assets = os.path.join(run_dir, f"assets-{rank}")
    make_assets(assets)
    if where == "resume":
        expect_resume_goes_on(assets, run_dir)
    else:
        expect_agreed_skips(run(assets, run_dir, where), run_dir)
    dist.barrier()
    if rank == 0:
        print("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
