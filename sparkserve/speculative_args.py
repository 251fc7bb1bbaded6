"""The speculative flags beside DSpark's (NGRAM's, SGLang's names) and the start-up checks of
--speculative-algorithm: ServerArgs inherits them. sparkserve verifies one chain of drafts found in
the request's own tokens, so a value that asks for a tree (breadth > 1) or for SGLang's n-gram cache
shared by all requests is refused naming the flag, never ignored."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

SPECULATIVE_ALGORITHMS = ("DSPARK", "NGRAM")
NGRAM_MATCH_TYPES = ("BFS", "PROB")
PLANNER_MODES = ("full", "threshold", "adaptive")     # speculative/planner.py's MODES
# flags of one speculative algorithm, refused with the other (or with none)
# (the verify planner's flags, --speculative-dspark-verify-mode / -confidence-threshold /
# -sps-table-path, serve NGRAM too: it plans with its drafts' measured acceptance)
DSPARK_FLAGS = ("speculative_draft_model_path", "speculative_dspark_block_size")
NGRAM_FLAGS = ("speculative_num_draft_tokens", "speculative_ngram_min_match_window_size",
               "speculative_ngram_max_match_window_size", "speculative_ngram_min_bfs_breadth",
               "speculative_ngram_max_bfs_breadth", "speculative_ngram_match_type",
               "speculative_ngram_branch_length", "speculative_ngram_capacity")
SHARED_CACHE_FLAGS = ("speculative_ngram_branch_length", "speculative_ngram_capacity")
BREADTH_FLAGS = ("speculative_ngram_min_bfs_breadth", "speculative_ngram_max_bfs_breadth")


def server_info_fields(info: dict, algorithm: str | None, described: dict | None) -> dict:
    """/server_info's args (`info`) with the speculative fields of the algorithm in use only: the
    other one's flags (and, without one, both's) are left out, and the drafter's own account
    (`described`: SpecWorker.describe) is added under the algorithm's names."""
    algorithm = algorithm.upper() if algorithm else None
    dspark = [k for k in info if k.startswith("speculative_dspark_")] + list(DSPARK_FLAGS)
    drop = {"DSPARK": NGRAM_FLAGS, "NGRAM": dspark}.get(algorithm, (*dspark, *NGRAM_FLAGS))
    out = {k: v for k, v in info.items() if k not in drop}
    if algorithm == "DSPARK" and described:
        out.update(speculative_draft_model_path=described["draft_model_path"],
                   speculative_dspark_verify_mode=described["verify_mode"],
                   speculative_dspark_block_size=described["block_size"])
    elif algorithm == "NGRAM" and described:     # its planner reads the --speculative-dspark-* planner flags
        out.update(speculative_ngram_verify_mode=described["verify_mode"])
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(kw_only=True)     # keyword-only: ServerArgs(path, ...) keeps its own fields first
class SpeculativeArgs:
    speculative_num_draft_tokens: int | None = field(default=None, metadata={"help": (
        "NGRAM: most tokens verified per step, the request's last token included (drafts: one fewer) "
        "(default: --speculative-ngram-max-match-window-size, as SGLang)")})
    speculative_ngram_min_match_window_size: int | None = field(default=None, metadata={"help": (
        "NGRAM: fewest latest tokens that must have occurred before to draft (default 1)")})
    speculative_ngram_max_match_window_size: int | None = field(default=None, metadata={"help": (
        "NGRAM: most latest tokens matched; the longest match wins (default 12)")})
    speculative_ngram_min_bfs_breadth: int | None = field(default=None, metadata={"help": (
        "NGRAM: only 1 (one chain of drafts is verified, not a tree)")})
    speculative_ngram_max_bfs_breadth: int | None = field(default=None, metadata={"help": (
        "NGRAM: only 1 (one chain of drafts is verified, not a tree; SGLang's default is 10)")})
    speculative_ngram_match_type: str | None = field(default=None, metadata={"help": (
        "NGRAM: BFS drafts what followed the latest occurrence of the match (default); PROB what most "
        "of its occurrences continue with, token by token"), "choices": NGRAM_MATCH_TYPES})
    speculative_ngram_branch_length: int | None = field(default=None, metadata={"help": (
        "NGRAM: SGLang's depth of its shared n-gram cache; refused (sparkserve searches each request's "
        "own tokens)")})
    speculative_ngram_capacity: int | None = field(default=None, metadata={"help": (
        "NGRAM: SGLang's size of its shared n-gram cache; refused (sparkserve searches each request's "
        "own tokens)")})

    def _refuse_flags(self, need, flags: tuple[str, ...], why: str) -> None:
        given = [_flag(f) for f in flags if getattr(self, f) is not None]
        need(not given, f"{' '.join(given)}: {why}")

    def _validate_speculative(self, need) -> None:
        algo = self.speculative_algorithm.upper()
        need(algo in SPECULATIVE_ALGORITHMS, f"--speculative-algorithm {self.speculative_algorithm}: use "
                                             f"{' or '.join(SPECULATIVE_ALGORITHMS)}")
        if algo == "DSPARK":
            self._refuse_flags(need, NGRAM_FLAGS, "needs --speculative-algorithm NGRAM")
            self._validate_dspark(need)
            return
        self.speculative_algorithm = "NGRAM"
        self._refuse_flags(need, DSPARK_FLAGS, "needs --speculative-algorithm DSPARK (NGRAM has no draft "
                                               "model; --speculative-num-draft-tokens sets its drafts)")
        self._validate_ngram(need)

    def _validate_ngram(self, need) -> None:
        """NGRAM's flags, SGLang's defaults filled in."""
        for flag in SHARED_CACHE_FLAGS:
            need(getattr(self, flag) is None,
                 f"{_flag(flag)}: sizes SGLang's n-gram cache shared by all requests; sparkserve's NGRAM "
                 "searches each request's own prompt and output and has no such cache; drop the flag")
        for flag in BREADTH_FLAGS:
            value = getattr(self, flag)
            need(value in (None, 1), f"{_flag(flag)} {value}: a breadth above 1 drafts a tree, and "
                                     "sparkserve verifies one chain of drafts; give 1 (or leave it out)")
        lo = self.speculative_ngram_min_match_window_size
        hi = self.speculative_ngram_max_match_window_size
        lo = self.speculative_ngram_min_match_window_size = 1 if lo is None else lo
        hi = self.speculative_ngram_max_match_window_size = 12 if hi is None else hi
        need(1 <= lo <= hi, f"--speculative-ngram-min-match-window-size {lo} / "
                            f"--speculative-ngram-max-match-window-size {hi}: need 1 <= min <= max")
        if self.speculative_num_draft_tokens is None:
            self.speculative_num_draft_tokens = hi
        need(self.speculative_num_draft_tokens >= 2,
             f"--speculative-num-draft-tokens {self.speculative_num_draft_tokens}: must be >= 2 (the "
             "request's last token and at least one draft)")
        mt = self.speculative_ngram_match_type = (self.speculative_ngram_match_type or "BFS").upper()
        need(mt in NGRAM_MATCH_TYPES,
             f"--speculative-ngram-match-type {mt}: use {' or '.join(NGRAM_MATCH_TYPES)}")
        self._validate_planner(need)

    def _validate_planner(self, need) -> None:
        """The verify planner's flags, which NGRAM shares with DSpark."""
        mode, thr = self.speculative_dspark_verify_mode, self.speculative_dspark_confidence_threshold
        need(mode in (None, *PLANNER_MODES),
             f"--speculative-dspark-verify-mode {mode}: use {', '.join(PLANNER_MODES)}")
        need(thr is None or 0.0 <= thr <= 1.0,
             f"--speculative-dspark-confidence-threshold must be in [0, 1], got {thr}")
        need(not (mode == "threshold" and thr is None),
             "--speculative-dspark-verify-mode threshold needs --speculative-dspark-confidence-threshold")
        table = self.speculative_dspark_sps_table_path
        need(table is None or os.path.isfile(table),
             f"--speculative-dspark-sps-table-path {table} does not exist")
