#!/usr/bin/env bash
# One rollout of examples/gemini_cli: Gemini CLI as it ships (node_modules, pinned in package.json),
# headless (-p --yolo), in a fresh project folder with a HOME of its own holding ~/.gemini/settings.json
# (this folder's); then the task's own check (../write_a_word/check.py), whose last line {"reward": …} is
# the reward. Knows nothing of lgt: Gemini CLI calls generativelanguage.googleapis.com through
# HTTPS_PROXY, which under `lgt-train run` is lgt-proxy (the policy).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../write_a_word/fresh_folder.sh" gemini   # $tmp/project (cwd), HOME=$tmp/home
export GEMINI_SYSTEM_MD=$here/system.md
mkdir -p "$HOME/.gemini"
cp "$here/settings.json" "$HOME/.gemini/settings.json"
"$here/node_modules/.bin/gemini" -p "$TASK_PROMPT" --yolo --skip-trust > "$tmp/gemini.out" 2> "$tmp/gemini.err" \
    < /dev/null
code=$?
tail -c 2000 "$tmp/gemini.out"; tail -c 2000 "$tmp/gemini.err" >&2
[ $code -eq 0 ] || exit $code   # Gemini CLI itself failed: a failed attempt, retried (not reward 0)
python3 "$here/../write_a_word/check.py" "$tmp/project"
