"""What retention costs: batched deletes of finished jobs on an indexed finish time, against
dropping a day's partition of a time-partitioned event table.

    ./dev bench retention [--jobs 1000000] [--batch 1000] [--batches 50] [--without INDEX]

On a fresh database, ``--jobs`` finished jobs of 10 types, finished evenly over the last 10
days in finish order, with time-ordered ids (as a running fleet writes them): 94 % COMPLETED,
3 % CANCELLED, 3 % FAILED with a discarded dead letter each; three events and one finished
dispatch per job (what a job that runs once leaves). Printed:
  * the build time of migration 0025's two indexes on that table (dropped and built again);
  * prune_finished's statement (the real query, through RetentionStore) deleting ``--batches``
    batches of ``--batch`` due jobs (a 5-day retention: half the jobs are due), without and
    with the archive's JSON: milliseconds per batch, jobs and rows per second, and the share
    of one server core that 100 finished jobs/s (8.6 million a day) would need;
  * a run that finds nothing due (a type probe per job type and status);
  * the baseline, in the same run: the same events copied into a table partitioned by day,
    and the time to DROP one day's partition (a tenth of the events), per job.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import statistics
import time

import psycopg

from bench.common import fresh_database, machine, server_version
from orchestrator.domain.retention import DAY, Retention
from orchestrator.domain.states import Status
from orchestrator.storage.database import create_pool
from orchestrator.storage.stores import Stores

DAYS = 10
JOBS = """
INSERT INTO orc_jobs (id, job_type, status, payload, queue, max_attempts, max_retries, trace_id,
                      created_at, started_at, finished_at)
SELECT (lpad(to_hex((extract(epoch FROM f) * 1000)::bigint), 12, '0') || '7'
        || substr(md5(i::text), 1, 19))::uuid,  -- time-ordered, as the orchestrator's UUIDv7
       'type_' || (i %% 10), s, '{"prompt": "summarise the ticket"}',
       'type_' || (i %% 10), 3, 3, md5(i::text), f - interval '2 s', f - interval '1 s', f
  FROM generate_series(1, %(jobs)s) AS i,
       LATERAL (SELECT now() - (%(jobs)s - i) * make_interval(secs => %(span)s / %(jobs)s) AS f,
                       CASE WHEN i %% 100 < 94 THEN 'COMPLETED'
                            WHEN i %% 100 < 97 THEN 'CANCELLED' ELSE 'FAILED' END AS s) AS x
 ORDER BY i
"""
EVENTS = """
INSERT INTO orc_job_events (job_id, kind, at, payload)
SELECT j.id, k.kind, j.finished_at - k.back, k.payload
  FROM orc_jobs AS j,
       (VALUES ('job.created', interval '2 s', '{"job_type": "type_1", "queue": "type_1"}'::jsonb),
               ('job.running', interval '1 s', '{"attempt": 1, "run": 1, "worker": "w/1"}'),
               ('job.completed', interval '0 s', '{"attempt": 1, "duration_ms": 812}'))
       AS k (kind, back, payload)
 ORDER BY j.finished_at
"""
DISPATCHES = """
INSERT INTO procrastinate_jobs (queue_name, task_name, lock, args, status, attempts)
SELECT j.queue, 'orc.' || j.job_type, j.id::text, jsonb_build_object('job_id', j.id),
       'succeeded', 1
  FROM orc_jobs AS j ORDER BY j.finished_at
"""
LETTERS = """
INSERT INTO orc_dead_letters (id, job_id, job_type, payload, error, state, discard_requested_by,
                              discarded_by)
SELECT gen_random_uuid(), id, job_type, payload, '{}', 'discarded', 'ann', 'bob'
  FROM orc_jobs WHERE status = 'FAILED'
"""
INDEXES = {
    "orc_jobs_finished_by_type": "CREATE INDEX orc_jobs_finished_by_type ON orc_jobs"
    " (job_type, status, finished_at) WHERE finished_at IS NOT NULL",
    "orc_procrastinate_jobs_finished_lock": "CREATE INDEX orc_procrastinate_jobs_finished_lock"
    " ON procrastinate_jobs (lock) WHERE status NOT IN ('todo', 'doing') AND lock IS NOT NULL",
    "orc_jobs_replay_of": "CREATE INDEX orc_jobs_replay_of ON orc_jobs (replay_of)"
    " WHERE replay_of IS NOT NULL",
    "orc_dead_letters_requeued_job_id": "CREATE INDEX orc_dead_letters_requeued_job_id"
    " ON orc_dead_letters (requeued_job_id) WHERE requeued_job_id IS NOT NULL",
}


async def fill(dsn: str, jobs: int, without: list[str]) -> dict[str, float]:
    """Load the jobs; the seconds each 0025 index takes to build on them (but those named in
    ``without``, left out: what they save)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for name in INDEXES:
            await conn.execute(f"DROP INDEX {name}")  # built again below, timed
        await conn.execute("ALTER TABLE orc_jobs DISABLE TRIGGER USER")  # a bulk load
        await conn.execute("ALTER TABLE orc_job_events DISABLE TRIGGER USER")
        await conn.execute(JOBS, {"jobs": jobs, "span": DAYS * DAY})
        await conn.execute(EVENTS)
        await conn.execute(DISPATCHES)
        await conn.execute(LETTERS)
        await conn.execute("ALTER TABLE orc_jobs ENABLE TRIGGER USER")
        await conn.execute("ALTER TABLE orc_job_events ENABLE TRIGGER USER")
        builds = {}
        for name, sql in INDEXES.items():
            if name in without:
                continue
            started = time.perf_counter()
            await conn.execute(sql)
            builds[name] = time.perf_counter() - started
        for table in ("orc_jobs", "orc_job_events", "procrastinate_jobs", "orc_dead_letters"):
            await conn.execute(f"VACUUM ANALYZE {table}")
        for name in INDEXES.keys() - set(without):
            cur = await conn.execute("SELECT pg_relation_size(%s::regclass)", (name,))
            builds[f"{name} bytes/job"] = (await cur.fetchone() or [0])[0] / jobs
        return builds


async def prune(
    dsn: str, retention: Retention, *, batch: int, batches: int, archive: bool
) -> tuple[list[float], int, int]:
    """Seconds per batch, jobs and rows deleted."""
    pool = create_pool(dsn, min_size=1, max_size=2)
    await pool.open()
    try:
        stores = Stores.on(pool)
        times, jobs, rows, archived = [], 0, 0, 0
        for _ in range(batches):
            started = time.perf_counter()
            async with stores.queries.transaction() as conn:
                done = await stores.retention.prune_jobs(
                    retention, limit=batch, archive=archive, dry_run=False, conn=conn
                )
            times.append(time.perf_counter() - started)
            if archive:  # what the archive file takes per job, as RunArchive writes it
                lines = b"".join(json.dumps(j.archived).encode() + b"\n" for j in done)
                archived += len(gzip.compress(lines))
            jobs += len(done)
            rows += sum(1 + sum(j.rows.values()) for j in done)
            if len(done) < batch:
                break
        if archive:
            print(f"  archive: {archived / max(jobs, 1):,.0f} bytes/job, gzip-compressed")
        return times, jobs, rows
    finally:
        await pool.close()


async def partition_drop(dsn: str) -> tuple[float, int]:
    """The events copied into a table partitioned by day; seconds to drop the oldest day's
    partition, and the events it held."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "CREATE TABLE bench_events (LIKE orc_job_events) PARTITION BY RANGE (at)"
        )
        for day in range(DAYS + 1):
            await conn.execute(
                f"CREATE TABLE bench_events_{day} PARTITION OF bench_events FOR VALUES FROM"
                f" (date_trunc('day', now()) - interval '{DAYS - day} days')"
                f" TO (date_trunc('day', now()) - interval '{DAYS - day - 1} days')"
            )
        await conn.execute(
            "CREATE TABLE bench_events_old PARTITION OF bench_events FOR VALUES FROM (MINVALUE)"
            f" TO (date_trunc('day', now()) - interval '{DAYS} days')"
        )
        await conn.execute("INSERT INTO bench_events SELECT * FROM orc_job_events")
        await conn.execute("ALTER TABLE bench_events ADD PRIMARY KEY (job_id, id, at)")
        await conn.execute("VACUUM ANALYZE bench_events")
        cur = await conn.execute("SELECT count(*) FROM bench_events_1")
        held = (await cur.fetchone() or [0])[0]
        started = time.perf_counter()
        await conn.execute("DROP TABLE bench_events_1")
        return time.perf_counter() - started, int(held)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1_000)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument(
        "--without", action="append", default=[], choices=sorted(INDEXES),
        help="leave this index of 0025 out (repeatable): what it saves",
    )  # fmt: skip
    args = parser.parse_args()
    half = Retention(
        default={Status.COMPLETED: DAYS / 2 * DAY, Status.CANCELLED: DAYS / 2 * DAY,
                 Status.FAILED: DAYS / 2 * DAY}
    )  # fmt: skip
    with fresh_database("orc_bench_retention") as dsn:
        print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
        started = time.perf_counter()
        builds = asyncio.run(fill(dsn, args.jobs, args.without))
        print(f"loaded {args.jobs:,} finished jobs in {time.perf_counter() - started:.0f} s")
        for name, figure in builds.items():
            print(f"  index {name}: {figure:.1f}" + ("" if "bytes" in name else " s to build"))
        seconds, held = asyncio.run(partition_drop(dsn))  # before the deletes
        results = {}
        for archive in (False, True):
            times, jobs, rows = asyncio.run(
                prune(dsn, half, batch=args.batch, batches=args.batches, archive=archive)
            )
            results[archive] = sum(times) / max(jobs, 1)
            ms = [t * 1_000 for t in times]
            label = "with archive JSON" if archive else "prune_finished"
            print(
                f"  {label:<18} {len(times)} batches of {args.batch}: median"
                f" {statistics.median(ms):.0f} ms, max {max(ms):.0f} ms; {jobs / sum(times):,.0f}"
                f" jobs/s, {rows / sum(times):,.0f} rows/s; {results[archive] * 1e6:.0f} us/job:"
                f" 100 jobs/s keep one connection busy"
                f" {results[archive] * 100 * 100:.1f} % of the time"
            )
        nothing = Retention(default=dict.fromkeys(half.default, 365 * DAY))
        times, _, _ = asyncio.run(prune(dsn, nothing, batch=args.batch, batches=5, archive=False))
        print(f"  a run with nothing due: {statistics.median(times) * 1_000:.1f} ms")
        per_job = seconds / max(held / 3, 1)
        print(
            f"  baseline: DROP of one day's event partition ({held:,} events) {seconds * 1_000:.0f}"
            f" ms, {per_job * 1e6:.2f} us/job; batched delete / partition drop:"
            f" {results[False] / per_job:.0f}x"
        )


if __name__ == "__main__":
    main()
