-- 0028_worker_config_versions: which retry config version each worker and API server runs.
--
-- compatible-with-older-workers: yes
--
-- A worker and `orchestrator serve` reload their retry config file when it changes (docs/
-- configuration.md, "Reloading"), and refuse a version that is not valid. Which version each
-- process runs is a fact of that process, recorded here by it alone, beside its entry in
-- Procrastinate's worker registry: at registration, and with each of its registry heartbeats
-- (an upsert). `orchestrator config show --workers` lists them and flags those not on the
-- file's version. A registry entry pruned or unregistered takes its row with it (the cascade),
-- so the table holds one row per live process and never grows. The previous release's workers
-- write nothing here: they are listed as having no version.

CREATE TABLE orc_worker_configs (
    worker_id bigint PRIMARY KEY REFERENCES procrastinate_workers (id) ON DELETE CASCADE,
    worker text NOT NULL,                 -- host/pid/w<id>, or host/api/w<id> for serve
    config_version text NOT NULL,         -- the file content's hash (retry_config.version_of)
    applied_at timestamptz NOT NULL       -- when that process applied it
);
