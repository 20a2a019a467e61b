"""The sample builder with a real BPE tokenizer: SmolLM2-135M-Instruct's (49,152 tokens) and lgt's ChatML
template with tools (the ``smollm2_dir`` fixture, conftest.py).

A byte-level tokenizer spells every text one way, so a prompt that holds the same text holds the same
tokens. A BPE tokenizer does not: the next prompt is the agent's history rendered again from *text*, and
between what the model generated and that rendering lie a tool call's arguments re-serialised, whitespace
normalised, a word that merges with the text after it, reasoning left out of the history, or the same text
in other tokens. Each test records a rollout's calls as vLLM would (prompt ids: the template's rendering
of the conversation with the generation prompt, tool-call arguments parsed into objects as vLLM's
``_postprocess_messages`` does; generated ids: the reply's tokens + ``<|im_end|>``; one distinct logprob
per token), builds the samples from real Parquet in both modes, and checks the same two things: every
generated token of every call is trained exactly once, in order, with its recorded logprob and policy
version, and nothing else is trained; and the splits are the ones the drift should give, by reason
(``exact`` vs ``realign``). ``bench/real_tokenizer.py`` measures the harnesses' and examples' own calls.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lgt.store.samples import SampleBuild, build_samples
from lgt.testing.samples import store_of

TOOLS = [{"type": "function", "function": {
    "name": "write_file", "description": "Write a file.",
    "parameters": {"type": "object", "required": ["path", "content"],
                   "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}]
SYSTEM = {"role": "system", "content": "You are a coding agent. Use the tools, then say done."}
TASK = {"role": "user", "content": "Write the word PINEAPPLE into the file answer.txt."}
ARGS = {"path": "answer.txt", "content": "PINEAPPLE\n"}
SPACED = (", ", ": ")  # how the template's tojson writes JSON (and vLLM's hermes parser, json.dumps)


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


# --- what the engine records --------------------------------------------------------------------------------

def as_vllm(messages: list[dict]) -> list[dict]:
    """The messages as vLLM hands them to the template: a tool call's arguments (the JSON string of the
    wire format) parsed into an object (vllm/renderers/chat_utils.py ``_postprocess_messages``), which
    the template writes back with ``tojson``."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or ():
            if isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def tool_call(args: dict, *, separators: tuple[str, str] = SPACED, ensure_ascii: bool = False,
              name: str = "write_file") -> str:
    """A hermes tool-call block as the model writes it (the template's own form with SPACED JSON)."""
    body = json.dumps({"name": name, "arguments": args}, separators=separators, ensure_ascii=ensure_ascii)
    return f"<tool_call>\n{body}\n</tool_call>"


def called(args: dict, *, agent: Callable[[dict], str] = json.dumps, call_id: str = "call_1") -> dict:
    """The assistant turn an agent sends back after a tool call (vLLM's hermes parser gave it the arguments;
    ``agent`` is how the agent serialises them again)."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "write_file", "arguments": agent(args)}}]}


def result(text: str = "Wrote 10 bytes.", call_id: str = "call_1") -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


@dataclass
class Rollout:
    """The calls of one rollout, as the proxy records them from vLLM."""

    tok: Any
    rollout_id: str = "r1"
    calls: list[dict] = field(default_factory=list)

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def by_character(self, text: str) -> list[int]:
        """``text`` in the most tokens it can take: one character a token (a spelling the model may
        sample; the canonical one merges them)."""
        return [i for ch in text for i in self.ids(ch)]

    def chat(self, messages: list[dict], generated: str | list[int], *, end: str | None = "<|im_end|>",
             finish: str | None = None) -> None:
        """A chat call: the prompt is the template's rendering of ``messages``; the model generated
        ``generated`` (text, tokenized the canonical way, or ids), then its stop token ``end`` (None: cut
        at the length limit)."""
        text = self.tok.apply_chat_template(as_vllm(messages), tools=TOOLS, tokenize=False,
                                            add_generation_prompt=True)
        self.raw(text, generated, end=end, finish=finish)

    def raw(self, prompt: str, generated: str | list[int], *, end: str | None = None,
            finish: str | None = None) -> None:
        """A call whose prompt is ``prompt``'s tokens (a completions-style agent builds its own text)."""
        gen = self.ids(generated) if isinstance(generated, str) else list(generated)
        if end is not None:
            gen.append(self.tok.convert_tokens_to_ids(end))
        seq = len(self.calls)
        self.calls.append({"rollout_id": self.rollout_id, "attempt": 0, "seq": seq, "status": "ok",
                           "policy_version": seq, "finish_reason": finish or ("stop" if end else "length"),
                           "prompt_token_ids": self.ids(prompt), "response_token_ids": gen,
                           # distinct, exact in float32: -seq - k/128
                           "response_logprobs": [-seq - (k + 1) / 128 for k in range(len(gen))]})


# --- what the builder must make of them ---------------------------------------------------------------------

def build(tmp_path: Path, calls: list[dict], tok: Any) -> dict[str, SampleBuild]:
    """Both modes' samples of ``calls``, each checked with :func:`check_trained_once`."""
    con = store_of(tmp_path, calls)
    out = {mode: build_samples(con, mode=mode, tokenizer=tok) for mode in ("exact", "realign")}
    for mode, b in out.items():
        check_trained_once(b, calls, tok, mode)
    return out


def check_trained_once(b: SampleBuild, calls: list[dict], tok: Any, mode: str) -> None:
    """Every generated token of every call trained exactly once, in order, with its recorded logprob and
    policy version; every other token (the prompts') untrained, logprob 0, version -1. Each sample is its
    last call's prompt + generated tokens: token for token (exact), or as text (realign: but for a stop
    token the template leaves out, ``<|endoftext|>``, kept where it was generated)."""
    left_out = tok.convert_tokens_to_ids("<|endoftext|>")
    dec = lambda ids: tok.decode([t for t in ids[:-1] if t != left_out] + ids[-1:],  # noqa: E731
                                 skip_special_tokens=False)
    ok = {c["rollout_id"]: [] for c in calls}
    for c in sorted(calls, key=lambda c: c["seq"]):
        ok[c["rollout_id"]].append(c)
    for rid, cs in ok.items():
        samples = sorted((s for s in b.samples.to_pylist() if s["rollout_id"] == rid),
                         key=lambda s: s["sample_index"])
        trained, untrained = [], []
        for s in samples:
            for t, m, lp, v in zip(s["input_ids"], s["loss_mask"], s["behaviour_logprobs"],
                                   s["policy_versions"]):
                (trained if m == 1 else untrained).append((t, lp, v))
        want = [(t, lp, c["policy_version"]) for c in cs
                for t, lp in zip(c["response_token_ids"], c["response_logprobs"])]
        assert trained == want, f"{mode}: the generated tokens are not trained exactly once, as recorded"
        assert all(lp == 0.0 and v == -1 for _, lp, v in untrained)
        assert all(s["rollout_tokens"] == len(want) for s in samples)
        last = 0  # each sample holds its calls in turn; it is its last call's context + reply
        for s in samples:
            last += s["n_calls"]
            c = cs[last - 1]
            whole = c["prompt_token_ids"] + c["response_token_ids"]
            if mode == "exact":
                assert s["input_ids"] == whole
            else:
                assert dec(s["input_ids"]) == dec(whole)
        assert last == len(cs)


def outcome(b: SampleBuild) -> tuple[int, list[tuple[int, str]], int]:
    """(samples, [(seq, reason) of each break], realigned merges)."""
    breaks = sorted((r["seq"], r["reason"]) for r in b.merge_breaks.to_pylist())
    return b.samples.num_rows, breaks, b.report.get("realigned_merges", 0)


# --- tool-call arguments ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "agent"), [
    pytest.param(ARGS, lambda a: json.dumps(a, separators=(",", ":")), id="compact-like-JSON.stringify"),
    pytest.param(ARGS, json.dumps, id="python-json.dumps"),
    pytest.param({**ARGS, "content": "café"}, json.dumps, id="non-ascii-escaped"),
])
def test_arguments_the_agent_reserialises_render_as_the_model_wrote_them(tmp_path: Path, tok: Any, args: dict,
                                                                        agent: Callable) -> None:
    """vLLM parses a history's arguments and the template writes them with tojson: however the agent
    spelled the JSON (the harnesses in JavaScript send it compact; Python escapes non-ASCII), the next
    prompt holds what the model wrote, when the model wrote it as the template does."""
    r = Rollout(tok)
    r.chat([SYSTEM, TASK], tool_call(args))
    r.chat([SYSTEM, TASK, called(args, agent=agent), result()], "Done: answer.txt holds PINEAPPLE.")
    exact, realign = build(tmp_path, r.calls, tok).values()
    assert outcome(exact) == outcome(realign) == (1, [], 0)


@pytest.mark.parametrize(("written", "sent"), [
    pytest.param(tool_call(ARGS, separators=(",", ":")), ARGS, id="model-wrote-compact-json"),
    pytest.param(tool_call({**ARGS, "content": "café"}, ensure_ascii=True), {**ARGS, "content": "café"},
                 id="model-escaped-non-ascii"),
    pytest.param(tool_call(ARGS), {"content": ARGS["content"], "path": ARGS["path"]},
                 id="agent-reordered-the-keys"),
])
def test_arguments_written_otherwise_than_the_template_writes_them_split_the_sample(
        tmp_path: Path, tok: Any, written: str, sent: dict) -> None:
    """The text really changed: realign cannot merge it either. Two samples, split for text_change, and
    each generated token still trained once (the checks in ``build``)."""
    r = Rollout(tok)
    r.chat([SYSTEM, TASK], written)
    r.chat([SYSTEM, TASK, called(sent), result()], "Done.")
    exact, realign = build(tmp_path, r.calls, tok).values()
    assert outcome(exact) == outcome(realign) == (2, [(1, "text_change")], 0)


# --- the same text in other tokens --------------------------------------------------------------------------

def test_a_tool_call_spelled_in_other_tokens_merges_in_realign_only(tmp_path: Path, tok: Any) -> None:
    """The model sampled its tool call one character a token (``<``, ``t``, ``o`` … where the canonical
    spelling is ``<``, ``tool``, ``_``, ``call``, ``>``): the next prompt holds the same text, tokenized
    the canonical way. Exact splits (retokenized); realign keeps the generated tokens as sampled and
    appends the rest of the prompt after the text they spell."""
    r = Rollout(tok)
    spelled = r.by_character(tool_call(ARGS))
    assert spelled != r.ids(tool_call(ARGS)) and tok.decode(spelled) == tool_call(ARGS)
    r.chat([SYSTEM, TASK], spelled)
    r.chat([SYSTEM, TASK, called(ARGS), result()], "Done.")
    exact, realign = build(tmp_path, r.calls, tok).values()
    assert outcome(exact) == (2, [(1, "retokenized")], 0)
    assert outcome(realign) == (1, [], 1)
    (s,) = realign.samples.to_pylist()
    first = r.calls[0]
    n = len(first["prompt_token_ids"]) + len(first["response_token_ids"])
    assert s["input_ids"][:n] == first["prompt_token_ids"] + first["response_token_ids"]


def test_a_word_in_two_pieces_merges_in_realign_only(tmp_path: Path, tok: Any) -> None:
    """A text reply whose word the model sampled in two pieces (`` an`` + ``swer``, one token ``answer``
    in the next prompt), then the user's next turn."""
    r = Rollout(tok)
    reply = "Which answer file?"
    pieces = r.ids("Which") + r.ids(" an") + r.ids("swer") + r.ids(" file?")
    assert pieces != r.ids(reply) and tok.decode(pieces) == reply
    r.chat([SYSTEM, TASK], pieces)
    r.chat([SYSTEM, TASK, {"role": "assistant", "content": reply}, {"role": "user", "content": "answer.txt"}],
           tool_call(ARGS))
    exact, realign = build(tmp_path, r.calls, tok).values()
    assert outcome(exact) == (2, [(1, "retokenized")], 0)
    assert outcome(realign) == (1, [], 1)


# --- whitespace ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("generated", "history"), [
    pytest.param("Done: answer.txt holds PINEAPPLE.\n\n", "Done: answer.txt holds PINEAPPLE.",
                 id="agent-stripped-the-reply"),
    pytest.param("Done:  answer.txt holds   PINEAPPLE.", "Done: answer.txt holds PINEAPPLE.",
                 id="agent-collapsed-spaces"),
    pytest.param("Done:\r\nanswer.txt holds PINEAPPLE.", "Done:\nanswer.txt holds PINEAPPLE.",
                 id="agent-normalised-line-ends"),
])
def test_whitespace_the_agent_normalised_splits_the_sample(tmp_path: Path, tok: Any, generated: str,
                                                           history: str) -> None:
    r = Rollout(tok)
    r.chat([SYSTEM, TASK], generated)
    r.chat([SYSTEM, TASK, {"role": "assistant", "content": history},
            {"role": "user", "content": "Thanks. Now say bye."}], "Bye.")
    exact, realign = build(tmp_path, r.calls, tok).values()
    assert outcome(exact) == outcome(realign) == (2, [(1, "text_change")], 0)


def test_the_templates_newline_before_a_tool_call_splits_the_sample(tmp_path: Path, tok: Any) -> None:
    """The model wrote a sentence and its tool call on one line; the parser gives the sentence as the
    content, and the template puts the tool call on a line of its own: one more newline than generated.
    With the newline generated, the same turn merges."""
    for k, sep in enumerate((" ", "\n")):
        r = Rollout(tok, rollout_id=f"r{k}")
        r.chat([SYSTEM, TASK], f"I will write it.{sep}{tool_call(ARGS)}")
        turn = {**called(ARGS), "content": f"I will write it.{sep}"}  # vLLM's hermes parser: text before
        r.chat([SYSTEM, TASK, turn, result()], "Done.")
        exact, realign = build(tmp_path / r.rollout_id, r.calls, tok).values()
        want = (2, [(1, "text_change")], 0) if sep == " " else (1, [], 0)
        assert outcome(exact) == outcome(realign) == want


# --- a word across a turn boundary --------------------------------------------------------------------------

@pytest.mark.parametrize(("prompt", "generated", "glued", "exact_wants", "realign_wants"), [
    pytest.param("Question: Is the water cold?\nAnswer:", " The wat", "er is cold.\nQuestion:",
                 (2, [(1, "boundary_resplit")], 0), (2, [(1, "boundary_resplit")], 0),
                 id="piece-merges-into-one-token"),
    pytest.param("Question: What is 23*47?\nThought:", " I will ", "compute it.\nAction:",
                 (2, [(1, "boundary_resplit")], 0), (2, [(1, "boundary_resplit")], 0),
                 id="trailing-space-merges-with-the-next-word"),
    pytest.param("Question: What is 23*47?\nThought: I will", [" comp", "ute"], "\nObservation: 1081\n",
                 (2, [(1, "retokenized")], 0), (1, [], 1), id="pieces-respelled-before-a-boundary"),
])
def test_a_word_across_the_boundary_of_a_completions_prompt(tmp_path: Path, tok: Any, prompt: str,
                                                            generated: str | list[str], glued: str,
                                                            exact_wants: tuple, realign_wants: tuple) -> None:
    """A completions-style agent builds its prompt from text: the reply (cut at the length limit or a
    stop string), then its own text glued on. Where the reply's last piece merges with the text after
    it, no token boundary ends the reply: boundary_resplit, in both modes. Where one does, realign
    merges the same text in other tokens."""
    r = Rollout(tok)
    pieces = [generated] if isinstance(generated, str) else generated
    r.raw(prompt, [i for p in pieces for i in r.ids(p)])
    r.raw(prompt + tok.decode(r.calls[0]["response_token_ids"]) + glued, " done")
    exact, realign = build(tmp_path, r.calls, tok).values()
    assert outcome(exact) == exact_wants and outcome(realign) == realign_wants


def test_chatml_keeps_a_cut_reply_apart_from_the_next_turn(tmp_path: Path, tok: Any) -> None:
    """The same reply cut mid-word in a chat (no ``<|im_end|>`` generated): the template closes the turn
    with ``<|im_end|>``, a special token no merge crosses, so the next prompt extends it token for token."""
    r = Rollout(tok)
    r.chat([SYSTEM, TASK], "The wat", end=None)
    assert r.ids("The wat") + r.ids("er") != r.ids("The water")
    r.chat([SYSTEM, TASK, {"role": "assistant", "content": "The wat"}, {"role": "user", "content": "er?"}],
           "Water.")
    exact, realign = build(tmp_path, r.calls, tok).values()
    assert outcome(exact) == outcome(realign) == (1, [], 0)


# --- a stop token the template leaves out -------------------------------------------------------------------

@pytest.mark.parametrize("finish", ["stop", "tool_calls"])
def test_a_stop_token_the_template_leaves_out_realigns_after_a_tool_call_too(tmp_path: Path, tok: Any,
                                                                             finish: str) -> None:
    """A model that ends its turn on a stop token the template does not render (``<|endoftext|>`` here;
    the template closes the turn with ``<|im_end|>``, as Llama 3's closes a tool call's ``<|eom_id|>``
    turn with ``<|eot_id|>``). vLLM reports finish_reason ``tool_calls`` for a reply its tool parser read
    calls from, which ended on the stop token all the same: realign merges it as it merges a text reply
    (``stop``), the stop token trained once where it was generated, the template's end as context."""
    r = Rollout(tok)
    r.chat([SYSTEM, TASK], tool_call(ARGS), end="<|endoftext|>", finish=finish)
    r.chat([SYSTEM, TASK, called(ARGS), result()], "Done.")
    exact, realign = build(tmp_path, r.calls, tok).values()
    assert outcome(exact) == (2, [(1, "retokenized")], 0)
    assert outcome(realign) == (1, [], 1)
    (s,) = realign.samples.to_pylist()
    n = len(r.calls[0]["prompt_token_ids"]) + len(r.calls[0]["response_token_ids"])
    assert tok.convert_ids_to_tokens(s["input_ids"][n - 1:n + 1]) == ["<|endoftext|>", "<|im_end|>"]
    assert s["loss_mask"][n - 1:n + 1] == [1, 0]


# --- reasoning ----------------------------------------------------------------------------------------------

def test_reasoning_dropped_from_the_history_splits_after_each_reasoning_turn(tmp_path: Path,
                                                                            tok: Any) -> None:
    """The model thinks before its first tool call, not before its second, then thinks again before its
    answer. The agent keeps no reasoning in its history (the APIs' reasoning items are dropped, chat
    templates render none): the prompt after a turn with reasoning does not hold it. Reasoning tokens are
    trained once like any other generated token."""
    think = "<think>\nThe user wants a file written. I will use write_file.\n</think>\n\n"
    second = {**ARGS, "path": "copy.txt"}
    r = Rollout(tok)
    r.chat([SYSTEM, TASK], think + tool_call(ARGS))
    history = [SYSTEM, TASK, called(ARGS), result()]
    r.chat(history, tool_call(second))
    history += [called(second, call_id="call_2"), result(call_id="call_2")]
    r.chat(history, think + "Done: both files hold PINEAPPLE.")
    exact, realign = build(tmp_path, r.calls, tok).values()
    assert outcome(exact) == outcome(realign) == (2, [(1, "text_change")], 0)
    assert [s["n_calls"] for s in exact.samples.to_pylist()] == [1, 2]


# --- all of it in one rollout -------------------------------------------------------------------------------

def test_a_rollout_with_every_drift_trains_each_generated_token_once(tmp_path: Path, tok: Any) -> None:
    """Six calls: a tool call as the template writes it (merges), one spelled by character (realign merges),
    one in compact JSON (splits), a text reply the agent strips (splits), reasoning (splits), an answer."""
    r, history = Rollout(tok), [SYSTEM, TASK]
    args = [{**ARGS, "path": f"f{k}.txt"} for k in range(3)]
    r.chat(history, tool_call(args[0]))
    history += [called(args[0], call_id="c0"), result(call_id="c0")]
    r.chat(history, r.by_character(tool_call(args[1])))
    history += [called(args[1], call_id="c1"), result(call_id="c1")]
    r.chat(history, tool_call(args[2], separators=(",", ":")))
    history += [called(args[2], call_id="c2"), result(call_id="c2")]
    r.chat(history, "Three files written.  ")
    history += [{"role": "assistant", "content": "Three files written."}, {"role": "user", "content": "Why?"}]
    r.chat(history, "<think>\nThe user asks why.\n</think>\n\nYou asked.")
    history += [{"role": "assistant", "content": "You asked."}, {"role": "user", "content": "Bye."}]
    r.chat(history, "Bye.")
    exact, realign = build(tmp_path, r.calls, tok).values()
    splits = [(3, "text_change"), (4, "text_change"), (5, "text_change")]
    assert outcome(exact) == (5, sorted([(2, "retokenized"), *splits]), 0)
    assert outcome(realign) == (4, splits, 1)
    assert [s["n_calls"] for s in realign.samples.to_pylist()] == [3, 1, 1, 1]
