"""The command line: `python -m sparkserve`, help that shows defaults and choices, `generate`
without server-only flags, and start-up errors that name the flag before any model loads."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sparkserve import cli
from sparkserve.args import ServerArgs
from sparkserve.embedded import shipped_draft_path


def _help(capsys, *argv: str) -> str:
    """The help text of a subcommand, line wrapping undone."""
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_python_dash_m_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "sparkserve", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "serve" in out.stdout and "train-draft" in out.stdout


def test_help_shows_defaults_choices_and_what_generate_takes(capsys):
    serve = _help(capsys, "serve")
    assert "(default: 64)" in serve and "{full,threshold,adaptive}" in serve
    assert "--port" in serve and "{round_robin,shortest_queue}" in serve and "--attn-cp-size" in serve
    gen = _help(capsys, "generate")
    assert "--max-new-tokens" in gen and "answer length limit" in gen and "--model-path" in gen
    for server_only in ("--port", "--host", "--api-key", "--max-queued-requests", "--served-model-name"):
        assert server_only not in gen, server_only


def test_bad_draft_is_refused_before_the_model_loads(tmp_path, llama_dir, capsys, monkeypatch):
    monkeypatch.setattr("sparkserve.scheduler.runtime.load_model",
                        lambda *a, **k: pytest.fail("a model was loaded"))
    empty = tmp_path / "nodraft"
    empty.mkdir()
    assert cli.main(["serve", "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path",
                     str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--speculative-draft-model-path" in err and "no config.json" in err
    assert cli.main(["generate", "hi", "--model-path", llama_dir, "--speculative-algorithm", "DSPARK"]) == 2
    assert "a draft is shipped only for the embedded default model" in capsys.readouterr().err


def test_embedded_dspark_resolves_the_shipped_draft():
    args = ServerArgs(speculative_algorithm="DSPARK").validate()
    assert args.speculative_draft_model_path == shipped_draft_path(args.model_path)
    assert os.path.isfile(os.path.join(args.speculative_draft_model_path, "config.json"))
    assert args.served_model_name == "SmolLM2-135M-Instruct" and args.verify_mode == "adaptive"
    assert ServerArgs(speculative_dspark_confidence_threshold=0.5).verify_mode == "threshold"
