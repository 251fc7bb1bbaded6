"""Greedy sampling's argmax kernel (kernels/argmax.cpp) against torch.argmax: every row length
around the vector widths, ties (the first maximum wins), NaN (the first NaN wins, as torch's),
infinities, rows with a stride, and batches split over the threads."""
from __future__ import annotations

import pytest
import torch

from sparkserve.kernels import argmax_rows, load_extension


@pytest.fixture(scope="module", autouse=True)
def ext():
    if load_extension() is None:
        pytest.fail("the C++ kernels did not build on this machine")


@pytest.mark.parametrize("vocab", [1, 7, 8, 31, 32, 33, 100, 320, 49152])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_random_rows_equal_torch(vocab: int, rows: int) -> None:
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab * rows))
    assert torch.equal(argmax_rows(x), x.argmax(-1))


def test_ties_nan_and_infinities_equal_torch() -> None:
    v = 1000
    x = torch.randn(8, v, generator=torch.Generator().manual_seed(1))
    x[0, [5, 40, 999]] = 10.0                             # ties: the first wins
    x[1, [600, 37]] = 10.0                                # a tie in the vector part and one before
    x[2, [3, 700]] = float("nan")                         # the first NaN, even after a larger value
    x[2, 1] = float("inf")
    x[3, 998] = float("nan")                              # a NaN in the scalar tail only
    x[4] = float("-inf")                                  # nothing above -inf: index 0
    x[5, [10, 20]] = float("inf")
    x[6] = 0.0
    x[6, 500] = -0.0                                      # -0.0 == 0.0: the first zero wins
    x[7, 999] = 50.0                                      # the maximum is the last entry
    assert torch.equal(argmax_rows(x), x.argmax(-1)), (argmax_rows(x), x.argmax(-1))


def test_strided_rows_and_other_inputs() -> None:
    wide = torch.randn(6, 300, generator=torch.Generator().manual_seed(2))
    rows = wide[:, 10:290]                                # row stride 300, contiguous within a row
    assert rows.stride() == (300, 1)
    assert torch.equal(argmax_rows(rows), rows.argmax(-1))
    cols = wide.t()[:, :6]                                # not contiguous within a row: torch's path
    assert torch.equal(argmax_rows(cols), cols.argmax(-1))
    half = wide.to(torch.bfloat16)
    assert torch.equal(argmax_rows(half), half.argmax(-1))


def test_many_rows_over_two_threads() -> None:
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(257, 4099, generator=torch.Generator().manual_seed(3))
        assert torch.equal(argmax_rows(x), x.argmax(-1))
    finally:
        torch.set_num_threads(n)
