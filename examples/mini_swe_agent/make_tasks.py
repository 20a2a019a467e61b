"""Write tasks.jsonl: toy SWE tasks, one-line bugs in a tiny module, each with its hidden test (the reward).

    python examples/mini_swe_agent/make_tasks.py [N] > examples/mini_swe_agent/tasks.jsonl
"""

from __future__ import annotations

import json
import random
import sys

# name, what it should do, the buggy body, the right answer
BUGS = [
    ("add", "a plus b", "a - b", lambda a, b: a + b),
    ("subtract", "a minus b", "a + b", lambda a, b: a - b),
    ("multiply", "a times b", "a + b", lambda a, b: a * b),
    ("larger", "the larger of a and b", "min(a, b)", max),
    ("smaller", "the smaller of a and b", "max(a, b)", min),
    ("distance", "the distance between a and b", "a - b", lambda a, b: abs(a - b)),
    ("power", "a to the power b", "a * b", lambda a, b: a**b),
    ("remainder", "the remainder of a divided by b", "a // b", lambda a, b: a % b),
]


def task(i: int, rng: random.Random) -> dict:
    name, doc, wrong, right = BUGS[i % len(BUGS)]
    while True:
        a, b = rng.randint(1, 9), rng.randint(2, 9)
        got = eval(wrong, {"min": min, "max": max}, {"a": a, "b": b})
        if got != right(a, b):
            break
    call = f"{name}({a}, {b})"
    return {
        "task_id": f"swe-{i:03d}",
        "issue": f"`{call}` in mathlib.py returns {got}; it should return {right(a, b)} ({doc}).",
        "files": {
            "mathlib.py": f'def {name}(a, b):\n    """{doc[0].upper() + doc[1:]}."""\n    return {wrong}\n',
        },
        # hidden from the agent (agent.private in run.yaml): the evaluator runs them on what it left
        "tests": {
            "test_mathlib.py": f"from mathlib import {name}\n\nassert {call} == {right(a, b)}, {call}\n"
            "print('ok')\n",
        },
    }


if __name__ == "__main__":
    rng = random.Random(0)
    for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 120):
        print(json.dumps(task(i, rng)))
