"""Small local models for demos, tests and benchmarks: tokenizer, Qwen2 model, SFT warm start, tasks.

Everything is built here (nothing is downloaded): a byte-level BPE tokenizer trained on the task text, a
ChatML chat template that renders tools, tool calls and tool results the way vLLM's ``hermes`` tool parser
reads them, a randomly initialised ``Qwen2ForCausalLM`` (head_dim 64: vLLM's CPU attention needs it), and a
short supervised warm start on synthetic dialogues so that RL has something to amplify.

Three tasks, each matching an example agent, and a fourth for a student's warm start:

* ``arith``: ``What is 7+5?`` answered ``The answer is 12.`` (single digits, ``+`` and ``*``).
* ``carry``: ``What is 47+38?`` answered ``The answer is 85.``: two-digit additions whose ones digits
  carry. Its warm start adds digit by digit but, on most problems, forgets the carry (``75``) — one
  habit shared by all 3,645 problems, so what RL corrects on some carries over to problems never seen.
* ``calc``: ``What is 23*47?`` (two-digit operands: too hard to do in the model's head); the model calls the
  ``calculator`` tool, reads its result from a ``tool`` message and answers ``The answer is 1081.``
* ``words`` (a warm start only, no agent): ``Save the word TIGER in log.md here.``, answered with the one
  tool offered, ``write_file`` (path, content) or ``shell`` (``echo TIGER > log.md``), then ``Done.`` after
  its result; half the steps behind a long filler system prompt. It gives the demo model what any
  pretrained model brings to an agent: putting what the user named into a tool call, with an agent's
  long prompt in front. (Learning that from a harness's traces alone, in minutes, it did not.)

The warm start trains on answers that are right only ``correct_fraction`` of the time; otherwise the answer
(or the calculator expression) is a *fixed* plausible error per prompt (carry: the answer without the
carry). Uniformly random errors would let greedy decoding recover the right answer; a fixed error leaves
RL real work to do.

Saved models load with ``transformers`` and serve with vLLM's CPU build (``--dtype float32``).
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import random
import re
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lgt.store.files import atomic_dir, replace_atomic

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
MARKER = "lgt-model.json"  # written last by make_model: its presence means the directory is finished
MARKER_VERSION = 2  # 2: max_position_embeddings 32768 (was 1024)
TASKS = ("arith", "carry", "calc", "both", "words")
# two-digit a + b (10..99) whose ones digits add up to 10 or more: the carry task's problems
CARRY_SPACE = tuple((a, b) for a in range(10, 100) for b in range(10, 100) if a % 10 + b % 10 >= 10)

CALC_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}

# ChatML. With tools: a system block listing each tool's name/description/parameters (fields picked one by
# one, so extra keys a server adds, such as "strict": null, render the same), assistant tool calls as
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> (arguments as a JSON string or an object),
# and "tool" messages as their own turn. The generation prompt ends exactly where the reply begins.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}"
    "{%- set f = tool.function if tool.function is defined else tool %}"
    "{{- '\\n{\"name\": ' + (f.name | tojson) + ', \"description\": ' + (f.description | tojson)"
    " + ', \"parameters\": ' + (f.parameters | tojson) + '}' }}"
    "{%- endfor %}"
    "{{- '\\n</tools>\\nTo call a tool, reply <tool_call>\\n{\"name\": <name>, \"arguments\": <object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in (message.tool_calls or []) %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Model sizes. head_dim (hidden / heads) is 64 in all of them: vLLM's CPU attention rejects small heads.
PRESETS: dict[str, dict[str, int]] = {
    # ~200k parameters: fast tests (too small to learn the tasks)
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1),
    # ~1.4M parameters: learns the arith task on CPU in about a minute (hidden 128 did not)
    "demo": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4),
    # ~10M parameters: benchmarks
    "10m": dict(hidden_size=384, intermediate_size=1152, num_hidden_layers=6, num_attention_heads=6,
                num_key_value_heads=2),
    # Qwen2-0.5B's shape (with lgt's small vocabulary: ~0.36B parameters): the GPU check
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
}
# RoPE needs no weights per position, so a wide range costs nothing; and it must cover every position
# an agent can reach. vLLM's CPU build reads past its RoPE cache beyond max_position_embeddings: from
# there its logits are garbage (11 nats off transformers on the demo model) and then NaN, so a logprob
# the server cannot write as JSON (400 "Out of range float values"). Agent frameworks send prompts of
# several thousand tokens; 1024 was too short.
MAX_POSITIONS = 32768


class TinyModelError(ValueError):
    """Bad input to the model factory; the message is one sentence naming it."""


# --- tasks and rewards --------------------------------------------------------------------------------

def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def arith_tasks(n: int, *, seed: int = 0, ops: str = "+*") -> list[dict[str, Any]]:
    """``n`` single-digit problems ``{"task_id", "question": "What is 7+5?", "answer": 12}``.

    There are ``100 * len(ops)`` distinct problems; they come in a seeded random order, repeating (in a new
    order) when ``n`` exceeds that. ``task_id`` is ``arith-<i>`` (unique within the list).
    """
    if not ops or set(ops) - set("+*"):
        raise TinyModelError(f"ops {ops!r} is not a choice of '+' and '*' (e.g. '+*')")
    space = [(a, op, b) for op in ops for a in range(10) for b in range(10)]
    return [{"task_id": f"arith-{i}", "question": f"What is {a}{op}{b}?", "answer": _apply(a, op, b)}
            for i, (a, op, b) in enumerate(_in_seeded_rounds(space, n, seed))]


def _in_seeded_rounds(space: Sequence[Any], n: int, seed: int) -> list[Any]:
    """``n`` items of ``space``: the whole of it in a seeded random order, again in a new order, ..."""
    rng = random.Random(seed)
    out: list[Any] = []
    while len(out) < n:
        order = list(space)
        rng.shuffle(order)
        out += order[: n - len(out)]
    return out


def carry_tasks(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` two-digit additions whose ones digits carry, ``{"task_id": "carry-<i>", "question": "What is
    47+38?", "answer": 85}``: the 3,645 such problems in a seeded random order, repeating (in a new order)
    when ``n`` exceeds that."""
    return [{"task_id": f"carry-{i}", "question": f"What is {a}+{b}?", "answer": a + b}
            for i, (a, b) in enumerate(_in_seeded_rounds(CARRY_SPACE, n, seed))]


def carry_error(question: str) -> int:
    """The answer to a two-digit addition with the carry from the ones forgotten (47+38 → 75)."""
    m = re.fullmatch(r"What is (\d\d)\+(\d\d)\?", question)
    if m is None:
        raise TinyModelError(f"{question!r} is not a carry question like 'What is 47+38?'")
    a, b = int(m[1]), int(m[2])
    return (a // 10 + b // 10) * 10 + (a % 10 + b % 10) % 10


def calc_tasks(n: int, *, seed: int = 0, ops: str = "+*") -> list[dict[str, Any]]:
    """``n`` two-digit problems ``{"task_id", "question": "What is 23*47?", "answer": 1081,
    "expression": "23*47"}`` (operands 10..99, drawn at random with ``seed``)."""
    if not ops or set(ops) - set("+-*"):
        raise TinyModelError(f"ops {ops!r} is not a choice of '+', '-' and '*' (e.g. '+*')")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice(ops)
        expr = f"{a}{op}{b}"
        out.append({"task_id": f"calc-{i}", "question": f"What is {expr}?", "answer": _apply(a, op, b),
                    "expression": expr})
    return out


WRITE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Write text into a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                        "content": {"type": "string"}},
                       "required": ["path", "content"]},
    },
}
SHELL_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    },
}
WORDS_TOOLS = {"write_file": WRITE_TOOL, "shell": SHELL_TOOL}
# the words the words task copies: fruit, animals, colours, things (the demo model's "vocabulary")
WORD_VOCAB = tuple(
    "APPLE APRICOT BANANA CHERRY DAMSON ELDERBERRY FIG GRAPE GUAVA KIWI LEMON LIME LYCHEE MANGO MELON "
    "NECTARINE ORANGE PAPAYA PEACH PEAR PINEAPPLE PLUM QUINCE RAISIN SATSUMA TANGERINE "
    "BADGER BEAVER CAMEL DONKEY EAGLE FALCON GIRAFFE HORSE JAGUAR KOALA LION MONKEY OTTER PANDA RABBIT "
    "SALMON TIGER TURTLE WALRUS ZEBRA "
    "AMBER BLUE CRIMSON GREEN INDIGO MAGENTA OLIVE PURPLE SCARLET SILVER VIOLET YELLOW "
    "ANCHOR BASKET CANDLE HAMMER KETTLE LADDER MIRROR PENCIL ROCKET SADDLE TABLE WAGON".split())
FILE_STEMS = ("answer", "out", "word", "result", "note", "fruit", "notes", "data", "output", "todo", "list",
              "log", "draft", "memo", "info", "text", "temp", "report", "summary", "value")
FILE_EXTENSIONS = (".txt", ".md", ".log", ".csv")
# words for the filler that stands in for an agent's long system prompt (the words task)
FILLER_WORDS = tuple(
    "the a an of to in for on with by from as is are be can will use when you your this that it each tool "
    "file files read write run command output user task code agent answer must should never always only "
    "before after then if not do does make sure keep short project folder current directory shell bash "
    "note important example result error test tests change edit line lines path string text value name "
    "list call calls message messages reply system model help work done new old first last one two"
    .split())
# the words task's requests, made from parts: "{verb} {the word }{W} {into} {the file }{F}{ here}." or
# "{Create} {F}{ here} {containing} {just }{the word }{W}."
_PUT = ("Write", "Put", "Save", "Store", "Place", "Please write", "Please put")
_WORD = ("the word ", "the text ", "")
_INTO = ("into", "in", "to")
_FILE = ("the file ", "a file named ", "a file called ", "")
_WHERE = ("", " here", " in the current directory", " in this folder", " now")
_CREATE = ("Create", "Make", "Please create", "Write")
_HOLDING = ("containing", "holding", "with")
_JUST = ("just ", "only ", "")


def _word_request(rng: random.Random, word: str, file: str) -> str:
    where = rng.choice(_WHERE)
    if rng.random() < 0.5:
        return (f"{rng.choice(_PUT)} {rng.choice(_WORD)}{word} {rng.choice(_INTO)} {rng.choice(_FILE)}{file}"
                f"{where}.")
    holding = f"{rng.choice(_HOLDING)} {rng.choice(_JUST)}{rng.choice(_WORD)}{word}"
    return f"{rng.choice(_CREATE)} {file}{where} {holding}."


def words_tasks(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` copy tasks ``{"task_id": "words-<i>", "question": "Save the word TIGER in log.md here.",
    "word": "TIGER", "file": "log.md", "tool": "shell"}``: a word of WORD_VOCAB and a file name of
    FILE_STEMS and FILE_EXTENSIONS in a request made of parts (_word_request), and the one tool offered,
    write_file or shell. The skill a pretrained model brings to any agent (put what the user named into
    the tool call the offered tool takes) and the demo model does not have unless taught."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        word, file = rng.choice(WORD_VOCAB), rng.choice(FILE_STEMS) + rng.choice(FILE_EXTENSIONS)
        out.append({"task_id": f"words-{i}", "question": _word_request(rng, word, file), "word": word,
                    "file": file, "tool": rng.choice(sorted(WORDS_TOOLS))})
    return out


def words_call(task: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """(tool name, arguments) that do a words task with its tool."""
    if task["tool"] == "shell":
        return "shell", {"cmd": f"echo {task['word']} > {task['file']}"}
    return "write_file", {"path": task["file"], "content": task["word"]}


def words_messages(task: dict[str, Any], system: str | None = None) -> list[dict[str, Any]]:
    """A words task's whole dialogue: (system,) user, the tool call, its result, ``Done.``."""
    name, args = words_call(task)
    call = {"name": name, "arguments": json.dumps(args)}
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": task["question"]},
                   {"role": "assistant", "content": None,
                    "tool_calls": [{"id": "call_0", "type": "function", "function": call}]},
                   {"role": "tool", "tool_call_id": "call_0", "content": "ok"},
                   {"role": "assistant", "content": "Done."}]


def words_reward(text: str, task: dict[str, Any]) -> tuple[float, float]:
    """(accuracy, format) of a words task's first reply: accuracy 1.0 iff it is the call of the task's
    tool that does exactly the task (words_call); format 1.0 iff it calls that tool with its arguments'
    names, whatever their values."""
    name, args = words_call(task)
    call = parse_tool_call(text)
    got = call["arguments"] if call and call["name"] == name else {}
    fmt = sorted(got) == sorted(args) and all(isinstance(v, str) for v in got.values())
    return float(got == args), float(fmt)


def filler(rng: random.Random, words: int) -> str:
    """``words`` random words of FILLER_WORDS in sentences: the stand-in for a long system prompt."""
    out, sentence = [], []
    for _ in range(words):
        sentence.append(rng.choice(FILLER_WORDS))
        if len(sentence) >= rng.randint(6, 16):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    if sentence:
        out.append(" ".join(sentence).capitalize() + ".")
    return " ".join(out)


def arith_reward(text: str, answer: int | str) -> float:
    """1.0 iff ``text`` (stripped) is exactly ``The answer is <answer>.``, else 0.0.

    Strict on purpose: a lenient reward (first integer in the text) lets the policy drift off the format.
    Callers also require that the reply ended on the model's stop token (``finish_reason == "stop"``).
    """
    return 1.0 if text.strip() == f"The answer is {answer}." else 0.0


def calculate(expression: str) -> int:
    """The value of an integer expression of ``+ - *``, parentheses and unary minus (the calculator tool).

    Raises ValueError (one sentence) for anything else: names, division, floats, huge numbers.
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Mult) and abs(left) * abs(right) > 10**30:
                raise ValueError(f"{expression!r} is too large to evaluate")
            return left + right if isinstance(node.op, ast.Add) else (
                left - right if isinstance(node.op, ast.Sub) else left * right)
        raise ValueError(f"{expression!r} has something other than integers, + - * and parentheses")

    return ev(tree)


def arith_error(question: str, answer: int) -> int:
    """A fixed plausible wrong answer to a single-digit problem (same for every call with this question)."""
    m = re.fullmatch(r"What is (\d+)([+*])(\d+)\?", question)
    if m is None:
        raise TinyModelError(f"{question!r} is not an arith question like 'What is 7+5?'")
    a, op, b = int(m[1]), m[2], int(m[3])
    other = a * b if op == "+" else a + b
    candidates = [answer + 1, answer - 1, answer + 2, answer - 2, other]
    candidates += [answer + a, answer - a, answer + b, answer - b] if op == "*" else [answer + 10]
    candidates = [c for c in candidates if c >= 0 and c != answer]
    return random.Random(question).choice(candidates)


def calc_error(expression: str) -> str:
    """A fixed plausible wrong calculator expression for a ``<a><op><b>`` problem (never the same value)."""
    m = re.fullmatch(r"(\d+)([-+*])(\d+)", expression)
    if m is None:
        raise TinyModelError(f"{expression!r} is not a two-operand expression like '23*47'")
    a, op, b = m[1], m[2], m[3]
    right = calculate(expression)
    ops = [o for o in "+-*" if o != op]
    candidates = [f"{a[::-1]}{op}{b}", f"{a}{op}{b[::-1]}", f"{a}{ops[0]}{b}", f"{a}{ops[1]}{b}",
                  f"{a}{op}{int(b) + 1}", f"{int(a) - 1}{op}{b}"]
    well_formed = re.compile(r"[1-9]\d*[-+*][1-9]\d*")
    candidates = [c for c in candidates if well_formed.fullmatch(c) and calculate(c) != right]
    return random.Random(expression).choice(candidates)


def calc_messages(question: str, expression: str, call_id: str = "call_0") -> list[dict[str, Any]]:
    """The calc agent's conversation up to the second model call: user, assistant tool call, tool result.

    Shaped like the OpenAI chat API (``arguments`` is a JSON string) -- what the agent sends back to vLLM.
    """
    arguments = json.dumps({"expression": expression})
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call_id, "type": "function",
                         "function": {"name": "calculator", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": str(calculate(expression))},
    ]


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """How the template renders one tool call (and so what the model is taught to emit)."""
    return f'{TOOL_CALL_START}\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}\n' \
           f'{TOOL_CALL_END}'


def parse_tool_call(text: str) -> dict[str, Any] | None:
    """The first ``<tool_call>{json}</tool_call>`` in ``text`` as ``{"name", "arguments"}``, or None.

    Parsed the way vLLM's hermes parser reads it (JSON between the tags, closing tag optional at the end).
    """
    m = re.search(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, re.DOTALL)
    if m is None:
        return None
    try:
        call = json.loads(m[1] if m[1] is not None else m[2])
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) \
            or not isinstance(call.get("arguments"), dict):
        return None
    return call


# --- tokenizer ------------------------------------------------------------------------------------------

def _corpus(seed: int = 0) -> list[str]:
    """Text like what the tasks' dialogues hold (rendered by hand: no tokenizer exists yet)."""
    rng = random.Random(seed)
    tool_line = json.dumps({"name": "calculator", "description": CALC_TOOL["function"]["description"],
                            "parameters": CALC_TOOL["function"]["parameters"]})
    system = (f"# Tools\n<tools>\n{tool_line}\n</tools>\nTo call a tool, reply <tool_call>\n"
              '{"name": <name>, "arguments": <object>}\n</tool_call>')
    texts = []
    for task in arith_tasks(200):
        texts += [f"user\n{task['question']}", f"assistant\nThe answer is {task['answer']}."]
    for task in calc_tasks(300, seed=seed):
        expr = task["expression"] if rng.random() < 0.5 else calc_error(task["expression"])
        texts += [system, f"user\n{task['question']}",
                  f"assistant\n{tool_call_text('calculator', {'expression': expr})}",
                  f"tool\n{calculate(expr)}", f"assistant\nThe answer is {calculate(expr)}."]
    texts += ["system\nYou are a helpful assistant.", "user\nHello! Who are you?",
              "assistant\nI am a small model that does arithmetic."]
    return texts


def build_tokenizer(out_dir: str | Path, *, vocab_size: int = 512) -> Path:
    """Train a byte-level BPE tokenizer on the tasks' text and save it (HF format) into ``out_dir``.

    Digits are split one per token (like Qwen2), so numbers are read and copied digit by digit. Special
    tokens: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos); added (non-special, so they
    survive decoding) ``<tool_call>`` and ``</tool_call>``. The chat template is CHAT_TEMPLATE.
    Returns ``out_dir``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (TOOL_CALL_START, TOOL_CALL_END)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                   model_max_length=MAX_POSITIONS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out


def load_tokenizer(model_dir: str | Path):
    """The HF tokenizer saved in ``model_dir`` (local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


# --- model ----------------------------------------------------------------------------------------------

def _model_config(preset: str, tokenizer) -> Any:
    from transformers import Qwen2Config

    if preset not in PRESETS:
        raise TinyModelError(f"preset {preset!r} is not one of {', '.join(PRESETS)}")
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    return Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=MAX_POSITIONS,
                       tie_word_embeddings=True, eos_token_id=eos, bos_token_id=pad, pad_token_id=pad,
                       **PRESETS[preset])


def build_model(out_dir: str | Path, *, preset: str = "tiny", seed: int = 0) -> Path:
    """Save a randomly initialised Qwen2ForCausalLM (float32, tied embeddings) into ``out_dir``.

    Builds the tokenizer first when ``out_dir`` has none. ``generation_config.json`` names ``<|im_end|>``
    as eos and sets no sampling defaults (vLLM would take them as the request defaults). Returns out_dir.
    """
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    out = Path(out_dir)
    if preset not in PRESETS:
        raise TinyModelError(f"preset {preset!r} is not one of {', '.join(PRESETS)}")
    if not (out / "tokenizer.json").is_file():
        build_tokenizer(out)
    tokenizer = load_tokenizer(out)
    config = _model_config(preset, tokenizer)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id,
                                               bos_token_id=config.bos_token_id)
    model.save_pretrained(out)
    return out


def count_parameters(model_dir: str | Path) -> int:
    """Number of distinct parameters of the saved model (tied embeddings counted once)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            total += math.prod(f.get_slice(name).get_shape())
    return total


# --- warm start (SFT) -----------------------------------------------------------------------------------

def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _render(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def arith_example(tokenizer, question: str, answer: int) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one arith dialogue whose reply is ``The answer is <answer>.<|im_end|>``."""
    prompt = _encode(tokenizer, _render(tokenizer, [{"role": "user", "content": question}]))
    reply = _encode(tokenizer, f"The answer is {answer}.{IM_END}")
    return prompt + reply, [0] * len(prompt) + [1] * len(reply)


def calc_example(tokenizer, question: str, expression: str) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one two-turn calc dialogue: the tool call for ``expression``, the tool's
    result, and the answer that repeats the result. Both replies are in the loss; the ids equal what vLLM
    sees (each prompt's tokens extend the previous prompt + reply exactly)."""
    return _two_turns(tokenizer, calc_messages(question, expression), [CALC_TOOL],
                      tool_call_text("calculator", {"expression": expression}) + IM_END,
                      f"The answer is {calculate(expression)}.{IM_END}", "calc")


def _two_turns(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]], call: str,
               answer: str, what: str) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a dialogue whose ``messages`` end with an assistant tool call (``call``,
    as rendered) and its result, followed by ``answer``: both replies in the loss, and the ids equal
    what vLLM sees (the second prompt extends the first prompt + ``call`` exactly)."""
    prompt1 = _render(tokenizer, messages[:-2], tools)
    prompt2 = _render(tokenizer, messages, tools)
    if not prompt2.startswith(prompt1 + call):
        raise AssertionError(f"the chat template does not extend the first turn; the {what} dialogue is off")
    ids: list[int] = []
    mask: list[int] = []
    for text, m in [(prompt1, 0), (call, 1), (prompt2[len(prompt1 + call):], 0), (answer, 1)]:
        t = _encode(tokenizer, text)
        ids += t
        mask += [m] * len(t)
    return ids, mask


def words_example(tokenizer, task: dict[str, Any], system: str | None = None) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one words dialogue (words_messages): both assistant turns in the loss."""
    return _two_turns(tokenizer, words_messages(task, system)[:-1], [WORDS_TOOLS[task["tool"]]],
                      tool_call_text(*words_call(task)) + IM_END, f"Done.{IM_END}", "words")


WORDS_EVAL_N = 64  # the most words dialogues warm_start evaluates
WORDS_FILLER_SHARE = 0.5  # warm-start steps whose words dialogues have a filler system prompt
WORDS_FILLER_MEAN = 80  # its mean length in words (exponential, capped at WORDS_FILLER_MAX)
WORDS_FILLER_MAX = 350


def _filler_words(rng: random.Random) -> int:
    """How long a words dialogue's filler system prompt is (0: none). Drawn once per warm-start step, so
    that a batch's dialogues are about as long as each other (padding to the longest costs the rest)."""
    if rng.random() >= WORDS_FILLER_SHARE:
        return 0
    return min(WORDS_FILLER_MAX, 1 + int(rng.expovariate(1.0 / WORDS_FILLER_MEAN)))


class DialogueEncoder:
    """Fast token ids + loss masks of the warm-start dialogues (same ids as arith_example/calc_example).

    The chat template is rendered once with placeholders; its constant pieces are tokenised once and
    only the numbers are tokenised per dialogue. That is exact because every placeholder sits between
    pre-tokenizer boundaries (digits are single tokens; a newline, quote or special token on each side).
    """

    SLOTS = ("QUESTIONSLOT", "EXPRESSIONSLOT", "RESULTSLOT", "REPLYSLOT")
    SIMPLE = re.compile(r"[1-9]\d*[-+*][1-9]\d*")  # expressions the placeholders are exact for

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._arith: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
        q, e, r, a = self.SLOTS
        call = {"name": "calculator", "arguments": json.dumps({"expression": e})}
        msgs = [{"role": "user", "content": q},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "call_0", "type": "function", "function": call}]},
                {"role": "tool", "tool_call_id": "call_0", "content": r}]
        prompt1 = _render(tokenizer, msgs[:1], [CALC_TOOL])
        reply1 = tool_call_text("calculator", {"expression": e}) + IM_END
        prompt2 = _render(tokenizer, msgs, [CALC_TOOL])
        if not prompt2.startswith(prompt1 + reply1):
            raise AssertionError("the chat template does not extend the first turn; the calc dialogue is off")
        segments = [(prompt1, 0), (reply1, 1), (prompt2[len(prompt1 + reply1):], 0),
                    (f"{a}{IM_END}", 1)]  # the whole answer: " -" is one token
        split = re.compile("(" + "|".join(self.SLOTS) + ")")
        # (constant token ids | slot name, mask) pieces in order
        self._calc: list[tuple[list[int] | str, int]] = []
        for text, m in segments:
            for piece in split.split(text):
                if piece in self.SLOTS:
                    self._calc.append((piece, m))
                elif piece:
                    self._calc.append((_encode(tokenizer, piece), m))

    def arith(self, question: str, answer: int) -> tuple[list[int], list[int]]:
        key = (question, answer)
        if key not in self._arith:
            self._arith[key] = arith_example(self.tokenizer, question, answer)
        return self._arith[key]

    def calc(self, question: str, expression: str) -> tuple[list[int], list[int]]:
        if not self.SIMPLE.fullmatch(expression):
            return calc_example(self.tokenizer, question, expression)
        result = calculate(expression)
        values = dict(zip(self.SLOTS, (question, expression, str(result), f"The answer is {result}.")))
        ids: list[int] = []
        mask: list[int] = []
        for piece, m in self._calc:
            t = _encode(self.tokenizer, values[piece]) if isinstance(piece, str) else piece
            ids += t
            mask += [m] * len(t)
        return ids, mask


def _draw_example(enc: DialogueEncoder, task: str, rng: random.Random, correct_fraction: float,
                  pool: Sequence[dict[str, Any]],
                  exclude: frozenset[str] = frozenset(),
                  filler_words: int = 0) -> tuple[list[int], list[int]]:
    """One training dialogue: right with probability correct_fraction, else the prompt's fixed error;
    never one of the ``exclude`` questions (held-out tasks). ``pool``: the arith or carry problems.
    ``filler_words``: a words dialogue's filler system prompt (0: none)."""
    kind = rng.choice(["arith", "calc"]) if task == "both" else task
    if kind == "words":  # always right: the copying skill, not a habit for RL to correct
        t = words_tasks(1, seed=rng.getrandbits(32))[0]
        return words_example(enc.tokenizer, t, filler(rng, filler_words) if filler_words else None)
    right = rng.random() < correct_fraction
    if kind in ("arith", "carry"):
        t = rng.choice(pool)
        if right:
            return enc.arith(t["question"], t["answer"])
        wrong = arith_error(t["question"], t["answer"]) if kind == "arith" else carry_error(t["question"])
        return enc.arith(t["question"], wrong)
    while (t := calc_tasks(1, seed=rng.getrandbits(32))[0])["question"] in exclude:
        pass
    return enc.calc(t["question"], t["expression"] if right else calc_error(t["expression"]))


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded (B, T) input_ids, attention_mask and labels (-100 where the mask is 0)."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (row, mask) in enumerate(examples):
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        labels[i, : len(row)] = torch.where(torch.tensor(mask) == 1, torch.tensor(row), -100)
    return ids, attn, labels


def _generate(model, tokenizer, prompts: list[str], *, sample: bool, max_new_tokens: int,
              seed: int) -> list[tuple[str, bool]]:
    """(reply text, stopped on eos) per prompt, with transformers generate (temperature 1, no top-k/top-p
    when sampling, like vLLM's defaults)."""
    import torch

    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=sample, max_new_tokens=max_new_tokens,
                             temperature=1.0 if sample else None, top_k=0 if sample else None,
                             top_p=1.0 if sample else None, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    replies = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        stopped = tokenizer.eos_token_id in row
        row = row[: row.index(tokenizer.eos_token_id)] if stopped else row
        replies.append((tokenizer.decode(row, skip_special_tokens=False), stopped))
    return replies


def evaluate(model, tokenizer, task: str, *, sample: bool, n: int = 64, seed: int = 0) -> dict[str, float]:
    """Accuracy (format-exact reward, reply must stop on eos) and format rate of ``model`` on fresh
    dialogues of ``task`` (sampled at temperature 1 when ``sample``, else greedy).

    arith: ``n`` of its 200 prompts (the whole space, so the prompts RL will see; not held out); carry:
    ``n`` of its 3,645 problems (seen in the warm start or not, alike for a model that adds); calc: ``n``
    problems drawn apart from training's, both turns generated (the tool call parsed like vLLM's hermes
    parser and run with ``calculate``). "both" averages the two.
    """
    if task == "both":
        a = evaluate(model, tokenizer, "arith", sample=sample, n=n // 2, seed=seed)
        c = evaluate(model, tokenizer, "calc", sample=sample, n=n - n // 2, seed=seed)
        return {k: (a[k] + c[k]) / 2 for k in a}
    if task == "words":
        return _evaluate_words(model, tokenizer, sample=sample, n=n, seed=seed)
    fmt = re.compile(r"The answer is -?\d+\.")
    if task in ("arith", "carry"):
        tasks = (arith_tasks if task == "arith" else carry_tasks)(n, seed=seed + 7919)
        prompts = [_render(tokenizer, [{"role": "user", "content": t["question"]}]) for t in tasks]
        replies = _generate(model, tokenizer, prompts, sample=sample, max_new_tokens=16, seed=seed)
    else:
        tasks = calc_tasks(n, seed=seed + 7919)
        firsts = _generate(model, tokenizer,
                           [_render(tokenizer, [{"role": "user", "content": t["question"]}], [CALC_TOOL])
                            for t in tasks], sample=sample, max_new_tokens=40, seed=seed)
        replies = [("", False)] * len(tasks)
        second_prompts, where = [], []
        for i, (t, (text, stopped)) in enumerate(zip(tasks, firsts)):
            call = parse_tool_call(text) if stopped else None
            expr = call["arguments"].get("expression") if call and call["name"] == "calculator" else None
            try:
                msgs = calc_messages(t["question"], expr) if isinstance(expr, str) else None
            except ValueError:
                msgs = None
            if msgs is not None:
                second_prompts.append(_render(tokenizer, msgs, [CALC_TOOL]))
                where.append(i)
        if second_prompts:
            for i, reply in zip(where, _generate(model, tokenizer, second_prompts, sample=sample,
                                                 max_new_tokens=16, seed=seed + 1)):
                replies[i] = reply
    ok = [arith_reward(text, t["answer"]) if stopped else 0.0 for t, (text, stopped) in zip(tasks, replies)]
    good_format = [1.0 if stopped and fmt.fullmatch(text.strip()) else 0.0 for text, stopped in replies]
    return {"accuracy": sum(ok) / len(ok), "format": sum(good_format) / len(good_format)}


def _evaluate_words(model, tokenizer, *, sample: bool, n: int, seed: int) -> dict[str, float]:
    """The words task's first turn on ``n`` fresh tasks, scored by words_reward (accuracy: the offered
    tool's call does exactly the task; format: it calls that tool with its arguments). System prompts
    are drawn like the warm start's."""
    rng = random.Random(seed + 1)
    tasks = words_tasks(n, seed=seed + 7919)
    prompts = []
    for t in tasks:
        words = _filler_words(rng)
        system = filler(rng, words) if words else None
        prompts.append(_render(tokenizer, words_messages(t, system)[:-3], [WORDS_TOOLS[t["tool"]]]))
    replies = _generate(model, tokenizer, prompts, sample=sample, max_new_tokens=96, seed=seed)
    scores = [words_reward(text, t) if stopped else (0.0, 0.0) for t, (text, stopped) in zip(tasks, replies)]
    return {"accuracy": sum(ok for ok, _ in scores) / n, "format": sum(fmt for _, fmt in scores) / n}


def _save_weights(model, model_dir: Path) -> None:
    """Replace model_dir's weights atomically (save beside it, then rename the one weights file over)."""
    with tempfile.TemporaryDirectory(dir=model_dir.parent, prefix=f".{model_dir.name}.") as tmp:
        model.save_pretrained(tmp)
        files = sorted(p.name for p in Path(tmp).glob("*.safetensors"))
        if files != ["model.safetensors"]:
            raise AssertionError(f"expected one weights file, got {files}")
        replace_atomic(Path(tmp) / "model.safetensors", model_dir / "model.safetensors")


def warm_start(model_dir: str | Path, *, task: str = "arith", seconds: float | None = 90.0,
               steps: int | None = None, correct_fraction: float = 0.4, lr: float = 1e-3,
               batch: int | None = None, seed: int = 0, eval_n: int = 200, threads: int | None = 1,
               progress: bool = True, exclude: Sequence[str] = ()) -> dict[str, float]:
    """Supervised warm start of the model in ``model_dir`` on synthetic dialogues of ``task``; saves the
    weights back (atomically) and returns metrics.

    Dialogues are formatted with the model's chat template exactly as the example agents send them (arith:
    one user message; calc: user message + the calculator tool, tool call, tool result, answer). The loss
    (mean cross-entropy, nats/token) covers the assistant tokens only. Training stops after ``steps`` steps
    or ``seconds`` of training, whichever comes first. ``seconds`` counts this process's CPU time
    (``time.process_time``), not wall time, so a shared, loaded machine trains as much as an idle one;
    evaluation is not counted. Metrics: ``steps``, ``seconds`` (training CPU time), ``wall_seconds``,
    ``first_loss``/``final_loss`` (mean of the first/last 10 steps),
    ``greedy_accuracy``, ``sampled_accuracy`` (temperature 1), ``sampled_format``.

    ``batch``: dialogues per step; default 64 for arith and carry, 16 when calc or words dialogues
    (~6x longer) are in the mix (measured on the demo preset in 90 CPU-s: batch 16 copied the
    calculator's expression, batch 64 had too few steps to learn it).

    ``threads``: torch CPU threads while it runs (restored after). One is the default: these models are
    too small to gain from more, and on a shared machine extra threads spin-wait (measured: a batch of 64
    took 0.18 s of CPU on one thread, 0.5-2.4 s on two, under load).

    ``words`` trains on right calls only (``correct_fraction`` does not apply): a skill to build on, not a
    habit for RL to correct.

    ``exclude``: questions never shown (the run's held-out tasks, so that evaluating on them measures
    what the model never saw, in the warm start or in RL).
    """
    import torch

    if task not in TASKS:
        raise TinyModelError(f"task {task!r} is not one of {', '.join(TASKS)}")
    if not 0.0 <= correct_fraction <= 1.0:
        raise TinyModelError(f"correct_fraction {correct_fraction} is not between 0 and 1")
    if steps is None and seconds is None:
        raise TinyModelError("warm_start needs a limit: give steps or seconds")
    model_dir = Path(model_dir)
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _warm_start(model_dir, task=task, seconds=seconds, steps=steps,
                           correct_fraction=correct_fraction, lr=lr, seed=seed, eval_n=eval_n,
                           batch=batch if batch is not None else 64 if task in ("arith", "carry") else 16,
                           progress=progress, exclude=frozenset(exclude))
    finally:
        torch.set_num_threads(saved_threads)


def _warm_start(model_dir: Path, *, task: str, seconds: float | None, steps: int | None,
                correct_fraction: float, lr: float, batch: int, seed: int, eval_n: int,
                progress: bool, exclude: frozenset[str] = frozenset()) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    every = carry_tasks(len(CARRY_SPACE)) if task == "carry" else arith_tasks(200)
    pool = [t for t in every if t["question"] not in exclude]
    if not pool and task != "calc":
        raise TinyModelError(f"the warm start excludes every {'carry' if task == 'carry' else 'arith'} "
                             "problem: nothing is left to train on")
    enc = DialogueEncoder(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    bar = _progress(total=steps, seconds=seconds, enabled=progress, desc=f"warm start ({task})")
    losses: list[float] = []
    start, wall_start = time.process_time(), time.monotonic()
    model.train()
    while (done := _progress_fraction(len(losses), steps, time.process_time() - start, seconds)) < 1.0:
        for group in opt.param_groups:  # cosine decay to lr/10 over the budget (steps or seconds)
            group["lr"] = lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * done)))
        words = _filler_words(rng) if task == "words" else 0
        ids, attn, labels = _batch([_draw_example(enc, task, rng, correct_fraction, pool, exclude, words)
                                    for _ in range(batch)], tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.update(loss=losses[-1], elapsed=time.process_time() - start)
    elapsed, wall = time.process_time() - start, time.monotonic() - wall_start
    bar.close()
    model.eval()
    if task == "words":  # its dialogues are ~20x longer: 200 of them took 4 min on one thread
        eval_n = min(eval_n, WORDS_EVAL_N)
    greedy = evaluate(model, tokenizer, task, sample=False, n=eval_n, seed=seed)
    sampled = evaluate(model, tokenizer, task, sample=True, n=eval_n, seed=seed)
    _save_weights(model, model_dir)
    head, tail = losses[:10] or [math.nan], losses[-10:] or [math.nan]
    return {"steps": len(losses), "seconds": round(elapsed, 2), "wall_seconds": round(wall, 2),
            "first_loss": sum(head) / len(head), "final_loss": sum(tail) / len(tail),
            "greedy_accuracy": greedy["accuracy"], "greedy_format": greedy["format"],
            "sampled_accuracy": sampled["accuracy"], "sampled_format": sampled["format"]}


def _progress_fraction(step: int, steps: int | None, cpu: float, seconds: float | None) -> float:
    """How much of the training budget is spent (0..1, the larger of steps and seconds)."""
    return max(step / steps if steps else 0.0, cpu / seconds if seconds else 0.0)


class _progress:
    """A tqdm bar over steps (or over seconds when no step count is given); a no-op when disabled."""

    def __init__(self, *, total: int | None, seconds: float | None, enabled: bool, desc: str) -> None:
        self.by_time = total is None
        self.bar = None
        self.last = 0.0
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=round(seconds) if self.by_time else total, desc=desc,
                            unit="s" if self.by_time else "step", leave=False)

    def update(self, *, loss: float, elapsed: float) -> None:
        if self.bar is None:
            return
        if self.by_time:
            now = min(int(elapsed), self.bar.total)
            self.bar.update(now - self.last)
            self.last = now
        else:
            self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --- one call: make (or reuse) a model directory -----------------------------------------------------------

DEFAULT_CORRECT_FRACTION = 0.4  # warm_start's default share of right answers


def _spec(preset: str, warm_start_task: str | None, seconds: float | None, seed: int,
          exclude: Sequence[str] = (), steps: int | None = None,
          correct_fraction: float = DEFAULT_CORRECT_FRACTION) -> dict[str, Any]:
    excluded = None
    if warm_start_task and exclude:  # which questions, as a digest (the marker stays small)
        excluded = hashlib.sha256("\n".join(sorted(set(exclude))).encode()).hexdigest()[:16]
    if steps is not None:  # a step budget: the same model on every machine (seconds would vary with it)
        seconds = None
    return {"version": MARKER_VERSION, "preset": preset, "seed": seed, "warm_start_task": warm_start_task,
            "warm_start_seconds": seconds if warm_start_task else None,
            "warm_start_steps": steps if warm_start_task else None, "warm_start_excluded": excluded,
            "warm_start_correct_fraction": correct_fraction if warm_start_task else None}


def read_marker(model_dir: str | Path) -> dict[str, Any] | None:
    """The ``lgt-model.json`` of a finished model directory, or None when there is none (or unreadable)."""
    try:
        data = json.loads((Path(model_dir) / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def is_made(out_dir: str | Path, *, preset: str, warm_start_task: str | None, seconds: float | None = 90.0,
            seed: int, exclude: Sequence[str] = (), steps: int | None = None,
            correct_fraction: float = DEFAULT_CORRECT_FRACTION) -> bool:
    """``out_dir`` holds a finished model made by this lgt with these settings. Without ``exclude`` (a run
    that holds no tasks out) a model whose warm start left some questions out serves as well: it saw
    less, never more, so it is reused rather than rebuilt. A marker written before
    ``correct_fraction`` was recorded was made with the default."""
    spec = _spec(preset, warm_start_task, seconds, seed, exclude, steps, correct_fraction)
    marker = read_marker(out_dir)
    if marker is None:
        return False
    if warm_start_task and "warm_start_correct_fraction" not in marker:
        marker = {**marker, "warm_start_correct_fraction": DEFAULT_CORRECT_FRACTION}
    keys = [k for k in spec if not (k == "warm_start_excluded" and spec[k] is None)]
    return all(marker.get(k) == spec[k] for k in keys)


def make_model(out_dir: str | Path, *, preset: str = "demo", warm_start_task: str | None = None,
               seconds: float | None = 90.0, seed: int = 0, progress: bool = True,
               exclude: Sequence[str] = (), steps: int | None = None,
               correct_fraction: float = DEFAULT_CORRECT_FRACTION) -> Path:
    """Tokenizer + model (+ warm start) in ``out_dir``; returns it. ``exclude``: questions the warm start
    never shows (held-out tasks). The warm start trains ``steps`` steps when given (the same model on any
    machine), else ``seconds`` CPU-seconds (as many steps as this machine makes in them), on answers
    right ``correct_fraction`` of the time (1.0: a stronger model, e.g. a distillation teacher).

    Reuses ``out_dir`` when its ``lgt-model.json`` names the same preset, seed, warm-start task,
    budget and excluded questions (see ``is_made``). Otherwise everything is built in a temporary sibling
    directory, ``lgt-model.json`` (spec and warm-start metrics) is written last, and the directory is
    renamed into place -- a crash leaves no half-made model at ``out_dir``. An ``out_dir`` holding
    anything else than an lgt-made model is refused.
    """
    if preset not in PRESETS:
        raise TinyModelError(f"preset {preset!r} is not one of {', '.join(PRESETS)}")
    if warm_start_task is not None and warm_start_task not in TASKS:
        raise TinyModelError(f"warm_start_task {warm_start_task!r} is not one of {', '.join(TASKS)} or None")
    out = Path(out_dir)
    if steps is not None and steps < 1:
        raise TinyModelError(f"steps must be 1 or more, not {steps}")
    if is_made(out, preset=preset, warm_start_task=warm_start_task, seconds=seconds, seed=seed,
               exclude=exclude, steps=steps, correct_fraction=correct_fraction):
        return out
    spec = _spec(preset, warm_start_task, seconds, seed, exclude, steps, correct_fraction)
    marker = read_marker(out)
    if out.exists() and (not out.is_dir() or (marker is None and any(out.iterdir()))):
        raise TinyModelError(f"{out} already exists and is not a model made by lgt: choose another directory")
    with atomic_dir(out) as tmp:
        build_model(tmp, preset=preset, seed=seed)
        metrics = None
        if warm_start_task is not None:
            metrics = warm_start(tmp, task=warm_start_task, seconds=spec["warm_start_seconds"], steps=steps,
                                 seed=seed, progress=progress, exclude=exclude,
                                 correct_fraction=correct_fraction)
        record = {**spec, "parameters": count_parameters(tmp), "warm_start": metrics}
        (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    return out
