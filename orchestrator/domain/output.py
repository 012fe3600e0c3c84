"""A job's live output as readers see it (docs/output.md): chunks at per-job offsets, each marked
with the attempt and step that wrote it. Pure: no I/O."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

#: What a chunk holds: a text delta (or several, batched), a progress record, or a marker
#: written by the database (``superseded``: an attempt's output from a step on is made again by
#: the next attempt; ``cut``: the job's output reached its size cap, and nothing more is kept).
OutputKind = Literal["text", "progress", "superseded", "cut"]


class OutputChunk(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    offset: int  # its place in the job's output: 0, 1, 2..., never reused
    attempt: int  # the attempt that wrote it (a marker: the attempt it is about)
    step: int | None  # the checkpointed step it was written in (None: outside any step)
    kind: OutputKind
    #: text: the text; progress: the record; superseded: {attempt, step}; cut: {max_bytes}.
    body: Any
    written_at: datetime
