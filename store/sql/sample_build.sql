-- The named queries of lgt.store.samples (loaded with lgt.store.query.named_queries), on a connection
-- that has the views of views.sql and samples.sql. Not a script to run whole.

-- name: file_search_path
-- The store directory a connection from lgt.store.query.connect reads.
SELECT current_setting('file_search_path');

-- name: scoped_calls_files
-- The calls files of a connection scoped to some rollouts (connect(rollout_ids=…)), else NULL.
SELECT getvariable('lgt_files_calls');

-- name: duplicate_seq
-- A call of a candidate attempt that shares its seq with another: the calls cannot be ordered.
SELECT rollout_id, attempt, seq FROM calls SEMI JOIN sample_candidates USING (rollout_id, attempt)
GROUP BY ALL HAVING count(*) > 1 ORDER BY ALL LIMIT 1;

-- name: call_order
-- Every call of a candidate attempt with the seq of the call before and after it.
FROM sample_order;

-- name: trained_rollouts
-- How many rollout attempts a build of the whole store trains: candidate attempts with generated
-- tokens in a usable call.
SELECT count(*) FROM (
    SELECT rollout_id, attempt
    FROM sample_calls SEMI JOIN sample_candidates USING (rollout_id, attempt)
    WHERE excluded IS NULL GROUP BY ALL HAVING sum(len(response_token_ids)) > 0);

-- name: sample_tokens
-- The generated tokens of each attempt's merged samples (_lgt_sample_meta: one row per sample).
CREATE OR REPLACE TEMP VIEW _lgt_sample_tokens AS
SELECT rollout_id, attempt, sum(masked) AS rollout_tokens FROM _lgt_sample_meta GROUP BY ALL;

-- name: rollout_facts
-- Every rollout attempt's row of sample_rollouts, given the merged samples' tokens.
FROM sample_rollouts('_lgt_sample_tokens');

-- name: sample_facts
-- Per merged sample (in merge order) its rollout's group, task and reward, its policy and the
-- rollout's trained tokens of that policy; keep is false where the rollout is not trained
-- (_lgt_rollouts: the rows of rollout_facts).
SELECT m.row, r.excluded IS NULL AS keep, m.rollout_id, m.attempt, m.sample_index,
       m.n_calls, r.group_id, r.task_id, r.reward, m.policy,
       sum(m.masked) OVER (PARTITION BY m.rollout_id, m.attempt, m.policy) AS rollout_tokens
FROM _lgt_sample_meta m JOIN _lgt_rollouts r USING (rollout_id, attempt)
ORDER BY m.row;

-- name: drop_sample_tokens
DROP VIEW IF EXISTS _lgt_sample_tokens;
