-- 0027_schedules: the users' schedules (docs/job-types.md, "Schedules"), one row each.
--
-- compatible-with-older-workers: yes
--
-- A schedule is defined in code, in the retry config or in a crontab file; every worker and
-- `serve` writes the definitions it holds here when its scheduler starts (orc_schedules_sync),
-- and keeps the rest:
-- * fire_after: ticks after this instant are due. A process fires a schedule's due ticks in one
--   transaction that moves fire_after to the last of them only if it still holds the value the
--   process read (a compare-and-set), and submits their jobs: of several processes that race
--   for a tick, one moves it and submits, the others match nothing. Set to the row's creation
--   at first (nothing before a schedule was known runs, as Graphile Worker's known_crontabs'
--   known_since), and to the resume's instant by a resume (a paused schedule's ticks never run).
-- * last_tick, last_job_id: the latest tick fired and its job, for the listings.
-- * paused_at, paused_by: set while an operator holds it.
-- * the definition's columns (job type, expression, zone, tenant, backfill) are those of the
--   latest process to start; the listings and the tenant filter read them.
-- Older releases never read the table.

CREATE TABLE orc_schedules (
    name text PRIMARY KEY,
    job_type text NOT NULL,
    cron text NOT NULL,
    tz text NOT NULL,
    tenant_id text,
    backfill_seconds integer NOT NULL CHECK (backfill_seconds >= 0),
    fire_after timestamptz NOT NULL DEFAULT now(),
    last_tick timestamptz,
    last_job_id uuid,
    paused_at timestamptz,
    paused_by text,
    defined_at timestamptz NOT NULL DEFAULT now(),
    CHECK ((paused_at IS NULL) = (paused_by IS NULL))
);
