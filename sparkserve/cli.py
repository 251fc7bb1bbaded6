"""Command line: `sparkserve serve | generate | train-draft`. Flags follow SGLang's names (see --help)."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from sparkserve.args import ServerArgs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparkserve", description="LLM serving engine on PyTorch")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser("serve", help="start the OpenAI- and SGLang-compatible HTTP server")
    ServerArgs.add_cli_args(serve)

    gen = sub.add_parser("generate", help="generate an answer for one prompt and print it")
    gen.add_argument("prompt", help="the user message (chat template applied unless --raw)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--system", default=None, help="system message")
    gen.add_argument("--json", action="store_true", help="print the full result as JSON")
    ServerArgs.add_cli_args(gen)

    tr = sub.add_parser("train-draft", help="train a DSpark draft for a model (self-distillation)")
    tr.add_argument("--model-path", default=None, help="target model (default: the embedded SmolLM2)")
    tr.add_argument("--out", required=True, help="output directory (resumable)")
    tr.add_argument("--stages", default="prompts,distill,features,train,eval",
                    help="comma-separated subset of prompts,distill,features,train,eval")
    tr.add_argument("--prompts-file", default=None, help="JSONL prompts (default: ShareGPT minus the held-out 2,000)")
    tr.add_argument("--num-prompts", type=int, default=2000)
    tr.add_argument("--prompts-offset", type=int, default=0,
                    help="skip this many training prompts (add data in a new run without repeating prompts)")
    tr.add_argument("--extra-features", default=None,
                    help="comma-separated feature caches (other runs' OUT/features) to train on as well")
    tr.add_argument("--max-new-tokens", type=int, default=256, help="distillation answer length")
    tr.add_argument("--temperature", type=float, default=0.0, help="distillation temperature")
    tr.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip longer prompts when distilling")
    tr.add_argument("--distill-batch", type=int, default=32, help="requests in flight while distilling")
    tr.add_argument("--num-layers", type=int, default=1, help="draft depth")
    tr.add_argument("--block-size", type=int, default=7, help="gamma")
    tr.add_argument("--markov-rank", type=int, default=64)
    tr.add_argument("--draft-vocab-size", type=int, default=None,
                    help="score only the most frequent response ids (default 8192; 0 = the full vocab). "
                         "With --init-draft: re-pick that draft's vocab (default: keep it)")
    tr.add_argument("--target-layer-ids", default=None, help="comma-separated taps (default: 1, L/2, L-2)")
    tr.add_argument("--steps", type=int, default=1000)
    tr.add_argument("--lr", type=float, default=6e-4)
    tr.add_argument("--seqs-per-step", type=int, default=4)
    tr.add_argument("--anchors-per-seq", type=int, default=32)
    tr.add_argument("--final-norm-lr-mult", type=float, default=20.0,
                    help="learning-rate multiple for the draft's small-initialised final norm")
    tr.add_argument("--ce-weight", type=float, default=0.1,
                    help="weight of the cross-entropy term (DeepSpec: 0.1 CE + 0.9 L1 + 1.0 BCE)")
    tr.add_argument("--no-markov-init", action="store_true",
                    help="start the Markov head at random instead of the responses' bigram fit")
    tr.add_argument("--val-prompts", type=int, default=64,
                    help="held-out prompts distilled for validation: training logs their greedy tau "
                         "and keeps the best draft in OUT/draft/best (0 = no validation)")
    tr.add_argument("--val-every", type=int, default=250, help="validate every N training steps")
    tr.add_argument("--val-seqs", type=int, default=48, help="validation sequences scored each time")
    tr.add_argument("--init-draft", default=None,
                    help="start from this draft's weights and config (fresh optimizer and schedule)")
    tr.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    tr.add_argument("--dropout", type=float, default=0.0,
                    help="dropout on the draft's target context and block output while training")
    tr.add_argument("--walk-anchor-frac", type=float, default=0.0,
                    help="share of training anchors moved to their greedy walk successor (where "
                         "serving anchors: right after the draft's miss); needs greedy distillation")
    tr.add_argument("--train-lm-head", action="store_true",
                    help="also train a reduced-vocab draft's LM head (default: frozen, as DeepSpec)")
    tr.add_argument("--eval-prompts", type=int, default=32)
    tr.add_argument("--eval-max-new-tokens", type=int, default=128)
    return p


def _generate(ns: argparse.Namespace) -> int:
    from sparkserve.entrypoints.engine import Engine
    args = ServerArgs.from_cli_args(ns)
    engine = Engine(**args.to_dict())
    params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature,
              "top_p": ns.top_p, "top_k": ns.top_k, "seed": ns.seed}
    if ns.raw:
        stream = engine.generate(ns.prompt, params, stream=True)
    else:
        msgs = ([{"role": "system", "content": ns.system}] if ns.system else []) + \
               [{"role": "user", "content": ns.prompt}]
        stream = engine.generate(messages=msgs, sampling_params=params, stream=True)
    last = None
    for chunk in stream:
        if not ns.json:
            sys.stdout.write(chunk["text"])
            sys.stdout.flush()
        last = chunk
    if ns.json:
        print(json.dumps(last["meta_info"]))
    else:
        sys.stdout.write("\n")
    return 0


def _train_draft(ns: argparse.Namespace) -> int:
    from sparkserve.training.pipeline import PipelineConfig, run_pipeline
    taps = [int(x) for x in ns.target_layer_ids.split(",")] if ns.target_layer_ids else None
    cfg = PipelineConfig(
        model_path=ns.model_path, out=ns.out, prompts_file=ns.prompts_file, num_prompts=ns.num_prompts,
        prompts_offset=ns.prompts_offset,
        extra_features=[d for d in (ns.extra_features or "").split(",") if d],
        max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, num_layers=ns.num_layers,
        max_prompt_tokens=ns.max_prompt_tokens, distill_batch=ns.distill_batch,
        block_size=ns.block_size, markov_rank=ns.markov_rank, target_layer_ids=taps,
        draft_vocab_size=8192 if ns.draft_vocab_size is None else (ns.draft_vocab_size or None),
        eval_prompts=ns.eval_prompts, eval_max_new_tokens=ns.eval_max_new_tokens, markov_init=not ns.no_markov_init,
        val_prompts=ns.val_prompts, init_draft=ns.init_draft,
        init_vocab_size=ns.draft_vocab_size if ns.init_draft else None,
        train={"steps": ns.steps, "lr": ns.lr, "seqs_per_step": ns.seqs_per_step,
               "anchors_per_seq": ns.anchors_per_seq, "final_norm_lr_mult": ns.final_norm_lr_mult,
               "ce_weight": ns.ce_weight, "val_every": ns.val_every, "val_seqs": ns.val_seqs,
               "train_lm_head": ns.train_lm_head, "weight_decay": ns.weight_decay, "dropout": ns.dropout,
               "walk_anchor_frac": ns.walk_anchor_frac})
    run_pipeline(cfg, [s.strip() for s in ns.stages.split(",") if s.strip()])
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    logging.basicConfig(level=getattr(ns, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if ns.command == "generate":
            return _generate(ns)
        if ns.command == "train-draft":
            return _train_draft(ns)
        if ns.command == "serve":
            from sparkserve.entrypoints.http_server import launch_server
            return launch_server(ServerArgs.from_cli_args(ns).validate())
    except ValueError as e:          # bad flags or inputs: a message, not a traceback
        print(f"sparkserve: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
