"""A GGUF file's tokenizer rebuilt on the Rust `tokenizers` library, following llama.cpp (llama-vocab.cpp).

Two vocabulary kinds (`tokenizer.ggml.model`):
- "llama": SentencePiece. Tokens with `tokenizer.ggml.scores`; the file holds no merges, so they are derived
  from the scores (a pair merges into a token in the order of that token's score, which is llama.cpp's SPM
  rule), or from the token order for Gemma, whose scores do not follow its merges. Spaces are written `▁`;
  `tokenizer.ggml.add_space_prefix` (default true) puts one `▁` before the text and after each special token,
  as llama.cpp does. Characters outside the vocabulary fall back to the `<0xXX>` byte tokens.
- "gpt2": byte-level BPE with `tokenizer.ggml.merges`, the text first split by the regexes llama.cpp runs for
  `tokenizer.ggml.pre` (the `_PRE` table). An unknown pre-tokenizer name is refused, naming the known ones.

Token types (`tokenizer.ggml.token_type`): control and unknown tokens are special (matched whole in text,
skipped on decode), user-defined ones are added tokens (matched whole, decoded), byte tokens serve byte
fallback, unused and normal ones are plain vocabulary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

logger = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp token types
SPACE = "\u2581"
# llama.cpp's end-of-generation tokens by name (llama-vocab.cpp): each stops generation and is made a control
# token (matched whole in text, skipped on decode) whatever type the file gives it (a converter that types
# `<end_of_turn>` normal still gets it matched whole by llama.cpp).
END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
                     "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>",
                     "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>",
                     "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")
# Further stops where the file types them control or user-defined.
END_OF_TURN = ("<|END_OF_TURN_TOKEN|>",)
# Fill-in-the-middle tokens llama.cpp finds by name where the file has no `tokenizer.ggml.<role>_token_id`
# (made control tokens); the pad / repo / file-separator ones also end generation.
_FIM_NAMES = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "\u2581<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "\u2581<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "\u2581<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_FIM_STOPS = ("fim_pad", "fim_rep", "fim_sep")
# llama.cpp's ids for a SentencePiece vocabulary whose file names none (LLAMA_VOCAB_TYPE_SPM's defaults).
_SPM_DEFAULT_IDS = {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}

# ---- BPE pre-tokenizers: llama.cpp's regex lists per `tokenizer.ggml.pre` (each regex splits every piece
# the previous one left, matches and gaps both kept). Where llama.cpp rewrites a tokenizer.json regex for its
# own engine, the original (which Oniguruma runs) is used.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Kimi K2 / Kimi-Linear (tokenization_kimi.py, llama.cpp's unicode_regex_split_custom_kimi_k2): runs of Han
# apart, letters other than Han as gpt-4o's (class intersections: the Oniguruma syntax `tokenizers` takes)
_K2_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_K2_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_K2 = (rf"\p{{Han}}+|[^\r\n\p{{L}}\p{{N}}]?{_K2_UPPER}*{_K2_LOWER}+{_CONTRACTION}"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{_K2_UPPER}+{_K2_LOWER}*{_CONTRACTION}"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"
_DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",  # noqa: E501  (\u escapes: these letters have canonical singletons)
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_CHAMELEON = (r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
              r"[\p{P}!-/:-@\[-`{-~]", _GPT2)
_BAILING = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]"
            r"|\s+(?!\S)|\s+")
_SEED_CODER = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_EXAONE_MOE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")
_JAIS2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+" + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
          + r"|\s{1,2}(?!\S)|\s{1}")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class _Pre:
    splits: tuple[str, ...]
    ignore_merges: bool = False   # a piece that is a whole token is that token (llama.cpp's ignore_merges)
    add_bos: bool = False         # llama.cpp's default when the file has no add_bos_token
    nfc: bool = False             # the HF tokenizer normalizes to NFC first (Qwen2's)


def _names(names: str, pre: _Pre) -> dict[str, _Pre]:
    return dict.fromkeys(names.split(), pre)


_PRE: dict[str, _Pre] = {
    **_names("default", _Pre(_DEFAULT)),
    **_names("gpt-2 phi-2 mpt olmo jais trillion gigachat jina-es jina-de jina-v2-es jina-v2-de jina-v1-en "
             "jina-v2-code roberta-bpe a.x-4.0 mellum modern-bert exaone4 granite-docling", _Pre((_GPT2,))),
    **_names("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
             _Pre((r"\p{N}", _GPT2))),
    **_names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
             _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)),
    **_names("dbrx smaug-bpe chatglm-bpe glm4", _Pre((_LLAMA3,))),
    **_names("minicpm5", _Pre((r"\p{N}{1,3}", _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}+")),
                              ignore_merges=True)),
    **_names("qwen2 deepseek-r1-qwen megrez kormo f2llmv2", _Pre((_QWEN2,), nfc=True)),
    **_names("stablelm2 hunyuan solar-open grok-2", _Pre((_QWEN2,))),
    **_names("qwen35", _Pre((_QWEN35,), nfc=True)),
    **_names("tekken", _Pre((_TEKKEN,), ignore_merges=True, add_bos=True)),
    **_names("gpt-4o llama4 kanana2 talkie minimax-m2", _Pre((_GPT4O,))),
    **_names("kimi-k2", _Pre((_KIMI_K2,))),
    **_names("deepseek-llm", _Pre(_DEEPSEEK_LLM)),
    **_names("deepseek-coder", _Pre(_DEEPSEEK_CODER)),
    **_names("deepseek-v3 hunyuan-dense joyai-llm hy_v4", _Pre(_DEEPSEEK_V3)),
    **_names("falcon", _Pre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"))),
    **_names("poro-chat bloom gpt3-finnish", _Pre((_PORO,))),
    **_names("viking", _Pre((_PORO, r"\p{N}"))),
    **_names("chameleon", _Pre(_CHAMELEON, add_bos=True)),
    **_names("bailingmoe bailingmoe2 llada-moe", _Pre((_BAILING,))),
    **_names("seed-coder", _Pre((_SEED_CODER,))),
    **_names("exaone-moe", _Pre((_EXAONE_MOE,))),
    **_names("jais-2", _Pre((_JAIS2,))),
    **_names("ufakzeka", _Pre((_QWEN2[_QWEN2.index(")|") + 2:],))),
    **_names("laguna", _Pre((r"[^\n]+|[\n]+", _QWEN2))),
}
SUPPORTED_PRE = tuple(sorted(_PRE))


def _pre_spec(pre: str | None) -> _Pre:
    if pre is None:
        logger.warning("GGUF file has no tokenizer.ggml.pre (an old converter): splitting as llama.cpp's "
                       "'default'")
        return _PRE["default"]
    if pre not in _PRE:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: "
                         f"{', '.join(SUPPORTED_PRE)}")
    return _PRE[pre]


def bytes_to_unicode() -> dict[int, str]:
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


def _byte_level(md: dict[str, Any], tokens: list[str], types: list[int]) -> tuple[RustTokenizer, _Pre]:
    spec = _pre_spec(md.get("tokenizer.ggml.pre"))
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    tok = RustTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                                   ignore_merges=spec.ignore_merges))
    tok.normalizer = normalizers.NFC() if spec.nfc else None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel, left alone (as transformers).
    strip = _rstrip(md, tokens, types)
    special = [t for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN) and set(t) <= alphabet]
    user = [(s, t in strip) for t, s, ty in zip(tokens, spelled, types) if ty == USER_DEFINED]
    _add_tokens(tok, [(t, t in strip) for t in special], user)
    return tok, spec


def _add_tokens(tok: RustTokenizer, special: list[tuple[str, bool]], user: list[tuple[str, bool]]) -> None:
    """Special and user-defined tokens, matched whole in raw text: (text, swallows the whitespace after)."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=r) for t, r in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False, rstrip=r) for t, r in user])


def _spm_merges(tokens: list[str], rank: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, the best merged token first (`rank`: higher first); ties as
    transformers orders them (longer left piece, longer right piece, then file order)."""
    index = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, t in enumerate(tokens):
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in index and right in index:
                found.append(((-rank[i], -k, k - len(t), i, index[left], index[right]), left, right))
    found.sort()
    return [(left, right) for _, left, right in found]


def _sentencepiece(md: dict[str, Any], tokens: list[str], types: list[int]) -> RustTokenizer:
    arch = str(md.get("general.architecture", ""))
    gemma = arch.startswith("gemma")
    if gemma:  # a space-run token not user-defined (those match raw text whole, below) is spelled `▁` (as HF)
        tokens = [SPACE * len(t) if ty != USER_DEFINED and t and not t.strip(" ") else t
                  for t, ty in zip(tokens, types)]
    scores = md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    # Gemma's scores do not follow its merge order, the token order does (transformers and llama.cpp agree).
    rank = [-float(i) for i in range(len(tokens))] if gemma else [float(s) for s in scores]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    tok = RustTokenizer(models.BPE(vocab, _spm_merges(tokens, rank), unk_token=unk, fuse_unk=True,
                                   byte_fallback=True))
    prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    steps: list[normalizers.Normalizer] = [normalizers.Prepend(SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    tok.pre_tokenizer = None
    chain = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*chain, decoders.Strip(content=" ", left=1)] if prefix else chain)
    strip = _rstrip(md, tokens, types)
    special = [t for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)]
    # User-defined tokens match the raw text whole before any merge (SentencePiece's user_defined_symbols;
    # llama.cpp's converter writes their `▁` as spaces, so Gemma's space runs "  ", "   ", ... are such).
    user = [t for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    _add_tokens(tok, [(t, t in strip) for t in special], [(t, t in strip) for t in user])
    return tok


def _rstrip(md: dict[str, Any], tokens: list[str], types: list[int]) -> set[str]:
    """The special tokens that swallow the whitespace after them: llama.cpp sets this per model (its token
    attributes are not in the file), for a model whose `general.name` says Phi-3 every special token but
    <unk>, <s> and <|endoftext|> (as Phi-3's own tokenizer marks them rstrip)."""
    name = str(md.get("general.name", "")).lower()
    if "phi-3" not in name and "phi3" not in name:
        return set()
    special = {t for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED, UNKNOWN)}
    return (special | {"</s>"}) - {"<unk>", "<s>", "<|endoftext|>"}


def _found_by_name(md: dict[str, Any], tokens: list[str]) -> tuple[set[int], list[int]]:
    """The tokens llama.cpp makes control tokens by their text (llama-vocab.cpp): every end-of-generation
    name, and per fill-in-the-middle role the file gives no id for, the first token with one of its names
    (the lowest id: llama.cpp's pick among several is its hash map's order). Also the FIM stops (pad, repo,
    file separator: the file's ids or the ones found)."""
    index = {t: i for i, t in reversed(list(enumerate(tokens)))}
    control = {index[t] for t in END_OF_GENERATION if t in index}
    stops = []
    for role, names in _FIM_NAMES.items():
        tid = md.get(f"tokenizer.ggml.{role}_token_id")
        if tid is None and (found := [index[t] for t in names if t in index]):
            tid = min(found)
            control.add(tid)
        if role in _FIM_STOPS and isinstance(tid, int) and 0 <= tid < len(tokens):
            stops.append(tid)
    return control, stops


@dataclass
class GGUFTokenizerParts:
    backend: RustTokenizer
    special_tokens: dict[str, str | None]
    eos_token_ids: list[int]
    chat_templates: dict[str, str]


# Vocabularies llama.cpp's converter writes only for models that are not decoder-only language
# models (conversion/t5.py, bert.py), so no family sparkserve serves has one: why each is refused.
_NOT_DECODER_VOCABS = {
    "t5": "a Unigram SentencePiece vocabulary, llama.cpp's UGM, which its converter writes for "
          "encoder-decoder models (T5, mT5, UMT5) and encoders only; sparkserve serves decoder-only "
          "language models",
    "bert": "a WordPiece vocabulary, which llama.cpp's converter writes for BERT-style encoders only; "
            "sparkserve serves decoder-only language models",
}


def build_gguf_tokenizer(md: dict[str, Any]) -> GGUFTokenizerParts:
    """The tokenizer a GGUF file's metadata describes (module docstring), with its stop ids and templates."""
    kind = md.get("tokenizer.ggml.model")
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types: list[int] = list(md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    by_name, fim_stops = _found_by_name(md, tokens)
    for i in by_name:           # as llama.cpp overrides their type
        types[i] = CONTROL
    if kind == "gpt2":
        tok, spec = _byte_level(md, tokens, types)
        add_bos_default = spec.add_bos
    elif kind == "llama":
        tok, add_bos_default = _sentencepiece(md, tokens, types), True
    else:
        why = f" ({_NOT_DECODER_VOCABS[kind]})" if kind in _NOT_DECODER_VOCABS else ""
        raise ValueError(f"GGUF tokenizer model {kind!r} (tokenizer.ggml.model){why} is not supported; "
                         "supported: 'llama' (SentencePiece), 'gpt2' (byte-level BPE)")

    def ident(key: str) -> int | None:
        tid = md.get(f"tokenizer.ggml.{key}", _SPM_DEFAULT_IDS.get(key) if kind == "llama" else None)
        return tid if isinstance(tid, int) and 0 <= tid < len(tokens) else None

    def name(key: str) -> str | None:
        tid = ident(key)
        return None if tid is None else tokens[tid]

    bos, eos = ident("bos_token_id"), ident("eos_token_id")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    single, specials = "$A:0", []
    for flag, tid, left in ((add_bos, bos, True), (add_eos, eos, False)):
        if flag and tid is not None:
            single = f"{tokens[tid]}:0 {single}" if left else f"{single} {tokens[tid]}:0"
            specials.append((tokens[tid], tid))
    if specials:
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    special = {"bos_token": name("bos_token_id"), "eos_token": name("eos_token_id"),
               "unk_token": name("unknown_token_id"), "pad_token": name("padding_token_id")}
    stops = [i for i in (eos, ident("eot_token_id"), ident("eom_token_id")) if i is not None] + fim_stops
    # by name, as llama.cpp finds them (`by_name` made them control above)
    stops += [i for i, (t, ty) in enumerate(zip(tokens, types))
              if t in END_OF_GENERATION or (ty in (CONTROL, USER_DEFINED) and t in END_OF_TURN)]
    templates = {
        ("default" if k == "tokenizer.chat_template" else k[len("tokenizer.chat_template."):]): v
        for k, v in md.items()
        if (k == "tokenizer.chat_template" or k.startswith("tokenizer.chat_template.")) and isinstance(v, str)
    }
    return GGUFTokenizerParts(tok, special, sorted(set(stops)), templates)
