# Sourced by the harness examples' task.sh: a fresh project folder to work in ($tmp/project, the current
# directory afterwards) and a HOME of the harness's own ($tmp/home, with its XDG folders), removed when
# the script exits. $1 names the folder (e.g. claude-code). Knows nothing of lgt.
tmp=$(mktemp -d "${TMPDIR:-/tmp}/$1-task.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/project" "$tmp/home"
export HOME=$tmp/home XDG_CONFIG_HOME=$tmp/home/.config XDG_CACHE_HOME=$tmp/home/.cache \
       XDG_DATA_HOME=$tmp/home/.local/share XDG_STATE_HOME=$tmp/home/.local/state
cd "$tmp/project"
