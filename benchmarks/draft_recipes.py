"""Held-out greedy tau of several DSpark drafts on several validation caches, one table: how the
draft-training recipe table in docs/draft-training-log.md is scored.

Each draft is a draft folder or a `train-draft` run (its OUT/draft/best, else OUT/draft); each
validation cache is a run's OUT/val/features, distilled greedily from held-out prompts
(ShareGPT's held-out part, or HumanEval through --prompts-file), captured with at least the
taps every draft reads. The offline
walk (training/validate.greedy_acceptance) replays greedy serving on the cached answers, so the
numbers equal what serving measures on those prompts (the parity check in the training log),
in seconds instead of minutes.

    python benchmarks/draft_recipes.py --drafts A=/tmp/rec/A,C=/tmp/rec/C \
        --val sharegpt=/tmp/rec/vs,humaneval=/tmp/rec/vh [--cost A=30,C=30] [--split-kinds]

--split-kinds scores each validation cache also as NAME/chat and NAME/code: its sequences split by
whether their prompt asks for code or maths (training/cache_kinds.py), so one held-out cache of
mixed prompts gives both columns.
"""
from __future__ import annotations

import argparse
import os

import torch
from results_io import machine_line, write_results


def _named(arg: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in arg.split(",") if item)


def draft_dir(run: str) -> str:
    """A draft folder itself, or a run's best validated draft, else its last one."""
    for d in (run, os.path.join(run, "draft", "best")):
        if os.path.exists(os.path.join(d, "config.json")):
            return d
    return os.path.join(run, "draft")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafts", required=True, help="NAME=RUN_DIR,... (train-draft --out folders)")
    ap.add_argument("--val", required=True, help="NAME=RUN_DIR,... whose val/features are scored")
    ap.add_argument("--cost", default="", help="NAME=CPU_MINUTES,... to print beside each draft")
    ap.add_argument("--model-path", default=None, help="the target (default: the embedded SmolLM2)")
    ap.add_argument("--name", default="draft_recipes", help="results file name")
    ap.add_argument("--split-kinds", action="store_true", help="also score each --val cache's chat and "
                                                               "code/maths sequences apart")
    args = ap.parse_args()
    from sparkserve import Engine
    from sparkserve.models.dspark_draft import load_dspark_draft
    from sparkserve.training.feature_cache import FeatureCache
    from sparkserve.training.validate import greedy_acceptance
    drafts, vals, cost = _named(args.drafts), _named(args.val), _named(args.cost)
    caches = {}
    for vname, vrun in vals.items():
        part = os.path.join(vrun, "val")
        caches[vname] = FeatureCache.open(os.path.join(part, "features"))
        if args.split_kinds:
            from sparkserve.training.cache_kinds import kind_subsets
            caches.update({f"{vname}/{k}": c for k, c in kind_subsets(caches[vname], part).items() if len(c)})
    rows = {}
    with Engine(args.model_path, max_total_tokens=1024, activation_quant="none") as eng, torch.no_grad():
        target = eng.scheduler.runner.model
        for name, run in drafts.items():
            draft = load_dspark_draft(draft_dir(run), target)
            taps = draft.config.target_layer_ids
            rows[name] = {"draft": draft_dir(run), "taps": taps, "cost_min": cost.get(name)}
            for vname, full in caches.items():
                res = greedy_acceptance(draft, full.with_taps(taps))
                rows[name][vname] = {"tau": res["tau"], "slot1": res["slot_accept"][0],
                                     "blocks": res["blocks"]}
            print(name, {v: round(rows[name][v]["tau"], 3) for v in caches})
    head = "| draft | taps | CPU min | " + " | ".join(f"{v} tau (slot-1)" for v in caches) + " |"
    lines = ["# Draft recipes: held-out greedy tau (offline walk)", "", machine_line(), "", head,
             "|" + "---|" * (3 + len(caches))]
    for name, r in rows.items():
        cells = " | ".join(f"{r[v]['tau']:.3f} ({r[v]['slot1']:.3f})" for v in caches)
        lines.append(f"| {name} | {','.join(map(str, r['taps']))} | {r['cost_min'] or '-'} | {cells} |")
    write_results(args.name, rows, lines)


if __name__ == "__main__":
    main()
