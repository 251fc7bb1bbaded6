"""Fixtures shared by the DSpark tests of this folder."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def embedded_engines():
    """The embedded SmolLM2 served plainly and with its shipped DSpark draft (verify mode full: every
    cycle drafts), at its default activations: the grammar tests' pair."""
    from sparkserve import Engine
    plain = Engine(max_total_tokens=4096, max_running_requests=4)
    spec = Engine(max_total_tokens=4096, max_running_requests=4, speculative_algorithm="DSPARK",
                  speculative_dspark_verify_mode="full")
    return plain, spec
