-- The index the next training group takes: one past the highest group ever recorded (g000041 -> 42).
SELECT coalesce(max(TRY_CAST(substr(group_id, 2) AS BIGINT)) + 1, 0) AS next_group
FROM rollouts
WHERE group_id LIKE 'g%';
