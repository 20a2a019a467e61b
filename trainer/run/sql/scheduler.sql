-- The named queries of the group scheduler (lgt.trainer.run.scheduler, loaded with
-- lgt.store.query.named_queries), on a connection with the store's views.

-- name: next_group
-- The index the next training group takes: one past the highest group ever recorded (g000041 -> 42).
SELECT coalesce(max(TRY_CAST(substr(group_id, 2) AS BIGINT)) + 1, 0) AS next_group
FROM rollouts
WHERE group_id LIKE 'g%';

-- name: recorded_groups
-- Each training group the store holds: its task, how many of its rollouts were recorded, and the
-- policy version it was launched at (a group that recorded all its rollouts finished).
SELECT group_id, any_value(task_id) AS task_id, count(DISTINCT rollout_id) AS rollouts, min(step) AS step
FROM rollouts
WHERE group_id LIKE 'g%'
GROUP BY group_id
ORDER BY group_id;

-- name: recorded_attempts
-- Every recorded attempt of the rollouts of these groups ($groups: a list of group ids), with its status.
SELECT rollout_id, attempt, status
FROM rollouts_log
WHERE list_contains($groups, group_id);
