"""Sharded: a module that keeps only this rank's part of some checkpoint tensors (tensor or
expert parallel). The weight loader passes every tensor of such a module through `local_shard`,
so a rank never holds more than its part."""
from __future__ import annotations

import torch
from torch import nn


class Sharded(nn.Module):
    def local_shard(self, tensor: torch.Tensor, blocks=None):
        """This rank's part of a checkpoint tensor (and of its block form): all of it by default."""
        return tensor, blocks
