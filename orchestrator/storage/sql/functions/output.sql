-- A job's live output (docs/output.md; migration 0071): its attempts' batches, fenced by their
-- lease and held to the job's size cap, and the one writer of each marker.

-- A batch of an attempt's output (`p_chunks`: [{kind, step, body}], kind text or progress, in
-- the order written; `p_batch`: its number, 1, 2... in the attempt, so that a batch sent again
-- after a lost acknowledgement is written once), appended at the job's next offsets while the attempt holds its lease: no
-- row returned for a stale attempt, which writes nothing. The job row is locked FOR SHARE while
-- the lease is checked, so a failure outcome (and its marker) either waits for the batch or
-- makes it match nothing; then the job's head, which orders its writes. Chunks are kept while the
-- bodies' bytes stay within `p_max_bytes`; the first that would pass it is dropped, with every
-- later one, and one `cut` marker says so (its only writer). Returns the chunks kept, the next
-- offset, and whether the output is cut.
CREATE OR REPLACE FUNCTION orc_output_write_v1(
    p_job_id uuid, p_lease_token uuid, p_batch integer, p_chunks jsonb, p_max_bytes bigint
) RETURNS TABLE (written integer, next_offset bigint, cut boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_attempt integer;
    v_head orc_job_output_heads;
    v_written integer;
    v_bytes bigint;
BEGIN
    IF jsonb_typeof(p_chunks) IS DISTINCT FROM 'array' OR EXISTS (
        SELECT FROM jsonb_array_elements(p_chunks) AS c (v)
         WHERE c.v ->> 'kind' IS DISTINCT FROM 'text' AND c.v ->> 'kind' IS DISTINCT FROM 'progress'
    ) THEN
        RAISE EXCEPTION 'output chunks must be an array of text or progress chunks: %', p_chunks
            USING ERRCODE = '22023';
    END IF;
    SELECT j.attempt INTO v_attempt FROM orc_jobs AS j
     WHERE j.id = p_job_id AND j.lease_token = p_lease_token AND j.status = 'RUNNING'
       FOR SHARE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    INSERT INTO orc_job_output_heads (job_id) VALUES (p_job_id) ON CONFLICT DO NOTHING;
    SELECT * INTO v_head FROM orc_job_output_heads AS h WHERE h.job_id = p_job_id FOR UPDATE;
    IF v_head.cut OR (v_head.attempt = v_attempt AND v_head.batch >= p_batch) THEN
        RETURN QUERY SELECT 0, v_head.next_offset, v_head.cut;
        RETURN;
    END IF;
    SELECT count(*), coalesce(max(s.upto), 0) INTO v_written, v_bytes
      FROM (SELECT sum(octet_length((c.v -> 'body')::text)) OVER (ORDER BY c.n) AS upto
              FROM jsonb_array_elements(p_chunks) WITH ORDINALITY AS c (v, n)) AS s
     WHERE v_head.bytes + s.upto <= p_max_bytes;
    INSERT INTO orc_job_output (job_id, chunk_offset, attempt, step, kind, body)
    SELECT p_job_id, v_head.next_offset + c.n - 1, v_attempt, (c.v ->> 'step')::integer,
           c.v ->> 'kind', c.v -> 'body'
      FROM jsonb_array_elements(p_chunks) WITH ORDINALITY AS c (v, n)
     WHERE c.n <= v_written;
    v_head.next_offset := v_head.next_offset + v_written;
    v_head.bytes := v_head.bytes + v_bytes;
    IF v_written < jsonb_array_length(p_chunks) THEN
        INSERT INTO orc_job_output (job_id, chunk_offset, attempt, step, kind, body)
        VALUES (p_job_id, v_head.next_offset, v_attempt, NULL, 'cut',
                jsonb_build_object('max_bytes', p_max_bytes));
        v_head.next_offset := v_head.next_offset + 1;
        v_head.cut := true;
    END IF;
    UPDATE orc_job_output_heads AS h
       SET next_offset = v_head.next_offset, bytes = v_head.bytes, cut = v_head.cut,
           attempt = v_attempt, batch = p_batch
     WHERE h.job_id = p_job_id;
    RETURN QUERY SELECT v_written, v_head.next_offset, v_head.cut;
END;
$$;

-- Batches of several attempts' output in one statement (a worker's group commit:
-- orchestrator.runtime.output): `p_batches` [{ord, job_id, lease_token, batch, chunks,
-- max_bytes}], each written as orc_output_write_v1 writes it, in job order (the order every
-- writer that locks several jobs takes). One row per batch, by its `ord`: what was written, or
-- nulls for a stale attempt's batch (nothing written). One statement: one commit, and one
-- notification of the streams, for them all.
CREATE OR REPLACE FUNCTION orc_output_write_many_v1(p_batches jsonb)
RETURNS TABLE (ord integer, written integer, next_offset bigint, cut boolean)
LANGUAGE plpgsql AS $$
DECLARE
    item record;
    w record;
BEGIN
    FOR item IN
        SELECT * FROM jsonb_to_recordset(p_batches)
            AS i (ord integer, job_id uuid, lease_token uuid, batch integer, chunks jsonb,
                  max_bytes bigint)
         ORDER BY i.job_id, i.batch
    LOOP
        SELECT * INTO w
          FROM orc_output_write_v1(item.job_id, item.lease_token, item.batch, item.chunks,
                                   item.max_bytes);
        ord := item.ord;
        written := w.written;
        next_offset := w.next_offset;
        cut := w.cut;
        RETURN NEXT;
    END LOOP;
END;
$$;

-- An attempt that ends without completing (a retry, a terminal failure, a hand-back, a park, a
-- wait for an approval or for children, a sweep of its dead worker) after writing output that
-- the next attempt makes again: the `superseded` marker, its only writer, in the transaction of
-- that outcome (the trigger below), naming the attempt and the first step its output is
-- superseded from (the one after the job's last checkpoint: a committed step's output stays).
-- Nothing when the attempt's last text or progress chunk belongs to a committed step, or when it
-- wrote none.
CREATE OR REPLACE FUNCTION orc_output_supersede_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_last orc_job_output;
    v_from integer;
    v_offset bigint;
BEGIN
    SELECT * INTO v_last FROM orc_job_output AS o
     WHERE o.job_id = NEW.id AND o.kind IN ('text', 'progress')
     ORDER BY o.chunk_offset DESC
     LIMIT 1;
    IF NOT FOUND OR v_last.attempt <> OLD.attempt THEN
        RETURN NULL;
    END IF;
    v_from := coalesce((SELECT max(c.step) FROM orc_checkpoints AS c WHERE c.job_id = NEW.id), 0)
              + 1;
    IF v_last.step < v_from THEN
        RETURN NULL;
    END IF;
    UPDATE orc_job_output_heads AS h SET next_offset = h.next_offset + 1
     WHERE h.job_id = NEW.id
    RETURNING h.next_offset - 1 INTO v_offset;
    INSERT INTO orc_job_output (job_id, chunk_offset, attempt, step, kind, body)
    VALUES (NEW.id, v_offset, OLD.attempt, v_from, 'superseded',
            jsonb_build_object('attempt', OLD.attempt, 'step', v_from));
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER orc_jobs_output_superseded
    AFTER UPDATE OF status ON orc_jobs
    FOR EACH ROW WHEN (OLD.status = 'RUNNING'
                       AND NEW.status NOT IN ('RUNNING', 'COMPLETED', 'CANCELLED'))
    EXECUTE FUNCTION orc_output_supersede_v1();

-- Output written wakes the API's streams as events do: one notification per statement, only
-- while a stream listens (orc_notify_event_listeners_v1, history.sql).
CREATE OR REPLACE TRIGGER orc_job_output_notify
    AFTER INSERT ON orc_job_output
    FOR EACH STATEMENT EXECUTE FUNCTION orc_notify_event_listeners_v1();
