"""The vLLM engine manager (trainer/serving/engine.py, launch.py) and its weight sync (weights.py,
vllm_ext.py).

Fast tests cover the pure helpers and the input checks that must fail before anything starts. The slow
ones start the real vLLM build installed in this environment (the CPU build here) on the tiny model:
one engine shared by the module for serving and weight sync, one that is broken on purpose (a failed
load, then SIGKILL), and one start that dies on a bad command-line flag.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from lgt.trainer.model_dir import ModelError
from lgt.trainer.serving.children import free_port
from lgt.trainer.serving.engine import Engine
from lgt.trainer.serving.launch import EngineConfig, EngineError, build_command, build_env, tool_call_parser
from lgt.trainer.serving.vllm_ext import iter_safetensors
from lgt.trainer.serving.weights import (
    check_weights,
    checkpoint_shapes,
    checkpoint_tensors,
    collect_tensors,
    ipc_payload,
    write_weights,
)

# A fixed prompt (token ids of the tiny model's 400-token vocabulary) whose logprobs are compared.
PROMPT_IDS = [1, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150]
TOLERANCE = 1e-4


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------- fast: helpers and input checks


def test_command_per_build(tmp_path: Path) -> None:
    cfg = EngineConfig(model=tmp_path, max_model_len=512, gpu_memory_utilization=0.5,
                       extra_args=("--seed", "3"))
    cpu = build_command(cfg, 8123, cpu=True, python="py")
    assert cpu[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert cpu[cpu.index("--port") + 1] == "8123"
    assert cpu[cpu.index("--worker-extension-cls") + 1] == "lgt.trainer.serving.vllm_ext.WeightSyncExtension"
    assert cpu[cpu.index("--dtype") + 1] == "float32" and "--enforce-eager" in cpu
    assert "--enable-sleep-mode" not in cpu and "--gpu-memory-utilization" not in cpu
    assert cpu[-2:] == ["--seed", "3"]
    gpu = build_command(cfg, 8123, cpu=False, python="py")
    assert "--enable-sleep-mode" in gpu and "--dtype" not in gpu and "--enforce-eager" not in gpu
    assert gpu[gpu.index("--gpu-memory-utilization") + 1] == "0.5"


def test_the_engines_tool_call_parser_is_read_from_its_extra_args() -> None:
    assert tool_call_parser(("--enable-auto-tool-choice", "--tool-call-parser", "hermes")) == "hermes"
    assert tool_call_parser(["--tool-call-parser=qwen3_xml"]) == "qwen3_xml"
    assert tool_call_parser(("--enable-auto-tool-choice",)) is None
    assert tool_call_parser(("--tool-call-parser",)) is None  # no name after it: vLLM refuses it itself


def test_env_defaults_and_overrides(tmp_path: Path) -> None:
    env = build_env(EngineConfig(model=tmp_path), cpu=True, base={"PATH": "/bin"})
    assert env["PATH"] == "/bin" and env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    env = build_env(EngineConfig(model=tmp_path, env={"VLLM_CPU_KVCACHE_SPACE": "4"}), cpu=True, base={})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "VLLM_CPU_KVCACHE_SPACE" not in build_env(EngineConfig(model=tmp_path), cpu=False, base={})
    # torch.compile off on CPU (its ops eager), unless the run config or the caller's environment says
    assert env["TORCHDYNAMO_DISABLE"] == "1"
    assert "TORCHDYNAMO_DISABLE" not in build_env(EngineConfig(model=tmp_path), cpu=False, base={})
    assert build_env(EngineConfig(model=tmp_path, env={"TORCHDYNAMO_DISABLE": "0"}), cpu=True,
                     base={})["TORCHDYNAMO_DISABLE"] == "0"
    assert build_env(EngineConfig(model=tmp_path), cpu=True, base={"TORCHDYNAMO_DISABLE": "0"}
                     )["TORCHDYNAMO_DISABLE"] == "0"
    # vLLM's busy-wait window between its processes: short on CPU, vLLM's own on a GPU unless asked
    assert env["LGT_VLLM_IDLE_SPIN_S"] == "0.05"
    assert "LGT_VLLM_IDLE_SPIN_S" not in build_env(EngineConfig(model=tmp_path), cpu=False, base={})
    asked = build_env(EngineConfig(model=tmp_path, idle_spin_s=0.2), cpu=False, base={})
    assert asked["LGT_VLLM_IDLE_SPIN_S"] == "0.2"
    # temporary files go to the engine's scratch folder; the compile cache stays shared where it was
    scratch = build_env(EngineConfig(model=tmp_path), cpu=True, base={"TMPDIR": "/var/tmp"}, scratch="/s")
    assert scratch["TMPDIR"] == scratch["VLLM_RPC_BASE_PATH"] == "/s"
    assert scratch["TORCHINDUCTOR_CACHE_DIR"].startswith("/var/tmp/torchinductor_")


@pytest.mark.parametrize("kwargs, word", [({"port": 70000}, "port"), ({"ready_timeout": 0}, "ready_timeout"),
                                          ({"max_model_len": 0}, "max_model_len"),
                                          ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
                                          ({"idle_spin_s": -1.0}, "idle_spin_s")])
def test_config_rejects_bad_values(tmp_path: Path, kwargs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        EngineConfig(model=tmp_path, **kwargs)


def test_write_weights_is_whole_and_unties(tmp_path: Path) -> None:
    emb = torch.randn(6, 4)
    named = [("model.embed_tokens.weight", emb), ("lm_head.weight", emb),  # tied: one storage
             ("model.norm.weight", torch.ones(4, dtype=torch.bfloat16)),
             ("t", torch.randn(4, 6).t())]  # not contiguous
    tensors = collect_tensors(named)
    path, nbytes = write_weights(tensors, tmp_path)
    assert os.listdir(tmp_path) == [path.name] and path.suffix == ".safetensors"  # no temp file left
    assert nbytes == 6 * 4 * 4 * 2 + 4 * 2 + 24 * 4
    back = dict(iter_safetensors(path))
    assert back.keys() == {name for name, _ in named}
    for name, t in named:
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)


def test_collect_tensors_rejects_bad_input() -> None:
    with pytest.raises(EngineError, match="no weights"):
        collect_tensors([])
    with pytest.raises(EngineError, match="'a' is given twice"):
        collect_tensors([("a", torch.zeros(1)), ("a", torch.zeros(1))])


def test_check_weights_against_checkpoint(tiny_model_dir: Path) -> None:
    expected = checkpoint_shapes(tiny_model_dir)
    assert "model.embed_tokens.weight" in expected and "lm_head.weight" not in expected  # tied: not saved
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    state = collect_tensors(model.state_dict().items())
    check_weights(state, expected, tied=True)  # the tied head's extra name is fine
    with pytest.raises(EngineError, match="not in the served model's checkpoint"):
        check_weights(state, expected, tied=False)
    with pytest.raises(EngineError, match="1 of the served model's weights are missing"):
        check_weights({k: v for k, v in state.items() if k != "model.norm.weight"}, expected, tied=True)
    with pytest.raises(EngineError, match="'model.norm.weight' has shape"):
        check_weights({**state, "model.norm.weight": torch.ones(3)}, expected, tied=True)
    check_weights({"anything": torch.ones(1)}, {}, tied=False)  # no safetensors checkpoint: not checked


def test_corrupt_checkpoint_fails_before_starting(tiny_model_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    log = tmp_path / "engine.log"
    with pytest.raises(EngineError, match="model.safetensors is not a readable safetensors file"):
        Engine.start(EngineConfig(model=bad, log_path=log))
    assert not log.exists()


def test_not_a_causal_lm_fails_before_starting(tmp_path: Path) -> None:
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"],
                                                  "model_type": "bert", "vocab_size": 100}))
    log = tmp_path / "engine.log"
    with pytest.raises(ModelError, match="not a causal language model"):
        Engine.start(EngineConfig(model=bert, log_path=log))
    with pytest.raises(ModelError, match="no config.json"):
        Engine.start(EngineConfig(model=tmp_path, log_path=log))
    assert not log.exists()  # nothing was started


def test_busy_port_fails_before_starting(tiny_model_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        log = tmp_path / "engine.log"
        with pytest.raises(EngineError, match=f"port {port} on 127.0.0.1 is already in use"):
            Engine.start(EngineConfig(model=tiny_model_dir, port=port, log_path=log))
    assert not log.exists()


# ---------------------------------------------------------------- slow: real engines


@pytest.mark.slow
def test_engine_dying_during_start_reports_its_log(tiny_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    cfg = EngineConfig(model=tiny_model_dir, log_path=log, extra_args=("--no-such-flag",))
    with pytest.raises(EngineError) as info:
        Engine.start(cfg)
    msg = str(info.value)
    assert "exited with code" in msg and "while starting" in msg and str(log) in msg
    assert "--no-such-flag" in msg  # vLLM's own complaint, from the log's last lines
    pid = int(re.search(r"\(pid (\d+)\)", msg).group(1))
    assert not group_alive(pid)


@pytest.mark.slow
def test_failed_load_then_killed_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    eng = Engine.start(EngineConfig(model=tiny_model_dir, max_model_len=256, log_path=log))
    try:
        with pytest.raises(EngineError, match="'model.no_such_layer.weight'"):
            eng.update_weights([("model.no_such_layer.weight", torch.zeros(3))])
        assert not eng.is_paused()  # refused before anything was sent
        pgid = eng.pid
        os.kill(eng.pid, signal.SIGKILL)
        dead = rf"the vLLM engine \(pid {pgid}\) exited with code -9; its log: {log}"
        with pytest.raises(EngineError, match=dead):
            eng.resume()
        assert not group_alive(pgid)  # the engine core child was stopped with it
        with pytest.raises(EngineError, match=f"pid {pgid}"):
            eng.check_alive()
    finally:
        eng.stop()


def test_an_engine_stopped_from_outside_mid_request_is_named_dead(tiny_model_dir: Path,
                                                                 tmp_path: Path) -> None:
    """SIGTERM to the engine's group (a user's kill, a node draining) while the trainer asks it something:
    the request fails as the engine's exit, so a supervisor starts it again, not as a dropped connection
    (which ended a demo run: vLLM's shutdown outlasted the two seconds it was given)."""
    log = tmp_path / "vllm.log"
    eng = Engine.start(EngineConfig(model=tiny_model_dir, max_model_len=256, log_path=log))
    try:
        pgid = eng.pid
        os.killpg(pgid, signal.SIGTERM)
        with pytest.raises(EngineError, match=rf"the vLLM engine \(pid {pgid}\) exited with code"):
            eng.pause()
        assert eng.died
    finally:
        eng.stop()


_SHUTTING_DOWN = """
import http.server, os, sys, threading
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def answer(self):
        busy = b'{"error":"Failed to pause generation: cannot schedule new futures after shutdown"}'
        code, body = (200, b"") if self.path == "/health" else (500, busy)
        self.send_response(code); self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body)
        if code == 500:  # /health answers a moment longer, then the process exits
            threading.Timer(1.5, lambda: os._exit(0)).start()
    do_GET = do_POST = answer
srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""


def test_a_500_after_shutdown_while_health_still_answers_is_named_dead(tmp_path: Path) -> None:
    """vLLM shutting down can answer a request 500 ("cannot schedule new futures after shutdown") while
    its /health still answers for a moment: the request fails as the engine's exit (seen in CI), not as
    a 500 a supervisor would not restart."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _SHUTTING_DOWN], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    port = int(proc.stdout.readline())
    eng = Engine(EngineConfig(max_model_len=64), proc, port, tmp_path / "vllm.log", cpu=True,
                 weight_shapes={}, tied=False, base_url=f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(EngineError, match=rf"the vLLM engine \(pid {proc.pid}\) exited with code 0"):
            eng.pause()
        assert eng.died
    finally:
        eng.stop()
        proc.kill()


def test_an_engine_stopped_while_a_pause_drains_is_named_dead_not_waited_on(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    """SIGTERM while ``pause("wait")`` drains a long generation: vLLM stops answering /health but waits
    for its open connections before it exits, and the pause it accepted is never answered; the trainer
    must not wait forever on it (it did, in CI) but name the engine's exit."""
    eng = Engine.start(EngineConfig(model=tiny_model_dir, max_model_len=512, log_path=tmp_path / "vllm.log"))
    try:
        def generate() -> None:
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{eng.url}/completions", trust_env=False, timeout=300,
                           json={"model": "policy", "prompt": [5, 6, 7], "max_tokens": 500,
                                 "ignore_eos": True, "temperature": 1.0})

        for _ in range(16):
            threading.Thread(target=generate, daemon=True).start()
        time.sleep(0.5)  # generating
        pgid = eng.pid
        stop = threading.Timer(0.3, os.killpg, (pgid, signal.SIGTERM))  # while the pause drains
        stop.start()
        outcome: list[BaseException | None] = []

        def pause() -> None:
            try:
                eng.pause("wait")
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - examined below
                outcome.append(e)

        waiter = threading.Thread(target=pause, daemon=True)
        waiter.start()
        waiter.join(120)
        assert not waiter.is_alive(), "pause() still waits on an engine that was stopped"
        # the drain may also have finished before the SIGTERM landed: then the next request names the exit
        if outcome[0] is None:
            stop.join()
            eng.await_exit()
            with pytest.raises(EngineError, match=rf"the vLLM engine \(pid {pgid}\) exited with code"):
                eng.resume()
        else:
            assert isinstance(outcome[0], EngineError), outcome[0]
            assert f"the vLLM engine (pid {pgid}) exited with code" in str(outcome[0])
        assert eng.died
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("engine") / "vllm.log"
    with Engine.start(EngineConfig(model=tiny_model_dir, max_model_len=512, log_path=log)) as eng:
        eng.log_at_start = log.read_text(errors="replace")  # what it had done when handed out
        yield eng


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[OpenAI]:
    with httpx.Client(trust_env=False) as http:
        yield OpenAI(base_url=engine.url, api_key="unused", http_client=http, max_retries=0)


def engine_logprobs(eng: Engine, ids: list[int]) -> torch.Tensor:
    """The engine's log p(ids[t] | ids[:t]) for t >= 1, shape (len(ids) - 1,), via prompt_logprobs."""
    with httpx.Client(trust_env=False, timeout=120) as http:  # a first request may compile kernels
        resp = http.post(f"{eng.url}/completions", json={"model": "policy", "prompt": ids, "max_tokens": 1,
                                                         "temperature": 0, "prompt_logprobs": 0})
    resp.raise_for_status()
    prompt_logprobs = resp.json()["choices"][0]["prompt_logprobs"]
    return torch.tensor([step[str(tok)]["logprob"] for step, tok in zip(prompt_logprobs[1:], ids[1:])])


def hf_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log p(ids[t] | ids[:t]) for t >= 1, shape (len(ids) - 1,)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


@pytest.mark.slow
def test_chat_with_sdk_returns_token_ids(engine: Engine, client: OpenAI) -> None:
    assert engine.url == f"http://127.0.0.1:{engine.port}/v1"
    messages = [{"role": "user", "content": "What is 2+3?"}]
    resp = client.chat.completions.create(model="policy", messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, extra_body={"return_token_ids": True})
    extra = resp.model_extra or {}
    assert extra["prompt_token_ids"] and all(isinstance(t, int) for t in extra["prompt_token_ids"])
    choice = resp.choices[0]
    token_ids = (choice.model_extra or {})["token_ids"]
    assert len(token_ids) == resp.usage.completion_tokens == len(choice.logprobs.content) > 0
    plain = client.chat.completions.create(model="policy", messages=messages, max_tokens=8, temperature=0)
    assert (plain.model_extra or {}).get("prompt_token_ids") is None  # only when asked
    assert plain.choices[0].message.content == choice.message.content


@pytest.mark.slow
def test_the_engine_is_warmed_up_with_a_logprobs_request_before_it_is_handed_out(
        engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """Engine.start asked one token with its logprob (vLLM compiles its logprobs op on the first such
    request, and every call arriving meanwhile waited for it) before it returned; an engine that
    refuses the warm-up is logged, not fatal."""
    served = [ln for ln in engine.log_at_start.splitlines() if '"POST /v1/completions HTTP/1.1" 200' in ln]
    assert len(served) == 1, engine.log_at_start[-2000:]
    assert engine.warm_up() is not None  # warm already: it answers again
    other = Engine(EngineConfig(model=engine.cfg.model, served_model_name="not-served"), None, engine.port,
                   None, cpu=True, weight_shapes={}, tied=False)
    with caplog.at_level("WARNING", logger="lgt.trainer.serving.engine"):
        assert other.warm_up() is None
    assert "did not answer its warm-up request (404)" in caplog.text, caplog.text
    other.stop()


@pytest.mark.slow
def test_plugin_shortens_the_busy_wait_in_every_engine_process(engine: Engine) -> None:
    """lgt's vLLM plugin (entry point vllm.general_plugins) ran in the engine core and in the worker,
    each a process vLLM spawned, with the window the engine was started with."""
    text = engine.log_path.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if "lgt: vLLM readers busy-wait at most 0.05 s" in ln]
    assert any("EngineCore" in ln for ln in lines), text[-2000:]
    assert any("Worker" in ln for ln in lines), text[-2000:]


def test_plugin_leaves_vllm_alone_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.device_communicators import shm_broadcast

    from lgt.trainer.serving import vllm_plugin

    original = shm_broadcast.SpinCondition.wait
    monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    vllm_plugin.register()
    assert shm_broadcast.SpinCondition.wait is original
    monkeypatch.setenv(vllm_plugin.ENV, "not a number")
    vllm_plugin.register()
    assert shm_broadcast.SpinCondition.wait is original
    monkeypatch.setenv(vllm_plugin.ENV, "0.01")
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", original)  # restored after the test
    vllm_plugin.register()
    patched = shm_broadcast.SpinCondition.wait
    assert patched is not original and patched.lgt_window == 0.01
    vllm_plugin.register()  # twice in one process: patched once
    assert shm_broadcast.SpinCondition.wait is patched

    class Reader:  # what vLLM's wait reads of a reader that has just read a message
        is_reader, busy_loop_s, last_read = True, 1.0, time.monotonic()

    reader = Reader()
    patched(reader, timeout_ms=0)  # within the window: vLLM's wait yields once and returns
    assert reader.busy_loop_s == 0.01


@pytest.mark.slow
def test_pause_resume_and_sleep_on_cpu(engine: Engine) -> None:
    engine.pause("wait")
    assert engine.is_paused()
    engine.resume()
    assert not engine.is_paused()
    with pytest.raises(ValueError, match="pause mode 'later'"):
        engine.pause("later")
    if engine.cpu:  # sleep frees nothing on the CPU build: a logged no-op, the engine keeps serving
        engine.sleep()
        engine.wake_up()
        engine.check_alive()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["file", "shm"])
def test_weight_sync_matches_transformers(engine: Engine, tiny_model_dir: Path, tmp_path: Path,
                                          transport: str) -> None:
    segments_before = set(os.listdir("/dev/shm"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    old = hf_logprobs(model, PROMPT_IDS)
    assert (engine_logprobs(engine, PROMPT_IDS) - old).abs().max() < TOLERANCE

    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    new = hf_logprobs(model, PROMPT_IDS)
    assert (new - old).abs().max() > 0.1  # the perturbation moves the logprobs

    seconds = engine.update_weights(model.named_parameters(), transport, directory=tmp_path)
    assert seconds > 0 and engine.last_sync is not None and engine.last_sync.total == seconds
    assert (engine_logprobs(engine, PROMPT_IDS) - new).abs().max() < TOLERANCE
    assert os.listdir(tmp_path) == []  # the weights file is gone
    assert set(os.listdir("/dev/shm")) <= segments_before  # and no shared-memory segment is left

    engine.update_weights(original.items(), transport)  # back, from a state dict with the tied lm_head
    assert (engine_logprobs(engine, PROMPT_IDS) - old).abs().max() < TOLERANCE
    assert not engine.is_paused()


@pytest.mark.slow
def test_weight_sync_while_clients_run(engine: Engine, client: OpenAI, tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    errors: list[BaseException] = []
    finished: list[str] = []

    def chat() -> None:
        try:
            for _ in range(4):
                r = client.chat.completions.create(model="policy", max_tokens=16, temperature=1.0,
                                                   messages=[{"role": "user", "content": "What is 1+1?"}])
                finished.append(r.choices[0].finish_reason)
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=chat) for _ in range(8)]
    for t in threads:
        t.start()
    for _ in range(3):
        engine.update_weights(model.named_parameters())
    for t in threads:
        t.join()
    assert errors == [] and len(finished) == 32 and set(finished) <= {"stop", "length"}


@pytest.mark.slow
def test_an_attached_engine_serves_a_checkpoint_and_is_left_running(engine: Engine, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    """``engine: {url: …}``: a run uses an engine it did not start — it loads its own weights into it
    (whatever the engine served before) and leaves it running when it ends."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    old = hf_logprobs(model, PROMPT_IDS)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # the engine serves someone else's weights now
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    engine.update_weights(model.named_parameters())
    assert (engine_logprobs(engine, PROMPT_IDS) - old).abs().max() > 0.1

    attached = Engine.attach(EngineConfig(url=engine.url, model=tiny_model_dir))
    assert attached.attached and attached.pid is None and attached.base_url == engine.base_url
    attached.update_weights(checkpoint_tensors(tiny_model_dir))
    assert (engine_logprobs(attached, PROMPT_IDS) - old).abs().max() < TOLERANCE
    attached.check_alive()
    attached.stop()
    engine.check_alive()  # still running: it was not the attached object's to stop

    with pytest.raises(EngineError, match=r"does not answer GET /v1/models: start one first"):
        Engine.attach(EngineConfig(url=f"http://127.0.0.1:{free_port('127.0.0.1')}/v1", model=tiny_model_dir))
    with pytest.raises(EngineError, match=r"serves policy, not 'other' \(engine.served_model_name\)"):
        Engine.attach(EngineConfig(url=engine.url, model=tiny_model_dir, served_model_name="other"))
    with pytest.raises(ValueError, match="engine url 'localhost:1' is not the http"):
        EngineConfig(url="localhost:1")


@pytest.mark.slow
def test_stop_leaves_no_process(engine: Engine) -> None:
    """Runs last in this module: it stops the shared engine."""
    pgid = engine.pid
    assert group_alive(pgid)
    # vLLM's IPC sockets are in the engine's own temporary folder (vLLM leaves them behind in /tmp)
    assert engine.scratch and any(p.is_socket() for p in Path(engine.scratch).iterdir())
    engine.stop()
    assert not group_alive(pgid) and engine.proc.returncode is not None
    assert not os.path.exists(engine.scratch)
    engine.stop()  # idempotent
    with pytest.raises(EngineError, match="was stopped"):
        engine.check_alive()


# -- the GPU path's weight transport (CUDA IPC): checked without a GPU as far as it goes ------------------


def _rebuild_probe(*args):
    """Stands in for torch's rebuild_cuda_tensor: gives back the arguments it was called with."""
    return torch.tensor([float(args[6])])


def test_ipc_payload_is_opened_on_the_workers_own_device() -> None:
    import base64
    import pickle

    from lgt.trainer.serving.vllm_ext import IPC_DEVICE_ARG, open_ipc_payload

    args = tuple(range(15))  # rebuild_cuda_tensor's 15 arguments; [6] is the sender's device index
    payload = base64.b64encode(pickle.dumps([("w", _rebuild_probe, args)])).decode()
    [(name, tensor)] = open_ipc_payload(payload, device=3)
    assert name == "w" and tensor.item() == 3.0 and IPC_DEVICE_ARG == 6
    with pytest.raises(EngineError, match="'w' is on cpu: CUDA IPC shares GPU tensors only"):
        ipc_payload({"w": torch.zeros(2)})
    if torch.cuda.is_available():  # on a GPU: the real handles open in this process too
        t = torch.arange(4.0, device="cuda")
        [(_, opened)] = open_ipc_payload(ipc_payload({"w": t}), torch.cuda.current_device())
        assert torch.equal(opened.cpu(), t.cpu())


def test_scratch_folders_of_killed_engines_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    import subprocess
    import sys

    from lgt.trainer.serving.launch import OWNER_FILE, SCRATCH_PREFIX, _owner, sweep_scratch

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_owner = _owner(gone.pid)  # taken while it runs; then it exits
    gone.wait()
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        folders = {}
        for name, owner in (("dead", dead_owner), ("live", _owner(parent.pid)), ("mine", _owner()),
                            ("reused", f"{parent.pid} 1"), ("unowned", None)):
            folders[name] = d = tmp_path / f"{SCRATCH_PREFIX}{name}"
            (d / "sub").mkdir(parents=True)
            if owner is not None:
                (d / OWNER_FILE).write_text(owner)
        (tmp_path / "other-dead").mkdir()
        (tmp_path / "other-dead" / OWNER_FILE).write_text(dead_owner)
        removed = sweep_scratch(str(tmp_path))
    finally:
        parent.kill()
        parent.wait()
    assert sorted(p.name for p in removed) == [f"{SCRATCH_PREFIX}dead", f"{SCRATCH_PREFIX}reused"]
    assert [n for n, d in folders.items() if d.exists()] == ["live", "mine", "unowned"]
    assert (tmp_path / "other-dead").exists()
