-- Tables for the pgbench scripts beside this file (BENCHMARKS.md, issue 17).
--   probe: the seed article's schema, a one-column key and five narrow columns.
--   store: PgStore's table as of migration 5 (src/pg/mod.rs), with its token sequence.
--   lean:  a candidate narrower table: one text key (scope, chr(1), key), the fingerprint's
--          version byte in front of its digest, no state column (in progress while
--          lease_until is set), status, headers and body in one column.
DROP SCHEMA IF EXISTS pgbench_idem CASCADE;
CREATE SCHEMA pgbench_idem;

CREATE TABLE pgbench_idem.probe (
    key text PRIMARY KEY, status text NOT NULL, request_hash bytea NOT NULL,
    response_status integer, response_body bytea,
    created_at timestamptz NOT NULL DEFAULT now(), expires_at timestamptz NOT NULL);
CREATE INDEX ON pgbench_idem.probe (expires_at);

CREATE SEQUENCE pgbench_idem.store_seq AS bigint MINVALUE 1;
CREATE TABLE pgbench_idem.store (
    scope text NOT NULL, key text NOT NULL, fingerprint bytea NOT NULL,
    fingerprint_version smallint NOT NULL,
    state text NOT NULL CHECK (state IN ('in_progress', 'completed')),
    token bigint NOT NULL, attempt bigint NOT NULL, lease_until bigint, checkpoint bytea,
    response_status integer, response_headers bytea, response_body bytea,
    created_at bigint NOT NULL, completed_at bigint, expires_at bigint NOT NULL,
    PRIMARY KEY (scope, key));
CREATE INDEX ON pgbench_idem.store (expires_at);

CREATE SEQUENCE pgbench_idem.lean_seq AS bigint MINVALUE 1;
CREATE TABLE pgbench_idem.lean (
    id text PRIMARY KEY, fp bytea NOT NULL, token bigint NOT NULL, attempt integer NOT NULL,
    lease_until bigint, created_at bigint NOT NULL, completed_at bigint,
    expires_at bigint NOT NULL, response bytea);
CREATE INDEX ON pgbench_idem.lean (expires_at);
