"""GGUF tokenizers of every kind against references, on tiny vocabularies trained here (nothing downloaded).

Each kind is written into a GGUF file with gguf-py's GGUFWriter under the keys llama.cpp's converter writes
(`write_tokenizer_gguf`). Two references:
- transformers loading that same GGUF (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`), where its
  conversion matches llama.cpp;
- `LlamaCpp` below, a line-by-line Python port of llama.cpp's tokenizers (llama-vocab.cpp: the special-token
  partition, `llm_tokenizer_spm_session`, `llm_tokenizer_bpe_session` with its `regex_exprs` per
  pre-tokenizer as llama.cpp writes them, run with the `regex` module), for everything transformers does not
  convert as llama.cpp runs it: a SentencePiece space prefix after a special token (llama.cpp and the
  legacy HF Llama/Mistral tokenizers put one, transformers' GGUF Llama tokenizer does not; nor before text
  that starts with a space, where SentencePiece's add_dummy_prefix and llama.cpp do), and the pre-tokenizers
  transformers has no split for (it falls back to GPT-2 splitting: smollm, starcoder, deepseek-*, falcon...),
  and llama.cpp's ignore_merges (Llama 3, Tekken: a piece that is a whole token is that token; the models'
  own tokenizer.json say so too, transformers' GGUF conversion does not).
"""

from __future__ import annotations

import heapq
import json
import os
import random

import gguf
import pytest
import regex
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from sparkserve.frontend.gguf_tokenizer import SPACE, SUPPORTED_PRE, bytes_to_unicode
from sparkserve.frontend.tokenizer import Tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

CORPUS = [
    "",
    " ",
    "Hello, world!",
    "  two leading spaces and trailing   ",
    "The quick brown fox jumps over the lazy dog. THE QUICK Brown FoX",
    "def f(x):\n\tif x:\n\t\treturn [i ** 2 for i in range(x)]  # comment\n    pass\n",
    "12345 3.14159 -0.5e10 1,000,000 v1.2.3 x²³ ½ ٣٤ 1234567890123",
    "emoji 😀🎉👩‍👩‍👧 and CJK 中文字符 日本語のテキスト 한국어",
    "\n\nnewlines\n\n\nand\r\nCRLF\n",
    "don't I'LL we've THEY'RE it's",
    "Ünïcödé façade naïve café Ωμέγα Кириллица",
    "tabs\t\tand   mixed \t whitespace",
    "path/to/file.py: <tag attr='v'>text</tag> $x+=1; a^b|c~d `code` @user #hash",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|eot_id|>more<think>inner</think> end",
    "<s>[INST] What is 2+2? [/INST] four </s>",
    "mixedCaseWords camelCaseHTTPServer XMLHttpRequest iPhone",
    WHOLE := "a Zyzzyva word: whole only where llama.cpp ignores merges",
    "…。，、।۔، punctuation runs!!! ??? ...",
]
UNSEEN = "characters never trained: 🦀∮ᚠ𝔘 ẞ"   # byte fallback (SentencePiece) / raw bytes (BPE)
CORPUS.append(UNSEEN)
_TRAIN = [t for t in CORPUS if t and t != UNSEEN and "Zyzzyva" not in t] * 3 + [
    "the of and to in is that for it with as was on be by this are at from or an have not but which",
    "return self def class import from print range len if else elif while for try except finally",
    "中文 日本 한국 字符 テキスト", "hello hello world world the the quick quick",
]
SPECIAL_TEXTS = [t for t in CORPUS if "<" in t]


# ---- writing a GGUF as llama.cpp's converter does ------------------------------------------------------


def write_tokenizer_gguf(path: str, *, arch: str, model: str, tokens: list[str], types: list[int],
                         scores: list[float] | None = None, merges: list[str] | None = None,
                         pre: str | None = None,
                         bos: int | None = None, eos: int | None = None, unk: int | None = None,
                         pad: int | None = None, eot: int | None = None, add_bos: bool | None = None,
                         add_eos: bool | None = None, add_space_prefix: bool | None = None,
                         chat_template: str | None = None, fim_pad: int | None = None,
                         name: str | None = None) -> str:
    """The `tokenizer.ggml.*` keys (gguf-py's writer, as convert_hf_to_gguf.py's set_vocab writes them)."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    for value, add in ((bos, w.add_bos_token_id), (eos, w.add_eos_token_id), (unk, w.add_unk_token_id),
                       (pad, w.add_pad_token_id), (eot, w.add_eot_token_id)):
        if value is not None:
            add(value)
    if fim_pad is not None:
        w.add_uint32("tokenizer.ggml.fim_pad_token_id", fim_pad)
    if name is not None:
        w.add_name(name)
    for flag, add in ((add_bos, w.add_add_bos_token), (add_eos, w.add_add_eos_token),
                      (add_space_prefix, w.add_add_space_prefix)):
        if flag is not None:
            add(flag)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def transformers_ref(path: str):
    import transformers  # a test dependency: the reference, never skipped
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


# ---- llama.cpp's tokenizers in Python (the reference where transformers differs) ------------------------


class LlamaCpp:
    """llama-vocab.cpp's `tokenize(text, add_special, parse_special=True)` for SPM and BPE vocabularies."""

    def __init__(self, tokens: list[str], types: list[int], scores: list[float] | None = None,
                 merges: list[str] | None = None, regexes: tuple[str, ...] = (), add_bos: bool = False,
                 bos: int | None = None, ignore_merges: bool = False, add_space_prefix: bool = True) -> None:
        self.tokens, self.ids = tokens, {t: i for i, t in enumerate(tokens)}
        self.scores = scores or [0.0] * len(tokens)
        self.ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(merges or [])}
        self.regexes, self.add_bos, self.bos = regexes, add_bos, bos
        self.ignore_merges, self.add_space_prefix = ignore_merges, add_space_prefix
        self.special = sorted((i for i, ty in enumerate(types) if ty in (CONTROL, USER_DEFINED, UNKNOWN)),
                              key=lambda i: -len(tokens[i]))
        self.spm = merges is None

    def _partition(self, text: str) -> list[int | str]:
        frags: list[int | str] = [text] if text else []
        for sid in self.special:
            word, out = self.tokens[sid], []
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    continue
                parts = f.split(word)
                for k, p in enumerate(parts):
                    if k:
                        out.append(sid)
                    if p:
                        out.append(p)
            frags = out
        return frags

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        out = [self.bos] if add_special and self.add_bos else []
        prev_special = True
        for f in self._partition(text):
            if isinstance(f, int):
                out.append(f)
                prev_special = True
            elif self.spm:
                t = (" " if self.add_space_prefix and prev_special else "") + f
                out += self._spm(t.replace(" ", SPACE))
                prev_special = False
            else:
                out += self._bpe(f)
        return out

    def _byte(self, b: int) -> int:
        return self.ids[f"<0x{b:02X}>"]

    def _spm(self, text: str) -> list[int]:
        syms = list(text)           # merged text per symbol; "" once merged away
        nxt, prv = list(range(1, len(syms))) + [-1], list(range(-1, len(syms) - 1))
        heap: list[tuple[float, int, int, int]] = []
        rev: dict[str, tuple[str, str]] = {}

        def bigram(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            t = syms[left] + syms[right]
            if t in self.ids:
                heapq.heappush(heap, (-self.scores[self.ids[t]], left, right, len(t)))
                rev[t] = (syms[left], syms[right])

        for i in range(1, len(syms)):
            bigram(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not syms[left] or not syms[right] or len(syms[left]) + len(syms[right]) != size:
                continue
            syms[left] += syms[right]
            syms[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            bigram(prv[left], left)
            bigram(left, nxt[left])
        out: list[int] = []

        def resegment(t: str) -> None:
            if t in self.ids:
                out.append(self.ids[t])
            elif t in rev:
                resegment(rev[t][0])
                resegment(rev[t][1])
            else:
                out.extend(self._byte(b) for b in t.encode("utf-8"))

        i = 0
        while i != -1 and syms:
            resegment(syms[i])
            i = nxt[i]
        return out

    def _split(self, text: str) -> list[str]:
        pieces = [text]
        for expr in self.regexes:
            out = []
            for p in pieces:
                last = 0
                for m in regex.finditer(expr, p):
                    if m.start() == m.end():
                        continue
                    if m.start() > last:
                        out.append(p[last:m.start()])
                    out.append(m.group())
                    last = m.end()
                if last < len(p):
                    out.append(p[last:])
            pieces = out
        return pieces

    def _bpe(self, text: str) -> list[int]:
        spell = bytes_to_unicode()
        out: list[int] = []
        for word in self._split(text):
            word = "".join(spell[b] for b in word.encode("utf-8"))
            if self.ignore_merges and word in self.ids:
                out.append(self.ids[word])
                continue
            syms = list(word)
            while len(syms) > 1:
                best = min((self.ranks.get(pair, 1 << 60), i) for i, pair in enumerate(zip(syms, syms[1:])))
                if best[0] == 1 << 60:
                    break
                i = best[1]
                syms[i:i + 2] = [syms[i] + syms[i + 1]]
            out.extend(self.ids[s] for s in syms)
        return out


# llama.cpp's regex_exprs (llama-vocab.cpp, llm_tokenizer_bpe), spelled as llama.cpp spells them.
_LC_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LC_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LC_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LC_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])"
              r"([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LC_CONTR = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
_LC_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}])([^a-z]))*((?=[\p{{L}}])([^A-Z]))+{_LC_CONTR}"
             rf"|[^\r\n\p{{L}}\p{{N}}]?((?=[\p{{L}}])([^a-z]))+((?=[\p{{L}}])([^A-Z]))*{_LC_CONTR}"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LC_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"
_LC_DS_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
_LC_DS_V3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
             r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
             r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LC_BAILING = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
_LC_SEED = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
            r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
# name -> (regex_exprs, ignore_merges, transformers converts it as llama.cpp runs it)
LLAMA_CPP_PRE: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "llama-bpe": ((_LC_LLAMA3,), True, True),
    "qwen2": ((_LC_QWEN2,), False, True),
    "deepseek-r1-qwen": ((_LC_QWEN2,), False, True),
    "gpt-4o": ((_LC_GPT4O,), False, True),
    "tekken": ((_LC_TEKKEN,), True, True),
    "smollm": ((r"\p{N}", _LC_GPT2), False, False),
    "olmo": ((_LC_GPT2,), False, True),
    "gpt-2": ((_LC_GPT2,), False, True),
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _LC_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), False, False),
    "refact": ((r"\p{N}", _LC_GPT2), False, False),
    "starcoder": ((r"\p{N}", _LC_GPT2), False, False),
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", _LC_GPT2, r"[0-9][0-9][0-9]"), False, False),
    "command-r": ((r"\p{N}", _LC_GPT2), False, False),
    "stablelm2": ((_LC_QWEN2,), False, False),
    "dbrx": ((_LC_LLAMA3,), False, True),
    "smaug-bpe": ((_LC_LLAMA3,), False, True),
    "poro-chat": ((_LC_PORO,), False, False),
    "chatglm-bpe": ((_LC_LLAMA3,), False, False),
    "viking": ((_LC_PORO, r"\p{N}"), False, False),
    "jais": ((_LC_GPT2,), False, False),
    "deepseek-coder": (_LC_DS_CODER, False, False),
    "deepseek-v3": (_LC_DS_V3, False, False),
    "exaone": ((r"\p{N}", _LC_GPT2), False, False),
    "minerva-7b": ((r"\p{N}", _LC_GPT2), False, False),
    "bloom": ((_LC_PORO,), False, False),
    "gpt3-finnish": ((_LC_PORO,), False, False),
    "phi-2": ((_LC_GPT2,), False, False),
    "trillion": ((_LC_GPT2,), False, False),
    "bailingmoe": ((_LC_BAILING,), False, False),
    "seed-coder": ((_LC_SEED,), False, False),
    "chameleon": ((r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )",
                   r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _LC_GPT2), False, False),
}


# ---- vocabularies trained here --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """A Llama-2-style SentencePiece vocabulary: <unk> <s> </s>, 256 byte tokens, pieces best-first with
    scores, then user-defined and control tokens (as llama.cpp's converter lists a tokenizer.model)."""
    trained = RustTokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    trained.train_from_iterator(_TRAIN, trainers.BpeTrainer(vocab_size=700, min_frequency=2,
                                                            show_progress=False, special_tokens=["<unk>"]))
    extra = ["<think>", "</think>", "<|im_start|>", "<|im_end|>", "<|eot_id|>", "[unused0]", "[unused1]"]
    reserved = {"<unk>", "<s>", "</s>", *extra}
    pieces = [t for t, _ in sorted(trained.get_vocab().items(), key=lambda kv: kv[1]) if t not in reserved]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, *extra]
    types = [UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * len(pieces),
             USER_DEFINED, USER_DEFINED, CONTROL, CONTROL, CONTROL, UNUSED, UNUSED]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * 7
    return tokens, types, scores


@pytest.fixture(scope="module")
def bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary (every byte, merges best-first) with control and user-defined tokens."""
    trained = RustTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=900, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trained.train_from_iterator(_TRAIN, trainer)
    model = json.loads(trained.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>", "<s>", "</s>"]
    assert "ĠZyzzyva" not in tokens
    tokens += ["ĠZyzzyva", *specials, "<think>", "</think>"]    # a token no merge makes (ignore_merges)
    types = [NORMAL] * (len(tokens) - 8) + [CONTROL] * 6 + [USER_DEFINED] * 2
    return tokens, types, merges


def _spm_gguf(tmp_path, spm_vocab, arch: str = "llama", **kw) -> str:
    tokens, types, scores = spm_vocab
    args = dict(arch=arch, model="llama", tokens=tokens, types=types, scores=scores, bos=1, eos=2, unk=0,
                add_bos=True, add_eos=False)
    name = f"{arch}-{len(os.listdir(tmp_path))}.gguf"      # a new name each: metadata is cached by path
    return write_tokenizer_gguf(str(tmp_path / name), **{**args, **kw})


def _check_round_trip(ours: Tokenizer, texts: list[str]) -> None:
    for text in texts:
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text, text


# ---- SentencePiece -------------------------------------------------------------------------------------


def test_sentencepiece_llama_matches_transformers_and_llama_cpp(tmp_path, spm_vocab) -> None:
    """Llama 2 / Mistral / TinyLlama: byte fallback, ▁ prefix, BOS added, control/user-defined tokens."""
    path = _spm_gguf(tmp_path, spm_vocab, eot=spm_vocab[0].index("<|eot_id|>"))
    ours, ref = Tokenizer.from_gguf(path), transformers_ref(path)
    tokens, types, scores = spm_vocab
    cpp = LlamaCpp(tokens, types, scores, add_bos=True, bos=1)
    assert ours.vocab_size == len(ref) == len(tokens)
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == cpp.encode(text), text
        want = cpp.encode(text, add_special=True)
        if text.startswith("<s>"):      # the text's own BOS is the one (chat templates write it)
            assert want[:2] == [1, 1]
            want = want[1:]
        assert ours.encode(text, add_special_tokens=True) == want, text
        if text not in SPECIAL_TEXTS and not text.startswith(" "):   # where transformers differs (docstring)
            assert ids == ref.encode(text, add_special_tokens=False), text
            assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    _check_round_trip(ours, [t for t in CORPUS if t not in SPECIAL_TEXTS])
    assert any(tokens[i].startswith("<0x") for i in ours.encode(UNSEEN))          # byte fallback
    assert ours.encode("<think>x</think>")[0] == tokens.index("<think>")           # user-defined: whole
    assert ours.decode(ours.encode("a<|im_end|>b")) == "a b"                        # control: skipped
    assert ours.bos_token_id == 1 and ours.eos_token_id == 2
    assert ours.eos_token_ids == {2, tokens.index("<|eot_id|>"), tokens.index("<|im_end|>")}


def test_sentencepiece_phi3_matches_transformers(tmp_path, spm_vocab) -> None:
    """Phi-3: transformers builds its space prefix as llama.cpp does (after special tokens too), so there it
    is the reference for every text."""
    tokens, types, scores = spm_vocab
    path = _spm_gguf(tmp_path, spm_vocab, arch="phi3")
    ours, ref, cpp = Tokenizer.from_gguf(path), transformers_ref(path), LlamaCpp(tokens, types, scores)
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False) == cpp.encode(text), text
        if not text.startswith("<s>"):
            assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_sentencepiece_flags(tmp_path, spm_vocab) -> None:
    """add_bos_token false, add_eos_token true, add_space_prefix false, each as llama.cpp reads them."""
    tokens, types, scores = spm_vocab
    path = _spm_gguf(tmp_path, spm_vocab, add_bos=False, add_eos=True, add_space_prefix=False)
    ours = Tokenizer.from_gguf(path)
    cpp = LlamaCpp(tokens, types, scores, add_space_prefix=False)
    for text in CORPUS:
        assert ours.encode(text) == cpp.encode(text), text
        assert ours.encode(text, add_special_tokens=True) == [*cpp.encode(text), 2], text
    _check_round_trip(ours, [t for t in CORPUS if t not in SPECIAL_TEXTS])
    assert ours.encode("hello")[0] != Tokenizer.from_gguf(_spm_gguf(tmp_path, spm_vocab)).encode("hello")[0]


def test_sentencepiece_gemma_matches_transformers(tmp_path, spm_vocab) -> None:
    """Gemma: no space prefix, merges from the token order, whitespace-run tokens stored as spaces."""
    tokens, types, scores = spm_vocab
    tokens, types = [*tokens, SPACE * 2, SPACE * 4, SPACE * 3], [*types, NORMAL, NORMAL, NORMAL]
    scores = [float(i % 7) for i in range(len(tokens))]      # not the merge order: Gemma's is the token order
    tokens = [t.replace(SPACE, " ") if t and set(t) == {SPACE} else t for t in tokens]   # as Gemma files do
    names = {1: "<bos>", 2: "<eos>", tokens.index("<|im_end|>"): "<end_of_turn>",
             tokens.index("<|im_start|>"): "<start_of_turn>"}
    tokens = [names.get(i, t) for i, t in enumerate(tokens)]
    template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}"
                "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    path = _spm_gguf(tmp_path, (tokens, types, scores), arch="gemma2", add_space_prefix=False,
                     chat_template=template)
    ours, ref = Tokenizer.from_gguf(path), transformers_ref(path)
    texts = [t.replace("<|im_start|>", "<start_of_turn>").replace("<|im_end|>", "<end_of_turn>")
             for t in CORPUS]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    _check_round_trip(ours, texts)
    assert tokens.index("<end_of_turn>") in ours.eos_token_ids
    msgs = [{"role": "user", "content": "Hello, world! 中文"}]
    prompt = ours.apply_chat_template(msgs)
    assert prompt == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = ours.encode(prompt, add_special_tokens=True)          # as the server encodes a chat prompt
    want = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    assert ids == list(getattr(want, "input_ids", want)) and ids.count(1) == 1     # one <bos>


def test_sentencepiece_gemma_user_defined_space_runs(tmp_path, spm_vocab) -> None:
    """Gemma's space runs are user-defined tokens spelled with spaces (llama.cpp's converter writes a
    user-defined token's `▁` as a space): matched whole in the raw text, as llama.cpp and SentencePiece do
    (transformers respells them `▁` and merges instead)."""
    tokens, types, _ = spm_vocab
    runs = [" " * n for n in (2, 3, 4, 8)]
    tokens, types = [*tokens, *runs], [*types, *[USER_DEFINED] * len(runs)]
    scores = [float(i % 7) for i in range(len(tokens))]      # Gemma merges by token order, not score
    path = _spm_gguf(tmp_path, (tokens, types, scores), arch="gemma", add_space_prefix=False)
    ours = Tokenizer.from_gguf(path)
    cpp = LlamaCpp(tokens, types, [-float(i) for i in range(len(tokens))], add_space_prefix=False)
    texts = [*CORPUS, "a" + " " * 21 + "b", "x  \n   y\t    z"]
    for text in texts:
        assert ours.encode(text) == cpp.encode(text), text
    assert tokens.index(" " * 8) in ours.encode("a" + " " * 21 + "b")
    _check_round_trip(ours, texts)


# ---- byte-level BPE pre-tokenizers ------------------------------------------------------------------------


def _bpe_gguf(tmp_path, bpe_vocab, pre: str, **kw) -> str:
    tokens, types, merges = bpe_vocab
    args = dict(arch="llama", model="gpt2", pre=pre, tokens=tokens, types=types, merges=merges,
                bos=tokens.index("<|endoftext|>"), eos=tokens.index("<|im_end|>"), add_bos=False)
    name = f"bpe-{pre}-{len(os.listdir(tmp_path))}.gguf"
    return write_tokenizer_gguf(str(tmp_path / name), **{**args, **kw})


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP_PRE))
def test_bpe_pre_tokenizer_matches_llama_cpp(tmp_path, bpe_vocab, pre: str) -> None:
    """Each pre-tokenizer splits as llama.cpp's regex_exprs do (and as transformers, where it converts it)."""
    regexes, ignore_merges, hf_same = LLAMA_CPP_PRE[pre]
    tokens, types, merges = bpe_vocab
    path = _bpe_gguf(tmp_path, bpe_vocab, pre)
    ours = Tokenizer.from_gguf(path)
    cpp = LlamaCpp(tokens, types, merges=merges, regexes=regexes, ignore_merges=ignore_merges)
    ref = transformers_ref(path) if hf_same else None
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == cpp.encode(text), (pre, text)
        if ref is not None and not (ignore_merges and text == WHOLE):   # transformers ignores no merges
            assert ids == ref.encode(text, add_special_tokens=False), (pre, text)
            assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    _check_round_trip(ours, CORPUS)


def test_bpe_special_tokens_bos_and_template(tmp_path, bpe_vocab) -> None:
    tokens, types, merges = bpe_vocab
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    path = _bpe_gguf(tmp_path, bpe_vocab, "llama-bpe", add_bos=True, eot=tokens.index("</s>"),
                     chat_template=template)
    ours, ref = Tokenizer.from_gguf(path), transformers_ref(path)
    for text in CORPUS:
        assert ours.encode(text, add_special_tokens=True)[0] == tokens.index("<|endoftext|>")
        if text != WHOLE:
            assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
    assert ours.encode(WHOLE)[1] == tokens.index("ĠZyzzyva")
    bos = tokens.index("<|endoftext|>")
    assert ours.encode("<|endoftext|>x", add_special_tokens=True)[:2] == [bos, tokens.index("x")]   # one BOS
    assert ours.encode("x<think>y")[1] == tokens.index("<think>")
    # eos, the file's eot id, and an end-of-turn token the file does not name
    stops = ("<|im_end|>", "</s>", "<|eot_id|>", "<|endoftext|>")
    assert ours.eos_token_ids == {tokens.index(t) for t in stops}
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    base = Tokenizer.from_gguf(_bpe_gguf(tmp_path, bpe_vocab, "qwen2"))    # a base model: completions only
    assert base.chat_template is None
    assert base.encode("<|endoftext|><|endoftext|>x", add_special_tokens=True)[:2] == [bos, bos]  # none added
    with pytest.raises(ValueError, match="no chat template; send a plain prompt"):  # serving_openai: a 400
        base.apply_chat_template(msgs)


def test_exported_hf_tokenizer_matches(tmp_path, spm_vocab, bpe_vocab) -> None:
    """hf_export's directory (save_pretrained) of a SentencePiece and a Llama 3 GGUF tokenizes the same in
    transformers, BOS included."""
    import transformers
    for i, path in enumerate((_spm_gguf(tmp_path, spm_vocab), _bpe_gguf(tmp_path, bpe_vocab, "llama-bpe",
                                                                         add_bos=True))):
        ours = Tokenizer.from_gguf(path)
        ours.save_pretrained(str(tmp_path / f"hf{i}"))
        hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / f"hf{i}"))
        for text in CORPUS:
            if not text.startswith("<s>"):      # where ours keeps one BOS, HF adds a second
                assert hf.encode(text) == ours.encode(text, add_special_tokens=True), (path, text)
            assert hf.encode(text, add_special_tokens=False) == ours.encode(text), (path, text)


def test_unknown_pre_tokenizer_fails_naming_it(tmp_path, bpe_vocab) -> None:
    """At start-up (the HTTP process's tokenizer load, which `serve` reports as StartupFailed)."""
    from sparkserve.args import ServerArgs
    from sparkserve.entrypoints.launch import _load_frontend_tokenizer
    path = _bpe_gguf(tmp_path, bpe_vocab, "no-such-pre")
    with pytest.raises(ValueError, match=r"'no-such-pre'.*not supported; supported: .*llama-bpe.*qwen2"):
        _load_frontend_tokenizer(ServerArgs(model_path=path, tokenizer_path=path))


def test_sentencepiece_streaming_detokenizer(tmp_path, spm_vocab) -> None:
    """Byte-fallback characters split over stream chunks come out whole; deltas add up to the full decode."""
    from sparkserve.frontend.detokenizer import IncrementalDetokenizer
    ours = Tokenizer.from_gguf(_spm_gguf(tmp_path, spm_vocab))
    ids = ours.encode("Hello " + UNSEEN + " world 中文 done")
    assert any(ours.decode([i]) == "\ufffd" for i in ids)
    for step in (1, 2):
        det = IncrementalDetokenizer(ours)
        deltas = [det.add(ids[i:i + step]) for i in range(0, len(ids), step)] + [det.flush()]
        assert "".join(deltas) == ours.decode(ids) and not any("\ufffd" in d for d in deltas)


def test_every_supported_pre_tokenizer_builds(tmp_path, bpe_vocab) -> None:
    """Every name in the table compiles and round-trips (the ones not compared above included)."""
    rng = random.Random(0)
    for pre in SUPPORTED_PRE:
        ours = Tokenizer.from_gguf(_bpe_gguf(tmp_path, bpe_vocab, pre))
        _check_round_trip(ours, rng.sample(CORPUS, 6))


def test_token_bytes_add_up_to_the_text(tmp_path, spm_vocab, bpe_vocab) -> None:
    """Logprobs show each token's own bytes: for SentencePiece `▁` is a space and a `<0xNN>` token its
    byte (a character split over byte tokens comes out whole only once they are joined); for byte-level
    BPE each spelled character maps back to its byte. Joined, they are the text that was encoded (with
    SentencePiece's one space in front)."""
    spm = Tokenizer.from_gguf(_spm_gguf(tmp_path, spm_vocab))
    bpe = Tokenizer.from_gguf(_bpe_gguf(tmp_path, bpe_vocab, "llama-bpe"))
    for text in [t for t in CORPUS if t and "<" not in t] + ["Hello " + UNSEEN + " 中文"]:
        ids = spm.encode(text)
        assert b"".join(spm.token_bytes(i) for i in ids) == (" " + text).encode(), text
        assert any(len(spm.token_bytes(i)) == 1 and spm.token_bytes(i)[0] >= 0x80 for i in spm.encode(UNSEEN))
        ids = bpe.encode(text)
        assert b"".join(bpe.token_bytes(i) for i in ids) == text.encode(), text
    eos = spm.eos_token_id
    assert spm.token_bytes(eos) == spm.decode([eos], skip_special_tokens=False).encode()


def test_end_of_generation_and_fim_names_are_control_whatever_their_type(tmp_path, bpe_vocab) -> None:
    """llama.cpp (llama-vocab.cpp) makes a token control by its text: every end-of-generation name (then
    matched whole in text, skipped on decode, a stop) and, per fill-in-the-middle role the file names no
    id for, its token (pad / repo / file separator also stop). A converter that types them normal (as
    convert_hf_to_gguf.py does a SentencePiece piece its tokenizer_config does not list) still gets them
    so from llama.cpp: seen against the real library in benchmarks/gguf_conformance.py."""
    tokens, types, merges = bpe_vocab
    extra = ["<end_of_turn>", "<|fim_prefix|>", "<|fim_pad|>", "[PAD]"]
    path = write_tokenizer_gguf(str(tmp_path / "normal.gguf"), arch="llama", model="gpt2", pre="qwen2",
                                tokens=tokens + extra, types=types + [NORMAL] * 4, merges=merges,
                                eos=tokens.index("<|im_end|>"))
    ours = Tokenizer.from_gguf(path)
    eot, pre, pad, pad2 = (len(tokens) + i for i in range(4))
    x, y = tokens.index("x"), tokens.index("y")
    assert ours.encode("x<end_of_turn>y") == [x, eot, y]
    assert ours.encode("x<|fim_prefix|>y<|fim_pad|>") == [x, pre, y, pad]
    assert ours.decode([x, eot, pre, y]) == "xy"
    assert ours.encode("[PAD]") != [pad2]       # the FIM pad role went to the first of its names
    assert {eot, pad} <= ours.eos_token_ids and pre not in ours.eos_token_ids
    # a file that names the FIM pad role: its id stops, the names are left alone
    named = write_tokenizer_gguf(str(tmp_path / "named.gguf"), arch="llama", model="gpt2", pre="qwen2",
                                 tokens=tokens + extra, types=types + [NORMAL] * 4, merges=merges,
                                 fim_pad=pad2)
    theirs = Tokenizer.from_gguf(named)
    assert pad2 in theirs.eos_token_ids and pad not in theirs.eos_token_ids
    assert theirs.encode("<|fim_pad|>") != [pad]


def test_sentencepiece_ids_default_as_llama_cpp(tmp_path, spm_vocab) -> None:
    """A SentencePiece file without bos / eos / unk ids: llama.cpp's SPM defaults 1 / 2 / 0 (what it
    added as BOS to the converter's Gemma file without ids, benchmarks/gguf_conformance.py)."""
    path = _spm_gguf(tmp_path, spm_vocab, bos=None, eos=None, unk=None)
    ours = Tokenizer.from_gguf(path)
    assert ours.encode("hello", add_special_tokens=True)[0] == 1
    assert 2 in ours.eos_token_ids
    assert ours.encode("🦀") == ours.encode("🦀", add_special_tokens=True)[1:]


def test_phi3_special_tokens_swallow_the_whitespace_after_them(tmp_path, spm_vocab) -> None:
    """llama.cpp gives a model whose general.name says Phi-3 rstrip special tokens (all but <unk>, <s>,
    <|endoftext|>): "<|user|>\\n  hi" tokenizes as "<|user|>hi" (the real llama.cpp does so on the
    converter's Phi-3 file, benchmarks/gguf_conformance.py); other models keep the whitespace."""
    phi3 = Tokenizer.from_gguf(_spm_gguf(tmp_path, spm_vocab, arch="phi3", name="Phi3 Mini 4k Instruct"))
    other = Tokenizer.from_gguf(_spm_gguf(tmp_path, spm_vocab, arch="phi3", name="Some Model"))
    text = "<|im_start|>\n  hi there <|im_end|>\n<|eot_id|> ok</s> x"
    assert phi3.encode(text) == phi3.encode("<|im_start|>hi there <|im_end|><|eot_id|>ok</s>x")
    assert other.encode(text) != phi3.encode(text)
    assert phi3.encode("<s> hi") == other.encode("<s> hi")          # <s> keeps its whitespace
    assert phi3.encode("<think> hi") == phi3.encode("<think>hi")    # user-defined tokens strip too
