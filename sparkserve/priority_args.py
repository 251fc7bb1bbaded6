"""The start-up checks of SGLang's priority scheduling flags (--enable-priority-scheduling and the
flags that need it) and the preemption threshold the scheduler runs with: an invalid combination
is refused naming the flags, never ignored."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

DEFAULT_PREEMPTION_THRESHOLD = 10   # SGLang's --priority-scheduling-preemption-threshold default


def preemption_threshold(args: Any) -> int | None:
    """The scheduler's preemption threshold; None: running requests are never preempted."""
    if not args.enable_priority_scheduling or args.disable_priority_preemption:
        return None
    threshold = args.priority_scheduling_preemption_threshold
    return DEFAULT_PREEMPTION_THRESHOLD if threshold is None else threshold


def validate_priority(args: Any, need: Callable[[bool, str], None]) -> None:
    threshold = args.priority_scheduling_preemption_threshold
    for flag, used in (("--schedule-low-priority-values-first", args.schedule_low_priority_values_first),
                       ("--disable-priority-preemption", args.disable_priority_preemption),
                       ("--priority-scheduling-preemption-threshold", threshold is not None)):
        need(not used or args.enable_priority_scheduling, f"{flag} needs --enable-priority-scheduling")
    need(threshold is None or not args.disable_priority_preemption,
         "--priority-scheduling-preemption-threshold with --disable-priority-preemption: there is no "
         "preemption to set a threshold for; drop one of the two flags")
    need(threshold is None or threshold >= 0,
         f"--priority-scheduling-preemption-threshold must be >= 0 (below 0 requests of equal priority "
         f"would preempt each other back and forth), got {threshold}")
