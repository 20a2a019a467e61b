"""Automatic prompt optimisation (``lgt-train apo``): a prompt resource rewritten from traces and rewards.

The ``beam`` optimiser, the published method's shape: each round, for every prompt in the beam, a batch
of training tasks is run with it (real rollouts through the same controller, proxy and store as RL), a
critic reads the prompt with its worst and best traces and their rewards and writes a critique, then
rewrites the prompt ``branch_factor`` times; every new prompt is scored on the validation tasks, and the
``beam_width`` best by validation reward go on. A rewrite that drops one of the template's
placeholders, an empty or unusable answer, or a critic that times out costs that one candidate, never
the run.

The critic is any OpenAI-compatible chat endpoint (``apo.critic: {base_url, model, api_key_env}``), by
default the policy's own engine. Everything is appended to ``<run>/apo/candidates.jsonl`` as it happens
(each candidate, each score), so ``--resume`` continues without scoring a finished candidate again;
``<run>/apo/best_prompt.txt`` is the best prompt, ``<run>/apo/rounds.svg`` the reward per round.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lgt.trainer.rollout.resources import Resources, check_rewrite, placeholders

OPTIMIZERS = ("beam", "gepa")
TRACES_SHOWN = 2  # worst and best rollouts the critic reads, each
CRITIQUE = """You improve the instructions (the prompt) an AI agent is given.

The current prompt:
<prompt>
{prompt}
</prompt>

Rollouts with this prompt, worst first (reward 0 is a failure, 1 a success):
{traces}

CRITIQUE: in a few sentences, say what in the prompt made the worst rollouts fail and what the best did
right. Do not rewrite the prompt yet."""
REWRITE = """You improve the instructions (the prompt) an AI agent is given.

The current prompt:
<prompt>
{prompt}
</prompt>

A critique of it:
{critique}

REWRITE the prompt to fix what the critique says (variant {variant}). Keep every placeholder in braces,
such as {placeholders}, exactly as written. Answer with the new prompt only, between <prompt> and
</prompt>."""


@dataclass(frozen=True)
class CriticConfig:
    base_url: str | None = None  # an OpenAI-compatible /v1 URL; null: the policy's own engine
    model: str | None = None  # null: the policy (engine.served_model_name) on its own engine

    def __post_init__(self) -> None:
        if self.base_url is not None and self.model is None:
            raise ValueError("apo.critic.model is required with apo.critic.base_url: the model that "
                             "endpoint serves")
    api_key_env: str | None = None  # the variable holding its API key
    timeout_s: float = 120.0
    max_tokens: int = 512
    temperature: float = 0.7


@dataclass(frozen=True)
class ApoConfig:
    """The ``apo`` section of a run config."""

    resource: str = "system_prompt"  # which of the run's resources is optimised
    optimizer: str = "beam"
    rounds: int = 3
    beam_width: int = 2
    branch_factor: int = 2
    batch_size: int = 8  # training tasks per critique
    val_size: int = 16  # validation tasks per score (the held-out split when the run has one)
    samples: int = 1  # rollouts per task
    target_reward: float | None = None  # stop once a candidate's validation reward reaches it
    max_rollouts: int | None = None  # gepa's budget; default: what the beam search could spend
    critic: CriticConfig = field(default_factory=CriticConfig)

    def budget(self, val: int) -> int:
        """Rollouts a search may spend: ``max_rollouts``, or the beam search's worst case."""
        if self.max_rollouts is not None:
            return self.max_rollouts
        per_round = self.beam_width * (self.batch_size + self.branch_factor * min(self.val_size, val))
        return self.samples * (min(self.val_size, val) + self.rounds * per_round)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"apo.optimizer must be one of {', '.join(OPTIMIZERS)}, not {self.optimizer!r}")
        for name in ("rounds", "beam_width", "branch_factor", "batch_size", "val_size", "samples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"apo.{name} must be a whole number ≥ 1, not {v!r}")


# -- the critic -------------------------------------------------------------------------------------------

class Critic:
    """One chat call per question; None for an answer that cannot be used (an error, a timeout,
    nothing said), which costs the caller one candidate."""

    def __init__(self, cfg: CriticConfig, default_base_url: str | None = None,
                 default_model: str = "policy") -> None:
        import os

        self.cfg = cfg
        self.base_url = (cfg.base_url or default_base_url or "").rstrip("/")
        self.model = cfg.model or default_model  # the policy's served name on its own engine
        self.api_key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
        self.calls = self.failures = 0

    def ask(self, prompt: str) -> str | None:
        import httpx

        self.calls += 1
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = httpx.post(f"{self.base_url}/chat/completions", headers=headers, trust_env=False,
                           timeout=self.cfg.timeout_s,
                           json={"model": self.model, "max_tokens": self.cfg.max_tokens,
                                 "temperature": self.cfg.temperature,
                                 "messages": [{"role": "user", "content": prompt}]})
            r.raise_for_status()
            text = r.json()["choices"][0]["message"]["content"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            self.failures += 1
            return None
        if not isinstance(text, str) or not text.strip():
            self.failures += 1
            return None
        return text.strip()


def extract_prompt(answer: str) -> str | None:
    """The text between <prompt> and </prompt> (or the whole answer when it has no tags)."""
    if "<prompt>" in answer:
        inner = answer.split("<prompt>", 1)[1].split("</prompt>", 1)[0].strip()
        return inner or None
    return answer.strip() or None


# -- the record -----------------------------------------------------------------------------------------

class Ledger:
    """``<run>/apo/candidates.jsonl``: candidates and their scores, appended as they happen."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "apo" / "candidates.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    self.rows.append(json.loads(line))
                except ValueError:  # a line cut by a crash
                    continue

    def add(self, **row: Any) -> None:
        row["at"] = round(time.time(), 3)
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    def candidates(self) -> dict[str, dict[str, Any]]:
        """version -> {version, text, parent, round, key, train_reward, val_reward}."""
        out: dict[str, dict[str, Any]] = {}
        for r in self.rows:
            if r["event"] == "candidate":
                out.setdefault(r["version"], {**r, "train_reward": None, "val_reward": None})
            elif r["event"] == "score" and r["version"] in out:
                out[r["version"]][f"{r['split']}_reward"] = r["reward"]
        return out

    def done(self, key: str) -> bool:
        """Whether the step ``key`` (a critique or a rewrite) was done before a restart."""
        return any(r.get("key") == key for r in self.rows)

    def beam(self, rnd: int) -> list[str] | None:
        return next((r["beam"] for r in self.rows if r["event"] == "round" and r["round"] == rnd), None)

    def critique(self, key: str) -> str | None:
        return next((r["text"] for r in self.rows if r["event"] == "critique" and r["key"] == key), None)


# -- the optimiser ---------------------------------------------------------------------------------------

Runner = Callable[[Resources, Sequence[Mapping[str, Any]], str], Any]  # async: -> [(reward, trace)]


async def beam(cfg: ApoConfig, start: Resources, run: Runner, train: Sequence[Mapping[str, Any]],
               val: Sequence[Mapping[str, Any]], critic: Critic, run_dir: Path,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """The beam search (see the module docstring); returns the best candidate's row."""
    ledger = Ledger(run_dir)
    name = cfg.resource
    if start.version not in ledger.candidates():
        ledger.add(event="candidate", version=start.version, text=start.texts[name], parent=None, round=0,
                   key="seed")
    texts = {c["version"]: c["text"] for c in ledger.candidates().values()}

    def resources_of(version: str) -> Resources:
        return start.with_texts({**start.texts, name: texts[version]})

    async def score(version: str, split: str, tasks: Sequence[Mapping[str, Any]], tag: str) -> float:
        results = await run(resources_of(version), tasks, tag)
        rewards = [r for r, _ in results if r is not None]
        value = sum(rewards) / len(results) if results else 0.0  # a failed rollout counts 0 here
        ledger.add(event="score", version=version, split=split, reward=value, n=len(results))
        log(f"apo: {version} {split} reward {value:.3f} ({len(results)} rollouts)")
        return value

    for c in list(ledger.candidates().values()):  # candidates made before a restart, never scored
        if c["val_reward"] is None:
            await score(c["version"], "val", val, f"v{c['round']}")
    for rnd in range(1, cfg.rounds + 1):
        cands = ledger.candidates()
        best_val = max(c["val_reward"] for c in cands.values())
        if cfg.target_reward is not None and best_val >= cfg.target_reward:
            log(f"apo: validation reward {best_val:.3f} reached the target {cfg.target_reward}")
            break
        beam_now = ledger.beam(rnd)  # a round begun before a restart keeps its beam
        if beam_now is None:
            ranked = sorted(cands.values(), key=lambda c: (-c["val_reward"], c["round"]))
            beam_now = [c["version"] for c in ranked[:cfg.beam_width]]
            ledger.add(event="round", round=rnd, beam=beam_now)
        for pv in beam_now:
            batch = random.Random(f"{rnd}:{pv}").sample(list(train), min(cfg.batch_size, len(train)))
            ckey = f"critique:{rnd}:{pv}"
            critique = ledger.critique(ckey)
            if critique is None and not all(ledger.done(f"rewrite:{rnd}:{pv}:{b}")
                                            for b in range(cfg.branch_factor)):
                results = await run(resources_of(pv), batch, f"t{rnd}")
                rewards = [r if r is not None else 0.0 for r, _ in results]
                ledger.add(event="score", version=pv, split="train", n=len(rewards), round=rnd,
                           reward=sum(rewards) / max(len(rewards), 1))
                order = sorted(range(len(results)), key=lambda i: rewards[i])
                worst = order[:TRACES_SHOWN]
                shown = worst + [i for i in order[-TRACES_SHOWN:] if i not in worst]
                traces = "\n\n".join(f"--- reward {rewards[i]:.2f}\n{results[i][1]}" for i in shown)
                question = CRITIQUE.format(prompt=texts[pv], traces=traces)
                critique = await asyncio.to_thread(critic.ask, question)
                ledger.add(event="critique", key=ckey, version=pv, round=rnd, text=critique)
            for b in range(cfg.branch_factor):
                rkey = f"rewrite:{rnd}:{pv}:{b}"
                if ledger.done(rkey):
                    continue
                new = None
                if critique:
                    holders = ", ".join("{" + p + "}" for p in sorted(placeholders(texts[pv]))) or "none"
                    answer = await asyncio.to_thread(critic.ask, REWRITE.format(
                        prompt=texts[pv], critique=critique, variant=b + 1, placeholders=holders))
                    new = extract_prompt(answer) if answer else None
                why = "the critic gave no usable answer" if new is None else None
                if new is not None:
                    try:
                        check_rewrite(texts[pv], new)
                    except ValueError as e:
                        why = str(e)
                if why is not None:
                    ledger.add(event="rejected", key=rkey, parent=pv, round=rnd, reason=why)
                    log(f"apo: round {rnd}: a rewrite of {pv} was rejected: {why}")
                    continue
                version = resources_of(pv).with_texts({**start.texts, name: new}).version
                texts[version] = new
                if version not in ledger.candidates():
                    ledger.add(event="candidate", key=rkey, version=version, text=new, parent=pv, round=rnd)
                    await score(version, "val", val, f"v{rnd}")
                else:
                    ledger.add(event="duplicate", key=rkey, version=version, parent=pv, round=rnd)
    cands = ledger.candidates()
    best = max(cands.values(), key=lambda c: (c["val_reward"], -c["round"]))
    (Path(run_dir) / "apo" / "best_prompt.txt").write_text(best["text"])
    return best


async def gepa_search(cfg: ApoConfig, start: Resources, run: Runner, train: Sequence[Mapping[str, Any]],
                      val: Sequence[Mapping[str, Any]], critic: Critic, run_dir: Path,
                      log: Callable[[str], None] = print) -> dict[str, Any]:
    """GEPA's reflective Pareto search (the ``gepa`` library) with lgt rollouts: an adapter scores its
    candidates by real rollouts and builds its reflective dataset from their traces; the critic is its
    reflection model. Candidates and scores go to the same ``candidates.jsonl``; GEPA keeps its own
    state in ``apo/gepa`` (``--resume`` continues from it)."""
    import gepa
    from gepa.core.adapter import EvaluationBatch

    loop = asyncio.get_running_loop()
    ledger = Ledger(run_dir)
    name = cfg.resource
    val_ids = {id(t) for t in val}
    order: dict[str, int] = {c["version"]: c["round"] for c in ledger.candidates().values()}

    class Adapter:
        propose_new_texts = None  # GEPA's own proposer, with the critic as its reflection model

        def evaluate(self, batch: list[Any], candidate: dict[str, str], capture_traces: bool = False) -> Any:
            text = candidate[name]
            split = "val" if len(batch) == len(val) and all(id(t) in val_ids for t in batch) else "train"
            try:
                res = start.with_texts({**start.texts, name: text})
            except ValueError as e:  # a placeholder lost: this candidate scores nothing
                ledger.add(event="rejected", key=f"gepa:{len(ledger.rows)}", reason=str(e), text=text)
                traj = [{"task": t, "trace": f"rejected: {e}", "reward": 0.0} for t in batch]
                return EvaluationBatch(outputs=[""] * len(batch), scores=[0.0] * len(batch),
                                       trajectories=traj if capture_traces else None)
            if res.version not in order:
                order[res.version] = len(order)
                ledger.add(event="candidate", key=f"gepa:{res.version}", version=res.version, text=text,
                           parent=None, round=order[res.version])
            results = asyncio.run_coroutine_threadsafe(run(res, batch, "g"), loop).result()
            scores = [r if r is not None else 0.0 for r, _ in results]
            ledger.add(event="score", version=res.version, split=split, n=len(scores),
                       reward=sum(scores) / max(len(scores), 1))
            traj = [{"task": t, "trace": tr, "reward": sc} for t, (_, tr), sc in zip(batch, results, scores)]
            return EvaluationBatch(outputs=[tr for _, tr in results], scores=scores,
                                   trajectories=traj if capture_traces else None)

        def make_reflective_dataset(self, candidate: dict[str, str], eval_batch: Any,
                                    components_to_update: list[str]) -> dict[str, list[dict[str, Any]]]:
            records = [{"Inputs": {"task": json.dumps(dict(t["task"]), ensure_ascii=False)[:600]},
                        "Generated Outputs": t["trace"],
                        "Feedback": f"reward {t['reward']:.2f} (1 is a success, 0 a failure)"}
                       for t in eval_batch.trajectories or ()]
            return {c: records for c in components_to_update}

    class Logger:
        def log(self, message: str) -> None:
            log(f"apo (gepa): {message}")

    def reflect(prompt: Any) -> str:
        return critic.ask(prompt if isinstance(prompt, str) else json.dumps(prompt)) or ""

    def reached(state: Any) -> bool:  # apo.target_reward: stop as the beam search does
        scores = state.program_full_scores_val_set
        return cfg.target_reward is not None and bool(scores) and max(scores) >= cfg.target_reward

    result = await asyncio.to_thread(
        gepa.optimize, stop_callbacks=[reached], seed_candidate={name: start.texts[name]},
        trainset=list(train), valset=list(val),
        adapter=Adapter(), reflection_lm=reflect, max_metric_calls=cfg.budget(len(val)),
        reflection_minibatch_size=min(cfg.batch_size, len(train)), seed=0, logger=Logger(),
        run_dir=str(Path(run_dir) / "apo" / "gepa"), raise_on_exception=False, display_progress_bar=False)
    text = result.best_candidate[name]
    version = start.with_texts({**start.texts, name: text}).version
    (Path(run_dir) / "apo" / "best_prompt.txt").write_text(text)
    best = ledger.candidates().get(version) or {"version": version, "text": text, "round": 0, "parent": None}
    return {**best, "val_reward": float(result.val_aggregate_scores[result.best_idx])}


async def optimize(cfg: ApoConfig, start: Resources, run: Runner, train: Sequence[Mapping[str, Any]],
                   val: Sequence[Mapping[str, Any]], critic: Critic, run_dir: Path,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """The configured optimiser (``beam`` or ``gepa``)."""
    search = beam if cfg.optimizer == "beam" else gepa_search
    return await search(cfg, start, run, train, val, critic, run_dir, log)


def table(run_dir: Path) -> list[dict[str, Any]]:
    """The candidates (version, round, parent, train and validation reward, text), best first."""
    rows = list(Ledger(run_dir).candidates().values())
    return sorted(rows, key=lambda c: (-(c["val_reward"] or 0), c["round"]))


def make_runner(controller: Any, store: Path, samples: int = 1) -> Runner:
    """Rollouts through ``controller`` with the given resources; each one's reward and its trace (the
    conversation of its last model call, from the store), as the critic reads them."""
    from lgt.store.query import connect

    counter = {"n": 0}

    async def run(res: Resources, tasks: Sequence[Mapping[str, Any]], tag: str) -> list[tuple[Any, str]]:
        controller.resources = res
        counter["n"] += 1
        jobs = [(t, f"apo-{tag}-{res.version}-{counter['n']}-{i}-{k}")
                for i, t in enumerate(tasks) for k in range(samples)]
        results = await asyncio.gather(*(controller.run(t, rid, f"apo-{tag}", None, split="eval")
                                         for t, rid in jobs))
        for p in controller.proxies:
            await asyncio.to_thread(p.api.flush)
        await asyncio.to_thread(controller.flush_records)
        con = connect(store, rollout_ids=[rid for _, rid in jobs])
        try:
            last = {rid: (req, resp) for rid, req, resp in con.execute(
                "SELECT rollout_id, arg_max(request_json, seq), arg_max(response_json, seq) FROM calls "
                "GROUP BY 1").fetchall()}
        finally:
            con.close()
        out = []
        for (task, rid), r in zip(jobs, results):
            req, resp = last.get(rid, (None, None))
            out.append((r.reward if r.ok else None, _trace(task, req, resp, r)))
        return out

    return run


def _trace(task: Mapping[str, Any], request_json: str | None, response_json: str | None, result: Any) -> str:
    """What the critic reads of one rollout: the task, the last exchange with the model, the outcome."""
    lines = [f"task: {json.dumps(dict(task), ensure_ascii=False)[:600]}"]
    try:
        msgs = json.loads(request_json)["messages"] if request_json else []
        lines += [f"{m.get('role')}: {str(m.get('content'))[:600]}" for m in msgs[-3:] if isinstance(m, dict)]
        reply = json.loads(response_json)["choices"][0]["message"]["content"] if response_json else None
        lines.append(f"assistant: {str(reply)[:600]}")
    except (ValueError, KeyError, IndexError, TypeError):
        pass
    if not result.ok:
        lines.append(f"the rollout {result.status}: {result.error}")
    return "\n".join(lines)


def plot(run_dir: Path) -> Path:
    """``<run>/apo/rounds.svg``: each candidate's validation reward by the round it was made in, and the
    best so far."""
    from lgt.store.files import write_atomic
    from lgt.trainer.report.plots import Series, line_chart

    cands = sorted(Ledger(run_dir).candidates().values(), key=lambda c: c["round"])
    scored = [(float(c["round"]), float(c["val_reward"])) for c in cands if c["val_reward"] is not None]
    best, top = [], float("-inf")
    for rnd in sorted({x for x, _ in scored}):
        top = max([top, *(y for x, y in scored if x == rnd)])
        best.append((rnd, top))
    svg = line_chart("Prompt optimisation: validation reward per round",
                     [Series("candidates", scored, "#4c78a8", width=0, marker=3),
                      Series("best so far", best, "#e45756", marker=2)],
                     y_label="validation reward", x_label="round", include_y=(0.0, 1.0),
                     empty="no candidate scored yet")
    path = Path(run_dir) / "apo" / "rounds.svg"
    write_atomic(path, svg)
    return path


def write_report(run_dir: Path) -> Path:
    """``<run>/report.html`` for an ``lgt-train apo`` run: the reward per round, the candidates, the best
    prompt."""
    import html

    run_dir = Path(run_dir)
    svg_path = run_dir / "apo" / "rounds.svg"
    svg = svg_path.read_text() if svg_path.exists() else ""
    rows = table(run_dir)
    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    cells = "".join(
        f"<tr><td><code>{c['version']}</code></td><td>{c['round']}</td>"
        f"<td><code>{c['parent'] or '-'}</code></td><td>{num(c['train_reward'])}</td>"
        f"<td>{num(c['val_reward'])}</td><td><pre>{html.escape(c['text'])}</pre></td></tr>" for c in rows)
    best = rows[0]["text"] if rows else ""
    title = f"{html.escape(run_dir.name)}: prompt optimisation"
    page = (f"<!doctype html><meta charset=utf-8><title>{title}</title>"
            "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}td,th{padding:4px 8px;"
            "vertical-align:top;border-bottom:1px solid #ddd}pre{white-space:pre-wrap;margin:0}</style>"
            f"<h1>{html.escape(run_dir.name)}</h1><h2>Prompt optimisation</h2>{svg}"
            f"<h3>Best prompt</h3><pre>{html.escape(best)}</pre><h3>Candidates (best first)</h3>"
            "<table><tr><th>version</th><th>round</th><th>parent</th><th>train</th><th>validation</th>"
            f"<th>text</th></tr>{cells}</table>")
    path = run_dir / "report.html"
    path.write_text(page)
    return path
