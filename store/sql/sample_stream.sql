-- The named queries of lgt.store.stream (loaded with lgt.store.query.named_queries): which groups make
-- each chunk of a streamed sample build, and which files hold their rollouts, planned in temporary
-- tables on a whole-store connection. Not a script to run whole.

-- name: plan_held_table
-- Which files hold each rollout's rows: n numbers the files of table t (_lgt_plan_names).
CREATE OR REPLACE TEMP TABLE _lgt_plan_held (rollout_id VARCHAR, t VARCHAR, n INTEGER);

-- name: plan_held
-- The rows of _lgt_plan_held of table $t, whose files are the variable lgt_plan_files.
INSERT INTO _lgt_plan_held
SELECT h.rollout_id, h.t, f.n
FROM (SELECT DISTINCT $t AS t, rollout_id, filename
      FROM read_parquet(getvariable('lgt_plan_files'), filename = true)) h
JOIN _lgt_plan_names f USING (t, filename);

-- name: plan
-- _lgt_plan_groups (i, g, n): every group numbered in the order of the first calls file holding its
-- rollouts, with its number of rollout attempts; _lgt_plan_members (i, rollout_id);
-- _lgt_plan_files (i, t, n): group i has rows in file n of table t.
CREATE OR REPLACE TEMP TABLE _lgt_plan_attempts AS
SELECT rollout_id, coalesce(group_id, rollout_id || '~' || attempt) AS g FROM rollouts;

CREATE OR REPLACE TEMP TABLE _lgt_plan_groups AS
SELECT row_number() OVER (ORDER BY min(c.n) NULLS LAST, a.g) AS i, a.g, count(*) AS n
FROM _lgt_plan_attempts a
LEFT JOIN (SELECT rollout_id, min(n) AS n FROM _lgt_plan_held WHERE t = 'calls' GROUP BY ALL) c
    USING (rollout_id)
GROUP BY a.g ORDER BY i;

CREATE OR REPLACE TEMP TABLE _lgt_plan_members AS
SELECT DISTINCT g.i, a.rollout_id FROM _lgt_plan_attempts a JOIN _lgt_plan_groups g USING (g)
ORDER BY i;

CREATE OR REPLACE TEMP TABLE _lgt_plan_files AS
SELECT DISTINCT m.i, h.t, h.n FROM _lgt_plan_members m JOIN _lgt_plan_held h USING (rollout_id)
ORDER BY i;

-- name: plan_cleanup
-- The planning's own tables, once the plan is made (or failed).
DROP TABLE IF EXISTS _lgt_plan_held;
DROP TABLE IF EXISTS _lgt_plan_attempts;

-- name: plan_sizes
-- The planned groups in order, with their number of rollout attempts.
SELECT i, n FROM _lgt_plan_groups ORDER BY i;

-- name: chunk_groups
-- The groups of a chunk: planned groups $first to $last.
SELECT g FROM _lgt_plan_groups WHERE i BETWEEN $first AND $last;

-- name: chunk_rollouts
-- The rollouts of those groups.
SELECT DISTINCT rollout_id FROM _lgt_plan_members WHERE i BETWEEN $first AND $last;

-- name: chunk_files
-- The files (table t, number n) that hold those rollouts' rows.
SELECT DISTINCT t, n FROM _lgt_plan_files WHERE i BETWEEN $first AND $last;
