"""A scripted critic for lgt-train apo's tests and bench: an OpenAI-compatible chat endpoint on 127.0.0.1
with deterministic answers. A critique request gets one fixed critique; each rewrite request (lgt's beam
prompt or GEPA's reflection prompt) gets the current prompt plus the next of :data:`RULES` — among them
an empty answer, one that drops the ``{question}`` placeholder, and one slower than a 0.5 s timeout.
The agent of these tests (agents/prompt_agent.py) earns reward 1 only with "Answer in one word.".
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SEED = "Solve {question}."
# the rewrites, in order: "" is an empty answer, DROP loses {question}, SLOW answers after 2 s
RULES = ["Be polite.", "DROP", "Use metric units.", "", "SLOW", "Answer in one word."]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        question = body["messages"][-1]["content"]
        gepa = "Provide the new instructions within ``` blocks" in question  # GEPA's reflection prompt
        if "CRITIQUE:" in question:
            text = "The prompt never says how the answer should look."
        else:
            current = re.search(r"for me:\n```\n(.*?)\n```" if gepa else r"<prompt>\n(.*?)\n</prompt>",
                                question, re.S)[1]
            with self.server.lock:
                rule = RULES[self.server.rewrites % len(RULES)]
                self.server.rewrites += 1
            if rule == "SLOW":
                time.sleep(2)
            new = current.replace("{question}", "it") if rule == "DROP" else f"{current} {rule}"
            text = "" if rule == "" else (f"```\n{new}\n```" if gepa else f"<prompt>{new}</prompt>")
        out = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out.encode())
        except BrokenPipeError:  # the SLOW answer: the critic gave up first
            pass

    def log_message(self, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    rewrites = 0
    lock = threading.Lock()


class ScriptedCritic:
    """``with ScriptedCritic() as base_url:`` — the endpoint's /v1 URL."""

    def __enter__(self) -> str:
        self.server = _Server(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_port}/v1"

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
