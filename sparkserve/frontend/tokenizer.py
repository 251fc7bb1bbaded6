"""Text <-> token ids for the frontend process, on the Rust `tokenizers` library only.

Two sources: a GGUF file (vocabulary, scores or merges and special tokens live in its metadata; rebuilt
in gguf_tokenizer.py as llama.cpp runs them) or a Hugging Face directory (tokenizer.json + configs).
Transformers is deliberately not a runtime dependency: the frontend holds no model and must start fast.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import Tokenizer as _RustTokenizer
from tokenizers import models as _models

from sparkserve.args import ServerArgs
from sparkserve.frontend.chat_template import render_chat_template
from sparkserve.frontend.gguf_tokenizer import build_gguf_tokenizer, bytes_to_unicode
from sparkserve.loader.gguf_file import gguf_metadata

logger = logging.getLogger(__name__)

_BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}    # byte-level BPE's spelling of each byte
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")                  # SentencePiece's byte-fallback tokens


def _token_content(value: Any) -> str | None:
    """tokenizer_config special tokens are strings or serialized AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


class Tokenizer:
    """A model's tokenizer: encode/decode, special ids, chat template."""

    def __init__(
        self,
        backend: _RustTokenizer,
        *,
        special_tokens: dict[str, str | None],
        eos_token_ids: Iterable[int] = (),
        chat_templates: dict[str, str] | None = None,
        prepend_bos: bool = False,
    ) -> None:
        self._tok = backend
        self.special_tokens = special_tokens  # bos_token/eos_token/unk_token/pad_token strings for templates
        self.bos_token_id: int | None = self._id_of(special_tokens.get("bos_token"))
        self.eos_token_id: int | None = self._id_of(special_tokens.get("eos_token"))
        self.pad_token_id: int | None = self._id_of(special_tokens.get("pad_token"))
        ids = set(eos_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        self.eos_token_ids: set[int] = ids
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self._prepend_bos = prepend_bos and self.bos_token_id is not None
        # whether encoding with special tokens adds a BOS (the flag, or the backend's post-processor)
        self._adds_bos = self._prepend_bos or (
            self.bos_token_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [
                self.bos_token_id])
        self.all_special_ids: list[int] = sorted(
            tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self._added_ids = set(backend.get_added_tokens_decoder())
        # SentencePiece vocabularies (GGUF `llama` model, HF Llama 2 / Mistral / Gemma) spell a space `▁`
        # and fall back to byte tokens; byte-level BPE spells every byte as a character
        self._sentencepiece = isinstance(backend.model, _models.BPE) and bool(backend.model.byte_fallback)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def backend(self) -> _RustTokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids; with add_special_tokens, BOS/EOS only where the model's metadata asks for them, and
        no second BOS before text that starts with one.
        (encode_batch lets go of the GIL while it works, so a huge prompt tokenized on a worker
        thread does not stall the server's event loop; encode holds it.)"""
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.bos_token_id
        if add_special_tokens and self._prepend_bos and (not ids or ids[0] != bos):
            ids = [bos, *ids]  # type: ignore[list-item]
        if add_special_tokens and self._adds_bos and ids[:2] == [bos, bos] and text.startswith(
                self._tok.id_to_token(bos) or "\0"):
            ids = ids[1:]  # the text writes its own BOS (chat templates do): one, as llama.cpp's server
        return ids

    def token_bytes(self, tid: int) -> bytes:
        """The bytes token `tid` stands for on its own (OpenAI logprobs' `bytes`; its text is their
        UTF-8 decode): a byte-level spelling mapped back to its bytes, SentencePiece's `▁` as a space
        and its `<0xNN>` tokens as that byte; added and special tokens as their text."""
        spelled = self._tok.id_to_token(tid) if 0 <= tid < self.vocab_size else None
        if spelled is None or tid in self._added_ids:
            return self._tok.decode([tid], skip_special_tokens=False).encode("utf-8")
        if self._sentencepiece:
            byte = _BYTE_TOKEN.fullmatch(spelled)
            return bytes([int(byte.group(1), 16)]) if byte else spelled.replace("\u2581", " ").encode("utf-8")
        if all(c in _BYTE_DECODER for c in spelled):
            return bytes(_BYTE_DECODER[c] for c in spelled)
        return self._tok.decode([tid], skip_special_tokens=False).encode("utf-8")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Prompt text for a conversation (HF semantics; the `tool_use` template when tools are given)."""
        template = self.chat_templates.get("tool_use") if tools is not None else None
        template = template or self.chat_template
        if template is None and self.chat_templates:
            raise ValueError(f"this model has several chat templates and no default: "
                             f"{sorted(self.chat_templates)}")
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=self.special_tokens,
            **extra,
        )

    def save_pretrained(self, directory: str) -> None:
        """Write an HF tokenizer directory (tokenizer.json, tokenizer_config.json,
        special_tokens_map.json) that transformers' AutoTokenizer loads as this tokenizer."""
        os.makedirs(directory, exist_ok=True)
        self._tok.save(os.path.join(directory, "tokenizer.json"))
        special = {k: v for k, v in self.special_tokens.items() if v is not None}
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                                  "add_bos_token": self._prepend_bos, "clean_up_tokenization_spaces": False}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        for name, body in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
            with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
                json.dump(body, f, indent=1, ensure_ascii=False)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Rebuilt from GGUF metadata: SentencePiece or byte-level BPE (frontend/gguf_tokenizer.py)."""
        parts = build_gguf_tokenizer(gguf_metadata(path))
        return cls(parts.backend, special_tokens=parts.special_tokens, eos_token_ids=parts.eos_token_ids,
                   chat_templates=parts.chat_templates)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """A Hugging Face model/tokenizer directory (tokenizer.json required)."""
        d = os.fspath(directory)
        tj = os.path.join(d, "tokenizer.json")
        if not os.path.isfile(tj):
            raise FileNotFoundError(f"{tj} not found (only fast tokenizers with a tokenizer.json are "
                                    f"supported)")
        tok = _RustTokenizer.from_file(tj)
        cfg = _read_json(os.path.join(d, "tokenizer_config.json"))
        special = {k: _token_content(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token",
                                                           "pad_token")}
        templates = _hf_chat_templates(d, cfg)
        eos_ids = _ids(_read_json(os.path.join(d, "generation_config.json")).get("eos_token_id"))
        prepend_bos = bool(cfg.get("add_bos_token", False))
        return cls(
            tok, special_tokens=special, eos_token_ids=eos_ids, chat_templates=templates,
            prepend_bos=prepend_bos
        )


def has_tokenizer_files(path: str) -> bool:
    """Whether `path` (a .gguf file or an HF directory) carries a tokenizer this module can load."""
    return path.endswith(".gguf") or os.path.isfile(os.path.join(path, "tokenizer.json"))


def load_tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(path) if path.endswith(".gguf") else Tokenizer.from_pretrained(path)


def load_tokenizer_for(args: ServerArgs) -> Tokenizer | None:
    """The tokenizer a server or engine uses: none with --skip-tokenizer-init or when the
    tokenizer path carries no tokenizer files (requests must then give token ids)."""
    if args.skip_tokenizer_init or not has_tokenizer_files(args.tokenizer_path):
        return None
    return load_tokenizer(args.tokenizer_path)


def _hf_chat_templates(d: str, cfg: dict[str, Any]) -> dict[str, str]:
    """Templates from tokenizer_config.json, chat_template.json/.jinja and additional_chat_templates/."""
    templates: dict[str, str] = {}

    def add(value: Any) -> None:
        if isinstance(value, str):
            templates["default"] = value
        elif isinstance(value, list):  # [{"name": ..., "template": ...}]
            templates.update({t["name"]: t["template"] for t in value if isinstance(t, dict) and "name" in t})

    add(cfg.get("chat_template"))
    add(_read_json(os.path.join(d, "chat_template.json")).get("chat_template"))
    jinja = os.path.join(d, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            templates["default"] = f.read()
    extra = os.path.join(d, "additional_chat_templates")
    if os.path.isdir(extra):
        for fname in sorted(os.listdir(extra)):
            if fname.endswith(".jinja"):
                with open(os.path.join(extra, fname), encoding="utf-8") as f:
                    templates[fname[: -len(".jinja")]] = f.read()
    return templates
