-- 0060_what_each_process_declares: a withdrawal waits for the live peers that may still define
-- the name (docs/applications.md, "What an application owns", rule 4). A process's config
-- version alone does not say what it defines: its schedules come from its code and its crontab
-- too, and a one-off script run on the same file defines none. So each worker and API server
-- records, beside its config version, a fingerprint of what it declares (its limits, the limits
-- of its job types, its schedules: orchestrator.domain.applications.fingerprint), at its
-- registration and with each registry heartbeat; an application's declaration withdraws a name
-- only while every live process of the application records the declaring process's
-- fingerprint (orc_declare_v1).
--
-- Compatible: the release before writes its row without it (null: it holds no withdrawal back,
-- as it declares nothing of applications).
--
-- compatible-with-older-workers: yes
-- revises: functions/applications.sql c278e5f136d298549dc5fd586f83f087ae15b146d0c1902cbe3cd946d15e6183

ALTER TABLE orc_worker_configs ADD COLUMN declares text;
