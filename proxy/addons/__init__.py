"""lgt's mitmproxy addons, one concern each, in the order ``server.py`` adds them (each hook runs in
that order; ``Answers`` to ``Record`` are sub-addons of one chain entry, ``server.LLMCalls``). An LLM
call is one :class:`~lgt.proxy.addons.state.Call` in ``flow.metadata``, each addon filling in its
part; what they all share is the :class:`Runtime`.

- :class:`Identify` — who is calling (proxy credentials, or the reverse-mode path); else 407/401.
- :class:`Rewards` — ``POST http://lgt.invalid/reward``: a rollout reports its own reward.
- ``CodexModels`` (``codex.py``) and :class:`Answers` — what the proxy answers itself: Codex's model
  catalogue, ``GET …/models``, token counts.
- :class:`Translate` — recognise an LLM call and read it as the engine's request (other APIs
  translated to chat/completions); 413/400 for what it cannot read.
- :class:`Hold` — the pause gate (hold, or 429), and 503 while the store cannot be written.
- :class:`Substitute` — the rollout's delivered prompt in place of the agent's.
- :class:`Route` — to the upstream, with its key, whatever host the agent aimed at.
- :class:`Deadlines` — ``--upstream-timeout``: the clock on the upstream's silence.
- :class:`Capture` — token ids and logprobs asked for, read from the answer (whole or streamed),
  stripped again or translated back to the agent's API; asked again without them when refused.
- :class:`Record` — one row per call, before the agent has all of its answer; refused calls too.
- ``ResponsesSocket`` (``wsbridge.py``) — the Responses API over WebSocket.
- :class:`Egress` — everything else: allow, an allowlist of hosts, or deny; each a row of ``egress``.
"""

from .answers import Answers
from .capture import Capture, StreamRewriter
from .deadline import Deadlines
from .egress import Egress
from .hold import Hold
from .identity import Identify
from .record import Record
from .rewards import Rewards
from .route import Route, Substitute
from .runtime import Conversations, Runtime
from .state import CALL, IDENT, NOTE_HEADER, REVERSE, ROUTED, SECRET_HEADERS, Call, agent_gone
from .translate import Translate

__all__ = ["CALL", "IDENT", "NOTE_HEADER", "REVERSE", "ROUTED", "SECRET_HEADERS", "Answers", "Call",
           "Capture", "Conversations", "Deadlines", "Egress", "Hold", "Identify", "Record", "Rewards",
           "Route", "Runtime", "StreamRewriter", "Substitute", "Translate", "agent_gone"]
