"""A rate-limit storm, with flow control off and on, in one run; and what a limit costs a no-op.

Storm: ``--jobs`` (2,000) ``llm_generate`` jobs of two tenants (tenant a's all submitted before
tenant b's, the worst case for first-come-first-served), three worker processes (concurrency 10
each, the built-in job types of ``tasks.app``), and the local LLM server (demo/llm_server.py)
allowing ``--rpm`` requests and ``--tpm`` tokens per ``--window`` seconds, with 429 +
Retry-After beyond. The same jobs run twice on a fresh database:

- **off**: today's per-job backoff: the default retry config's ``llm_generate`` (5 application
  retries, 5 s times 3 up to 300 s, full jitter; the server's Retry-After honoured, capped);
- **on**: the same type under ``[limits.anthropic]`` with the server's allowances less
  ``--headroom`` (5 %: the provider sees each request a moment after its claim).

For each it prints: 429s received as a share of the calls (goal with it on: ≤ 1 %), the rate
achieved ÷ the rate allowed (goal ≥ 0.9), each tenant's share of the starts while both waited
(goal with it on: 50 % ± 10 %), the jobs that failed, and the wall time.

The achieved rate is measured over whole windows: the calls that got through (one per completed
job, at its finish) in the ``k`` windows from the first one's, ``k`` as many as end before the
last one; the server allowed ``rpm · k`` in them. Over the whole span (first start to last
finish) a sliding window allows ``rpm · (span / window + 1)``, and that figure is printed too,
but it counts the last window's whole allowance however few jobs are left for it: with 2,000
jobs and a limit at 95 % of 200 per window, the last 100 run alone in an eleventh window, and
even a perfect schedule scores 0.91 on it.

Agent storm (``--modes agents``, also run by default): ``--agents`` (300) ``run_agent`` jobs of
five turns each (four calls of a tool that costs nothing, ``note``, then the answer: 1,500 LLM
calls), three worker processes of concurrency 10 (``bench.agent_app``), against the local LLM
server allowing ``--agent-rpm`` (150) requests and ``--agent-tpm`` (60,000) tokens per
``--window`` (10 s: the bench then ends in a few minutes), with 429 + Retry-After beyond.
Requests bind: each call costs the server about 150 tokens. Run twice:

- **configured**: the key's limit at 100 % of the server's allowance, no headroom;
- **learned**: a limit with no number (``learn = true``): the key learns its limits from the
  server's ``anthropic-ratelimit-*`` headers.

For each it prints: 429s ÷ calls (goal ≤ 1 % configured; learned, after the first window: goal
≤ 2 %), calls achieved ÷ allowed over whole windows (from the first call, as many as end before
the last call; goal ≥ 0.95), and the worker-seconds of slots held by waiting agents ÷ the
fleet's worker-seconds (its 30 slots from the first start to the last finish; goal ≤ 5 %). An
agent waits holding its slot only while a call waits in place for room that comes within 2 s
(each worker's ``orchestrator_flow_call_wait_seconds_total``, scraped at the end); a parked one
holds none (the parks are printed too).

No-op: ``--noop-jobs`` no-op jobs, one worker process (concurrency 10), drained with no limit,
then under a limit that never binds (concurrency 1,000 and 10,000,000 requests per minute, one
key): jobs/s each, and their ratio (goal ≥ 0.9), median of ``--rounds``.

    ./dev bench flow_control [--jobs 2000] [--rpm 200] [--window 10] [--noop-jobs 20000]
    ./dev bench flow_control --modes agents --skip-noop [--agents 300] [--agent-rpm 150]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg

from bench.common import fresh_database, machine, quiet_orchestrator, server_version
from demo import llm_server as llm
from orchestrator import JobContext, Orchestrator, Settings
from retry_config import DEFAULT_PATH

KEY = "sk-bench-flow-0123456789"
MODEL = "bench-model"
TENANTS = ("a", "b")
PROMPT = "Summarise the quarterly report in one sentence please"  # 9 words
MAX_TOKENS = 100


def storm_config(on: bool, rpm: int, tpm: int, window: float, headroom: float) -> Path:
    """The default retry config; with ``on``, llm_generate under a limit of the server's
    allowances less the headroom."""
    text = DEFAULT_PATH.read_text()
    if on:
        text = text.replace(
            "[job_types.llm_generate]\n", '[job_types.llm_generate]\nlimit = "anthropic"\n'
        )
        text += (
            f'\n[limits.anthropic]\nkey = "anthropic:{{payload.model}}"\n'
            f"requests = {int(rpm * (1 - headroom))}\nunits = {int(tpm * (1 - headroom))}\n"
            f'interval_seconds = {window}\nshare_by = "tenant"\n'
        )
    path = Path(tempfile.mkdtemp()) / "retry_config.toml"
    path.write_text(text)
    return path


def workers(dsn: str, config: Path, env: dict[str, str], n: int, app: str) -> list[Any]:
    environment = {
        **os.environ, "ORCHESTRATOR_HEALTH_PORT": "0", **env, "DATABASE_URL": dsn,
        "ORCHESTRATOR_RETRY_CONFIG": str(config),
    }  # fmt: skip
    return [
        subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "--app", app, "worker"],
            env=environment,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(n)
    ]


def stop(processes: list[Any]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


@dataclass(frozen=True)
class StormResult:
    mode: str
    calls: int
    rate_limited: int
    completed: int
    failed: int
    span: float  # first claim to last finish, seconds
    allowed: float  # requests the server allowed over that span
    windows: int  # whole windows from the first finish that end before the last one
    in_windows: int  # jobs that finished in them
    shares: dict[str, float]
    wall: float
    rpm: int

    @property
    def window_allowance(self) -> int:
        return self.rpm * self.windows

    def line(self) -> str:
        share = " ".join(f"{t} {v:.1%}" for t, v in sorted(self.shares.items()))
        return (
            f"flow control {self.mode:>3}: 429s {self.rate_limited}/{self.calls} calls "
            f"({self.rate_limited / max(1, self.calls):.1%}); "
            f"achieved ÷ allowed over {self.windows} whole windows "
            f"{self.in_windows}/{self.window_allowance} = "
            f"{self.in_windows / max(1, self.window_allowance):.2f}, over the whole span "
            f"{self.completed}/{self.allowed:.0f} = {self.completed / self.allowed:.2f}; "
            f"tenants while both waited: {share}; "
            f"failed {self.failed}; wall {self.wall:.1f}s"
        )


async def submit_storm(dsn: str, jobs: int, config: Path) -> None:
    """The jobs, submitted under the workers' retry config (a job's key is rendered at submit)."""
    orc = Orchestrator(settings=Settings(), dsn=dsn, retry_config_path=config)
    from tasks import llm as llm_task

    llm_task.register(orc)
    async with orc:
        specs = [
            {"job_type": "llm_generate", "tenant_id": tenant,
             "payload": {"model": MODEL, "max_tokens": MAX_TOKENS,
                         "messages": [{"role": "user", "content": PROMPT}]}}
            for tenant in TENANTS for _ in range(jobs // 2)
        ]  # fmt: skip
        for start in range(0, len(specs), 500):
            await orc.submit_many(specs[start : start + 500])


@dataclass(frozen=True)
class Outcome:
    completed: int
    failed: int
    span: float
    finishes: list[float]  # of the completed jobs, seconds from the first one
    shares: dict[str, float]  # each tenant's share of the starts while both waited

    def whole_windows(self, window: float) -> tuple[int, int]:
        """(k, jobs that finished in the k whole windows from the first finish that end before
        the last one)."""
        k = int((self.finishes[-1] if self.finishes else 0.0) // window)
        return k, sum(1 for t in self.finishes if t < k * window)


async def storm_outcome(dsn: str) -> Outcome:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'COMPLETED'),"
            " count(*) FILTER (WHERE status = 'FAILED'),"
            " extract(epoch FROM max(finished_at) - min(started_at)) FROM orc_jobs"
        )
        completed, failed, span = await cur.fetchone() or (0, 0, 0.0)
        cur = await conn.execute(
            "SELECT extract(epoch FROM finished_at - min(finished_at) OVER ()) FROM orc_jobs"
            " WHERE status = 'COMPLETED' ORDER BY finished_at"
        )
        finishes = [float(row[0]) for row in await cur.fetchall()]
        cur = await conn.execute(
            "SELECT j.tenant_id FROM orc_job_events AS e JOIN orc_jobs AS j ON j.id = e.job_id"
            " WHERE e.kind = 'job.running' ORDER BY e.at"
        )
        starts = [row[0] for row in await cur.fetchall()]
    first_b = starts.index("b") if "b" in starts else 0
    last_a = len(starts) - 1 - starts[::-1].index("a") if "a" in starts else len(starts)
    both = starts[first_b : last_a + 1] or starts
    shares = {t: both.count(t) / len(both) for t in TENANTS}
    return Outcome(completed, failed, float(span or 0.0), finishes, shares)


def storm(mode: str, args: argparse.Namespace) -> StormResult:
    with fresh_database("orc_bench_flow") as dsn, llm.serve(
        api_key=KEY, requests_per_window=args.rpm, tokens_per_window=args.tpm,
        window_seconds=args.window,
    ) as server:  # fmt: skip
        server.script(MODEL, [llm.Text("The quarter went well.")])
        config = storm_config(mode == "on", args.rpm, args.tpm, args.window, args.headroom)
        asyncio.run(submit_storm(dsn, args.jobs, config))
        env = {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": KEY}
        started = time.perf_counter()
        processes = workers(dsn, config, env, 3, "tasks.app:orc")
        try:
            deadline = started + args.timeout
            while asyncio.run(unfinished(dsn)) and time.perf_counter() < deadline:
                time.sleep(0.5)
        finally:
            wall = time.perf_counter() - started
            stop(processes)
        outcome = asyncio.run(storm_outcome(dsn))
        windows, in_windows = outcome.whole_windows(args.window)
        return StormResult(
            mode, server.stats()["total"], server.rate_limited, outcome.completed,
            outcome.failed, outcome.span, args.rpm * (outcome.span / args.window + 1), windows,
            in_windows, outcome.shares, wall, args.rpm,
        )  # fmt: skip


async def unfinished(dsn: str) -> int:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute("SELECT count(*) FROM orc_jobs WHERE finished_at IS NULL")
        row = await cur.fetchone()
        return int(row[0]) if row else 0


# -- the agent storm -----------------------------------------------------------------------------

AGENT_MODEL = "bench-agent"
AGENT_PROMPT = "Take four notes on the quarterly report, then summarise it in one sentence"
AGENT_SLOTS = 30  # three worker processes of concurrency 10


def agent_config(learn: bool, rpm: int, tpm: int, window: float) -> Path:
    """The default retry config, run_agent under a limit at 100 % of the server's allowance,
    or one that learns it (no number)."""
    numbers = "learn = true\n" if learn else f"requests = {rpm}\nunits = {tpm}\n"
    text = DEFAULT_PATH.read_text().replace(
        "[job_types.run_agent]\n", '[job_types.run_agent]\nlimit = "anthropic"\n'
    )
    text += (
        f'\n[limits.anthropic]\nkey = "anthropic:{{payload.model}}"\n{numbers}'
        f'interval_seconds = {window}\nshare_by = "none"\n'
    )
    path = Path(tempfile.mkdtemp()) / "retry_config.toml"
    path.write_text(text)
    return path


@dataclass(frozen=True)
class AgentStormResult:
    mode: str
    calls: int  # requests the server got
    rate_limited: int
    later_calls: int  # after the first window (from the first call)
    later_rate_limited: int
    windows: int  # whole windows from the first call that end before the last one
    in_windows: int  # calls answered in them
    rpm: int
    waited: float  # slot-seconds agents held while a call waited in place
    span: float  # first start to last finish, seconds
    parks: int
    completed: int
    failed: int

    def line(self) -> str:
        allowed = self.rpm * self.windows
        worker_seconds = AGENT_SLOTS * self.span
        return (
            f"agents, limit {self.mode:>10}: 429s {self.rate_limited}/{self.calls} calls "
            f"({self.rate_limited / max(1, self.calls):.2%}), after the first window "
            f"{self.later_rate_limited}/{self.later_calls} "
            f"({self.later_rate_limited / max(1, self.later_calls):.2%}); achieved ÷ allowed "
            f"over {self.windows} whole windows {self.in_windows}/{allowed} = "
            f"{self.in_windows / max(1, allowed):.2f}; slots held by waiting agents "
            f"{self.waited:.1f} of {worker_seconds:.0f} worker-seconds "
            f"({self.waited / max(1e-9, worker_seconds):.2%}); {self.parks} parks; "
            f"completed {self.completed}, failed {self.failed}; span {self.span:.1f}s"
        )


async def submit_agents(dsn: str, agents: int, config: Path) -> None:
    orc = Orchestrator(settings=Settings(), dsn=dsn, retry_config_path=config)
    from bench import agent_app
    from tasks import agent

    agent.register(orc, agent_app.TOOLS)
    async with orc:
        spec = {"job_type": "run_agent",
                "payload": {"prompt": AGENT_PROMPT, "model": AGENT_MODEL, "tools": ["note"],
                            "max_tokens": 100, "max_steps": 5}}  # fmt: skip
        await orc.submit_many([spec] * agents)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def waited_in_place(ports: list[int]) -> float:
    """The slot-seconds the workers' calls waited in place (their metric, summed)."""
    total = 0.0
    for port in ports:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for value in re.findall(
            r"^orchestrator_flow_call_wait_seconds_total\{[^}]*\} (\S+)$", text, re.MULTILINE
        ):
            total += float(value)
    return total


async def agent_outcome(dsn: str) -> tuple[int, int, float, list[float], int]:
    """(completed, failed, first start to last finish, the answered calls' times from the first
    one, parks)."""
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'COMPLETED'),"
            " count(*) FILTER (WHERE status = 'FAILED'),"
            " extract(epoch FROM max(finished_at) - min(started_at)) FROM orc_jobs"
        )
        completed, failed, span = await cur.fetchone() or (0, 0, 0.0)
        cur = await conn.execute(
            "SELECT extract(epoch FROM recorded_at - min(recorded_at) OVER ()) FROM orc_llm_usage"
            " ORDER BY recorded_at"
        )
        calls = [float(row[0]) for row in await cur.fetchall()]
        cur = await conn.execute(
            "SELECT count(*) FROM orc_job_events WHERE kind = 'job.waiting_for_capacity'"
        )
        parks = await cur.fetchone() or (0,)
    return int(completed), int(failed), float(span or 0.0), calls, int(parks[0])


def agent_storm(learn: bool, args: argparse.Namespace) -> AgentStormResult:
    with fresh_database("orc_bench_agents") as dsn, llm.serve(
        api_key=KEY, requests_per_window=args.agent_rpm, tokens_per_window=args.agent_tpm,
        window_seconds=args.window, agent_steps=4,
    ) as server:  # fmt: skip
        config = agent_config(learn, args.agent_rpm, args.agent_tpm, args.window)
        asyncio.run(submit_agents(dsn, args.agents, config))
        ports = [free_port() for _ in range(3)]
        env = {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": KEY,
               "ORCHESTRATOR_WORKER_CONCURRENCY": str(AGENT_SLOTS // 3)}  # fmt: skip
        processes = [
            workers(dsn, config, {**env, "ORCHESTRATOR_HEALTH_PORT": str(port)}, 1,
                    "bench.agent_app:orc")[0]
            for port in ports
        ]  # fmt: skip
        first_call: float | None = None
        after_first: tuple[int, int] | None = None  # (calls, 429s) at the first window's end
        try:
            deadline = time.perf_counter() + args.timeout
            while asyncio.run(unfinished(dsn)) and time.perf_counter() < deadline:
                time.sleep(0.2)
                stats = server.stats()
                if first_call is None and stats["total"]:
                    first_call = time.perf_counter()
                if (
                    after_first is None and first_call is not None
                    and time.perf_counter() >= first_call + args.window
                ):  # fmt: skip
                    after_first = (stats["total"], stats["rate_limited"])
            waited = waited_in_place(ports)
        finally:
            stop(processes)
        completed, failed, span, calls, parks = asyncio.run(agent_outcome(dsn))
        stats = server.stats()
        first_calls, first_limited = after_first or (0, 0)
        windows = math.floor((calls[-1] if calls else 0.0) / args.window)
        return AgentStormResult(
            "learned" if learn else "configured", stats["total"], stats["rate_limited"],
            stats["total"] - first_calls, stats["rate_limited"] - first_limited, windows,
            sum(1 for t in calls if t < windows * args.window), args.agent_rpm, waited, span,
            parks, completed, failed,
        )  # fmt: skip


# -- a no-op under a limit that never binds ---------------------------------------------------

NOOP_LIMIT = """
[limits.free]
key = "free"
concurrency = 1000
requests = 10000000
interval_seconds = 60

[job_types.noop]
limit = "free"
"""


def noop_app(dsn: str, config: Path | None = None) -> Orchestrator:
    orc = Orchestrator(settings=Settings(), dsn=dsn, retry_config_path=config)

    @orc.job_type("noop")
    async def noop(ctx: JobContext, payload: int) -> None:
        return None

    return orc


async def fill_noop(dsn: str, n: int, config: Path | None) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "TRUNCATE orc_job_events, orc_jobs, procrastinate_jobs, procrastinate_events,"
            " orc_flow_keys, orc_flow_spends RESTART IDENTITY CASCADE"
        )
    async with noop_app(dsn, config) as orc:
        for start in range(0, n, 1000):
            await orc.submit_many(
                {"job_type": "noop", "payload": i} for i in range(start, min(n, start + 1000))
            )
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("ANALYZE orc_jobs; ANALYZE orc_job_events; ANALYZE procrastinate_jobs")


async def drain_noop(dsn: str, config: str | None) -> float:
    quiet_orchestrator()
    async with noop_app(dsn, Path(config) if config else None) as orc:
        started = time.perf_counter()
        await orc.run_worker(concurrency=10, wait=False, install_signal_handlers=False)
        return time.perf_counter() - started


def noop_rounds(args: argparse.Namespace) -> tuple[float, float]:
    limited = Path(tempfile.mkdtemp()) / "retry_config.toml"
    limited.write_text(DEFAULT_PATH.read_text() + NOOP_LIMIT)
    rates: dict[str, list[float]] = {"none": [], "limit": []}
    with fresh_database("orc_bench_flow_noop") as dsn:
        for round_no in range(1, args.rounds + 1):
            for side, config in (("none", None), ("limit", limited)):
                asyncio.run(fill_noop(dsn, args.noop_jobs, config))
                command = [sys.executable, "-m", "bench.flow_control", "--drain", dsn]
                if config is not None:
                    command += ["--config", str(config)]
                out = subprocess.run(command, capture_output=True, text=True, check=True)
                seconds = float(out.stdout.strip().splitlines()[-1])
                rates[side].append(args.noop_jobs / seconds)
                print(
                    f"  round {round_no} no-op, {side:>5}: {rates[side][-1]:7.0f} jobs/s",
                    flush=True,
                )
    return statistics.median(rates["none"]), statistics.median(rates["limit"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=2_000)
    parser.add_argument("--rpm", type=int, default=200, help="requests per window")
    parser.add_argument("--tpm", type=int, default=24_000, help="tokens per window")
    parser.add_argument("--window", type=float, default=10.0, help="seconds")
    parser.add_argument("--headroom", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=900.0, help="per storm, seconds")
    parser.add_argument("--noop-jobs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-storm", action="store_true")
    parser.add_argument("--modes", default="off,on,agents",
                        help="the storms: off, on (the llm_generate storm), agents")  # fmt: skip
    parser.add_argument("--agents", type=int, default=300)
    parser.add_argument("--agent-rpm", type=int, default=150, help="requests per window")
    parser.add_argument("--agent-tpm", type=int, default=60_000, help="tokens per window")
    parser.add_argument("--skip-noop", action="store_true")
    parser.add_argument("--drain")  # child process: drain the no-op jobs of this database
    parser.add_argument("--config")
    args = parser.parse_args()
    if args.drain:
        print(asyncio.run(drain_noop(args.drain, args.config)))
        return
    with fresh_database("orc_bench_flow_probe") as dsn:
        print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
    modes = args.modes.split(",")
    if not args.skip_storm and {"off", "on"} & set(modes):
        print(
            f"storm: {args.jobs} llm_generate jobs of tenants a then b, 3 worker processes "
            f"(concurrency 10), the local server allowing {args.rpm} requests and {args.tpm} "
            f"tokens per {args.window:g} s ({args.rpm * 60 / args.window:.0f} requests/min), "
            f"429 + Retry-After beyond; limit at {1 - args.headroom:.0%} of that"
        )
        for mode in modes:
            if mode in ("off", "on"):
                print(storm(mode, args).line(), flush=True)
    if not args.skip_storm and "agents" in modes:
        print(
            f"agent storm: {args.agents} run_agent jobs of 5 turns, 3 worker processes "
            f"(concurrency 10), the local server allowing {args.agent_rpm} requests and "
            f"{args.agent_tpm} tokens per {args.window:g} s, 429 + Retry-After beyond; the limit "
            f"at 100 % of that, then learned from its headers"
        )
        for learn in (False, True):
            print(agent_storm(learn, args).line(), flush=True)
    if args.skip_noop:
        return
    none, limit = noop_rounds(args)
    print(
        f"no-op throughput (median of {args.rounds}): no limit {none:.0f} jobs/s, a limit that "
        f"never binds {limit:.0f} jobs/s; ratio {limit / none:.2f} (goal >= 0.9)"
    )


if __name__ == "__main__":
    main()
