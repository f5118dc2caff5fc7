"""lockstep for PyTorch trainers: `lockstep.torch.SkipGuard` (see docs/pytorch.md)."""
