"""The teacher of on-policy distillation (:mod:`lgt.trainer.distill.opd`): its ``teacher:`` section
(:class:`TeacherSection`), the check that its tokenizer is the student's (:func:`tokenizer_mismatch`,
:func:`probe_mismatch`), and :class:`Teacher`, a second vLLM engine (started, or running at a URL) and the
client that asks it for the logprob of every token of the student's samples (:func:`prompt_logprobs_of`
reads its answer).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lgt.trainer.make_model import MakeModel
from lgt.trainer.serving.launch import EngineConfig, EngineError

SERVED_NAME = "teacher"  # the name a started teacher engine serves under
MAX_TOP_K = 100  # teacher.top_k's bound: each position's k logprobs travel as JSON
VLLM_MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
PAD_LOGPROB = -1e9  # a missing top-k entry (a vocabulary smaller than k): probability 0 after softmax
TopK = tuple[np.ndarray, np.ndarray]  # a sequence's teacher top-k: ids (L, k) int32, logprobs (L, k) float32


class TeacherError(RuntimeError):
    """The teacher could not score the batch; the message names why (and the engine's log)."""


@dataclass(frozen=True)
class TeacherSection:
    """The ``teacher:`` section of a run config (``algorithm.estimator: opd``).

    ``path``: the teacher's Hugging Face model directory (its tokenizer must be the student's), served
    by a second vLLM engine the run starts and stops; ``make``: build it there first when it does not
    exist (like ``model.make``); or ``url``: a running OpenAI-compatible vLLM engine serving the teacher
    (``model_name``: which of its models; default the only one). ``engine``: the started engine's
    settings (default: the run's ``engine`` section, with one more position of context, since the
    teacher is asked for one token after the longest sample). ``concurrency``: requests in flight at
    once; ``batch_sequences``: samples per request; ``timeout_s``: per request.

    ``top_k``: also ask for the teacher's ``top_k`` most likely tokens at every position (vLLM's
    ``prompt_logprobs: k``); the loss then adds, at each generated position, the cross-entropy from the
    teacher's top-k distribution (renormalised) to the student (weight ``algorithm.opd_top_k_coef``,
    :func:`lgt.trainer.rl.loss.top_k_kl`). 0: the sampled log-ratio only. More than vLLM's default of
    20 starts the teacher with ``--max-logprobs``.
    """

    path: Path | None = None
    make: MakeModel | None = None
    url: str | None = None
    model_name: str | None = None
    engine: EngineConfig | None = None
    concurrency: int = 4
    batch_sequences: int = 8
    timeout_s: float = 600.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.path is not None and self.url is not None:
            raise ValueError("teacher.path and teacher.url are both given: the teacher is either a model "
                             "directory the run serves or a running engine, not both")
        if self.path is None and self.url is None:
            raise ValueError("teacher.path (a model directory, optionally built with teacher.make) or "
                             "teacher.url (a running vLLM engine serving the teacher) is needed")
        if self.make is not None and self.path is None:
            raise ValueError("teacher.make builds the model at teacher.path: give the path too")
        if self.url is not None and not re.match(r"^https?://[^/\s]+(/v1)?/?$", self.url):
            raise ValueError(f"teacher.url {self.url!r} is not the http(s) base URL of a running engine "
                             "(e.g. http://127.0.0.1:8001/v1)")
        if self.engine is not None and self.engine.url is not None:
            raise ValueError("teacher.engine.url is not used: give a running teacher as teacher.url")
        if self.engine is not None and self.url is not None:
            raise ValueError("teacher.engine sets up an engine the run starts; with teacher.url it has none")
        for name in ("concurrency", "batch_sequences"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"teacher.{name} must be a whole number >= 1, not {v!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_K:
            raise ValueError(f"teacher.top_k must be a whole number from 0 (the sampled log-ratio only) to "
                             f"{MAX_TOP_K}, not {k!r}")
        t = self.timeout_s
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"teacher.timeout_s must be a positive number of seconds, not {t!r}")


# --- the tokenizer check --------------------------------------------------------------------------

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _special(tok_config: dict[str, Any], key: str) -> str | None:
    v = tok_config.get(key)
    return v.get("content") if isinstance(v, dict) else v if isinstance(v, str) else None


def _tokenizer_facts(model_dir: Path) -> dict[str, Any]:
    """What decides how text becomes ids: the vocabulary, merges, added tokens and special tokens."""
    facts: dict[str, Any] = {}
    tj = model_dir / "tokenizer.json"
    if tj.is_file():
        data = json.loads(tj.read_text(encoding="utf-8"))
        model = data.get("model") or {}
        vocab = model.get("vocab")
        facts["vocab"] = dict(vocab) if isinstance(vocab, dict) else \
            {(v[0] if isinstance(v, list) else str(v)): i for i, v in enumerate(vocab or [])}
        facts["merges"] = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges") or []]
        facts["added"] = {t.get("content"): t.get("id") for t in data.get("added_tokens") or []}
    else:
        for name in ("vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model", "vocab.txt"):
            if (model_dir / name).is_file():
                facts[name] = (model_dir / name).read_bytes()
    tc = model_dir / "tokenizer_config.json"
    tok_config = json.loads(tc.read_text(encoding="utf-8")) if tc.is_file() else {}
    for key in SPECIAL_KEYS:
        facts[key] = _special(tok_config, key)
    return facts


def tokenizer_mismatch(student_dir: Path, teacher_dir: Path) -> str | None:
    """One sentence saying how the teacher's tokenizer differs from the student's, or None when they
    turn text into the same ids (same vocabulary, merges, added and special tokens). Reads the
    tokenizer files only."""
    try:
        s, t = _tokenizer_facts(Path(student_dir)), _tokenizer_facts(Path(teacher_dir))
    except (OSError, ValueError) as e:
        return f"the teacher's or the student's tokenizer files could not be read ({e})"
    why = ("; the teacher scores the student's token ids, so it needs the student's tokenizer (a model of "
           "the same family)")
    head = f"the teacher {teacher_dir}'s tokenizer is not the student's ({student_dir})"
    for key in ("vocab", "added"):
        a, b = s.get(key), t.get(key)
        if a != b:
            if isinstance(a, dict) and isinstance(b, dict):
                diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
                token = diff[0]
                return (f"{head}: {len(diff)} {'vocabulary' if key == 'vocab' else 'added'} entries differ "
                        f"(e.g. {token!r}: {a.get(token)} in the student's, {b.get(token)} in the "
                        f"teacher's){why}")
            return f"{head}: their {key} differ{why}"
    for key in SPECIAL_KEYS:
        if s.get(key) != t.get(key):
            return f"{head}: its {key} is {t.get(key)!r}, the student's {s.get(key)!r}{why}"
    for key in sorted((s.keys() | t.keys()) - {"vocab", "added", *SPECIAL_KEYS}):
        if s.get(key) != t.get(key):
            return f"{head}: their {key} differ{why}"
    return None


PROBE_TEXT = " What is 47+38? The answer is 85.\n\t{\"x\": [1, 2]} Ünïcödé 日本語 — end"


def probe_mismatch(student_dir: Path, tokenize: Callable[[str], list[int]]) -> str | None:
    """For a teacher known only by its URL (no tokenizer files to compare): one sentence when the
    teacher's ``tokenize`` of a probe text (the student's added tokens, digits, code, accents, CJK)
    differs from the student's, else None."""
    from tokenizers import Tokenizer

    path = Path(student_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    added = [t.get("content", "") for t in data.get("added_tokens") or []]
    probe = "".join(added) + PROBE_TEXT
    mine = Tokenizer.from_file(str(path)).encode(probe, add_special_tokens=False).ids
    theirs = tokenize(probe)
    if mine == theirs:
        return None
    at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    return (f"the teacher's tokenizer is not the student's ({student_dir}): they turn the same text into "
            f"other ids (from token {at} on); the teacher scores the student's token ids, so it needs the "
            "student's tokenizer (a model of the same family)")


# --- its answer -----------------------------------------------------------------------------------

def prompt_logprobs_of(entries: Sequence[dict[str, Any] | None], ids: Sequence[int]) -> np.ndarray:
    """vLLM's ``prompt_logprobs`` of a completion whose prompt was ``ids`` as a float32 array aligned with
    ``ids``: entry i is the logprob of ``ids[i]`` given ``ids[:i]``; entry 0 (nothing before it) is 0.
    Each entry maps token ids (as strings) to ``{"logprob": …}``; the prompt's own token is always one
    of them. TeacherError when the answer does not fit ``ids``."""
    if len(entries) != len(ids):
        raise TeacherError(f"the teacher returned {len(entries)} prompt logprobs for a sequence of "
                           f"{len(ids)} tokens")
    out = np.zeros(len(ids), np.float32)
    for i in range(1, len(ids)):
        entry = entries[i] or {}
        hit = entry.get(str(ids[i]))
        if hit is None:
            raise TeacherError(f"the teacher's prompt logprobs at position {i} do not name the token there "
                               f"({ids[i]})")
        out[i] = float(hit["logprob"] if isinstance(hit, dict) else hit)
    return out


def prompt_top_k_of(entries: Sequence[dict[str, Any] | None], ids: Sequence[int], k: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The teacher's ``k`` most likely tokens at every position of ``ids`` from vLLM's ``prompt_logprobs``
    (asked with ``k``: each entry holds the top k and the prompt's own token): ``(ids (L, k) int32,
    logprobs (L, k) float32)``, most likely first; row 0 (nothing before it) is zeros. An entry with
    fewer than k tokens is padded with :data:`PAD_LOGPROB`. Call after :func:`prompt_logprobs_of`."""
    top_ids = np.zeros((len(ids), k), np.int32)
    top_lps = np.zeros((len(ids), k), np.float32)
    for i in range(1, len(ids)):
        ranked = sorted(((float(v["logprob"] if isinstance(v, dict) else v), int(t))
                         for t, v in (entries[i] or {}).items()), key=lambda x: -x[0])[:k]
        top_lps[i] = PAD_LOGPROB
        top_ids[i] = ids[i]
        for j, (lp, t) in enumerate(ranked):
            top_ids[i, j], top_lps[i, j] = t, lp
    return top_ids, top_lps


def chunks(n: int, size: int) -> list[range]:
    """``range(n)`` cut into consecutive ranges of at most ``size``."""
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


# --- the teacher engine and its client -------------------------------------------------------------

@dataclass
class Scored:
    """One batch scored: each sequence's logprobs (aligned with its ids, entry 0 is 0), the wall time,
    the tokens sent and the requests made; with ``top_k``, each sequence's top-k ids and logprobs
    ((L, k) each, :func:`prompt_top_k_of`)."""

    logprobs: list[np.ndarray]
    seconds: float
    tokens: int
    requests: int
    top: tuple[list[np.ndarray], list[np.ndarray]] | None = None

    def metrics(self) -> dict[str, float]:
        return {"teacher/seconds": round(self.seconds, 4), "teacher/tokens": float(self.tokens),
                "teacher/requests": float(self.requests)}


REQUEST_TRIES = 3  # a scoring request dropped by the network (a reset connection) is sent again


class Teacher:
    """The teacher: an engine this run started (``engine``, restarted when it dies, at most ``restarts``
    times) or one at a URL; :meth:`score` asks it for the logprobs of sequences of token ids."""

    def __init__(self, section: TeacherSection, base_url: str, model_name: str, *, engine: Any = None,
                 restarts: int = 0, log: Callable[[str], None] = lambda line: None) -> None:
        import httpx

        self.section = section
        self.base_url = base_url.rstrip("/")  # …/v1
        self.model_name = model_name
        self.engine = engine
        self.max_restarts = restarts
        self.restarts = 0
        self.log = log
        self.total_seconds = 0.0
        self.total_tokens = 0
        self.total_requests = 0
        self._client = httpx.Client(trust_env=False, timeout=section.timeout_s,
                                    limits=httpx.Limits(max_connections=section.concurrency))

    @classmethod
    def start(cls, section: TeacherSection, model_dir: Path, engine: EngineConfig, *, log_path: Path,
              seed: int | None, restarts: int, log: Callable[[str], None]) -> Teacher:
        """A second vLLM engine serving ``model_dir`` (``section.engine``, else ``engine`` — the student's —
        with one more position of context)."""
        from lgt.trainer.serving.engine import Engine

        cfg = section.engine or dataclasses.replace(
            engine, max_model_len=engine.max_model_len + 1 if engine.max_model_len else None)
        cfg = dataclasses.replace(cfg, model=model_dir, served_model_name=SERVED_NAME, log_path=log_path,
                                  seed=seed, url=None, port=0)
        if section.top_k > VLLM_MAX_LOGPROBS and "--max-logprobs" not in cfg.extra_args:
            cfg = dataclasses.replace(cfg, extra_args=(*cfg.extra_args, "--max-logprobs", str(section.top_k)))
        log(f"starting the teacher's vLLM engine on {model_dir.name} ...")
        eng = Engine.start(cfg)  # warmed up as it starts: the first scoring request pays no compile
        return cls(section, eng.url, SERVED_NAME, engine=eng, restarts=restarts, log=log)

    @classmethod
    def attach(cls, section: TeacherSection, log: Callable[[str], None]) -> Teacher:
        """The running engine at ``section.url``; TeacherError (one sentence) when it does not answer or
        does not serve ``section.model_name``."""
        import httpx

        base = re.sub(r"(/v1)?/?$", "", section.url or "") + "/v1"
        try:
            cards = httpx.get(f"{base}/models", trust_env=False, timeout=10.0).json().get("data") or []
        except (httpx.HTTPError, ValueError, AttributeError):
            raise TeacherError(f"the teacher at {section.url} (teacher.url) does not answer GET /v1/models: "
                               "start it first, or give teacher.path for the run to start one") from None
        names = [str(c.get("id")) for c in cards if isinstance(c, dict)]
        if section.model_name is None and len(names) != 1:
            raise TeacherError(f"the teacher at {section.url} serves {', '.join(names) or 'nothing'}: name "
                               "the teacher's model with teacher.model_name")
        name = section.model_name or names[0]
        if name not in names:
            raise TeacherError(f"the teacher at {section.url} serves {', '.join(names) or 'nothing'}, not "
                               f"{name!r} (teacher.model_name)")
        log(f"using the teacher at {section.url} ({name})")
        return cls(section, base, name, log=log)

    def tokenize(self, text: str) -> list[int]:
        """The teacher engine's ids for ``text`` (vLLM's ``POST /tokenize``, no special tokens added)."""
        import httpx

        root = re.sub(r"/v1/?$", "", self.base_url)
        try:
            resp = self._client.post(f"{root}/tokenize", json={"model": self.model_name, "prompt": text,
                                                               "add_special_tokens": False})
            resp.raise_for_status()
            return [int(t) for t in resp.json()["tokens"]]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            raise TeacherError(f"the teacher at {self.base_url} could not tokenize a probe text to compare "
                               f"its tokenizer with the student's ({e})") from None

    # -- scoring

    def _request(self, seqs: list[list[int]]) -> list[tuple[np.ndarray, TopK | None]]:
        import httpx

        k = self.section.top_k
        body = {"model": self.model_name, "prompt": seqs, "max_tokens": 1, "prompt_logprobs": k,
                "temperature": 1.0}
        def post() -> Any:
            return self._client.post(f"{self.base_url}/completions", json=body)

        for attempt in range(1, REQUEST_TRIES + 1):
            try:  # a started engine is watched while it scores: one shutting down is not waited on
                resp = post() if self.engine is None else self.engine.watch(post, "POST /v1/completions")
                break
            except (httpx.NetworkError, httpx.RemoteProtocolError) as e:
                # a kept-alive connection the server closed as it was reused, a reset: asking again
                # is safe (scoring changes nothing); a timeout is not asked again
                if attempt == REQUEST_TRIES:
                    raise TeacherError(f"the teacher at {self.base_url} did not answer: {e} ({attempt} "
                                       f"tries){self._log_hint()}") from e
                time.sleep(0.2 * attempt)
            except (httpx.HTTPError, EngineError) as e:  # EngineError: killed while it held the request
                raise TeacherError(f"the teacher at {self.base_url} did not answer: {e}"
                                   f"{self._log_hint()}") from e
        if resp.status_code >= 400:
            raise TeacherError(f"the teacher answered {resp.status_code}: {resp.text[:300]}"
                               f"{self._log_hint()}")
        choices = sorted(resp.json().get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != len(seqs):
            raise TeacherError(f"the teacher answered {len(choices)} choices for {len(seqs)} sequences")
        out = []
        for c, s in zip(choices, seqs):
            entries = c.get("prompt_logprobs") or []
            out.append((prompt_logprobs_of(entries, s), prompt_top_k_of(entries, s, k) if k else None))
        return out

    def _log_hint(self) -> str:
        path = getattr(self.engine, "log_path", None)
        return f" (its log: {path})" if path else ""

    def _score_once(self, seqs: list[list[int]]) -> list[tuple[np.ndarray, TopK | None]]:
        parts = chunks(len(seqs), self.section.batch_sequences)
        out: list[tuple[np.ndarray, TopK | None]] = [(np.zeros(0, np.float32), None)] * len(seqs)
        with concurrent.futures.ThreadPoolExecutor(self.section.concurrency) as pool:
            futures = {pool.submit(self._request, [seqs[i] for i in r]): r for r in parts}
            for fut in concurrent.futures.as_completed(futures):
                for i, scored in zip(futures[fut], fut.result()):
                    out[i] = scored
        return out

    def score(self, seqs: Sequence[Sequence[int]]) -> Scored:
        """The teacher's logprob of every token of every sequence (``batch_sequences`` sequences per
        request, ``concurrency`` requests at once). A started engine that died is started again (at most
        ``restarts`` times in the run) and the batch asked again; otherwise TeacherError."""
        seqs = [[int(t) for t in s] for s in seqs]
        t0 = time.monotonic()
        self.keep_alive()
        try:
            lps = self._score_once(seqs)
        except TeacherError:
            if self.engine is None or not self.engine.await_exit():  # a dying one exits in seconds
                raise
            self.keep_alive()
            lps = self._score_once(seqs)
        top = ([t[0] for _, t in lps], [t[1] for _, t in lps]) if self.section.top_k else None
        scored = Scored([lp for lp, _ in lps], time.monotonic() - t0, sum(len(s) for s in seqs),
                        len(chunks(len(seqs), self.section.batch_sequences)), top)
        self.total_seconds += scored.seconds
        self.total_tokens += scored.tokens
        self.total_requests += scored.requests
        return scored

    # -- life

    def keep_alive(self) -> None:
        """A started engine that died is started again on its port (TeacherError once ``restarts`` are
        spent); nothing for a teacher at a URL."""
        from lgt.trainer.serving.engine import Engine

        if self.engine is None:
            return
        try:
            self.engine.check_alive()
            return
        except EngineError as e:
            first = str(e).splitlines()[0].split("; its log")[0]
            if self.restarts >= self.max_restarts:
                raise TeacherError(f"the teacher's engine died ({first}; its log: {self.engine.log_path}) "
                                   f"and was restarted {self.restarts} times already (restarts: "
                                   f"{self.max_restarts}); resume the run with --resume once the cause is "
                                   "fixed") from None
            self.restarts += 1
            self.log(f"the teacher's engine died ({first}); starting it again "
                     f"(restart {self.restarts} of {self.max_restarts})")
        old = self.engine
        old.stop(5)
        self.engine = Engine.start(dataclasses.replace(old.cfg, port=old.port))
        self.base_url = self.engine.url

    def totals(self) -> dict[str, float]:
        return {"seconds": round(self.total_seconds, 3), "tokens": self.total_tokens,
                "requests": self.total_requests}

    def stop(self) -> None:
        self._client.close()
        if self.engine is not None:
            self.engine.stop()
