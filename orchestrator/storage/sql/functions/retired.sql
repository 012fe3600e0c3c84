-- Functions no release uses any more, dropped by name: a function leaves its concept file and
-- its DROP comes here, in the same change as a migration that revises both files (and says
-- whether the release before can run without it: docs/architecture.md, "Where the SQL lives").
-- Applied before the other files.

DROP FUNCTION IF EXISTS orc_flow_dispatch_v1(uuid[], timestamptz, text);

-- The fetch of migration 0019 (queues of external job types left alone), which only releases
-- between 0019 and 0028 called: since 0029 the fetch is orc_fetch_dispatches_v3.
DROP FUNCTION IF EXISTS orc_fetch_dispatches_v2(
    integer, varchar[], varchar[], bigint, text, text, text[], text);
DROP FUNCTION IF EXISTS orc_fetch_dispatch_v2(
    varchar[], varchar[], bigint, text, text, text[], text);

-- A tenant derived from the row it comes from had a trigger function per table; since 0036 both
-- triggers run orc_inherited_tenant_v1 (tenants.sql). CASCADE drops the trigger still on an old
-- function, which tenants.sql, changed in the same release, puts back on the new one.
DROP FUNCTION IF EXISTS orc_jobs_replay_tenant_v1() CASCADE;
DROP FUNCTION IF EXISTS orc_dead_letters_tenant_v1() CASCADE;

-- The fetch of releases before flow control (0001-0028); the release before this one (0032)
-- fetches with orc_fetch_dispatches_v3.
DROP FUNCTION IF EXISTS orc_fetch_dispatches_v1(integer, varchar[], bigint, text, text, text[], text);
DROP FUNCTION IF EXISTS orc_fetch_dispatch_v1(varchar[], bigint, text, text, text[], text);

-- Events' append-only rule and a committed side effect's finality had a function each; since
-- 0043 both triggers run orc_history_is_final_v1 (history.sql). CASCADE as above: history.sql
-- and checkpoints.sql, changed in the same release, put the triggers back.
DROP FUNCTION IF EXISTS orc_events_append_only_v1() CASCADE;
DROP FUNCTION IF EXISTS orc_side_effect_committed_is_final_v1() CASCADE;

-- A running job's call read and recorded its job's own key only, and a parked job was sent for
-- no later time (0047); since 0051 a call names its model (a fallback model's key) and a park
-- its earliest time: orc_flow_call_window_v2, orc_flow_call_spend_v2, orc_flow_park_v2. The
-- release before (0032) calls none of them.
DROP FUNCTION IF EXISTS orc_flow_call_window_v1(text, uuid, text, boolean);
DROP FUNCTION IF EXISTS orc_flow_call_spend_v1(text, uuid, bigint, boolean);
DROP FUNCTION IF EXISTS orc_flow_park_v1(uuid, uuid, text[], bigint, text, boolean);

-- A running job's call was recorded at the instant it was admitted only (0047, 0051); since 0052
-- a call whose room comes soon is admitted for that instant, its spend placed there ahead
-- (orc_flow_call_spend_v3 over orc_flow_record_spend_v2, which takes the spend's instant and
-- answers its id). The release before (0032) calls neither directly.
DROP FUNCTION IF EXISTS orc_flow_call_spend_v2(text, uuid, bigint, boolean);
DROP FUNCTION IF EXISTS orc_flow_record_spend_v1(text, uuid, integer, bigint);

-- The release of migration 0069, which deleted its jobs' counts itself: since 0070 the settle
-- deletes them as it counts down, and orc_dependencies_release_v2 takes what it returned.
DROP FUNCTION IF EXISTS orc_dependencies_release_v1(uuid[]);
