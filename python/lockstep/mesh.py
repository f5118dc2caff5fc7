"""Where each rank sits in an N-D device mesh, for the guard (issue 53): every rank's coordinates
(events and `lockstep diag` name a rank by them: "rank 5 (pp 1, dp_shard 0, tp 1)"), the
pipeline stage it runs (the mesh dimension named "pp", torchtitan's name), and the loss a
pipeline's last stage computed, made known to the pipeline's other stages each step.

    mesh = init_device_mesh("cuda", (2, 2, 2), mesh_dim_names=("pp", "dp_shard", "tp"))
    guard = SkipGuard(optimizer, model=stage_model, mesh=mesh)
    schedule.step(...)                       # every micro-batch through every stage
    guard.step(loss if has_last_stage else None)

What it settles:
  - the ranks of one stage hold the same parameters; stages hold different ones: the guard's
    fingerprint compares parameters within a stage and everything else across the world;
  - plain (not DTensor) gradients are replicated over the ranks of one stage (DDP inside a
    stage), so each of them checks 1 / replicas of their concatenation;
  - the stage with the loss (found at the first step: the last stage, or stage 0 of a V-shaped
    schedule) sends it, with whether it has per-sample losses, to the other stages of its
    pipeline in one all-gather of two numbers per stage; every rank's row then carries its
    pipeline's loss, and the loss z-score and the per-rank windows mean what they do without
    pipelining (each pipeline counted once per stage, the mean unchanged).
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

PIPELINE_DIM = "pp"


class MeshPlaces:
    """The guard's view of a device mesh over its process group's ranks (group rank order)."""

    def __init__(self, mesh, group, rank, world):
        self.names, self.stage_of, self.text = [], [0] * world, [""] * world
        self.stages, self.stage = 1, 0
        # this rank's index among the ranks of its stage, and how many there are
        self.replica, self.replicas = rank, world
        if mesh is None:
            return
        group_ranks = dist.get_process_group_ranks(group or dist.group.WORLD) if world > 1 \
            else [dist.get_rank() if dist.is_initialized() else 0]
        grid = mesh.mesh
        names = list(mesh.mesh_dim_names or [f"dim{d}" for d in range(grid.dim())])
        cells = grid.flatten().tolist()
        if sorted(cells) != sorted(group_ranks):
            raise ValueError(f"mesh: a device mesh of ranks {sorted(cells)} for a guard over the "
                             f"ranks {sorted(group_ranks)}; pass the whole job's mesh (torchtitan's "
                             "world_mesh), whose ranks are the guard's process group")
        self.names = names
        for flat, r in enumerate(cells):
            coords = torch.unravel_index(torch.tensor(flat), tuple(grid.shape))
            where = dict(zip(names, (int(c) for c in coords)))
            g = group_ranks.index(r)
            self.text[g] = ", ".join(f"{n} {c}" for n, c in where.items())
            self.stage_of[g] = where.get(PIPELINE_DIM, 0)
        if PIPELINE_DIM in names:
            self.stages = grid.shape[names.index(PIPELINE_DIM)]
            self.pipeline_mesh = mesh[PIPELINE_DIM]
        self.stage = self.stage_of[rank]
        mates = [r for r, s in enumerate(self.stage_of) if s == self.stage]
        self.replica, self.replicas = mates.index(rank), len(mates)

    @property
    def pipelined(self):
        return self.stages > 1

    def describe(self):
        """The mesh as the fingerprint compares it ('' without one)."""
        return ", ".join(self.names) if self.names else ""


class PipelineLoss:
    """The loss of this rank's pipeline, from the stage that computed it."""

    def __init__(self, places, timeout_seconds, device):
        mesh = places.pipeline_mesh
        ranks = mesh.mesh.flatten().tolist()
        self.stage, self.stages, self.device = places.stage, places.stages, device
        # its own group, so a stage that stops calling the guard fails the others at the
        # guard's timeout (not after the backend's default)
        self.group = dist.new_group(ranks=ranks, timeout=timedelta(seconds=timeout_seconds),
                                    backend=dist.get_backend(mesh.get_group()),
                                    use_local_synchronization=True)
        self.source = None  # the stage that passes the loss, found at the first step
        self.samples = False  # whether it passes per-sample losses

    def exchange(self, loss, has_samples, gather):
        """(the pipeline's loss as a one-element fp64 tensor or None, misuse) for this rank's
        `loss` (a tensor, or None on a stage without it). `gather(into, row, group)`: the
        guard's all-gather (raises StalledRank on a timeout). Reads the host only at the
        first step, to learn which stage has the loss."""
        given = torch.is_tensor(loss) and loss.numel() == 1
        row = torch.zeros(3, dtype=torch.float64, device=self.device)
        if given:
            row[0] = 1
            row[1] = loss.detach().reshape(()).to(self.device, torch.float64)
            row[2] = 1.0 if has_samples else 0.0
        every = torch.empty(3 * self.stages, dtype=torch.float64, device=self.device)
        gather(every, row, self.group)
        every = every.view(self.stages, 3)
        if self.source is None:
            sources = every[:, 0].cpu().nonzero().flatten().tolist()
            if len(sources) != 1:
                return None, (11, len(sources), 0)
            self.source = sources[0]
            self.samples = bool(every[self.source, 2].item())
        if loss is not None and not given:
            return loss, (0, 0, 0)  # the guard's own checks name what is wrong with it
        if given != (self.stage == self.source):
            return None, (10 if given else 9, self.stage, self.source)
        return every[self.source, 1].reshape(()), (0, 0, 0)
