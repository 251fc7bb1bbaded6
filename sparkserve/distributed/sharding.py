"""How a model's dimensions split over the tensor-parallel ranks, written once: attention heads
and MLP width divide by --tp-size; KV heads divide too, or are replicated when there are fewer
of them than ranks (rank r keeps KV head r * kv_heads // tp). MoE models (Kimi-Linear,
MiniMax-M3) split their routed experts over the group (--ep-size = --tp-size) and replicate the
rest."""
from __future__ import annotations

from sparkserve.config import ModelConfig
from sparkserve.distributed import parallel_state as ps

TP_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
MOE_ARCHITECTURES = ("KimiLinearForCausalLM", "MiniMaxM3VLForCausalLM")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_tp(cfg: ModelConfig, tp: int, ep: int = 1) -> None:
    """Start-up check of --tp-size / --ep-size against the model, naming the flags and the
    sizes that work."""
    if ep > 1 and cfg.architecture not in MOE_ARCHITECTURES:
        raise ValueError(f"--ep-size {ep}: {cfg.architecture} has no experts to split; run with --ep-size 1")
    if tp == 1:
        return
    if cfg.architecture in MOE_ARCHITECTURES:
        if ep != tp:
            raise ValueError(f"--tp-size {tp}: {cfg.architecture} splits its experts over the ranks "
                             f"(--ep-size {tp}) and replicates its attention on them; give --ep-size {tp}")
        return
    if cfg.architecture not in TP_ARCHITECTURES:
        raise ValueError(f"--tp-size {tp}: tensor parallelism is built for {', '.join(TP_ARCHITECTURES)} "
                         f"so far, not {cfg.architecture}; run it with --tp-size 1")
    h, hkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if h % tp:
        raise ValueError(f"--tp-size {tp}: the model's {h} attention heads do not split over {tp} ranks; "
                         f"use one of {_divisors(h)}")
    if hkv % tp and tp % hkv:
        raise ValueError(f"--tp-size {tp}: the model's {hkv} KV heads neither split over {tp} ranks nor "
                         f"replicate evenly onto them; use one of {_divisors(h)} that {hkv} divides or "
                         "that divides it")
    if inter % tp:
        raise ValueError(f"--tp-size {tp}: the MLP width {inter} does not split over {tp} ranks")


def check_pp(cfg: ModelConfig, pp: int, partition: tuple[int, ...] | None) -> None:
    """Start-up check of --pp-size / --pp-layer-partition against the model's layers."""
    if pp > 1:
        ps.layer_partition(cfg.num_hidden_layers, pp, partition)


def heads_shard(num_heads: int) -> tuple[int, int, int]:
    """(this rank's part index, number of parts, heads per part) of the query heads."""
    tp = ps.tp_size()
    return ps.tp_rank(), tp, num_heads // tp


def kv_heads_shard(num_kv_heads: int) -> tuple[int, int, int]:
    """As heads_shard for KV heads; with fewer KV heads than ranks each rank keeps one, shared
    by tp // num_kv_heads ranks."""
    tp, r = ps.tp_size(), ps.tp_rank()
    if num_kv_heads >= tp:
        return r, tp, num_kv_heads // tp
    return r * num_kv_heads // tp, num_kv_heads, 1


def width_shard(width: int) -> tuple[int, int, int]:
    tp = ps.tp_size()
    return ps.tp_rank(), tp, width // tp
