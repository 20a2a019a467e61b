#!/usr/bin/env bash
# One rollout of examples/claude_code: Claude Code as it ships (node_modules, pinned in package.json),
# headless (-p), in a fresh project folder with a HOME of its own; then the task's own check
# (../write_a_word/check.py), whose last line {"reward": …} is the reward. Knows nothing of lgt: Claude Code
# calls api.anthropic.com through HTTPS_PROXY, which under `lgt-train run` is lgt-proxy (the policy).
# Its own settings only: the smallest prompt Claude Code makes (--bare, one tool, a short system prompt,
# and the env vars in run.yaml), so the demo model's context holds it. CLAUDE_TOOLS (default Bash) names the
# tools Claude Code offers; CLAUDE_BARE=0 leaves out --bare, under which Claude Code offers no Agent tool:
# policies.yaml sets both, so that Claude Code can hand work to sub-agents (a policy of their own there).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../write_a_word/fresh_folder.sh" claude-code   # $tmp/project (cwd), HOME=$tmp/home
bare=--bare; [ "${CLAUDE_BARE:-1}" = 0 ] && bare=
"$here/node_modules/.bin/claude" -p "$TASK_PROMPT" ${bare} --tools "${CLAUDE_TOOLS:-Bash}" \
    --allowedTools "${CLAUDE_TOOLS:-Bash}" \
    --permission-mode acceptEdits --output-format json --system-prompt "$(cat "$here/system.md")" \
    > "$tmp/claude.json" < /dev/null
code=$?
head -c 2000 "$tmp/claude.json"; echo
if [ $code -ne 0 ]; then
    # the model's own reply ended the session (longer than CLAUDE_CODE_MAX_OUTPUT_TOKENS) → scored like
    # any answer; Claude Code itself or its API failing (a connection, a status) → a failed attempt, retried
    python3 -c 'import json, sys; d = json.load(open(sys.argv[1]))
sys.exit(0 if d.get("api_error_status") is None and "output token maximum" in str(d.get("result")) else 1)' \
        "$tmp/claude.json" 2>/dev/null || exit $code
fi
python3 "$here/../write_a_word/check.py" "$tmp/project"
