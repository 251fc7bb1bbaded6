"""PD disaggregation over every transfer backend: tcp (rows in the control messages) and the
registered-memory ones, nixl and mooncake (the prefill side writes straight into the decode
side's pool memory, only row indices and notices travel on the control channel). A backend
whose package does not load here is skipped with the reason; tcp always runs. Each pairs a
prefill and a decode scheduler in one process (test_pd_tcp.Pair) and checks the decode side's
output equals one colocated engine's; faults fail the request with a clear error and free every
slot on both sides."""
from __future__ import annotations

import importlib
import time

import numpy as np
import pytest
import torch
from conftest import assert_no_kv_leak
from kimi_fixtures import make_kimi
from minimax_fixtures import make_minimax, with_index_value
from test_pd_tcp import KW, PROMPTS, SP, Pair, _aborted, _idle, _same, _works_after

from sparkserve import Engine
from sparkserve.core.forward_batch import ForwardMode
from sparkserve.core.pool import Pool, PoolComponent
from sparkserve.disaggregation import backend as backend_mod
from sparkserve.disaggregation.backend import Heard, Reservation, decode_transfer, prefill_transfer
from sparkserve.disaggregation.registered import layout, mismatch, plan
from sparkserve.mem.transfer import RequestPages, RequestRows, read_request, shapes, write_request
from sparkserve.messages import Bootstrap
from sparkserve.scheduler.disaggregated import DecodeScheduler, PrefillScheduler

MODULES = {"nixl": "nixl", "mooncake": "mooncake.engine"}


def _available(name: str) -> str:
    if name != "tcp":
        pytest.importorskip(MODULES[name], exc_type=ImportError)
    return name


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_dirs):
    from test_swa_pool import save_tiny
    root = tmp_path_factory.mktemp("pdbackends")
    return {"llama": tiny_dirs["llama"],
            "windowed": save_tiny(str(root / "w8"), "mistral", sliding_window=8),
            "kimi": make_kimi(str(root / "kimi"), "kda_mla"),
            "minimax": with_index_value(make_minimax(str(root / "minimax")))}


@pytest.fixture(params=["tcp", "nixl", "mooncake"])
def backend(request) -> str:
    return _available(request.param)


@pytest.fixture(params=["nixl", "mooncake"])
def registered(request) -> str:
    return _available(request.param)


@pytest.mark.parametrize("arch", ["llama", "windowed", "kimi", "minimax"])
def test_pair_matches_colocated(arch, backend, models):
    path = models[arch]
    want = Engine(path, **KW).generate(input_ids=PROMPTS, sampling_params=SP)
    pair = Pair(path, backend=backend)
    try:
        reqs = [pair.submit(ids, SP) for ids in PROMPTS]
        pair.run([rd for _, rd in reqs])
        for (rp, rd), w in zip(reqs, want):
            assert len(rp.output_ids) == 1 and rp.finished
            _same(rd, w)
        assert pair.decode_engine.scheduler.forward_count[ForwardMode.EXTEND] == 0
        assert pair.prefill_engine.scheduler.forward_count[ForwardMode.DECODE] == 0
        assert_no_kv_leak(pair.prefill_engine.scheduler.cache)
        assert_no_kv_leak(pair.decode_engine.scheduler.cache)
    finally:
        pair.close()


def test_decode_server_gone(backend, models):
    """The decode server goes away after reserving: the prefill side's next write or notice
    fails, it frees the request and keeps serving."""
    pair = Pair(models["llama"], backend=backend)
    try:
        rp, _ = pair.submit(PROMPTS[0], SP)
        pair.decode.step()
        pair.decode.transfer.close()
        end = time.monotonic() + 15
        while not rp.finished:
            assert time.monotonic() < end
            pair.prefill.step()
        _aborted(rp, 502, "decode server went away")
        for _ in range(3):
            pair.prefill.step()
        assert not pair.prefill.has_work()
        assert_no_kv_leak(pair.prefill_engine.scheduler.cache)
    finally:
        pair.prefill.close()
        pair.decode.inner.close()


def test_decode_server_gone_mid_transfer(backend, models):
    """The decode server goes away after the first chunk's rows landed: the next chunk's write or
    notice fails at once (no heartbeat needed), the prefill side frees the request."""
    pair = Pair(models["llama"], backend=backend)
    try:
        rp, rd = pair.submit(PROMPTS[0], SP)
        pair.decode.step()
        pair.prefill.step()                     # reservation in, first chunk written
        assert not rp.finished
        pair.decode.transfer.close()
        time.sleep(0.3)                         # the disconnect (and the goodbye) reach the prefill side
        pair.prefill.step()
        assert rp.finished
        _aborted(rp, 502, "decode server went away during the transfer")
        for _ in range(3):
            pair.prefill.step()
        assert not pair.prefill.has_work()
        assert_no_kv_leak(pair.prefill_engine.scheduler.cache)
    finally:
        pair.prefill.close()
        pair.decode.inner.close()


def test_failed_write_fails_both_sides(registered, models, monkeypatch):
    """The engine's write fails (the decode side is reachable): the decode request fails with a
    transfer error at once, the prefill side frees its request and keeps serving."""
    pair = Pair(models["llama"], backend=registered)
    try:
        def boom(handle, p):
            raise RuntimeError("the link broke")
        monkeypatch.setattr(pair.prefill.transfer, "_write", boom)
        rp, rd = pair.submit(PROMPTS[0], SP)
        pair.run([rp, rd], until=10)
        _aborted(rp, 502, "decode server went away during the transfer")
        _aborted(rd, 502, "transfer error: the write into the decode server failed: the link broke")
        monkeypatch.undo()
        _idle(pair)
        _works_after(pair, models)
    finally:
        pair.close()


def test_prefill_restart_asks_for_the_memory_description_again(registered, models):
    """A prefill server that restarted never got the decode side's hello: it asks for it again
    and the room goes on."""
    pair = Pair(models["llama"], backend=registered)
    try:
        _works_after(pair, models)
        pair.prefill.transfer.close()
        restarted = prefill_transfer(registered, pair.port)
        pair.prefill = PrefillScheduler(pair.prefill_engine.scheduler, restarted, 30.0)
        asked, take = [], pair.decode.transfer._on_message
        pair.decode.transfer._on_message = lambda sock, msg: asked.append(msg.kind) or take(sock, msg)
        _works_after(pair, models)
        assert asked == ["rehello"]
    finally:
        pair.close()


def _swap_decode(pair: Pair, engine: Engine, backend: str) -> None:
    """The decode side on `engine` with `backend` (the old engine closed if another)."""
    pair.decode.transfer.close()
    if engine is not pair.decode_engine:
        pair.decode.inner.close()
    pair.decode = DecodeScheduler(engine.scheduler, decode_transfer(backend), 30.0)
    pair.decode_engine = engine


def test_transfer_error_fails_cleanly(backend, models, tmp_path):
    """The two sides run different models (another layer count): the request fails with a
    transfer error naming the mismatch; both free everything."""
    from test_swa_pool import save_tiny
    other = save_tiny(str(tmp_path / "w"), "mistral", sliding_window=8)
    pair = Pair(models["llama"], backend=backend)
    _swap_decode(pair, Engine(other, **KW), backend)
    try:
        rp, rd = pair.submit(PROMPTS[0], SP)
        pair.run([rp, rd], until=10)
        _aborted(rd, 502, "transfer error")
        _aborted(rp, 502, "decode server gave up")
        _idle(pair)
    finally:
        pair.close()


@pytest.mark.parametrize("decode_side", [False, True], ids=["prefill-side", "decode-side"])
def test_mixed_backends_fail_clearly(registered, decode_side, models):
    """One server runs tcp, the other a registered-memory backend: the request fails at once on
    both sides with a transfer error naming the two backends."""
    pair = Pair(models["llama"], backend="tcp" if decode_side else registered)
    _swap_decode(pair, pair.decode_engine, registered if decode_side else "tcp")
    try:
        rp, rd = pair.submit(PROMPTS[0], SP)
        pair.run([rp, rd], until=10)
        _aborted(rd, 502, "transfer error: the decode server uses --disaggregation-transfer-backend")
        _aborted(rp, 502, "decode server gave up: transfer error")
        _idle(pair)
    finally:
        pair.close()


def test_registered_layout_mismatch_refused_before_writing(registered, models):
    """Same shapes, another dtype in one buffer of the decode side (the scheduler's shape check
    passes): the prefill side refuses before any byte moves; the request fails with a transfer
    error naming the buffer, and the decode side's memory is untouched."""
    pair = Pair(models["llama"], backend=registered)
    try:
        pool = pair.decode_engine.scheduler.pools()[0]
        pool.k[0] = torch.zeros(pool.k[0].shape, dtype=torch.float16)
        rp, rd = pair.submit(PROMPTS[0], SP)
        pair.run([rp, rd], until=10)
        _aborted(rd, 502, "transfer error")
        assert "float32" in rd.finished_reason.message and "float16" in rd.finished_reason.message
        _aborted(rp, 502, "decode server gave up")
        assert not pool.k[1].any() and not pool.v[0].any()
        _idle(pair)
    finally:
        pair.close()


@pytest.mark.parametrize("name, words", [
    ("nixl", "--disaggregation-transfer-backend nixl needs the nixl package: pip install 'sparkserve[nixl]'"),
    ("mooncake", "--disaggregation-transfer-backend mooncake needs the mooncake-transfer-engine-non-cuda "
                 "package: pip install 'sparkserve[mooncake]'"),
])
def test_missing_backend_is_a_start_up_error(name, words, monkeypatch):
    real = importlib.import_module

    def missing(module, *a, **kw):
        if module == MODULES[name]:
            top = module.split(".")[0]
            raise ModuleNotFoundError(f"No module named {top!r}", name=top)
        return real(module, *a, **kw)
    monkeypatch.setattr(backend_mod.importlib, "import_module", missing)
    with pytest.raises(ValueError) as e:
        decode_transfer(name)
    assert str(e.value) == words
    with pytest.raises(ValueError, match="needs the"):
        prefill_transfer(name, 1)


def test_backend_that_does_not_load_names_the_library(monkeypatch):
    def broken(module, *a, **kw):
        raise ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
    monkeypatch.setattr(backend_mod.importlib, "import_module", broken)
    words = "installed but does not load: libibverbs.so.1.*apt-get install libibverbs1"
    with pytest.raises(ValueError, match=words):
        decode_transfer("mooncake")


# ---- the write plan and the engines' raw throughput, without a model ----

class _Pool(Pool):
    """Token rows (K, V per layer) and one request_row state buffer."""

    def __init__(self, slots: int, layers: int, item: tuple[int, ...], rows: int = 4):
        self.num_slots = slots
        self.k = [torch.zeros((slots + 1, *item)) for _ in range(layers)]
        self.v = [torch.zeros((slots + 1, *item)) for _ in range(layers)]
        self.state = [torch.zeros((rows, 3, 5))]

    def components(self) -> list[PoolComponent]:
        item = self.k[0][0].nbytes
        return [PoolComponent("k", "token_page", self.k, item),
                PoolComponent("v", "token_page", self.v, item),
                PoolComponent("s", "request_row", self.state, self.state[0][0].nbytes)]


def test_plan_writes_one_descriptor_per_run():
    src, dst = _Pool(64, 2, (2, 4)), _Pool(64, 2, (2, 4))
    assert mismatch(layout([src]), layout([dst])) is None
    sp = RequestPages(torch.tensor([3, 4, 5, 9, 10, 11, 12]), None, 1)
    dp = RequestPages(torch.tensor([20, 21, 22, 23, 40, 41, 42]), None, 2)
    p = plan(layout([src]), layout([dst]), sp, dp, 0, 7, state=True)
    # runs: (3..5 -> 20..22), (9 -> 23), (10..12 -> 40..42): 3 per token buffer, 1 state row
    assert len(p.length) == 3 * 4 + 1
    row = src.k[0][0].nbytes
    assert p.bytes == 7 * 4 * row + src.state[0][0].nbytes
    assert p.src[0] == src.k[0].data_ptr() + 3 * row and p.dst[0] == dst.k[0].data_ptr() + 20 * row
    assert plan(layout([src]), layout([dst]), sp, dp, 5, 7, state=False).bytes == 2 * 4 * row
    other = _Pool(64, 3, (2, 4))
    assert "layer buffers" in mismatch(layout([src]), layout([other]))
    other = _Pool(64, 2, (2, 4))
    other.v[1] = torch.zeros(65, 4, 2).transpose(1, 2)          # rows not back to back
    assert "buffer 3 has rows that are not contiguous on the decode server" in mismatch(layout([src]),
                                                                                       layout([other]))


def _rows(pools: list[Pool], pages: RequestPages) -> RequestRows:
    return RequestRows(pools, pages, lambda lo, state: read_request(pools, pages, lo, state),
                       lambda rows, lo, start: write_request(pools, pages, rows, lo, start), shapes(pools))


def _wait(cond, what: str, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < end, what


@pytest.mark.parametrize("scattered", [False, True], ids=["contiguous", "scattered"])
def test_thousand_pages_land_intact(backend, scattered):
    """1000 token rows of 16 layers' K and V (2 KiB a row: 66 MB) moved from one side's slots to
    the other's (consecutive, or scattered at random: one descriptor per row); prints the rate,
    from send_rows to the decode side hearing the rows are there."""
    from server_harness import free_port
    n, layers, item = 1000, 16, (8, 64)
    src, dst = _Pool(2048, layers, item), _Pool(2048, layers, item)
    for t in src.k + src.v:
        t.normal_()
    if scattered:
        gen = torch.Generator().manual_seed(0)
        sp = RequestPages(torch.randperm(2048, generator=gen)[:n] + 1, None, 0)
        dp = RequestPages(torch.randperm(2048, generator=gen)[:n] + 1, None, 1)
    else:
        sp = RequestPages(torch.arange(1, n + 1), None, 0)
        dp = RequestPages(torch.arange(1001, 1001 + n), None, 1)
    port = free_port()
    pre, dec = prefill_transfer(backend, port), decode_transfer(backend)
    try:
        dec.reserve(Bootstrap("127.0.0.1", port, 7), _rows([dst], dp), 0)
        [res] = _wait(lambda: [e for e in pre.poll(10) if isinstance(e, Reservation)], "no reservation")
        times = []
        for i in range(4):              # the first connects and warms up
            t0 = time.perf_counter()
            pre.send_rows(res, _rows([src], sp), 0, last=False)
            _wait(lambda: any(isinstance(e, Heard) for e in dec.poll(1)), "no rows notice")
            times.append(time.perf_counter() - t0)
        for a, b in zip(src.k + src.v, dst.k + dst.v):
            assert torch.equal(a[sp.slots], b[dp.slots])
        assert not dst.k[0][0].any()
        mb = n * layers * 2 * src.k[0][0].nbytes / 1e6
        rates = [mb / t for t in times[1:]]
        print(f"\n{backend} {'scattered' if scattered else 'contiguous'}: {mb:.0f} MB, {n} rows x "
              f"{2 * layers} buffers: {max(rates):.0f} MB/s best of 3, {np.mean(rates):.0f} mean")
    finally:
        dec.close()
        pre.close()
