"""An HF tokenizer directory for programs that need one (load generators: guidellm's
--processor, aiperf's --tokenizer) when the model is a GGUF file: exported once per file into the
cache (~/.cache/sparkserve/tokenizers/), reported by /server_info and /model_info."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile

from sparkserve.frontend.tokenizer import Tokenizer, has_tokenizer_files

log = logging.getLogger(__name__)


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sparkserve", "tokenizers")


def served_tokenizer_path(tokenizer_path: str, tokenizer: Tokenizer | None) -> str | None:
    """The model's own directory when it has tokenizer.json; for a GGUF file the exported copy;
    None without a tokenizer."""
    if tokenizer is None or not has_tokenizer_files(tokenizer_path):
        return None
    if not tokenizer_path.endswith(".gguf"):
        return os.path.abspath(tokenizer_path)
    st = os.stat(tokenizer_path)
    ident = f"{os.path.abspath(tokenizer_path)}:{st.st_size}:{st.st_mtime_ns}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:12]
    stem = os.path.basename(tokenizer_path)[:-len(".gguf")]
    out = os.path.join(cache_root(), f"{stem}-{key}")
    if not os.path.isfile(os.path.join(out, "tokenizer_config.json")):
        os.makedirs(cache_root(), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cache_root(), prefix=".export-")
        try:
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, out)           # atomic: a concurrent export loses the race harmlessly
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isdir(out):
                raise
        log.info("exported the tokenizer of %s to %s", tokenizer_path, out)
    return out
