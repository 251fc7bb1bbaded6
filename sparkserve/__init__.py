"""sparkserve: an LLM serving engine on PyTorch."""
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
