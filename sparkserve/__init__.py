"""sparkserve: an LLM serving engine on PyTorch."""
import os

# OpenMP threads that spin while waiting stall badly when another process holds a core (a
# laptop, a shared server): decode drops ~20x. Passive waiting must be chosen before torch
# loads its OpenMP runtime; set OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import sparkserve` stays cheap for the CLI and the HTTP frontend.
    if name == "Engine":
        from sparkserve.entrypoints.engine import Engine
        return Engine
    if name == "SamplingParams":
        from sparkserve.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
