"""Storage: the database, its schema (``sql/migrations/``), every statement by name
(``sql/queries.sql``), and one store per aggregate, each taking the query runner (``stores``).

Importing the package itself loads nothing, so a small process can use one of its modules
without the stores and their dependencies (the embedded server's watchdog does).
"""
