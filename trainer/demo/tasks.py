"""The demo's toy tasks and their rewards: problems, the dialogues an example agent holds about them, the
fixed plausible errors the warm start teaches, and how a reply is scored.

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
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Sequence
from typing import Any

from lgt.trainer.demo.chat import parse_tool_call

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


class TinyModelError(ValueError):
    """Bad input to the demo's tasks, models or warm start; the message is one sentence naming it."""


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


WORDS_FILLER_SHARE = 0.5  # warm-start steps whose words dialogues have a filler system prompt
WORDS_FILLER_MEAN = 80  # its mean length in words (exponential, capped at WORDS_FILLER_MAX)
WORDS_FILLER_MAX = 350


def filler_length(rng: random.Random) -> int:
    """How long a words dialogue's filler system prompt is (0: none). Drawn once per warm-start step, so
    that a batch's dialogues are about as long as each other (padding to the longest costs the rest)."""
    if rng.random() >= WORDS_FILLER_SHARE:
        return 0
    return min(WORDS_FILLER_MAX, 1 + int(rng.expovariate(1.0 / WORDS_FILLER_MEAN)))
