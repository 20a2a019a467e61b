#!/usr/bin/env bash
# One attempt of examples/swe_images/claude_code.yaml, inside the task's own image: Claude Code as it ships
# (examples/claude_code's node_modules, mounted read-only at /opt/claude; this script at
# /opt/swe-claude/claude_code.sh) works on the issue in the repository at /testbed, headless (-p), with the
# image's bash as its Bash tool. Knows nothing of lgt: Claude Code calls api.anthropic.com through
# HTTPS_PROXY, which under `lgt-train run` is lgt-proxy (the policy). The reward is the evaluator's, run in
# the same image on the tree Claude Code left — nothing here scores it.
set -uo pipefail
cd "${LGT_WORK_DIR:-/testbed}"
echo "claude code $(/opt/claude/.bin/claude --version 2>/dev/null) in $(pwd) at $(git rev-parse HEAD)"
/opt/claude/.bin/claude -p "$TASK_PROMPT" --bare --tools Bash --allowedTools Bash \
    --permission-mode acceptEdits --output-format json \
    --system-prompt "You are a coding agent in a git repository. Use the Bash tool to read the code, fix \
the issue the user describes by editing the repository's files, and check your fix; then say done." \
    > "$HOME/claude.json" < /dev/null
code=$?
head -c 2000 "$HOME/claude.json"; echo
if [ $code -ne 0 ]; then
    # the model's own reply ended the session (longer than the output cap) → graded like any answer;
    # Claude Code itself or its API failing (a connection, a status) → a failed attempt, retried
    python3 -c 'import json, sys; d = json.load(open(sys.argv[1]))
sys.exit(0 if d.get("api_error_status") is None and "output token maximum" in str(d.get("result")) else 1)' \
        "$HOME/claude.json" 2>/dev/null || exit $code
fi
echo "git status: $(git status --short | tr '\n' ' ')"
