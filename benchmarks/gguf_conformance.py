"""Every GGUF family sparkserve serves, converted by llama.cpp's OWN convert_hf_to_gguf.py and checked
three ways: sparkserve's logits from the GGUF vs transformers on the HF checkpoint, vs llama.cpp's own
logits on the same GGUF, and sparkserve's GGUF tokenizer vs llama.cpp's tokenization of hard strings
(on each family's file, and for every pre-tokenizer name sparkserve supports on vocab-only files).

The test fixtures (tests/family_fixtures.py write_gguf) mirror the converter by hand; this runs the real
one, so a metadata quirk (a key it writes or leaves out, a tensor layout) shows here.

Per family: the tiny random checkpoint of tests/family_fixtures.py (every 1-D parameter moved off its
init value) with a tokenizer trained here (byte-level BPE split as the family's real pre-tokenizer, or a
SentencePiece model for the SentencePiece families), converted to f32, f16 and q8_0. One liberty is
taken with the converter: its pre-tokenizer detection (a hash of a real tokenizer's ids, which a tokenizer
trained here cannot match) is replaced by the name the family's real tokenizer hashes to
(`tokenizer.ggml.pre`); everything else is the converter's.

llama.cpp: the llama-cpp-python sdist (pinned in peers/llamacpp.py) unpacked at LLAMA_CPP_SDIST (its
vendor/llama.cpp holds the converter and gguf-py), its libllama built as shared libraries (cmake ...
-DBUILD_SHARED_LIBS=ON; `cmake --build build --target llama`), found as every benchmark finds llama.cpp
(peers/llamacpp.py `lib_dir`, `tool`: LLAMA_CPP_LIB_PATH, else a found copy), and the sdist's own
Python bindings (llama_cpp) on that library, in a process of their own. The converter runs
under CONVERTER_PYTHON (a Python with sentencepiece and protobuf: the SentencePiece families need them).

    CONVERTER_PYTHON=/work/llamacpp/venv/bin/python LLAMA_CPP_SDIST=/work/llamacpp/llama_cpp_python-0.3.36 \\
    LLAMA_CPP_LIB_PATH=/work/llamacpp/build/bin PYTHONPATH=. \\
    python benchmarks/gguf_conformance.py [--only a,b] [--keep DIR]

writes benchmarks/results/gguf_conformance.{json,md}."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SDIST = os.environ.get("LLAMA_CPP_SDIST", "/work/llamacpp/llama_cpp_python-0.3.36")
CONVERTER_PYTHON = os.environ.get("CONVERTER_PYTHON", "/work/llamacpp/venv/bin/python")
CONVERTER = os.path.join(SDIST, "vendor", "llama.cpp")

# family -> (fixture: tests/family_fixtures.py FAMILIES name or a conftest TINY_CONFIGS arch,
#            tokenizer: "spm" (SentencePiece tokenizer.model) / "gemma-spm" / a BPE pre-tokenizer name
#            as llama.cpp's converter detects it for the family's real tokenizer)
CASES: dict[str, tuple[str, str]] = {
    "llama3 (rope_freqs)": ("llama3", "llama-bpe"),
    "llama3 tied": ("llama3_tied", "llama-bpe"),
    "llama linear rope": ("llama_linear", "spm"),
    "mistral (window 8)": ("mistral", "spm"),
    "qwen2": ("qwen2", "qwen2"),
    "qwen2 yarn": ("qwen2_yarn", "deepseek-r1-qwen"),
    "qwen3": ("qwen3", "qwen2"),
    "gemma2": ("gemma2", "gemma-spm"),
    "gemma3": ("gemma3", "gemma-spm"),
    "gemma3 local base": ("gemma3_local_base", "gemma-spm"),
    "phi3": ("phi3", "phi3-spm"),
    "phi3 longrope": ("phi3_longrope", "phi3-spm"),
    "granite": ("granite", "refact"),
    "olmo2": ("olmo2", "dbrx"),
    "smollm3": ("smollm3", "llama-bpe"),
    "gpt-oss": ("gpt_oss_gguf", "gpt-4o"),
    "deepseek2": ("deepseek_v2", "deepseek-llm"),
    "deepseek2 q_lora": ("deepseek_v2_qlora_gguf", "deepseek-llm"),
    "mixtral": ("mixtral", "spm"),
    "qwen3moe": ("qwen3_moe_raw", "qwen2"),
    # Kimi-Linear in its original checkpoint format (kimi_fixtures.as_original_checkpoint; its real
    # pre-tokenizer kimi-k2 is llama.cpp's own code, not a regex: gpt-4o's splitting stands in; NOTES)
    "olmo3": ("olmo3", "dbrx"),
    "kimi-linear": ("kimi:gguf", "gpt-4o"),
    # MiniMax-M2 as transformers saves it (the released checkpoints' format: minimax_m2_fixtures)
    "minimax-m2": ("minimax_m2:", "minimax-m2"),
    # MiniMax-M3 in MiniMax's own layout (minimax_fixtures.as_original_checkpoint), which the converter
    # reads and transformers does not: the transformers-format copy beside it is the reference
    # (`reference_dir`); llama.cpp runs its sparse attention (MSA) only with flash attention on
    "minimax-m3": ("minimax_m3:", "minimax-m2"),
}
OUTTYPES = ("f32", "f16", "q8_0")
QUANTIZED = "Q4_K_M"      # llama-quantize's type, from the f32 file
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "Hello, world!", " leading space", "  two leading spaces and trailing   ",
    "The quick brown fox jumps over the lazy dog. THE QUICK Brown FoX",
    "def f(x):\n\tif x:\n\t\treturn [i ** 2 for i in range(x)]  # comment\n    pass\n",
    "12345 3.14159 -0.5e10 1,000,000 v1.2.3 x²³ ½ ٣٤ 1234567890123",
    "emoji 😀🎉👩‍👩‍👧 and CJK 中文字符 日本語のテキスト 한국어",
    "\n\nnewlines\n\n\nand\r\nCRLF\n", "don't I'LL we've THEY'RE it's",
    "Ünïcödé façade naïve café Ωμέγα Кириллица", "tabs\t\tand   mixed \t whitespace",
    "path/to/file.py: <tag attr='v'>text</tag> $x+=1; a^b|c~d `code` @user #hash",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n", "text<|endoftext|>more",
    "<|user|>\n  hi there <|end|>\n<|assistant|> ok</s> x", "mixedCaseWords camelCaseHTTPServer",
    "characters never trained: 🦀∮ᚠ𝔘 ẞ",
]
TRAIN = TEXTS[:-1] * 4 + [
    "the of and to in is that for it with as was on be by this are at from or an have not but which",
    "return self def class import from print range len if else elif while for try except finally",
    "hello hello world world the the quick quick brown brown fox fox",
]
_SPM_ALPHABET = set("abcdefghijklmnopqrstuvwxyz .,'")
PROMPT_LEN = 24          # past the 8-token windows of the windowed families
# Where llama.cpp itself parts from transformers (sparkserve follows the one named), measured here.
NOTES = [
    "mistral (window 8): the converter writes no sliding window for arch llama and llama.cpp runs none; "
    "sparkserve runs the GGUF as llama.cpp does (the HF directory with its window).",
    "qwen3moe (norm_topk_prob false): the converter writes no expert_weights_norm and llama.cpp's qwen3moe "
    "renormalises the top-k; sparkserve as llama.cpp (released Qwen3-MoE models renormalise).",
    "gpt-oss: llama.cpp rounds YaRN's correction range (HF's `truncate: true`); the model's config says "
    "false and sparkserve follows it (set true, sparkserve equals llama.cpp to 5e-6).",
    "deepseek2 (V2-Lite layout, no q_lora): llama.cpp takes `is_lite` from the layer count (27) and "
    "refuses a smaller file without attention.q_lora_rank; sparkserve reads the q_lora tensors.",
    "deepseek2 q_lora (group-limited routing, 2 groups): llama.cpp ranks groups by their best two experts "
    "(DeepSeek-V3's rule), DeepSeek-V2 by its best one; sparkserve follows the model (with llama.cpp's "
    "rule, sparkserve equals llama.cpp to 5e-6).",
    "Q4_K_M rows: llama-quantize's mix on rows this narrow is mostly its Q5_0 / Q8_0 fallbacks; sparkserve "
    "computes with the file's exact weights in fp32, llama.cpp with its quantized activations (MoE routing "
    "can flip where two experts' scores are close).",
    "olmo3 (windowed layers' rope base 1e4, full layers' 5e5 + YaRN): llama.cpp rotates the windowed layers "
    "by the global base although the file carries rope.freq_base_swa (with the two bases equal, as the "
    "released OLMo 3 models have them, llama.cpp equals transformers to 4e-6, YaRN and windows included); "
    "sparkserve follows transformers.",
    "kimi-linear: converted from the original checkpoint format (linear_attn_config, first_k_dense_replace; "
    "kimi_fixtures.as_original_checkpoint), one expert group (the converter writes no group count for it) "
    "and no q LoRA (llama.cpp's kimi-linear reads no q_lora_rank; the released model has none); "
    "its real pre-tokenizer kimi-k2 (gpt-4o's stands in here) sparkserve splits by Kimi's own pattern "
    "(tokenization_kimi.py; tests/engine/test_kimi_k2_pre.py), llama.cpp by hand-written code that keeps "
    "mixed-case words whole (\" FoX\" where the pattern gives \" Fo\" \"X\"): on TEXTS 16/18 equal.",
    "minimax-m3: converted from MiniMax's own layout (sparse_attention_config, moe_layer_freq, "
    "block_sparse_moe; minimax_fixtures.as_original_checkpoint), compared with transformers on the same "
    "weights in its layout; llama.cpp builds sparse attention on every layer past the leading dense ones, "
    "one index head per KV head, K-only, no initial blocks (the fixture is such a model) and runs it only "
    "with flash attention (on here), whose f16 rounding is the 1.6e-3 of its f32 rows.",
    "t5 / t5encoder and Unigram ('t5') vocabularies are refused at start-up (encoder-decoder / encoder "
    "models).",
]


# ---- workers (own processes: the converter with its vendored gguf-py, llama.cpp with its own env) ----


def convert_worker(jobs_path: str) -> None:
    """Run convert_hf_to_gguf.py's main() for each job, its pre-tokenizer hash check replaced by the
    job's name."""
    sys.path[:0] = [CONVERTER, os.path.join(CONVERTER, "gguf-py")]
    import convert_hf_to_gguf as conv
    from conversion import base
    owners = [c for c in vars(base).values() if isinstance(c, type) and "get_vocab_base_pre" in vars(c)]
    with open(jobs_path) as f:
        jobs = json.load(f)
    for job in jobs:
        for c in owners:
            c.get_vocab_base_pre = lambda self, tokenizer, pre=job["pre"]: pre
        sys.argv = ["convert_hf_to_gguf.py", job["dir"], "--outfile", job["out"], "--outtype", job["outtype"]]
        t = time.time()
        try:
            conv.main()
            job["error"] = None
        except BaseException as e:      # noqa: BLE001  (SystemExit included: a refusal is a result)
            job["error"] = f"{type(e).__name__}: {e}"
        job["seconds"] = round(time.time() - t, 1)
    with open(jobs_path, "w") as f:
        json.dump(jobs, f)


def llamacpp_worker(jobs_path: str) -> None:
    """llama.cpp's logits for each job's ids (every position, f32 KV cache) and its tokenization of TEXTS
    (parse_special, no BOS; and with BOS as the vocabulary asks)."""
    sys.path.insert(0, SDIST)
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama
    with open(jobs_path) as f:
        jobs = json.load(f)
    for job in jobs:
        try:
            llm = Llama(job["gguf"], n_ctx=64, n_batch=64, n_ubatch=64, n_threads=1, logits_all=True,
                        type_k=0, type_v=0, verbose=False, seed=0, vocab_only=not job["ids"],
                        flash_attn=job.get("flash_attn", False))
            if job["ids"]:
                llm.eval(job["ids"])
                job["logits"] = np.asarray(llm.scores[:len(job["ids"])], dtype=np.float32).tolist()
            job["tokens"] = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in TEXTS]
            job["tokens_bos"] = [llm.tokenize(t.encode(), add_bos=True, special=True) for t in TEXTS[:3]]
            vocab = llama_cpp.llama_model_get_vocab(llm.model)
            job["eog"] = [i for i in range(llama_cpp.llama_vocab_n_tokens(vocab))
                          if llama_cpp.llama_vocab_is_eog(vocab, i)]
            job["error"] = None
            del llm
        except Exception as e:      # noqa: BLE001
            job["error"] = f"{type(e).__name__}: {e}"
    with open(jobs_path, "w") as f:
        json.dump(jobs, f)


def _run_worker(python: str, mode: str, jobs: list[dict], env: dict[str, str], timeout: int) -> list[dict]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(jobs, f)
    try:
        p = subprocess.run([python, os.path.abspath(__file__), mode, f.name], env=env, timeout=timeout,
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{mode} worker failed ({p.returncode}):\n{p.stderr[-3000:]}")
        with open(f.name) as g:
            return json.load(g)
    finally:
        os.unlink(f.name)


# ---- checkpoints with tokenizers ---------------------------------------------------------------------


def _hf_checkpoint(fixture: str, path: str) -> str:
    from conftest import TINY_CONFIGS, make_tiny_checkpoint
    from family_fixtures import FAMILIES, make_family_checkpoint
    if fixture in FAMILIES:
        return make_family_checkpoint(fixture, path)
    if fixture.startswith("kimi:"):
        from kimi_fixtures import as_original_checkpoint, make_kimi
        return as_original_checkpoint(make_kimi(path, fixture.removeprefix("kimi:")))
    if fixture == "minimax_m2:":
        from minimax_m2_fixtures import make_minimax_m2
        return make_minimax_m2(path)
    if fixture == "minimax_m3:":
        import shutil

        from minimax_fixtures import as_original_checkpoint, make_minimax_exact
        make_minimax_exact(reference_dir(fixture, path), vocab_size=320)
        return as_original_checkpoint(shutil.copytree(reference_dir(fixture, path), path))
    assert fixture in TINY_CONFIGS, fixture
    return make_tiny_checkpoint(fixture, path)


def reference_dir(fixture: str, path: str) -> str:
    """The HF directory transformers reads for the case at `path` (MiniMax-M3: a copy in its format)."""
    return path + ".transformers" if fixture == "minimax_m3:" else path


def _write_bpe_tokenizer(path: str, pre: str, vocab_size: int) -> None:
    """A byte-level BPE trained here, split as llama.cpp splits for `pre` (the family's real regexes)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from sparkserve.frontend.gguf_tokenizer import _PRE
    spec = _PRE[pre]
    tok = Tokenizer(models.BPE(ignore_merges=spec.ignore_merges))
    if spec.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 16, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAIN, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                            add_bos_token=spec.add_bos).save_pretrained(path)
    _set_config_ids(path, bos=SPECIALS.index("<|endoftext|>"), eos=SPECIALS.index("<|im_end|>"))


def _write_spm_tokenizer(path: str, kind: str, vocab_size: int) -> None:
    """A SentencePiece BPE model with byte fallback (tokenizer.model), Llama's ids (<unk> <s> </s>) or
    Gemma's (<pad> <eos> <bos> <unk>), and the family's turn markers (user-defined pieces)."""
    gemma = kind == "gemma-spm"
    import sentencepiece as spm
    prefix = os.path.join(path, "tokenizer")
    ids = (dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                bos_piece="<bos>") if gemma else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1))
    user = {"gemma-spm": ["<start_of_turn>", "<end_of_turn>"], "spm": ["<|im_start|>", "<|im_end|>"],
            "phi3-spm": ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"]}[kind]
    # 256 byte pieces leave little room in a 320-token vocabulary: pieces of a small alphabet
    train = ["".join(c for c in t.lower() if c in _SPM_ALPHABET) for t in TRAIN]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(train), model_prefix=prefix, model_type="bpe",
                                   vocab_size=vocab_size - 4, byte_fallback=True, character_coverage=1.0,
                                   hard_vocab_limit=False, user_defined_symbols=user, add_dummy_prefix=True,
                                   remove_extra_whitespaces=False, split_digits=gemma, minloglevel=2, **ids)
    cfg = ({"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
            "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True} if gemma else
           {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "add_bos_token": True, "legacy": False})
    # the turn markers as the models' tokenizer_config lists them (special: the converter types them CONTROL)
    cfg["added_tokens_decoder"] = {str(4 + i if gemma else 3 + i): {"content": t, "special": True}
                                   for i, t in enumerate(user)}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    _set_config_ids(path, bos=2 if gemma else 1, eos=1 if gemma else 2)


def _set_config_ids(path: str, bos: int, eos: int) -> None:
    """config.json's bos/eos ids, as the models ship them (the converter writes them from there)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(bos_token_id=bos, eos_token_id=eos)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def make_case(fixture: str, tokenizer: str, path: str) -> str:
    _hf_checkpoint(fixture, path)
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    if tokenizer.endswith("spm"):
        _write_spm_tokenizer(path, tokenizer, vocab)
    else:
        _write_bpe_tokenizer(path, tokenizer, vocab)
    return path


# ---- the three comparisons ---------------------------------------------------------------------------


def sparkserve_logits(path: str, ids: list[int]):
    """Every position's logits from sparkserve on `path` (fp32 activations, fp32 KV), one prefill."""
    import torch

    from sparkserve.core.forward_batch import ForwardMode
    from sparkserve.executor.model_runner import ModelRunner, ScheduledReq
    from sparkserve.mem.cache_manager import KVCacheManager
    from sparkserve.models.registry import load_config, load_model
    cfg = load_config(path)
    model = load_model(path, cfg, activation_quant="none")
    n = len(ids)
    cache = KVCacheManager(64, 1, 2, 65, disable_radix_cache=True)
    runner = ModelRunner(model, model.make_pool(64, 2), cache.req_to_token.table)
    row = cache.req_to_token.alloc()
    slots = cache.allocator.alloc(0, n, 0)
    cache.req_to_token.table[row, :n] = slots
    with torch.no_grad():
        fb = runner.build_batch(ForwardMode.EXTEND, [ScheduledReq(row, 0, ids, slots, n)])
        fb.logits_rows = torch.arange(fb.num_tokens)
        return runner.forward(fb).float()


def hf_logits(path: str, ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _diff(a, b) -> dict:
    """max |a - b|, relative to b's largest |logit|, and how many positions agree on the top token."""
    import torch
    b = torch.as_tensor(b, dtype=torch.float32)
    d = (a - b).abs().max().item()
    return {"max_abs": round(d, 6), "rel": round(d / max(1e-6, b.abs().max().item()), 6),
            "top1": f"{int((a.argmax(-1) == b.argmax(-1)).sum())}/{len(b)}"}


def _tokenizer_report(gguf_path: str, hf_dir: str | None, cpp: dict) -> dict:
    """sparkserve's GGUF tokenizer vs llama.cpp's tokenization (and the HF tokenizer's, for reference)."""
    from transformers import AutoTokenizer

    from sparkserve.frontend.tokenizer import load_tokenizer
    ours = load_tokenizer(gguf_path)
    mine = [ours.encode(t) for t in TEXTS]
    mine_bos = [ours.encode(t, add_special_tokens=True) for t in TEXTS[:3]]
    bad = [TEXTS[i] for i, (a, b) in enumerate(zip(mine, cpp["tokens"])) if a != b]
    bad += [f"(BOS) {TEXTS[i]}" for i, (a, b) in enumerate(zip(mine_bos, cpp["tokens_bos"])) if a != b]
    if ours.eos_token_ids != set(cpp["eog"]):
        bad.append(f"stop ids {sorted(ours.eos_token_ids)} vs llama.cpp's end-of-generation {cpp['eog']}")
    try:
        if hf_dir is None:
            raise FileNotFoundError("no HF directory")
        hf = AutoTokenizer.from_pretrained(hf_dir)
        hf_agree = sum(hf.encode(t, add_special_tokens=False) == c for t, c in zip(TEXTS, cpp["tokens"]))
        hf_note = f"{hf_agree}/{len(TEXTS)}"
    except Exception as e:      # noqa: BLE001  (the reference only)
        hf_note = f"n/a ({type(e).__name__})"
    return {"agree": f"{len(TEXTS) + 4 - len(bad)}/{len(TEXTS) + 4}", "differ": bad,
            "hf_vs_llamacpp": hf_note,
            "first_diff": None if not bad else _first_diff(ours, mine, mine_bos, cpp)}


def _first_diff(ours, mine, mine_bos, cpp) -> dict:
    for i, (a, b) in enumerate(zip(mine, cpp["tokens"])):
        if a != b:
            return {"text": TEXTS[i], "sparkserve": [ours.id_to_token(t) for t in a],
                    "llama.cpp": [ours.id_to_token(t) for t in b]}
    for i, (a, b) in enumerate(zip(mine_bos, cpp["tokens_bos"])):
        if a != b:
            return {"text": "(BOS) " + TEXTS[i], "sparkserve": a, "llama.cpp": b}
    return {}


def fixture_vs_converter(fixture: str, hf_dir: str, converted: str, outtype: str) -> str:
    """tests/family_fixtures.py write_gguf's file vs the converter's: metadata outside tokenizer.* /
    general.*, and every tensor's name, type, shape and values. "equal", or the differences."""
    import gguf
    import numpy as np
    from family_fixtures import FAMILIES, write_gguf

    from sparkserve.loader.gguf_file import GGUFFile
    ours = fixture in FAMILIES or fixture.startswith(("kimi:", "minimax_m2:", "minimax_m3:"))
    if not ours or outtype not in OUTTYPES:
        # (llama-quantize's files: no fixture)
        return "-"
    mine = converted.replace(".gguf", ".fixture.gguf")
    write_gguf(hf_dir, mine, outtype)
    a, b = GGUFFile(converted), GGUFFile(mine)
    skip = ("tokenizer.", "general.", "GGUF.")
    ka = {k: v for k, v in a.metadata.items() if not k.startswith(skip)}
    kb = {k: v for k, v in b.metadata.items() if not k.startswith(skip)}
    out = [f"{k}: converter {ka.get(k, '-')!r}, fixture {kb.get(k, '-')!r}" for k in sorted(set(ka) | set(kb))
           if not (isinstance(ka.get(k), float) and isinstance(kb.get(k), float)
                   and abs(ka[k] - kb[k]) <= 1e-6 * max(1.0, abs(ka[k]))) and ka.get(k) != kb.get(k)]
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    for name in sorted(set(ta) | set(tb)):
        x, y = ta.get(name), tb.get(name)
        if x is None or y is None:
            out.append(f"{name}: only in the {'fixture' if x is None else 'converter'}'s file")
        elif x.tensor_type != y.tensor_type or x.shape != y.shape:
            out.append(f"{name}: converter {x.tensor_type.name} {x.shape}, "
                       f"fixture {y.tensor_type.name} {y.shape}")
        elif not np.array_equal(gguf.quants.dequantize(x.data, x.tensor_type),
                                gguf.quants.dequantize(y.data, y.tensor_type)):
            out.append(f"{name}: values differ")
    return "; ".join(out) if out else "equal"


def _tokenizer_gguf(base: str, out: str, pre: str, vocab: tuple[list[str], list[str]]) -> str:
    """`base`'s metadata (a converted llama file) with another vocabulary and `tokenizer.ggml.pre`, no
    tensors: what llama.cpp loads with vocab_only."""
    import gguf
    reader = gguf.GGUFReader(base)
    w = gguf.GGUFWriter(out, "llama")
    tokens, merges = vocab
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture", "tokenizer.ggml.")):
            continue
        vtype = field.types[0]
        w.add_key_value(field.name, field.contents(), vtype,
                        sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _bpe_vocab(size: int = 1200) -> tuple[list[str], list[str]]:
    """A byte-level BPE trained on TRAIN split as GPT-2 does (every pre-tokenizer then runs its own
    splits over the same merges)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TRAIN * 3, trainers.BpeTrainer(
        vocab_size=size, min_frequency=1, show_progress=False, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    return tokens, [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]


def pre_tokenizer_sweep(base: str, work: str) -> list[dict]:
    """Every pre-tokenizer sparkserve supports, on one BPE vocabulary: sparkserve's ids vs llama.cpp's."""
    from sparkserve.frontend.gguf_tokenizer import SUPPORTED_PRE
    from sparkserve.frontend.tokenizer import load_tokenizer
    vocab = _bpe_vocab()
    files = {pre: _tokenizer_gguf(base, os.path.join(work, f"pre-{pre}.gguf"), pre, vocab)
             for pre in SUPPORTED_PRE}
    cpp = _run_worker(sys.executable, "--llamacpp", [{"gguf": f, "ids": []} for f in files.values()],
                      _peer_env(), timeout=1800)
    rows = []
    for pre, job in zip(files, cpp):
        if job["error"] is not None:
            rows.append({"pre": pre, "error": job["error"]})
            continue
        ours = load_tokenizer(files[pre])
        bad = [t for t, ids in zip(TEXTS, job["tokens"]) if ours.encode(t) != ids]
        if ours.eos_token_ids != set(job["eog"]):
            bad.append(f"stop ids {sorted(ours.eos_token_ids)} vs {job['eog']}")
        rows.append({"pre": pre, "agree": f"{len(TEXTS) - len(bad)}/{len(TEXTS)}", "differ": bad,
                     "llamacpp": json.dumps(job["tokens"])})
    return rows


def _peer_env() -> dict[str, str]:
    """The bindings' process environment: llama-cpp-python loads libllama from LLAMA_CPP_LIB_PATH."""
    from peers.llamacpp import lib_dir
    from results_io import peer_env
    lib = lib_dir()
    if lib is None:
        raise RuntimeError("llama.cpp's shared libraries (libllama.so) not found: set LLAMA_CPP_LIB_PATH to "
                           "a shared-library build's bin/ directory")
    return peer_env(LLAMA_CPP_LIB_PATH=str(lib))


def quantize(job: dict, qtype: str) -> dict:
    """The converter's f32 file re-quantized by llama.cpp's llama-quantize (its mix for `qtype`; rows too
    narrow for a K-quant fall back to the types llama.cpp picks)."""
    from peers.llamacpp import tool
    from results_io import peer_env
    out = job["out"].replace(".f32.gguf", f".{qtype.lower()}.gguf")
    r = subprocess.run([str(tool("llama-quantize")), job["out"], out, qtype], capture_output=True,
                       text=True, env=peer_env(), timeout=600)
    return dict(job, out=out, outtype=f"{qtype} (llama-quantize)",
                error=None if r.returncode == 0 else "llama-quantize: " + " | ".join(
                    line for line in (r.stdout + r.stderr).splitlines() if "failed to quantize:" in line))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated families (CASES keys)")
    ap.add_argument("--keep", help="keep the checkpoints and GGUFs in this directory")
    ap.add_argument("--merge", action="store_true", help="with --only: replace those families' rows in the "
                    "last results, keep the rest (and its tokenizer sweeps) as they are")
    a = ap.parse_args()
    import torch
    from results_io import machine_line, write_results
    torch.set_num_threads(1)
    cases = {k: v for k, v in CASES.items() if not a.only or k in a.only.split(",")}
    work = a.keep or tempfile.mkdtemp(prefix="gguf_conformance_")
    os.makedirs(work, exist_ok=True)
    jobs, dirs = [], {}
    for name, (fixture, tok) in cases.items():
        slug = name.split(" ")[0] + "_" + fixture
        dirs[name] = make_case(fixture, tok, os.path.join(work, slug))
        pre = "llama-bpe" if tok.endswith("spm") else tok     # unused for SentencePiece vocabularies
        jobs += [{"case": name, "dir": dirs[name], "out": os.path.join(work, f"{slug}.{o}.gguf"),
                  "outtype": o, "pre": pre} for o in OUTTYPES]
    t = time.time()
    converted = _run_worker(CONVERTER_PYTHON, "--convert", jobs, dict(os.environ), timeout=3600)
    print(f"converted {len(jobs)} files in {time.time() - t:.0f} s", file=sys.stderr)
    converted += [quantize(job, QUANTIZED) for job in list(converted)
                  if job["outtype"] == "f32" and job["error"] is None]
    gen = torch.Generator().manual_seed(0)
    rows, cpp_jobs = [], []
    for job in converted:
        with open(os.path.join(job["dir"], "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        job["ids"] = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist()
        if job["error"] is None:
            cpp_jobs.append({"gguf": job["out"], "ids": job["ids"],
                             "flash_attn": job["case"] == "minimax-m3"})
    cpp_out = _run_worker(sys.executable, "--llamacpp", cpp_jobs, _peer_env(), timeout=3600)
    cpp = {j["gguf"]: j for j in cpp_out}
    for job in converted:
        row = {"family": job["case"], "outtype": job["outtype"], "convert_error": job["error"]}
        rows.append(row)
        if job["error"] is not None:
            continue
        row["fixture"] = fixture_vs_converter(cases[job["case"]][0], job["dir"], job["out"], job["outtype"])
        ref = hf_logits(reference_dir(cases[job["case"]][0], job["dir"]), job["ids"])
        try:
            ours = sparkserve_logits(job["out"], job["ids"])
            row["vs_hf"] = _diff(ours, ref)
        except Exception as e:      # noqa: BLE001  (a refusal is a result)
            row["sparkserve_error"] = f"{type(e).__name__}: {e}"
            ours = None
        c = cpp[job["out"]]
        if c["error"] is not None:
            row["llamacpp_error"] = c["error"]
            continue
        row["llamacpp_vs_hf"] = _diff(torch.tensor(c["logits"]), ref)
        if ours is not None:
            row["vs_llamacpp"] = _diff(ours, c["logits"])
        if job["outtype"] == "f32":
            try:
                row["tokenizer"] = _tokenizer_report(job["out"], job["dir"], c)
            except Exception as e:      # noqa: BLE001
                row["tokenizer"] = {"agree": f"error: {type(e).__name__}: {e}"}
        print(json.dumps(row), file=sys.stderr)

    last = None
    if a.merge:
        with open(os.path.join(HERE, "results", "gguf_conformance.json")) as f:
            last = json.load(f)
        order = {name: i for i, name in enumerate(CASES)}
        rows = sorted([r for r in last["rows"] if r["family"] not in cases] + rows,
                      key=lambda r: order.get(r["family"], len(order)))

    def cell(r: dict, key: str) -> str:
        v = r.get(key)
        return "-" if v is None else f"{v['max_abs']:.2g} ({v['rel']:.1e}) {v['top1']}"
    lines = ["# GGUF conformance: llama.cpp's own converter, sparkserve vs transformers vs llama.cpp", "",
             machine_line(), "",
             f"llama.cpp: llama-cpp-python sdist at {SDIST} (vendor/llama.cpp), converter + libllama from "
             f"it. Tiny random checkpoints (tests/family_fixtures.py), {PROMPT_LEN} random token ids, one "
             "prefill; "
             "sparkserve with fp32 activations and KV; llama.cpp with an f32 KV cache, 1 thread.", "",
             "Cells: max |Δlogit| (relative to the reference's largest |logit|) and top-1 agreement over the "
             "positions. Tokenizer: sparkserve's ids equal llama.cpp's (TEXTS, parse_special; +3 with BOS; "
             "+1 sparkserve's stop ids = llama.cpp's end-of-generation set); "
             "HF: the trained HF tokenizer equal to llama.cpp's.", "",
             "| family | outtype | sparkserve vs HF | sparkserve vs llama.cpp | llama.cpp vs HF | tokenizer "
             "(sparkserve = llama.cpp) | HF = llama.cpp | test fixture = converter |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = r.get("convert_error") or r.get("sparkserve_error") or r.get("llamacpp_error")
        tok = r.get("tokenizer", {})
        lines.append(f"| {r['family']} | {r['outtype']} | {cell(r, 'vs_hf')} | {cell(r, 'vs_llamacpp')} | "
                     f"{cell(r, 'llamacpp_vs_hf')} | {tok.get('agree', '')} | "
                     f"{tok.get('hf_vs_llamacpp', '')} | {r.get('fixture', '')} |"
                     + (f" error: {err[:160]}" if err else ""))
    from sparkserve.embedded import default_model_path
    if last is not None:        # the tokenizer sweeps as the last full run wrote them
        with open(os.path.join(HERE, "results", "gguf_conformance.md")) as f:
            text = f.read()
        sweeps = text[text.index("A real converted"):text.index("Notes:")].rstrip("\n").splitlines()
        lines += ["", *sweeps, "", "Notes:", *(f"- {n}" for n in NOTES)]
        write_results("gguf_conformance", dict(last, machine=machine_line(), rows=rows, notes=NOTES), lines)
        return
    real = _run_worker(sys.executable, "--llamacpp", [{"gguf": default_model_path(), "ids": []}], _peer_env(),
                       timeout=600)[0]
    real_row = (_tokenizer_report(default_model_path(), None, real) if real["error"] is None
                else {"agree": real["error"], "differ": []})
    lines += ["", f"A real converted file, the embedded SmolLM2-135M-Instruct GGUF (pre `smollm`): "
              f"{real_row['agree']} {'; '.join(real_row['differ'])[:300]}"]
    base = next((j["out"] for j in converted if j["error"] is None and j["outtype"] == "f32"
                 and cases[j["case"]][1] == "llama-bpe"), None)
    pre_rows = pre_tokenizer_sweep(base, work) if base else []
    ok = [r for r in pre_rows if r.get("agree") and not r["differ"]]
    distinct = len({r["llamacpp"] for r in pre_rows if "llamacpp" in r})
    lines += ["", "Pre-tokenizers (`tokenizer.ggml.pre`), every name sparkserve supports on one byte-level "
              f"BPE vocabulary (vocab-only files, TEXTS): {len(ok)}/{len(pre_rows)} names give llama.cpp's "
              f"ids exactly ({distinct} distinct llama.cpp tokenizations among them)."]
    lines += [f"- {r['pre']}: {r.get('error') or r['agree'] + ' ' + '; '.join(r['differ'])[:200]}"
              for r in pre_rows if r not in ok]
    lines += ["", "Notes:", *(f"- {n}" for n in NOTES)]
    for r in pre_rows:
        r.pop("llamacpp", None)
    write_results("gguf_conformance", {"machine": machine_line(), "rows": rows, "pre_tokenizers": pre_rows,
                                       "smollm2_tokenizer": real_row, "notes": NOTES}, lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--convert":
        convert_worker(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "--llamacpp":
        llamacpp_worker(sys.argv[2])
    else:
        sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]
        main()
