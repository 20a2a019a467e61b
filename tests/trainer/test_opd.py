"""On-policy distillation (``algorithm.estimator: opd``): the teacher's logprobs, the per-token advantages,
the torch backend trained with them, the config's rules, and a real ``lgt-train run`` with a teacher."""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pytest

from lgt.trainer import config
from lgt.trainer.distill import opd
from lgt.trainer.distill.opd import token_advantages
from lgt.trainer.distill.teacher import (
    PAD_LOGPROB,
    Teacher,
    TeacherError,
    TeacherSection,
    probe_mismatch,
    prompt_logprobs_of,
    prompt_top_k_of,
    tokenizer_mismatch,
)

if TYPE_CHECKING:
    from lgt.trainer.serving.engine import Engine

ROOT = Path(__file__).resolve().parents[2]


def _samples(rows: list[dict]) -> pa.Table:
    """A hand-made batch with the columns OPD reads."""
    return pa.table({
        "sample_id": pa.array([r["id"] for r in rows], pa.string()),
        "input_ids": pa.array([r["ids"] for r in rows], pa.list_(pa.int32())),
        "loss_mask": pa.array([r["mask"] for r in rows], pa.list_(pa.int8())),
        "behaviour_logprobs": pa.array([r["blp"] for r in rows], pa.list_(pa.float32())),
        "advantage": pa.array([r["adv"] for r in rows], pa.float64()),
        "loss_weight": pa.array([r.get("w", 0.5) for r in rows], pa.float64()),
    })


# --- (a) the teacher's logprobs are the model's ---------------------------------------------------

def _hf_logprobs(model_dir: Path, seqs: list[list[int]]) -> list[np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = model(input_ids=torch.tensor([s])).logits[0]
            lp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, torch.tensor(s[1:])[:, None])[:, 0]
            out.append(np.concatenate([[0.0], lp.numpy()]))
    return out


def test_teacher_logprobs_equal_what_transformers_computes(arith_model_dir: Path, tiny_model_dir: Path,
                                                          engines: Callable[[Path], Engine]) -> None:
    from lgt.trainer.demo.tokenizer import load_tokenizer

    engine = engines(arith_model_dir, own_weights=True)  # the session's engine serves the teacher here
    tok = load_tokenizer(arith_model_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 3+4?"},
                                    {"role": "assistant", "content": "The answer is 7."}], tokenize=False)
    rng = np.random.default_rng(0)
    seqs = [tok.encode(chat, add_special_tokens=False),
            *[rng.integers(0, len(tok), size=n).tolist() for n in (5, 17, 2)]]
    section = TeacherSection(url=engine.url, batch_sequences=2, concurrency=2)
    teacher = Teacher(section, engine.url, engine.cfg.served_model_name)
    try:
        scored = teacher.score(seqs)
    finally:
        teacher.stop()
    assert (scored.tokens, scored.requests) == (sum(map(len, seqs)), 2)  # 4 sequences, 2 per request
    assert teacher.totals()["tokens"] == scored.tokens and scored.seconds > 0
    for got, want in zip(scored.logprobs, _hf_logprobs(arith_model_dir, seqs)):
        assert got.shape == want.shape and got[0] == 0.0
        np.testing.assert_allclose(got, want, atol=2e-3)
    # teacher.top_k: the engine's top 4 at every position, ranked, as transformers ranks them
    top4 = Teacher(TeacherSection(url=engine.url, top_k=4), engine.url, engine.cfg.served_model_name)
    try:
        ranked = top4.score(seqs)
    finally:
        top4.stop()
    assert ranked.top is not None
    for lp, got_ids, got_lps, want, (want_ids, want_lps) in zip(ranked.logprobs, *ranked.top, scored.logprobs,
                                                                _hf_top_k(arith_model_dir, seqs, 4)):
        np.testing.assert_array_equal(lp, want)  # the sampled token's logprob is unchanged by asking k
        np.testing.assert_allclose(got_lps, want_lps, atol=2e-3)
        clear = np.abs(np.diff(want_lps, axis=1)).min(1) > 1e-2  # positions without near-ties
        np.testing.assert_array_equal(got_ids[clear], want_ids[clear])
    # teacher.url: the engine's one model is the teacher's
    attached = Teacher.attach(TeacherSection(url=engine.url), log=lambda line: None)
    try:
        assert attached.model_name == engine.cfg.served_model_name
        np.testing.assert_array_equal(attached.score(seqs[:1]).logprobs[0], scored.logprobs[0])
        # with no tokenizer files to compare, a probe text tokenized by the teacher stands in
        assert probe_mismatch(arith_model_dir, attached.tokenize) is None
        other = probe_mismatch(tiny_model_dir, attached.tokenize)
        assert other is not None and "they turn the same text into other ids" in other
    finally:
        attached.stop()


def test_a_teacher_that_does_not_answer_is_one_clear_error() -> None:
    from lgt.trainer.serving.children import free_port

    url = f"http://127.0.0.1:{free_port('127.0.0.1')}/v1"
    with pytest.raises(TeacherError, match=r"does not answer GET /v1/models: start it first"):
        Teacher.attach(TeacherSection(url=url), log=lambda line: None)
    teacher = Teacher(TeacherSection(url=url), url, "teacher")
    with pytest.raises(TeacherError, match=f"the teacher at {url} did not answer"):
        teacher.score([[1, 2, 3]])
    teacher.stop()


def _resetting_teacher(resets: int):
    """A teacher on loopback that resets the first ``resets`` connections once it has read their request
    (what a kept-alive connection closed under a request looks like), then answers each request with a
    logprob of -0.5 for every token; returns (url, requests seen, stop)."""
    import socket
    import struct
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    seen: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                while len(body) < length:
                    body += conn.recv(65536)
                seen.append(body)
                if len(seen) <= resets:  # RST instead of an answer
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue
                prompt = json.loads(body)["prompt"]
                choices = [{"index": i, "prompt_logprobs": [None, *({str(t): {"logprob": -0.5}}
                                                                    for t in p[1:])]}
                           for i, p in enumerate(prompt)]
                out = json.dumps({"choices": choices}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(out), out))

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}/v1", seen, srv.close


def test_a_reset_connection_is_asked_again_then_one_clear_error() -> None:
    url, seen, stop = _resetting_teacher(resets=2)
    teacher = Teacher(TeacherSection(url=url), url, "teacher")
    try:
        np.testing.assert_array_equal(teacher.score([[1, 2, 3]]).logprobs[0], [0.0, -0.5, -0.5])
        assert len(seen) == 3  # two resets, then the answer
    finally:
        teacher.stop()
        stop()
    url, seen, stop = _resetting_teacher(resets=10)
    teacher = Teacher(TeacherSection(url=url), url, "teacher")
    try:
        with pytest.raises(TeacherError, match=f"the teacher at {url} did not answer: .*\\(3 tries\\)"):
            teacher.score([[1, 2, 3]])
        assert len(seen) == 3
    finally:
        teacher.stop()
        stop()


def test_prompt_logprobs_that_miss_the_token_are_one_error() -> None:
    entries = [None, {"5": {"logprob": -1.5}}, {"9": {"logprob": -0.25}}]
    np.testing.assert_array_equal(prompt_logprobs_of(entries, [1, 5, 9]), [0.0, -1.5, -0.25])
    with pytest.raises(TeacherError, match="at position 2 do not name the token there"):
        prompt_logprobs_of(entries, [1, 5, 8])
    with pytest.raises(TeacherError, match="3 prompt logprobs for a sequence of 2 tokens"):
        prompt_logprobs_of(entries, [1, 5])


@pytest.mark.slow
def test_a_started_teacher_that_dies_is_started_again_then_one_clear_error(tmp_path: Path,
                                                                           arith_model_dir: Path) -> None:
    import os
    import signal

    from lgt.trainer.serving.launch import EngineConfig

    lines: list[str] = []
    teacher = Teacher.start(TeacherSection(path=arith_model_dir), arith_model_dir,
                                EngineConfig(max_model_len=64), log_path=tmp_path / "teacher.log", seed=0,
                                restarts=1, log=lines.append)
    try:
        first = teacher.score([[1, 2, 3, 4]]).logprobs[0]
        os.killpg(teacher.engine.proc.pid, signal.SIGKILL)
        teacher.engine.proc.wait()
        np.testing.assert_allclose(teacher.score([[1, 2, 3, 4]]).logprobs[0], first, atol=1e-5)  # restarted
        assert any("the teacher's engine died" in line and "restart 1 of 1" in line for line in lines)
        # stopped from outside: asked while vLLM shuts down (it answers 500 or drops the connection
        # meanwhile), the teacher is seen to die, not to fail
        log = teacher.engine.log_path
        seen = log.stat().st_size
        os.killpg(teacher.engine.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while "[shutdown]" not in log.read_text(errors="replace")[seen:] and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(TeacherError) as e:
            teacher.score([[1, 2, 3, 4]])
        assert "was restarted 1 times already (restarts: 1)" in str(e.value) and "\n" not in str(e.value)
    finally:
        teacher.stop()


_HOLDS_REQUESTS = """
import http.server, time
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):  # /health: shutting down
        self.send_response(503); self.send_header("content-length", "0"); self.end_headers()
    def do_POST(self):  # a request it accepted and never answers, as vLLM waiting for its connections
        self.rfile.read(int(self.headers.get("content-length", 0))); time.sleep(3600)
srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""


def test_a_started_teacher_that_holds_a_request_while_shutting_down_is_not_waited_on(tmp_path: Path) -> None:
    """A teacher engine stopped while the student is scored can accept a request and never answer it
    (vLLM waits for open connections before it exits): the request is watched, the engine killed once
    /health stays silent, and the run hears of its exit in seconds, not after teacher.timeout_s (a test
    of the restart above once waited the whole 600 s for it)."""
    import subprocess
    import sys

    from lgt.trainer.serving.engine import Engine
    from lgt.trainer.serving.launch import EngineConfig

    proc = subprocess.Popen([sys.executable, "-c", _HOLDS_REQUESTS], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    port = int(proc.stdout.readline())
    eng = Engine(EngineConfig(max_model_len=64), proc, port, tmp_path / "vllm.log", cpu=True,
                 weight_shapes={}, tied=False, base_url=f"http://127.0.0.1:{port}")
    teacher = Teacher(TeacherSection(path=tmp_path), f"http://127.0.0.1:{port}/v1", "teacher", engine=eng,
                          restarts=0, log=lambda line: None)
    t0 = time.monotonic()
    try:
        with pytest.raises(TeacherError, match="restarted 0 times already"):
            teacher.score([[1, 2, 3]])
        assert time.monotonic() - t0 < 60 and eng.died
    finally:
        eng.stop()
        proc.kill()


# --- (b) the advantages ---------------------------------------------------------------------------

def test_token_advantage_is_teacher_minus_student_on_generated_tokens_only() -> None:
    # sample a: prompt [0], generated [1, 2], tool output [3], generated [4]
    samples = _samples([
        {"id": "a", "ids": [10, 11, 12, 13, 14], "mask": [0, 1, 1, 0, 1],
         "blp": [0.0, -1.0, -0.5, 0.0, -2.0], "adv": 1.0},
        {"id": "b", "ids": [10, 15, 16], "mask": [0, 1, 1], "blp": [0.0, -0.1, -3.0], "adv": -1.0},
    ])
    teacher = [np.array([0.0, -0.2, -0.5, -9.0, -3.0]), np.array([0.0, -0.1, -1.0])]
    out, m = token_advantages(samples, teacher, coef=0.0)
    a, b = out["token_advantage"].to_pylist()
    # teacher - student: a: [_, -0.2+1, -0.5+0.5, _, -3+2] = [0, 0.8, 0, 0, -1]; b: [0, 0, -1+3 = 2]
    np.testing.assert_allclose(a, [0.0, 0.8, 0.0, 0.0, -1.0], atol=1e-6)
    np.testing.assert_allclose(b, [0.0, 0.0, 2.0], atol=1e-6)
    assert a[3] == 0.0  # the tool output's teacher logprob (-9) never reaches the advantage
    # reverse KL = mean over the 5 generated tokens of student - teacher = -(0.8 + 0 - 1 + 0 + 2) / 5
    assert m["opd/reverse_kl"] == pytest.approx(-1.8 / 5)
    assert m["opd/teacher_logprob_mean"] == pytest.approx((-0.2 - 0.5 - 3.0 - 0.1 - 1.0) / 5)
    assert m["opd/tokens"] == 5
    np.testing.assert_allclose(out["teacher_logprobs"].to_pylist()[0], [0, -0.2, -0.5, 0, -3], atol=1e-6)
    assert out["advantage"].to_pylist() == [1.0, -1.0]  # the reward part stays, for the logs

    # the reward mix: + coef x the group advantage, on generated tokens only
    mixed, _ = token_advantages(samples, teacher, coef=0.5)
    a, b = mixed["token_advantage"].to_pylist()
    np.testing.assert_allclose(a, [0.0, 1.3, 0.5, 0.0, -0.5], atol=1e-6)
    np.testing.assert_allclose(b, [0.0, -0.5, 1.5], atol=1e-6)


def test_the_teachers_top_k_is_ranked_padded_and_kept_on_generated_tokens_only() -> None:
    # vLLM's entries: the top k and the prompt's own token (here 9 at position 2, outside the top 2)
    entries = [None, {"5": {"logprob": -0.1, "rank": 1}, "6": {"logprob": -2.5, "rank": 2}},
               {"7": {"logprob": -0.3, "rank": 1}, "8": {"logprob": -1.6, "rank": 2},
                "9": {"logprob": -4.0, "rank": 5}},
               {"3": {"logprob": 0.0, "rank": 1}}]  # a vocabulary of one: padded
    ids, lps = prompt_top_k_of(entries, [1, 5, 9, 3], 2)
    assert ids.tolist() == [[0, 0], [5, 6], [7, 8], [3, 3]]
    np.testing.assert_allclose(lps, [[0, 0], [-0.1, -2.5], [-0.3, -1.6], [0.0, PAD_LOGPROB]])
    samples = _samples([{"id": "a", "ids": [1, 5, 9, 3], "mask": [0, 1, 0, 1], "blp": [0.0, -0.2, 0, -0.1],
                         "adv": 0.0}])
    out, m = token_advantages(samples, [np.array([0, -0.1, -4.0, 0.0])], 0.0, top=([ids], [lps]))
    assert out["teacher_top_k_ids"].to_pylist() == [[0, 0, 5, 6, 0, 0, 3, 3]]  # off the mask: zeros
    np.testing.assert_allclose(out["teacher_top_k_logprobs"].to_pylist()[0],
                               [0, 0, -0.1, -2.5, 0, 0, 0, PAD_LOGPROB], rtol=1e-6)
    # top-1 agrees at both generated tokens (5 and 3); mass: (e^-0.1 + e^-2.5 + e^0) / 2
    assert m["opd/top1_agree"] == 1.0
    assert m["opd/top_k_mass"] == pytest.approx((math.exp(-0.1) + math.exp(-2.5) + 1.0) / 2)
    with pytest.raises(ValueError, match="teacher top-k of shape"):
        token_advantages(samples, [np.array([0, -0.1, -4.0, 0.0])], 0.0, top=([ids[:2]], [lps[:2]]))


def test_missing_behaviour_logprobs_use_the_recomputed_ones() -> None:
    samples = _samples([{"id": "a", "ids": [1, 2, 3], "mask": [0, 1, 1], "blp": [0.0, math.nan, -1.0],
                         "adv": 0.0}])
    teacher = [np.array([0.0, -0.5, -0.5])]
    assert opd.needs_recompute(samples)
    with pytest.raises(ValueError, match="sample a has generated tokens without behaviour logprobs"):
        token_advantages(samples, teacher, 0.0)
    out, _ = token_advantages(samples, teacher, 0.0, recomputed=[np.array([0.0, -2.0, -7.0])])
    np.testing.assert_allclose(out["token_advantage"].to_pylist()[0], [0.0, 1.5, 0.5], atol=1e-6)


def test_opd_estimator_gives_the_group_advantage_per_sample() -> None:
    from lgt.trainer.rl.algorithm import AlgorithmConfig, advantages

    r, g = np.array([1.0, 0.0, 1.0, 1.0]), np.array([0, 0, 1, 1])
    np.testing.assert_allclose(advantages(r, g, AlgorithmConfig(estimator="opd")),
                               advantages(r, g, AlgorithmConfig(estimator="grpo")))


# --- (c) the torch backend with per-token advantages ----------------------------------------------

def test_torch_backend_makes_a_token_with_positive_advantage_more_likely(tiny_model_dir: Path) -> None:
    from lgt.trainer.backends.torch_backend import TorchBackend, TorchConfig
    from lgt.trainer.rl.algorithm import LossConfig

    backend = TorchBackend.load(tiny_model_dir, TorchConfig(lr=1e-2, loss=LossConfig(agg="token-mean")))
    ids = [5, 17, 42, 99, 7, 23]
    base = _samples([{"id": "s", "ids": ids, "mask": [0, 0, 1, 1, 1, 1], "blp": [0.0] * 6, "adv": 0.0}])
    before = backend.sample_logprobs(base)[0]
    blp = pa.array([before.tolist()], pa.list_(pa.float32()))
    # token 2 up (+1), token 3 down (-1), tokens 4 and 5 left alone (0): a per-sample advantage could not
    samples = base.set_column(3, "behaviour_logprobs", blp).append_column(
        "token_advantage", pa.array([[0.0, 0.0, 1.0, -1.0, 0.0, 0.0]], pa.list_(pa.float32())))
    metrics = backend.train_step(samples)
    after = backend.sample_logprobs(base)[0]
    assert metrics["skipped"] == 0.0
    assert after[2] > before[2] + 1e-3 and after[3] < before[3] - 1e-3

    # a non-finite token advantage is one sentence naming the sample
    from lgt.trainer.backends.samples import SampleError
    nan = pa.array([[0, 0, math.nan, 0, 0, 0]], pa.list_(pa.float32()))
    bad = samples.set_column(6, "token_advantage", nan)
    with pytest.raises(SampleError, match="sample s has a non-finite token_advantage"):
        backend.train_step(bad)


@pytest.fixture(scope="module")
def seeded_batch(tmp_path_factory: pytest.TempPathFactory, arith_student_dir: Path):
    """(student dir, teacher dir, calls): 48 answers the 40-step student sampled (seeded) to arith
    questions, as (prompt ids, generated ids), and a teacher of its family trained on right answers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lgt.trainer.demo.factory import make_model

    teacher = make_model(tmp_path_factory.mktemp("opd-teacher") / "t", preset="tiny",
                         warm_start_task="arith", steps=150, correct_fraction=1.0, progress=False)
    tok = AutoTokenizer.from_pretrained(str(arith_student_dir), local_files_only=True)
    student = AutoModelForCausalLM.from_pretrained(str(arith_student_dir), dtype=torch.float32,
                                                   local_files_only=True).eval()
    tasks = [json.loads(line) for line in (ROOT / "examples/arith/tasks.jsonl").read_text().splitlines()]
    torch.manual_seed(0)
    calls = []
    for task in tasks[:48]:
        prompt = tok.apply_chat_template([{"role": "user", "content": task["question"]}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
        prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
        with torch.no_grad():
            out = student.generate(torch.tensor([prompt]), do_sample=True, temperature=1.0, top_k=0,
                                   max_new_tokens=16, pad_token_id=tok.eos_token_id)
        calls.append((prompt, out[0, len(prompt):].tolist()))
    return arith_student_dir, teacher, calls


def _hf_top_k(model_dir: Path, seqs: list[list[int]], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """What the teacher engine's top-k prompt logprobs should be: (ids, logprobs), (L, k) each, row 0
    zeros."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    out = []
    with torch.no_grad():
        for s in seqs:
            lp = torch.log_softmax(model(input_ids=torch.tensor([s])).logits[0, :-1].float(), -1)
            top, idx = lp.topk(k, -1)
            out.append((np.concatenate([np.zeros((1, k), np.int32), idx.numpy().astype(np.int32)]),
                        np.concatenate([np.zeros((1, k), np.float32), top.numpy()])))
    return out


def _update_on_seeded_batch(seeded_batch, tmp_path: Path, top_k: int,
                            coef: float = 1.0) -> tuple[float, float]:
    """Exact KL(student ‖ teacher) on the batch's contexts before and after three torch-backend steps
    (lr 1e-4) on the batch's OPD samples, with the teacher's top ``top_k`` (0: the sampled ratio only)."""
    from lgt.trainer.backends.torch_backend import TorchBackend, TorchConfig
    from lgt.trainer.rl.algorithm import LossConfig

    student_dir, teacher, calls = seeded_batch
    seqs = [[*p, *g] for p, g in calls]
    student_lps = _hf_logprobs(student_dir, seqs)
    samples = _samples([{"id": f"s{i}", "ids": s, "mask": [0] * len(p) + [1] * len(g),
                         "blp": lp.tolist(), "adv": 0.0}
                        for i, ((p, g), s, lp) in enumerate(zip(calls, seqs, student_lps))])
    top = None
    if top_k:
        pairs = _hf_top_k(teacher, seqs, top_k)
        top = ([i for i, _ in pairs], [lp for _, lp in pairs])
    samples, metrics = token_advantages(samples, _hf_logprobs(teacher, seqs), 0.0, top=top)
    assert metrics["opd/reverse_kl"] > 0
    backend = TorchBackend.load(student_dir, TorchConfig(lr=1e-4, loss=LossConfig(agg="token-mean",
                                                                                   opd_top_k_coef=coef)))
    for _ in range(3):
        step = backend.train_step(samples)
        assert step["skipped"] == 0.0 and (("loss/top_k_kl" in step) == bool(top_k))
    after = backend.save_checkpoint(tmp_path / "ckpt")
    backend.close()
    return _exact_reverse_kl(student_dir, teacher, calls), _exact_reverse_kl(after, teacher, calls)


def test_the_top_k_term_is_the_teachers_cross_entropy_in_a_padded_batch(tiny_model_dir: Path) -> None:
    """Two samples of different lengths in one micro-batch, advantages 0 (no policy gradient): the
    backend's gradient is that of Σ_j t_j (log t_j - log s_j) over the teacher's top 3 (renormalised),
    the student's whole-vocabulary log-probs, token-mean over the generated tokens, computed by hand."""
    import torch
    from transformers import AutoModelForCausalLM

    from lgt.trainer.backends.torch_backend import TorchBackend, TorchConfig
    from lgt.trainer.rl.algorithm import LossConfig

    rng = np.random.default_rng(0)
    rows = [([5, 17, 42, 99, 7, 23], [0, 0, 1, 1, 0, 1]), ([8, 9, 10, 11], [0, 1, 1, 1])]
    top_ids = [rng.integers(0, 200, size=(len(i), 3)) for i, _ in rows]
    top_lps = [np.log(rng.dirichlet([1, 1, 1], size=len(i))).astype(np.float32) for i, _ in rows]
    samples = _samples([{"id": f"s{n}", "ids": i, "mask": m, "blp": [0.0] * len(i), "adv": 0.0}
                        for n, (i, m) in enumerate(rows)])
    samples, _ = token_advantages(samples, [np.zeros(len(i)) for i, _ in rows], 0.0, top=(top_ids, top_lps))
    backend = TorchBackend.load(tiny_model_dir, TorchConfig(loss=LossConfig(agg="token-mean",
                                                                            opd_top_k_coef=2.0)))
    backend.optimizer.zero_grad(set_to_none=True)
    metrics = backend.accumulate(samples)
    got = {n: p.grad.detach().clone() for n, p in backend.model.named_parameters() if p.grad is not None}
    backend.close()

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    total, tokens = 0.0, 0
    for (ids, mask), t_ids, t_lps in zip(rows, top_ids, top_lps):
        s = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
        for pos in range(1, len(ids)):
            if mask[pos]:
                t = torch.log_softmax(torch.tensor(t_lps[pos]), -1)
                total = total + (t.exp() * (t - s[pos - 1, torch.tensor(t_ids[pos])])).sum()
                tokens += 1
    (2.0 * total / tokens).backward()
    assert metrics["loss/top_k_kl"] == pytest.approx(float(total.detach()) / tokens, rel=1e-4)
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for n in want:  # float32 kernels differ (padding, a batch of two): within 1% of the norm (measured
        # 0.1%; a position off by one or the student renormalised to the k tokens is off by tens of %)
        assert (got[n] - want[n]).norm() <= 1e-2 * want[n].norm() + 1e-8, n


def test_opd_updates_lower_the_exact_reverse_kl_on_the_students_own_samples(tmp_path: Path,
                                                                            seeded_batch) -> None:
    """The whole update, without the noise of a run: the student samples answers (seeded), the teacher
    scores them, :func:`token_advantages` and three torch-backend steps on that batch; KL(student ‖ teacher)
    summed over the vocabulary on those contexts goes down (a sign or alignment slip sends it up)."""
    before, after = _update_on_seeded_batch(seeded_batch, tmp_path, top_k=0)
    # one sampled log-ratio per token is a weak signal (bench/opd_signal.py): a few % in 3 steps
    assert after < before, (before, after)


def test_the_teachers_top_k_moves_the_student_several_times_further_per_step(tmp_path: Path,
                                                                            seeded_batch) -> None:
    """``teacher.top_k``: the same batch and steps with the teacher's top 8 per position in the loss lower
    the exact reverse KL several times more than the sampled log-ratio alone."""
    before, sampled = _update_on_seeded_batch(seeded_batch, tmp_path / "sampled", top_k=0)
    _, top8 = _update_on_seeded_batch(seeded_batch, tmp_path / "top8", top_k=8)
    print(f"exact KL {before:.4f}: sampled -> {sampled:.4f}, top-8 -> {top8:.4f}")
    # measured: 1.531 -> sampled 1.493, top-8 1.429 (2.7x the drop); without the term it is 1x
    assert before - top8 > 1.5 * (before - sampled) > 0, (before, sampled, top8)


# --- (d) the config's rules -----------------------------------------------------------------------

BASE = "agent: {command: [python, agent.py]}\ntasks: tasks.jsonl\nmodel: {path: m}\n"


def _write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "a", "question": "q"}\n')
    p = tmp_path / "run.yaml"
    p.write_text(BASE + text)
    return p


@pytest.mark.parametrize("extra, message", [
    ("algorithm: {estimator: opd}\n", "algorithm.estimator: opd needs a teacher section"),
    ("teacher: {path: t}\n", "the teacher section is used only by algorithm.estimator: opd, not 'grpo'"),
    ("algorithm: {estimator: opd}\nteacher: {path: t, top_k: 4}\nbackend: {name: verl}\n",
     "teacher.top_k adds a term over the student's whole vocabulary to the torch backend's loss, which the "
     "verl backend does not compute: set teacher.top_k: 0"),
    ("algorithm: {estimator: opd}\nteacher: {}\n", "teacher.path (a model directory, optionally built with "
     "teacher.make) or teacher.url (a running vLLM engine serving the teacher) is needed"),
    ("algorithm: {estimator: opd}\nteacher: {path: t, url: 'http://h:1/v1'}\n",
     "teacher.path and teacher.url are both given"),
    ("algorithm: {estimator: opd}\nteacher: {url: 'h:1'}\n", "teacher.url 'h:1' is not the http(s) base URL"),
    ("algorithm: {estimator: opd}\nteacher: {url: 'http://h:1/v1', make: {preset: tiny}}\n",
     "teacher.make builds the model at teacher.path"),
    ("algorithm: {estimator: opd}\nteacher: {path: t, concurrency: 0}\n", "teacher.concurrency must be"),
    ("algorithm: {estimator: opd, opd_reward_coef: -1}\nteacher: {path: t}\n",
     "opd_reward_coef must be a finite number >= 0"),
    ("algorithm: {estimator: opd}\nteacher: {path: t, make: {correct_fraction: 2}}\n",
     "correct_fraction must be between 0 and 1"),
    ("algorithm: {estimator: opd}\nteacher: {path: t, engine: {model: x}}\n", "teacher.engine.model is set"),
    ("algorithm: {estimator: opd}\nteacher: {path: t, top_k: 101}\n",
     "teacher.top_k must be a whole number from 0 (the sampled log-ratio only) to 100, not 101"),
    ("algorithm: {estimator: opd, opd_top_k_coef: -1}\nteacher: {path: t}\n",
     "opd_top_k_coef must be a finite number >= 0"),
])
def test_bad_teacher_configs_are_one_sentence(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(config.ConfigError) as e:
        config.load(_write(tmp_path, extra))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_opd_on_the_verl_backend_loads_with_the_sampled_log_ratio_only(tmp_path: Path) -> None:
    cfg = config.load(_write(tmp_path, "algorithm: {estimator: opd}\nteacher: {url: 'http://h:1/v1'}\n"
                                       "backend: {name: verl}\n"))
    assert cfg.backend.name == "verl" and cfg.teacher is not None and cfg.teacher.top_k == 0


def test_a_teacher_with_another_tokenizer_is_refused_at_load(tmp_path: Path, tiny_model_dir: Path,
                                                            arith_model_dir: Path) -> None:
    text = f"algorithm: {{estimator: opd}}\nteacher: {{path: {arith_model_dir}}}\n"
    p = _write(tmp_path, text.replace("model: {path: m}", ""))
    p.write_text(p.read_text().replace("model: {path: m}", f"model: {{path: {tiny_model_dir}}}"))
    with pytest.raises(config.ConfigError) as e:
        config.load(p)
    assert "tokenizer is not the student's" in str(e.value) and "vocabulary entries differ" in str(e.value)
    # the same tokenizer (a copy of the student) loads, with the defaults
    same = tmp_path / "same"
    shutil.copytree(tiny_model_dir, same)
    p.write_text(p.read_text().replace(str(arith_model_dir), str(same)))
    cfg = config.load(p)
    assert cfg.teacher.path == same and cfg.algorithm.opd_reward_coef == 0.0
    # one special token changed is named
    tc = json.loads((same / "tokenizer_config.json").read_text())
    tc["eos_token"] = "<|endoftext|>"
    (same / "tokenizer_config.json").write_text(json.dumps(tc))
    assert "its eos_token is '<|endoftext|>'" in tokenizer_mismatch(tiny_model_dir, same)


def test_make_correct_fraction_reaches_the_warm_start(tmp_path: Path) -> None:
    from lgt.trainer.demo.factory import is_made, make_model, read_marker

    out = make_model(tmp_path / "m", preset="tiny", warm_start_task="arith", steps=1,
                     correct_fraction=1.0, progress=False)
    assert read_marker(out)["warm_start_correct_fraction"] == 1.0
    assert is_made(out, preset="tiny", warm_start_task="arith", steps=1, seed=0, correct_fraction=1.0)
    assert not is_made(out, preset="tiny", warm_start_task="arith", steps=1, seed=0)  # 0.4: another


# --- (e) a real run -------------------------------------------------------------------------------

def _exact_reverse_kl(student: Path, teacher: Path, calls: list[tuple[list[int], list[int]]]) -> float:
    """KL(student ‖ teacher) summed over the whole vocabulary at every generated position of ``calls``
    (prompt ids, generated ids), per generated token: the quantity OPD's sampled advantages descend."""
    import torch
    from transformers import AutoModelForCausalLM

    def load(d: Path) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, local_files_only=True).eval()

    s_model, t_model = load(student), load(teacher)
    total = n = 0.0
    with torch.no_grad():
        for prompt, gen in calls:
            ids = torch.tensor([[*prompt, *gen]])
            at = slice(len(prompt) - 1, len(prompt) + len(gen) - 1)  # the positions predicting gen
            s = torch.log_softmax(s_model(input_ids=ids).logits[0, at].float(), -1)
            t = torch.log_softmax(t_model(input_ids=ids).logits[0, at].float(), -1)
            total += float((s.exp() * (s - t)).sum())
            n += len(gen)
    return total / n


@pytest.mark.slow
def test_opd_run_scores_every_step_and_keeps_the_student_near_the_teacher(
        tmp_path: Path, arith_model_dir: Path, engines: Callable[[Path], Engine]) -> None:
    from lgt.store.query import connect
    from lgt.testing.runs import lgt_train, metrics, write_config

    student = engines(arith_model_dir)  # the session's engine serves the student; the run starts a teacher
    run_dir = tmp_path / "run"
    teacher = {"path": str(tmp_path / "teacher"),  # the same family, trained longer on right answers only
               "make": {"preset": "tiny", "warm_start": "arith", "steps": 150, "correct_fraction": 1.0},
               "top_k": 4}
    # lr 3e-4: Adam's first step at 1e-3 overshoots on this model (measured on one batch, exact reverse
    # KL 1.16 -> 1.42 after it, -> 1.06 at 3e-4)
    cfg = write_config(tmp_path, arith_model_dir, engine_url=student.url, steps=3, mode="sync",
                       teacher=teacher, backend={"lr": 3e-4},
                       algorithm={"sample_mode": "exact", "estimator": "opd"})
    out = lgt_train(str(cfg), "--run-dir", str(run_dir), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["teacher/seconds"] > 0 and r["teacher/requests"] >= 1
        assert r["teacher/tokens"] >= r["opd/tokens"] > 0
        assert math.isfinite(r["opd/reverse_kl"]) and r["opd/teacher_logprob_mean"] < 0
        assert 0 < r["opd/top_k_mass"] <= 1.0001 and 0 <= r["opd/top1_agree"] <= 1 and r["loss/top_k_kl"] > 0
    assert "reverse KL" in out.stderr + out.stdout
    assert (run_dir / "logs" / "teacher-engine.log").stat().st_size > 0
    summary = json.loads((run_dir / "summary.json").read_text())  # the teacher's cost, added up
    assert summary["teacher"]["tokens"] == sum(r["teacher/tokens"] for r in rows)
    assert summary["teacher"]["requests"] == sum(r["teacher/requests"] for r in rows)
    # the student did not move away from the teacher: the exact reverse KL on the contexts it visited
    # did not rise past the noise of 3 steps of 8 rollouts (one run measured +3%; with the advantage's sign
    # flipped it rises ~40%); that it goes down is the test above's, on one seeded batch
    calls = connect(run_dir / "store").execute(
        "SELECT prompt_token_ids, response_token_ids FROM calls WHERE len(response_token_ids) > 0").fetchall()
    before = _exact_reverse_kl(arith_model_dir, tmp_path / "teacher", calls)
    after = _exact_reverse_kl(run_dir / "checkpoints" / "step-00000003", tmp_path / "teacher", calls)
    assert after < 1.1 * before, (before, after)
