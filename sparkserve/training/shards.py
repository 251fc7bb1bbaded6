"""Distillation split over ranks: each rank writes its contiguous share [a, b) of a part's prompts
to PART/shards/distill-a-b/ (distill.jsonl and features.log, resumable like a one-rank run; named
by the share, so a rerun on another number of ranks never resumes a file made for other prompts),
and rank 0 concatenates the shards in order into PART/distill.jsonl and PART/features.log: the
files one rank would have written, so the feature cache, its sequence order and a resume on any
number of ranks do not depend on N. The feature stage's prefill capture shards the same way."""
from __future__ import annotations

import json
import os
import shutil

from sparkserve.training.ranks import Ranks


def shard_dir(part: str, kind: str, share: range) -> str:
    return os.path.join(part, "shards", f"{kind}-{share.start}-{share.stop}")


def merge_shards(part: str, kind: str, n: int, ranks: Ranks, name: str) -> None:
    """PART/name and PART/features.log from the `kind` shards of n items over `ranks`. A shard's
    log may hold rows past its last line (a batch cut off mid-write); only the rows its lines
    promise move."""
    dirs = [shard_dir(part, kind, Ranks(r, ranks.world).share(n)) for r in range(ranks.world)]
    log = os.path.join(part, "features.log")
    os.makedirs(log, exist_ok=True)
    shutil.copy(os.path.join(dirs[0], "features.log", "meta.json"), os.path.join(log, "meta.json"))
    with open(os.path.join(dirs[0], "features.log", "meta.json")) as f:
        meta = json.load(f)
    widths = {"taps.bin": len(meta["target_layer_ids"]) * meta["hidden_size"] * 2,
              "final.bin": meta["hidden_size"] * 2}
    outs = {b: open(os.path.join(log, b), "wb") for b in widths}
    lines = []
    for d in dirs:
        rows = [line for line in open(os.path.join(d, name)) if line.strip()]
        lines += rows
        n = sum(json.loads(r).get("feature_rows", 0) for r in rows)
        for b, width in widths.items():
            with open(os.path.join(d, "features.log", b), "rb") as src:
                _copy(src, outs[b], n * width)
    for f in outs.values():
        f.close()
    tmp = os.path.join(part, name + ".tmp")
    with open(tmp, "w") as f:         # written last and renamed: its lines promise the rows
        f.writelines(lines)
    os.replace(tmp, os.path.join(part, name))


def _copy(src, dst, nbytes: int, chunk: int = 1 << 24) -> None:
    while nbytes > 0:
        buf = src.read(min(chunk, nbytes))
        if not buf:
            raise ValueError(f"{src.name}: {nbytes} bytes short of what its distill lines promise")
        dst.write(buf)
        nbytes -= len(buf)
