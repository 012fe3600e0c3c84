-- 0056_applications: several applications on one database (docs/applications.md). An
-- application (ORCHESTRATOR_APPLICATION; `default` unless named) declares its job types, its
-- flow limits, which of its job types run under which limit, and its schedules; each
-- declaration is recorded here with the application that made it, and a sync (a worker or
-- `serve` starting, a reload, `migrate`) adds, changes and removes only its own application's
-- declarations (orc_declare_v1, functions/applications.sql). The shared rows (orc_job_types,
-- orc_flow_limits, orc_flow_job_types, orc_schedules) hold what some application declares: a
-- row is removed only when no application declares it any more. Two applications may declare
-- one name only with the same definition; the second to declare it otherwise is refused, and
-- the refusal recorded (orc_application_conflicts) for the operator and the alert. Which
-- application each live process belongs to is recorded beside its config version.
--
-- What was there before belongs to the application `default`: a database of one application,
-- unnamed, carries on as it was.
--
-- Compatible: the release before writes the shared rows as it did (it knows no declarations)
-- and its row in orc_worker_configs without an application (null: a process of a release
-- before applications).
--
-- compatible-with-older-workers: yes
-- revises: functions/applications.sql d5215e4dd73183536559f1e69fc23a8a177c3cc3ab47a6f974c3c94d85e8cec0

CREATE TABLE orc_application_definitions (
    kind text NOT NULL
        CHECK (kind IN ('job_type', 'limit', 'limit_of_type', 'schedule')),
    name text NOT NULL,
    application text NOT NULL,
    definition jsonb NOT NULL,              -- the fields of the shared row, as declared
    declared_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, name, application)
);
CREATE INDEX orc_application_definitions_application
    ON orc_application_definitions (application, kind);

-- A declaration refused because another application declares the name otherwise: kept until
-- the refused application's next declaration of that kind succeeds (or it is forgotten).
CREATE TABLE orc_application_conflicts (
    application text NOT NULL,              -- the application refused
    kind text NOT NULL,
    name text NOT NULL,
    other text NOT NULL,                    -- the application whose definition stands
    difference jsonb NOT NULL,              -- {field: [refused value, standing value]}
    at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (application, kind, name, other)
);

ALTER TABLE orc_worker_configs ADD COLUMN application text;

INSERT INTO orc_application_definitions (kind, name, application, definition)
SELECT 'job_type', job_type, 'default',
       jsonb_build_object('queue', queue, 'max_attempts', max_attempts,
                          'max_retries', max_retries, 'timeout_seconds', timeout_seconds,
                          'external', external)
  FROM orc_job_types;

INSERT INTO orc_application_definitions (kind, name, application, definition)
SELECT 'limit', name, 'default',
       jsonb_build_object('concurrency', concurrency, 'requests', requests, 'units', units,
                          'interval_seconds', interval_seconds, 'weights', weights,
                          'key', key_template, 'share_by', share_by,
                          'tenant_share', tenant_share, 'learn', learn)
  FROM orc_flow_limits
 WHERE owner = 'config';

INSERT INTO orc_application_definitions (kind, name, application, definition)
SELECT 'limit_of_type', job_type, 'default',
       jsonb_build_object('limit', limit_name, 'fallback_after_seconds', fallback_after_seconds)
  FROM orc_flow_job_types;

INSERT INTO orc_application_definitions (kind, name, application, definition)
SELECT 'schedule', name, 'default',
       jsonb_build_object('job_type', job_type, 'cron', cron, 'tz', tz, 'tenant_id', tenant_id,
                          'backfill_seconds', backfill_seconds)
  FROM orc_schedules;
