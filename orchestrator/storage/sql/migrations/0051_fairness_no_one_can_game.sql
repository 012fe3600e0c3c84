-- 0051_fairness_no_one_can_game: fairness inside a flow key follows what each share's calls
-- really spent, and a share may be capped (docs/flow-control.md, "Fairness"; issue 35, items 5
-- and 6). A share's virtual time is charged at each start and call (its estimate, bounded to
-- [1, the units one share may hold] whatever was declared) and corrected to the reply's usage
-- (at least 1 a call); a limit's `tenant_share` caps the concurrency, requests and units one
-- share holds (its spends now name their share); the waiters of a share go in their jobs'
-- priority order. A fallback model's call is admitted against that model's key
-- (orc_flow_call_window_v2, orc_flow_call_spend_v2, orc_flow_park_v2, which replace their v1s:
-- no release that ran before them called them), only a provider's pause may be passed by a
-- type with fallback models, and an operator's pause stays the operator's when a hint extends
-- it. Compatible: the release before (0032) calls none of the functions retired, and its
-- writes of limits leave tenant_share unset.
--
-- compatible-with-older-workers: yes
-- revises: functions/retired.sql de90394a047b937c3d17ff2653c3236542d4cc20038a8099205448b72db50028
-- revises: functions/flow.sql 879eed54407675b0adda9e284269735cf0bfadcea5bff0f23257cef8dd7d131d

ALTER TABLE orc_flow_limits
    ADD COLUMN tenant_share double precision
        CONSTRAINT orc_flow_limits_tenant_share_check CHECK (tenant_share > 0 AND tenant_share <= 1);

ALTER TABLE orc_flow_spends ADD COLUMN share text;

ALTER TABLE orc_flow_waiters ADD COLUMN priority integer NOT NULL DEFAULT 0;
UPDATE orc_flow_waiters AS w SET priority = j.priority FROM orc_jobs AS j WHERE j.id = w.job_id;
DROP INDEX orc_flow_waiters_line;
CREATE INDEX orc_flow_waiters_line ON orc_flow_waiters (key, share, priority, seq)
    WHERE dispatched_at IS NULL;

ALTER TABLE orc_flow_waiters DROP CONSTRAINT orc_flow_waiters_blocked_on_check;
ALTER TABLE orc_flow_waiters ADD CONSTRAINT orc_flow_waiters_blocked_on_check
    CHECK (blocked_on IN ('concurrency', 'requests', 'units', 'paused', 'line', 'share'));
