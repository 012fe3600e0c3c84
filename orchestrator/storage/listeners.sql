-- listen_for_events --
-- This API server waits for events until %(seconds)s from now, unless it renews the claim
-- (orc_job_events' statement trigger notifies `orc_job_events` while any claim is live).
INSERT INTO orc_event_listeners (listener, until)
VALUES (%(listener)s, now() + make_interval(secs => %(seconds)s))
ON CONFLICT (listener) DO UPDATE SET until = excluded.until

-- stop_listening_for_events --
DELETE FROM orc_event_listeners WHERE listener = %(listener)s OR until < now()

-- latest_marks --
-- How far each of these jobs has got (one primary-key probe each, per table): its newest event
-- id and the offset its next output chunk gets, 0 for none: which of the jobs waited for have
-- news since the waiter last looked. Not a global cursor: ids are handed out before commit, so
-- a lower id can commit after a higher one.
SELECT w.job_id,
       coalesce((SELECT max(e.id) FROM orc_job_events AS e WHERE e.job_id = w.job_id), 0)
           AS last_event_id,
       coalesce((SELECT h.next_offset FROM orc_job_output_heads AS h WHERE h.job_id = w.job_id), 0)
           AS next_output
  FROM unnest(%(job_ids)s::uuid[]) AS w (job_id)
