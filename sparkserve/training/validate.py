"""Held-out acceptance of a draft from a feature cache, without running the serving loop.

On a cache distilled at temperature 0 the next token of every response position is the target's
greedy choice, so greedy verification of a block accepts slot k exactly when slots 0..k all
equal the cached tokens (with the Markov bias fed the accepted, i.e. cached, previous tokens).
Replaying serving's walk over these prefixes (first cycle at the first response token, the next
at the bonus token after each accepted prefix) gives the greedy tau that serving would measure
on the same prompts: seconds for hundreds of prompts, against minutes through the engine."""
from __future__ import annotations

import torch

from sparkserve.models.dspark_draft import DSparkDraft
from sparkserve.training.feature_cache import FeatureCache
from sparkserve.training.train_dspark import block_forward


@torch.no_grad()
def accepted_prefix(draft: DSparkDraft, tokens: torch.Tensor, taps: torch.Tensor,
                    anchors: torch.Tensor) -> torch.Tensor:
    """Per anchor: how many drafts greedy verification accepts (the matching prefix of the
    block against the cached next tokens; slots past the sequence end never match)."""
    G = draft.block_size
    _, logits, _, valid, tgt = block_forward(draft, tokens, taps, anchors)
    guess = draft.to_target_ids(logits.argmax(-1)).view(-1, G)
    match = (guess == tokens[tgt].view(-1, G)) & valid
    return torch.cumprod(match.long(), dim=1).sum(1)


@torch.no_grad()
def greedy_acceptance(draft: DSparkDraft, cache: FeatureCache, max_seqs: int | None = None,
                      anchors_per_chunk: int = 64) -> dict:
    """Greedy serving replayed on each cached sequence of length S: a cycle anchored at position
    a accepts the matching prefix of its block, at most S - a - 2 drafts (a request at its token
    limit keeps room for the bonus), and the next cycle is anchored at the bonus token; the
    last token or two are plain decode steps. Returns {"tau": tokens per cycle, bonus included,
    "slot_accept": P(slot k accepted | slots < k accepted), "blocks": cycles, "accept_hist":
    {accepted drafts: cycles}} (the engine's scheduler.accept_hist for the same requests).
    The prefix is computed at every anchor in batches, on the draft's device; the walk then picks
    its anchors (on the host)."""
    G = draft.block_size
    dev = draft.norm.weight.device
    was_training = draft.training
    draft.eval()
    n_walk, v_walk = [], []
    for i in range(len(cache) if max_seqs is None else min(max_seqs, len(cache))):
        tokens, taps, _, plen = cache.sequence(i)
        lo, S = max(plen, 1), len(tokens)
        if S - 2 <= lo:
            continue
        tokens, taps = tokens.to(dev), taps.to(dev)
        n = torch.cat([accepted_prefix(draft, tokens, taps, torch.arange(a, min(a + anchors_per_chunk, S - 2),
                                                                         device=dev))
                       for a in range(lo, S - 2, anchors_per_chunk)]).tolist()
        a = lo
        while a < S - 2:
            room = min(G, S - a - 2)
            acc = min(n[a - lo], room)
            n_walk.append(acc)
            v_walk.append(room)
            a += acc + 1
    draft.train(was_training)
    n, v = torch.tensor(n_walk, dtype=torch.long), torch.tensor(v_walk, dtype=torch.long)
    k = torch.arange(G)[None, :]
    reached = ((n[:, None] >= k) & (k < v[:, None])).sum(0)
    accepted = (n[:, None] > k).sum(0)
    return {"tau": 1 + float(n.float().mean()) if len(n) else 1.0,
            "slot_accept": (accepted / reached.clamp_min(1)).tolist(), "blocks": len(n),
            "accept_hist": {int(c): int((n == c).sum()) for c in n.unique()}}


@torch.no_grad()
def slot1_accuracy(draft: DSparkDraft, cache: FeatureCache, positions: int = 4000, seed: int = 0,
                   anchors_per_chunk: int = 256) -> dict:
    """Quick metrics, steadier than tau on a few sequences: at `positions` response positions
    drawn uniformly (without replacement, fixed seed) from every usable anchor of the cache,
    whether the draft's first slot guesses the cached next token. "slot1_acc": over all of them;
    "slot1_acc_in_vocab": over those whose next token is in the draft vocab (a miss outside it
    no training can fix); "oov": the share outside; "positions": how many were scored."""
    G = draft.block_size
    dev = draft.norm.weight.device
    spans = []
    for i in range(len(cache)):
        toks, plen = cache.token_ids(i)
        lo, hi = max(plen, 1), len(toks) - 2
        if hi >= lo:
            spans.append((i, lo, hi - lo + 1))
    counts = torch.tensor([n for _, _, n in spans] or [0])
    starts = torch.cumsum(counts, 0) - counts
    total = int(counts.sum())
    pick = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:positions].sort().values
    seq_of = torch.searchsorted(starts, pick, right=True) - 1
    vocab = draft.to_target_ids(torch.arange(draft.config.out_vocab, device=dev)).cpu()
    was_training = draft.training
    draft.eval()
    hit, in_vocab = [], []
    for k in seq_of.unique().tolist():
        i, lo, _ = spans[k]
        anchors = (pick[seq_of == k] - starts[k] + lo)
        tokens, taps, _, _ = cache.sequence(i)
        tokens, taps = tokens.to(dev), taps.to(dev)
        for c in range(0, len(anchors), anchors_per_chunk):
            a = anchors[c:c + anchors_per_chunk].to(dev)
            _, logits, _, _, _ = block_forward(draft, tokens, taps, a)
            guess = draft.to_target_ids(logits.view(len(a), G, -1)[:, 0].argmax(-1))
            nxt = tokens[a + 1]
            hit.append((guess == nxt).cpu())
            in_vocab.append(torch.isin(nxt.cpu(), vocab))
    draft.train(was_training)
    hit_t = torch.cat(hit) if hit else torch.zeros(0, dtype=torch.bool)
    inv = torch.cat(in_vocab) if in_vocab else torch.zeros(0, dtype=torch.bool)
    n = len(hit_t)
    return {"slot1_acc": float(hit_t.float().mean()) if n else 0.0,
            "slot1_acc_in_vocab": float(hit_t[inv].float().mean()) if int(inv.sum()) else 0.0,
            "oov": float(1 - inv.float().mean()) if n else 0.0, "positions": n}


def serving_acceptance(engine, cache: FeatureCache, max_seqs: int | None = None) -> dict:
    """The parity check of greedy_acceptance: the same cached sequences served greedily by a
    DSpark `engine` (each prompt, as many new tokens as cached, EOS ignored) give tau, slot-1
    acceptance and the accept histogram as serving measures them. Where they differ from the
    offline walk, training and serving see different drafts (a skew in masks, positions, taps or
    numerics). `same_tokens`: the share of sequences served token for token as cached (below 1 the
    target's greedy answers changed since distillation, and the two walks differ for that reason)."""
    seqs = [cache.token_ids(i) for i in range(len(cache) if max_seqs is None else min(max_seqs, len(cache)))]
    seqs = [(tokens, plen) for tokens, plen in seqs if len(tokens) - 2 > max(plen, 1)]   # the walk's too
    before = dict(engine.scheduler.load().spec_accept_hist)
    outs = engine.generate(input_ids=[tokens[:plen].tolist() for tokens, plen in seqs],
                           sampling_params=[{"temperature": 0, "max_new_tokens": len(tokens) - plen,
                                             "ignore_eos": True} for tokens, plen in seqs])
    after = engine.scheduler.load().spec_accept_hist
    hist = {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v - before.get(k, 0)}
    cycles = sum(hist.values())
    accepted = sum(k * v for k, v in hist.items())
    same = sum(o["output_ids"] == tokens[plen:].tolist() for o, (tokens, plen) in zip(outs, seqs))
    return {"tau": 1 + accepted / max(cycles, 1), "slot1_accept": sum(v for k, v in hist.items() if k > 0)
            / max(cycles, 1), "blocks": cycles, "accept_hist": hist, "same_tokens": same / max(len(seqs), 1)}
