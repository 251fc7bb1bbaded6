"""`sparkserve train-draft`: prompts -> self-distillation -> feature cache -> training ->
evaluation, each stage resumable and runnable alone (`--stages`), all under --out DIR:
prompts.jsonl, distill.jsonl, features/, draft/ (the DeepSpec-format checkpoint), eval.json."""
from __future__ import annotations

import json
import os
import time

from tqdm import tqdm

from sparkserve.training.config import DEFAULT_DRAFT_VOCAB, STAGES, PipelineConfig
from sparkserve.training.ranks import Ranks, close_ranks, init_ranks, train_device
from sparkserve.training.shards import merge_shards, shard_dir
from sparkserve.training.target_source import EngineTarget, HttpTarget, TargetSource


def _path(cfg: PipelineConfig, *names: str) -> str:
    return os.path.join(cfg.out, *names)


def _parts(cfg: PipelineConfig) -> list[str]:
    """Data folders: DIR itself (training) and DIR/val when validation prompts were written."""
    return [cfg.out] + ([_path(cfg, "val")] if os.path.exists(_path(cfg, "val", "prompts.jsonl")) else [])


def stage_prompts(cfg: PipelineConfig) -> None:
    """Training prompts, and cfg.val_prompts validation prompts that training never sees: the
    last lines of --prompts-file, or the end of ShareGPT's held-out part (eval takes its start)."""
    from sparkserve.training.prompts import jsonl_prompts, order_training_prompts, split_sharegpt
    if os.path.exists(_path(cfg, "prompts.jsonl")) and (
            not cfg.val_prompts or os.path.exists(_path(cfg, "val", "prompts.jsonl"))):
        return
    if cfg.prompts_file:
        prompts = jsonl_prompts(cfg.prompts_file)
        if cfg.val_prompts >= len(prompts):
            raise ValueError(f"--val-prompts {cfg.val_prompts} leaves no training prompt in "
                             f"{cfg.prompts_file} "
                             f"({len(prompts)} prompts): lower --val-prompts (0 = no validation)")
        val = prompts[len(prompts) - cfg.val_prompts:] if cfg.val_prompts else []
        train = prompts[:len(prompts) - len(val)]
    else:
        train, held = split_sharegpt(answers=cfg.labels != "generated")   # prefill labels read the replies
        val = held[len(held) - cfg.val_prompts:] if cfg.val_prompts else []
    train = order_training_prompts(train, cfg.code_math_frac, cfg.later_turn_frac)
    train = train[cfg.prompts_offset:cfg.prompts_offset + cfg.num_prompts]
    if val and os.path.exists(_path(cfg, "prompts.jsonl")):   # validation added to an earlier run
        seen = {json.dumps(p) for p in jsonl_prompts(_path(cfg, "prompts.jsonl"))}
        if any(json.dumps(p) in seen for p in val):
            raise ValueError(f"--val-prompts: the validation prompts overlap {_path(cfg, 'prompts.jsonl')}, "
                             "which was written without them; use a new --out")
    for name, prompts in (("val/prompts.jsonl", val), ("prompts.jsonl", train)):
        if (name.startswith("val/") and not prompts) or os.path.exists(_path(cfg, name)):
            continue          # written by an earlier run (validation may be added later)
        os.makedirs(os.path.dirname(_path(cfg, name)), exist_ok=True)
        with open(_path(cfg, name), "w") as f:
            for p in prompts:
                f.write(json.dumps({"messages": p}) + "\n")


def stage_distill(cfg: PipelineConfig, target: TargetSource, ranks: Ranks = Ranks()) -> None:
    for part in _parts(cfg):
        distill(cfg, target, part, ranks)


def distill(cfg: PipelineConfig, target: TargetSource, part: str, ranks: Ranks = Ranks()) -> None:
    """The target answers part/prompts.jsonl (resumes mid-file), and the hidden rows it computes
    on the way are logged for the feature cache (RawFeatureLog). Prefill-labelled prompts
    (--labels) are not answered: one prefill over the answer they bring logs its rows. With
    --second-answer-temperature each training prompt has two lines, its answer and one sampled.
    Over several ranks each distils its share of the lines and rank 0 merges them (shards.py)."""
    from sparkserve.training.prompts import jsonl_prompts
    n = len(jsonl_prompts(os.path.join(part, "prompts.jsonl"))) * _answers_per_prompt(cfg, part)
    out = os.path.join(part, "distill.jsonl")
    if ranks.world == 1:
        distill_share(cfg, target, part, range(n), part)
        return
    if not (os.path.exists(out) and sum(1 for _ in open(out)) >= n):
        distill_share(cfg, target, part, ranks.share(n), shard_dir(part, "distill", ranks.share(n)))
        ranks.barrier()
        if ranks.is_main:
            merge_shards(part, "distill", n, ranks, "distill.jsonl")
    ranks.barrier()


def _answers_per_prompt(cfg: PipelineConfig, part: str) -> int:
    """2 with a second sampled answer (training prompts only: validation follows greedy answers)."""
    second = cfg.second_answer_temperature is not None
    return 2 if second and os.path.abspath(part) == os.path.abspath(cfg.out) else 1


def distill_share(cfg: PipelineConfig, target: TargetSource, part: str, share: range, out_dir: str) -> None:
    """Lines `share` (prompt line // answers per prompt, answer line % it) of part/prompts.jsonl
    into out_dir/distill.jsonl and out_dir/features.log."""
    from sparkserve.training.feature_cache import RawFeatureLog
    from sparkserve.training.prompts import jsonl_prompts
    prompts, per = jsonl_prompts(os.path.join(part, "prompts.jsonl")), _answers_per_prompt(cfg, part)
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, "distill.jsonl")
    rows = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
    done = len(rows)
    taps = draft_config(cfg, target.model_config, target.tokenizer)["target_layer_ids"]
    if done >= len(share) and os.path.exists(os.path.join(out_dir, "features.log", "meta.json")):
        return
    log = RawFeatureLog(os.path.join(out_dir, "features.log"), taps, target.model_config.hidden_size,
                        sum(r.get("feature_rows", 0) for r in rows))
    target.tap(taps)
    # validation follows the target's own greedy answers (greedy_acceptance): never prefill-labelled
    labels = cfg.labels if os.path.abspath(part) == os.path.abspath(cfg.out) else "generated"
    items = [_distill_item(cfg, labels, target.tokenizer, k // per, prompts[k // per], k % per)
             for k in range(share.start + done, share.stop)]
    runnable = [it for it in items if it["run"]]
    results = target.run([it["run_ids"] for it in runnable], [it["params"] for it in runnable])
    lines = []
    with open(out, "a") as f, tqdm(total=len(share), initial=done, desc="distill", unit="prompt") as bar:
        for n, it in enumerate(items, 1):  # one line per prompt (skipped ones empty) so a rerun resumes right
            row = {"prompt_ids": it["prompt_ids"], "output_ids": []}
            if it["run"]:
                meta = (res := next(results))["meta_info"]
                if it["prefill"]:         # every position was run: drop the last row, as distilled
                    row.update(output_ids=it["answer_ids"], prefill_labelled=True)
                    row["feature_rows"] = log.append(meta["aux_hidden_states"][:-1],
                                                     meta["hidden_states"][:-1])
                else:
                    row["output_ids"] = res["output_ids"]
                    row.update(it.get("sampled", {}))
                    row["feature_rows"] = log.append(meta["aux_hidden_states"], meta["hidden_states"])
            lines.append(json.dumps(row) + "\n")
            if len(lines) == cfg.distill_batch or n == len(items):
                log.flush()
                f.writelines(lines)      # after the feature rows: a line promises its rows exist
                f.flush()
                bar.update(len(lines))
                lines = []
    log.close()


def _distill_item(cfg: PipelineConfig, labels: str, tok, index: int, messages: list[dict],
                  second: int = 0) -> dict:
    """What the target runs for prompt `index`: the prompt to answer, or (prefill labels) the
    prompt and its answer, once; `second`: its second answer, sampled at
    --second-answer-temperature with seed `index` (none for a prefill-labelled prompt)."""
    from sparkserve.training.label_mix import is_prefill_labelled, split_answer
    prompt, answer = split_answer(messages)
    ids = tok.encode(tok.apply_chat_template(prompt), add_special_tokens=True)
    fits = len(ids) <= cfg.max_prompt_tokens      # longer prompts are skipped (an empty line)
    if second:
        sampled = {"temperature": cfg.second_answer_temperature, "seed": index}
        return {"prefill": False, "run": fits and not is_prefill_labelled(index, labels, cfg.prefill_frac),
                "prompt_ids": ids, "run_ids": ids, "sampled": sampled,
                "params": {**sampled, "max_new_tokens": cfg.max_new_tokens}}
    if not is_prefill_labelled(index, labels, cfg.prefill_frac):
        return {"prefill": False, "run": fits, "prompt_ids": ids, "run_ids": ids,
                "params": {"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens}}
    if answer is None and not cfg.prompts_file:      # a ShareGPT turn nobody answered: skipped
        return {"prefill": True, "run": False, "prompt_ids": ids}
    if answer is None:
        raise ValueError(f"--labels {cfg.labels}: prompt {index} brings no answer to prefill (a prompts "
                         "file line whose messages end with an assistant turn)")
    ans = tok.encode(answer, add_special_tokens=False)[:cfg.max_new_tokens]
    return {"prefill": True, "run": fits and len(ans) >= 2, "prompt_ids": ids, "answer_ids": ans,
            "run_ids": ids + ans, "params": {"max_new_tokens": 0}}


def draft_config(cfg: PipelineConfig, target_cfg, tokenizer) -> dict:
    from sparkserve.models.dspark_draft import dspark_config_dict
    mask = cfg.mask_token_id
    if mask is None:       # an id the model never emits in text: a spare special token if any
        special = sorted(set(tokenizer.all_special_ids) - set(tokenizer.eos_token_ids)
                         - {tokenizer.bos_token_id}) if tokenizer else []
        mask = special[-1] if special else 0
    size = DEFAULT_DRAFT_VOCAB if cfg.draft_vocab_size is None else cfg.draft_vocab_size
    reduced = size if size and size < target_cfg.vocab_size else None
    return dspark_config_dict(target_cfg, cfg.num_layers or 1, cfg.block_size, cfg.target_layer_ids,
                              mask, cfg.markov_rank, draft_vocab_size=reduced, kv_heads=cfg.draft_kv_heads,
                              tap_norm=cfg.tap_norm, prev_context_fusion=cfg.prev_context_fusion)


def stage_features(cfg: PipelineConfig, target: TargetSource, ranks: Ranks = Ranks()) -> None:
    """The feature cache from the rows logged while distilling; by a prefill pass of the target
    over every sequence (split over the ranks) when that log is missing or incomplete (e.g.
    other taps). Rank 0 writes the cache."""
    from sparkserve.training.feature_cache import RawFeatureLog, feature_cache_from_log
    taps = draft_config(cfg, target.model_config, target.tokenizer)["target_layer_ids"]
    for part in _parts(cfg):
        out = os.path.join(part, "features")
        if os.path.exists(os.path.join(out, "index.json")):
            continue
        rows = [r for r in map(json.loads, open(os.path.join(part, "distill.jsonl"))) if r["output_ids"]]
        if not rows:
            continue
        seqs = [r["prompt_ids"] + r["output_ids"] for r in rows]
        plens = [len(r["prompt_ids"]) for r in rows]
        log = os.path.join(part, "features.log")
        if not (all("feature_rows" in r for r in rows) and RawFeatureLog.usable(log, taps, sum(map(len,
                                                                                                   seqs)))):
            if ranks.is_main:
                print(f"features: no complete distillation log in {log}: capturing by prefill")
            ranks.barrier()               # every rank has read the log's state before it is rewritten
            if ranks.world == 1:
                prefill_log(target, seqs, taps, log)
            else:
                share = ranks.share(len(seqs))
                shard = shard_dir(part, "prefill", share)
                prefill_log(target, seqs[share.start:share.stop], taps, os.path.join(shard, "features.log"),
                            os.path.join(shard, "prefill.jsonl"))
                ranks.barrier()
                if ranks.is_main:
                    merge_shards(part, "prefill", len(seqs), ranks, "prefill.jsonl")
        if ranks.is_main:
            labelled = [bool(r.get("prefill_labelled")) for r in rows]
            if cfg.cache_format == "int8" and part == cfg.out:     # validation stays fp16
                from sparkserve.training.int8_cache import convert_log
                convert_log(log, seqs, plens, taps, os.path.join(part, "features"), target.head_weight(),
                            labelled)
            else:
                feature_cache_from_log(log, seqs, plens, taps, out, labelled)
        ranks.barrier()


def prefill_log(target: TargetSource, seqs: list[list[int]], taps: list[int], path: str,
                lines_path: str | None = None) -> None:
    """A distillation log of `seqs` by the target's prefill-only capture (max_new_tokens 0 with
    hidden states returns every position's rows), on whatever ranks the target runs; with
    lines_path, a line per sequence with its row count (what merge_shards reads)."""
    from sparkserve.training.feature_cache import RawFeatureLog
    target.tap(taps)
    log = RawFeatureLog(path, taps, target.model_config.hidden_size, 0)
    lines = []
    for res in target.run(seqs, [{"max_new_tokens": 0}] * len(seqs)):
        meta = res["meta_info"]   # as distilled: the last row NaN
        n = log.append(meta["aux_hidden_states"][:-1], meta["hidden_states"][:-1])
        lines.append(json.dumps({"feature_rows": n}) + "\n")
    log.close()
    if lines_path is not None:
        os.makedirs(os.path.dirname(lines_path), exist_ok=True)
        with open(lines_path, "w") as f:
            f.writelines(lines)


def stage_train(cfg: PipelineConfig, engine, ranks: Ranks = Ranks()) -> dict:
    from sparkserve.models.dspark_draft import init_dspark_draft, target_vocab_weights
    from sparkserve.training.draft_vocab import select_draft_vocab
    from sparkserve.training.feature_cache import FeatureCache, write_lse
    from sparkserve.training.train_dspark import train
    target = engine.scheduler.runner.model
    # whole, also when TP splits the vocab; on CPU wherever the target runs (the teacher's rows, lse and
    # vocab moves read it beside CPU tensors; training moves only the draft vocab's rows)
    head = target_vocab_weights(target)["lm_head.weight"].cpu()
    dirs = [d for d in [_path(cfg, "features")] if os.path.exists(os.path.join(d, "index.json"))]
    dirs += cfg.extra_features
    if not dirs:
        raise ValueError(f"no feature cache to train on: run the features stage for {cfg.out}, or give "
                         f"--extra-features")
    if cfg.init_draft:
        with open(os.path.join(cfg.init_draft, "config.json")) as f:
            init_cfg = json.load(f)
        from sparkserve.training.grow_draft import grown_config
        dcfg = grown_config(init_cfg, cfg.init_draft, cfg.num_layers, cfg.draft_kv_heads, cfg.tap_norm,
                            cfg.prev_context_fusion)
        if cfg.draft_vocab_size is not None:
            if not 0 < cfg.draft_vocab_size < engine.model_config.vocab_size:
                raise ValueError(f"--draft-vocab-size {cfg.draft_vocab_size} with --init-draft re-picks a "
                                 f"reduced vocab: give 0 < N < {engine.model_config.vocab_size}, or leave it "
                                 "out to keep the draft's vocab")
            dcfg["draft_vocab_size"] = cfg.draft_vocab_size
    else:
        dcfg = draft_config(cfg, engine.model_config, engine.tokenizer)
    reduced = bool(dcfg.get("draft_vocab_size"))
    for d in dirs:          # the teacher's log-normaliser and greedy labels, once per cache, by rank 0
        c = FeatureCache.open(d)
        if ranks.is_main and ((reduced and not c.has_teacher())
                              or (c.any_prefill_labelled() and c.greedy is None)):
            write_lse(d, head)
    ranks.barrier()
    cache = FeatureCache.open_all(dirs)
    # the draft taps what --init-draft or --target-layer-ids name (a subset of the cache's taps),
    # else all the cache holds
    taps = dcfg["target_layer_ids"] if cfg.init_draft or cfg.target_layer_ids else cache.target_layer_ids
    cache = cache.with_taps(taps)
    dcfg["target_layer_ids"] = taps
    resuming = os.path.exists(os.path.join(_path(cfg, "draft"), "train_state.pt"))
    vocab = None
    if reduced and (not cfg.init_draft or cfg.draft_vocab_size is not None):
        counts = cache.response_token_counts(engine.model_config.vocab_size)
        pick = counts
        if cfg.vocab_count_replies:
            from sparkserve.training.reply_counts import draft_vocab_counts
            pick = draft_vocab_counts(cfg.out, cfg.prompts_file, counts, cfg.vocab_distilled_weight,
                                      engine.tokenizer)
        vocab, _ = select_draft_vocab(pick, dcfg["draft_vocab_size"], engine.tokenizer.eos_token_ids)
        coverage = float(counts[vocab].sum()) / max(int(counts.sum()), 1)
        if resuming:
            print("draft vocab: resuming, the checkpoint's vocab is kept")
        else:
            print(f"draft vocab: {len(vocab)} ids cover {coverage:.2%} of response tokens"
                  + _heldout_coverage(cfg, vocab, engine.model_config.vocab_size))
    # its weights (grown, moved to the new vocab); a resume then loads the checkpoint's
    if cfg.init_draft:
        from sparkserve.training.grow_draft import load_init_draft
        draft = load_init_draft(cfg.init_draft, init_cfg, dcfg, target, vocab, head)
    else:
        draft = init_dspark_draft(dcfg, target, vocab=vocab)
        if cfg.markov_init and not resuming:
            from sparkserve.training.markov_init import fit_markov_head
            fit_markov_head(draft, cache)     # start from the responses' bigram model
    val = _path(cfg, "val", "features")
    val_cache = None
    if os.path.exists(os.path.join(val, "index.json")):
        val_cache = FeatureCache.open(val).with_taps(taps)
    return train(draft, cache, _path(cfg, "draft"), cfg.train, log_every=cfg.train.log_every,
                 target_head=head, val_cache=val_cache, ranks=ranks)


def _heldout_coverage(cfg: PipelineConfig, vocab, vocab_size: int) -> str:
    """The ceiling a draft vocab puts on acceptance: the share of held-out (validation) response
    tokens it holds (a token outside it can never be drafted)."""
    from sparkserve.training.feature_cache import FeatureCache
    val = _path(cfg, "val", "features")
    if not os.path.exists(os.path.join(val, "index.json")):
        return ""
    counts = FeatureCache.open(val).response_token_counts(vocab_size)
    return f", {float(counts[vocab].sum()) / max(int(counts.sum()), 1):.2%} of held-out ones (the ceiling)"


def stage_eval(cfg: PipelineConfig) -> dict:
    """tau (tokens per verify cycle, bonus included) through the real serving path, on the
    held-out ShareGPT prompts and HumanEval, at temperature 0 and 1; with validation data also
    the offline greedy tau over all of it and, as a parity check, the same sequences served.
    Scores DIR/draft/best (the best validated draft, the one to ship) when training validated,
    else DIR/draft."""
    from sparkserve.entrypoints.engine import Engine
    from sparkserve.training.prompts import humaneval_prompts, split_sharegpt
    sets = {"sharegpt_heldout": split_sharegpt()[1][:cfg.eval_prompts],
            "humaneval": humaneval_prompts()[:cfg.eval_prompts]}
    best = _path(cfg, "draft", "best")
    draft_dir = best if os.path.exists(os.path.join(best, "config.json")) else _path(cfg, "draft")
    # verify mode full: tau is the draft's acceptance (adaptive may not draft where it cannot pay)
    with Engine(cfg.model_path, speculative_algorithm="DSPARK", speculative_draft_model_path=draft_dir,
                speculative_dspark_verify_mode="full", tp_size=cfg.tp_size, pp_size=cfg.pp_size,
                activation_quant=cfg.activation_quant, kv_cache_dtype=cfg.kv_cache_dtype,
                device=cfg.device) as eng:
        res = _eval_sets(cfg, eng, sets, draft_dir)
    with open(_path(cfg, "eval.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def _eval_sets(cfg: PipelineConfig, eng, sets: dict, draft_dir: str) -> dict:
    res: dict = {"draft": draft_dir}
    val = _path(cfg, "val", "features")
    if os.path.exists(os.path.join(val, "index.json")):
        from sparkserve.training.feature_cache import FeatureCache
        from sparkserve.training.validate import greedy_acceptance, serving_acceptance, slot1_accuracy
        draft = eng.scheduler.spec.draft
        cache = FeatureCache.open(val).with_taps(draft.config.target_layer_ids)
        res["val_greedy_offline"] = greedy_acceptance(draft, cache)
        res["val_quick"] = slot1_accuracy(draft, cache)
        res["val_greedy_serving"] = serving_acceptance(eng, cache)      # the same walk, served: parity
    for name, prompts in sets.items():
        for temp in (0.0, 1.0):
            t = time.time()
            outs = eng.generate(messages=prompts, sampling_params={
                "temperature": temp, "max_new_tokens": cfg.eval_max_new_tokens, "seed": 0})
            cycles = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
            tokens = cycles + sum(o["meta_info"].get("spec_accept_token_num", 0) for o in outs)
            res[f"{name}_T{temp:g}"] = {"tau": tokens / max(cycles, 1), "cycles": cycles,
                                        "prompts": len(prompts), "seconds": time.time() - t}
    return res


def check_flags(cfg: PipelineConfig, ranks: Ranks) -> None:
    """Bad flag combinations, before anything starts."""
    from sparkserve.training.label_mix import check_label_flags
    bad = [s for s in cfg.stages if s not in STAGES]
    if bad:
        raise ValueError(f"--stages: unknown {bad}; choose from {', '.join(STAGES)}")
    walk = cfg.train.walk_anchor_frac
    if not 0 <= walk <= 1:
        raise ValueError(f"--walk-anchor-frac must be within [0, 1], got {walk}")
    if walk and cfg.temperature > 0:
        raise ValueError("--walk-anchor-frac follows greedy verification along the cached answers: "
                         f"distill them with --temperature 0 (got {cfg.temperature})")
    if walk and cfg.second_answer_temperature is not None:
        raise ValueError("--walk-anchor-frac follows the target's greedy answers: not with "
                         "--second-answer-temperature (sampled answers in the cache)")
    if walk and cfg.labels != "generated":
        raise ValueError(f"--walk-anchor-frac follows the target's own greedy answers: not with --labels "
                         f"{cfg.labels} (prefill over answers the target did not write)")
    check_label_flags(cfg.labels, cfg.prefill_frac)
    for flag, frac in (("code-math-frac", cfg.code_math_frac), ("later-turn-frac", cfg.later_turn_frac)):
        if frac is not None and not 0 <= frac <= 1:
            raise ValueError(f"--{flag} must be within [0, 1], got {frac}")
    keeps_vocab = cfg.draft_vocab_size == 0 or (cfg.init_draft and cfg.draft_vocab_size is None)
    if cfg.vocab_count_replies and keeps_vocab:
        raise ValueError("--vocab-count-replies picks a reduced draft vocab: not with --draft-vocab-size 0, "
                         "nor with --init-draft keeping its draft's vocab (give --draft-vocab-size)")
    if cfg.second_answer_temperature is not None and cfg.second_answer_temperature <= 0:
        raise ValueError(f"--second-answer-temperature must be > 0, got {cfg.second_answer_temperature}")
    if cfg.distill_batch < 1:
        raise ValueError(f"--distill-batch must be >= 1, got {cfg.distill_batch}")
    if cfg.target_url and (cfg.tp_size > 1 or cfg.pp_size > 1):
        raise ValueError("--target-url with --tp-size/--pp-size: the served target has its own layout; "
                         "these flags shard an in-process target")
    if ranks.group and (cfg.tp_size > 1 or cfg.pp_size > 1):
        raise ValueError(f"--tp-size/--pp-size with {ranks.world} torchrun rank(s): each rank runs its own "
                         "in-process target; serve a sharded target and give --target-url instead")
    if cfg.cache_format == "int8" and cfg.target_url and "features" in cfg.stages:
        raise ValueError("--cache-format int8 with --target-url: the int8 cache's teacher needs the target's "
                         "LM head in this process; run the features stage without --target-url")
    if ranks.world > 1 and "eval" in cfg.stages:
        raise ValueError("--stages eval under torchrun: run the eval stage in one process")


def _local_config_and_tokenizer(model_path: str | None):
    """The target's config and tokenizer without its weights (--target-url's distillation)."""
    from sparkserve.args import ServerArgs
    from sparkserve.frontend.tokenizer import load_tokenizer_for
    from sparkserve.models.registry import load_config
    args = ServerArgs(model_path=model_path).validate()
    return load_config(args.model_path), load_tokenizer_for(args)


def run_pipeline(cfg: PipelineConfig) -> None:
    """One process, or one rank of `torchrun --nproc-per-node N -m sparkserve.cli train-draft`
    (every rank runs this with the same flags)."""
    ranks = init_ranks(train_device(cfg.device))     # a bad --device fails before any group forms
    finished = False
    try:
        check_flags(cfg, ranks)
        _run_stages(cfg, ranks)
        finished = True
    finally:
        close_ranks(ranks, finished)


def _run_stages(cfg: PipelineConfig, ranks: Ranks) -> None:
    stages = cfg.stages
    os.makedirs(cfg.out, exist_ok=True)
    data_stages = {"distill", "features"} & set(stages)
    engine = None
    if "train" in stages or (data_stages and not cfg.target_url):
        from sparkserve.entrypoints.engine import Engine
        # no prefix cache: a cached prompt prefix is not recomputed, so it has no hidden rows
        engine = Engine(cfg.model_path, max_total_tokens=cfg.distill_batch * (cfg.max_new_tokens + 2048),
                        max_running_requests=max(64, cfg.distill_batch), tp_size=cfg.tp_size,
                        pp_size=cfg.pp_size, enable_return_hidden_states=True, disable_radix_cache=True,
                        activation_quant=cfg.activation_quant, kv_cache_dtype=cfg.kv_cache_dtype,
                        device=cfg.device)
    target: TargetSource | None = None
    if data_stages and cfg.target_url:
        mc, tok = ((engine.model_config, engine.tokenizer) if engine is not None
                   else _local_config_and_tokenizer(cfg.model_path))
        target = HttpTarget(cfg.target_url, mc, tok, cfg.distill_batch)
    elif data_stages:
        target = EngineTarget(engine, cfg.distill_batch)
    try:
        for s in STAGES:
            if s not in stages:
                continue
            if s == "prompts":
                if ranks.is_main:
                    stage_prompts(cfg)
                ranks.barrier()
            elif s == "eval":
                print(json.dumps(stage_eval(cfg), indent=1))
            elif s == "train":
                out = stage_train(cfg, engine, ranks)
                if out and ranks.is_main:
                    print(json.dumps(out))
            else:
                {"distill": stage_distill, "features": stage_features}[s](cfg, target, ranks)
    finally:
        if engine is not None:
            engine.shutdown()
