-- list_dead_letters --
-- Newest first; a tenant's through orc_dead_letters_tenant; `tenants`: only theirs (an API
-- principal's), null for any. The open ones (the default) through orc_dead_letters_state: the
-- cost grows with the letters awaiting review, never with those reviewed. `error`: a part
-- of the error's code, message or class, in any case.
SELECT * FROM orc_dead_letters
 WHERE (%(states)s::text[] IS NULL OR state = ANY (%(states)s))
   AND (%(job_type)s::text IS NULL OR job_type = %(job_type)s)
   AND (%(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s)
   AND (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))
   AND (%(error)s::text IS NULL
        OR strpos(lower(error->>'code'), lower(%(error)s)) > 0
        OR strpos(lower(error->>'message'), lower(%(error)s)) > 0
        OR strpos(lower(error->>'classification'), lower(%(error)s)) > 0)
 ORDER BY created_at DESC
 LIMIT %(limit)s

-- find_dead_letters --
-- These letters, of `tenants` only (null: any): a bulk action's given ids.
SELECT * FROM orc_dead_letters
 WHERE id = ANY (%(ids)s::uuid[])
   AND (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))

-- find_dead_letter --
SELECT * FROM orc_dead_letters WHERE id = %(dead_letter_id)s

-- get_dead_letter --
SELECT * FROM orc_dead_letters WHERE id = %(dead_letter_id)s FOR UPDATE

-- mark_dead_letter_requeued --
UPDATE orc_dead_letters
   SET state = 'requeued', requeued_job_id = %(job_id)s, resolved_at = now()
 WHERE id = %(dead_letter_id)s AND state IN ('recorded', 'discard_requested')
RETURNING id

-- request_dead_letter_discard --
UPDATE orc_dead_letters
   SET state = 'discard_requested', discard_requested_by = %(reviewer)s,
       discard_reason = %(reason)s
 WHERE id = %(dead_letter_id)s AND state = 'recorded'
RETURNING id

-- confirm_dead_letter_discard --
-- By another person than the requester's: no skeleton in common (the persons:
-- sql/functions/principals.sql's trigger).
UPDATE orc_dead_letters
   SET state = 'discarded', discarded_by = %(reviewer)s, resolved_at = now()
 WHERE id = %(dead_letter_id)s AND state = 'discard_requested'
   AND NOT discard_requested_persons && orc_principal_persons_v1(%(reviewer)s)
RETURNING id

-- same_person --
-- Whether two recorded principals are one person (sql/functions/principals.sql).
SELECT orc_principal_persons_v1(%(first)s) && orc_principal_persons_v1(%(second)s) AS same

-- dead_letter_of_job --
SELECT * FROM orc_dead_letters WHERE job_id = %(job_id)s ORDER BY created_at DESC LIMIT 1
