"""``./dev demo``: the orchestrator against local peers, in a database of its own.

The demo creates a new database, ``orc_demo_<random>``, on the server ``DATABASE_URL`` names (or
on the embedded one), and drops it at the end, also after an error or a Ctrl-C: it never sees,
runs or sweeps anyone else's jobs.

Part 1, retries: three ``http_request`` jobs, run by a worker in this process. One meets two
HTTP 429s (``Retry-After: 1``) and then succeeds; one gets a 400 and fails permanently; one gets
503 until its retry budget is spent. Each of the two failures notifies a person (a
``send_notification`` to a local on-call webhook, submitted with the failure).

Part 2, crash and recovery: an agent job of three checkpointed steps runs in a worker process.
Right after step 2 delivered its notification, and before the worker could record it, the
worker is killed (SIGKILL). A second worker's zombie sweep finds the job, which resumes at
step 2: the ledger asks the message service, learns the notification arrived, and does not send
it again.

Part 3, an LLM agent: a ``run_agent`` job (one LLM reply and the tool calls it asks for per
checkpointed step) against the bundled local Messages API server (demo/
llm_server.py), or against Anthropic's API with ``--real-llm`` and ``ANTHROPIC_API_KEY``. Its
tool, ``file_write``, writes under .orchestrator/demo-workspace.

Each job's final state, history and steps are printed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import tasks
from demo import agent, llm_server
from demo.peers import Peers, serve
from orchestrator.app import Orchestrator
from orchestrator.interfaces.render import describe
from orchestrator.settings import Settings
from orchestrator.storage.database import scratch_database

CONFIG = Path(__file__).with_name("retry_config.toml")
WORKSPACE = Path(".orchestrator") / "demo-workspace"
#: Worker processes of part 2: heartbeats every 0.2 s, zombies after 2 s, a sweep every second.
FAST = {
    "ORCHESTRATOR_HEARTBEAT_INTERVAL": "0.2",
    "ORCHESTRATOR_ZOMBIE_THRESHOLD": "2",
    "ORCHESTRATOR_SWEEP_CRON": "* * * * * *",
    "ORCHESTRATOR_RETRY_CONFIG": str(CONFIG),
    "ORCHESTRATOR_HEALTH_PORT": "0",
}


#: How to read what ``describe`` prints, shown before the first job.
LEGEND = """\
How to read a job:
  attempt N                  how many times a worker claimed the job, whichever layer retried it
  run n/m of this dispatch   the infrastructure layer: Procrastinate's runs of the job's current
                             dispatch (its Procrastinate job), of the type's worker_max_attempts;
                             an application retry gives the job a new dispatch, at run 1 again
  retries r/R                the application layer: retries used, of the type's app_max_retries
  job.degraded               what followed a failure for good: here a person is notified (a
                             send_notification job to the on-call webhook, submitted with the
                             failure); a notification that fails keeps its content instead
"""


#: The Ctrl-Cs received (main's handler, interrupt).
INTERRUPTED: list[signal.Signals] = []


def run(*, real_llm: bool = False, model: str = "claude-sonnet-4-5") -> int:
    """The demo, in a database of its own, dropped at the end whatever happens. A Ctrl-C is a
    KeyboardInterrupt."""
    settings = Settings()
    where = "the server DATABASE_URL names" if settings.database_url else "the embedded PostgreSQL"
    print(f"Creating the demo's own database on {where} ...")
    with scratch_database(settings, "orc_demo") as dsn:
        try:
            return asyncio.run(main(dsn, real_llm=real_llm, model=model))
        except asyncio.CancelledError:
            raise KeyboardInterrupt from None


async def main(dsn: str, *, real_llm: bool = False, model: str = "claude-sonnet-4-5") -> int:
    # A Ctrl-C cancels this task, and is remembered: a cancellation can be lost on its way (a
    # task that ends normally though cancelled), so every wait of the demo checks it as well.
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, interrupt, main_task)
    with serve() as peers:
        oncall = {"channel": "webhook", "url": f"{peers.url}/oncall"}
        settings = Settings(retry_config=CONFIG, health_port=0, escalation_target=oncall)
        orc = Orchestrator(settings=settings, dsn=dsn)
        tasks.register_all(orc)
        agent.register(orc)
        print(f"migrate: {await orc.migrate()}")
        async with orc:
            await retries(orc, peers)
            await crash_and_recovery(orc, peers)
            if real_llm:
                await agent_run(orc, model, "Anthropic's API")
            else:
                with llm_server.serve() as local:
                    os.environ["ANTHROPIC_BASE_URL"] = local.url
                    os.environ.setdefault("ANTHROPIC_API_KEY", "local-demo-key")
                    await agent_run(orc, model, f"the bundled local server at {local.url}")
    return 0


async def agent_run(orc: Orchestrator, model: str, where: str) -> None:
    print(f"#### Part 3: an LLM agent ({model}, {where})\n")
    os.environ.setdefault("ORCHESTRATOR_TOOL_WORKSPACE", str(WORKSPACE))
    prompt = (
        "Write a three-line poem about retry budgets to poem.txt with the file_write tool, "
        "then answer with the poem."
    )
    job_id = await orc.submit(
        "run_agent", {"prompt": prompt, "model": model, "tools": ["file_write"], "max_steps": 6}
    )
    worker = asyncio.create_task(orc.run_worker(install_signal_handlers=False))
    await until_finished(orc, [job_id], seconds=300)
    worker.cancel()
    await asyncio.gather(worker, return_exceptions=True)
    await show(orc, "the LLM agent", job_id)
    job = await orc.get_job(job_id)
    if isinstance(job.result, dict):
        for call in job.result["tool_calls"]:
            print(f"step {call['step']}: {call['tool']}({call['args']}) -> {call['output']}")
        print(f"answer: {job.result['answer']}")
        print(f"tokens: {job.result['usage']}\n")


async def retries(orc: Orchestrator, peers: Peers) -> None:
    print("\n#### Part 1: retries (a worker in this process)\n")
    jobs = {
        "meets two 429s, then succeeds": f"{peers.url}/flaky",
        "fails permanently (400)": f"{peers.url}/bad",
        "exhausts its retry budget (503)": f"{peers.url}/down",
    }
    ids = {label: await orc.submit("http_request", {"url": u}) for label, u in jobs.items()}
    worker = asyncio.create_task(orc.run_worker(install_signal_handlers=False))
    await until_finished(orc, list(ids.values()), seconds=60)
    notices = [
        UUID(e.payload["escalation_job_id"])
        for job_id in ids.values()
        for e in await orc.job_events(job_id)
        if e.kind == "job.degraded" and e.payload.get("escalation_job_id")
    ]
    await until_finished(orc, notices, seconds=30)
    worker.cancel()
    await asyncio.gather(worker, return_exceptions=True)
    print(LEGEND)
    for label, job_id in ids.items():
        await show(orc, label, job_id)
    for notice in peers.oncall:
        print(f"on-call webhook received, about job {notice['about_job_id']}:")
        print("  " + notice["text"].replace("\n", "\n  ") + "\n")


async def crash_and_recovery(orc: Orchestrator, peers: Peers) -> None:
    print("#### Part 2: a worker killed mid-step, its job recovered by the sweep\n")
    topic = "retry budgets"
    peers.messages.hold(f"brief on {topic} drafted")
    job_id = await orc.submit("research_brief", {"topic": topic, "notify_url": peers.url})
    first = start_worker(orc.dsn)
    try:
        await asyncio.to_thread(peers.messages.held.wait, 60)
        print(f"step 2 delivered its notification; killing worker pid {first.pid} (SIGKILL)")
        print("before it could record that it did.")
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        peers.messages.release()
        first.kill()
    started = time.monotonic()
    second = start_worker(orc.dsn)
    print(f"started worker pid {second.pid}; waiting for its sweep to find the job ...\n")
    try:
        await until_finished(orc, [job_id], seconds=60)
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=60)
    print(f"recovered and finished {time.monotonic() - started:.1f} s after the kill")
    await show(orc, "the agent job", job_id)
    invocation = next(iter(peers.messages.deliveries))
    print(f"notifications delivered for {invocation}: {peers.messages.deliveries[invocation]}\n")


def start_worker(dsn: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, **FAST, "DATABASE_URL": dsn}
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "--app", "demo.agent:orc", "worker"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def interrupt(main_task: asyncio.Task[int]) -> None:
    INTERRUPTED.append(signal.SIGINT)
    main_task.cancel()


async def until_finished(orc: Orchestrator, job_ids: list[UUID], *, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if INTERRUPTED:
            raise KeyboardInterrupt
        if all([(await orc.get_job(job_id)).finished_at for job_id in job_ids]):
            return
        await asyncio.sleep(0.1)
    print(f"(gave up waiting after {seconds:.0f} s)")


async def show(orc: Orchestrator, label: str, job_id: UUID) -> None:
    print(f"== {label}")
    job = await orc.get_job(job_id)
    print(describe(job, await orc.job_events(job_id), await orc.job_steps(job_id)))
    print()
