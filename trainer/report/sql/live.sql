-- The named queries of the live run page (lgt.trainer.report.run_view, loaded with
-- lgt.store.query.named_queries), on a connection with the store's views. Not a script to run whole.

-- name: trained_tables
-- What training made of each rollout: trained_log holds trained.jsonl's lines as read, trained one
-- row per rollout attempt; listing_view is the rollout table beside it.
CREATE OR REPLACE TEMP TABLE trained_log (rollout_id VARCHAR, attempt INTEGER, step BIGINT, advantage DOUBLE,
    loss_weight DOUBLE);
CREATE OR REPLACE TEMP TABLE trained (rollout_id VARCHAR, attempt INTEGER, trained_step BIGINT,
    advantage DOUBLE, loss_weight DOUBLE);
CREATE OR REPLACE TEMP VIEW listing_view AS
SELECT listing.*, trained.trained_step, trained.advantage, trained.loss_weight
FROM listing LEFT JOIN trained USING (rollout_id, attempt);

-- name: trained_append
-- trained.jsonl's new lines (trained_chunk, registered from Arrow) into trained_log.
INSERT INTO trained_log SELECT * FROM trained_chunk;

-- name: trained_last
-- A resumed step trains a rollout again: its last step counts.
CREATE OR REPLACE TEMP TABLE trained AS
SELECT rollout_id, attempt, max(step) AS trained_step, arg_max(advantage, step) AS advantage,
       arg_max(loss_weight, step) AS loss_weight
FROM trained_log GROUP BY ALL;

-- name: listing
-- The rollout table: one row per rollout attempt, from scalar columns only (token counts from the
-- calls' usage).
CREATE OR REPLACE TEMP TABLE listing AS
WITH c AS (
    SELECT rollout_id, attempt, count(*) AS calls, count(*) FILTER (WHERE status = 'ok') AS calls_ok,
           sum(usage_completion_tokens) AS generated, max(usage_prompt_tokens) AS context,
           min(policy_version) AS version_min, max(policy_version) AS version_max,
           count(*) FILTER (WHERE status = 'ok' AND coalesce(capture, 'full') <> 'full') AS capture_partial
    FROM calls GROUP BY ALL
), w AS (
    SELECT rollout_id, attempt, value AS reward, source AS reward_source FROM rewards WHERE call_id IS NULL
)
SELECT r.rollout_id, r.attempt, r.task_id, r.group_id, r.step, r.split, r.status, r.exit_code,
       r.started_at, r.ended_at, epoch(r.ended_at) - epoch(r.started_at) AS seconds,
       w.reward, w.reward_source, coalesce(c.calls, 0) AS calls, coalesce(c.calls_ok, 0) AS calls_ok,
       c.generated, c.context, c.version_min, c.version_max, coalesce(c.capture_partial, 0) AS capture_partial
FROM rollouts r LEFT JOIN c USING (rollout_id, attempt) LEFT JOIN w USING (rollout_id, attempt);

-- name: empty_listing
-- The rollout table before the store has any rows (or before the run has written its store).
CREATE OR REPLACE TEMP TABLE listing (rollout_id VARCHAR, attempt INTEGER, task_id VARCHAR, group_id VARCHAR,
    step BIGINT, split VARCHAR, status VARCHAR, exit_code INTEGER, started_at TIMESTAMPTZ,
    ended_at TIMESTAMPTZ,
    seconds DOUBLE, reward DOUBLE, reward_source VARCHAR, calls BIGINT, calls_ok BIGINT, generated HUGEINT,
    context BIGINT, version_min BIGINT, version_max BIGINT, capture_partial BIGINT);

-- name: listing_kept
-- The rows of listing_view the page's filters keep: each argument NULL where not given; task_like and
-- rollout_like are ILIKE patterns, was_trained whether a step trained the rollout.
CREATE OR REPLACE TEMP MACRO listing_kept(status_is, split_is, task_like, rollout_like, step_is,
                                          reward_min, reward_max, was_trained) AS TABLE
SELECT * FROM listing_view
WHERE (status_is IS NULL OR status = status_is)
  AND (split_is IS NULL OR split = split_is)
  AND (task_like IS NULL OR task_id ILIKE task_like)
  AND (rollout_like IS NULL OR rollout_id ILIKE rollout_like)
  AND (step_is IS NULL OR step = step_is)
  AND (reward_min IS NULL OR reward >= reward_min)
  AND (reward_max IS NULL OR reward <= reward_max)
  AND (was_trained IS NULL OR (trained_step IS NOT NULL) = was_trained);

-- name: listing_count
-- How many rows the filters keep.
SELECT count(*) FROM listing_kept($status, $split, $task, $rollout, $step, $reward_min, $reward_max, $trained);

-- name: listing_page
-- A page of them. A column cannot be a parameter: {sort} (one of run_view.SORTS) and {direction}
-- (ASC or DESC) are filled in before the query runs.
SELECT * FROM listing_kept($status, $split, $task, $rollout, $step, $reward_min, $reward_max, $trained)
ORDER BY {sort} {direction} NULLS LAST, rollout_id, attempt
LIMIT $limit OFFSET $offset;

-- name: statuses
-- Rollout attempts per status (the filter's choices).
SELECT status, count(*) FROM listing GROUP BY 1;

-- name: trained_rollout
-- What training made of one rollout attempt.
SELECT trained_step, advantage, loss_weight FROM trained WHERE rollout_id = $rollout_id AND attempt = $attempt;
