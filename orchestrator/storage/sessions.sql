-- create_session --
INSERT INTO orc_ui_sessions (id_sha256, token_id, csrf, expires_at)
VALUES (%(id_sha256)s, %(token_id)s, %(csrf)s, now() + make_interval(secs => %(seconds)s))

-- find_session --
-- A live session of a live token: the token's principal and the session's CSRF token.
SELECT t.id, t.name, t.scopes, t.tenants, s.csrf
  FROM orc_ui_sessions AS s JOIN orc_api_tokens AS t ON t.id = s.token_id
 WHERE s.id_sha256 = %(id_sha256)s AND s.expires_at > now() AND t.revoked_at IS NULL

-- end_session --
DELETE FROM orc_ui_sessions WHERE id_sha256 = %(id_sha256)s OR expires_at < now()
