"""The sample builder (lgt.store.samples) on real Parquet stores, real DuckDB and a real tokenizer.

The tokenizer is a byte-level BPE trained here on a few hundred sentences; conversations are rendered
with ChatML and tokenized the way an agent's server does (the whole context each call), so merges,
re-tokenisation drift and splits come out of real tokenization, not hand-written ids.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from pathlib import Path
from typing import Any

import click
import duckdb
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from lgt.store.merge import merge_calls
from lgt.store.query import connect
from lgt.store.realign import realign_offset
from lgt.store.report import report_data
from lgt.store.samples import (
    CALL_COLUMNS,
    MERGE_BREAKS,
    SAMPLES,
    build_group_samples,
    build_samples,
    call_order,
    install,
    split_by_policy,
    store_root,
    trained_rollouts,
)
from lgt.store.show import render_build
from lgt.store.stream import merge_reports, stream_samples
from lgt.store.writer import to_arrow, write_parquet_atomic
from lgt.testing.samples import (
    Agent,
    Turn,
    call_row,
    make_tokenizer,
    reward,
    rollout,
    sentence,
    store_of,
    write_store,
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return make_tokenizer()


def by_id(build) -> dict[str, dict]:
    return {r["sample_id"]: r for r in build.samples.to_pylist()}


def breaks(build) -> list[tuple]:
    return sorted((r["rollout_id"], r["seq"], r["reason"]) for r in build.merge_breaks.to_pylist())


def generated_runs(sample: dict) -> list[tuple[list[int], list[float], int]]:
    """Un-merge: the sample's generated spans (mask 1), with logprobs and policy version."""
    runs, cur, prev_v = [], None, None
    for i, (m, t, lp, v) in enumerate(zip(sample["loss_mask"], sample["input_ids"],
                                          sample["behaviour_logprobs"], sample["policy_versions"])):
        if m == 1:
            if cur is None or v != prev_v:
                cur = ([], [], v)
                runs.append(cur)
            cur[0].append(t)
            cur[1].append(lp)
            prev_v = v
        else:
            assert lp == 0.0 and v == -1, f"token {i}: context tokens have logprob 0 and version -1"
            cur = None
    return runs


# --- exact mode -------------------------------------------------------------------------------------

def test_a_conversation_that_only_appends_is_one_sample(tmp_path: Path, tok: Tokenizer) -> None:
    agent = Agent(tok)
    calls = agent.run("r1", [Turn("how do the water", "the water is 42."),
                             Turn("and then", "then we call it a day.", version=1),
                             Turn("why", "no way.", version=2)])
    b = build_samples(store_of(tmp_path, calls))
    (s,) = b.samples.to_pylist()
    last = calls[-1]
    # one sample: the last call's prompt + what it generated; every earlier call's tokens inside it
    assert s["input_ids"] == last["prompt_token_ids"] + last["response_token_ids"]
    assert (s["sample_id"], s["n_calls"], s["sample_index"], s["mode"]) == ("r1~0#0", 3, 0, "exact")
    got = [(ids, lps, v) for ids, lps, v in generated_runs(s)]
    want = [(c["response_token_ids"], pytest.approx(c["response_logprobs"]), c["policy_version"])
            for c in calls]
    assert got == want
    for c in calls:  # each generated span sits where the next prompt puts it
        start, n = len(c["prompt_token_ids"]), len(c["response_token_ids"])
        assert s["loss_mask"][start:start + n] == [1] * n
    assert sum(s["loss_mask"]) == s["rollout_tokens"] == sum(len(c["response_token_ids"]) for c in calls)
    assert b.merge_breaks.num_rows == 0 and b.merge_breaks.schema == MERGE_BREAKS
    assert b.samples.schema == SAMPLES
    assert b.report["samples_per_rollout"] == {"1": 1}


def test_exact_splits_at_excluded_calls_and_truncation(tmp_path: Path, tok: Tokenizer) -> None:
    agent = Agent(tok)
    calls = agent.run("r1", [Turn("hi", "", status="http_error"),  # before any sample: no split
                             Turn("how do the water", "the water is 42."),
                             Turn("and then", "then we call it a day."),
                             Turn("and now", "", status="upstream_error"),
                             Turn("why", "no way."),
                             Turn("what", "all of them.", forget=True)])
    calls[3] = {k: v for k, v in calls[3].items() if k != "prompt_token_ids"}  # no token ids at all
    b = build_samples(store_of(tmp_path, calls))
    assert breaks(b) == [("r1", 4, "excluded_call"), ("r1", 5, "truncation")]
    samples = sorted(b.samples.to_pylist(), key=lambda s: s["sample_index"])
    assert [s["n_calls"] for s in samples] == [2, 1, 1]
    assert samples[1]["input_ids"] == calls[4]["prompt_token_ids"] + calls[4]["response_token_ids"]
    assert b.report["calls"] == {"used": 4, "excluded": {"http_error": 1, "upstream_error": 1},
                                 "logprobs_recomputed": 0}
    assert b.report["samples_per_rollout"] == {"3": 1}


def test_a_call_the_proxy_refused_does_not_split_the_sample(tmp_path: Path, tok: Tokenizer) -> None:
    # a 429 while the policy was updated (pause in reject mode), then the same turn again: the retried
    # call extends the call before the refused one, which is on the record but never in a sample
    agent = Agent(tok)
    calls = agent.run("r1", [Turn("how do the water", "the water is 42."),
                             Turn("and then", "", status="rejected"),
                             Turn("and then", "then we call it a day.")])
    b = build_samples(store_of(tmp_path, calls))
    (s,) = b.samples.to_pylist()
    assert b.merge_breaks.num_rows == 0 and s["n_calls"] == 2
    assert s["input_ids"] == calls[2]["prompt_token_ids"] + calls[2]["response_token_ids"]
    assert b.report["calls"]["used"] == 2


def test_a_call_recorded_without_logprobs_stays_in_its_sample_for_the_trainer_to_recompute(
        tmp_path: Path, tok: Tokenizer) -> None:
    agent = Agent(tok)
    calls = agent.run("r1", [Turn("how do the water", "the water is 42."),
                             Turn("and then", "then we call it a day.", logprobs=False),
                             Turn("why", "no way.")])
    con = store_of(tmp_path, calls)
    b = build_samples(con)
    (s,) = b.samples.to_pylist()  # no split: the prompts still extend token by token
    assert b.merge_breaks.num_rows == 0 and s["n_calls"] == 3
    runs = generated_runs(s)
    assert [ids for ids, _, _ in runs] == [c["response_token_ids"] for c in calls]
    assert all(math.isnan(lp) for lp in runs[1][1])
    assert not any(math.isnan(lp) for lp in runs[0][1] + runs[2][1])
    assert b.report["calls"] == {"used": 3, "excluded": {}, "logprobs_recomputed": 1}
    install(con)  # the plain-SQL view says the same
    (v,) = con.sql("FROM samples").to_arrow_table().to_pylist()
    assert v["behaviour_logprobs"] == pytest.approx(s["behaviour_logprobs"], nan_ok=True)


def test_a_rollout_spanning_three_versions_keeps_each_tokens_own_version(tmp_path: Path,
                                                                         tok: Tokenizer) -> None:
    """Calls that lived through updates (lgt-proxy --on-update continue) carry a version per token: the
    sample holds each token's own, in the merge and in the plain-SQL view alike; a list that is not one
    per token is read as the call's policy_version throughout."""
    agent = Agent(tok)
    calls = agent.run("r1", [Turn("how do the water", "the water is 42.", version=1),
                             Turn("and then", "then we call it a day.", version=1),
                             Turn("why", "no way.", version=2),
                             Turn("so", "so be it.", version=3)])
    n1, n2 = len(calls[1]["response_token_ids"]), len(calls[2]["response_token_ids"])
    calls[1]["response_policy_versions"] = [1] * 3 + [2] * (n1 - 3)  # updated after 3 tokens
    calls[2]["response_policy_versions"] = [2] * 2 + [3] * (n2 - 2)
    calls[3]["response_policy_versions"] = [7, 7]  # not one per token: ignored
    con = store_of(tmp_path, calls)
    (s,) = build_samples(con).samples.to_pylist()
    want: list[int] = []
    for c in calls:
        want += [-1] * (len(c["prompt_token_ids"]) - len(want)) + (
            c["response_policy_versions"] if c is calls[1] or c is calls[2]
            else [c["policy_version"]] * len(c["response_token_ids"]))
    assert s["policy_versions"] == want and s["n_calls"] == 4
    assert [v for _, _, v in generated_runs(s)] == [1, 1, 2, 2, 3, 3]  # run boundaries per call and version
    install(con)
    (v,) = con.sql("FROM samples").to_arrow_table().to_pylist()
    assert v["policy_versions"] == s["policy_versions"] and v["n_calls"] == 4


def test_exact_names_token_differences_only_with_a_tokenizer(tmp_path: Path, tok: Tokenizer) -> None:
    agent = Agent(tok)
    calls = agent.run("r1", [Turn("how do the water", "the water is 42.", split=True),
                             Turn("and then", "then we call it a day.")])
    con = store_of(tmp_path, calls)
    assert breaks(build_samples(con)) == [("r1", 1, "no_tokenizer")]
    assert breaks(build_samples(con, tokenizer=tok)) == [("r1", 1, "retokenized")]


# --- realign ----------------------------------------------------------------------------------------

def test_realign_keeps_a_bpe_resplit_reply_in_one_sample(tmp_path: Path, tok: Tokenizer) -> None:
    agent = Agent(tok)
    calls = agent.run("r1", [Turn("how do the water", "the water is 42.", split=True),
                             Turn("and then", "then we call it a day.", version=1)])
    # the model said "the water is 42." one byte per token; the next prompt re-tokenizes it
    assert calls[1]["prompt_token_ids"][:len(calls[0]["prompt_token_ids"])] == calls[0]["prompt_token_ids"]
    assert calls[1]["prompt_token_ids"][len(calls[0]["prompt_token_ids"]):][:3] != \
        calls[0]["response_token_ids"][:3]
    con = store_of(tmp_path, calls)
    assert build_samples(con).samples.num_rows == 2
    b = build_samples(con, mode="realign", tokenizer=tok)
    (s,) = b.samples.to_pylist()
    assert b.merge_breaks.num_rows == 0 and b.report["realigned_merges"] == 1
    # the generated tokens stay as generated; the text is the last call's
    assert [r[0] for r in generated_runs(s)] == [c["response_token_ids"] for c in calls]
    last = calls[-1]
    assert tok.decode(s["input_ids"], skip_special_tokens=False) == \
        tok.decode(last["prompt_token_ids"] + last["response_token_ids"], skip_special_tokens=False)
    assert s["mode"] == "realign"


def test_realign_merges_across_a_template_that_drops_the_eos(tmp_path: Path, tok: Tokenizer) -> None:
    agent = Agent(tok)
    eos = tok.token_to_id("</s>")
    calls = agent.run("r1", [Turn("how do the water", "the water is 42.", stop="</s>"),
                             Turn("and then", "then we call it a day.", stop="</s>")])
    con = store_of(tmp_path, calls)
    assert breaks(build_samples(con, tokenizer=tok)) == [("r1", 1, "retokenized")]
    (s,) = build_samples(con, mode="realign", tokenizer=tok).samples.to_pylist()
    first = calls[0]
    end = len(first["prompt_token_ids"]) + len(first["response_token_ids"])
    # the EOS the model generated is kept and trained; the template's <|im_end|> follows as context
    assert s["input_ids"][end - 1] == eos and s["loss_mask"][end - 1] == 1
    assert s["input_ids"][end] == tok.token_to_id("<|im_end|>") and s["loss_mask"][end] == 0
    assert [r[0] for r in generated_runs(s)] == [c["response_token_ids"] for c in calls]


def test_realign_splits_where_the_text_does_not_extend(tmp_path: Path, tok: Tokenizer) -> None:
    agent = Agent(tok)
    calls = agent.run("r1", [Turn("how do the water", "the water is 42."),
                             Turn("and then", "then we call it a day.", rewrite=True),
                             Turn("why", "no way.", forget=True)])
    # a completions-style agent that glues the observation onto the reply: "... is 4" + "2. ..."
    text = "Question: what is six times seven?\nAnswer: it is 4"
    p2 = tok.encode("Question: what is six times seven?\nAnswer:").ids
    g2 = tok.encode(" it is 4").ids
    p3 = tok.encode(text + "2.\nQuestion: and then?\nAnswer:").ids
    assert tok.decode(p2 + g2) == text and p3[:len(p2 + g2)] != p2 + g2
    calls += [{"rollout_id": "r2", "attempt": 0, "seq": 0, "prompt_token_ids": p2, "response_token_ids": g2,
               "response_logprobs": [-1.0] * len(g2), "finish_reason": "length"},
              {"rollout_id": "r2", "attempt": 0, "seq": 1, "prompt_token_ids": p3,
               "response_token_ids": g2, "response_logprobs": [-1.0] * len(g2), "finish_reason": "length"}]
    b = build_samples(store_of(tmp_path, calls), mode="realign", tokenizer=tok)
    assert breaks(b) == [("r1", 1, "text_change"), ("r1", 2, "truncation"), ("r2", 1, "boundary_resplit")]


def test_realign_offset_finds_the_token_boundary_or_says_why_not(tok: Tokenizer) -> None:
    dec = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    enc = lambda text: tok.encode(text).ids  # noqa: E731
    prompt = enc("<|im_start|>user\nthe water<|im_end|>\n<|im_start|>assistant\n")
    said = [i for ch in "it is 42." for i in enc(ch)]  # generated one byte a token
    held = prompt + said
    again = enc(dec(held) + " Yes")  # the same text, re-tokenized: "it", " is", " 42", "."
    assert again[:len(held)] != held
    boundary = len(enc(dec(held)))  # " Yes" starts a new pre-token: the held text ends a token
    assert realign_offset(dec, held, len(prompt), False, again) == (boundary, None)
    assert realign_offset(dec, held, len(prompt), False, held[:4]) == (None, "truncation")
    assert realign_offset(dec, held, len(prompt), False, enc("<|im_start|>user\nno") + held) == \
        (None, "text_change")
    wat = prompt + enc("the wat")  # the text goes on into the same word: " water" is one token
    assert realign_offset(dec, wat, len(prompt), False, enc(dec(wat) + "er")) == (None, "boundary_resplit")
    eos = held + [tok.token_to_id("</s>")]  # a stop token the template does not render
    after = enc(dec(held) + "<|im_end|>\n")
    assert realign_offset(dec, eos, len(prompt), True, after) == (boundary, None)
    assert realign_offset(dec, eos, len(prompt), False, after) == (None, "text_change")


# --- merging and un-merging (Hypothesis) --------------------------------------------------------------

@st.composite
def conversations(draw) -> list[list[Turn]]:
    rng = random.Random(draw(st.integers(0, 2**32)))
    rollouts = []
    for _ in range(draw(st.integers(1, 3))):
        turns = []
        for k in range(draw(st.integers(1, 5))):
            roll = rng.random()
            turns.append(Turn(
                user=sentence(rng, rng.randint(1, 6)),
                reply=sentence(rng, rng.randint(0, 8)) + rng.choice(".?"),
                split=roll < 0.25, stop="</s>" if 0.25 <= roll < 0.4 else "<|im_end|>",
                status="http_error" if 0.4 <= roll < 0.45 else "rejected" if 0.45 <= roll < 0.5 else "ok",
                forget=0.5 <= roll < 0.55 and k > 1, rewrite=0.55 <= roll < 0.6, version=k,
                logprobs=not 0.6 <= roll < 0.7))
        rollouts.append(turns)
    return rollouts


def check_unmerge(build, calls: list[dict]) -> None:
    """Every generated token of every trained call comes back exactly once, in order, unchanged,
    with its logprob and policy version, by reading each attempt's samples' loss masks."""
    samples = sorted(build.samples.to_pylist(), key=lambda s: (s["rollout_id"], s["sample_index"]))
    got: dict[str, list] = {}
    for s in samples:
        for ids, lps, v in generated_runs(s):
            got.setdefault(s["rollout_id"], []).extend((t, lp, v) for t, lp in zip(ids, lps))
    want: dict[str, list] = {}
    for c in sorted(calls, key=lambda c: (c["rollout_id"], c["seq"])):
        if c["status"] == "ok":  # a call recorded without logprobs: NaN, for the trainer to recompute
            lps = c["response_logprobs"] or [math.nan] * len(c["response_token_ids"])
            want.setdefault(c["rollout_id"], []).extend(
                (t, pytest.approx(lp, nan_ok=True), c["policy_version"])
                for t, lp in zip(c["response_token_ids"], lps))
    assert got == want


def last_calls(build, calls: list[dict]) -> list[tuple[dict, dict]]:
    """Each sample with the last call merged into it (samples take an attempt's calls in turn)."""
    ok = {}
    for c in sorted(calls, key=lambda c: c["seq"]):
        if c["status"] == "ok":
            ok.setdefault(c["rollout_id"], []).append(c)
    out, used = [], Counter()
    for s in sorted(build.samples.to_pylist(), key=lambda s: (s["rollout_id"], s["sample_index"])):
        used[s["rollout_id"]] += s["n_calls"]
        out.append((s, ok[s["rollout_id"]][used[s["rollout_id"]] - 1]))
    assert all(used[r] == len(cs) for r, cs in ok.items())
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversations())
def test_merge_then_unmerge_gives_back_every_generated_token(tmp_path_factory, tok, convs) -> None:
    agent = Agent(tok)
    calls = [c for i, turns in enumerate(convs) for c in agent.run(f"r{i}", turns)]
    con = store_of(tmp_path_factory.mktemp("s"), calls, files=2)
    exact = build_samples(con)
    check_unmerge(exact, calls)
    realigned = build_samples(con, mode="realign", tokenizer=tok)
    check_unmerge(realigned, calls)  # realign never changes a generated token
    assert realigned.samples.num_rows <= exact.samples.num_rows
    assert realigned.samples.num_rows + realigned.report["realigned_merges"] == exact.samples.num_rows
    eos = tok.token_to_id("</s>")
    for s, last in last_calls(exact, calls):  # exact: a sample is its last call's prompt + output
        assert s["input_ids"] == last["prompt_token_ids"] + last["response_token_ids"]
    for s, last in last_calls(realigned, calls):  # realign: the same text, but for kept stop tokens
        ids = s["input_ids"]
        kept = [t for i, t in enumerate(ids) if not (t == eos and i < len(ids) - 1)]
        assert tok.decode(kept, skip_special_tokens=False) == \
            tok.decode(last["prompt_token_ids"] + last["response_token_ids"], skip_special_tokens=False)
    # the builder and the plain-SQL views agree (exact mode)
    install(con)
    view = {r["sample_id"]: r for r in con.sql("FROM samples").to_arrow_table().to_pylist()}
    assert view.keys() == by_id(exact).keys()
    for sid, r in by_id(exact).items():
        assert {k: v for k, v in r.items() if k != "behaviour_logprobs"} == \
            {k: v for k, v in view[sid].items() if k != "behaviour_logprobs"}
        assert r["behaviour_logprobs"] == pytest.approx(view[sid]["behaviour_logprobs"], nan_ok=True)
    assert breaks(exact) == sorted((r, q, why) for r, _, q, why in con.sql("FROM merge_breaks").fetchall())


def test_calls_out_of_order_merge_the_same(tmp_path: Path, tok: Tokenizer) -> None:
    agent = Agent(tok)
    rng = random.Random(1)
    calls = [c for i in range(4) for c in agent.run(
        f"r{i}", [Turn(sentence(rng, 3), sentence(rng, 5) + ".", split=i == 2 and k == 1, version=k)
                  for k in range(4)])]
    con = store_of(tmp_path, calls)
    install(con)
    order = call_order(con)
    rows = con.sql(f"SELECT {', '.join(CALL_COLUMNS)} FROM calls").to_arrow_table()
    in_order = merge_calls(rows.sort_by([("rollout_id", "ascending"), ("seq", "ascending")])
                           .to_batches(), order, "exact", None)
    backwards = merge_calls(rows.sort_by([("seq", "descending")]).to_batches(max_chunksize=3),
                            order, "exact", None)
    def samples(m):
        lists = [list(itertools.chain.from_iterable(c[i].to_pylist() for c in m.chunks)) for i in range(4)]
        return {s[:3]: [col[k] for col in lists] for k, s in enumerate(m.scalars)}
    assert samples(in_order) == samples(backwards) and len(samples(in_order)) == 5
    assert sorted(map(str, in_order.breaks)) == sorted(map(str, backwards.breaks)) != []


def test_each_policys_calls_make_its_own_samples(tmp_path: Path, tok: Tokenizer) -> None:
    """A planner and a coder taking turns in one rollout (calls.policy): each policy's calls merge among
    themselves, the coder's calls in between neither split nor join the planner's sample; each sample
    counts its rollout's tokens of its own policy."""
    planner = Agent(tok).run("r1", [Turn("plan the water", "first the water."),
                                    Turn("and then", "then the day.", version=1),
                                    Turn("done?", "yes.", version=2)])
    coder = Agent(tok).run("r1", [Turn("write the water", "water = 42"), Turn("run it", "ok then.")])
    calls = []
    for i, c in enumerate([planner[0], coder[0], planner[1], coder[1], planner[2]]):
        calls.append({**c, "seq": i, "policy": "planner" if c in planner else "coder"})
    other = [{**c, "policy": None} for c in Agent(tok).run("r2", [Turn("hi", "hello."), Turn("and", "so.")])]
    con = store_of(tmp_path, calls + other, files=2)
    b = build_samples(con)
    got = by_id(b)
    assert sorted(got) == ["r1~0#coder.0", "r1~0#planner.0", "r2~0#0"]  # r2: a store row of no policy
    for sid, mine in (("r1~0#planner.0", planner), ("r1~0#coder.0", coder)):
        s = got[sid]
        assert s["input_ids"] == mine[-1]["prompt_token_ids"] + mine[-1]["response_token_ids"]
        assert (s["n_calls"], s["sample_index"], s["reward"]) == (len(mine), 0, 1.0)
        assert [v for _, _, v in generated_runs(s)] == [c["policy_version"] for c in mine]
        assert s["rollout_tokens"] == sum(s["loss_mask"]) == sum(len(c["response_token_ids"]) for c in mine)
    assert got["r2~0#0"]["policy"] == "default" and b.merge_breaks.num_rows == 0
    parts = split_by_policy(b.samples)
    assert {k: v.column("sample_id").to_pylist() for k, v in parts.items()} == {
        p: [sid for sid, r in got.items() if r["policy"] == p] for p in ("planner", "coder", "default")}
    assert all(t.schema == SAMPLES for t in parts.values())
    install(con)  # the plain-SQL views agree
    view = {r["sample_id"]: r for r in con.sql("FROM samples").to_arrow_table().to_pylist()}
    assert view.keys() == got.keys()
    for sid, r in got.items():
        assert {k: v for k, v in r.items() if k != "behaviour_logprobs"} == \
            {k: v for k, v in view[sid].items() if k != "behaviour_logprobs"}


# --- bad input, empty stores --------------------------------------------------------------------------

def test_bad_arguments_are_one_sentence_errors(tmp_path: Path, tok: Tokenizer) -> None:
    con = store_of(tmp_path, Agent(tok).run("r1", [Turn("hi", "hello.")]))
    cases = [({"mode": "fuzzy"}, "unknown sample mode 'fuzzy': use one of exact, realign"),
             ({"mode": "realign"}, "mode 'realign' needs a tokenizer (anything with decode(ids) -> str)"),
             ({"tokenizer": object()}, "the tokenizer (object) has no decode(ids) method")]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as e:
            build_samples(con, **kwargs)
        assert str(e.value) == message


def test_two_calls_with_one_seq_are_refused(tmp_path: Path, tok: Tokenizer) -> None:
    calls = Agent(tok).run("r1", [Turn("hi", "hello."), Turn("and", "then.")])
    calls[1]["seq"] = 0
    calls[1]["call_id"] = "dup"
    with pytest.raises(ValueError, match=r"^rollout 'r1' attempt 0 has more than one call with seq 0; "):
        build_samples(store_of(tmp_path, calls))


def test_a_connection_without_the_store_views_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^build_samples needs a connection from lgt.store.query.connect"):
        build_samples(duckdb.connect())
    con = duckdb.connect()
    con.execute(f"SET file_search_path = '{tmp_path}'")
    with pytest.raises(ValueError, match="^the connection has no store views"):
        build_samples(con)


def test_the_builder_needs_the_store_behind_the_connection(tmp_path: Path, tok: Tokenizer) -> None:
    con = store_of(tmp_path, Agent(tok).run("r1", [Turn("hi", "hello.")]))
    install(con)
    order = call_order(con)
    rows = con.sql(f"SELECT {', '.join(CALL_COLUMNS)} FROM calls").to_arrow_table()
    with pytest.raises(RuntimeError, match="^the calls view lists 2 calls of trainable rollout attempts, "
                                           "the calls files hold 1; "):
        merge_calls(rows.to_batches(), {**order, ("r1", 0, 7): (None, None)}, "exact", None)
    con.execute("SET file_search_path = ''")
    with pytest.raises(ValueError, match="^build_samples needs a connection from lgt.store.query.connect"):
        build_samples(con)


def test_an_empty_store_gives_an_empty_table_and_says_why(tmp_path: Path, tok: Tokenizer) -> None:
    (tmp_path / "empty").mkdir()
    b = build_samples(connect(write_store(tmp_path / "empty", [])))
    assert b.samples.num_rows == 0 and b.samples.schema == SAMPLES
    assert b.merge_breaks.num_rows == 0 and b.merge_breaks.schema == MERGE_BREAKS
    assert b.report["why_empty"] == "the store has no rollouts and no calls"

    agent = Agent(tok)
    calls = agent.run("r1", [Turn("hi", "hello.")]) + agent.run("r2", [Turn("hi", "", status="http_error")])
    b = build_samples(store_of(tmp_path, calls, rollouts=[rollout("r1", status="failed"), rollout("r2")],
                               rewards=[reward("r1", 1.0), reward("r2", 0.0)]))
    assert b.samples.num_rows == 0
    assert b.report["why_empty"] == ("none of the 2 rollout attempt(s) can be trained (1 failed, "
                                     "1 no_trainable_calls); their calls were excluded: 1 http_error")


def test_attempts_and_calls_only_rollouts(tmp_path: Path, tok: Tokenizer) -> None:
    agent = Agent(tok)
    calls = (agent.run("r1", [Turn("hi", "hello.")], attempt=0)
             + agent.run("r1", [Turn("hi", "hey.")], attempt=1)
             + agent.run("r2", [Turn("yo", "yes.")]))
    rollouts = [rollout("r1", "g", status="failed", attempt=0), rollout("r1", "g", attempt=1)]
    b = build_samples(store_of(tmp_path, calls, rollouts=rollouts,
                               rewards=[reward("r1", 1.0, None), reward("r2", 0.5)]))
    # the reward without an attempt goes to r1's latest attempt; r2 exists only in calls: its own group
    got = {r["sample_id"]: (r["group_id"], r["reward"]) for r in b.samples.to_pylist()}
    assert got == {"r1~1#0": ("g", 1.0), "r2~0#0": ("r2~0", 0.5)}
    assert b.merge_breaks.num_rows == 0


# --- a trainer's batch: some groups of a large store -------------------------------------------------

def groups_store(tmp_path: Path, tok: Tokenizer) -> Path:
    """Groups g0..g5 of three rollouts each, calls spread over 6 files (group k's calls in file k),
    plus r9, seen only in calls."""
    agent = Agent(tok)
    rng = random.Random(5)
    root = tmp_path / "store"
    rollouts, rewards = [], []
    for k in range(6):
        calls = []
        for j in range(3):
            rid = f"g{k}-r{j}"
            calls += agent.run(rid, [Turn(sentence(rng, 3), sentence(rng, 4) + "."),
                                     Turn(sentence(rng, 2), sentence(rng, 3) + ".", forget=j == 2)])
            rollouts.append(rollout(rid, f"g{k}"))
            rewards.append(reward(rid, rng.choice([0.0, 0.5, 1.0])))
        (root / "calls").mkdir(parents=True, exist_ok=True)
        write_parquet_atomic(to_arrow([call_row(c) for c in calls], "calls"),
                             root / "calls" / f"part-{k:03d}.parquet")
    calls = agent.run("r9", [Turn("hi", "hello.")])
    write_parquet_atomic(to_arrow([call_row(c) for c in calls], "calls"), root / "calls" / "part-009.parquet")
    rewards.append(reward("r9", 1.0))
    for table, items in (("rollouts", rollouts), ("rewards", rewards)):
        (root / table).mkdir(parents=True, exist_ok=True)
        write_parquet_atomic(to_arrow(items, table), root / table / "part-000.parquet")
    return root


def test_group_build_equals_the_whole_build_of_those_groups(tmp_path: Path, tok: Tokenizer) -> None:
    root = groups_store(tmp_path, tok)
    whole = {r["sample_id"]: r for r in build_samples(connect(root)).samples.to_pylist()}
    some = build_group_samples(root, ["g1", "g4", "r9~0", "nope"])
    got = {r["sample_id"]: r for r in some.samples.to_pylist()}
    assert {r["group_id"] for r in got.values()} == {"g1", "g4", "r9~0"}
    assert set(got) == {s for s, r in whole.items() if r["group_id"] in ("g1", "g4", "r9~0")}
    for sid, r in got.items():  # tokens, rewards, groups: as in the whole build
        assert r == whole[sid]
    assert sorted(b["rollout_id"] for b in some.merge_breaks.to_pylist()) == ["g1-r2", "g4-r2"]
    assert some.report["rollouts"] == {"trained": 7, "excluded": {}}


@pytest.mark.parametrize("chunk", [1, 4, 7, 100])
def test_a_streamed_build_is_the_whole_build_a_chunk_at_a_time(tmp_path: Path, tok: Tokenizer,
                                                               chunk: int) -> None:
    from lgt.trainer.rl.algorithm import AlgorithmConfig, assign

    root = groups_store(tmp_path, tok)
    whole = build_samples(connect(root))
    chunks = list(stream_samples(root, chunk_rollouts=chunk))
    assert len(chunks) == {1: 7, 4: 6, 7: 3, 100: 1}[chunk]  # whole groups of 3 (and r9 alone), never split
    got = pa.concat_tables([c.samples for c in chunks])
    assert sorted(got.to_pylist(), key=lambda r: r["sample_id"]) == \
        sorted(whole.samples.to_pylist(), key=lambda r: r["sample_id"])
    assert merge_reports([c.report for c in chunks]) == whole.report
    # the report's counts are its tables' (the summary and the report page show them, not the tables)
    reasons = Counter(whole.merge_breaks.column("reason").to_pylist())
    per_attempt = Counter(zip(whole.samples["rollout_id"].to_pylist(), whole.samples["attempt"].to_pylist()))
    assert reasons and whole.report["merge_breaks"] == dict(reasons)
    assert whole.report["samples_per_rollout"] == {str(k): n
                                                  for k, n in Counter(per_attempt.values()).items()}
    assert click.unstyle(render_build(merge_reports([c.report for c in chunks]))[0]).startswith(
        f"{whole.samples.num_rows} samples from {len(per_attempt)} rollout attempts")
    page = report_data(connect(root), merge_reports([c.report for c in chunks]))
    assert page["merge_breaks"] == sorted(reasons.items(), key=lambda kv: -kv[1])
    # the loss weights: each rollout once among all R, as if built whole
    cfg = AlgorithmConfig()
    r = trained_rollouts(root)
    assert r == len({(x["rollout_id"], x["attempt"]) for x in whole.samples.to_pylist()}) == 19
    want = {x["sample_id"]: x for x in assign(whole.samples, cfg).to_pylist()}
    for c in chunks:
        for x in assign(c.samples, cfg, rollouts=r).to_pylist():
            assert x["loss_weight"] == pytest.approx(want[x["sample_id"]]["loss_weight"], rel=1e-12)
            assert x["advantage"] == pytest.approx(want[x["sample_id"]]["advantage"], abs=1e-12)


def test_each_chunk_of_a_streamed_build_reads_only_its_files_and_no_index_is_kept(
        tmp_path: Path, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    from lgt.store import query
    from lgt.store import samples as samples_mod

    root = groups_store(tmp_path, tok)
    read: list[dict[str, list[str]]] = []
    real = samples_mod.connect

    def spy(store: Path, *args: Any, **kw: Any) -> Any:
        if kw.get("rollout_ids") is not None:
            read.append({t: [Path(f).name for f in fs] for t, fs in kw["files"].items()})
        return real(store, *args, **kw)

    monkeypatch.setattr(samples_mod, "connect", spy)
    query._SEEN.clear()
    chunks = list(stream_samples(root, chunk_rollouts=3))
    assert [sorted(c.samples["group_id"].unique().to_pylist()) for c in chunks] == \
        [[f"g{k}"] for k in range(6)] + [["r9~0"]]
    assert read == [{"calls": [f"part-{k:03d}.parquet"], "rollouts": ["part-000.parquet"],
                     "rewards": ["part-000.parquet"]} for k in range(6)] + \
        [{"calls": ["part-009.parquet"], "rewards": ["part-000.parquet"]}]
    assert not query._SEEN  # which file holds which rollout: planned in DuckDB, not kept per file in Python


def test_a_streamed_build_of_nothing_trainable_says_why(tmp_path: Path, tok: Tokenizer) -> None:
    agent = Agent(tok)
    calls = agent.run("r1", [Turn("hi", "hello.")]) + agent.run("r2", [Turn("hi", "", status="http_error")])
    con = store_of(tmp_path, calls, rollouts=[rollout("r1", "a", status="failed"), rollout("r2", "b")],
                   rewards=[reward("r1", 1.0), reward("r2", 0.0)])
    whole = build_samples(con)
    chunks = list(stream_samples(store_root(con), chunk_rollouts=1))
    assert len(chunks) == 2 and trained_rollouts(store_root(con)) == 0
    assert merge_reports([c.report for c in chunks]) == whole.report


def test_a_scoped_connection_sees_and_reads_only_its_rollouts(tmp_path: Path, tok: Tokenizer) -> None:
    root = groups_store(tmp_path, tok)
    con = connect(root, rollout_ids=["g2-r0", "g2-r1", "r9"])
    files = con.execute("SELECT getvariable('lgt_files_calls')").fetchall()[0][0]
    assert [Path(f).name for f in files] == ["part-002.parquet", "part-009.parquet"]
    for table in ("calls", "rollouts", "rewards"):
        seen = {r for (r,) in con.execute(f"SELECT DISTINCT rollout_id FROM {table}").fetchall()}
        assert seen == {"g2-r0", "g2-r1", "r9"}, table
    empty = connect(root, rollout_ids=[])
    assert empty.execute("SELECT count(*) FROM calls").fetchall() == [(0,)]
    assert build_samples(empty).samples.num_rows == 0
    # a file replaced by one that is not a calls file is named, though its rollouts are not asked for
    (root / "calls" / "part-005.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="part-005.parquet"):
        connect(root, rollout_ids=["g2-r0"])
