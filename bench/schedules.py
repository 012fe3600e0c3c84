"""Schedules: what a scheduler's check costs with many schedules, and how late a tick's job is
submitted.

    ./dev bench schedules [--counts 1,100,1000,10000] [--seconds 10]

1. check: one check of a scheduler holding N schedules, none due (what every worker and
   ``serve`` does at each wake-up): its time, against a ping (``SELECT 1`` through the same
   pool) measured in the same run. Target: one statement whatever N, so the check's time is
   the ping's plus the next-tick computations in Python, a few tens of µs per schedule.
2. lateness: three schedulers (three pools, as three processes) over one schedule firing every
   second for ``--seconds`` s; for each tick, the time from the tick to its job's insertion
   (``orc_jobs.created_at - run_at``). Target: p50 under 50 ms (a scheduler sleeps until the
   tick, it never polls), and exactly one job per tick.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import psycopg

from bench.common import fresh_database, machine, percentile, quiet_orchestrator, server_version
from orchestrator import JobContext, Orchestrator, Settings


def application(dsn: str, schedules: int, cron: str) -> Orchestrator:
    orc = Orchestrator(settings=Settings(pool_min_size=1, pool_max_size=2), dsn=dsn)

    @orc.job_type("noop")
    async def noop(ctx: JobContext, payload: Any) -> None:
        return None

    for n in range(schedules):
        orc.schedule(f"s{n}", "noop", cron=cron, tz="Europe/Paris")
    return orc


async def check(dsn: str, count: int, rounds: int = 20) -> tuple[float, float]:
    """Median seconds of a check with ``count`` schedules none due, and of a ping."""
    orc = application(dsn, count, "0 7 * * *")
    async with orc:
        await orc.stores.schedules.sync(orc.application, orc.schedules.values())
        scheduler = orc.scheduler()
        checks, pings = [], []
        for _ in range(rounds + 3):
            started = time.perf_counter()
            result = await scheduler.run_once()
            checks.append(time.perf_counter() - started)
            started = time.perf_counter()
            await orc.stores.liveness.ping()
            pings.append(time.perf_counter() - started)
            assert result.fired == 0
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute("TRUNCATE orc_schedules")
        return statistics.median(checks[3:]), statistics.median(pings[3:])


async def lateness(dsn: str, seconds: float) -> None:
    orcs = [application(dsn, 0, "") for _ in range(3)]
    for orc in orcs:
        orc.schedule("every_second", "noop", cron="* * * * * *")
        await orc.open()
    tasks = [asyncio.create_task(orc.scheduler().run()) for orc in orcs]
    await asyncio.sleep(seconds)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for orc in orcs:
        await orc.close()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT extract(epoch FROM created_at - run_at), job_key FROM orc_jobs"
            " WHERE job_key LIKE 'schedule/every_second/%' ORDER BY run_at"
        )
        rows = await cur.fetchall()
    late = [float(seconds) * 1000 for seconds, _ in rows]
    keys = {key for _, key in rows}
    print(
        f"lateness, 3 schedulers, {len(rows)} ticks ({len(keys)} distinct): "
        f"p50 {percentile(late, 50):.1f} ms, p90 {percentile(late, 90):.1f} ms, "
        f"max {max(late):.1f} ms (target p50 < 50 ms, one job per tick)"
    )


async def run(dsn: str, counts: list[int], seconds: float) -> None:
    print(f"{machine()}; {await server_version(dsn)}")
    for count in counts:
        spent, ping = await check(dsn, count)
        print(
            f"check, {count:>6} schedules none due: {spent * 1000:8.2f} ms "
            f"(ping {ping * 1000:.2f} ms; ratio {spent / ping:6.1f}; "
            f"{(spent - ping) / count * 1e6:6.1f} µs per schedule beyond the ping)"
        )
    await lateness(dsn, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counts", default="1,100,1000,10000")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    quiet_orchestrator()
    with fresh_database("orc_bench_schedules") as dsn:
        asyncio.run(run(dsn, [int(n) for n in args.counts.split(",")], args.seconds))


if __name__ == "__main__":
    main()
