-- 0046_flow_holds_for_changes: flow control holds through changes (docs/flow-control.md).
-- A fetch waits for one flow key's lock at most and only tries any other, so fetches meeting
-- keys in different orders cannot deadlock (functions/claim.sql). Any change to a key's pause
-- (set, shortened, extended, lifted) and to its limit reschedules the waiters sent ahead
-- (orc_flow_reschedule_v1), and a pause's end is a time of the database's clock
-- (orc_flow_pause_v1, orc_flow_throttled_v2; functions/flow.sql). A call's spend is written
-- once per call id (orc_flow_spend_v2, through orc_flow_spent_calls). Compatible: the release
-- before calls orc_flow_throttled_v1 and orc_flow_spend_v1, which stay (each now calls its
-- new version), and its own queries' plain pause, whose waiters the safety net's backstop
-- reschedules.
--
-- compatible-with-older-workers: yes
-- revises: functions/claim.sql 5bb51748c562a40978927b886b3c15b976af47b67be60770d0e9552956818768
-- revises: functions/flow.sql e643b4beab638fc6b69787efd44d4437dc5a7018d31f1bb85e9239e3087477bb

CREATE TABLE orc_flow_spent_calls (
    job_id uuid NOT NULL REFERENCES orc_jobs (id) ON DELETE CASCADE,
    call_id text NOT NULL,
    PRIMARY KEY (job_id, call_id)
);
