-- 0059_graphile_declared: Graphile Worker's API for producers (docs/graphile.md) is one per
-- database, with one row of settings (the tenant its jobs get, ...). Each application that
-- migrates with ORCHESTRATOR_GRAPHILE_COMPAT on declares it, with its settings, as it declares
-- its job types (docs/applications.md): a second application declaring other settings is
-- refused rather than resetting the first's, and a `migrate` with the setting off drops the
-- schema only once no application declares it any more. No row is written here: a database
-- that has the schema and no declaration of it is as before (its next `migrate` declares it,
-- or, with the setting off, drops it).
--
-- Compatible: the release before never reads orc_application_definitions.
--
-- compatible-with-older-workers: yes

ALTER TABLE orc_application_definitions
    DROP CONSTRAINT orc_application_definitions_kind_check,
    ADD CONSTRAINT orc_application_definitions_kind_check
        CHECK (kind IN ('job_type', 'limit', 'limit_of_type', 'schedule', 'graphile'));
