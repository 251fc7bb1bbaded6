"""KDA (Kimi Delta Attention): linear attention with a gated delta rule and a per-channel forget
gate, as in Kimi-Linear. Per head, with state S [dk, dv] and token inputs q, k (l2-normalised
after a short causal conv), v, log-decay g [dk] (<= 0) and beta in (0, 1):

    S <- diag(exp(g)) S;   S <- S + k (beta (v - k^T S))^T;   o = q^T S

The output goes through an RMSNorm gated by sigmoid(g_b(g_a(x))), then o_proj.

State lives in the request's row of the pool (`request_row` components `kda_state`
[H, dk, dv] and `kda_conv` [K-1, 3C], the last K-1 conv inputs). A request whose first position
in the forward is 0 starts from zero state: that is how new, re-admitted and retracted requests
reset. EXTEND runs the chunked (WY) form; DECODE the recurrence.

VERIFY (anchor + drafts) must leave the stored state untouched until the scheduler knows how
many tokens were accepted; `commit_verify` then advances it by exactly the kept tokens. Two ways
(`KimiDeltaAttention.rollback`), measured for Kimi-Linear-48B-A3B (transformers' KimiLinearConfig
defaults: 21 KDA layers of 27, 32 heads x 128, conv 4, fp32; 45 MiB of stored state per request)
at batch 8, gamma 7 (8 verify tokens per request), as the storage one VERIFY forward of one layer
at those sizes keeps alive until commit, times 21 layers:
  - "snapshot": state and conv window after every verify token, commit copies the kept one:
    3,017 MB (states 2,819 MB + conv windows 198 MB).
  - "replay" (default): the per-token recurrence inputs (k, v, g, beta) and raw conv inputs;
    commit re-runs the recurrence over the kept prefix from the untouched stored state:
    132 MB (k, v, g 22 MB each, beta 0.2 MB, conv inputs 66 MB), 23x less, for at most
    gamma + 1 extra recurrence steps per layer at commit.

Tensor parallel: heads are independent all the way to o_proj, so a rank keeps its heads' rows of
q/k/v, b, f_b and g_b, their conv channels, dt_bias and A_log (f_a, g_a and the o_norm weight,
shared by every head, are whole), and its request rows hold only its heads' state and conv
window; o_proj sums the heads' partial outputs over the ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sparkserve.core.forward_batch import ForwardBatch, ForwardMode
from sparkserve.core.pool import Split
from sparkserve.distributed.sharding import heads_shard, heads_split, shard_rows
from sparkserve.layers.linear import ColumnParallelLinear, FusedLinear, RowParallelLinear
from sparkserve.layers.norm import RMSNorm
from sparkserve.layers.sharded import Sharded

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps), as FLA computes it (eps inside the root, not a clamp)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_recurrent(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state: torch.Tensor, snapshots: bool = False):
    """Token by token. q, k, g: [B, H, L, dk]; v: [B, H, L, dv]; beta: [B, H, L];
    state [B, H, dk, dv]. Returns (o [B, H, L, dv] or None without q, final state, states after
    every token [B, L, H, dk, dv] or None). Steps with k = beta = g = 0 leave the state as is."""
    S = state
    outs, snaps = [], []
    decay = g.exp()
    for t in range(k.shape[2]):
        kt = k[:, :, t]
        S = S * decay[:, :, t, :, None]
        delta = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", kt, S))
        S = S + kt[..., None] * delta[..., None, :]
        if q is not None:
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
        if snapshots:
            snaps.append(S)
    o = torch.stack(outs, 2) if q is not None else None
    return o, S, (torch.stack(snaps, 1) if snapshots else None)


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK):
    """The same recurrence, `chunk` tokens at a time: inside a chunk the delta rule's updates are
    folded into one triangular solve (WY form), so the sequential loop runs L / chunk times.
    Shapes as kda_recurrent; returns (o, final state). Zero-padded tail tokens change nothing."""
    B, H, L, dk = k.shape
    dv = v.shape[-1]
    C = min(chunk, L)
    pad = -L % C
    if pad:
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, pad))
    n = (L + pad) // C
    q, k, v, g = (x.reshape(B, H, n, C, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(B, H, n, C, 1)
    g = g.cumsum(-2)                                   # log-decay from the chunk start
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    eye = torch.eye(C, dtype=k.dtype)
    S = state
    out = v.new_empty(B, H, n, C, dv)
    for i in range(n):
        qi, ki, vi, gi, bi = q[:, :, i], k[:, :, i], v[:, :, i], g[:, :, i], beta[:, :, i]
        # decay[r, c] = exp(g_r - g_c) per channel for c <= r (never exp of a positive number)
        decay = (gi[..., :, None, :] - gi[..., None, :, :]).masked_fill(~lower[..., None],
                                                                        float("-inf")).exp()
        kk = ((ki * bi)[..., :, None, :] * ki[..., None, :, :] * decay).sum(-1).tril(-1)
        a = eye + kk
        t = torch.linalg.solve_triangular(a, eye.expand_as(a), upper=False, unitriangular=True)
        u = t @ (vi * bi)                              # in-chunk delta-rule values
        w = t @ (ki * bi * gi.exp())                   # how much of the entering state they subtract
        qk = (qi[..., :, None, :] * ki[..., None, :, :] * decay).sum(-1)
        v_new = u - w @ S
        out[:, :, i] = (qi * gi.exp()) @ S + qk @ v_new
        g_last = gi[..., -1, :]
        S = S * g_last.exp()[..., None] + (ki * (g_last[..., None, :] - gi).exp()).transpose(-1, -2) @ v_new
    return out.reshape(B, H, n * C, dv)[:, :, :L], S


@dataclass
class VarlenLayout:
    """The flat batch (request after request) as a zero-padded [B, L] grid, shared by all KDA
    layers of one forward."""
    lens: torch.Tensor          # [B]
    valid: torch.Tensor         # [B, L] bool
    fresh: torch.Tensor         # [B] bool: first position 0 -> start from zero state
    q_index: torch.Tensor | None
    flat: torch.Tensor | None

    @classmethod
    def of(cls, batch: ForwardBatch) -> "VarlenLayout":
        if "kda_layout" not in batch._meta:
            lens = torch.tensor(batch.extend_lens)
            starts = lens.cumsum(0) - lens
            q_index, flat = batch.query_layout()
            valid = torch.arange(int(lens.max()))[None, :] < lens[:, None]
            batch._meta["kda_layout"] = cls(lens, valid, batch.positions[starts] == 0, q_index, flat)
        return batch._meta["kda_layout"]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, L, ...], zeros in padding."""
        B, L = self.valid.shape
        if self.q_index is None:
            return x.view(B, L, *x.shape[1:])
        return x[self.q_index] * self.valid.view(B, L, *([1] * (x.dim() - 1)))

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] -> [T, ...]."""
        x = x.reshape(-1, *x.shape[2:])
        return x if self.flat is None else x[self.flat]


class KimiDeltaAttention(Sharded):
    rollback = "replay"     # or "snapshot": how VERIFY keeps state for commit_verify (see top)

    def __init__(self, layer_id: int, hidden: int, num_heads: int, head_dim: int,
                 conv_kernel: int, eps: float):
        super().__init__()
        self.layer_id = layer_id
        self.index, self.parts, self.h = heads_shard(num_heads)
        self.d, self.kernel = head_dim, conv_kernel
        C, part = self.h * head_dim, (self.index, self.parts)
        self.in_proj = FusedLinear(hidden, {"q": C, "k": C, "v": C, "f_a": head_dim,
                                            "g_a": head_dim, "b": self.h},
                                   tp_parts={"q": part, "k": part, "v": part, "b": part})
        self.conv_weight = nn.Parameter(torch.empty(3 * C, conv_kernel), requires_grad=False)
        self.f_b_proj = ColumnParallelLinear(head_dim, num_heads * head_dim, part=part)
        self.dt_bias = nn.Parameter(torch.empty(C), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.h), requires_grad=False)
        self.g_b_proj = ColumnParallelLinear(head_dim, num_heads * head_dim, part=part)
        self.o_norm = RMSNorm(head_dim, eps)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden)

    def local_shard(self, tensor: torch.Tensor, blocks=None, stacks: int = 1) -> tuple[torch.Tensor, None]:
        """This rank's heads of a checkpoint tensor of this module's own parameters (conv
        weights, dt_bias, A_log: rows head-major; `stacks` 3 for q|k|v conv weights in one)."""
        return tensor[shard_rows(tensor.shape[0], self.index, self.parts, stacks)], None

    def state_splits(self) -> dict[str, Split]:
        """How state_shapes' items are cut over the tp ranks: the recurrent state by heads, the
        conv window's channels by heads inside each of its q|k|v blocks."""
        return {"kda_state": heads_split(0), "kda_conv": heads_split(1, groups=3)}

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-request pool items: recurrent state and the last K-1 conv inputs."""
        return {"kda_state": (self.h, self.d, self.d), "kda_conv": (self.kernel - 1, 3 * self.h * self.d)}

    def state_buffers(self, pool) -> list[torch.Tensor]:
        """This layer's request-row buffers in `pool` (what context parallel hands on)."""
        return [pool.get(name, self.layer_id) for name in self.state_shapes()]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        H, D, C, T = self.h, self.d, self.h * self.d, x.shape[0]
        lay = VarlenLayout.of(batch)
        B, L = lay.valid.shape
        mixed, f_a, g_a, b = self.in_proj(x).split([3 * C, D, D, H], -1)
        conv_buf = batch.kv_pool.get("kda_conv", self.layer_id)
        state_buf = batch.kv_pool.get("kda_state", self.layer_id)
        rows = batch.req_rows
        fresh = lay.fresh.view(B, 1, 1)
        window = torch.cat([conv_buf[rows].masked_fill(fresh, 0.0), lay.pad(mixed)], 1)  # [B, K-1+L, 3C]
        qkv = torch.nn.functional.silu(self._conv(window, L))
        valid = lay.valid.view(B, L, 1, 1)
        q, k, v = (t.reshape(B, L, H, D).transpose(1, 2) for t in qkv.split(C, -1))
        q = l2norm(q) * D ** -0.5
        k = l2norm(k) * valid.transpose(1, 2)
        g = lay.pad(self._log_decay(f_a)).transpose(1, 2)                   # [B, H, L, D]
        beta = lay.pad(torch.sigmoid(b.float())).transpose(1, 2)           # [B, H, L]
        S0 = state_buf[rows].masked_fill(fresh.view(B, 1, 1, 1), 0.0)
        if batch.mode == ForwardMode.VERIFY:
            snap = self.rollback == "snapshot"
            o, _, states = kda_recurrent(q, k, v, g, beta, S0, snapshots=snap)
            batch._meta[("kda", self.layer_id)] = (
                {"states": states, "conv": window.unfold(1, self.kernel - 1, 1)[:, 1:].clone()} if snap else
                {"k": k.clone(), "v": v.clone(), "g": g.clone(), "beta": beta.clone(),
                 "x": window[:, self.kernel - 1:].clone()})
        else:
            if L == 1:
                o, S, _ = kda_recurrent(q, k, v, g, beta, S0)
            else:
                o, S = kda_chunked(q, k, v, g, beta, S0)
            state_buf[rows] = S
            conv_buf[rows] = self._conv_tail(window, lay.lens)
        o = lay.unpad(o.transpose(1, 2))                                   # [T, H, D]
        gate = self.g_b_proj(g_a).view(T, H, D)
        o = self.o_norm(o) * torch.sigmoid(gate.float())
        return self.o_proj(o.reshape(T, C))

    def commit_verify(self, batch: ForwardBatch, kept: list[int]) -> None:
        """Advance the stored state by each request's first kept[i] verify tokens."""
        st = batch._meta.pop(("kda", self.layer_id))
        conv_buf = batch.kv_pool.get("kda_conv", self.layer_id)
        state_buf = batch.kv_pool.get("kda_state", self.layer_id)
        rows = batch.req_rows
        n = torch.tensor(kept)
        B = n.shape[0]
        if self.rollback == "snapshot":
            state_buf[rows] = st["states"][torch.arange(B), n - 1]
            conv_buf[rows] = st["conv"][torch.arange(B), n - 1].transpose(-1, -2)
            return
        lay = VarlenLayout.of(batch)
        fresh = lay.fresh.view(B, 1, 1)
        steps = int(n.max())
        keep = (torch.arange(steps)[None, :] < n[:, None]).view(B, 1, steps)   # [B, 1, L']
        k = st["k"][:, :, :steps] * keep[..., None]
        g = st["g"][:, :, :steps] * keep[..., None]
        beta = st["beta"][:, :, :steps] * keep
        S0 = state_buf[rows].masked_fill(fresh.view(B, 1, 1, 1), 0.0)
        _, S, _ = kda_recurrent(None, k, st["v"][:, :, :steps], g, beta, S0)
        state_buf[rows] = S
        window = torch.cat([conv_buf[rows].masked_fill(fresh, 0.0), st["x"]], 1)
        conv_buf[rows] = self._conv_tail(window, n)

    # ---- pieces -----------------------------------------------------------------------------
    def _conv(self, window: torch.Tensor, L: int) -> torch.Tensor:
        """Depthwise causal conv: out[t] = sum_j w[:, j] * window[t + j]."""
        w = self.conv_weight
        out = window[:, :L] * w[:, 0]
        for j in range(1, self.kernel):
            out = out + window[:, j:j + L] * w[:, j]
        return out

    def _conv_tail(self, window: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """The last K-1 conv inputs of each request after its `lens` new tokens."""
        idx = lens[:, None] + torch.arange(self.kernel - 1)[None, :]
        return window.gather(1, idx[..., None].expand(-1, -1, window.shape[-1]))

    def _log_decay(self, f_a: torch.Tensor) -> torch.Tensor:
        """Per-channel log forget gate: -exp(A_log[h]) * softplus(f_b(f_a) + dt_bias)."""
        f = self.f_b_proj(f_a).float() + self.dt_bias.float()
        f = torch.nn.functional.softplus(f).view(-1, self.h, self.d)
        return -self.A_log.float().exp()[:, None] * f
