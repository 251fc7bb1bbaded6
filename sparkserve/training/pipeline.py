"""`sparkserve train-draft`: prompts -> self-distillation -> feature cache -> training ->
evaluation, each stage resumable and runnable alone (`--stages`), all under --out DIR:
prompts.jsonl, distill.jsonl, features/, draft/ (the DeepSpec-format checkpoint), eval.json."""
from __future__ import annotations

import json
import os
import time

from tqdm import tqdm

from sparkserve.training.config import DEFAULT_DRAFT_VOCAB, STAGES, PipelineConfig


def _path(cfg: PipelineConfig, *names: str) -> str:
    return os.path.join(cfg.out, *names)


def _parts(cfg: PipelineConfig) -> list[str]:
    """Data folders: DIR itself (training) and DIR/val when validation prompts were written."""
    return [cfg.out] + ([_path(cfg, "val")] if os.path.exists(_path(cfg, "val", "prompts.jsonl")) else [])


def stage_prompts(cfg: PipelineConfig) -> None:
    """Training prompts, and cfg.val_prompts validation prompts that training never sees: the
    last lines of --prompts-file, or the end of ShareGPT's held-out part (eval takes its start)."""
    from sparkserve.training.prompts import jsonl_prompts, split_sharegpt
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
        train, held = split_sharegpt()
        val = held[len(held) - cfg.val_prompts:] if cfg.val_prompts else []
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


def stage_distill(cfg: PipelineConfig, engine) -> None:
    for part in _parts(cfg):
        distill(cfg, engine, part)


def distill(cfg: PipelineConfig, engine, part: str) -> None:
    """The target answers part/prompts.jsonl with sparkserve's batched engine (resumes mid-file),
    and the hidden rows it computes on the way are logged for the feature cache (RawFeatureLog)."""
    from sparkserve.training.feature_cache import RawFeatureLog
    from sparkserve.training.prompts import jsonl_prompts
    prompts = jsonl_prompts(os.path.join(part, "prompts.jsonl"))
    out = os.path.join(part, "distill.jsonl")
    rows = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
    done = len(rows)
    if done >= len(prompts):
        return
    taps = draft_config(cfg, engine.model_config, engine.tokenizer)["target_layer_ids"]
    engine.scheduler.runner.model.set_aux_layers(taps)
    log = RawFeatureLog(os.path.join(part, "features.log"), taps, engine.model_config.hidden_size,
                        sum(r.get("feature_rows", 0) for r in rows))
    tok = engine.tokenizer
    params = {"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens}
    ids = [tok.encode(tok.apply_chat_template(m), add_special_tokens=True) for m in prompts[done:]]
    # distill_batch requests in flight, each finished one replaced at once (Engine.generate_many)
    answers = engine.generate_many((p for p in ids if len(p) <= cfg.max_prompt_tokens), params,
                                   max_in_flight=cfg.distill_batch, return_hidden_states=True)
    lines = []
    with open(out, "a") as f, tqdm(total=len(prompts), initial=done, desc="distill", unit="prompt") as bar:
        for n, p in enumerate(ids, 1):  # one line per prompt (skipped ones empty) so a rerun resumes right
            row = {"prompt_ids": p, "output_ids": []}
            if len(p) <= cfg.max_prompt_tokens:
                ans = next(answers)
                row["output_ids"] = ans["output_ids"]
                meta = ans["meta_info"]
                row["feature_rows"] = log.append(meta["aux_hidden_states"], meta["hidden_states"])
            lines.append(json.dumps(row) + "\n")
            if len(lines) == cfg.distill_batch or n == len(ids):
                log.flush()
                f.writelines(lines)      # after the feature rows: a line promises its rows exist
                f.flush()
                bar.update(len(lines))
                lines = []
    log.close()


def draft_config(cfg: PipelineConfig, target_cfg, tokenizer) -> dict:
    from sparkserve.models.dspark_draft import dspark_config_dict
    mask = cfg.mask_token_id
    if mask is None:       # an id the model never emits in text: a spare special token if any
        special = sorted(set(tokenizer.all_special_ids) - set(tokenizer.eos_token_ids)
                         - {tokenizer.bos_token_id}) if tokenizer else []
        mask = special[-1] if special else 0
    size = DEFAULT_DRAFT_VOCAB if cfg.draft_vocab_size is None else cfg.draft_vocab_size
    reduced = size if size and size < target_cfg.vocab_size else None
    return dspark_config_dict(target_cfg, cfg.num_layers, cfg.block_size, cfg.target_layer_ids,
                              mask, cfg.markov_rank, draft_vocab_size=reduced)


def stage_features(cfg: PipelineConfig, engine) -> None:
    """The feature cache from the rows logged while distilling; by a prefill pass of the target
    over every sequence when that log is missing or incomplete (e.g. other taps)."""
    from sparkserve.training.feature_cache import RawFeatureLog, feature_cache_from_log
    taps = draft_config(cfg, engine.model_config, engine.tokenizer)["target_layer_ids"]
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
            print(f"features: no complete distillation log in {log}: capturing by prefill")
            prefill_log(engine, seqs, taps, log)
        feature_cache_from_log(log, seqs, plens, taps, out)


def prefill_log(engine, seqs: list[list[int]], taps: list[int], path: str) -> None:
    """A distillation log of `seqs` by the engine's prefill-only capture (max_new_tokens 0 with
    hidden states returns every position's rows), on whatever ranks the target runs."""
    from sparkserve.training.feature_cache import RawFeatureLog
    engine.scheduler.runner.model.set_aux_layers(taps)
    log = RawFeatureLog(path, taps, engine.model_config.hidden_size, 0)
    for res in engine.generate_many(seqs, {"max_new_tokens": 0}, return_hidden_states=True):
        meta = res["meta_info"]
        log.append(meta["aux_hidden_states"][:-1], meta["hidden_states"][:-1])   # as distilled: last row NaN
    log.close()


def stage_train(cfg: PipelineConfig, engine) -> dict:
    from sparkserve.models.dspark_draft import init_dspark_draft, target_vocab_weights
    from sparkserve.training.draft_vocab import select_draft_vocab
    from sparkserve.training.feature_cache import FeatureCache, write_lse
    from sparkserve.training.train_dspark import train
    target = engine.scheduler.runner.model
    head = target_vocab_weights(target)["lm_head.weight"]     # whole, also when TP splits the vocab
    dirs = [d for d in [_path(cfg, "features")] if os.path.exists(os.path.join(d, "index.json"))]
    dirs += cfg.extra_features
    if not dirs:
        raise ValueError(f"no feature cache to train on: run the features stage for {cfg.out}, or give "
                         f"--extra-features")
    if cfg.init_draft:
        with open(os.path.join(cfg.init_draft, "config.json")) as f:
            init_cfg = json.load(f)
        dcfg = dict(init_cfg)
        if cfg.draft_vocab_size is not None:
            if not 0 < cfg.draft_vocab_size < engine.model_config.vocab_size:
                raise ValueError(f"--draft-vocab-size {cfg.draft_vocab_size} with --init-draft re-picks a "
                                 f"reduced "
                                 f"vocab: give 0 < N < {engine.model_config.vocab_size}, or leave it out to "
                                 f"keep "
                                 "the draft's vocab")
            dcfg["draft_vocab_size"] = cfg.draft_vocab_size
    else:
        dcfg = draft_config(cfg, engine.model_config, engine.tokenizer)
    reduced = bool(dcfg.get("draft_vocab_size"))
    for d in dirs if reduced else []:          # the teacher's log-normaliser, once per cache
        if FeatureCache.open(d).lse is None:
            write_lse(d, head)
    cache = FeatureCache.open_all(dirs)
    if cfg.init_draft and cache.target_layer_ids != dcfg["target_layer_ids"]:
        raise ValueError(f"--init-draft {cfg.init_draft} taps layers {dcfg['target_layer_ids']} but the "
                         f"feature cache holds {cache.target_layer_ids}: capture with --target-layer-ids "
                         f"{','.join(map(str, dcfg['target_layer_ids']))}")
    dcfg["target_layer_ids"] = cache.target_layer_ids
    resuming = os.path.exists(os.path.join(_path(cfg, "draft"), "train_state.pt"))
    vocab = None
    if reduced and (not cfg.init_draft or cfg.draft_vocab_size is not None):
        counts = cache.response_token_counts(engine.model_config.vocab_size)
        vocab, coverage = select_draft_vocab(counts, dcfg["draft_vocab_size"], engine.tokenizer.eos_token_ids)
        if resuming:
            print("draft vocab: resuming, the checkpoint's vocab is kept")
        else:
            print(f"draft vocab: {len(vocab)} ids cover {coverage:.2%} of response tokens")
    # its weights (moved to the new vocab); a resume then loads the checkpoint's
    if cfg.init_draft:
        from sparkserve.loader.hf import hf_weights
        from sparkserve.training.draft_vocab import move_to_vocab
        draft = init_dspark_draft(init_cfg, target)
        draft.load_weights(hf_weights(cfg.init_draft), target)
        if vocab is not None:
            moved = init_dspark_draft(dcfg, target, vocab=vocab)
            move_to_vocab(draft, moved, head)
            draft = moved
    else:
        draft = init_dspark_draft(dcfg, target, vocab=vocab)
        if cfg.markov_init and not resuming:
            from sparkserve.training.markov_init import fit_markov_head
            fit_markov_head(draft, cache)     # start from the responses' bigram model
    val = _path(cfg, "val", "features")
    val_cache = FeatureCache.open(val) if os.path.exists(os.path.join(val, "index.json")) else None
    return train(draft, cache, _path(cfg, "draft"), cfg.train, target_head=head,
                 val_cache=val_cache)


def stage_eval(cfg: PipelineConfig) -> dict:
    """tau (tokens per verify cycle, bonus included) through the real serving path, on the
    held-out ShareGPT prompts and HumanEval, at temperature 0 and 1; with validation data also
    the offline greedy tau over all of it. Scores DIR/draft/best (the best validated draft,
    the one to ship) when training validated, else DIR/draft."""
    from sparkserve.entrypoints.engine import Engine
    from sparkserve.training.prompts import humaneval_prompts, split_sharegpt
    sets = {"sharegpt_heldout": split_sharegpt()[1][:cfg.eval_prompts],
            "humaneval": humaneval_prompts()[:cfg.eval_prompts]}
    best = _path(cfg, "draft", "best")
    draft_dir = best if os.path.exists(os.path.join(best, "config.json")) else _path(cfg, "draft")
    with Engine(cfg.model_path, speculative_algorithm="DSPARK", speculative_draft_model_path=draft_dir,
                tp_size=cfg.tp_size, pp_size=cfg.pp_size) as eng:
        res = _eval_sets(cfg, eng, sets, draft_dir)
    with open(_path(cfg, "eval.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def _eval_sets(cfg: PipelineConfig, eng, sets: dict, draft_dir: str) -> dict:
    res: dict = {"draft": draft_dir}
    val = _path(cfg, "val", "features")
    if os.path.exists(os.path.join(val, "index.json")):
        from sparkserve.training.feature_cache import FeatureCache
        from sparkserve.training.validate import greedy_acceptance
        res["val_greedy_offline"] = greedy_acceptance(eng.scheduler.spec.draft, FeatureCache.open(val))
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


def run_pipeline(cfg: PipelineConfig) -> None:
    stages = cfg.stages
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise ValueError(f"--stages: unknown {bad}; choose from {', '.join(STAGES)}")
    os.makedirs(cfg.out, exist_ok=True)
    walk = cfg.train.walk_anchor_frac
    if not 0 <= walk <= 1:
        raise ValueError(f"--walk-anchor-frac must be within [0, 1], got {walk}")
    if walk and cfg.temperature > 0:
        raise ValueError("--walk-anchor-frac follows greedy verification along the cached answers: "
                         f"distill them with --temperature 0 (got {cfg.temperature})")
    engine = None
    if {"distill", "features", "train"} & set(stages):
        from sparkserve.entrypoints.engine import Engine
        # no prefix cache: a cached prompt prefix is not recomputed, so it has no hidden rows
        if cfg.distill_batch < 1:
            raise ValueError(f"--distill-batch must be >= 1, got {cfg.distill_batch}")
        engine = Engine(cfg.model_path, max_total_tokens=cfg.distill_batch * (cfg.max_new_tokens + 2048),
                        max_running_requests=max(64, cfg.distill_batch), tp_size=cfg.tp_size,
                        pp_size=cfg.pp_size, enable_return_hidden_states=True, disable_radix_cache=True)
    try:
        for s in STAGES:
            if s not in stages:
                continue
            if s == "prompts":
                stage_prompts(cfg)
            elif s == "eval":
                print(json.dumps(stage_eval(cfg), indent=1))
            else:
                out = {"distill": stage_distill, "features": stage_features, "train": stage_train}[s](cfg,
                                                                                                      engine)
                if out:
                    print(json.dumps(out))
    finally:
        if engine is not None:
            engine.shutdown()
