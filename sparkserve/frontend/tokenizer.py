"""Text <-> token ids for the frontend process, on the Rust `tokenizers` library only.

Two sources: a GGUF file (vocabulary, merges and special tokens live in its metadata; rebuilt here the
way llama.cpp and transformers read them) or a Hugging Face directory (tokenizer.json + configs).
Transformers is deliberately not a runtime dependency: the frontend holds no model and must start fast.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _RustTokenizer

from sparkserve.args import ServerArgs
from sparkserve.frontend.chat_template import render_chat_template
from sparkserve.loader.gguf_file import gguf_metadata

logger = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer names (`tokenizer.ggml.pre`) -> how the text is split before BPE.
_GPT2_PRE = ("gpt2", "gpt-2", "default", "mpt", "olmo", "jais")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "falcon3", "smaug-bpe", "dbrx", "pixtral")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "megrez")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of every byte (the alphabet byte-level vocabularies are written in)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _byte_level_pre(pre: str | None) -> tuple[pre_tokenizers.PreTokenizer, normalizers.Normalizer | None,
                                              bool]:
    """(pre-tokenizer, normalizer, ignore_merges) matching the model's own tokenizer.json for `pre`."""
    if pre in _DIGITS_PRE:
        seq = [pre_tokenizers.Digits(individual_digits=True),
               pre_tokenizers.ByteLevel(add_prefix_space=False)]
        return pre_tokenizers.Sequence(seq), None, False
    if pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        seq = [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
        norm = normalizers.NFC() if pre in _QWEN2_PRE else None
        return pre_tokenizers.Sequence(seq), norm, pre in _LLAMA3_PRE
    if pre not in _GPT2_PRE:
        logger.warning("unknown GGUF pre-tokenizer %r: falling back to GPT-2 byte-level splitting", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False), None, False


def _special_post(tok: _RustTokenizer, bos: int | None, eos: int | None, add_bos: bool,
                  add_eos: bool) -> None:
    """Post-processor adding BOS/EOS when the model asks for them (llama.cpp's add_bos/add_eos flags)."""
    single, specials = "$A:0", []
    for flag, tid, left in ((add_bos, bos, True), (add_eos, eos, False)):
        if flag and tid is not None:
            name = tok.id_to_token(tid)
            single = f"{name}:0 {single}" if left else f"{single} {name}:0"
            specials.append((name, tid))
    if specials:
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)


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
        self.all_special_ids: list[int] = sorted(
            tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special
        )

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
        """Token ids; with add_special_tokens, BOS/EOS only where the model's metadata asks for them."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]  # type: ignore[list-item]
        return ids

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
        """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) rebuilt from GGUF metadata."""
        md = gguf_metadata(path)
        kind = md.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE); "
                "use the model's Hugging Face directory (tokenizer.json) instead"
            )
        tokens: list[str] = md["tokenizer.ggml.tokens"]
        types: list[int] = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
                   for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
        pre, norm, ignore_merges = _byte_level_pre(md.get("tokenizer.ggml.pre"))
        bpe = models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
        tok = _RustTokenizer(bpe)
        tok.normalizer = norm
        tok.pre_tokenizer = pre
        tok.decoder = decoders.ByteLevel()
        # Control tokens are special (matched whole, skipped on decode); one spelled outside the byte
        # alphabet is a llama.cpp mislabel and is left alone (as transformers does).
        control = [t for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
        user = [t for t, ty in zip(spelled, types) if ty == _USER_DEFINED]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

        def name(key: str) -> str | None:
            tid = md.get(f"tokenizer.ggml.{key}")
            return tokens[tid] if isinstance(tid, int) and 0 <= tid < len(tokens) else None

        bos_id, eos_id = md.get("tokenizer.ggml.bos_token_id"), md.get("tokenizer.ggml.eos_token_id")
        _special_post(
            tok,
            bos_id,
            eos_id,
            bool(md.get("tokenizer.ggml.add_bos_token", False)),
            bool(md.get("tokenizer.ggml.add_eos_token", False)),
        )
        special = {
            "bos_token": name("bos_token_id"),
            "eos_token": name("eos_token_id"),
            "unk_token": name("unknown_token_id"),
            "pad_token": name("padding_token_id"),
        }
        end_keys = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")  # end of turn / of message
        eos_ids = [md[k] for k in end_keys if isinstance(md.get(k), int)]
        templates = {
            ("default" if k == "tokenizer.chat_template" else k[len("tokenizer.chat_template.") :]): v
            for k, v in md.items()
            if (k == "tokenizer.chat_template" or k.startswith("tokenizer.chat_template."))
            and isinstance(v, str)
        }
        return cls(tok, special_tokens=special, eos_token_ids=eos_ids, chat_templates=templates)

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
