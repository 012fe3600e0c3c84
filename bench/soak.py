"""Soak: a million no-op jobs through workers while retention prunes what they finish.

    ./dev bench soak [--jobs 1000000] [--workers 1] [--concurrency 10] [--retention 60]

Jobs are submitted in batches of 1,000 while ``--workers`` worker processes run them; the
submitter keeps at most ``--backlog`` jobs unfinished (counted every half second, topped up in
whole batches), so the run measures a steady fleet, not a queue filled first and drained
after. Retention is short (``--retention`` seconds for every finished job) and otherwise as it
ships (the prune every minute, going on while jobs are due, for up to
``ORCHESTRATOR_RETENTION_RUN_SECONDS``), so pruning runs during the soak, on the same tables the
workers write; a job also waits for the rollups to count it (their watermark trails the clock
by one to two minutes), which sets the plateau's height.

It prints, per tenth of the jobs (a decile: the time from the previous tenth finished to this
one), the jobs/s of that decile and, at its end, each table's size and its indexes' size, its
live and dead tuples, and how often autovacuum and autoanalyze have run on it. Goals (printed
as verdicts): the last decile's throughput at least 0.9 x the first's, and the tables' and
indexes' total size at the end at most 1.1 x its size at the fifth decile (a plateau once
retention deletes as fast as jobs finish), and the last decile at least 0.8 x the plain drain.

The plain drain is ``./dev bench throughput``'s orchestrator side, measured in the same run on a
database of its own, before the soak and after it: ``--drain-jobs`` no-op jobs queued
beforehand, then one worker process of the same concurrency runs them until the queue is empty,
with nothing submitted and nothing pruned meanwhile. The verdict takes the faster of the two
drains, so the machine's drift within the run counts against the soak.

Finished-job counts are read as "submitted minus unfinished" (an indexed count of the live
jobs): a count of COMPLETED rows would shrink as retention deletes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import psycopg

from bench import throughput
from bench.common import fresh_database, machine, quiet_orchestrator, server_version
from orchestrator import JobContext, Orchestrator, Settings

#: The tables a soak writes (those absent from the schema are left out of the report).
TABLES = (
    "orc_jobs", "orc_job_events", "orc_dead_letters", "orc_checkpoints", "orc_side_effects",
    "orc_rollups", "orc_queue_depth", "procrastinate_jobs", "procrastinate_events",
    "procrastinate_periodic_defers",
)  # fmt: skip
BATCH = 1000
#: Seconds between two counts of the unfinished jobs: each count is the bench's own cost on the
#: server the fleet uses (tens of milliseconds against a job table that retention keeps churning),
#: so it is taken no more often than the backlog needs (at 2,000 jobs/s, a second drains 2,000
#: of its 5,000).
POLL = 0.5


def settings(retention_seconds: float) -> Settings:
    """Every finished job kept ``retention_seconds``; retention otherwise as it ships: a fleet
    at its full rate needs no tuning of the prune (docs/operations.md, "Sizing")."""
    days = retention_seconds / 86_400
    return Settings(
        metrics=False,
        health_port=0,
        job_retention_days=days,
        failed_job_retention_days=days,
    )


def soak_app(dsn: str, retention_seconds: float) -> Orchestrator:
    orc = Orchestrator(settings=settings(retention_seconds), dsn=dsn)

    @orc.job_type("noop")
    async def noop(ctx: JobContext, payload: int) -> None:
        return None

    return orc


async def work(dsn: str, concurrency: int, retention_seconds: float) -> None:
    """One worker process: runs until SIGTERM (and drains)."""
    quiet_orchestrator()
    async with soak_app(dsn, retention_seconds) as orc:
        await orc.run_worker(concurrency=concurrency)


@dataclass
class Sample:
    decile: int
    seconds: float
    jobs_per_second: float
    tables: dict[str, dict[str, int]]
    indexes: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(t["table_bytes"] + t["index_bytes"] for t in self.tables.values())


async def tables(conn: psycopg.AsyncConnection[tuple[object, ...]]) -> dict[str, dict[str, int]]:
    rows = await (
        await conn.execute(
            "SELECT relname, pg_table_size(relid), pg_indexes_size(relid), n_live_tup, "
            "n_dead_tup, autovacuum_count, autoanalyze_count FROM pg_stat_user_tables "
            "WHERE relname = ANY(%s) ORDER BY relname",
            [list(TABLES)],
        )
    ).fetchall()
    keys = ("table_bytes", "index_bytes", "live", "dead", "autovacuums", "autoanalyzes")
    return {str(r[0]): dict(zip(keys, (int(v) for v in r[1:]), strict=True)) for r in rows}


async def indexes(conn: psycopg.AsyncConnection[tuple[object, ...]]) -> dict[str, int]:
    """Each index's size: which of them, if any, keeps growing once retention deletes."""
    rows = await (
        await conn.execute(
            "SELECT indexrelname, pg_relation_size(indexrelid) FROM pg_stat_user_indexes "
            "WHERE relname = ANY(%s) ORDER BY relname, indexrelname",
            [list(TABLES)],
        )
    ).fetchall()
    return {str(r[0]): int(r[1]) for r in rows if int(r[1]) > 1_000_000}


async def unfinished(conn: psycopg.AsyncConnection[tuple[object, ...]]) -> int:
    row = await (
        await conn.execute("SELECT count(*) FROM orc_jobs WHERE finished_at IS NULL")
    ).fetchone()
    return int(row[0]) if row else 0


def soak(dsn: str, args: argparse.Namespace) -> list[Sample]:
    """The worker processes, running while the submitter feeds them."""
    command = [
        sys.executable, "-m", "bench.soak", "--work", "--dsn", dsn,
        "--concurrency", str(args.concurrency), "--retention", str(args.retention),
    ]  # fmt: skip
    workers = [subprocess.Popen(command) for _ in range(args.workers)]
    try:
        return asyncio.run(feed(dsn, args))
    finally:
        for process in workers:
            process.send_signal(signal.SIGTERM)
        for process in workers:
            process.wait(timeout=60)


async def feed(dsn: str, args: argparse.Namespace) -> list[Sample]:
    """Submit in batches, at most ``--backlog`` unfinished; a sample at each tenth finished."""
    samples: list[Sample] = []
    async with (
        soak_app(dsn, args.retention) as orc,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn,
    ):
        submitted = 0
        step = args.jobs // 10
        started = last = time.perf_counter()
        while len(samples) < 10:
            live = await unfinished(conn)
            if submitted - live >= step * (len(samples) + 1):
                now = time.perf_counter()
                sample = Sample(len(samples) + 1, now - started, step / (now - last),
                                await tables(conn), await indexes(conn))  # fmt: skip
                samples.append(sample)
                last = now
                print(json.dumps({"decile": sample.decile,
                                  "jobs_per_second": round(sample.jobs_per_second),
                                  "bytes": sample.total_bytes}), flush=True)  # fmt: skip
                continue
            while live < args.backlog and submitted < args.jobs:
                n = min(BATCH, args.jobs - submitted)
                await orc.submit_many(
                    {"job_type": "noop", "payload": submitted + i} for i in range(n)
                )
                submitted += n
                live += n
            await asyncio.sleep(POLL)
    return samples


def plain_drain(jobs: int, concurrency: int) -> float:
    """The throughput bench's drain of ``jobs`` queued no-op jobs, in jobs/s."""
    with fresh_database("orc_soak_drain") as dsn:
        asyncio.run(throughput.fill_orc(dsn, jobs))
        asyncio.run(throughput.analyze(dsn))
        rate = jobs / throughput.drain("orc", dsn, concurrency)
    print(json.dumps({"plain_drain_jobs_per_second": round(rate)}), flush=True)
    return rate


def report(samples: list[Sample], drains: list[float], args: argparse.Namespace) -> None:
    print(f"\n{args.jobs:,} no-op jobs, {args.workers} workers x concurrency {args.concurrency}, "
          f"retention {args.retention:g} s (the prune's other settings as they ship), "
          f"wall {samples[-1].seconds:,.0f} s")  # fmt: skip
    heading = ("decile", "jobs/s", "table MB", "index MB", "dead", "autovac")
    print("{:>6} {:>7} {:>9} {:>9} {:>9} {:>7}".format(*heading))
    for s in samples:
        t = s.tables.values()
        print(
            f"{s.decile:>6} {s.jobs_per_second:>7.0f} "
            f"{sum(x['table_bytes'] for x in t) / 1e6:>9.1f} "
            f"{sum(x['index_bytes'] for x in t) / 1e6:>9.1f} "
            f"{sum(x['dead'] for x in t):>9,} {sum(x['autovacuums'] for x in t):>7}"
        )
    print("\nper table at each decile (table MB / index MB / live / dead / autovacuum runs):")
    for name in samples[-1].tables:
        cells = []
        for s in samples:
            x = s.tables.get(name)
            if x:
                cells.append(f"{x['table_bytes'] / 1e6:.1f}/{x['index_bytes'] / 1e6:.1f}/"
                             f"{x['live']}/{x['dead']}/{x['autovacuums']}")  # fmt: skip
        print(f"  {name}: " + "  ".join(cells))
    print("\nper index over 1 MB at each decile (MB):")
    for name in samples[-1].indexes:
        sizes = (f"{s.indexes[name] / 1e6:.1f}" if name in s.indexes else "-" for s in samples)
        print(f"  {name}: " + " ".join(sizes))
    ratio = samples[-1].jobs_per_second / samples[0].jobs_per_second
    growth = samples[-1].total_bytes / samples[4].total_bytes
    print(f"\nthroughput last ÷ first decile: {ratio:.2f} (goal ≥ 0.9): "
          f"{'met' if ratio >= 0.9 else 'NOT met'}")  # fmt: skip
    print(f"size at the end ÷ size at the fifth decile: {growth:.2f} (goal ≤ 1.1, a plateau): "
          f"{'met' if growth <= 1.1 else 'NOT met'}")  # fmt: skip
    against = samples[-1].jobs_per_second / max(drains)
    print(
        f"plain drain ({args.drain_jobs:,} jobs, one worker x concurrency {args.concurrency}) "
        f"before and after: {', '.join(f'{d:,.0f}' for d in drains)} jobs/s; last decile ÷ "
        f"the faster: {against:.2f} (goal ≥ 0.8): {'met' if against >= 0.8 else 'NOT met'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=1, help="1: the plain drain's fleet")
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--retention", type=float, default=60.0, help="seconds")
    parser.add_argument("--backlog", type=int, default=5000, help="most jobs unfinished at once")
    parser.add_argument("--drain-jobs", type=int, default=20_000, help="the plain drain's jobs")
    parser.add_argument("--work", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dsn", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.work:
        asyncio.run(work(args.dsn, args.concurrency, args.retention))
        return
    if args.jobs < 10 * BATCH:
        parser.error("--jobs: at least 10,000 (ten deciles of whole batches)")
    print(json.dumps({"machine": machine()}))
    drains = [plain_drain(args.drain_jobs, args.concurrency)]
    with fresh_database("orc_soak") as dsn:
        print(json.dumps({"server": asyncio.run(server_version(dsn))}))
        samples = soak(dsn, args)
    drains.append(plain_drain(args.drain_jobs, args.concurrency))
    report(samples, drains, args)


if __name__ == "__main__":
    main()
