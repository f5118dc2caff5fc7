"""lockstep's agreed, explained skip for PyTorch training loops (DDP, FSDP2, one process).

    guard = lockstep.torch.SkipGuard(optimizer, model=model, run_dir="runs/a")
    loss.backward()
    verdict = guard.step(loss)          # instead of clip_grad_norm_ + optimizer.step()

Everything that checks or decides is lockstep's C++ (lockstep._C, built from the harness's own
kernels/ and src/): the fused one-pass check, the decision core, the counters, the events. This
file gathers the gradients, exchanges one 72-byte row per rank over the process group and
applies the verdict to the optimizer. docs/pytorch.md says what each part does and costs.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import socket
import time
import weakref
from datetime import timedelta
from dataclasses import dataclass

import torch
import torch.distributed as dist

try:
    from . import _C
    from .mesh import MeshPlaces, PipelineLoss
except ImportError as e:  # the package's C++ part is built by pip, not shipped in the source
    raise ImportError(
        f"lockstep._C is not built ({e}); install the package with `pip install "
        "--no-build-isolation .` in lockstep's folder (torch installed first), or run "
        "launch/test.sh there to build it in place") from e

log = logging.getLogger("lockstep")
# torch 2.13 renamed all_gather_into_tensor (one flat collective) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

ConfigError = _C.ConfigError

# The sections of a lockstep config the guard reads; the others belong to the harness's trainer
# (a full lockstep TOML file is accepted, its other sections unused).
GUARD_KEYS = ("skip.", "diagnostics.", "lr_scheduler.on_skip", "training.max_norm",
              "comm.train_timeout_seconds")
SECTIONS = ("job", "model", "training", "optimizer", "lr_scheduler", "checkpoint", "metrics",
            "data", "validation", "parallelism", "comm", "skip", "diagnostics", "fault")
# What needs the harness's own step (the batch, a replay, a peer's recomputation).
HARNESS_ONLY = {  # the values the guard takes; others need lockstep's own trainer
    ("skip", "scope"): ("step",),
    ("skip", "replay"): ("off",),
    ("diagnostics", "replay_every"): (0,),
    ("training", "loss_scale"): ("none",),
    # the guard knows neither a step's tokens in advance nor its compute time
    ("skip", "max_consecutive_tokens"): (0,),
    ("skip", "max_consecutive_seconds"): (0,),
}


def harness_only_refusal(config):
    """The message refusing a setting only lockstep's own trainer takes (HARNESS_ONLY), or None;
    `config`: the resolved config (Core.config_json())."""
    for (section, key), fine in HARNESS_ONLY.items():
        value = config[section][key]
        if value not in fine:
            takes = " or ".join(map(repr, fine))
            return (f"invalid value for '{section}.{key}': {value!r} needs lockstep's own trainer "
                    f"(lockstep train); the guard takes {takes}")
    return None


def _fused(optimizer):
    """The optimizer takes found_inf and grad_scale (a fused Adam/AdamW)."""
    return bool(optimizer.defaults.get("fused")) and hasattr(optimizer,
                                                             "_step_supports_amp_scaling")


def plan_of(core, device_type, backend, fused):
    """What a step exchanges and where it is decided (lockstep._C.ExchangePlan): the trainer's
    own rule over the guard's path. "auto" decides on the device for gradients on a GPU,
    exchanged by NCCL, with a fused Adam/AdamW (found_inf and grad_scale, no host read); "on"
    also elsewhere (a CPU: the tests). `backend`: the process group's ("" for one process)."""
    host_exchange = "" if backend in ("", "nccl") or "cuda:nccl" in backend else \
        f"the process group's {backend} exchanges on the host"
    return core.plan(device_type == "cuda", host_exchange, fused)


class StalledRank(RuntimeError):
    """Raised on the ranks that wait when another rank did not reach guard.step within
    comm.train_timeout_seconds (it stopped calling it, hangs elsewhere or died); the message
    names it. Nothing of that step was applied."""


class StepAborted(RuntimeError):
    """Every rank raises this at the same step: the agreed decision is to stop (a guard fired,
    skip.enabled is false and a gradient is nonfinite, or on_global_spike = "abort"). Parameters
    and optimizer state are those of the last update; save nothing newer than your last
    checkpoint, fix the cause (the message and `lockstep diag RUN_DIR` name it), and resume."""


class MisuseError(RuntimeError):
    """Raised on every rank at the step where the guard sees a mistake in the loop, on any rank:
    the message names the rank, the mistake and the fix. Nothing of that step was applied (no
    update, no count); fix the loop and run again."""


# What a rank can get wrong in one guard.step call, by code. The code and two numbers of the rank
# that made the mistake ride in the exchanged row, so every rank raises the same MisuseError at
# the same step (none waits in a collective for a rank that raised alone).
MISUSES = {
    1: "passed a Python number as the loss; pass the loss tensor itself (`loss`, not "
       "`loss.item()`), after loss.backward()",
    2: "called guard.step with no gradients ({a:.0f} parameters, none with .grad); call it after "
       "loss.backward() and before optimizer.zero_grad()",
    3: "passed sample_ids without sample_losses; pass both (each sample's own loss, in the ids' "
       "order) or neither",
    4: "passed sample_losses without sample_ids; pass both (each sample's id, in the losses' "
       "order) or neither",
    5: "passed {a:.0f} sample ids and {b:.0f} sample losses; pass one loss per id, in the same "
       "order",
    6: "called scheduler.step() outside guard.step ({a:.0f} time(s) since the guard's last step); "
       "the guard steps the scheduler you passed it: remove your scheduler.step()",
    7: "passed a loss of {a:.0f} elements; pass this rank's mean loss (a one-element tensor)",
    8: "called guard.step again without a new backward (none of its {a:.0f} gradients changed "
       "since guard step {b:.0f}); call loss.backward() before each guard.step (a second step "
       "would apply the same gradient twice and shift the step counter)",
    9: "passed no loss on pipeline stage {a:.0f}, the stage that computes its pipeline's loss "
       "(it passed it at the first step); pass the loss there at every step",
    10: "passed a loss on pipeline stage {a:.0f}, where stage {b:.0f} computes its pipeline's "
        "loss; pass None on the stages without the loss (the guard sends them the loss)",
    11: "found {a:.0f} pipeline stages passing a loss in its pipeline; pass the loss on the stage "
        "that computes it (the last, or stage 0 of a V-shaped schedule) and None on the others",
}
_MISUSE_COLUMNS = 3  # the code, then its two numbers


def _text(key, value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return value
    raise ConfigError(f"invalid value for '{key}': {value!r}; expected a bool, number or string")


def _key_of_keyword(name):
    """skip_grad_norm_zscore -> skip.grad_norm_zscore; lr_scheduler_on_skip -> lr_scheduler.on_skip"""
    for section in sorted(SECTIONS, key=len, reverse=True):
        if name.startswith(section + "_"):
            return f"{section}.{name[len(section) + 1:]}"
    raise ConfigError(f"unknown option '{name}'; keyword options are lockstep keys with the first "
                      f"'.' written '_', e.g. skip_enabled=True for skip.enabled")


def _flatten(config, prefix=""):
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, name + ".")
        else:
            yield name, value


def _overrides(config, overrides):
    """The (key, text) pairs lockstep's config reader applies; only keys the guard reads."""
    pairs = list(_flatten(config)) if isinstance(config, dict) else []
    pairs += [(_key_of_keyword(k), v) for k, v in overrides.items()]
    for key, _ in pairs:
        if "." in key and not key.startswith(GUARD_KEYS):
            raise ConfigError(f"'{key}' is your trainer's setting, not the guard's; the guard "
                              f"reads {', '.join(k.rstrip('.') + ('*' if k.endswith('.') else '') for k in GUARD_KEYS)}")
    return [(k, _text(k, v)) for k, v in pairs]


def _inner_optimizers(optimizer):
    """The optimizers behind `optimizer` (a container such as torchtitan's is looked through)."""
    return getattr(optimizer, "optimizers", None) or [optimizer]


def _adam_like(optimizer):
    """Whether every optimizer behind `optimizer` keeps Adam's moments."""
    return all(isinstance(o, (torch.optim.Adam, torch.optim.AdamW))
               for o in _inner_optimizers(optimizer))


def _and_others(ranks):
    """" (and rank 2)" / " (and ranks 2, 3)" after the first of `ranks`, or ""."""
    if len(ranks) < 2:
        return ""
    return f" (and rank{'s' if len(ranks) > 2 else ''} {', '.join(map(str, ranks[1:]))})"


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _apply_values(targets, index, values, op):
    """targets[i] x values[index[i]] (op 0; 1: untouched), or zeroed where it is 1 (op 1), on the
    values' device with no host read: lockstep's kernel for contiguous fp32 tensors, torch's ops
    (a pass over each) for the others."""
    fast = [t.dtype == torch.float32 and t.is_contiguous() for t in targets]
    _C.apply_tensor_values([t for t, f in zip(targets, fast) if f],
                           [i for i, f in zip(index, fast) if f], values, op)
    for t, i, f in zip(targets, index, fast):
        if f:
            continue
        if op == 0:
            t.mul_(values[i])
        else:
            t.masked_fill_(values[i] == 1, 0)


def _grad_parts(params):
    """The gradients to check and whether they are shards: FSDP2's DTensor gradients are each
    rank's own Shard(0) pieces; plain tensors are whole (DDP: the same on every rank)."""
    grads = [p.grad for p in params]
    dtensor = [hasattr(g, "_local_tensor") for g in grads]
    if any(dtensor) and not all(dtensor):
        raise ValueError("the optimizer holds both DTensor and plain gradients; the guard checks "
                         "FSDP2's sharded gradients or plain ones, not a mix")
    if not any(dtensor):
        return grads, False
    for g in grads:
        if any(pl.is_partial() for pl in g.placements):
            raise ValueError(f"a gradient of placements {g.placements} is Partial (not reduced "
                             "yet); call guard.step after the gradients' reduction (FSDP2 "
                             "reduces them in backward)")
    return [g._local_tensor for g in grads], True


def _holding(p, group_ranks):
    """Where this rank holds parameter `p` (check/layout.h's Holding): its device mesh's ranks
    in the guard's group (row-major), the mesh's shape and a letter per mesh dimension (S: a
    shard, strided too; R: replicated; P: partial)."""
    mesh = p.device_mesh
    ranks = []
    for r in mesh.mesh.flatten().tolist():
        if r not in group_ranks:
            raise ConfigError(f"parameter on device mesh {mesh.mesh.tolist()}: rank {r} is not in "
                              "the guard's process group; pass a process group that holds every "
                              "rank of the model's meshes")
        ranks.append(group_ranks.index(r))
    letters = "".join("P" if pl.is_partial() else "R" if pl.is_replicate() else "S"
                      for pl in p.placements)
    return ranks, list(mesh.shape), letters


@functools.lru_cache(maxsize=None)
def _build_id():
    """lockstep's C++ as built: a digest of the extension's own bytes (two builds of one version
    string differ here)."""
    with open(_C.__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _digest(text):
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _first_difference(shapes, reference):
    """The first parameter where `shapes` differs from `reference` ('' if none)."""
    for i, (a, b) in enumerate(zip(shapes, reference)):
        if a != b:
            return f"parameter {i}: {a}"
    return f"{len(shapes)} tensors" if len(shapes) != len(reference) else ""


class Verdict:
    """The agreed verdict of one guard.step, the same on every rank: `step` (the guard's count,
    1-based), `decision` ("step", "skip", "clip" or "abort"), `reasons`, `grad_norm`, `loss`,
    `clip`, `culprit_ranks`, `scope`, `cause`, ... (docs/pytorch.md lists them).

    Decided on the device (a fused AdamW), the verdict stays there until a field is read (that
    read waits for the device) or the next guard.step reads it, whichever comes first; `ready`
    says whether it has been read."""

    __slots__ = ("step", "_guard", "_core")

    def __init__(self, step, guard, core=None):
        self.step, self._guard, self._core = step, guard, core

    @property
    def ready(self):
        return self._core is not None

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if self._core is None:
            self._guard._settle(self)
        return getattr(self._core, name)

    def __repr__(self):
        if self._core is None:
            return f"Verdict(step {self.step}, decided on the device, not read yet)"
        return f"Verdict(step {self.step}, {repr(self._core)[len('Verdict('):]}"


def _zero_step(optimizer):
    """A step at learning rate 0 over zero gradients: how torch.distributed.checkpoint's
    get_state_dict / set_state_dict create a fresh optimizer's state (it moves no weight)."""
    groups = optimizer.param_groups
    return all(float(g.get("lr", 0.0)) == 0.0 for g in groups) and all(
        p.grad is None or not bool(p.grad.any()) for g in groups for p in g["params"])


def _refuse_outside(guard, optimizer, args, kwargs):
    if guard() is not None and not _zero_step(optimizer):  # a guard that is gone refuses nothing
        guard()._outside_step()


def _claim(optimizer, guard):
    """A step pre-hook on each optimizer behind `optimizer` that refuses a step outside
    guard.step (replacing an earlier guard's: the newest guard of an optimizer owns its step)."""
    hooks = []
    for o in _inner_optimizers(optimizer):
        if not hasattr(o, "register_step_pre_hook"):
            continue
        if getattr(o, "_lockstep_hook", None) is not None:
            o._lockstep_hook.remove()
        o._lockstep_hook = o.register_step_pre_hook(functools.partial(_refuse_outside,
                                                                      weakref.ref(guard)))
        hooks.append(o._lockstep_hook)
    return hooks


class _UsedGradients:
    """The gradients a guard step used, as they stood when it ended: each one's tensor (a weak
    reference: zero_grad(set_to_none=True) frees it) and its version counter (every backward
    that accumulates into it, and every in-place write, moves it). A later call whose gradients
    are all the same tensors at the same versions had no backward in between."""

    def __init__(self, step, params):
        self.step = step
        self.marks = [(weakref.ref(p.grad), _local(p.grad)._version) for p in params]

    def unchanged(self, params):
        if len(params) != len(self.marks):
            return False
        return all(ref() is p.grad and _local(p.grad)._version == version
                   for (ref, version), p in zip(self.marks, params))


@dataclass
class _Pending:  # a device-decided step whose verdict the host reads a step later
    verdict: Verdict
    mine: object
    samples: tuple | None
    lr: float
    tokens: int
    misuse: object  # the exchanged misuse columns (the record form: this rank's own row, its
    # misuse columns last), copied to the host without a wait
    copied: object  # a CUDA event after that copy (None on a CPU): waited on before reading


class SkipGuard:
    """The agreed step, skip, clip or abort for a PyTorch optimizer.

    optimizer: any torch.optim optimizer (its parameters: plain tensors, or FSDP2's DTensors).
    config: a lockstep TOML file, or a dict of lockstep keys ({"skip": {"enabled": True}} or
        {"skip.enabled": True}); keyword overrides use '_' for the first '.' (skip_enabled=True).
        The guard reads skip.*, training.max_norm (the clip, as clip_grad_norm_),
        lr_scheduler.on_skip and diagnostics.*.
    process_group: the ranks that decide together (default: the world; none: one process).
    run_dir: events go to run_dir/diagnostics/rank<R>.jsonl (`lockstep diag run_dir` reads them).
    model: names the parameters in events (named_parameters); ddp: a DistributedDataParallel
        whose comm hook checks each rank's own gradient before the all-reduce (culprit ranks).
    scheduler: stepped as lr_scheduler.on_skip says ("advance": every step, "hold": updates).
    mesh: the job's whole DeviceMesh (torchtitan's world_mesh): events name each rank by its
        coordinates, and a dimension named "pp" holds pipeline stages (lockstep/mesh.py: each
        stage's ranks agree on their parameters; guard.step(None) where a stage has no loss).
    """

    def __init__(self, optimizer, config=None, process_group=None, run_dir=None, *, model=None,
                 ddp=None, scheduler=None, mesh=None, **overrides):
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.group = process_group
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.world = dist.get_world_size(process_group) if distributed else 1
        self.run_dir = os.fspath(run_dir) if run_dir is not None else ""
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self.names = [names.get(id(p), f"param_groups.{i}") for i, p in enumerate(self.params)]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.places = MeshPlaces(mesh, process_group, self.rank, self.world)
        try:  # a setting refused on one rank is refused on every rank (none waits for it)
            self._settings(config, overrides)
            refused = None
        except ConfigError as e:
            refused = str(e)
        self._agree(refused)
        self._weights = self._layout()  # 1 / holders of each tensor's local elements, or None
        self._weight_index = {}
        if self.run_dir:  # only for a valid config: a refused guard writes nothing
            os.makedirs(os.path.join(self.run_dir, "diagnostics"), exist_ok=True)
        self._step = 0
        self._checks = {}
        self._sum_index = {}
        self._local_parts = []
        self._pending = None
        self._used = None  # the gradients the last step used (_UsedGradients)
        self._state_calls = 0  # state_dict() calls (the record form's roll call names each)
        self.last_verdict = None
        self._epoch = None  # the scheduler's last_epoch after the guard's last step
        self._inside = False  # the guard's own optimizer.step() is running
        self._exchange_group = self._group_with_timeout()
        self._pipeline = PipelineLoss(self.places, self.config["comm"]["train_timeout_seconds"],
                                      self.device) if self.places.pipelined else None
        self._my_sums = None  # this rank's per-tensor sums, gathered on the steps that need them
        if self._record:  # one fixed-size record a step, every rank's row only on a step to explain
            self.core.exchange_records_over(self._exchange_group.group_name, self._stage())
        self._hooks = _claim(optimizer, self)
        if ddp is not None:
            self.attach_ddp(ddp)

    # ---- settings --------------------------------------------------------------------------
    def _settings(self, config, overrides):
        """The config read by lockstep's reader, and what the guard's path allows of it."""
        text, origin = "", "<guard>"
        if isinstance(config, (str, os.PathLike)):
            origin = os.fspath(config)
            try:
                with open(origin, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"config file: cannot read '{origin}' ({e}); pass a lockstep "
                                  "TOML file or a dict") from None
        elif config is not None and not isinstance(config, dict):
            raise ConfigError(f"config: {type(config).__name__}; expected a TOML file path or a dict")
        self.core = _C.Core(text, origin, _overrides(config, overrides), self.rank, self.world,
                            self.names, self.run_dir, socket.gethostname(), str(self.device),
                            self.places.text if self.places.names else [])
        self.config = json.loads(self.core.config_json())
        self._refuse_harness_only()
        self._tensors = self.core.tensors_active()  # AdaGC's clip, SPAM's reset
        if self.config["skip"]["spike_moment_reset"] and not _adam_like(self.optimizer):
            raise ConfigError("invalid value for 'skip.spike_moment_reset': true needs Adam or "
                              f"AdamW moments (exp_avg, exp_avg_sq); {type(self.optimizer).__name__} "
                              "has none to reset; set it to false")
        # What each step exchanges and where it is decided: the trainer's plan (lockstep._C)
        self.plan = plan_of(self.core, self.device.type, self._backend(), _fused(self.optimizer))
        self.on_device = self.plan.on_device
        self._record = self.plan.each == "record"
        self._sums_each_step = self.plan.tensor_sums_each_step  # else gathered when needed

    def _fingerprint(self):
        """What every rank's guard must share: its resolved settings, the optimizer's kind and
        hyper-parameters, the parameters' names, shapes and dtypes in order, the world, the
        build of lockstep's C++ (the extension's own bytes) and torch's version."""
        out = {f"{section}.{key}": value for section in ("skip", "diagnostics")
               for key, value in self.config[section].items()}
        out["lr_scheduler.on_skip"] = self.config["lr_scheduler"]["on_skip"]
        out["training.max_norm"] = self.config["training"]["max_norm"]
        out["comm.train_timeout_seconds"] = self.config["comm"]["train_timeout_seconds"]
        out["optimizer"] = ", ".join(type(o).__name__ for o in _inner_optimizers(self.optimizer))
        for i, group in enumerate(self.optimizer.param_groups):
            for key, value in sorted(group.items()):
                if key != "params":
                    out[f"optimizer.param_groups[{i}].{key}"] = repr(value)
        shapes = [f"{n} {tuple(p.shape)} {str(p.dtype).replace('torch.', '')}"
                  for n, p in zip(self.names, self.params)]
        out["parameters"] = f"{len(shapes)} tensors, digest {_digest(chr(10).join(shapes))}"
        out["world_size"] = dist.get_world_size() if self.world > 1 else 1
        out["mesh"] = self.places.describe()
        out["lockstep build"] = _build_id()
        out["torch"] = torch.__version__
        return out, shapes

    def _agree(self, refused):
        """Every rank's guard alike, checked at construction: a setting refused on any rank, or
        any difference, raises ConfigError on every rank naming the rank, the key and the values."""
        if self.world == 1:
            if refused:
                raise ConfigError(refused)
            return
        mine = {"refused": refused} if refused else dict(zip(("values", "shapes"),
                                                             self._fingerprint()))
        every = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        bad = [(r, e["refused"]) for r, e in enumerate(every) if "refused" in e]
        if bad:
            raise ConfigError(f"lockstep guard: rank {bad[0][0]}: {bad[0][1]}"
                              f"{_and_others([r for r, _ in bad])}")
        # the parameters: alike within a pipeline stage (the first rank of each is its reference)
        first = {s: self.places.stage_of.index(s) for s in set(self.places.stage_of)}
        ref = [every[first[s]] for s in self.places.stage_of]
        differ = []
        for key in every[0]["values"]:
            values = [e["values"].get(key) for e in every]
            if key == "parameters" and any(v != f["values"][key] for v, f in zip(values, ref)):
                values = [_first_difference(e["shapes"], f["shapes"]) or v
                          for e, f, v in zip(every, ref, values)]
            elif key == "parameters" or all(v == values[0] for v in values):
                continue
            differ.append(f"'{key}': " + ", ".join(f"rank {r} {v}" for r, v in enumerate(values)))
        if differ:
            stages = "" if self.places.pipelined else (
                " (pipeline stages hold different parameters: pass mesh=, whose 'pp' dimension "
                "says which ranks share a stage)")
            raise ConfigError("lockstep guard: the ranks' guards differ in " + "; ".join(differ) +
                              "; build the guard, its optimizer and model alike on every rank" +
                              (stages if any(d.startswith("'parameters'") for d in differ) else ""))

    def _layout(self):
        """Where every rank holds every DTensor parameter (one exchange at construction), and so
        how many ranks hold each element this rank holds (lockstep's check/layout.h): on HSDP's
        replicate dimension, or on the copies of a norm weight sharded over each tensor-parallel
        rank's data-parallel submesh. Each rank checks its whole local piece and weighs its stats
        by 1 / holders, so the world's norm and nonfinite count take every element once. None
        where every element has one holder (FSDP2 on one mesh dimension, plain gradients)."""
        if self.world == 1 or not any(hasattr(p, "device_mesh") for p in self.params):
            return None
        group_ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
        try:
            mine, refused = [_holding(p, group_ranks) if hasattr(p, "device_mesh") else
                             ([self.rank], [1], "R") for p in self.params], None
        except ConfigError as e:
            mine, refused = None, str(e)
        every = [None] * self.world
        dist.all_gather_object(every, (mine, refused), group=self.group)
        holders = None
        if not any(r for _, r in every):
            try:
                stage_of = self.places.stage_of  # another pipeline stage holds none of these
                holdings = [[every[r][0][t] if stage_of[r] == stage_of[self.rank] else ([], [], "")
                             for r in range(self.world)] for t in range(len(self.params))]
                holders = _C.element_holders(self.names, holdings, self.rank)
            except ConfigError as e:
                refused = str(e)
        agreed = [None] * self.world  # a layout refused on any rank is refused on every rank
        dist.all_gather_object(agreed, refused, group=self.group)
        bad = [(r, e) for r, e in enumerate(agreed) if e] or \
              [(r, e) for r, (_, e) in enumerate(every) if e]
        if bad:
            raise ConfigError(f"lockstep guard: rank {bad[0][0]}: {bad[0][1]}"
                              f"{_and_others([r for r, _ in bad])}")
        if all(h == 1 for h in holders):
            return None
        return torch.tensor([1.0 / h for h in holders], dtype=torch.float64, device=self.device)

    def _weighed(self, stats, params):
        """A check's stats over `params` with each tensor's count and sum of squares weighed by
        1 / holders (see _layout), and the totals added again."""
        key = tuple(map(id, params))
        if key not in self._weight_index:
            self._weight_index[key] = self._weights[
                torch.tensor([self._index[id(p)] for p in params], device=self.device)]
        head = _C.STATS_HEADER
        out = stats.clone()
        per = out[head:].view(-1, 2)
        per.mul_(self._weight_index[key].unsqueeze(1))
        out[:2] = per.sum(0)
        return out

    def _refuse_harness_only(self):
        refusal = harness_only_refusal(self.config)
        if refusal:
            raise ConfigError(refusal)

    def _backend(self):
        return str(dist.get_backend(self.group)) if self.world > 1 else ""

    # ---- DDP: each rank's own gradient, before the all-reduce ---------------------------------
    def attach_ddp(self, ddp, process_group=None):
        """Registers a comm hook on `ddp` that checks this rank's own gradient bucket by bucket
        before the default all-reduce (the mean), so events name the rank whose own gradient
        was bad. Replaces DDP's default hook with the same all-reduce."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def hook(state, bucket):
            params = bucket.parameters()
            slots = [self._index.get(id(p), -1) for p in params]
            names = [self.names[i] if i >= 0 else "?" for i in slots]
            check = self._checks.setdefault(("bucket", bucket.index(), tuple(slots)),
                                            _C.Check(names))
            self._local_parts.append((slots, check.run(bucket.gradients())))
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(process_group, hook)

    def _local_stats(self):
        """This rank's own gradient's stats from the DDP hook's buckets (None without a hook)."""
        if not self._local_parts:
            return None
        head = _C.STATS_HEADER
        out = torch.zeros(head + 2 * len(self.params), dtype=torch.float64,
                          device=self._local_parts[0][1].device)
        for slots, stats in self._local_parts:
            out[:head] += stats[:head]
            for j, slot in enumerate(slots):
                if slot >= 0:
                    out[head + 2 * slot: head + 2 * slot + 2] = stats[head + 2 * j: head + 2 * j + 2]
        self._local_parts = []
        return out

    # ---- the step ------------------------------------------------------------------------------
    def _shard_stats(self, params):
        """Check [B]: the gradient this rank owns. Shards (FSDP2) whole; whole gradients (DDP,
        one process) in parts of their concatenation, one per rank of this rank's pipeline stage
        (the world without pipelining), its own part here."""
        grads, sharded = _grad_parts(params)
        names = [self.names[self._index[id(p)]] for p in params]
        part, parts = self.places.replica, self.places.replicas
        if sharded or parts == 1:
            offset, length = 0, -1
        else:
            total = sum(g.numel() for g in grads)
            offset = total * part // parts
            length = total * (part + 1) // parts - offset
        key = ("shard", tuple(names), offset, length)
        check = self._checks.setdefault(key, _C.Check(names, offset, length))
        stats = check.run(grads)
        return (stats if self._weights is None else self._weighed(stats, params)), grads

    def _misuse(self, loss, params, sample_ids, sample_losses):
        """This rank's mistake in this call, as (code, a, b) (code 0: none); see MISUSES."""
        if not torch.is_tensor(loss):
            return 1, 0, 0  # (None on a pipeline stage without the loss: replaced before)
        if loss.numel() != 1:
            return 7, loss.numel(), 0
        if not params:
            return 2, len(self.params), 0
        if (sample_ids is None) != (sample_losses is None):
            return (3 if sample_losses is None else 4), 0, 0
        if sample_ids is not None and len(sample_ids) != len(sample_losses):
            return 5, len(sample_ids), len(sample_losses)
        if self.scheduler is not None and self._epoch is not None \
                and self.scheduler.last_epoch != self._epoch:
            return 6, self.scheduler.last_epoch - self._epoch, 0
        if self._used is not None and self._used.unchanged(params):
            return 8, len(params), self._used.step
        return 0, 0, 0

    def _refuse(self, misuse):
        """Raises MisuseError on every rank if any rank's row carries a mistake ([W, 3] fp64)."""
        codes = misuse.cpu().tolist()
        bad = [(r, row) for r, row in enumerate(codes) if row[0] != 0]
        if not bad:
            return
        self._local_parts = []
        r, (code, a, b) = bad[0]
        raise MisuseError(f"lockstep guard: rank {r}{_and_others([x for x, _ in bad])} "
                          f"{MISUSES[int(code)].format(a=a, b=b)}; nothing of this step was applied")

    def _row(self, shard, local, loss, stop, sample_losses):
        """This rank's 72-byte row of lockstep's stats table (built by the harness's own code)."""
        dev = shard.device
        losses = torch.as_tensor([] if sample_losses is None else sample_losses,
                                 dtype=torch.float64, device=dev)
        return _C.rank_row(local, shard, loss.detach().reshape(()).to(dev, torch.float64), losses,
                           1.0 if stop else 0.0)

    def _row_width(self):
        return len(_C.STATS_FIELDS) + (len(self.params) if self._sums_each_step else 0)

    def _group_with_timeout(self):
        """The group the rows go over: the process group's ranks and backend with
        comm.train_timeout_seconds as its collective timeout, so a rank that stops calling
        guard.step fails the others then (named by _stalled), not after the backend's default
        (Gloo's: 30 minutes)."""
        if self.world == 1:
            return None
        return dist.new_group(
            ranks=dist.get_process_group_ranks(self.group or dist.group.WORLD),
            timeout=timedelta(seconds=self.config["comm"]["train_timeout_seconds"]),
            backend=dist.get_backend(self.group), use_local_synchronization=True)

    def _exchange(self, row):
        if self.world == 1:
            return row.reshape(1, -1)
        table = torch.empty(self.world * row.numel(), dtype=row.dtype, device=row.device)
        self._gather(table, row, self._exchange_group)
        return table.reshape(self.world, -1)

    def _gather(self, into, row, group):
        try:
            _all_gather_single(into, row, group=group)
        except RuntimeError as e:  # a rank did not come (Gloo raises; NCCL's watchdog aborts)
            raise self._stalled(e) from None

    def _roll_call(self, what):
        """Every rank of the exchange group that reached `what` says so in the job's store, then
        waits up to comm.train_timeout_seconds for the others; returns the group ranks still
        missing then ("?" when the store cannot tell: it is torch's private API)."""
        timeout = self.config["comm"]["train_timeout_seconds"]
        try:
            store = dist.distributed_c10d._get_default_store()
            ranks = dist.get_process_group_ranks(self._exchange_group)
            store.set(f"lockstep/guard/{what}/{dist.get_rank()}", "1")
            deadline = time.monotonic() + timeout
            while True:
                here = [r for r in ranks if store.check([f"lockstep/guard/{what}/{r}"])]
                if len(here) == len(ranks) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            return ", ".join(str(dist.get_group_rank(self._exchange_group, r))
                             for r in ranks if r not in here)
        except Exception:  # noqa: BLE001
            return "?"

    def _stalled(self, error):
        """The error of a step some rank did not reach: every rank that did says so in the job's
        store, then waits up to the timeout again for the others; the ones still missing are
        named (the same on every waiting rank, barring a rank later than the timeout)."""
        timeout = self.config["comm"]["train_timeout_seconds"]
        step = self._step + 1
        missing = self._roll_call(step) or "?"
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return StalledRank(f"lockstep guard: rank {missing} did not reach guard.step {step} within "
                           f"comm.train_timeout_seconds = {timeout:g} s ({first}); every rank "
                           "must call guard.step once per step; nothing of this step was applied")

    def _samples(self, v, sample_ids, sample_losses):
        """Every rank's sample ids and losses, exchanged on anomalous steps only (every rank
        knows the step is anomalous: the verdict is agreed)."""
        table = _C.SampleTable()
        others = self._pipeline is not None and self._pipeline.samples  # its last stage's
        if not v.anomalous or (sample_ids is None and not others):
            return table
        mine = (list(map(int, sample_ids or [])), list(map(float, sample_losses or [])))
        every = [mine]
        if self.world > 1:
            every = [None] * self.world
            dist.all_gather_object(every, mine, group=self._exchange_group)
        table.ids = [ids for ids, _ in every]
        table.losses = [losses for _, losses in every]
        return table

    def _measure(self, loss, params, misuse, sample_losses, stop):
        """This rank's row (its stats, its per-tensor sums when a policy needs them, then its
        misuse columns) and its own side of the step; a rank that made a mistake sends zeros
        and a nonfinite count of 1, so no rank updates whatever is decided."""
        if misuse[0]:
            self._local_parts = []
            row = torch.zeros(self._row_width(), dtype=torch.float64, device=self.device)
            row[_C.STATS_FIELDS.index("shard_nonfinite")] = 1
            shard = grads = local = None
        else:
            shard, grads = self._shard_stats(params)
            local = self._local_stats()
            row = self._row(shard, local, loss, stop, sample_losses)
            if self._tensors:  # each tensor's partial sum of squares
                self._my_sums = self._tensor_sums(shard, params)
            if self._sums_each_step:  # decided on the device: the sums ride the same exchange
                row = torch.cat([row, self._my_sums])
        codes = torch.zeros(_MISUSE_COLUMNS, dtype=torch.float64, device=row.device)
        if misuse[0]:  # (a clean step copies nothing from the host: no wait on a GPU)
            codes = torch.tensor(misuse, dtype=torch.float64, device=row.device)
        mine = _C.LocalStep()
        if shard is not None:
            mine.local_stats = local  # the DDP hook's stats are in the guard's order already
            mine.shard_stats = self._in_guard_order(shard, params)
        return torch.cat([row, codes]), mine, grads

    @torch.no_grad()
    def step(self, loss, *, sample_ids=None, sample_losses=None, tokens=0, stop=False):
        """After backward(), instead of clip_grad_norm_ + optimizer.step(): checks this rank's
        gradients, exchanges one fixed-size record (skip.exchange; or one row per rank),
        decides, and steps, clips or skips. Returns the
        step's Verdict (`verdict.step`, `verdict.decision`, ...; decided on the device, it is
        read when first used). Raises StepAborted on every rank when the agreed decision is to
        stop, MisuseError on every rank when any rank's call is wrong (MISUSES). `loss`: this
        rank's mean loss (a tensor); `sample_ids`/`sample_losses`: this rank's samples and their
        own losses (events name the suspects; both or neither, on every rank or on none: an
        anomalous step exchanges them); `stop`: this rank asks all to stop (the verdict's
        `stop` is agreed)."""
        params = [p for p in self.params if p.grad is not None]
        misuse = (0, 0, 0)
        if self._pipeline is not None:  # the loss from the stage that has it
            loss, misuse = self._pipeline.exchange(loss, sample_losses is not None, self._gather)
        misuse = misuse if misuse[0] else self._misuse(loss, params, sample_ids, sample_losses)
        if loss is None:  # a misuse row: zeros
            loss = torch.zeros((), dtype=torch.float64, device=self.device)
        row, mine, grads = self._measure(loss, params, misuse, sample_losses, stop)
        whole, codes, v = self._exchange_step(row)
        table = whole[..., :len(_C.STATS_FIELDS)]
        self._step += 1
        if sample_ids is not None and not misuse[0]:
            mine.sample_ids = list(map(int, sample_ids))
            mine.sample_losses = list(map(float, sample_losses))
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.on_device:  # the per-tensor sums, if any, go along
            return self._step_on_device(whole, mine, lr, tokens, sample_ids, sample_losses, codes)
        v = v if v is not None else self.core.decide(table)
        self._judge_model(v)
        factors = self._tensor_actions(v, params)
        if v.updates:
            if v.clip < 1.0:
                torch._foreach_mul_(grads, v.clip)
            clipped = [(g, f) for g, f in zip(grads, factors) if f < 1.0]
            if clipped:  # AdaGC: the tensors above their own bound, scaled down to it
                torch._foreach_mul_([g for g, _ in clipped], [f for _, f in clipped])
            self._optimizer_step()
        self._advance_scheduler(v.updates)
        self._used = _UsedGradients(self._step, params)
        loss = _C.STATS_FIELDS.index("loss")  # the table's is on the host already
        mine.loss = float(row[loss] if self._record else table[self.rank, loss])
        self._finish(v, table, mine, self._samples(v, sample_ids, sample_losses), lr, tokens)
        return Verdict(self._step, self, v)

    def _exchange_step(self, row):
        """The table form: every rank's row all-gathered (a host decision reads it and refuses
        any rank's misuse). The record form: this rank's row stays here; a host decision is made
        now over the record exchange (lockstep._C), and a step some rank's misuse made
        anomalous (its row counts a nonfinite element) gathers the misuse columns to name it.
        Returns the rows (with any per-tensor sums), the misuse columns (what a device step
        keeps for its read: in the record form this rank's whole row) and the record form's host
        verdict (else None)."""
        if not self._record:
            whole = self._exchange(row)
            if not self.on_device:  # the host decides: one read of the exchanged table
                whole = whole.cpu()
                self._refuse(whole[:, -_MISUSE_COLUMNS:])
            return whole[:, :-_MISUSE_COLUMNS], whole[:, -_MISUSE_COLUMNS:], None
        mine, codes = row[:-_MISUSE_COLUMNS], row[-_MISUSE_COLUMNS:]
        if self.on_device:
            return mine, row, None
        try:
            v, table = self.core.decide_record(mine)
        except RuntimeError as e:  # a rank did not come
            raise self._stalled(e) from None
        if v.nonfinite > 0:
            self._refuse(self._exchange(codes).cpu())
        return table, codes, v

    def _stage(self):
        """Where the exchange group's collectives run: the GPU for NCCL, else the host."""
        nccl = "nccl" in str(dist.get_backend(self._exchange_group))
        return str(self.device) if nccl and self.device.type == "cuda" else "cpu"

    def _judge_model(self, v):
        """A step with nonfinite values, checked against the model's own parameters (each rank
        those it holds: FSDP2's shards), the counts exchanged so every rank agrees: any turns
        the verdict into an abort blaming the model, with nothing quarantined."""
        if not _C.model_suspect(v):
            return
        mine = _C.nonfinite_tensors(self.names, [_local(p).detach() for p in self.params])
        count = torch.tensor([float(sum(n for _, n in mine))], dtype=torch.float64,
                             device=self.device)
        _C.blame_model(v, self._exchange(count)[:, 0].tolist(), mine)

    def _in_guard_order(self, stats, params):
        """A check's buffer over `params` (those with gradients) as one over all of the guard's
        parameters, in its order (zeros for a parameter without a gradient this step)."""
        if len(params) == len(self.params):
            return stats
        head = _C.STATS_HEADER
        out = torch.zeros(head + 2 * len(self.params), dtype=stats.dtype, device=stats.device)
        out[:head] = stats[:head]
        for j, p in enumerate(params):
            i = self._index[id(p)]
            out[head + 2 * i: head + 2 * i + 2] = stats[head + 2 * j: head + 2 * j + 2]
        return out

    def _optimizer_step(self):
        """The optimizer's step, the one the guard allows (its pre-hook refuses any other)."""
        self._inside = True
        try:
            self.optimizer.step()
        finally:
            self._inside = False

    def _outside_step(self):
        if not self._inside:
            raise MisuseError(
                f"lockstep guard: rank {self.rank} called optimizer.step() outside guard.step "
                f"(after the guard's step {self._step}); guard.step(loss) already steps, clips or "
                "skips the optimizer: remove your optimizer.step() (a second one would apply the "
                "gradient twice, and a skipped step's bad gradient)")

    def _tensor_sums(self, shard, params):
        """This rank's partial sum of squares of every tensor, in the guard's parameter order
        (0 for a parameter without a gradient this step)."""
        head, n = _C.STATS_HEADER, len(params)
        out = torch.zeros(len(self.params), dtype=torch.float64, device=shard.device)
        key = tuple(map(id, params))
        if key not in self._sum_index:  # built once per set of parameters with gradients
            self._sum_index[key] = torch.tensor([self._index[i] for i in key], device=shard.device)
        out[self._sum_index[key]] = shard[head + 1: head + 2 * n: 2]
        return out

    def _tensor_actions(self, v, params):
        """The per-tensor policies of the decided step (the harness's TensorPolicies, over every
        rank's sums, gathered as the trainer does: only on a step that needs them, which every
        rank knows from the agreed verdict): SPAM's reset zeroes the moments of the tensors a
        global spike hit (now, skipped or not); returns AdaGC's factor for each of `params`
        (1: untouched)."""
        if not self._tensors or not self.core.needs_tensor_sums(v):
            return [1.0] * len(params)
        factors, resets = self.core.decide_tensors(self._exchange(self._my_sums).cpu(), v)
        for p, reset in zip(self.params, resets):
            for moment in self._moments(p) if reset else []:
                moment.zero_()
        return [factors[self._index[id(p)]] for p in params]

    def _moments(self, p):
        """Adam's moments of `p` (none before its first step); the step counts stay, as in the
        harness."""
        state = self.optimizer.state.get(p, {})
        return [state[key] for key in ("exp_avg", "exp_avg_sq") if key in state]

    def _tensor_actions_on_device(self, factors, resets):
        """The per-tensor policies decided on the device, applied there with no host read
        (lockstep's kernel for fp32 tensors, which touches only the tensors acted on)."""
        params = [p for p in self.params if p.grad is not None]
        moments, where = [], []
        for p in self.params:
            for moment in self._moments(p):
                moments.append(_local(moment))
                where.append(self._index[id(p)])
        _apply_values(moments, where, resets, 1)
        _apply_values(_grad_parts(params)[0], [self._index[id(p)] for p in params], factors, 0)

    def _step_on_device(self, table, mine, lr, tokens, sample_ids, sample_losses, codes):
        """The device decides (found_inf, grad_scale for the fused optimizer); a misuse row
        counts a nonfinite element, so nothing updates; the host reads the verdict and the misuse
        columns (copied without a wait) at the next step."""
        found_inf, grad_scale, factors, resets = self.core.decide_on_device(table, self._step)
        if factors is not None:
            self._tensor_actions_on_device(factors, resets)
        self.optimizer.found_inf, self.optimizer.grad_scale = found_inf, grad_scale
        try:
            self._optimizer_step()
        finally:
            del self.optimizer.found_inf, self.optimizer.grad_scale
        self._advance_scheduler(True)
        self._used = _UsedGradients(self._step, [p for p in self.params if p.grad is not None])
        verdict = Verdict(self._step, self)
        misuse, copied = codes.to("cpu", non_blocking=True), None
        if codes.is_cuda:
            copied = torch.cuda.Event()
            copied.record()
        previous, self._pending = self._pending, _Pending(
            verdict, mine, (sample_ids, sample_losses), lr, tokens, misuse, copied)
        self._finish_pending(previous)
        return verdict

    def _finish_pending(self, p):
        if p is None:
            return None
        if p.copied is not None:  # a step later: long landed, as the table's own copy
            p.copied.synchronize()
        loss = _C.STATS_FIELDS.index("loss")
        if self._record:  # p.misuse: this rank's own row, its misuse columns last
            v, table = self.core.read_device(p.verdict.step)  # the names: rows gathered
            if v.nonfinite > 0:
                self._refuse(self._exchange(p.misuse[-_MISUSE_COLUMNS:].to(self.device)).cpu())
            p.mine.loss = float(p.misuse[loss])
        else:
            self._refuse(p.misuse)
            v, table = self.core.read_device(p.verdict.step)
            p.mine.loss = float(table[self.rank, loss])
        self._judge_model(v)
        p.verdict._core = v
        self._finish(v, table, p.mine, self._samples(v, *p.samples), p.lr, p.tokens)
        return p.verdict

    def _settle(self, verdict):
        """Reads a device-decided verdict now (a field of it was used before the next step)."""
        if self._pending is None or self._pending.verdict is not verdict:
            raise RuntimeError(f"the verdict of step {verdict.step} was never read: the guard's "
                               "state was loaded over it")
        self.flush()

    def flush(self):
        """Finishes the device-decided step still pending (its counters, its event; raises
        StepAborted if it was an abort) and returns its Verdict (None if none is pending).
        state_dict() and close() call it."""
        p, self._pending = self._pending, None
        return self._finish_pending(p)

    def close(self):
        """flush(), then gives the optimizer back: its step() is no longer refused outside the
        guard."""
        self.flush()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _advance_scheduler(self, updated):
        if self.scheduler is not None and (updated or self.config["lr_scheduler"]["on_skip"] == "advance"):
            self.scheduler.step()
        if self.scheduler is not None:
            self._epoch = self.scheduler.last_epoch

    def _say(self, message):
        """A line every rank has alike: rank 0 says it (a warning), the others log it as debug."""
        log.log(logging.WARNING if self.rank == 0 else logging.DEBUG, message)

    def _finish(self, v, table, mine, samples, lr, tokens):
        message = self.core.finish(v, table, mine, samples, lr, tokens)
        self.last_verdict = v
        if message:  # every rank writes its own event; the line is the same on all
            self._say(message)
        if v.decision == "abort":
            raise StepAborted(message)

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self):
        """The detector's windows, the guards, the loss scale and the counters (a JSON string:
        torch.save and torch.distributed.checkpoint store it as it is). In the record form each
        rank keeps its own windows, and this gathers them: call it on every rank (as
        torch.distributed.checkpoint and torchtitan do), not on rank 0 alone."""
        self.flush()
        if self._record:  # a collective: first, every rank is here (else a line, not a hang)
            self._state_calls += 1
            missing = self._roll_call(f"state_dict/{self._state_calls}")
            if missing:
                timeout = self.config["comm"]["train_timeout_seconds"]
                raise StalledRank(
                    f"lockstep guard: rank {missing} did not call guard.state_dict() within "
                    f"comm.train_timeout_seconds = {timeout:g} s (its call {self._state_calls} "
                    "here); in the record form (skip.exchange) it gathers every rank's windows: "
                    "call it on every rank, as torch.distributed.checkpoint and torchtitan do")
        return {"lockstep": self.core.state(), "step": self._step}

    def load_state_dict(self, state):
        """What state_dict() returned (through torch.save or torch.distributed.checkpoint). Saved
        by another number of ranks, the global windows, guards and counters carry over and each
        rank's own windows fill again (a line says so)."""
        try:
            saved = json.loads(state["lockstep"])["world_size"]
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"guard state: not a lockstep guard state ({type(e).__name__}: {e}); "
                             "pass what guard.state_dict() returned") from None
        if saved != self.world:
            self._say(f"lockstep guard: state saved by {saved} rank(s), loaded on {self.world}: "
                      "the global windows, guards and counters carry over; each rank's own "
                      "windows fill again")
        self._pending = None
        self._used = None
        self._epoch = None  # a scheduler loaded with it may stand anywhere
        self.core.load_state(state["lockstep"])
        self._step = int(state["step"])

    @property
    def counters(self):
        """The run's counters as lockstep's metrics name them (step, optimizer_steps,
        skipped_steps, clipped_steps, ...), plus consecutive_skips and loss_scale."""
        return self.core.counters()

    def __getattr__(self, name):  # guard.skipped_steps, guard.clipped_steps, ...
        if name.startswith("_") or name in ("core",):
            raise AttributeError(name)
        counters = self.core.counters()
        if name in counters:
            return counters[name]
        raise AttributeError(f"'SkipGuard' has no attribute '{name}'")
