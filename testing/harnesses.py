"""How each real coding-agent harness is run headless, with only its own flags, env vars and config files.

One description per harness and profile, used by ``scripts/harness_fixtures.py`` (which records what
the harnesses send), ``tests/test_harnesses.py`` (which runs them through ``lgt-proxy``),
``bench/harnesses.py`` and the docs (docs/harnesses.md). The harnesses are the npm packages pinned in
``tests/harnesses/package.json``; nothing in them is patched.

Profiles: ``default`` — the harness with the settings that keep it from asking questions, updating
itself and sending telemetry; ``minimal`` — the smallest prompt found with the harness's own settings;
``http`` — Codex with its WebSocket refused (the fixture proxy answers the upgrade 426); ``stock`` —
only a key and what a headless run cannot do without.

A run happens in a ``Place``: the task (one sentence), the agent's work dir and its HOME (config
files are written under it). ``environment(h, place, proxy_env)`` is the whole environment the harness
gets: a clean base (PATH, HOME, XDG dirs, TMPDIR), the proxy's variables (``lgt.proxy.auth.rollout_env``
or the fixture proxy's) and the harness's own.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lgt.trainer.serving.children import signal_group

ROOT = Path(__file__).resolve().parent.parent
HARNESS_DIR = ROOT / "tests" / "harnesses"  # package.json, package-lock.json, node_modules
FAKE_KEY = "sk-test-harness-fixtures"  # the harnesses insist on a key; the proxy never forwards it
SHORT_PROMPT = "You are a coding agent. Use the tools to do the user's task, then say done."

PACKAGES = {  # harness → npm package
    "claude_code": "@anthropic-ai/claude-code",
    "codex": "@openai/codex",
    "gemini": "@google/gemini-cli",
    "qwen": "@qwen-code/qwen-code",
    "opencode": "opencode-ai",
    "pi": "@mariozechner/pi-coding-agent",
}
# harness → the folder whose package.json pins it (npm ci there installs node_modules/.bin): the three the
# examples train live in their example's folder, the others in tests/harnesses; each is installed once
INSTALL_DIRS = {"claude_code": ROOT / "examples" / "claude_code", "codex": ROOT / "examples" / "codex",
                "gemini": ROOT / "examples" / "gemini_cli", "qwen": HARNESS_DIR, "opencode": HARNESS_DIR,
                "pi": HARNESS_DIR}
APIS = {  # harness → the API it speaks by default (calls.api of its translated calls)
    "claude_code": "messages", "codex": "responses", "gemini": "gemini", "qwen": "chat/completions",
    "opencode": "responses", "pi": "responses",
}


@dataclass(frozen=True)
class Place:
    """Where one run happens: the task it is given, the agent's work dir and its HOME."""

    task: str
    workdir: Path
    home: Path


@dataclass(frozen=True)
class Harness:
    name: str
    profile: str
    bin: str
    argv: Callable[[Place], list[str]]
    env: Callable[[Place], dict[str, str]] = lambda p: {}
    files: Callable[[Place], dict[str, str]] = lambda p: {}  # path (relative to HOME, or absolute) → text
    tool_prefs: tuple[str, ...] = ()  # the tools the fixture proxy calls, in order of preference
    ws: str = "refuse"  # what the fixture proxy answers a WebSocket upgrade: accept | refuse
    notes: str = ""

    @property
    def package(self) -> str:
        return PACKAGES[self.name]

    @property
    def api(self) -> str:
        return APIS[self.name]


HARNESSES: dict[str, dict[str, Harness]] = {}


def _add(h: Harness) -> None:
    HARNESSES.setdefault(h.name, {})[h.profile] = h


def _j(obj: object) -> str:
    return json.dumps(obj, indent=2)


# ---- Claude Code ---------------------------------------------------------------------------------
# -p skips the workspace trust dialog; as root, --dangerously-skip-permissions is refused, so edits are
# allowed by --permission-mode acceptEdits and the shell by --allowedTools.

CLAUDE_QUIET = {
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no bootstrap, event logging, metrics lookups
}
CLAUDE_SMALL = {
    "ENABLE_TOOL_SEARCH": "false",  # no DeferredToolPlaceholder (with the default tools: 21 tools inline!)
    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",  # no "x-anthropic-billing-header: …" system block
    "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS": "1",  # no context_management, diagnostics; fewer betas
    "DISABLE_PROMPT_CACHING": "1",  # no cache_control
    "CLAUDE_CODE_DISABLE_THINKING": "1",  # no thinking field
}


def _claude(p: Place) -> list[str]:
    return ["-p", p.task, "--permission-mode", "acceptEdits", "--output-format", "json"]


_add(Harness("claude_code", "default", "claude", lambda p: [*_claude(p), "--allowedTools", "Write", "Bash"],
             env=lambda p: {"ANTHROPIC_API_KEY": FAKE_KEY, **CLAUDE_QUIET},
             tool_prefs=("Write", "Bash"),
             notes="quiet: no auto-update, telemetry, error reports or non-essential traffic"))
_add(Harness("claude_code", "minimal", "claude",
             lambda p: [*_claude(p), "--bare", "--tools", "Bash", "--allowedTools", "Bash",
                        "--system-prompt", SHORT_PROMPT],
             env=lambda p: {"ANTHROPIC_API_KEY": FAKE_KEY, **CLAUDE_QUIET, **CLAUDE_SMALL},
             tool_prefs=("Bash",),
             notes="smallest prompt found: --bare (no environment/system message, no CLAUDE.md, hooks, "
                   "plugins), one tool, own system prompt, betas/caching/thinking/attribution off"))


# ---- Codex ---------------------------------------------------------------------------------------
# Codex is Rust: it takes the proxy's CA from CODEX_CA_CERTIFICATE or SSL_CERT_FILE (not
# NODE_EXTRA_CA_CERTS). It opens a WebSocket to wss://api.openai.com/v1/responses first; answered 426
# it falls back to HTTPS at once, answered 401/403/404/502 after 7 tries (~6 s), answered 400 it fails.

CODEX_QUIET = """\
check_for_update_on_startup = false

[analytics]
enabled = false   # no OpenTelemetry metrics to ab.chatgpt.com

[feedback]
enabled = false

[features]
plugins = false   # no plugin sync (github.com, api.github.com, chatgpt.com)
"""
# the smallest prompt Codex makes: examples/codex's own config.toml (the example trains Codex with it)
def _codex_small(p: Place) -> dict[str, str]:
    folder = ROOT / "examples" / "codex"
    return {".codex/config.toml": (folder / "config.toml").read_text().replace("@HERE@", str(folder))}


CODEX_TOOLS = ("exec_command", "shell", "shell_command", "apply_patch", "exec")


def _codex_argv(p: Place) -> list[str]:
    return ["exec", "--skip-git-repo-check", "--sandbox", "workspace-write", p.task]


def _codex_env(p: Place) -> dict[str, str]:
    return {"OPENAI_API_KEY": FAKE_KEY, "CODEX_HOME": str(p.home / ".codex")}


_add(Harness("codex", "default", "codex", _codex_argv, env=_codex_env,
             files=lambda p: {".codex/config.toml": CODEX_QUIET}, tool_prefs=CODEX_TOOLS, ws="accept",
             notes="quiet config.toml; the Responses API over WebSocket (answered)"))
_add(Harness("codex", "http", "codex", _codex_argv, env=_codex_env,
             files=lambda p: {".codex/config.toml": CODEX_QUIET}, tool_prefs=CODEX_TOOLS, ws="refuse",
             notes="as default, but the WebSocket upgrade is answered 426: Codex falls back to HTTPS POST "
                   "/v1/responses (SSE) at once and sends the whole history each call"))
_add(Harness("codex", "minimal", "codex", _codex_argv, env=_codex_env,
             files=_codex_small,
             tool_prefs=CODEX_TOOLS, ws="accept",
             notes="smallest prompt found: model gpt-5 (classic function tools), own base instructions, "
                   "no permissions/apps/collaboration/environment/skills sections, features off"))


# ---- Gemini CLI ----------------------------------------------------------------------------------
# -p is headless; --yolo approves tools; without --skip-trust it exits 55 in an untrusted folder.

GEMINI_QUIET = {"general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
                "privacy": {"usageStatisticsEnabled": False},  # no Clearcut logs to play.googleapis.com
                "telemetry": {"enabled": False}}
GEMINI_EXAMPLE = ROOT / "examples" / "gemini_cli"  # its settings.json and system.md: the smallest prompt


def _gemini(p: Place) -> list[str]:
    return ["-p", p.task, "--yolo", "--skip-trust"]


_add(Harness("gemini", "default", "gemini", _gemini, env=lambda p: {"GEMINI_API_KEY": FAKE_KEY},
             files=lambda p: {".gemini/settings.json": _j(GEMINI_QUIET)},
             tool_prefs=("write_file", "run_shell_command"),
             notes="quiet settings.json; model 'auto' (a flash-lite routing call picks the model)"))
_add(Harness("gemini", "minimal", "gemini", _gemini,
             env=lambda p: {"GEMINI_API_KEY": FAKE_KEY,
                            "GEMINI_SYSTEM_MD": str(GEMINI_EXAMPLE / "system.md")},
             files=lambda p: {".gemini/settings.json": (GEMINI_EXAMPLE / "settings.json").read_text()},
             tool_prefs=("write_file", "run_shell_command"),
             notes="smallest prompt found: GEMINI_SYSTEM_MD replaces the system prompt, tools.core keeps "
                   "write_file, a fixed model (no routing call), skills/todos/agents off"))


# ---- qwen-code -----------------------------------------------------------------------------------
# --auth-type openai with OPENAI_API_KEY/OPENAI_MODEL; without OPENAI_BASE_URL it speaks
# chat/completions to DashScope's OpenAI-compatible endpoint (dashscope.aliyuncs.com/compatible-mode/v1).

QWEN_QUIET = {"general": {"enableAutoUpdate": False},
              "privacy": {"usageStatisticsEnabled": False},  # no RUM events to *.rum.aliyuncs.com
              "telemetry": {"enabled": False}}
QWEN_SMALL = {**QWEN_QUIET,
              # tools.core keeps the core tools to write_file; the agent/goal/worktree/... tools are not
              # core tools and need tools.disabled (--bare would ignore settings files altogether)
              "tools": {"core": ["write_file"], "toolSearch": {"enabled": False},
                        "disabled": ["agent", "enter_worktree", "exit_worktree", "get_goal", "update_goal",
                                     "list_agents", "record_artifact", "report_findings", "send_message",
                                     "skill", "task_stop"]},
              "skills": {"disabledLevels": ["user", "project", "bundled", "builtin", "extension"]},
              "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False,
                         "enableAutoSkill": False},
              "model": {"skipStartupContext": True, "skipNextSpeakerCheck": True, "skipLoopDetection": True}}


def _qwen(p: Place) -> list[str]:
    return ["-p", p.task, "--yolo", "--auth-type", "openai"]


_add(Harness("qwen", "default", "qwen", _qwen,
             env=lambda p: {"OPENAI_API_KEY": FAKE_KEY, "OPENAI_MODEL": "qwen3-coder-plus"},
             files=lambda p: {".qwen/settings.json": _j(QWEN_QUIET)},
             tool_prefs=("write_file", "run_shell_command"),
             notes="quiet settings.json; no OPENAI_BASE_URL: DashScope's compatible-mode endpoint"))
_add(Harness("qwen", "minimal", "qwen", _qwen,
             env=lambda p: {"OPENAI_API_KEY": FAKE_KEY, "OPENAI_MODEL": "gpt-4.1",
                            "OPENAI_BASE_URL": "https://api.openai.com/v1",
                            "QWEN_SYSTEM_MD": str(p.home / "system.md")},
             files=lambda p: {".qwen/settings.json": _j(QWEN_SMALL), "system.md": SHORT_PROMPT + "\n",
                              # made from the locale (~1 KB) and sent as context when missing
                              ".qwen/output-language.md":
                                  "<!-- qwen-code:llm-output-language: English -->\n"},
             tool_prefs=("write_file", "run_shell_command"),
             notes="smallest prompt found, aimed at api.openai.com: QWEN_SYSTEM_MD replaces the system "
                   "prompt, tools.core keeps write_file, no tool search, skills or startup context"))


# ---- opencode ------------------------------------------------------------------------------------
# `run` is headless; without a permission rule it asks before touching its own work dir.

OPENCODE_QUIET = {"OPENCODE_DISABLE_AUTOUPDATE": "1",
                  "OPENCODE_DISABLE_MODELS_FETCH": "1"}  # its models.dev snapshot, not models.opencode.ai
_add(Harness("opencode", "default", "opencode", lambda p: ["run", "-m", "openai/gpt-5", p.task],
             env=lambda p: {"OPENAI_API_KEY": FAKE_KEY, **OPENCODE_QUIET,
                            "OPENCODE_CONFIG_CONTENT": json.dumps({
                                "permission": {"*": "allow"}, "share": "disabled", "autoupdate": False})},
             tool_prefs=("write", "bash", "apply_patch"),
             notes="quiet; a title call (gpt-5.4-nano) precedes the main call"))
_add(Harness("opencode", "minimal", "opencode",
             lambda p: ["run", "-m", "openai/gpt-5", "--title", "t", p.task],
             env=lambda p: {"OPENAI_API_KEY": FAKE_KEY, **OPENCODE_QUIET,
                            "OPENCODE_CONFIG_CONTENT": json.dumps({
                                "permission": {"*": "deny", "edit": "allow"},  # denied tools are not offered
                                "share": "disabled", "autoupdate": False,
                                "agent": {"build": {"prompt": SHORT_PROMPT}}})},
             tool_prefs=("write", "apply_patch", "bash"),
             notes="smallest prompt found: --title (no title call), every permission denied but edit "
                   "(gpt-5 gets apply_patch alone), the build agent's prompt replaced"))


# ---- pi ------------------------------------------------------------------------------------------

_PI = ["-p", "--provider", "openai", "--no-session", "--offline"]
_add(Harness("pi", "default", "pi", lambda p: [*_PI, p.task], env=lambda p: {"OPENAI_API_KEY": FAKE_KEY},
             tool_prefs=("write", "bash"),
             notes="--offline: no startup network operations; --no-session: nothing saved"))
_add(Harness("pi", "minimal", "pi",
             lambda p: [*_PI, "--tools", "write", "--system-prompt", SHORT_PROMPT, "--no-skills",
                        "--no-context-files", "--no-extensions", "--no-prompt-templates", "--thinking", "off",
                        p.task],
             env=lambda p: {"OPENAI_API_KEY": FAKE_KEY},
             tool_prefs=("write", "bash"),
             notes="smallest prompt found: one tool, own system prompt, no skills/context files/"
                   "extensions/templates, thinking off"))


# ---- stock: only the key (and what a run cannot do without); to see what the quiet settings remove --

def _stock(name: str, env: dict[str, str], files: Callable[[Place], dict[str, str]] = lambda p: {}) -> None:
    base = HARNESSES[name]["default"]
    _add(Harness(name, "stock", base.bin, base.argv, env=lambda p: dict(env), files=files,
                 tool_prefs=base.tool_prefs, ws=base.ws,
                 notes="stock: only a key and what a headless run needs"))


_stock("claude_code", {"ANTHROPIC_API_KEY": FAKE_KEY})
_stock("codex", {"OPENAI_API_KEY": FAKE_KEY}, lambda p: {".codex/config.toml": ""})
_stock("gemini", {"GEMINI_API_KEY": FAKE_KEY})
_stock("qwen", {"OPENAI_API_KEY": FAKE_KEY, "OPENAI_MODEL": "qwen3-coder-plus"})
_stock("opencode", {"OPENAI_API_KEY": FAKE_KEY,
                    "OPENCODE_CONFIG_CONTENT": json.dumps({"permission": {"*": "allow"}})})
_stock("pi", {"OPENAI_API_KEY": FAKE_KEY})


# --------------------------------------------------------------------------------------------------
# running one
# --------------------------------------------------------------------------------------------------

def bin_dir(h: Harness) -> Path:
    """Where the harness's binary is installed (``npm ci`` in its INSTALL_DIRS folder)."""
    return INSTALL_DIRS[h.name] / "node_modules" / ".bin"


def installed(h: Harness) -> bool:
    return (bin_dir(h) / h.bin).exists()


def installed_version(package: str) -> str:
    name = next(n for n, p in PACKAGES.items() if p == package)
    try:
        meta = INSTALL_DIRS[name] / "node_modules" / package / "package.json"
        return json.loads(meta.read_text())["version"]
    except (OSError, ValueError, KeyError):
        return "?"


def command(h: Harness, place: Place) -> list[str]:
    return [str(bin_dir(h) / h.bin), *h.argv(place)]


def prepare(h: Harness, place: Place) -> None:
    """The work dir, HOME (with its tmp, config and cache dirs) and the harness's config files."""
    for d in (place.workdir, place.home / "tmp", place.home / ".config", place.home / ".cache"):
        d.mkdir(parents=True, exist_ok=True)
    for rel, text in h.files(place).items():
        path = Path(rel) if os.path.isabs(rel) else place.home / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def environment(h: Harness, place: Place, proxy_env: dict[str, str]) -> dict[str, str]:
    """A clean environment — nothing of this machine's own (its CA variables, keys, proxies) leaks in —
    with the proxy's variables (``HTTPS_PROXY``, the CA files …) and the harness's own on top."""
    node = Path(shutil.which("node") or "/usr/bin/node").parent
    env = {
        "PATH": f"{bin_dir(h)}:{node}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(place.home), "USER": os.environ.get("USER", "root"), "LANG": "C.UTF-8", "TERM": "dumb",
        "SHELL": "/bin/bash", "TMPDIR": str(place.home / "tmp"),
        "XDG_CONFIG_HOME": str(place.home / ".config"), "XDG_DATA_HOME": str(place.home / ".local/share"),
        "XDG_CACHE_HOME": str(place.home / ".cache"), "XDG_STATE_HOME": str(place.home / ".local/state"),
    }
    env.update(proxy_env)
    env.update(h.env(place))
    return env


def run(h: Harness, place: Place, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    """Run the harness headless in its work dir (stdin closed, output captured). Past ``timeout`` its
    process group is killed and ``returncode`` is None; helpers it left running go with it either way."""
    proc = subprocess.Popen(command(h, place), cwd=place.workdir, env=env, text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    rc: int | None
    try:
        out, err = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        rc = None
    signal_group(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, rc, out, err)  # type: ignore[arg-type]


def shell_script(h: Harness, place: Place) -> str:
    """The harness's settings as shell commands a person can paste after ``eval "$(lgt-proxy creds …)"``:
    its config files, its environment, the command line."""
    lines = [f"# {h.name} [{h.profile}] ({h.package} {installed_version(h.package)}): {h.notes}",
             f"mkdir -p {shlex.quote(str(place.workdir))} {shlex.quote(str(place.home))}"]
    for rel, text in h.files(place).items():
        path = Path(rel) if os.path.isabs(rel) else place.home / rel
        lines += [f"mkdir -p {shlex.quote(str(path.parent))}",
                  f"cat > {shlex.quote(str(path))} <<'EOF'\n{text.rstrip()}\nEOF"]
    env = {"HOME": str(place.home), **h.env(place)}
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines.append(f"cd {shlex.quote(str(place.workdir))} && {shlex.join(command(h, place))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from lgt.testing.harness_policy import task_text

    ap = argparse.ArgumentParser(prog="python -m lgt.testing.harnesses",
                                 description="Print how a harness is run headless (its files, env, command).")
    ap.add_argument("harness", choices=sorted(HARNESSES))
    ap.add_argument("profile", nargs="?", default="default")
    ap.add_argument("--dir", default="/tmp/lgt-harness", help="the run's folder: DIR/work and DIR/home")
    ap.add_argument("--task", default=task_text("PINEAPPLE", "answer.txt"))
    args = ap.parse_args(argv)
    h = HARNESSES[args.harness].get(args.profile)
    if h is None:
        ap.error(f"{args.harness} has no profile {args.profile!r} ({', '.join(HARNESSES[args.harness])})")
    print(shell_script(h, Place(args.task, Path(args.dir) / "work", Path(args.dir) / "home")))


if __name__ == "__main__":
    main()
