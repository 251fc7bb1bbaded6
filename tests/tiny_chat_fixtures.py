"""A tiny random Llama that also serves chat: the tiny checkpoint of conftest with a byte-level
tokenizer (one token per byte, no merges) and a ChatML template written next to it, so HTTP tests
can send text, chat and completions to a server that starts in seconds (the embedded SmolLM2 takes
several times longer, which adds up when a test runs two or three servers). Every one of the 320
model ids decodes: 256 bytes, the two ChatML markers, and filler tokens for the rest."""
from __future__ import annotations

import json
import os

from conftest import TINY_CONFIGS, make_tiny_checkpoint

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_chat_checkpoint(path: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    make_tiny_checkpoint("llama", path)
    vocab = {c: b for b, c in _bytes_to_unicode().items()}        # token id = the byte
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.add_tokens([f"<x{i}>" for i in range(TINY_CONFIGS["llama"]["vocab_size"] - tok.get_vocab_size())])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>", "add_bos_token": False}, f)
    return path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character of each byte (what byte-level tokenizers store)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}
