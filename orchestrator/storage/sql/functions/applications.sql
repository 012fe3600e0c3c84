-- Several applications on one database (docs/applications.md; migration 0056).

-- What differs between two definitions of one name: {field: [ours, theirs]}, null when none
-- (jsonb's equality: 60 and 60.0 are one number).
CREATE OR REPLACE FUNCTION orc_definition_difference_v1(p_ours jsonb, p_theirs jsonb)
RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_object_agg(k, jsonb_build_array(p_ours -> k, p_theirs -> k))
      FROM jsonb_object_keys(p_ours || p_theirs) AS k
     WHERE (p_ours -> k) IS DISTINCT FROM (p_theirs -> k)
$$;

-- An application declares its definitions of the kinds p_kinds ({kind: {name: definition}}).
-- p_whole: what it gives of a kind is all it declares of it, and a name it declared before and
-- no longer gives is withdrawn; otherwise it only adds and changes (an operator's command that
-- holds part of the application's definitions). A withdrawal waits while a live process of the
-- application (its registry heartbeat younger than p_live_seconds) records another fingerprint
-- of what it declares than p_version, the declaring process's (migration 0060): that peer may
-- still define the name (a rolling deploy half done, a one-off script); such names are returned
-- `deferred`, still declared, and the caller declares again later. p_version null: withdraw at
-- once (`migrate`, the act of the code that migrates).
--
-- Refused, declaring nothing, when another application declares one of these names otherwise:
-- the refusal is recorded in orc_application_conflicts and returned, a row per name and
-- application whose definition stands (`other`), with what differs. Otherwise: the names
-- withdrawn that no other application declares (`other` null), whose shared rows the caller
-- deletes in the same transaction. Declarations of a kind are made one at a time (an advisory
-- lock per kind, taken in one order), so two applications declaring one name at once cannot
-- both pass the check. Nothing is written where nothing changes.
CREATE OR REPLACE FUNCTION orc_declare_v1(
    p_application text, p_kinds text[], p_definitions jsonb, p_whole boolean,
    p_version text, p_live_seconds double precision
) RETURNS TABLE (kind text, name text, other text, difference jsonb, deferred boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    k text;
    refused jsonb;
BEGIN
    FOR k IN SELECT DISTINCT x FROM unnest(p_kinds) AS x ORDER BY x LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended('orc_declare_v1 ' || k, 0));
    END LOOP;
    SELECT jsonb_agg(jsonb_build_object(
               'kind', g.kind, 'name', g.name, 'other', o.application,
               'difference', orc_definition_difference_v1(g.definition, o.definition))
               ORDER BY g.kind, g.name, o.application)
      INTO refused
      FROM orc_declared_v1(p_kinds, p_definitions) AS g
      JOIN orc_application_definitions AS o
        ON o.kind = g.kind AND o.name = g.name AND o.application <> p_application
     WHERE o.definition <> g.definition;
    IF EXISTS (SELECT FROM orc_application_conflicts AS c
                WHERE c.application = p_application AND c.kind = ANY (p_kinds)) THEN
        DELETE FROM orc_application_conflicts AS c
         WHERE c.application = p_application AND c.kind = ANY (p_kinds);
    END IF;
    IF refused IS NOT NULL THEN
        INSERT INTO orc_application_conflicts (application, kind, name, other, difference)
        SELECT p_application, r.kind, r.name, r.other, r.difference
          FROM jsonb_to_recordset(refused) AS r (kind text, name text, other text, difference jsonb);
        RETURN QUERY
        SELECT r.kind, r.name, r.other, r.difference, false
          FROM jsonb_to_recordset(refused) AS r (kind text, name text, other text, difference jsonb);
        RETURN;
    END IF;
    INSERT INTO orc_application_definitions AS o (kind, name, application, definition)
    SELECT g.kind, g.name, p_application, g.definition
      FROM orc_declared_v1(p_kinds, p_definitions) AS g
     ORDER BY g.kind, g.name
    ON CONFLICT ON CONSTRAINT orc_application_definitions_pkey DO UPDATE
       SET definition = EXCLUDED.definition, declared_at = now()
     WHERE o.definition IS DISTINCT FROM EXCLUDED.definition;
    IF NOT p_whole THEN
        RETURN;
    END IF;
    IF p_version IS NOT NULL AND EXISTS (
        SELECT FROM orc_worker_configs AS c
          JOIN procrastinate_workers AS w ON w.id = c.worker_id
         WHERE coalesce(c.application, 'default') = p_application
           AND c.declares IS DISTINCT FROM p_version AND c.declares IS NOT NULL
           AND w.last_heartbeat > now() - make_interval(secs => p_live_seconds)) THEN
        RETURN QUERY
        SELECT o.kind, o.name, NULL::text, NULL::jsonb, true
          FROM orc_application_definitions AS o
         WHERE o.application = p_application AND o.kind = ANY (p_kinds)
           AND NOT EXISTS (SELECT FROM orc_declared_v1(p_kinds, p_definitions) AS g
                            WHERE g.kind = o.kind AND g.name = o.name);
        RETURN;
    END IF;
    RETURN QUERY
    WITH withdrawn AS (
        DELETE FROM orc_application_definitions AS o
         WHERE o.application = p_application AND o.kind = ANY (p_kinds)
           AND NOT EXISTS (SELECT FROM orc_declared_v1(p_kinds, p_definitions) AS g
                            WHERE g.kind = o.kind AND g.name = o.name)
        RETURNING o.kind, o.name
    )
    SELECT w.kind, w.name, NULL::text, NULL::jsonb, false
      FROM withdrawn AS w
     WHERE NOT EXISTS (SELECT FROM orc_application_definitions AS o
                        WHERE o.kind = w.kind AND o.name = w.name
                          AND o.application <> p_application);
END;
$$;

-- The definitions given, a row each (kinds not in p_kinds are not declared).
CREATE OR REPLACE FUNCTION orc_declared_v1(p_kinds text[], p_definitions jsonb)
RETURNS TABLE (kind text, name text, definition jsonb)
LANGUAGE sql STABLE AS $$
    SELECT g.kind, d.key, d.value
      FROM unnest(p_kinds) AS g (kind),
           jsonb_each(coalesce(p_definitions -> g.kind, '{}'::jsonb)) AS d
$$;
