"""The store's on-disk contract: one versioned constant per table.

Both deployed tools import this module (the proxy writes ``calls``; the trainer reads it), so it
depends on pyarrow alone. A change to a schema bumps ``SCHEMA_VERSION``; the version is written into
every Parquet file's key-value metadata under ``lgt.schema_version``.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 8  # 1: calls; 2: + rollouts, rewards; 3: + calls.capture(_reason), egress;
# 4: + calls.sampling, rollouts.split; 5: + calls.api; 6: + calls.translation, each table's schema file;
# 7: + calls.policy; 8: + calls.response_policy_versions
SCHEMA_VERSION_KEY = b"lgt.schema_version"
TABLE_KEY = b"lgt.table"

# Call status values written by the proxy.
STATUS_OK = "ok"  # 2xx and, when streamed, the stream ended with [DONE]
STATUS_HTTP_ERROR = "http_error"  # the upstream answered 4xx/5xx (passed to the agent unchanged)
STATUS_UPSTREAM_ERROR = "upstream_error"  # no answer: connect failure, reset
STATUS_UPSTREAM_TIMEOUT = "upstream_timeout"  # the upstream was silent past --upstream-timeout (504)
STATUS_STREAM_ERROR = "stream_error"  # a stream that ended without [DONE] or carried broken events
STATUS_CLIENT_DISCONNECT = "client_disconnect"  # the agent went away before the call completed
STATUS_REJECTED = "rejected"  # answered by the proxy itself (pause in reject mode, bad request)
STATUSES = (
    STATUS_OK,
    STATUS_HTTP_ERROR,
    STATUS_UPSTREAM_ERROR,
    STATUS_UPSTREAM_TIMEOUT,
    STATUS_STREAM_ERROR,
    STATUS_CLIENT_DISCONNECT,
    STATUS_REJECTED,
)

_TS = pa.timestamp("us", tz="UTC")

DEFAULT_POLICY = "default"  # calls.policy of a run without a policies section, and of rows before schema 7

EXTRA_CHOICE = pa.struct(
    [
        ("index", pa.int32()),
        ("token_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("finish_reason", pa.string()),
    ]
)

CALLS = pa.schema(
    [
        ("call_id", pa.string(), False),
        ("rollout_id", pa.string(), False),
        ("attempt", pa.int32(), False),
        ("seq", pa.int64(), False),  # order of arrival within (rollout_id, attempt)
        ("started_at", _TS, False),
        ("first_byte_at", _TS),
        ("ended_at", _TS),
        ("latency_ms", pa.float64()),
        ("ttfb_ms", pa.float64()),
        ("endpoint", pa.string(), False),  # what the engine was asked: "chat/completions" | "completions"
        # what the agent called: "chat/completions" | "completions" | "responses" (OpenAI Responses) |
        # "messages" (Anthropic Messages; both translated to chat/completions); null: before schema 5
        ("api", pa.string()),
        # what the translation to chat/completions approximated (a field mapped to its nearest form,
        # carried as text, or ignored), one sentence each; null: translated exactly (or not translated)
        ("translation", pa.list_(pa.string())),
        ("original_host", pa.string()),  # the host the agent aimed at
        ("requested_model", pa.string()),
        ("served_model", pa.string()),
        ("upstream", pa.string()),  # base URL the call went to; null when observe-only
        ("policy_version", pa.int64(), False),
        ("streamed", pa.bool_(), False),
        ("request_json", pa.string()),  # the agent's request, as it sent it (redacted)
        ("response_json", pa.string()),  # what the agent received (streams re-assembled)
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response_token_ids", pa.list_(pa.int32())),  # choice 0
        ("response_logprobs", pa.list_(pa.float32())),  # choice 0, one per response token
        # the policy version that generated each response token, when not all were generated under
        # policy_version (a call that lived through an update: lgt-proxy --on-update continue stops it
        # at the pause and continues it on the new weights); null: every token is policy_version's
        ("response_policy_versions", pa.list_(pa.int32())),
        # how complete the token capture is: full | no_logprobs | no_tokens (null: before schema 3)
        ("capture", pa.string()),
        ("capture_reason", pa.string()),  # why an ok call's capture is not full (see proxy/addons/capture.py)
        ("sampling", pa.string()),  # "greedy": the proxy decoded greedily (evaluation); null: as asked
        ("extra_choices", pa.list_(EXTRA_CHOICE)),  # choices 1.. when n > 1
        ("finish_reason", pa.string()),
        ("status", pa.string(), False),
        ("http_status", pa.int32()),
        ("error", pa.string()),
        ("usage_prompt_tokens", pa.int64()),
        ("usage_completion_tokens", pa.int64()),
        ("usage_total_tokens", pa.int64()),
        ("proxy_session", pa.string()),  # which proxy process wrote the record
        # the policy the call belongs to (docs/policies.md): one of the run's policies, DEFAULT_POLICY
        # when the run names none; null before schema 7 (the views read it as DEFAULT_POLICY)
        ("policy", pa.string()),
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode(), TABLE_KEY: b"calls"},
)

# Rollout status values (written by the rollout controller or `lgt-train rollout`).
ROLLOUT_OK = "ok"  # the agent finished; its reward counts
ROLLOUT_FAILED = "failed"  # the agent crashed / exited non-zero: retried, never trained as reward 0
ROLLOUT_TIMEOUT = "timeout"
ROLLOUT_STATUSES = (ROLLOUT_OK, ROLLOUT_FAILED, ROLLOUT_TIMEOUT)
ROLLOUT_SPLITS = ("train", "eval")  # eval: held-out evaluation, recorded and never trained

ROLLOUTS = pa.schema(
    [
        ("rollout_id", pa.string(), False),
        ("attempt", pa.int32(), False),
        ("task_id", pa.string()),
        ("group_id", pa.string()),  # the rollouts of one task in one step; advantages are per group
        ("step", pa.int64()),
        ("status", pa.string(), False),
        ("exit_code", pa.int32()),
        ("started_at", _TS),
        ("ended_at", _TS),
        ("resource_version", pa.string()),  # e.g. the prompt template's version (APO)
        ("split", pa.string()),  # train | eval (held-out evaluation: never trained); null: train
        ("metadata_json", pa.string()),
        ("recorded_at", _TS, False),  # the latest row per (rollout_id, attempt) wins
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode(), TABLE_KEY: b"rollouts"},
)

REWARDS = pa.schema(
    [
        ("reward_id", pa.string(), False),
        ("rollout_id", pa.string(), False),
        ("attempt", pa.int32()),  # null: the rollout's latest attempt
        ("call_id", pa.string()),  # null: a reward for the whole rollout
        ("value", pa.float64(), False),
        ("source", pa.string(), False),  # cli | proxy | file | stdout | evaluator
        ("recorded_at", _TS, False),  # the latest reward per (rollout, attempt, call) wins
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode(), TABLE_KEY: b"rewards"},
)

# Egress kinds: what an agent reached through the proxy that is not an LLM call.
EGRESS_HTTP = "http"  # one HTTP request (plain, or inside a TLS tunnel the proxy intercepted)
EGRESS_TCP = "tcp"  # a connection that carried something other than HTTP
EGRESS_TLS_FAILED = "tls_failed"  # a CONNECT whose TLS the agent refused (e.g. a pinned certificate)

EGRESS = pa.schema(
    [
        ("egress_id", pa.string(), False),
        ("rollout_id", pa.string(), False),
        ("attempt", pa.int32(), False),
        ("started_at", _TS, False),
        ("ended_at", _TS),
        ("kind", pa.string(), False),  # http | tcp | tls_failed
        ("scheme", pa.string()),  # http | https (http kind)
        ("method", pa.string()),
        ("host", pa.string(), False),
        ("port", pa.int32()),
        ("path", pa.string()),  # the values of secret-looking query parameters redacted
        ("allowed", pa.bool_(), False),  # false: blocked by the proxy's egress policy
        ("policy", pa.string(), False),  # allow | allowlist | deny
        ("status", pa.int32()),  # the HTTP status the agent got (403 when blocked)
        ("request_bytes", pa.int64()),
        ("response_bytes", pa.int64()),
        ("error", pa.string()),
        ("proxy_session", pa.string()),
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode(), TABLE_KEY: b"egress"},
)

TABLES: dict[str, pa.Schema] = {"calls": CALLS, "rollouts": ROLLOUTS, "rewards": REWARDS,
                                "egress": EGRESS}
SCHEMA_DIR = "_schema"  # <table>/_schema/<table>.parquet: no rows, the table's columns (see migrations)


def schema_file(table: str) -> str:
    """Where a table's empty schema file lives, relative to the store: any DuckDB client reads the
    table as ``<table>/**/*.parquet`` and gets its columns even before the first file is written."""
    return f"{table}/{SCHEMA_DIR}/{table}.parquet"


TIMESTAMP_FIELDS = {name: [f.name for f in s if f.type == _TS] for name, s in TABLES.items()}
