"""lockstep's guard in torchtitan's trainer: the agreed, explained skip inside torchtitan's own
optimizer step (where torchtitan's maintainers suggested such a check belongs), with its FSDP2,
its data, its lr schedule and its checkpoints unchanged.

    torchrun --nproc-per-node 8 python/examples/torchtitan_guard.py \\
        --module llama3 --config llama3_8b [torchtitan's flags] \\
        [--lockstep-config skip.toml] [--lockstep-run-dir DIR]

What GuardedTrainer changes in torchtitan's Trainer (torchtitan 0.3.0 from PyPI):
  - `optimizers.step()` becomes `guard.step(loss)`: each rank checks its FSDP2 shard of the
    gradients, one row per rank is exchanged, every rank takes the same decision and steps,
    clips or skips all of torchtitan's optimizers (the fused AdamW's found_inf/grad_scale on a GPU:
    no host read on a clean step);
  - the clip is lockstep's (`training.max_norm` in the guard's config, clip_grad_norm_'s
    semantics, applied to the update it takes); torchtitan's own clip_grad_norm_ does not run
    during the step (it would clip a spike before the guard could see it), and torchtitan's
    logged grad_norm is the guard's;
  - a nonfinite loss no longer stops the run: the guard skips that step on every rank
    (torchtitan's "Loss is not finite" stop is left to lockstep's guards, which abort with
    lockstep.torch.StepAborted on every rank when skips pile up);
  - torchtitan's lr scheduler advances every step (lockstep's lr_scheduler.on_skip =
    "advance"; "hold" is refused);
  - the guard's windows, guards and counters ride in torchtitan's checkpoints (train_state).
Events go to RUN_DIR/diagnostics/rank<R>.jsonl (default: torchtitan's dump folder + /lockstep),
so `lockstep diag RUN_DIR` names the culprit rank of a nonfinite or spiking loss.
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch
import torchtitan.trainer as titan
from torchtitan.config import ConfigManager
from torchtitan.tools.logging import init_logger

from lockstep.torch import ConfigError, SkipGuard


class _Optimizers:
    """What the guard steps: torchtitan's optimizers (one per model part) as one optimizer."""

    def __init__(self, container):
        self.container = container
        # torchtitan sets `fused` per parameter group: every group fused, the guard may hand the
        # fused Adam/AdamW kernels its found_inf and grad_scale (the device-decided step).
        fused = all(g.get("fused") for g in self.param_groups) and all(
            isinstance(o, (torch.optim.Adam, torch.optim.AdamW)) for o in container.optimizers)
        self.defaults = {**container.optimizers[0].defaults, "fused": fused}
        if fused:
            self._step_supports_amp_scaling = True

    @property
    def optimizers(self):
        return self.container.optimizers

    @property
    def param_groups(self):
        return [g for o in self.container.optimizers for g in o.param_groups]

    @property
    def state(self):  # each parameter's state, wherever its optimizer is
        return {p: s for o in self.container.optimizers for p, s in o.state.items()}

    def step(self):
        # The container's own step (its class's, with its hooks: the guard's step stands in for
        # the instance's during a train step); decided on the device, every fused optimizer
        # reads the decision's found_inf and grad_scale.
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        inner = self.container.optimizers if found_inf is not None else []
        for o in inner:
            o.found_inf, o.grad_scale = found_inf, grad_scale
        try:
            type(self.container).step(self.container)
        finally:
            for o in inner:
                del o.found_inf, o.grad_scale


class GuardedTrainer(titan.Trainer):
    """torchtitan's Trainer whose optimizer step is lockstep's agreed step, skip or clip."""

    def __init__(self, config, *, guard_config=None, run_dir=None):
        super().__init__(config)
        if run_dir is None:
            run_dir = os.path.join(config.dump_folder, "lockstep")
        self.guard = SkipGuard(_Optimizers(self.optimizers), config=guard_config,
                               model=self.model_parts[0], run_dir=run_dir)
        if self.guard.config["lr_scheduler"]["on_skip"] != "advance":
            raise ConfigError("invalid value for 'lr_scheduler.on_skip': torchtitan advances its "
                              "lr scheduler every step; set it to \"advance\"")
        mesh = self.parallel_dims.get_optional_mesh("batch") if self.parallel_dims.dp_enabled else None
        self._batch_degree = mesh.size() if mesh is not None else 1
        self._loss = None
        self._grad_norm = torch.zeros((), device=self.device)

    def forward_backward_step(self, **kwargs):
        loss = super().forward_backward_step(**kwargs)  # this rank's token sum / global tokens
        self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()
        return loss

    def _guarded_step(self, closure=None):
        # The rank's mean loss (every rank holds as many tokens: the sum x the batch degree).
        verdict = self.guard.step(self._loss * self._batch_degree)
        if verdict.ready:  # decided on the device, it is read at the next step (no wait here)
            self._grad_norm.fill_(verdict.grad_norm)

    def _no_clip(self, *args, **kwargs):
        return self._grad_norm  # the guard clips the update it takes; this is what it measured

    @contextlib.contextmanager
    def _lockstep_owns_the_step(self):
        # For one train step: torchtitan's clip and its optimizers' step (an instance attribute
        # over the class's, which _Optimizers.step calls) become the guard's.
        clip = titan.dist_utils.clip_grad_norm_
        titan.dist_utils.clip_grad_norm_, self.optimizers.step = self._no_clip, self._guarded_step
        try:
            yield
        finally:
            titan.dist_utils.clip_grad_norm_ = clip
            del self.optimizers.step

    def train_step(self, data_iterator):
        self._loss = None
        with self._lockstep_owns_the_step():
            try:
                super().train_step(data_iterator)
            except RuntimeError as e:
                # A nonfinite global loss means some rank's loss was nonfinite, and lockstep never
                # takes such a step: the guard skipped it on every rank (its guards raise
                # StepAborted when skips pile up), so torchtitan's stop (raised after the
                # optimizer step, on a logging step) does not apply; that step is not logged.
                if not str(e).startswith("Loss is not finite"):
                    raise

    def state_dict(self):
        return {**super().state_dict(), "lockstep": self.guard.state_dict()}

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if "lockstep" in state_dict:
            self.guard.load_state_dict(state_dict["lockstep"])

    def close(self):
        try:
            self.guard.close()  # the last device-decided step's counters and event
        finally:
            super().close()


def _own_flags(argv):
    """--lockstep-config FILE and --lockstep-run-dir DIR, taken out of torchtitan's flags."""
    mine, rest, it = {}, [], iter(argv)
    for arg in it:
        key = arg.split("=", 1)[0]
        if key in ("--lockstep-config", "--lockstep-run-dir"):
            mine[key] = arg.split("=", 1)[1] if "=" in arg else next(it)
        else:
            rest.append(arg)
    return mine.get("--lockstep-config"), mine.get("--lockstep-run-dir"), rest


def main(argv=None):
    init_logger()
    guard_config, run_dir, rest = _own_flags(sys.argv[1:] if argv is None else argv)
    config = ConfigManager().parse_args(rest)
    trainer = GuardedTrainer(config, guard_config=guard_config, run_dir=run_dir)
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
