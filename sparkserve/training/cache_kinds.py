"""A run's cached sequences split by what their prompts ask for: chat, or code / maths
(prompts.is_code_or_math), so that one held-out cache reports a tau per kind."""
from __future__ import annotations

import json
import os

from sparkserve.training.feature_cache import FeatureCache
from sparkserve.training.prompts import is_code_or_math, jsonl_prompts


def sequence_prompts(part: str) -> list[list[dict]]:
    """The prompt behind each sequence of part/features, in order: a prompts.jsonl line per
    distilled answer line (two with a second sampled answer) that has output."""
    prompts = jsonl_prompts(os.path.join(part, "prompts.jsonl"))
    with open(os.path.join(part, "distill.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    per = max(len(rows) // max(len(prompts), 1), 1)
    return [prompts[k // per] for k, r in enumerate(rows) if r["output_ids"]]


def kind_subsets(cache: FeatureCache, part: str) -> dict[str, FeatureCache]:
    """{"chat": ..., "code": ...}: the sequences of `cache` (part/features) by their prompt's kind."""
    prompts = sequence_prompts(part)
    if len(prompts) != len(cache):
        raise ValueError(f"{part}: {len(prompts)} distilled answers for {len(cache)} cached sequences")
    code = [i for i, p in enumerate(prompts) if is_code_or_math(p)]
    chat = [i for i, p in enumerate(prompts) if not is_code_or_math(p)]
    return {"chat": cache.subset(chat), "code": cache.subset(code)}
