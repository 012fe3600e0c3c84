"""Storage: the database, its schema (``sql/migrations/``), and one store per aggregate, each
taking the query runner (``stores``), with its statements by name beside it (``jobs.sql`` beside
``jobs.py``, loaded by ``queries``).

Importing the package itself loads nothing, so a small process can use one of its modules
without the stores and their dependencies (the embedded server's watchdog does).
"""
