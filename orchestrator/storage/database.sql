-- Statements on a bare connection, run by no store: the databases themselves (database.py)
-- and LISTEN (runtime/wakeups.py, interfaces/watch.py).

-- database_exists --
SELECT 1 FROM pg_database WHERE datname = %(dbname)s

-- create_database --
-- (the name is an identifier, formatted in with psycopg.sql)
CREATE DATABASE {}

-- drop_database --
DROP DATABASE IF EXISTS {} WITH (FORCE)

-- listen_channel --
-- (the channel is an identifier, formatted in with psycopg.sql). Workers listen on orc_wakeup,
-- where statements that schedule a dispatch send its due time (epoch seconds), and on
-- Procrastinate's channels, where it announces inserted jobs and abort requests.
LISTEN {}
