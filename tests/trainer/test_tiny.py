"""The model-directory check (trainer/model_dir.py) and the demo models and tasks (trainer/demo/)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from lgt.trainer.demo.chat import parse_tool_call, tool_call_text
from lgt.trainer.demo.dialogues import DialogueEncoder, calc_example, words_example
from lgt.trainer.demo.factory import make_model, read_marker
from lgt.trainer.demo.model import build_model, count_parameters
from lgt.trainer.demo.tasks import (
    CALC_TOOL,
    WORD_VOCAB,
    TinyModelError,
    arith_error,
    arith_reward,
    arith_tasks,
    calc_error,
    calc_messages,
    calc_tasks,
    calculate,
    carry_error,
    carry_tasks,
    words_reward,
    words_tasks,
)
from lgt.trainer.demo.tokenizer import build_tokenizer, load_tokenizer
from lgt.trainer.demo.warmstart import warm_start
from lgt.trainer.model_dir import ModelError, ModelInfo, check_model_dir

QWEN_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 300,
               "max_position_embeddings": 1024, "tie_word_embeddings": True, "eos_token_id": 2}


def write_model_dir(path: Path, *, config: dict | None = None, tokenizer: bool = True,
                    template: str | None = "{{ messages }}") -> Path:
    """A model directory holding only the JSON files check_model_dir reads (no weights needed)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(QWEN_CONFIG if config is None else config))
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
        tok_config = {"eos_token": "<|im_end|>"}
        if template is not None:
            tok_config["chat_template"] = template
        (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


# --- check_model_dir ---------------------------------------------------------------------------------

def test_check_model_dir_good(tmp_path: Path) -> None:
    info = check_model_dir(write_model_dir(tmp_path / "m"), need_chat_template=True)
    assert info == ModelInfo(path=tmp_path / "m", architecture="Qwen2ForCausalLM", model_type="qwen2",
                             vocab_size=300, max_position_embeddings=1024, tie_word_embeddings=True,
                             has_chat_template=True, eos_token_id=2, eos_token_ids=(2,))


def test_max_model_len_past_the_models_positions_is_refused(tmp_path: Path) -> None:
    info = check_model_dir(write_model_dir(tmp_path / "m"))
    info.check_context(1024)
    info.check_context(None)
    with pytest.raises(ModelError, match=r"^max_model_len 4096 exceeds .*'s max_position_embeddings 1024: "
                                         r"positions past it are not computed correctly; "
                                         r"lower max_model_len$"):
        info.check_context(4096)
    scaled = {**QWEN_CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    check_model_dir(write_model_dir(tmp_path / "y", config=scaled)).check_context(4096)  # scaled: allowed


def test_check_model_dir_template_file_and_generation_config_eos(tmp_path: Path) -> None:
    """transformers >= 4.47 keeps the template in chat_template.jinja; eos may live in generation_config."""
    config = {k: v for k, v in QWEN_CONFIG.items() if k != "eos_token_id"}
    d = write_model_dir(tmp_path / "m", config=config, template=None)
    assert not check_model_dir(d).has_chat_template
    (d / "chat_template.jinja").write_text("{{ messages }}")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 3]}))
    info = check_model_dir(d, need_chat_template=True)
    assert info.has_chat_template and info.eos_token_id == 7 and info.eos_token_ids == (7, 3)


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "nope", r"nope does not exist"),
    (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", r"f.txt is not a directory"),
    (lambda p: p, r"has no config.json"),
    (lambda p: (p / "config.json").write_text("{oops") and p, r"is not a readable model config"),
    (lambda p: write_model_dir(p, config={**QWEN_CONFIG, "architectures": ["BertModel"],
                                          "model_type": "bert"}),
     r"is not a causal language model: its config.json names BertModel \(need an architecture ending in "
     r"ForCausalLM\)"),
    (lambda p: write_model_dir(p, config={"vocab_size": 3}),
     r"is not a causal language model: its config.json names no architecture"),
    (lambda p: write_model_dir(p, config={**QWEN_CONFIG, "vocab_size": None}), r"has no positive vocab_size"),
    (lambda p: write_model_dir(p, tokenizer=False), r"has no tokenizer: lgt needs tokenizer.json"),
])
def test_check_model_dir_errors(tmp_path: Path, make, message: str) -> None:
    with pytest.raises(ModelError, match=message):
        check_model_dir(make(tmp_path))


def test_check_model_dir_needs_template(tmp_path: Path) -> None:
    d = write_model_dir(tmp_path / "m", template=None)
    assert check_model_dir(d).has_chat_template is False
    message = (r"m has no chat template: lgt needs one to turn the agent's messages into tokens "
               r"\(add chat_template to tokenizer_config.json\)")
    with pytest.raises(ModelError, match=message):
        check_model_dir(d, need_chat_template=True)


def test_check_model_dir_other_causal_lm_names(tmp_path: Path) -> None:
    """GPT2LMHeadModel is a causal LM that AutoModelForCausalLM maps; an encoder-decoder is not."""
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257}
    info = check_model_dir(write_model_dir(tmp_path / "gpt2", config=gpt2))
    assert info.architecture == "GPT2LMHeadModel" and info.max_position_embeddings is None
    t5 = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": 32128}
    with pytest.raises(ModelError, match="names T5ForConditionalGeneration"):
        check_model_dir(write_model_dir(tmp_path / "t5", config=t5))


# --- tasks, rewards, calculator --------------------------------------------------------------------------

def test_arith_tasks_cover_the_space_in_a_seeded_order() -> None:
    tasks = arith_tasks(200, seed=3)
    assert tasks == arith_tasks(200, seed=3) != arith_tasks(200, seed=4)
    assert len({t["question"] for t in tasks}) == 200 and len({t["task_id"] for t in tasks}) == 200
    assert any(t["question"] == "What is 7+5?" and t["answer"] == 12 for t in tasks)
    for t in tasks:
        a, op, b = t["question"][8], t["question"][9], t["question"][10]
        assert t["answer"] == (int(a) + int(b) if op == "+" else int(a) * int(b))
    assert len(arith_tasks(250)) == 250 and {t["question"][9] for t in arith_tasks(50, ops="*")} == {"*"}
    with pytest.raises(TinyModelError, match="ops '/' is not"):
        arith_tasks(3, ops="/")


def test_carry_tasks_are_the_two_digit_additions_that_carry() -> None:
    tasks = carry_tasks(4000, seed=3)
    assert tasks[:100] == carry_tasks(100, seed=3) != carry_tasks(100, seed=4)
    assert len({t["question"] for t in tasks[:3645]}) == 3645 and len({t["task_id"] for t in tasks}) == 4000
    for t in tasks:
        a, b = (int(x) for x in t["question"][8:-1].split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and a % 10 + b % 10 >= 10 and t["answer"] == a + b
    # the warm start's habit: the carry from the ones is forgotten, the rest added right
    assert carry_error("What is 47+38?") == 75 and carry_error("What is 67+58?") == 115
    assert all(carry_error(t["question"]) == t["answer"] - 10 for t in tasks)
    with pytest.raises(TinyModelError, match="not a carry question"):
        carry_error("What is 7+5?")


def test_calc_tasks() -> None:
    tasks = calc_tasks(30, seed=1)
    assert tasks == calc_tasks(30, seed=1)
    for t in tasks:
        assert t["question"] == f"What is {t['expression']}?" and calculate(t["expression"]) == t["answer"]
        a, b = (int(x) for x in t["expression"].replace("*", "+").split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99


def test_arith_reward_is_format_exact() -> None:
    assert arith_reward("The answer is 12.", 12) == 1.0
    assert arith_reward("  The answer is 12.\n", "12") == 1.0
    for text in ("The answer is 13.", "The answer is 12", "the answer is 12.", "The answer is 12. Yes.",
                 "12", "The answer is 12.0."):
        assert arith_reward(text, 12) == 0.0, text


def test_fixed_errors_are_wrong_and_fixed() -> None:
    for t in arith_tasks(200):
        wrong = arith_error(t["question"], t["answer"])
        assert wrong != t["answer"] and wrong >= 0 and wrong == arith_error(t["question"], t["answer"])
    for t in calc_tasks(200, seed=2, ops="+-*"):
        wrong = calc_error(t["expression"])
        assert calculate(wrong) != t["answer"] and wrong == calc_error(t["expression"])


def test_calculate() -> None:
    assert calculate("23*47") == 1081 and calculate(" (2+3)*-4 - 1 ") == -21
    for bad in ("2/3", "x+1", "2**8", "1.5+1", "", "__import__('os')"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            calculate(bad)


def test_parse_tool_call() -> None:
    text = tool_call_text("calculator", {"expression": "23*47"})
    assert text == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "23*47"}}\n</tool_call>'
    assert parse_tool_call(text) == {"name": "calculator", "arguments": {"expression": "23*47"}}
    assert parse_tool_call(text[: -len("</tool_call>")]) is not None  # closing tag optional at the end
    assert parse_tool_call("The answer is 3.") is None
    assert parse_tool_call('<tool_call>\n{"name": "calculator"}\n</tool_call>') is None
    assert parse_tool_call("<tool_call>\n{oops\n</tool_call>") is None


# --- tokenizer and chat template ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path):
    return load_tokenizer(tokenizer_dir)


def test_tokenizer_round_trips_task_text(tok) -> None:
    texts = [t["question"] for t in arith_tasks(20)] + [t["question"] for t in calc_tasks(20)]
    texts += ["The answer is 1081.", "The answer is -32.", json.dumps(CALC_TOOL),
              tool_call_text("calculator", {"expression": "9*9"}), "Not in the corpus: ünïcödé ✓"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.convert_ids_to_tokens(tok.encode("1081", add_special_tokens=False)) == ["1", "0", "8", "1"]
    ids = tok.encode("<tool_call></tool_call><|im_end|>", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["<tool_call>", "</tool_call>", "<|im_end|>"]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    # the tool-call tags are plain added tokens: decoding with skip_special_tokens keeps them
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call></tool_call>"


def test_template_plain_chat(tok) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7+5?"},
            {"role": "assistant", "content": "The answer is 12."}, {"role": "user", "content": "Sure?"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 7+5?<|im_end|>\n"
        "<|im_start|>assistant\nThe answer is 12.<|im_end|>\n"
        "<|im_start|>user\nSure?<|im_end|>\n"
        "<|im_start|>assistant\n")


TOOLS_BLOCK = (
    "# Tools\n<tools>\n"
    '{"name": "calculator", "description": "Evaluate an arithmetic expression.", "parameters": '
    '{"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}\n'
    "</tools>\n"
    'To call a tool, reply <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n')


def test_template_tools_tool_calls_and_results(tok) -> None:
    msgs = calc_messages("What is 23*47?", "23*47")
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_0", "content": "1081"}
    expected = (
        "<|im_start|>system\n" + TOOLS_BLOCK
        + "<|im_start|>user\nWhat is 23*47?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "23*47"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>tool\n1081<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, tools=[CALC_TOOL], tokenize=False, add_generation_prompt=True) \
        == expected
    # as vLLM passes them: arguments parsed into an object, tools with the extra keys its model adds
    served = json.loads(json.dumps(msgs))
    served[1]["tool_calls"][0]["function"]["arguments"] = {"expression": "23*47"}
    tool = {**CALC_TOOL, "defer_loading": None,
            "function": {**CALC_TOOL["function"], "strict": None, "defer_loading": None}}
    assert tok.apply_chat_template(served, tools=[tool], tokenize=False, add_generation_prompt=True) \
        == expected
    # a system message joins the tools block; content next to a tool call goes first
    msgs = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Let me see.",
             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}},
                            {"type": "function", "function": {"name": "g", "arguments": {"x": 1}}}]}]
    assert tok.apply_chat_template(msgs, tools=[CALC_TOOL], tokenize=False) == (
        "<|im_start|>system\nUse tools.\n\n" + TOOLS_BLOCK
        + "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nLet me see.\n"
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n')


def test_dialogue_encoder_matches_the_template(tok) -> None:
    enc = DialogueEncoder(tok)
    for t in calc_tasks(40, seed=5, ops="+-*"):
        for expr in (t["expression"], calc_error(t["expression"])):
            ids, mask = calc_example(tok, t["question"], expr)
            assert enc.calc(t["question"], expr) == (ids, mask)
            replies = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
            value = calculate(expr)
            assert replies == tool_call_text("calculator", {"expression": expr}) \
                + f"<|im_end|>The answer is {value}.<|im_end|>"
            # the whole dialogue tokenises to the same ids in one go (what vLLM sees for the 2nd call)
            assert tok.encode(tok.decode(ids, skip_special_tokens=False), add_special_tokens=False) == ids
    ids, mask = enc.arith("What is 7+5?", 12)
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>user\nWhat is 7+5?<|im_end|>\n<|im_start|>assistant\nThe answer is 12.<|im_end|>")
    assert tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) \
        == "The answer is 12.<|im_end|>"


def test_words_tasks_and_dialogues(tok) -> None:
    import random

    from lgt.trainer.demo.tasks import filler, words_call

    tasks = words_tasks(60, seed=3)
    assert tasks == words_tasks(60, seed=3) and tasks != words_tasks(60, seed=4)
    assert len({t["word"] for t in tasks}) > 20 and all(t["word"] in WORD_VOCAB for t in tasks)
    assert len({t["question"].replace(t["word"], "W").replace(t["file"], "F") for t in tasks}) > 30
    assert {t["tool"] for t in tasks} == {"write_file", "shell"}
    for t in tasks[:10]:
        assert t["word"] in t["question"] and t["file"] in t["question"]
        for system in (None, filler(random.Random(0), 200)):
            ids, mask = words_example(tok, t, system)
            text = tok.decode(ids, skip_special_tokens=False)
            assert t["question"] in text and (system is None) == ("<|im_start|>system\n# Tools" in text)
            assert f'{{"name": "{t["tool"]}", "description"' in text  # the one tool it offers
            call = tool_call_text(*words_call(t))
            assert t["word"] in call and t["file"] in call
            assert tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) \
                == f"{call}<|im_end|>Done.<|im_end|>"  # both replies trained, nothing else
            assert tok.encode(text, add_special_tokens=False) == ids  # what vLLM sees for the 2nd call
            assert words_reward(call, t) == (1.0, 1.0)
    for tool in ("write_file", "shell"):
        t = next(t for t in tasks if t["tool"] == tool)
        other = dict(t, word=next(w for w in WORD_VOCAB if w != t["word"]))
        assert words_reward(tool_call_text(*words_call(other)), t) == (0.0, 1.0)  # the wrong word
        assert words_reward(tool_call_text(*words_call(dict(t, file="x.txt"))), t) == (0.0, 1.0)
        twin = dict(t, tool="shell" if tool == "write_file" else "write_file")
        assert words_reward(tool_call_text(*words_call(twin)), t) == (0.0, 0.0)  # the tool not offered
    t = tasks[0]
    bash = tool_call_text("Bash", {"command": f"echo {t['word']} > {t['file']}"})
    assert words_reward(bash, t) == (0.0, 0.0)
    assert words_reward(f"I wrote {t['word']} to {t['file']}.", t) == (0.0, 0.0)


# --- models -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset, low, high", [("tiny", 100_000, 400_000), ("demo", 1_200_000, 1_700_000),
                                               ("10m", 9_000_000, 12_000_000)])
def test_build_model_presets(tmp_path: Path, tokenizer_dir: Path, preset: str, low: int, high: int) -> None:
    d = tmp_path / preset
    shutil.copytree(tokenizer_dir, d)
    build_model(d, preset=preset)
    config = json.loads((d / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # vLLM's CPU attention needs 64
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 32768  # what agent frameworks send fits
    assert low <= count_parameters(d) <= high
    gen = json.loads((d / "generation_config.json").read_text())
    tok = load_tokenizer(d)
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>") == config["eos_token_id"]
    assert not {"temperature", "top_p", "top_k"} & set(gen)  # vLLM would make them request defaults
    info = check_model_dir(d, need_chat_template=True)
    assert info.vocab_size == len(tok) and info.eos_token_id == gen["eos_token_id"]


def test_build_model_unknown_preset(tmp_path: Path) -> None:
    with pytest.raises(TinyModelError, match="preset 'huge' is not one of tiny, demo, 10m, 0.5b"):
        build_model(tmp_path, preset="huge")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    d = tmp_path_factory.mktemp("models") / "tiny"
    shutil.copytree(tokenizer_dir, d)
    return build_model(d, preset="tiny", seed=1)


@pytest.mark.parametrize("task", ["arith", "calc", "both", "words"])
def test_warm_start_lowers_the_loss_and_saves(tmp_path: Path, tiny_dir: Path, task: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    before = AutoModelForCausalLM.from_pretrained(d, local_files_only=True).state_dict()
    metrics = warm_start(d, task=task, steps=30, seconds=None, batch=16, lr=3e-3, eval_n=8, progress=False)
    assert metrics["steps"] == 30 and metrics["final_loss"] < 0.8 * metrics["first_loss"]
    for key in ("greedy_accuracy", "sampled_accuracy", "greedy_format", "sampled_format"):
        assert 0.0 <= metrics[key] <= 1.0
    after = AutoModelForCausalLM.from_pretrained(d, local_files_only=True).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary directory left behind
    check_model_dir(d, need_chat_template=True)


def test_warm_start_bad_input(tiny_dir: Path) -> None:
    with pytest.raises(TinyModelError, match="task 'chess' is not one of arith, carry, calc, both, words"):
        warm_start(tiny_dir, task="chess", steps=1)
    with pytest.raises(TinyModelError, match="correct_fraction 1.5 is not between 0 and 1"):
        warm_start(tiny_dir, correct_fraction=1.5, steps=1)
    with pytest.raises(TinyModelError, match="needs a limit"):
        warm_start(tiny_dir, steps=None, seconds=None)


def test_make_model_builds_once_and_caches(tmp_path: Path) -> None:
    out = tmp_path / "model"
    assert make_model(out, preset="tiny", seed=2, progress=False) == out
    marker = read_marker(out)
    assert marker["preset"] == "tiny" and marker["seed"] == 2 and marker["warm_start"] is None
    assert 100_000 < marker["parameters"] < 400_000
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    weights = (out / "model.safetensors").read_bytes()
    make_model(out, preset="tiny", seed=2, progress=False)  # same spec: reused as is
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    make_model(out, preset="tiny", seed=3, progress=False)  # another spec: rebuilt in place
    assert read_marker(out)["seed"] == 3 and (out / "model.safetensors").read_bytes() != weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    check_model_dir(out, need_chat_template=True)


def test_make_model_refuses_foreign_directories(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(TinyModelError, match="mine already exists and is not a model made by lgt"):
        make_model(tmp_path / "mine", preset="tiny", progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(TinyModelError, match="warm_start_task 'x' is not one of"):
        make_model(tmp_path / "new", warm_start_task="x")


# --- a real vLLM engine reads the template and the tool calls as the warm start taught them ---------------

@pytest.fixture(scope="module")
def calc_vllm(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path, arith_model_dir: Path,
              engines: Callable) -> Iterator[tuple[str, Path]]:
    """vLLM (CPU build) with the hermes tool parser serving a tiny model warm-started on calc dialogues:
    the session's engine on the arith model (conftest.py's ``engines``), given the calc model's weights.
    Both models have the same tokenizer, chat template and shapes (checked), so vLLM renders the calc
    model's conversations with the template it was trained on."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed in this environment")
    model = tmp_path_factory.mktemp("calc") / "model"
    shutil.copytree(tiny_dir, model)
    warm_start(model, task="calc", steps=120, lr=3e-3, eval_n=8, progress=False)
    from lgt.trainer.serving.weights import checkpoint_tensors

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (model / name).read_bytes() == (arith_model_dir / name).read_bytes(), name
    engine = engines(arith_model_dir)
    engine.update_weights(checkpoint_tensors(model))  # names and shapes checked against the served model
    yield engine.url, model


@pytest.mark.slow
def test_vllm_parses_the_calc_models_tool_calls(calc_vllm: tuple[str, Path]) -> None:
    from openai import OpenAI

    url, model = calc_vllm
    tok = load_tokenizer(model)
    client = OpenAI(base_url=url, api_key="unused", http_client=httpx.Client(trust_env=False))
    calls = 0
    for t in calc_tasks(8, seed=11):
        msgs = [{"role": "user", "content": t["question"]}]
        r = client.chat.completions.create(model="policy", messages=msgs, tools=[CALC_TOOL], temperature=1.0,
                                           max_tokens=60, extra_body={"return_token_ids": True})
        # vLLM renders the template into exactly the ids the warm start trained on
        first_prompt = r.model_extra["prompt_token_ids"]
        assert first_prompt == calc_example(tok, t["question"], t["expression"])[0][: len(first_prompt)]
        choice = r.choices[0]
        if not choice.message.tool_calls:
            continue
        calls += 1
        call = choice.message.tool_calls[0]
        assert choice.finish_reason == "tool_calls" and call.function.name == "calculator"
        expr = json.loads(call.function.arguments)["expression"]
        if not DialogueEncoder.SIMPLE.fullmatch(expr):
            continue
        # the second call (tool result sent back, OpenAI style) also renders to the trained ids
        msgs += [{"role": "assistant", "content": choice.message.content,
                  "tool_calls": [call.model_dump(exclude_none=True)]},
                 {"role": "tool", "tool_call_id": call.id, "content": str(calculate(expr))}]
        r2 = client.chat.completions.create(model="policy", messages=msgs, tools=[CALC_TOOL], temperature=1.0,
                                            max_tokens=20, extra_body={"return_token_ids": True})
        second_prompt = r2.model_extra["prompt_token_ids"]
        assert second_prompt == calc_example(tok, t["question"], expr)[0][: len(second_prompt)]
        assert second_prompt[: len(first_prompt)] == first_prompt
    assert calls >= 1  # sampled at temperature 1: some replies are parsed into tool_calls


def test_the_warm_start_never_shows_excluded_questions(tok) -> None:
    import random

    from lgt.trainer.demo.dialogues import DialogueEncoder
    from lgt.trainer.demo.factory import _spec
    from lgt.trainer.demo.warmstart import _draw_example

    held = {t["question"] for t in arith_tasks(200)[:40]}
    pool = [t for t in arith_tasks(200) if t["question"] not in held]
    enc, rng = DialogueEncoder(tok), random.Random(0)
    seen = set()
    for _ in range(2000):
        ids, _ = _draw_example(enc, "arith", rng, 0.4, pool, frozenset(held))
        seen.add(tok.decode(ids, skip_special_tokens=False).split("user\n")[1].split("<|im_end|>")[0])
    assert seen == {t["question"] for t in pool}  # every other question, never a held-out one
    carry_held = {t["question"] for t in carry_tasks(200)}
    carry_pool = [t for t in carry_tasks(3645) if t["question"] not in carry_held]
    for _ in range(300):
        ids, _ = _draw_example(enc, "carry", rng, 0.4, carry_pool, frozenset(carry_held))
        text = tok.decode(ids, skip_special_tokens=False)
        assert text.split("user\n")[1].split("<|im_end|>")[0] not in carry_held
    calc_held = frozenset(t["question"] for t in calc_tasks(50, seed=1))
    for _ in range(300):
        ids, _ = _draw_example(enc, "calc", rng, 0.4, pool, calc_held)
        assert not any(q in tok.decode(ids, skip_special_tokens=False) for q in calc_held)
    # a model made without the exclusion (or with another) is not the one asked for with it
    spec = {e: _spec("demo", "arith", 180, 0, e)["warm_start_excluded"] for e in ((), tuple(held), ("x",))}
    assert spec[()] is None and len(set(spec.values())) == 3
    assert _spec("demo", "arith", 180, 0, sorted(held, reverse=True)) == _spec("demo", "arith", 180, 0, held)


def test_a_warm_start_of_fixed_steps_is_reused_by_runs_that_hold_out_less(tmp_path: Path) -> None:
    from lgt.trainer.demo.factory import is_made

    out, held = tmp_path / "model", [t["question"] for t in arith_tasks(200)[:40]]
    make_model(out, preset="tiny", warm_start_task="arith", steps=3, seconds=0.001, exclude=held,
               progress=False)
    marker = read_marker(out)
    assert marker["warm_start"]["steps"] == 3  # the step budget wins over seconds: same model anywhere
    assert marker["warm_start_steps"] == 3 and marker["warm_start_seconds"] is None
    same = dict(preset="tiny", warm_start_task="arith", seed=0)
    assert is_made(out, **same, steps=3, exclude=held)
    assert is_made(out, **same, steps=3)  # a run without held-out tasks: it saw less, never more
    assert not is_made(out, **same, steps=3, exclude=held[:10])  # another held-out set: it saw those
    assert not is_made(out, **same, steps=4, exclude=held)
    assert not is_made(out, **same, seconds=90.0, exclude=held)
    with pytest.raises(TinyModelError, match="steps must be 1 or more, not 0"):
        make_model(tmp_path / "other", preset="tiny", warm_start_task="arith", steps=0)
