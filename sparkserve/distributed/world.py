"""Forming the default process group, for the serving ranks and the training ranks alike.

torch.distributed.nn binds `group.WORLD` as a default argument of its functions when it is first
imported, and torch imports it lazily (optimizer and state-dict code reach it through
torch.distributed._shard). Imported after the world forms, it holds the group for the life of
the process: destroy_process_group() then leaves the group's gloo threads running, and one of
them still dropping a collective's tensor when the interpreter shuts down aborts the process
("terminate called without an active exception"). Imported first, it binds None."""
from __future__ import annotations

import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (see the module docstring)


def init_world(backend: str, **kwargs) -> None:
    """dist.init_process_group(backend, **kwargs), after the import above."""
    dist.init_process_group(backend, **kwargs)
