"""Command line: `sparkserve serve | generate | router | train-draft | build-kernels` (also
`python -m sparkserve ...`).
Flags follow SGLang's names; every flag comes from a dataclass field (see --help)."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from sparkserve.args import ServerArgs
from sparkserve.dataclass_cli import add_dataclass_args, dataclass_from_args


def _parser() -> argparse.ArgumentParser:
    from sparkserve.training.config import PipelineConfig, TrainConfig
    p = argparse.ArgumentParser(prog="sparkserve", description="LLM serving engine on PyTorch")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser("serve", help="start the OpenAI- and SGLang-compatible HTTP server")
    ServerArgs.add_cli_args(serve)

    gen = sub.add_parser("generate", help="generate an answer for one prompt and print it")
    gen.add_argument("prompt", help="the user message (chat template applied unless --raw)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    gen.add_argument("--system", default=None, help="system message")
    gen.add_argument("--json", action="store_true",
                     help="print the result's meta_info as JSON instead of the text")
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--max-new-tokens", type=int, default=256,
                          help="answer length limit (default: 256)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    sampling.add_argument("--top-k", type=int, default=-1,
                          help="sample from the k most likely tokens (default: -1, all)")
    sampling.add_argument("--seed", type=int, default=None, help="seed of this request's sampling")
    ServerArgs.add_cli_args(gen.add_argument_group("engine"), server=False)
    gen.set_defaults(log_level="warning")      # the answer, not the batch log, on the terminal

    rt = sub.add_parser("router", help="route requests over prefill and decode servers (PD disaggregation)",
                        description="Pair one --prefill and one --decode server per request (round robin "
                                    "over the healthy ones) and send it to both; the decode server answers. "
                                    "Flags as sglang-router's PD mode.")
    rt.add_argument("--prefill", nargs="+", action="append", required=True, metavar=("URL", "BOOTSTRAP_PORT"),
                    help="a prefill server and the port of its bootstrap service (default: 8998; none: "
                         "each decode server's own --disaggregation-bootstrap-port); repeatable")
    rt.add_argument("--decode", action="append", required=True, metavar="URL",
                    help="a decode server; repeatable")
    rt.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    rt.add_argument("--port", type=int, default=30000, help="port to listen on (default: 30000)")
    rt.add_argument("--health-check-interval", type=float, default=10.0, metavar="S",
                    help="seconds between GET /health checks of every server; one that fails is skipped "
                         "until it passes (default: 10)")
    rt.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                    help="default: info")

    tr = sub.add_parser("train-draft", help="train a DSpark draft for a model (self-distillation)")
    add_dataclass_args(tr.add_argument_group("pipeline"), PipelineConfig)
    add_dataclass_args(tr.add_argument_group("training"), TrainConfig)
    sub.add_parser("build-kernels", help="build the C++ CPU kernels (install step) or name the cached build",
                   description="Build the C++ CPU kernels into the cache (~/.cache/sparkserve/kernels/, or "
                               "$XDG_CACHE_HOME's) that every later start loads, or name the build already "
                               "there; a failed build prints the compiler's message and exits 1.")
    return p


def _build_kernels() -> int:
    import time

    from sparkserve.kernels import build
    t0 = time.monotonic()

    def announce(path: str) -> None:
        print(f"sparkserve: building the C++ CPU kernels (about a minute) into {path}", flush=True)
    try:
        path, built, what = build.build_kernels(announce)
    except ValueError as e:          # nothing to build here: serve runs the torch path
        print(f"sparkserve: the C++ CPU kernels are not used here ({e}); nothing to build")
        return 0
    except Exception as e:
        print(f"sparkserve: error: the C++ CPU kernels failed to build in {build.build_dir()}:\n"
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    state = f"built in {time.monotonic() - t0:.0f} s" if built else "already built"
    print(f"sparkserve: C++ CPU kernels {state}: {path} ({what})")
    return 0


def _generate(ns: argparse.Namespace) -> int:
    from sparkserve.entrypoints.engine import Engine
    engine = Engine(**dataclass_from_args(ServerArgs, ns).to_dict())
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
    print(json.dumps(last["meta_info"]) if ns.json else "")
    return 0


def _train_draft(ns: argparse.Namespace) -> int:
    from sparkserve.training.config import PipelineConfig, TrainConfig
    from sparkserve.training.pipeline import run_pipeline
    run_pipeline(dataclass_from_args(PipelineConfig, ns, train=dataclass_from_args(TrainConfig, ns)))
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
        if ns.command == "build-kernels":
            return _build_kernels()
        if ns.command == "router":
            from sparkserve.entrypoints.router import run_router
            return run_router(ns.prefill, ns.decode, ns.host, ns.port, ns.health_check_interval, ns.log_level)
        if ns.command == "serve":
            from sparkserve.entrypoints.launch import launch_server
            return launch_server(ServerArgs.from_cli_args(ns).validate())
    except ValueError as e:          # bad flags or inputs: a message, not a traceback
        print(f"sparkserve: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
