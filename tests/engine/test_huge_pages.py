"""sparkserve/mem/huge_pages.py: the weights' blocks copied into 2 MiB transparent huge pages at
load (the engine's default; --disable-huge-pages keeps them where torch put them).

What the kernel really backs with huge pages is read from /proc/self/smaps. On a host where THP is
off (or not Linux) nothing moves, and the tests check just that."""
from __future__ import annotations

import gc

import pytest
import torch

from sparkserve import Engine
from sparkserve.kernels import BlockWeight
from sparkserve.layers.block_backed import BlockBacked
from sparkserve.layers.linear import Linear
from sparkserve.layers.moe import Experts
from sparkserve.mem.huge_pages import HUGE_PAGE, huge_page_buffer, huge_pages_available, move_into_huge_pages

THP = huge_pages_available()
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def resident_mib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) // 1024


def test_tensors_move_with_their_values_and_views():
    g = torch.Generator().manual_seed(0)
    big = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=g)
    head, tail = big[:100], big[(2 << 20) + 7:].view(-1)      # views of one storage, one unaligned
    floats = torch.randn(1000, 33, generator=g)
    rows = floats[5:9]
    want = [t.clone() for t in (big, head, tail, floats, rows)]
    old = [t.data_ptr() for t in (big, head, tail, floats, rows)]
    moved = move_into_huge_pages([big, head, tail, floats, rows])
    for t, w in zip((big, head, tail, floats, rows), want):
        assert torch.equal(t, w)
    if not THP:
        assert moved == 0 and [t.data_ptr() for t in (big, head, tail, floats, rows)] == old
        return
    assert moved >= big.numel() + floats.numel() * 4
    # views stay views of one copy: the offsets between them are kept, and a write shows through
    assert head.data_ptr() == big.data_ptr() and tail.data_ptr() == big.data_ptr() + (2 << 20) + 7
    assert rows.data_ptr() == floats.data_ptr() + 5 * 33 * 4
    assert big.untyped_storage().data_ptr() == floats.untyped_storage().data_ptr()    # one buffer
    assert big.data_ptr() % HUGE_PAGE == 0
    assert all(p != t.data_ptr() for p, t in zip(old, (big, head, tail, floats, rows)))
    big[0] = 255 - int(big[0])
    assert int(head[0]) == int(big[0])
    assert anon_huge_kib(big.data_ptr()) >= 2048


def test_tensors_stay_when_no_buffer_can_be_had(monkeypatch):
    from sparkserve.mem import huge_pages

    def refuse(nbytes: int):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(huge_pages, "huge_page_buffer", refuse)
    t = torch.arange(1 << 20, dtype=torch.int32)
    ptr = t.data_ptr()
    assert move_into_huge_pages([t]) == 0
    assert t.data_ptr() == ptr and torch.equal(t, torch.arange(1 << 20, dtype=torch.int32))


@pytest.mark.skipif(not THP, reason="needs Linux with transparent huge pages (madvise or always)")
def test_buffer_takes_huge_pages_as_written_and_gives_them_back():
    gc.collect()
    before = resident_mib()
    buf = huge_page_buffer(64 << 20)
    assert buf.data_ptr() % HUGE_PAGE == 0 and buf.numel() == 64 << 20
    assert resident_mib() - before < 8                 # nothing resident before it is written
    buf.fill_(1)
    assert resident_mib() - before >= 60
    assert anon_huge_kib(buf.data_ptr()) >= 60 << 10
    del buf
    gc.collect()
    assert resident_mib() - before < 8                 # the mapping went with the tensor


def test_hybrid_model_weights_in_huge_pages(tmp_path):
    """Kimi-Linear (fp32 checkpoint: stacked experts, KDA, MLA held as parameters, not blocks): its
    weights move, and it decodes what it does with them left in place."""
    from kimi_fixtures import VOCAB, make_kimi
    path = make_kimi(str(tmp_path / "kimi"), "kda_mla")
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 17)]
    runs = {}
    for huge in (False, True):
        with Engine(path, max_total_tokens=512, activation_quant="none", disable_huge_pages=not huge) as eng:
            runs[huge] = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
            model = eng.scheduler.runner.model
            experts = [m for m in model.modules() if isinstance(m, Experts)]
            params = [p for m in model.modules() if not isinstance(m, BlockBacked)
                      for p in m.parameters(recurse=False)]
            assert experts and len(params) > 10
            storages = {p.untyped_storage().data_ptr() for p in params}
            if THP and huge:        # one buffer for all of them, in huge pages
                assert len(storages) == 1 and anon_huge_kib(storages.pop()) >= 2048
            else:
                assert len(storages) == len(params)
    assert runs[True] == runs[False]


def test_dense_weights_beside_blocks_stay_put(tmp_path):
    """A bf16 checkpoint served with fp32 activations keeps fp32 weights beside its BF16 blocks:
    only the blocks move, since moving a weight counts as an update to it and would leave its
    blocks stale (the native step then would not run)."""
    from conftest import TINY_CONFIGS, TINY_SEED
    from transformers import AutoConfig, AutoModelForCausalLM

    from sparkserve.models.registry import load_model
    torch.manual_seed(TINY_SEED)
    cfg = AutoConfig.for_model("llama", **TINY_CONFIGS["llama"])
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "llama")
    model = load_model(str(tmp_path / "llama"), activation_quant="none", huge_pages=True)
    linears = [m for m in model.modules() if isinstance(m, BlockBacked) and m.held_blocks is not None]
    assert linears and all(not m.weight.is_meta for m in linears)
    assert all(m.inference_blocks() is not None for m in linears if isinstance(m, Linear))
    if THP:
        assert all(anon_huge_kib(m.held_blocks.blocks.data_ptr()) > 0 for m in linears)


def held_blocks(*roots: torch.nn.Module) -> list[BlockWeight]:
    return [m.held_blocks for root in roots for m in root.modules()
            if isinstance(m, BlockBacked) and m.held_blocks is not None]


def test_engine_serves_the_same_tokens_from_huge_pages():
    """The embedded SmolLM2 with its DSpark draft, weights in huge pages, decodes what plain decoding
    with the weights where they were loaded does (`--disable-huge-pages`: not moved into one buffer;
    whether such memory gets huge pages depends on what the process's heap held before, which NumPy
    advises for its large arrays); every block of both models sits in huge pages, and the blocks
    the draft shares with the target were not copied twice."""
    prompts = [[{"role": "user", "content": "Name three rivers in Europe."}],
               [{"role": "user", "content": "def fib(n):"}]]
    ref = Engine(max_total_tokens=2048, disable_huge_pages=True)
    try:
        want = [o["output_ids"] for o in ref.generate(messages=prompts, sampling_params=GREEDY)]
        model = ref.scheduler.runner.model
        assert (model.model.embed_tokens.held_blocks.blocks.untyped_storage().data_ptr() !=
                model.model.layers[0].self_attn.qkv_proj.held_blocks.blocks.untyped_storage().data_ptr())
    finally:
        ref.shutdown()
    eng = Engine(max_total_tokens=2048, speculative_algorithm="DSPARK")
    try:
        got = [o["output_ids"] for o in eng.generate(messages=prompts, sampling_params=GREEDY)]
        target, draft = eng.scheduler.runner.model, eng.scheduler.spec.draft
        blocks = held_blocks(target, draft)
        assert len(blocks) > 4 * len(target.model.layers)
        if THP:
            huge = [b for b in blocks if anon_huge_kib(b.blocks.data_ptr()) > 0]
            assert len(huge) == len(blocks), f"{len(blocks) - len(huge)} blocks outside huge pages"
            # the embedding stays in the target's buffer: the draft shares it, does not move it
            assert "embed_tokens" in draft.shared_with_target
            arena = target.model.layers[0].self_attn.qkv_proj.held_blocks.blocks.untyped_storage()
            embed = target.model.embed_tokens.held_blocks.blocks.untyped_storage()
            assert embed.data_ptr() == arena.data_ptr()
    finally:
        eng.shutdown()
    assert got == want
