"""Why a request ended, as SGLang names it: the scheduler sets one, the wire carries it, and
`to_json()` is what meta_info shows. Plain classes without torch: the HTTP frontend uses them too."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


class BaseFinishReason:
    type: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class FINISH_MATCHED_TOKEN(BaseFinishReason):
    """A stop token id or EOS was sampled."""
    matched: int
    type: ClassVar[str] = "stop"

    def to_json(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


@dataclass(frozen=True)
class FINISH_MATCHED_STR(BaseFinishReason):
    """A stop string appeared in the output text."""
    matched: str | None
    type: ClassVar[str] = "stop"

    def to_json(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


@dataclass(frozen=True)
class FINISH_LENGTH(BaseFinishReason):
    """max_new_tokens reached (0 for a request that only ran its prompt)."""
    length: int
    type: ClassVar[str] = "length"

    def to_json(self) -> dict[str, Any]:
        return {"type": "length", "length": self.length}


@dataclass(frozen=True)
class FINISH_ABORT(BaseFinishReason):
    """Aborted: by the client, by shutdown (status_code 503) or by a dead scheduler (500)."""
    message: str = "aborted"
    status_code: int | None = None
    type: ClassVar[str] = "abort"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "abort", "message": self.message}
        if self.status_code is not None:
            out["status_code"] = self.status_code
        return out
