-- lgt store views. Works from any DuckDB client started in the store directory:
--   cd runs/demo/store && duckdb -init /path/to/lgt/store/sql/views.sql
-- (lgt's own tools set file_search_path to the store instead.)

-- The tables, one Parquet file set each (whole files only: writers rename finished files in). Each
-- table's folder also holds <table>/_schema/<table>.parquet, no rows and the table's current columns,
-- so a table that has no files yet is an empty view, and older files read newer columns as null.
-- calls.policy: the policy each call belongs to. Rows written before it existed (schema 7) read as
-- 'default', the one policy of a run that names none (lgt.store.schema.DEFAULT_POLICY).
CREATE OR REPLACE VIEW calls AS
SELECT * REPLACE (coalesce(policy, 'default') AS policy)
FROM read_parquet('calls/**/*.parquet', union_by_name = true);

CREATE OR REPLACE VIEW rollouts_log AS
SELECT * FROM read_parquet('rollouts/**/*.parquet', union_by_name = true);

CREATE OR REPLACE VIEW rewards_log AS
SELECT * FROM read_parquet('rewards/**/*.parquet', union_by_name = true);

-- What agents reached through the proxy that is not an LLM call: one row per HTTP request or TCP
-- connection, allowed or blocked by the egress policy.
CREATE OR REPLACE VIEW egress AS
SELECT * FROM read_parquet('egress/**/*.parquet', union_by_name = true);

-- One row per rollout attempt: the latest rollouts row, or, for attempts seen only in calls,
-- a row derived from them (status 'ok', no task or group: the attempt is its own group).
-- split: 'train', or 'eval' for held-out evaluation rollouts (recorded, never trained).
CREATE OR REPLACE VIEW rollouts AS
SELECT * REPLACE (coalesce(split, 'train') AS split) FROM (
WITH latest AS (
    SELECT * EXCLUDE (rn) FROM (
        SELECT *, row_number() OVER (PARTITION BY rollout_id, attempt
                                     ORDER BY recorded_at DESC) AS rn
        FROM rollouts_log)
    WHERE rn = 1
), seen AS (
    SELECT rollout_id, attempt, min(started_at) AS started_at, max(ended_at) AS ended_at
    FROM calls GROUP BY ALL
)
SELECT l.* FROM latest l
UNION ALL BY NAME
SELECT s.rollout_id, s.attempt, NULL::VARCHAR AS task_id,
       s.rollout_id || '~' || s.attempt AS group_id, NULL::BIGINT AS step, 'ok' AS status,
       NULL::INTEGER AS exit_code, s.started_at, s.ended_at, NULL::VARCHAR AS resource_version,
       NULL::VARCHAR AS metadata_json, NULL::VARCHAR AS split, s.ended_at AS recorded_at
FROM seen s ANTI JOIN latest l USING (rollout_id, attempt));

-- One reward per rollout attempt (call_id IS NULL) or per call: the latest recorded. A reward
-- given without an attempt applies to the rollout's latest attempt.
CREATE OR REPLACE VIEW rewards AS
WITH resolved AS (
    SELECT r.* EXCLUDE (attempt),
           coalesce(r.attempt, (SELECT max(o.attempt) FROM rollouts o
                                WHERE o.rollout_id = r.rollout_id)) AS attempt
    FROM rewards_log r
)
SELECT * EXCLUDE (rn) FROM (
    SELECT *, row_number() OVER (PARTITION BY rollout_id, attempt, call_id
                                 ORDER BY recorded_at DESC) AS rn
    FROM resolved)
WHERE rn = 1;
