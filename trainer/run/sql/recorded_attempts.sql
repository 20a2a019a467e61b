-- Every recorded attempt of the rollouts of these groups ($groups: a list of group ids), with its status.
SELECT rollout_id, attempt, status
FROM rollouts_log
WHERE list_contains($groups, group_id);
