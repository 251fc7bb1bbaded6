"""RMSNorm in fp32, as the HF reference computes it. At inference on a contiguous fp32 input it
runs the C++ kernel from sparkserve.kernels when that is built (torch's rms_norm costs ~15 us of
small ops per call at batch 1, 61 calls per SmolLM2 token); `add_norm` fuses the residual add."""
import torch
from torch import nn

from sparkserve import kernels
from sparkserve.distributed import parallel_state as ps
from sparkserve.layers.sharded import Sharded

_ext: list = []          # [extension or None], resolved on first use


def _kernels():
    if not _ext:
        _ext.append(kernels.load_extension())
    return _ext[0]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def _kernel_ok(self, x: torch.Tensor) -> bool:
        return (x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type == "cpu"
                and x.is_contiguous() and not torch.is_grad_enabled() and _kernels() is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel_ok(x):
            return _kernels().rms_norm(x, self.weight, self.eps)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, norm(x + residual)) in one pass."""
        same = residual.dtype == x.dtype and residual.shape == x.shape
        if self._kernel_ok(x) and residual.is_contiguous() and same:
            return _kernels().add_rms_norm(x, residual, self.weight, self.eps)
        s = x + residual
        return s, self(s)


class WidthRMSNorm(Sharded):
    """RMSNorm over a projection's whole width (OLMo2's q and k norms) while the tensor-parallel
    ranks hold its heads apart: each rank keeps its part of the weight, and the sum of squares is
    summed over the ranks (heads held by several ranks, as KV heads fewer than ranks are, count once)."""

    def __init__(self, width: int, eps: float, index: int, parts: int):
        super().__init__()
        self.width, self.eps, self.index, self.local = width, eps, index, width // parts
        self.group = ps.layer_group()
        self.replicas = self.group.size // parts
        self.weight = nn.Parameter(torch.ones(self.local))

    def local_shard(self, tensor, blocks=None):
        return tensor[self.index * self.local:(self.index + 1) * self.local], None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = x.float().pow(2).sum(-1, keepdim=True)
        if self.group.size > 1:
            squares = ps.all_reduce(squares, self.group) / self.replicas
        return (x * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype) * self.weight
