"""sparkserve: an LLM serving engine on PyTorch."""
import os
import sys

# OpenMP threads that spin while waiting stall badly when another process holds a core (a
# laptop, a shared server): decode drops ~20x. They also spin for milliseconds after every torch
# op that opens a parallel region (penalties, logprobs, the Python layer path), on the cores the
# kernels' own threads run on. Passive waiting must be chosen before torch loads its OpenMP
# runtime; set OMP_WAIT_POLICY yourself to override.
# What importing sparkserve added to the environment. sparkserve's own processes inherit it; a
# launcher of other programs (the benchmarks' peers: llama.cpp's OpenMP threads waiting passively
# run several times slower) hands them the environment without it.
ENV_DEFAULTS: dict[str, str] = {}
if "OMP_WAIT_POLICY" not in os.environ:
    if "torch" in sys.modules:
        import warnings
        warnings.warn("torch was imported before sparkserve, so its OpenMP threads spin after each torch op "
                      "and hold the cores the kernels run on (an in-process Engine then decodes slower): "
                      "import sparkserve first, or set OMP_WAIT_POLICY=PASSIVE before torch loads",
                      RuntimeWarning, stacklevel=2)
    os.environ["OMP_WAIT_POLICY"] = ENV_DEFAULTS["OMP_WAIT_POLICY"] = "PASSIVE"

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
