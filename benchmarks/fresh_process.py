"""Run one measurement in a fresh process and read back its JSON result.

Engines compared in one process do not start equal: one made later decodes measurably faster
than the first (docs/benchmarks.md, "Engines in one process"), so whichever order they are made
in would bias the comparison, and a server runs a single engine in its own process. So the
scripts that compare engines run each measurement in a process of its own, the kinds taking
turns."""
from __future__ import annotations

import json
import subprocess
import sys


def run_json(script: str, args: list[str], env: dict[str, str] | None = None) -> dict:
    """`python script args...` (its worker mode; `env`: the whole environment, None: this one's),
    whose last stdout line is a JSON object."""
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{script} {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def in_turns(kinds: list[str], rep: int) -> list[str]:
    """The kinds in the order of round `rep`: each one starts a round in turn."""
    k = rep % len(kinds)
    return kinds[k:] + kinds[:k]
