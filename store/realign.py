"""Realignment: where a call's prompt is not a token extension of the previous call's prompt + generated
tokens, whether its decoded text is, and where its new tokens start (:func:`realign_offset`).

Re-tokenisation drift (the agent's harness renders the same text again and the tokenizer cuts it
otherwise) splits a sample in exact mode; ``mode="realign"`` of :func:`lgt.store.samples.build_samples`
keeps the held tokens unchanged and appends the prompt's tokens after the matching text. Pure functions
over a ``decode(ids) -> str``.
"""

from __future__ import annotations

from collections.abc import Callable

# Why a prompt does not continue the held text (merge_breaks.reason; lgt.store.merge lists them all).
TRUNCATION = "truncation"  # its prompt is shorter than what the sample holds: context trimmed
TEXT_CHANGE = "text_change"  # its decoded prompt does not start with the held text: history rewritten
BOUNDARY_RESPLIT = "boundary_resplit"  # the text extends, but no token boundary ends the held text


def realign_offset(decode: Callable[[list[int]], str], held: list[int], n_prompt: int, stop: bool,
                   prompt: list[int]) -> tuple[int | None, str | None]:
    """Where ``prompt`` continues the held tokens as text: ``(offset, None)`` or ``(None, reason)``.

    ``held`` is the previous call's prompt (its first ``n_prompt`` tokens) + generated tokens. The
    held text is ``decode(held)``, or, when that call stopped on a stop token (``stop``) that the
    next prompt's template left out, the text without its last generated token. ``offset`` is the
    first prompt token after a token boundary whose decoded prefix is exactly the held text: the
    held tokens stay, ``prompt[offset:]`` is appended. Reasons: truncation (the prompt's text is
    shorter than the held text), text_change (it does not start with it), boundary_resplit (it does,
    but no token boundary ends there).
    """
    text = decode(prompt)
    targets = [held]
    if stop and len(held) > n_prompt:
        targets.append(held[:-1])
    for target in targets:
        held_text = decode(target)
        if text.startswith(held_text):
            offset = _boundary(decode, prompt, target, held_text)
            return (offset, None) if offset is not None else (None, BOUNDARY_RESPLIT)
    return None, TRUNCATION if len(text) < len(decode(held)) else TEXT_CHANGE


def _boundary(decode: Callable[[list[int]], str], prompt: list[int], held: list[int],
              held_text: str) -> int | None:
    """The least ``o`` with ``decode(prompt[:o]) == held_text``, searched from the common token prefix."""
    first_difference = next((i for i, (x, y) in enumerate(zip(prompt, held)) if x != y),
                            min(len(prompt), len(held)))
    for o in range(first_difference, len(prompt) + 1):
        got = decode(prompt[:o])
        if got == held_text:
            return o
        if len(got) > len(held_text):
            return None
    return None
