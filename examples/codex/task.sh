#!/usr/bin/env bash
# One rollout of examples/codex: Codex CLI as it ships (node_modules, pinned in package.json), headless
# (`codex exec`), in a fresh project folder with a CODEX_HOME of its own holding config.toml; then the
# task's own check (../write_a_word/check.py), whose last line {"reward": …} is the reward. Knows nothing
# of lgt: Codex calls api.openai.com — the Responses API over a WebSocket first — through HTTPS_PROXY,
# which under `lgt-train run` is lgt-proxy (the policy). Codex reads the proxy's CA from SSL_CERT_FILE.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../write_a_word/fresh_folder.sh" codex   # $tmp/project (cwd), HOME=$tmp/home
export CODEX_HOME=$HOME/.codex
mkdir -p "$CODEX_HOME"
sed "s#@HERE@#$here#" "$here/config.toml" > "$CODEX_HOME/config.toml"
"$here/node_modules/.bin/codex" exec --skip-git-repo-check --sandbox workspace-write "$TASK_PROMPT" \
    > "$tmp/codex.out" 2> "$tmp/codex.err" < /dev/null
code=$?
tail -c 2000 "$tmp/codex.out"; tail -c 2000 "$tmp/codex.err" >&2
# the model's own reply ended the turn (longer than the output limit: the run's proxy.max_output_tokens)
# → scored like any answer; Codex itself or its API failing (a connection, a status) → a failed attempt,
# retried (not reward 0)
if [ $code -ne 0 ] && ! grep -q "Incomplete response returned, reason: max_output_tokens" "$tmp/codex.err"; then
    exit $code
fi
python3 "$here/../write_a_word/check.py" "$tmp/project"
