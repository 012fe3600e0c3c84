-- 0058_worker_releases: which release each live worker and API server runs (issue 43;
-- docs/operations.md, "Planning a migrate").
--
-- `orchestrator migrate --plan` lists the registered processes that run a release older than
-- the one planning, so that an operator knows, before migrating, whether a migration not marked
-- compatible with older workers would run under them. A process's release, as the schema
-- counts releases, is the newest migration its code has (`0058` for this one): each process
-- records it beside its retry config version (0028), at its registration and with each registry
-- heartbeat. A release before this one writes its row without it (null), or no row at all: it
-- is reported as an older release that records no version.
--
-- compatible-with-older-workers: yes

ALTER TABLE orc_worker_configs ADD COLUMN schema_version text;
