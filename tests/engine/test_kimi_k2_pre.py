"""The `kimi-k2` pre-tokenizer (Kimi K2 / Kimi-Linear GGUFs) splits text as Kimi's own tokenizer does:
its pattern as tokenization_kimi.py writes it (llama.cpp quotes it beside
unicode_regex_split_custom_kimi_k2), run by the `regex` package, is the reference for the Oniguruma
form the GGUF tokenizer runs. (llama.cpp's hand-written splitter keeps mixed-case words whole, e.g.
" FoX", where the pattern splits " Fo" "X": benchmarks/gguf_conformance.py notes it.)"""
from __future__ import annotations

import pytest
import regex
from tokenizers import Regex, pre_tokenizers

from sparkserve.frontend.gguf_tokenizer import _PRE

KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
TEXTS = ["Hello中文字符abc日本語のテキスト 한국어", "The quick brown fox. THE QUICK Brown FoX",
         "don't I'LL we've THEY'RE", "mixedCaseWords camelCaseHTTPServer", "12345 3.14159 -0.5e10 1,000,000",
         "  two  spaces\n\n\tand\r\nCRLF  ",
         "path/to/file.py: <tag attr='v'>text</tag> $x+=1;", "Ünïcödé façade naïve café Ωμέγα Кириллица 😀🎉",
         "汉字と漢字、カタカナ。中文，标点！"]


@pytest.mark.parametrize("text", TEXTS)
def test_kimi_k2_splits_as_kimis_pattern(text):
    spec = _PRE["kimi-k2"]
    split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated")
                                     for r in spec.splits])
    assert [piece for piece, _ in split.pre_tokenize_str(text)] == regex.findall(KIMI_PATTERN, text,
                                                                                  flags=regex.V1)
