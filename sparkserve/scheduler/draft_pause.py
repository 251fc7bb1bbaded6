"""When a request drafts again, and when its rows stop becoming draft context.

A request whose proposals verify nothing backs off drafting for 2, 4, .. DRAFT_BACKOFF_MAX tokens.
After DARK_IDLE such proposals in a row (every back-off tried: its drafts have not paid for ~60
tokens) it goes dark for DARK_BACKOFF tokens: no draft pass, and the rows it commits are not made
draft context (no projection into the draft's KV; a decode forward whose requests are all dark runs
without the target's taps), save the last DRAFT_BACKOFF_MAX before it drafts again. A new request
starts from the latest proposal's streak, but not dark: a draft that did not pay on the traffic
before is tried once more on its own rows. The rows left out are
its `draft_gaps`, which the draft pass leaves out of its context: drafts read less, never wrong
rows, and verification keeps the output lossless whatever they read. A dark request wakes early
(drafts again after WAKE_ROWS rows, its streak restarted) when the batch it runs in has fewer
requests than when its latest proposal came to nothing: what barred it (a batch whose forward is
bound by the arithmetic of its rows) may be gone."""
from __future__ import annotations

from sparkserve.core.req import Req
from sparkserve.speculative.worker import SpecWorker

DRAFT_BACKOFF_MAX = 32       # longest plain-decode stretch of a request whose drafts don't pay
DARK_IDLE = 7                # vain proposals in a row (back-offs 2 .. 32 all tried) before going dark
DARK_BACKOFF = 256           # tokens a dark request decodes plainly before it drafts again
WAKE_ROWS = 8                # rows made draft context again before a dark request drafts


def back_off(req: Req) -> None:
    """After its streak of vain proposals (spec_idle), when `req` drafts next."""
    idle = req.spec_idle
    if idle >= DARK_IDLE:
        req.spec_resume_at = len(req.output_ids) + DARK_BACKOFF
    elif idle >= 2:
        req.spec_resume_at = len(req.output_ids) + min(2 ** (idle - 1), DRAFT_BACKOFF_MAX)


def is_dark(req: Req) -> bool:
    """Whether the rows `req` commits now stay out of the draft context: its next draft pass is
    further off than any back-off's."""
    return req.spec_resume_at - len(req.output_ids) > DRAFT_BACKOFF_MAX


def wake_in_smaller_batch(req: Req, batch: int) -> None:
    """A dark request in a batch of `batch` requests, fewer than when it went dark, drafts again
    after WAKE_ROWS rows, its streak restarted."""
    if batch < req.spec_batch and is_dark(req):
        req.spec_idle = 1
        req.spec_resume_at = len(req.output_ids) + WAKE_ROWS


def note_gap(req: Req, start: int, end: int) -> None:
    """Positions [start, end) of `req` were committed without becoming draft context."""
    gaps = req.draft_gaps
    if gaps and gaps[-1][1] == start:
        gaps[-1][1] = end
    else:
        gaps.append([start, end])


def trim_gaps(req: Req, end: int) -> None:
    """Positions from `end` on are computed again (a retracted request's prefill): their rows
    become draft context anew."""
    req.draft_gaps = [[a, min(b, end)] for a, b in req.draft_gaps if a < end]


def wake(spec: SpecWorker | None, running: list[Req]) -> None:
    """Each dark request of `running` whose batch shrank wakes (wake_in_smaller_batch), under a
    drafter `spec` that backs off."""
    if spec is not None and spec.backs_off:
        for r in running:
            wake_in_smaller_batch(r, len(running))


def all_dark(spec: SpecWorker | None, running: list[Req]) -> bool:
    """Whether, under a drafter `spec` that backs off, no request of this decode step keeps its rows
    (as draft context or hidden states): its forward then skips the target's taps."""
    return spec is not None and spec.backs_off and all(is_dark(r) and r.hidden_parts is None for r in running)


def recomputed(reqs) -> None:
    """A prefill computes each request's rows from its kv_len on (again, for a retracted one):
    they become draft context anew."""
    for r in reqs:
        trim_gaps(r, r.kv_len)


def lit_groups(fb, groups: list) -> list:
    """The (request, rows) groups of forward `fb` whose rows become draft context; each dark
    request's (all of them, in a forward run without taps) are noted as its gap instead."""
    for req, rows in groups:
        if len(rows) and (is_dark(req) or not fb.aux_hidden):
            note_gap(req, int(fb.positions[rows[0]]), int(fb.positions[rows[-1]]) + 1)
    return [(req, rows) for req, rows in groups if not is_dark(req)] if fb.aux_hidden else []
