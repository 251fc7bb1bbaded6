"""The draft vocab picked on more text than the distillation gives: the distilled answers' token
counts (weighted) plus those of the training conversations' own replies (ShareGPT's assistant
turns, tokenized by the target's tokenizer), whose counts stand in for the target's. On 117k
distilled tokens this raised the held-out coverage of 8,192 ids from ~92 % to ~93.4 %
(docs/draft-training-log.md)."""
from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

import torch


def training_replies(out: str, prompts_file: str | None) -> Iterator[str]:
    """The assistant turns of the training part: ShareGPT's training conversations (held-out ones
    and any that meet them excluded), or those in a prompts file's training lines (OUT/prompts.jsonl)."""
    from sparkserve.training.prompts import jsonl_prompts, sharegpt_training_conversations
    convs = (jsonl_prompts(os.path.join(out, "prompts.jsonl")) if prompts_file
             else sharegpt_training_conversations())
    for c in convs:
        for m in c:
            if m["role"] == "assistant" and m["content"].strip():
                yield m["content"]


def reply_token_counts(texts: Iterable[str], tokenizer, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for text in texts:
        ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocab_counts(out: str, prompts_file: str | None, distilled: torch.Tensor, weight: float,
                       tokenizer) -> torch.Tensor:
    """distilled * weight + the training replies' counts (counted once into OUT/reply_counts.json)."""
    path = os.path.join(out, "reply_counts.json")
    if os.path.exists(path):
        with open(path) as f:
            replies = torch.tensor(json.load(f)["counts"], dtype=torch.long)
    else:
        replies = reply_token_counts(training_replies(out, prompts_file), tokenizer, len(distilled))
        with open(path + ".tmp", "w") as f:
            json.dump({"tokens": int(replies.sum()), "counts": replies.tolist()}, f)
        os.replace(path + ".tmp", path)
    print(f"draft vocab: {int(replies.sum())} tokens of training replies counted beside "
          f"{int(distilled.sum())} distilled ones (x{weight:g})")
    return distilled.double() * weight + replies.double()
