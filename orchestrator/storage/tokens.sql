-- lock_token_names --
-- Until the transaction ends, no other token is created: the names read next stay all there is
-- while a new one is compared with them (token_of_person).
LOCK TABLE orc_api_tokens IN SHARE ROW EXCLUSIVE MODE

-- token_of_person --
-- The first token, revoked or not, whose name is the person of `name` (a skeleton in common:
-- sql/functions/principals.sql).
SELECT name FROM orc_api_tokens
 WHERE orc_principal_persons_v1('token:' || name) && orc_principal_persons_v1('token:' || %(name)s)
 ORDER BY created_at, name
 LIMIT 1

-- create_token --
INSERT INTO orc_api_tokens (id, name, secret_sha256, scopes, tenants, created_by)
VALUES (%(id)s, %(name)s, %(secret_sha256)s, %(scopes)s, %(tenants)s, %(created_by)s)
RETURNING id

-- find_token --
SELECT id, name, secret_sha256, scopes, tenants FROM orc_api_tokens
 WHERE id = %(id)s AND revoked_at IS NULL

-- list_tokens --
SELECT id, name, scopes, tenants, created_by, created_at, revoked_at FROM orc_api_tokens
 ORDER BY created_at, name

-- revoke_token --
-- By its name as typed, in normal form (a token made before 0022 may have kept another), or in
-- another case (a name is kept as written since 0057; two that differ only in case are one
-- person, which no two tokens are).
UPDATE orc_api_tokens SET revoked_at = now()
 WHERE (name = ANY (%(names)s) OR lower(name) = lower(%(folded)s)) AND revoked_at IS NULL
RETURNING id
