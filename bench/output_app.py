"""The job type of ``./dev bench output_streams`` (``--app bench.output_app:orc``): ``ticker``
writes a text delta ``rate`` times a second for ``seconds``, each delta the time it was made
(epoch seconds) and a ``;``, so that a reader can tell each delta's age when it reads it."""

from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel

from orchestrator import JobContext, Orchestrator


class Ticks(BaseModel):
    rate: float = 50.0
    seconds: float = 10.0


async def ticker(ctx: JobContext, payload: Ticks) -> int:
    every, made = 1 / payload.rate, 0
    start = time.monotonic()
    while made < round(payload.rate * payload.seconds):
        ctx.output.text(f"{time.time():.6f};")
        made += 1
        await asyncio.sleep(max(0.0, start + made * every - time.monotonic()))
    return made


def register(orc: Orchestrator) -> None:
    orc.job_type("ticker")(ticker)


orc = Orchestrator()
register(orc)
