"""Write tasks.jsonl: the harness examples' task — write a given word into a given file — and its check.

    python examples/write_a_word/make_tasks.py [N] > examples/write_a_word/tasks.jsonl

Each task: {"task_id", "prompt", "file", "word"}. The prompt is what the harness is asked (``-p``); the
reward is the check in check.py: the file holds the word and nothing else.
"""

from __future__ import annotations

import json
import random
import sys

WORDS = ["PINEAPPLE", "KIWI", "MANGO", "APRICOT", "BANANA", "CHERRY", "DAMSON", "ELDERBERRY", "FIG",
         "GUAVA", "LEMON", "LYCHEE", "MELON", "NECTARINE", "ORANGE", "PAPAYA", "QUINCE", "RAISIN",
         "SATSUMA", "TANGERINE"]
FILES = ["answer.txt", "out.txt", "word.txt", "result.txt", "note.md", "fruit.txt"]
PHRASES = ["Write the word {word} into the file {file} in the current directory.",
           "Create {file} in the current directory containing just the word {word}.",
           "Put the word {word} in a file named {file} here."]


def task(i: int, rng: random.Random) -> dict:
    word, file = rng.choice(WORDS), rng.choice(FILES)
    return {"task_id": f"word-{i:03d}", "prompt": rng.choice(PHRASES).format(word=word, file=file),
            "file": file, "word": word}


if __name__ == "__main__":
    rng = random.Random(0)
    for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 120):
        print(json.dumps(task(i, rng)))
