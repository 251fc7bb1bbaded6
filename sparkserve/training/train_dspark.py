"""Train a DSpark draft on a feature cache with DeepSpec's objective.

Per sequence: random anchors a (anchor and next token in the response); block b = [x_a, mask x
(G-1)] at positions a..a+G-1 sees the fused target context at positions < a plus its own block.
Slot k predicts x_{a+k+1}. Markov bias teacher-forced on ground-truth previous tokens.
Loss = 0.1 CE + 0.9 L1(p_draft - p_target) + 1.0 BCE(confidence, 1 - TV), each weighted by
w_k = exp(-k / 4) over the valid prefix of each block and normalised by the summed weights.
Recipe options (TrainConfig): the CE term against the teacher's whole distribution (ce_target
soft, with e.g. ce_weight 1 and a small l1_weight), the confidence BCE on detached inputs
(conf_detach) or down-weighted (conf_weight), the anchors per sequence."""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from sparkserve.layers.block_backed import BlockBacked
from sparkserve.layers.linear import Linear
from sparkserve.models.dspark_draft import DSparkDraft, save_dspark_draft
from sparkserve.training.blocks import BlockSeq, blocks_forward
from sparkserve.training.config import CE_TARGETS, TrainConfig
from sparkserve.training.feature_cache import FeatureCache
from sparkserve.training.ranks import Ranks


def lr_at(step: int, cfg: TrainConfig) -> float:
    warm = max(1, int(cfg.steps * cfg.warmup_frac))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def sample_anchors(seq_len: int, prompt_len: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Anchors a with x_a and x_{a+1} in the response, uniform without replacement. On CPU, from a
    CPU generator: the same anchors whatever device trains on them."""
    lo, hi = max(prompt_len, 1), seq_len - 2
    if hi < lo:
        return torch.empty(0, dtype=torch.long)
    cand = torch.arange(lo, hi + 1)
    return cand[torch.randperm(len(cand), generator=gen)[:n]].sort().values


def walk_anchors(draft: DSparkDraft, tokens: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor,
                 frac: float) -> torch.Tensor:
    """Replace an evenly spread `frac` of the sorted anchors by their greedy walk successors on
    this cached greedy sequence: a + accepted + 1, where serving's next cycle would anchor.
    Successors past the last usable anchor are dropped."""
    from sparkserve.training.validate import accepted_prefix
    n = int(round(len(anchors) * frac))
    if n == 0:
        return anchors
    pick = torch.zeros(len(anchors), dtype=torch.bool, device=anchors.device)
    pick[torch.linspace(0, len(anchors) - 1, n, device=anchors.device).round().long()] = True
    seeds = anchors[pick]
    nxt = seeds + accepted_prefix(draft, tokens, taps, seeds) + 1
    return torch.cat([anchors[~pick], nxt[nxt <= len(tokens) - 2]]).sort().values


@dataclass
class Teacher:
    """The target's distribution restricted to a reduced draft vocab: LM-head rows of the draft
    ids and a dense target->draft id map (-1 = not in the draft vocab). The per-token
    log-normaliser over the full vocab comes from the feature cache (lse.npy). Both on the draft's
    device; the target's whole head stays where it is (only the draft vocab's rows move)."""
    head_rows: torch.Tensor
    t2d: torch.Tensor

    @classmethod
    def for_draft(cls, draft: DSparkDraft, target_head: torch.Tensor) -> "Teacher":
        dev = draft.d2t.device
        ids = draft.to_target_ids(torch.arange(draft.config.out_vocab, device=dev))
        t2d = torch.full((draft.config.vocab_size,), -1, dtype=torch.long, device=dev)
        t2d[ids] = torch.arange(len(ids), device=dev)
        return cls(target_head[ids.to(target_head.device)].detach().float().to(dev), t2d)


def block_forward(draft: DSparkDraft, tokens: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor,
                  dropout: float = 0.0, dense: bool = True):
    """blocks_forward for one sequence: (h [A*G, d], logits [A*G, V_draft], Markov embeddings
    [A*G, r], valid [A, G], target positions [A*G])."""
    return blocks_forward(draft, [BlockSeq(tokens, taps, anchors)], dropout, dense)


def consistent_slots(tokens: torch.Tensor, greedy: torch.Tensor, anchors: torch.Tensor,
                     G: int) -> torch.Tensor:
    """[A, G]: slot k of the block at anchor a is supervised by prefill labels only while the
    answer's tokens a+1..a+k equal the target's greedy choices there: serving drafts slot k
    after accepted (greedy) tokens, so an answer that left the greedy path conditions the later
    slots on a context serving never has."""
    S, dev = tokens.shape[0], tokens.device
    pos = (anchors[:, None] + torch.arange(G, device=dev)[None, :]).clamp(max=S - 2)   # a..a+G-1
    agree = tokens[pos + 1] == greedy[pos]                                    # x_{p+1} is greedy
    before = torch.cat([torch.ones(len(anchors), 1, dtype=torch.long, device=dev), agree[:, :-1].long()], 1)
    return torch.cumprod(before, 1).bool()


def block_losses(draft: DSparkDraft, tokens: torch.Tensor, taps: torch.Tensor, final: torch.Tensor,
                 anchors: torch.Tensor, cfg: TrainConfig, teacher: Teacher | None = None,
                 lse: torch.Tensor | None = None,
                 greedy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """blocks_losses for one sequence."""
    return blocks_losses(draft, [BlockSeq(tokens, taps, anchors, final, lse, greedy)], cfg, teacher)


def blocks_losses(draft: DSparkDraft, seqs: list[BlockSeq], cfg: TrainConfig,
                  teacher: Teacher | None = None) -> dict[str, torch.Tensor]:
    """Weighted loss sums and weight sum of the blocks of these sequences, in one forward
    (training/blocks.py). A sequence with `greedy` (the target's argmax after each position, from a
    prefill over an answer it did not write) has slot k learn the target's greedy token, where
    consistent_slots allows."""
    G, A = draft.block_size, sum(s.anchors.shape[0] for s in seqs)
    dev = seqs[0].tokens.device
    k = torch.arange(G, device=dev)
    h, logits, emb, valid, safe_tgt = blocks_forward(draft, seqs, cfg.dropout, not cfg.block_attention)
    tokens = torch.cat([s.tokens for s in seqs])
    # labels: the answer's next token, or the target's greedy one for prefill-labelled sequences
    greedy = torch.cat([s.tokens if s.greedy is None else s.greedy for s in seqs])
    from_greedy = torch.cat([torch.full_like(s.tokens, s.greedy is not None, dtype=torch.bool) for s in seqs])
    parts, a0 = [], 0
    for s in seqs:
        n = s.anchors.shape[0]
        part = valid[a0:a0 + n]
        parts.append(part if s.greedy is None else part & consistent_slots(s.tokens, s.greedy, s.anchors, G))
        a0 += n
    valid = torch.cat(parts)
    logp_d = F.log_softmax(logits.float(), -1)
    with torch.no_grad():     # target dist. of x_{a+k+1}, once per position (blocks overlap)
        rows, inv = torch.unique(safe_tgt - 1, return_inverse=True)
        p_t, outside = teacher_probs(draft, seqs, rows, teacher)
        p_t, outside = p_t[inv], outside[inv]
    p_d = logp_d.exp()
    l1 = (p_d - p_t).abs().sum(-1) + outside       # teacher mass outside the draft vocab counts fully
    if cfg.ce_target == "soft":
        ce = soft_cross_entropy(logp_d, p_t)
    else:
        labels = torch.where(from_greedy[safe_tgt], greedy[safe_tgt - 1], tokens[safe_tgt])
        tgt = labels if teacher is None else teacher.t2d[labels]
        ce = F.nll_loss(logp_d, tgt.clamp_min(0), reduction="none") * (tgt >= 0)
    w = (torch.exp(-k.float() / cfg.decay_gamma)[None, :] * valid).reshape(-1)
    out = {"ce": (ce * w).sum(), "l1": (l1 * w).sum(), "wsum": w.sum()}
    c_star = (1 - 0.5 * l1.detach()).clamp(0, 1)
    if draft.confidence_head is not None:
        head = draft.confidence_head
        feats = torch.cat([h, emb], -1) if head.with_markov else h
        if cfg.conf_detach:
            feats = feats.detach()
        conf_logit = head.proj(feats).squeeze(-1).float()
        bce = F.binary_cross_entropy_with_logits(conf_logit, c_star, reduction="none")
        out["conf"] = (bce * w).sum()
    # training-time acceptance estimate: tau = 1 + sum_k prod_{i<=k} c*_i (valid prefix only)
    surv = torch.cumprod((c_star * valid.reshape(-1)).view(A, G), dim=1)
    out["tau_sum"] = (1 + surv.sum(1)).sum().detach()
    out["blocks"] = torch.tensor(float(A), device=dev)
    return out


def teacher_probs(draft: DSparkDraft, seqs: list[BlockSeq], rows: torch.Tensor,
                  teacher: Teacher | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(p_t [R, V_draft], teacher mass outside the draft vocab [R]) at `rows` of the sequences
    laid end to end: from a sequence's final rows (the full softmax through the draft's head, or
    the target's rows of the draft vocab with its lse) or from its top-k log-probs (int8 cache:
    the mass beyond the top k counts as outside)."""
    V = draft.config.out_vocab
    p_t = torch.zeros(len(rows), V, device=rows.device)
    outside = torch.zeros(len(rows), device=rows.device)
    start = 0
    for s in seqs:
        mine = (rows >= start) & (rows < start + len(s.tokens))
        r = rows[mine] - start
        start += len(s.tokens)
        if len(r) == 0:
            continue
        if s.topk is not None:
            ids, logp = s.topk[0][r], s.topk[1][r]
            d = ids if teacher is None else teacher.t2d[ids]
            p = torch.exp(logp) * (d >= 0)
            p_t[mine] = torch.zeros(len(r), V, device=rows.device).scatter_add_(1, d.clamp_min(0), p)
            outside[mine] = (1 - p_t[mine].sum(-1)).clamp_min(0)
        elif teacher is None:
            p_t[mine] = F.softmax(draft.lm_head(s.final[r]).float(), -1)
        else:
            p_t[mine] = torch.exp(s.final[r] @ teacher.head_rows.T - s.lse[r, None])
            outside[mine] = (1 - p_t[mine].sum(-1)).clamp_min(0)
    return p_t, outside


def soft_cross_entropy(logp_d: torch.Tensor, p_t: torch.Tensor) -> torch.Tensor:
    """-sum_v p_t(v) log p_d(v) per row: the cross-entropy against the teacher's distribution over
    the draft's vocab (teacher mass outside it has no draft row to learn; a hard label outside it
    is masked the same way). Equals the hard CE of a one-hot teacher."""
    return -(p_t * logp_d).sum(-1)


def _optimizer(draft: DSparkDraft, cfg: TrainConfig) -> tuple[list[torch.Tensor], torch.optim.AdamW]:
    """AdamW over the trainable weights; the final norm at its own rate multiple."""
    # Inference layers (Linear) are made with requires_grad=False: switch everything on first,
    # then freeze what is shared with the target.
    draft.requires_grad_(True)
    frozen = ("embed_tokens",) if draft.d2t is not None and cfg.train_lm_head else ("embed_tokens", "lm_head")
    for name in frozen:
        getattr(draft, name).requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    norm_w = draft.norm.weight
    groups = [{"params": [p for p in params if p is not norm_w], "mult": 1.0},
              {"params": [norm_w], "mult": cfg.final_norm_lr_mult}]
    return params, torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _resume(draft: DSparkDraft, opt: torch.optim.Optimizer, out_dir: str) -> tuple[int, dict]:
    """(step, best validation) from out_dir/train_state.pt, the weights and optimizer loaded. The
    data order and anchors follow from the step (sample_seed), so any number of ranks resumes.
    Read to CPU (as written): the weights are copied into the draft on its device, and AdamW moves
    its moments to their weights' device while keeping `step` on CPU, as a fresh AdamW has it; so a
    run resumes on either device."""
    best = {"tau": 0.0, "step": 0, "last": 0.0}
    state_path = os.path.join(out_dir, "train_state.pt")
    if not os.path.exists(state_path):
        return 0, best
    st = torch.load(state_path, map_location="cpu", weights_only=False)
    draft.load_state_dict(st["model"], strict=False)
    try:
        opt.load_state_dict(st["opt"])
    except ValueError:     # another set of trainable weights (train_lm_head changed)
        print("train draft: the saved optimizer state is for other trainable weights; "
              "resuming the weights with fresh AdamW moments")
    return st["step"], st.get("best", best)


def sample_seed(seed: int, sample: int) -> int:
    """The anchor RNG seed of the sample-th sequence drawn (counted over the whole run): anchors
    depend on the run's seed and position only, not on which rank draws them or on a resume."""
    return seed * 1_000_003 + sample


def _step_sums(draft: DSparkDraft, cache, order: torch.Tensor, first: int, mine: range,
               cfg: TrainConfig, teacher: Teacher | None, device: torch.device) -> dict[str, torch.Tensor]:
    """Loss sums of this rank's sequences (`mine`: positions within the global batch that
    starts at sample `first`) in one forward, each sequence's features moved to `device` as it is
    read."""
    seqs: list[BlockSeq] = []
    for j in mine:
        sample = first + j
        i = int(order[sample % len(cache)])
        tokens, taps, final, plen = cache.sequence(i)
        gen = torch.Generator().manual_seed(sample_seed(cfg.seed, sample))
        anchors = sample_anchors(len(tokens), plen, cfg.anchors_per_seq, gen)
        if len(anchors) == 0:
            continue
        topk = cache.sequence_topk(i)        # an int8 cache's teacher (then no final rows)
        tokens, taps, anchors = (t.to(device) for t in (tokens, taps, anchors))
        final = final.to(device) if final is not None else None
        topk = tuple(t.to(device) for t in topk) if topk is not None else None
        if cfg.walk_anchor_frac > 0:
            anchors = walk_anchors(draft, tokens, taps, anchors, cfg.walk_anchor_frac)
            if len(anchors) == 0:
                continue
        lse = cache.sequence_lse(i).to(device) if teacher is not None and topk is None else None
        greedy = cache.sequence_greedy(i).to(device) if cache.prefill_labelled(i) else None
        seqs.append(BlockSeq(tokens, taps, anchors, final, lse, greedy, topk))
    return blocks_losses(draft, seqs, cfg, teacher) if seqs else {}


def train(draft: DSparkDraft, cache: FeatureCache, out_dir: str, cfg: TrainConfig,
          log_every: int = 10, target_head: torch.Tensor | None = None,
          val_cache: FeatureCache | None = None, ranks: Ranks = Ranks(),
          device: torch.device | str | None = None) -> dict:
    """Resumable: picks up train_state.pt in out_dir. Returns the last logged metrics.
    A reduced-vocab draft needs the target's LM head weight and a cache with lse.npy; its LM
    head (the target's rows of its vocab) is trained only with cfg.train_lm_head.

    Data parallel over `ranks`: a step's cfg.seqs_per_step sequences (the global batch) are
    dealt round-robin to the ranks, each rank's loss is scaled so that the averaged gradient is
    the one-rank gradient of the whole batch, and rank 0 alone logs, validates and saves.

    On `device` (default: the ranks' own, where their process group reduces): the draft (left
    there), its AdamW moments and the teacher's rows move there, each sequence's features as it is
    read. Checkpoints hold CPU tensors, so a run resumes on either device."""
    device = _check_inputs(draft, cache, cfg, target_head, ranks, device)
    os.makedirs(out_dir, exist_ok=True)
    draft_to(draft, device)
    params, opt = _optimizer(draft, cfg)
    step, best = _resume(draft, opt, out_dir)
    ranks.broadcast_([p.data for p in params])
    # After the resume: a checkpoint brings its own draft vocab (d2t), which may differ from the
    # one this cache would select (more data since), and the teacher must score that one.
    teacher = Teacher.for_draft(draft, target_head) if draft.d2t is not None else None
    order = torch.randperm(len(cache), generator=torch.Generator().manual_seed(cfg.seed))
    mine = range(ranks.rank, cfg.seqs_per_step, ranks.world)
    keys = ("wsum", "ce", "l1", "conf", "tau_sum", "blocks")
    metrics: dict = {}
    last = cfg.steps if cfg.stop_after is None else min(cfg.stop_after, cfg.steps)
    draft.train()
    with tqdm(total=cfg.steps, initial=step, desc="train draft", unit="step",
              disable=not ranks.is_main) as bar:
        while step < last:
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg) * g["mult"]
            acc = _step_sums(draft, cache, order, step * cfg.seqs_per_step, mine, cfg, teacher, device)
            total = ranks.sum_(torch.stack([torch.as_tensor(acc.get(k, 0.0), dtype=torch.float32,
                                                            device=device).detach() for k in keys]))
            glob = dict(zip(keys, total))
            if glob["blocks"] == 0:         # no sequence of this batch had an anchor on any rank
                step += 1
                continue
            wsum = glob["wsum"].clamp_min(1e-6)
            local = sum(w * acc[k] for k, w in (("ce", cfg.ce_weight), ("l1", cfg.l1_weight),
                                                ("conf", cfg.conf_weight)) if k in acc)
            if not acc:                     # nothing here: a zero gradient joins the average
                local = sum(p.sum() for p in params) * 0.0
            opt.zero_grad(set_to_none=True)
            (local * ranks.world / wsum).backward()
            ranks.average_grads(params)
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            opt.step()
            step += 1
            loss = (cfg.ce_weight * glob["ce"] + cfg.l1_weight * glob["l1"]
                    + cfg.conf_weight * glob["conf"]) / wsum
            metrics = {"step": step, "loss": loss.item(), "ce": (glob["ce"] / wsum).item(),
                       "l1": (glob["l1"] / wsum).item(), "tau_est": (glob["tau_sum"] / glob["blocks"]).item(),
                       "lr": lr_at(step - 1, cfg), "blocks": int(glob["blocks"])}
            bar.update(1)
            if ranks.is_main and step % log_every == 0:
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics['tau_est']:.2f}")
                with open(os.path.join(out_dir, "train_log.jsonl"), "a") as f:
                    f.write(json.dumps(metrics) + "\n")
            at_end = step == cfg.steps
            if (ranks.is_main and val_cache is not None and cfg.val_every
                    and (step % cfg.val_every == 0 or at_end)):
                best = validate_step(draft, val_cache, cfg, step, out_dir, best)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", val_tau=f"{best['last']:.3f}")
            if ranks.is_main and (step % cfg.save_every == 0 or at_end or step == last):
                save_checkpoint(draft, opt, step, out_dir, cfg, best)
    ranks.barrier()              # the last checkpoint is written before any rank goes on
    draft.eval()
    return metrics


def _check_inputs(draft: DSparkDraft, cache: FeatureCache, cfg: TrainConfig, target_head: torch.Tensor | None,
                  ranks: Ranks, device: torch.device | str | None) -> torch.device:
    """What train() cannot run with, before it starts; returns the device it trains on (a CUDA one
    with its index, as the ranks and the draft's tensors name it)."""
    if cfg.ce_target not in CE_TARGETS:
        raise ValueError(f"ce_target must be one of {', '.join(CE_TARGETS)}, got {cfg.ce_target!r}")
    if not 0 <= cfg.walk_anchor_frac <= 1:
        raise ValueError(f"walk_anchor_frac must be within [0, 1], got {cfg.walk_anchor_frac}")
    if draft.d2t is not None and (target_head is None or not cache.has_teacher()):
        raise ValueError("a reduced-vocab draft trains against the target's LM head and the "
                         "cache's lse.npy (feature_cache.write_lse), or an int8 cache's top-k teacher")
    if cache.any_prefill_labelled() and cache.greedy is None:
        raise ValueError("prefill-labelled sequences train on the target's greedy choices: the cache "
                         "needs greedy.npy (feature_cache.write_lse)")
    device = torch.device(ranks.device if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if ranks.group and device != ranks.device:
        raise ValueError(f"training on {device}: the ranks' process group reduces on {ranks.device}")
    return device


def validate_step(draft: DSparkDraft, val_cache: FeatureCache, cfg: TrainConfig, step: int,
                  out_dir: str, best: dict) -> dict:
    """Log the held-out greedy tau; keep the best draft in DIR/best (early stopping: on small
    data the held-out tau peaks long before the training loss stops falling)."""
    from sparkserve.training.validate import greedy_acceptance, slot1_accuracy
    res = greedy_acceptance(draft, val_cache, max_seqs=cfg.val_seqs)
    quick = slot1_accuracy(draft, val_cache, positions=cfg.val_positions) if cfg.val_positions else {}
    best = {**best, "last": res["tau"]}
    if res["tau"] > best["tau"]:
        best.update(tau=res["tau"], step=step)
        save_dspark_draft(draft, os.path.join(out_dir, "best"), include_shared=False)
    row = {"step": step, "val_tau": res["tau"], "val_slot_accept": res["slot_accept"], **quick,
           "best_val_tau": best["tau"], "best_step": best["step"]}
    print("validation: " + " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                    for k, v in row.items() if k != "val_slot_accept"), flush=True)
    with open(os.path.join(out_dir, "train_log.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    return best


def save_checkpoint(draft, opt, step, out_dir, cfg, best=None) -> None:
    """train_state.pt with CPU tensors (a CUDA run's checkpoint loads where no GPU is) and the
    draft's safetensors (which hold no device)."""
    # re-made from the target
    shared = ("embed_tokens",) if draft.d2t is not None else ("embed_tokens", "lm_head")
    trainable = {k: v for k, v in draft.state_dict().items() if not k.startswith(shared)}
    torch.save(_on_cpu({"model": trainable, "opt": opt.state_dict(), "step": step,
                        "config": asdict(cfg), "best": best}), os.path.join(out_dir, "train_state.pt"))
    save_dspark_draft(draft, out_dir, include_shared=False)


def _on_cpu(x):
    """x with every tensor inside (dicts, lists, tuples) on CPU."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _on_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_on_cpu(v) for v in x)
    return x


def draft_to(draft: DSparkDraft, device: torch.device) -> None:
    """Move the draft to `device`, in place. A module it shares with the target (loading
    --init-draft shares the embedding and LM head) and that is not on `device` is first replaced
    by a frozen fp32 copy, so the move leaves the target where it runs."""
    for name in sorted(draft.shared_with_target):
        mod = getattr(draft, name)
        if mod.weight.device == device:
            continue
        w = (mod.dense_weight() if isinstance(mod, BlockBacked) else mod.weight).detach().float().clone()
        if name == "embed_tokens":
            own = torch.nn.Embedding.from_pretrained(w, freeze=True)
        else:
            own = Linear(w.shape[1], w.shape[0])
            own.weight.data = w
        setattr(draft, name, own)
    draft.to(device)
