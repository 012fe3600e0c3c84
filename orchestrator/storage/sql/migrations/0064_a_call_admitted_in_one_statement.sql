-- 0064_a_call_admitted_in_one_statement: a running job's call is admitted in one statement
-- (orc_flow_admit_call_v1, functions/flow_calls.sql; docs/flow-control.md, "Every call
-- admitted"): the window read under the key's lock, the share's cap and the learned allowances
-- applied, the verdict decided (the fit rule: orc_flow_call_room_v1) and the spend recorded,
-- the key's lock held for that statement only (before: the window read, the verdict decided
-- in Python with the lock held across the round trip, the spend recorded). An external
-- worker's call-admit is answered once per call id: orc_flow_admitted_calls keeps a call
-- admitted under its attempt and id, with its spend, so that the same call asked again (its
-- answer lost on the way) is answered as it was and not counted twice.
-- Compatible: the release before admits a call through orc_flow_call_window_v2 and
-- orc_flow_call_spend_v3, which stay as they are (orc_flow_call_spend_v3 is also the new
-- function's recording step; orc_flow_call_window_v2 is no longer called by this release and
-- goes, to functions/retired.sql, once no older worker runs), and it never names a call id.
--
-- compatible-with-older-workers: yes
-- revises: functions/flow_calls.sql 6676a05505ba38b456af18b62d5e040b27c306a406f35b0a355cdf8d7ba9c9ad

CREATE TABLE orc_flow_admitted_calls (
    job_id uuid NOT NULL REFERENCES orc_jobs (id) ON DELETE CASCADE,
    attempt integer NOT NULL,
    call_id text NOT NULL,
    key text NOT NULL,
    spend bigint,
    PRIMARY KEY (job_id, attempt, call_id)
);
