-- Each training group the store holds: its task, how many of its rollouts were recorded, and the
-- policy version it was launched at (a group that recorded all its rollouts finished).
SELECT group_id, any_value(task_id) AS task_id, count(DISTINCT rollout_id) AS rollouts, min(step) AS step
FROM rollouts
WHERE group_id LIKE 'g%'
GROUP BY group_id
ORDER BY group_id;
