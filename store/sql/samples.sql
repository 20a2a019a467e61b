-- lgt samples: how the calls of a rollout attempt become training samples.
-- Needs the views of views.sql. lgt loads this file with lgt.store.samples.install(con); in any
-- DuckDB client started in the store directory, run views.sql and then this file, e.g. in the CLI:
--   .read /path/to/lgt/store/sql/views.sql
--   .read /path/to/lgt/store/sql/samples.sql
-- `samples`, `sample_links` and `merge_breaks` are the exact mode, in plain SQL.
-- lgt.store.samples.build_samples gives the same rows reading the token lists once (and offers
-- realign); the tests hold the two to each other.

-- Every call, with why it cannot be trained (excluded NULL: it can): it did not succeed, or it
-- lacks prompt or generated token ids. A call without one logprob per generated token (capture
-- 'no_logprobs') is trained: its logprobs are NaN here, and the trainer recomputes them. Calls the
-- proxy answered itself (status 'rejected': refused, or held back during an update) never reached
-- the policy and hold no tokens: they are left out here and in sample_order, so a call the agent
-- sent again still extends the one before it.
CREATE OR REPLACE VIEW sample_calls AS
SELECT rollout_id, attempt, policy, seq, policy_version, finish_reason,
       prompt_token_ids, response_token_ids,
       -- the version that generated each token: calls.response_policy_versions for a call that lived
       -- through an update (continued on the new weights), else policy_version for every token
       CASE WHEN response_policy_versions IS NOT NULL
                 AND len(response_policy_versions) = len(response_token_ids)
            THEN response_policy_versions
            ELSE list_resize([]::INTEGER[], len(response_token_ids), policy_version::INTEGER)
       END AS token_versions,
       CASE WHEN response_logprobs IS NULL OR len(response_logprobs) <> len(response_token_ids)
            THEN list_resize([]::FLOAT[], len(response_token_ids), 'NaN'::FLOAT)
            ELSE response_logprobs END AS response_logprobs,
       CASE WHEN status <> 'ok' THEN status
            WHEN prompt_token_ids IS NULL OR response_token_ids IS NULL THEN 'no_token_ids'
       END AS excluded
FROM calls
WHERE status <> 'rejected';

-- Rollout attempts that can be trained: finished 'ok' and given a rollout-level reward, and not
-- held-out evaluation (split 'eval' rollouts are recorded, never trained).
CREATE OR REPLACE VIEW sample_candidates AS
SELECT r.rollout_id, r.attempt
FROM rollouts r
JOIN rewards w ON w.rollout_id = r.rollout_id AND w.attempt = r.attempt AND w.call_id IS NULL
WHERE r.status = 'ok' AND r.split = 'train';

-- The calls of candidate attempts in seq order, each policy's apart (calls.policy: a policy's samples
-- hold its own calls only): the seq of the policy's call before and after each one. Scalar columns
-- only, so cheap on any store; build_samples reads the token lists in one pass over the calls files
-- and takes each attempt's calls in this order.
CREATE OR REPLACE VIEW sample_order AS
SELECT rollout_id, attempt, seq, lag(seq) OVER w AS prev_seq, lead(seq) OVER w AS next_seq
FROM calls SEMI JOIN sample_candidates USING (rollout_id, attempt)
WHERE status <> 'rejected'
WINDOW w AS (PARTITION BY rollout_id, attempt, policy ORDER BY seq);

-- How each trainable call of a candidate attempt continues the one before it (exact mode):
--   first          the attempt's first trainable call: it starts sample 0
--   extends        its prompt starts with the previous call's prompt + generated tokens, token
--                  by token: it joins that call's sample
--   excluded_call  the call before it was excluded: a new sample
--   truncation     its prompt is shorter than the previous prompt + generated tokens
--   no_tokenizer   any other difference (build_samples with a tokenizer tells text_change,
--                  retokenized and boundary_resplit apart)
-- context_from: the first prompt token that is new to the sample; sample_index: the running
-- count of calls that did not extend.
CREATE OR REPLACE VIEW sample_links AS
WITH w AS (
    SELECT *,
           lag(excluded) OVER w AS prev_excluded,
           lag(prompt_token_ids) OVER w AS prev_prompt,
           lag(response_token_ids) OVER w AS prev_response,
           sum((excluded IS NULL)::INTEGER) OVER w - (excluded IS NULL)::INTEGER AS trainable_before
    FROM sample_calls SEMI JOIN sample_candidates USING (rollout_id, attempt)
    WINDOW w AS (PARTITION BY rollout_id, attempt, policy ORDER BY seq)
), linked AS (
    SELECT rollout_id, attempt, policy, seq, policy_version,
           prompt_token_ids, response_token_ids, response_logprobs, token_versions,
           CASE WHEN trainable_before = 0 THEN 'first'
                WHEN prev_excluded IS NOT NULL THEN 'excluded_call'
                WHEN len(prompt_token_ids) < len(prev_prompt) + len(prev_response) THEN 'truncation'
                WHEN prompt_token_ids[:len(prev_prompt) + len(prev_response)]
                     = prev_prompt || prev_response THEN 'extends'
                ELSE 'no_tokenizer' END AS link,
           CASE WHEN link = 'extends' THEN len(prev_prompt) + len(prev_response) ELSE 0 END
               AS context_from
    FROM w WHERE excluded IS NULL
)
SELECT *, sum((link <> 'extends')::INTEGER) OVER (PARTITION BY rollout_id, attempt, policy ORDER BY seq)
          - 1 AS sample_index
FROM linked;

-- Why samples split: one row per call that started a new sample after the attempt's first.
CREATE OR REPLACE VIEW merge_breaks AS
SELECT rollout_id, attempt, seq, link AS reason FROM sample_links
WHERE link NOT IN ('first', 'extends');

-- Every rollout attempt: whether it is trained (excluded NULL), its group and reward, and how many
-- generated (loss-masked) tokens its samples hold. sample_tokens names a relation (rollout_id,
-- attempt, rollout_tokens).
--   excluded: the rollout's status when not 'ok' (failed, timeout), no_reward, no_trainable_calls.
-- The store gives facts: advantages and loss weights are computed by the trainer over the rollouts it
-- trains together (lgt.trainer.rl.algorithm: a failed rollout never counts as reward 0).
CREATE OR REPLACE MACRO sample_rollouts(sample_tokens) AS TABLE
SELECT r.rollout_id, r.attempt, r.task_id, r.step,
       coalesce(r.group_id, r.rollout_id || '~' || r.attempt) AS group_id,
       w.value AS reward, coalesce(t.rollout_tokens, 0) AS rollout_tokens,
       CASE WHEN r.status <> 'ok' THEN r.status
            WHEN r.split = 'eval' THEN 'eval'
            WHEN w.value IS NULL THEN 'no_reward'
            WHEN coalesce(t.rollout_tokens, 0) = 0 THEN 'no_trainable_calls' END AS excluded
FROM rollouts r
LEFT JOIN rewards w
       ON w.rollout_id = r.rollout_id AND w.attempt = r.attempt AND w.call_id IS NULL
LEFT JOIN query_table(sample_tokens) t
       ON t.rollout_id = r.rollout_id AND t.attempt = r.attempt;

-- The token lists of each exact-mode sample: every call adds its new prompt tokens (mask 0,
-- logprob 0, policy version -1) then its generated tokens (mask 1, recorded logprobs, the policy
-- version that generated them).
CREATE OR REPLACE VIEW sample_lists AS
SELECT rollout_id, attempt, policy, sample_index, count(*) AS n_calls,
       flatten(list(prompt_token_ids[context_from + 1:] || response_token_ids ORDER BY seq))
           AS input_ids,
       flatten(list(list_resize([]::TINYINT[], len(prompt_token_ids) - context_from, 0)
                    || list_resize([]::TINYINT[], len(response_token_ids), 1) ORDER BY seq))
           AS loss_mask,
       flatten(list(list_resize([]::FLOAT[], len(prompt_token_ids) - context_from, 0)
                    || response_logprobs ORDER BY seq)) AS behaviour_logprobs,
       flatten(list(list_resize([]::INTEGER[], len(prompt_token_ids) - context_from, -1)
                    || token_versions ORDER BY seq)) AS policy_versions,
       sum(len(response_token_ids)) AS masked_tokens
FROM sample_links GROUP BY rollout_id, attempt, policy, sample_index;

CREATE OR REPLACE VIEW sample_tokens AS
SELECT rollout_id, attempt, sum(masked_tokens) AS rollout_tokens FROM sample_lists GROUP BY ALL;

-- What the trainer trains on (exact mode), before it adds advantages and loss weights. Each sample
-- holds one policy's calls; rollout_tokens counts the rollout's trained tokens of that policy (with one
-- policy, all of them), and a policy other than 'default' is named in the sample id (r~0#planner.0).
CREATE OR REPLACE VIEW samples AS
SELECT s.rollout_id || '~' || s.attempt || '#'
       || CASE WHEN s.policy = 'default' THEN '' ELSE s.policy || '.' END || s.sample_index AS sample_id,
       s.rollout_id, s.attempt, r.group_id, r.task_id, s.sample_index, s.n_calls,
       s.input_ids, s.loss_mask, s.behaviour_logprobs, s.policy_versions, r.reward,
       sum(s.masked_tokens) OVER (PARTITION BY s.rollout_id, s.attempt, s.policy) AS rollout_tokens,
       'exact' AS mode, s.policy
FROM sample_lists s JOIN sample_rollouts('sample_tokens') r USING (rollout_id, attempt)
WHERE r.excluded IS NULL;
