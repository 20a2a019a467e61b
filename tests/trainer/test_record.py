"""``lgt-train record``: an unmodified agent's traces on a "hosted" model, through the real observe-only
proxy, into a real store — and the bad-input sentences.

The hosted model is the one thing that cannot run here: a stand-in on loopback speaks the provider's
wire format (OpenAI chat/completions), demands the agent's own key as a provider would, and answers
with the session's vLLM CPU engine under a dated model name, as hosted APIs do. The agent is
examples/arith/agent.py, unchanged, pointed at the stand-in by its own OPENAI_BASE_URL.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from lgt.store.query import connect
from lgt.trainer.cli import record_cmd

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-hosted-secret-0f3a9c77e1b24d5e"  # the agent's own key: reaches the provider, never the store
ANSWERED_BY = "gpt-4o-mini-2024-07-18"  # what the stand-in says answered (hosted APIs date their models)
TASKS = [json.loads(line) for line in (ROOT / "examples/arith/tasks.jsonl").read_text().splitlines()]
# the stand-in is a stronger model than the tiny one: it knows these answers (every other task's)
KNOWN = {t["question"]: t["answer"] for t in TASKS[1::2]}


class Hosted:
    """A provider-looking host on loopback: ``POST /v1/chat/completions`` with ``Authorization: Bearer
    KEY`` is answered by the engine (served as ``policy``) under :data:`ANSWERED_BY`, the answer's text
    replaced by the right one for a question in :data:`KNOWN`; any other key gets 401."""

    def __init__(self, engine_url: str) -> None:
        self.calls: list[dict[str, Any]] = []
        hosted = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if self.headers.get("authorization") != f"Bearer {KEY}":
                    return self.reply(401, {"error": {"message": "invalid api key"}})
                hosted.calls.append({"path": self.path, "body": body})
                req = urllib.request.Request(f"{engine_url}/chat/completions", method="POST",
                                             data=json.dumps({**body, "model": "policy"}).encode(),
                                             headers={"content-type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    answer = json.loads(r.read())
                question = body["messages"][-1]["content"]
                if question in KNOWN:
                    choice = answer["choices"][0]
                    choice["message"]["content"] = f"The answer is {KNOWN[question]}."
                    choice["finish_reason"] = "stop"
                self.reply(200, {**answer, "model": ANSWERED_BY})

            def reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hosted(arith_engine: Any) -> Iterator[Hosted]:
    h = Hosted(arith_engine.url)
    yield h
    h.close()


def write_config(tmp_path: Path, *, base_url: str = "http://127.0.0.1:9/v1", tasks: list | None = None,
                 command: list[str] | None = None, extra: str = "") -> Path:
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in (tasks or TASKS[:3])))
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS[100:102]))
    agent = {"command": command or [sys.executable, str(ROOT / "examples/arith/agent.py")],
             "env": {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": KEY}, "timeout_s": 60, "retries": 0}
    cfg = tmp_path / "record.yaml"
    cfg.write_text(f"name: rec\nmodel: {{path: never-built}}\ntasks: tasks.jsonl\n"
                   f"agent: {json.dumps(agent)}\n"
                   f"group_size: 2\nmax_inflight: 4\n{extra}")
    return cfg


def invoke(*args: str) -> Any:
    return CliRunner().invoke(record_cmd, [str(a) for a in args], catch_exceptions=False)


def test_record_an_unmodified_agent_on_a_hosted_model(tmp_path: Path, hosted: Hosted) -> None:
    cfg = write_config(tmp_path, base_url=hosted.url,
                       extra="eval: {tasks: held.jsonl, greedy: true, samples: 1}\n")
    run_dir = tmp_path / "rec"
    out = invoke(cfg, "--run-dir", run_dir, "--eval", "--threshold", "0.5")
    assert out.exit_code == 0, out.output
    assert f"next: lgt-train sft {cfg} --traces {run_dir / 'store'}" in out.output
    summary = json.loads((run_dir / "summary.json").read_text())
    store = run_dir / "store"

    con = connect(store)
    try:
        rollouts = con.execute("SELECT rollout_id, attempt, group_id, split, status, task_id FROM rollouts "
                               "ORDER BY rollout_id").fetchall()
        calls = con.execute("SELECT rollout_id, api, upstream, served_model, "
                            "json_extract_string(response_json, '$.model'), status, usage_prompt_tokens, "
                            "usage_completion_tokens, request_json, "
                            "original_host FROM calls").fetchall()
        rewards = dict(con.execute("SELECT rollout_id, value FROM rewards WHERE call_id IS NULL").fetchall())
        by_split = dict(con.execute("SELECT split, count(*) FROM rollouts GROUP BY split").fetchall())
        mean = con.execute("SELECT avg(w.value), avg((w.value >= 0.5)::INT) FROM rollouts r "
                           "JOIN rewards w USING (rollout_id, attempt) "
                           "WHERE r.split = 'train' AND r.status = 'ok'").fetchone()
        tokens = con.execute("SELECT sum(usage_prompt_tokens), sum(usage_completion_tokens) "
                             "FROM calls").fetchone()
    finally:
        con.close()

    # 3 training tasks × 2 (group_size), a group per task; the 2 held-out tasks once each (eval.samples: 1;
    # no greedy rollout: the proxy does not change a hosted model's call)
    assert by_split == {"train": 6, "eval": 2}
    train = [r for r in rollouts if r[3] == "train"]
    assert sorted({r[2] for r in train}) == ["g000000", "g000001", "g000002"]
    assert {r[5] for r in train} == {"arith-0", "arith-1", "arith-2"}
    assert {r[5] for r in rollouts if r[3] == "eval"} == {"arith-100", "arith-101"}
    failed = {r[0]: (run_dir / "rollouts" / f"{r[0]}~{r[1]}.err").read_text()[-400:] for r in rollouts
              if r[4] != "ok"}
    assert not failed, failed

    # one row of calls per model call the provider answered, each recorded as the hosted model's
    assert len(calls) == len(hosted.calls) == len(rollouts)
    assert {c[0] for c in calls} == {r[0] for r in rollouts}
    for _rid, api, upstream, served, answer_model, status, p_tok, c_tok, request, host in calls:
        assert (api, status, host) == ("chat/completions", "ok", "127.0.0.1")
        assert upstream == hosted.url.removesuffix("/v1")  # observe-only: where the agent sent it
        assert served == answer_model == ANSWERED_BY  # the store says which model answered
        assert p_tok > 0 and c_tok > 0
        assert json.loads(request)["model"] == "gpt-4o-mini"  # the agent's request, as it sent it
    assert all(c["body"]["model"] == "gpt-4o-mini" for c in hosted.calls)  # forwarded unchanged

    # each rollout's reward is what the agent said (its last stdout line): 1 where the teacher knew
    questions = {t["task_id"]: t["question"] for t in TASKS}
    for rid, attempt, _group, _split, _status, task_id in rollouts:
        said = json.loads((run_dir / "rollouts" / f"{rid}~{attempt}.out").read_text().splitlines()[-1])
        assert rewards[rid] == said["reward"] == (1.0 if questions[task_id] in KNOWN else 0.0)

    # the summary against the store
    t = summary["splits"]["train"]
    assert (t["tasks"], t["rollouts"], t["ok"], t["failed"]) == (3, 6, 6, 0)
    assert 0 < mean[0] < 1
    assert t["reward_mean"] == pytest.approx(mean[0])
    assert t["reward_at_least_threshold"] == pytest.approx(mean[1])
    assert summary["rollouts_not_recorded"] == 0
    assert "g000001 (task arith-1): 2 of 2 ok, mean reward 1.000" in out.output
    e = summary["splits"]["eval"]
    assert (e["tasks"], e["rollouts"], e["ok"], e["reward_mean"]) == (2, 2, 2, 0.5)  # it knew arith-101
    assert summary["calls"] == len(calls) and summary["calls_by_api"] == {"chat/completions": len(calls)}
    assert summary["calls_by_model"] == {ANSWERED_BY: len(calls)}
    assert (summary["prompt_tokens"], summary["completion_tokens"]) == tuple(tokens)
    assert summary["store_calls"] == len(calls)

    # the agent's key reached the provider (it answered 401 otherwise) and no file of the recording:
    # Parquet is compressed, so its rows are read back and searched; every other file byte by byte
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert sum(p.suffix == ".parquet" for p in written) >= 3 and (run_dir / "logs" / "proxy.log").exists()
    for p in written:
        rows = json.dumps(pq.read_table(p).to_pylist(), default=str) if p.suffix == ".parquet" else ""
        assert KEY not in rows and KEY.encode() not in p.read_bytes(), p

    # a second recording adds to the store: groups go on, the summary counts the new rollouts only
    out = invoke(cfg, "--run-dir", run_dir, "--tasks", "1", "--per-task", "1")
    assert out.exit_code == 0, out.output
    assert "holds 8 calls already" in out.output
    again = json.loads((run_dir / "summary.json").read_text())
    assert again["splits"]["train"]["rollouts"] == 1 and again["calls"] == 1
    assert again["store_calls"] == 9
    con = connect(store)
    try:
        added = con.execute("SELECT group_id, task_id FROM rollouts WHERE rollout_id = 'g000003-0'")
        assert added.fetchone() == ("g000003", "arith-0")
    finally:
        con.close()


def test_record_claude_code_on_a_hosted_teacher_and_its_traces_render_as_samples(
        tmp_path: Path, arith_model_dir: Path) -> None:
    """examples/claude_code/distill.yaml as docs/distill.md runs it: the real Claude Code binary, unchanged,
    on the stand-in hosted model (``python -m lgt.testing.hosted_teacher``, Anthropic Messages on
    loopback); every call is a row the student's template renders, each rollout one merged sample."""
    import subprocess

    from lgt.testing import harnesses
    from lgt.trainer.demo.tokenizer import load_tokenizer
    from lgt.trainer.distill.traces import SftConfig, build_samples, choose_rollouts, read_traces
    from lgt.trainer.serving.children import free_port

    if not harnesses.installed(harnesses.HARNESSES["claude_code"]["minimal"]):
        pytest.skip("Claude Code is not installed (bash scripts/setup_agent.sh examples/claude_code)")
    port = free_port("127.0.0.1")
    teacher = subprocess.Popen([sys.executable, "-m", "lgt.testing.hosted_teacher", "--port", str(port)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert "a stand-in hosted model" in (teacher.stdout.readline() if teacher.stdout else "")  # it's up
        run_dir = tmp_path / "rec"
        out = invoke(ROOT / "examples/claude_code/distill.yaml", "--run-dir", run_dir, "--tasks", "3",
                     "--eval", "--set", f"agent.env.ANTHROPIC_BASE_URL=http://127.0.0.1:{port}",
                     "--set", "eval.split=0.05")  # a few held-out tasks of 120
    finally:
        teacher.terminate()
        teacher.wait(10)
    assert out.exit_code == 0, out.output
    assert "train: 3 tasks, 3 rollouts (3 ok, 0 failed), mean reward 1.000" in out.output
    held = re.search(r"eval: (\d+) tasks, \1 rollouts \(\1 ok, 0 failed\), mean reward 1.000", out.output)
    assert held, out.output
    con = connect(run_dir / "store")
    try:
        rows = con.execute("SELECT api, status, capture_reason, upstream, served_model, count(*) FROM calls "
                           "GROUP BY ALL").fetchall()
    finally:
        con.close()
    # two calls per rollout: the Bash call, then "done" after its result
    n = 2 * (3 + int(held.group(1)))
    assert rows == [("messages", "ok", "hosted", f"http://127.0.0.1:{port}", rows[0][4], n)], rows
    assert rows[0][4].startswith("claude-")  # the model Claude Code asked for, as the host answered it

    calls, rollouts = read_traces(run_dir / "store")
    kept = choose_rollouts(rollouts, SftConfig(min_reward=1.0))
    assert len(kept) == 3  # the held-out rollouts are never trained on
    tok = load_tokenizer(arith_model_dir)  # the demo models' tokenizer and chat template
    built = build_samples(tok, calls, kept, 4096)
    assert (len(built.samples), built.calls) == (3, 6) and not built.bad_traces and not built.merge_breaks
    for sample in built.samples:
        task = next(json.loads(line) for line in (ROOT / "examples/write_a_word/tasks.jsonl").open()
                    if json.loads(line)["task_id"] == sample["task_id"])
        trained = tok.decode([i for i, m in zip(sample["input_ids"], sample["loss_mask"]) if m])
        assert f'"command": "echo {task["word"]} > {task["file"]}"' in trained and trained.count("done") == 1
        assert task["prompt"] in tok.decode(sample["input_ids"])  # the task itself is context, not trained


@pytest.mark.parametrize("case, message", [
    ("no tasks", "holds no tasks"),
    ("agent not found", "no-such-agent-binary"),
    ("eval without a section", "the run config has no eval section"),
    ("zero per task", "--per-task must be 1 or more"),
    ("held out everything", "nothing is left to train on"),
])
def test_bad_input_is_one_sentence(tmp_path: Path, case: str, message: str) -> None:
    args: list[str] = []
    if case == "no tasks":
        cfg = write_config(tmp_path)
        (tmp_path / "tasks.jsonl").write_text("\n")
    elif case == "agent not found":
        cfg = write_config(tmp_path, command=["no-such-agent-binary"])
    elif case == "eval without a section":
        cfg, args = write_config(tmp_path), ["--eval"]
    elif case == "zero per task":
        cfg, args = write_config(tmp_path), ["--per-task", "0"]
    else:
        cfg = write_config(tmp_path, tasks=TASKS[:1], extra="eval: {split: 0.999999}\n")
    out = invoke(cfg, "--run-dir", tmp_path / "rec", *args)
    assert out.exit_code == 1
    error = out.output.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("Error: ") and message in error[0], out.output
    assert not (tmp_path / "rec").exists()  # nothing started, nothing written
