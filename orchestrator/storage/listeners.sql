-- listen_for_events --
-- This API server waits for events until %(seconds)s from now, unless it renews the claim
-- (orc_job_events' statement trigger notifies `orc_job_events` while any claim is live).
INSERT INTO orc_event_listeners (listener, until)
VALUES (%(listener)s, now() + make_interval(secs => %(seconds)s))
ON CONFLICT (listener) DO UPDATE SET until = excluded.until

-- stop_listening_for_events --
DELETE FROM orc_event_listeners WHERE listener = %(listener)s OR until < now()

-- latest_event_ids --
-- The newest event id of each of these jobs (one primary-key probe each): which of the jobs
-- waited for have new events since the waiter last looked. Not a global cursor: ids are handed
-- out before commit, so a lower id can commit after a higher one.
SELECT job_id, max(id) AS last_event_id FROM orc_job_events
 WHERE job_id = ANY (%(job_ids)s::uuid[])
 GROUP BY job_id
