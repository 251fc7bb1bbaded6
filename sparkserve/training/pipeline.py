"""`sparkserve train-draft`: prompts -> self-distillation -> feature cache -> training ->
evaluation, each stage resumable and runnable alone (`--stages`), all under --out DIR:
prompts.jsonl, distill.jsonl, features/, draft/ (the DeepSpec-format checkpoint), eval.json."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from tqdm import tqdm

STAGES = ("prompts", "distill", "features", "train", "eval")


@dataclass
class PipelineConfig:
    model_path: str | None
    out: str
    prompts_file: str | None = None
    num_prompts: int = 2000
    max_new_tokens: int = 256
    temperature: float = 0.0
    distill_batch: int = 32
    max_prompt_tokens: int = 1024          # longer prompts are skipped (prefill would dominate)
    num_layers: int = 1
    block_size: int = 7
    markov_rank: int = 64
    draft_vocab_size: int | None = 8192     # None or >= vocab: the full vocab
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    markov_init: bool = True                # Markov head starts as the responses' bigram fit
    eval_prompts: int = 32
    eval_max_new_tokens: int = 128
    train: dict = field(default_factory=dict)


def _path(cfg: PipelineConfig, name: str) -> str:
    return os.path.join(cfg.out, name)


def stage_prompts(cfg: PipelineConfig) -> None:
    from sparkserve.training.prompts import jsonl_prompts, split_sharegpt
    out = _path(cfg, "prompts.jsonl")
    if os.path.exists(out):
        return
    prompts = jsonl_prompts(cfg.prompts_file) if cfg.prompts_file else split_sharegpt()[0]
    with open(out, "w") as f:
        for p in prompts[:cfg.num_prompts]:
            f.write(json.dumps({"messages": p}) + "\n")


def stage_distill(cfg: PipelineConfig, engine) -> None:
    """The target answers the prompts with sparkserve's batched engine (resumes mid-file)."""
    from sparkserve.training.prompts import jsonl_prompts
    prompts = jsonl_prompts(_path(cfg, "prompts.jsonl"))
    out = _path(cfg, "distill.jsonl")
    done = sum(1 for _ in open(out)) if os.path.exists(out) else 0
    tok = engine.tokenizer
    params = {"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens}
    with open(out, "a") as f, tqdm(total=len(prompts), initial=done, desc="distill", unit="prompt") as bar:
        for i in range(done, len(prompts), cfg.distill_batch):
            batch = prompts[i:i + cfg.distill_batch]
            ids = [tok.encode(tok.apply_chat_template(m), add_special_tokens=True) for m in batch]
            short = [p for p in ids if len(p) <= cfg.max_prompt_tokens]
            answers = iter(engine.generate(input_ids=short, sampling_params=params) if short else [])
            for p in ids:      # one line per prompt (skipped ones empty) so a rerun resumes right
                out = next(answers)["output_ids"] if len(p) <= cfg.max_prompt_tokens else []
                f.write(json.dumps({"prompt_ids": p, "output_ids": out}) + "\n")
            f.flush()
            bar.update(len(batch))


def draft_config(cfg: PipelineConfig, target_cfg, tokenizer) -> dict:
    from sparkserve.models.dspark_draft import dspark_config_dict
    mask = cfg.mask_token_id
    if mask is None:       # an id the model never emits in text: a spare special token if any
        special = sorted(set(tokenizer.all_special_ids) - set(tokenizer.eos_token_ids)
                         - {tokenizer.bos_token_id}) if tokenizer else []
        mask = special[-1] if special else 0
    reduced = cfg.draft_vocab_size if cfg.draft_vocab_size and cfg.draft_vocab_size < target_cfg.vocab_size else None
    return dspark_config_dict(target_cfg, cfg.num_layers, cfg.block_size, cfg.target_layer_ids,
                              mask, cfg.markov_rank, draft_vocab_size=reduced)


def stage_features(cfg: PipelineConfig, engine) -> None:
    from sparkserve.training.feature_cache import build_feature_cache
    out = _path(cfg, "features")
    if os.path.exists(os.path.join(out, "index.json")):
        return
    rows = [json.loads(line) for line in open(_path(cfg, "distill.jsonl"))]
    seqs = [r["prompt_ids"] + r["output_ids"] for r in rows if r["output_ids"]]
    plens = [len(r["prompt_ids"]) for r in rows if r["output_ids"]]
    dcfg = draft_config(cfg, engine.model_config, engine.tokenizer)
    model = engine.scheduler.runner.model
    build_feature_cache(model, seqs, plens, dcfg["target_layer_ids"], out)


def stage_train(cfg: PipelineConfig, engine) -> dict:
    from sparkserve.models.dspark_draft import init_dspark_draft
    from sparkserve.training.draft_vocab import select_draft_vocab
    from sparkserve.training.feature_cache import FeatureCache, write_lse
    from sparkserve.training.train_dspark import TrainConfig, train
    target = engine.scheduler.runner.model
    features = _path(cfg, "features")
    cache = FeatureCache.open(features)
    dcfg = draft_config(cfg, engine.model_config, engine.tokenizer)
    dcfg["target_layer_ids"] = cache.target_layer_ids
    vocab = None
    if dcfg.get("draft_vocab_size"):
        if cache.lse is None:
            write_lse(features, target.lm_head.weight)
            cache = FeatureCache.open(features)
        counts = cache.response_token_counts(engine.model_config.vocab_size)
        vocab, coverage = select_draft_vocab(counts, dcfg["draft_vocab_size"], engine.tokenizer.eos_token_ids)
        if os.path.exists(os.path.join(_path(cfg, "draft"), "train_state.pt")):
            print("draft vocab: resuming, the checkpoint's vocab is kept")
        else:
            print(f"draft vocab: {len(vocab)} ids cover {coverage:.2%} of response tokens")
    draft = init_dspark_draft(dcfg, target, vocab=vocab)
    if cfg.markov_init and not os.path.exists(os.path.join(_path(cfg, "draft"), "train_state.pt")):
        from sparkserve.training.markov_init import fit_markov_head
        fit_markov_head(draft, cache)     # start from the responses' bigram model
    return train(draft, cache, _path(cfg, "draft"), TrainConfig(**cfg.train), target_head=target.lm_head.weight)


def stage_eval(cfg: PipelineConfig) -> dict:
    """tau (tokens per verify cycle, bonus included) through the real serving path, on the
    held-out ShareGPT prompts and HumanEval, at temperature 0 and 1."""
    from sparkserve.entrypoints.engine import Engine
    from sparkserve.training.prompts import humaneval_prompts, split_sharegpt
    sets = {"sharegpt_heldout": split_sharegpt()[1][:cfg.eval_prompts],
            "humaneval": humaneval_prompts()[:cfg.eval_prompts]}
    eng = Engine(cfg.model_path, speculative_algorithm="DSPARK",
                 speculative_draft_model_path=_path(cfg, "draft"))
    res = {}
    for name, prompts in sets.items():
        for temp in (0.0, 1.0):
            t = time.time()
            outs = eng.generate(messages=prompts, sampling_params={
                "temperature": temp, "max_new_tokens": cfg.eval_max_new_tokens, "seed": 0})
            cycles = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
            tokens = sum(o["meta_info"].get("spec_accepted_tokens", 0) for o in outs)
            res[f"{name}_T{temp:g}"] = {"tau": tokens / max(cycles, 1), "cycles": cycles,
                                        "prompts": len(prompts), "seconds": time.time() - t}
    with open(_path(cfg, "eval.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def run_pipeline(cfg: PipelineConfig, stages: list[str]) -> None:
    os.makedirs(cfg.out, exist_ok=True)
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise ValueError(f"--stages: unknown {bad}; choose from {', '.join(STAGES)}")
    engine = None
    if {"distill", "features", "train"} & set(stages):
        from sparkserve.entrypoints.engine import Engine
        engine = Engine(cfg.model_path, max_total_tokens=cfg.distill_batch * (cfg.max_new_tokens + 2048))
    for s in STAGES:
        if s not in stages:
            continue
        if s == "prompts":
            stage_prompts(cfg)
        elif s == "eval":
            print(json.dumps(stage_eval(cfg), indent=1))
        else:
            out = {"distill": stage_distill, "features": stage_features, "train": stage_train}[s](cfg, engine)
            if out:
                print(json.dumps(out))
