"""What the dashboard's pages cost the server with a big table: the jobs list (its first page,
a status filter, a tenant filter, an older page) and the overview, with 1,000,000 jobs.

    ./dev bench ui [--jobs 1000000] [--loads 30]

The table is bench/fleet_scrape.py's settled fleet (95 % finished, 200 tenants, dead letters),
ANALYZEd and VACUUMed. A real ``orchestrator serve`` answers; the time printed is the server's
own (its ``Server-Timing`` header), median and slowest of ``--loads`` loads of each page
(target: the jobs list under 200 ms). The overview is read once per 2 s for every viewer: its
median is the cache's, its slowest the read itself (bench/overview.py times that read alone,
cache off, over a day of rolled-up history). The baseline named is the same page on an empty
table, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
from pathlib import Path

import httpx

from bench.common import api_token, fresh_database, machine, server_version, serving
from bench.fleet_scrape import LETTERS, SETTLED, fill
from orchestrator.domain.principals import Scope

ROOT = Path(__file__).resolve().parent.parent
#: The fleet bench's dead letters carry no error (it only counts them); these pages show it.
LETTER_ERRORS = """
UPDATE orc_dead_letters
   SET error = jsonb_build_object('ts', now(), 'message', '400 Bad Request', 'code', 'HTTP_400',
                                  'classification', 'PERMANENT', 'attempt', 1, 'terminal', true)
"""
PAGES = {
    "jobs": "/ui/jobs",
    "jobs?status=RETRY": "/ui/jobs?status=RETRY",
    "jobs?tenant_id=tenant_7": "/ui/jobs?tenant_id=tenant_7",
    "jobs (a later page)": None,  # the next-page link of the first page
    "overview": "/ui/fragments/overview",
}


def server_ms(response: httpx.Response) -> float:
    timing = response.headers["server-timing"]
    return float(timing.split("dur=")[1])


def measure(url: str, secret: str, loads: int) -> dict[str, list[float]]:
    with httpx.Client(base_url=url, follow_redirects=False) as browser:
        form = browser.get("/ui/login").text  # its CSRF token, in the form and a cookie
        csrf = re.search(r'name="csrf" value="([^"]+)"', form)
        assert csrf, form
        signed = browser.post(
            "/ui/login", data={"token": secret, "next": "/ui/jobs", "csrf": csrf.group(1)}
        )
        assert signed.status_code == 303, signed.text
        first = browser.get("/ui/jobs").text
        cursor = re.search(r"cursor=([0-9a-f-]{36})", first)
        older = cursor.group(1) if cursor else ""
        times: dict[str, list[float]] = {}
        for name, path in PAGES.items():
            path = path or f"/ui/jobs?cursor={older}"
            times[name] = []
            for _ in range(loads):
                response = browser.get(path)
                response.raise_for_status()
                times[name].append(server_ms(response))
    return times


def serve(dsn: str, secret: str, loads: int) -> dict[str, list[float]]:
    with serving(dsn) as url:
        return measure(url, secret, loads)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--loads", type=int, default=30)
    args = parser.parse_args()
    with fresh_database("orc_bench_ui") as dsn:
        print(f"machine: {machine()}, PostgreSQL {asyncio.run(server_version(dsn))}")
        secret = asyncio.run(api_token(dsn, Scope.READ))
        empty = serve(dsn, secret, args.loads)
        asyncio.run(fill(dsn, [SETTLED, LETTERS, LETTER_ERRORS], args.jobs))
        full = serve(dsn, secret, args.loads)
    print(f"server time per page (Server-Timing), {args.loads} loads each; "
          f"{args.jobs:,} jobs against an empty table")  # fmt: skip
    for name in PAGES:
        big, small = full[name], empty[name]
        print(f"  {name:<26} median {statistics.median(big):6.1f} ms, max {max(big):6.1f} ms"
              f"   (empty table: median {statistics.median(small):5.1f} ms)")  # fmt: skip
    worst = max(statistics.median(full[n]) for n in PAGES if n.startswith("jobs"))
    print(f"jobs list, slowest median: {worst:.1f} ms (target < 200 ms)")


if __name__ == "__main__":
    main()
