"""return_hidden_states: the rows of a forward each asking request keeps."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from sparkserve.core.req import Req


def keep_hidden(fb, groups: Iterable[tuple[Req, range | list[int]]]) -> None:
    """Each asking request keeps its committed rows of this forward (final normed hidden state,
    and the aux taps when the model captures any)."""
    for req, rows in groups:
        if req.hidden_parts is None or not len(rows):
            continue
        idx = torch.as_tensor(list(rows))      # results leave the scheduler on the host
        taps = torch.cat([a[idx] for a in fb.aux_hidden], -1).cpu() if fb.aux_hidden else None
        req.hidden_parts.append((fb.positions[idx].cpu(), fb.final_hidden[idx].cpu(), taps))
