"""``lgt-train sft``'s samples from a teacher's recorded traces: retokenised with the student's template,
merged across the turns of a rollout, bad traces counted by reason, rollouts chosen by reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lgt.testing.store import call_row, make_store, tool_rollout
from lgt.trainer.distill.traces import (
    TEXT_CHANGE,
    SftConfig,
    SftError,
    build_samples,
    choose_rollouts,
    read_traces,
    render_call,
)


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _as_hosted(rows: list[dict]) -> list[dict]:
    return [{**r, "api": None} for r in rows]


def test_reply_tokens_are_exactly_the_trained_ones(tok) -> None:
    msgs = [{"role": "user", "content": "What is 6*7?"}]
    prompt, full = render_call(tok, msgs, None, {"role": "assistant", "content": "It is 42."}, 4096)
    assert full[:len(prompt)] == prompt
    row = call_row("r", 0, msgs, {"role": "assistant", "content": "It is 42."})
    kept = {"r": {"task_id": "t", "group_id": "g", "reward": 1.0}}
    built = build_samples(tok, _as_hosted([row]), kept, 4096)
    (s,) = built.samples
    assert s["input_ids"] == full
    trained = tok.decode([i for i, m in zip(s["input_ids"], s["loss_mask"]) if m])
    assert trained.startswith("It is 42.") and "6*7" not in trained


def test_a_tool_using_rollout_merges_and_a_rewritten_history_breaks(tok) -> None:
    rows = _as_hosted(tool_rollout("r", "6*7", "42"))
    kept = {"r": {"task_id": "t", "group_id": "g", "reward": 1.0}}
    built = build_samples(tok, rows, kept, 4096)
    if built.bad_traces:  # a template without tools cannot render the tool call: counted, not dropped
        assert sum(built.bad_traces.values()) >= 1
        return
    (s,) = built.samples
    assert s["n_calls"] == 2 and not built.merge_breaks
    rewritten = call_row("r", 2, [{"role": "user", "content": "start over"}],
                         {"role": "assistant", "content": "ok"})
    built = build_samples(tok, rows + _as_hosted([rewritten]), kept, 4096)
    assert len(built.samples) == 2 and built.merge_breaks[TEXT_CHANGE] == 1


def test_bad_traces_are_counted_by_reason(tok) -> None:
    msgs = [{"role": "user", "content": "x" * 50}]
    long = call_row("a", 0, msgs, {"role": "assistant", "content": "y" * 50})
    parts = call_row("b", 0, [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                     {"role": "assistant", "content": "z"})
    junk = {**call_row("c", 0, msgs, {"role": "assistant", "content": "w"}), "response_json": json.dumps({})}
    kept = {k: {"reward": 1.0} for k in "abc"}
    built = build_samples(tok, _as_hosted([long, parts, junk]), kept, 40)
    assert dict(built.bad_traces) == {"too_long": 1, "content_parts": 1, "unreadable": 1}
    assert not built.samples


def test_the_reward_filter() -> None:
    rows = [{"rollout_id": f"r{i}", "task_id": "t" if i < 3 else "u", "status": "ok", "split": None,
             "reward": float(i)} for i in range(5)]
    rows += [{"rollout_id": "held", "task_id": "t", "status": "ok", "split": "eval", "reward": 9.0},
             {"rollout_id": "dead", "task_id": "t", "status": "failed", "split": None, "reward": 9.0}]
    assert set(choose_rollouts(rows, SftConfig(min_reward=2))) == {"r2", "r3", "r4"}
    assert set(choose_rollouts(rows, SftConfig(best_k=1))) == {"r2", "r4"}
    with pytest.raises(SftError, match="no reward"):
        choose_rollouts(rows + [{"rollout_id": "x", "status": "ok", "reward": None}], SftConfig())
    assert "x" in choose_rollouts(rows + [{"rollout_id": "x", "status": "ok", "reward": None}],
                                  SftConfig(unrewarded=True))


def test_a_store_is_read(tmp_path: Path, tok) -> None:
    calls, rollouts = read_traces(make_store(tmp_path / "s"))
    with pytest.raises(SftError, match="1 of the 2 usable rollouts have no reward"):  # r-err
        choose_rollouts(rollouts, SftConfig(min_reward=0.5))
    kept = choose_rollouts(rollouts, SftConfig(min_reward=0.5, unrewarded=True))
    assert set(kept) == {"r-ok"}
    assert build_samples(tok, calls, kept, 4096).calls == 2



def test_a_retried_rollout_is_read_as_its_latest_attempt_with_that_attempts_reward(tmp_path: Path) -> None:
    """Attempt 0 failed and was retried: only attempt 1's calls are traces, under attempt 1's reward
    (the store's own rollouts and rewards views)."""
    from lgt.store.ingest import add_reward, add_rollout
    from lgt.store.writer import TableWriter

    store = tmp_path / "s"
    with TableWriter(store, "calls") as w:
        for attempt, answer in ((0, "41"), (1, "42")):
            for row in tool_rollout("r", "6*7", answer, attempt=attempt):
                w.append(row)
    add_rollout(store, "r", attempt=0, task_id="mult", group_id="g0", status="failed", exit_code=1)
    add_rollout(store, "r", attempt=1, task_id="mult", group_id="g0")
    add_reward(store, "r", 0.0, attempt=0)
    add_reward(store, "r", 1.0, attempt=1)
    calls, rollouts = read_traces(store)
    assert [(r["rollout_id"], r["status"], r["reward"]) for r in rollouts] == [("r", "ok", 1.0)]
    assert {c["attempt"] for c in calls} == {1} and len(calls) == 2

# --- training: the policy loss with advantage 1 and ratio 1 is the NLL; a real lgt-train sft ---------

def test_the_policy_loss_gradient_is_the_nll_gradient(tiny_model_dir: Path, tok) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from lgt.trainer.backends.torch_backend import TorchBackend, TorchConfig
    from lgt.trainer.distill.traces import samples_table
    from lgt.trainer.rl.algorithm import LossConfig

    msgs = [{"role": "user", "content": "What is 6*7?"}]
    row = call_row("r", 0, msgs, {"role": "assistant", "content": "The answer is 42."})
    (s,) = build_samples(tok, _as_hosted([row]), {"r": {"reward": 1.0}}, 4096).samples
    backend = TorchBackend.load(tiny_model_dir, TorchConfig(loss=LossConfig(agg="token-mean")))
    backend.optimizer.zero_grad(set_to_none=True)
    backend.accumulate(samples_table([s]))
    got = {n: p.grad.detach().clone() for n, p in backend.model.named_parameters() if p.grad is not None}
    backend.close()

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    ids, mask = torch.tensor([s["input_ids"]]), torch.tensor(s["loss_mask"][1:], dtype=torch.bool)
    logits = model(input_ids=ids).logits[0, :-1]
    torch.nn.functional.cross_entropy(logits[mask], ids[0, 1:][mask]).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and sum(mask) > 3
    for n in want:  # float32 kernels differ (chunked log-softmax, padding): equal to 1e-3 of the norm
        assert (got[n] - want[n]).norm() <= 1e-3 * want[n].norm() + 1e-8, n


def _teacher_store(root: Path, n: int) -> Path:
    """A hosted teacher's recorded calls: the right answer to each of ``n`` arith problems, rewarded 1;
    and one wrong answer per problem, rewarded 0 (the filter must drop those)."""
    from lgt.store.ingest import add_reward, add_rollout
    from lgt.store.writer import TableWriter
    from lgt.trainer.demo.tasks import arith_tasks

    tasks = arith_tasks(n, seed=1)
    with TableWriter(root, "calls") as w:
        for t in tasks:
            msgs = [{"role": "user", "content": t["question"]}]
            for tag, answer in (("good", t["answer"]), ("bad", t["answer"] + 1)):
                w.append({**call_row(f"{t['task_id']}-{tag}", 0, msgs,
                                     {"role": "assistant", "content": f"The answer is {answer}."}),
                          "request_json": json.dumps({"model": "gpt-4o", "messages": msgs}),
                          "prompt_token_ids": None, "response_token_ids": None, "response_logprobs": None})
    for t in tasks:
        for tag, reward in (("good", 1.0), ("bad", 0.0)):
            add_rollout(root, f"{t['task_id']}-{tag}", task_id=t["task_id"], group_id=t["task_id"], step=0)
            add_reward(root, f"{t['task_id']}-{tag}", reward)
    return root


def test_lgt_train_sft_on_a_teachers_right_answers_lowers_the_nll_and_raises_accuracy(
        tmp_path: Path, arith_student_dir: Path) -> None:
    import shutil

    import torch
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from lgt.trainer.cli import sft_cmd
    from lgt.trainer.demo.evaluation import evaluate
    from lgt.trainer.demo.tokenizer import load_tokenizer

    student = tmp_path / "student"
    shutil.copytree(arith_student_dir, student)
    store = _teacher_store(tmp_path / "traces", 200)
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "a", "question": "q"}\n')
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"agent: {{command: [python, agent.py]}}\ntasks: tasks.jsonl\nmodel: {{path: {student}}}\n"
                   "backend: {lr: 0.001}\nsft: {min_reward: 1, epochs: 20, batch_rollouts: 20}\n")

    def accuracy(d: Path) -> float:
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        return evaluate(model, load_tokenizer(d), "arith", sample=False, n=64)["accuracy"]

    before = accuracy(student)
    res = CliRunner().invoke(sft_cmd, [str(cfg), "--traces", str(store), "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rollouts_kept"] == 200 and summary["samples"] == 200 and not summary["bad_traces"]
    assert summary["nll_last"] < summary["nll_first"] * 0.7
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 200 and all(r["tokens"] > 0 for r in rows)
    after = accuracy(Path(summary["checkpoint"]))
    # measured: 0.016 -> 0.547 (greedy, 64 problems; NLL of the right answers 1.31 -> 0.18). At lr 3e-3
    # for 3 epochs it moved by one problem either way: noise, and a failure in a fresh clone
    assert after >= before + 0.25, (before, after)
    assert "NLL per token" in res.output


def test_bad_input_is_one_sentence(tmp_path: Path, tiny_model_dir: Path) -> None:
    from click.testing import CliRunner

    from lgt.trainer.cli import sft_cmd

    store = _teacher_store(tmp_path / "traces", 3)
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "a", "question": "q"}\n')
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"agent: {{command: [python, agent.py]}}\ntasks: tasks.jsonl\n"
                   f"model: {{path: {tiny_model_dir}}}\n")
    run = ["--run-dir", str(tmp_path / "run")]
    for args, message in [([], "no traces store"), (["--traces", str(tmp_path / "nope")], "is not a store"),
                          (["--traces", str(store), "--set", "sft.min_reward=5"], "kept none of the 6")]:
        res = CliRunner().invoke(sft_cmd, [str(cfg), *args, *run])
        assert res.exit_code == 1 and message in res.output, res.output


@pytest.mark.parametrize("name,passes", [("torch", "epochs"), ("verl", "ppo_epochs")])
def test_sft_trains_each_batch_once_with_either_backend_and_its_own_lr(name: str, passes: str) -> None:
    # sft.epochs counts the passes over the traces; each batch is one pass of the backend (verl names its
    # field ppo_epochs: asking it for `epochs` was a TypeError before any training)
    from lgt.trainer.backends.base import BACKENDS
    from lgt.trainer.distill.sft import sft_backend

    run = BACKENDS[name].config(**{passes: 3, "lr": 1e-6})
    made = sft_backend(run, 1e-4)
    assert (getattr(made, passes), made.lr, type(made)) == (1, 1e-4, type(run))
    assert sft_backend(run, None).lr == 1e-6
