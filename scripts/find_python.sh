# Sourced by the setup scripts.
# find_python MINOR... : the first interpreter of those minor versions that runs (PATH, then pyenv)
find_python() {
  local minor c v
  for minor in "$@"; do
    if c=$(command -v "python$minor" 2>/dev/null) && "$c" -c '' 2>/dev/null; then
      echo "$c"; return
    fi
    if command -v pyenv >/dev/null 2>&1; then
      for v in $(pyenv versions --bare 2>/dev/null | grep -E "^${minor//./\\.}\.[0-9]+$" | sort -rV); do
        c="$(pyenv prefix "$v")/bin/python$minor"
        if [ -x "$c" ] && "$c" -c '' 2>/dev/null; then echo "$c"; return; fi
      done
    fi
  done
  command -v python3
}

