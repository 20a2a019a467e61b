"""The house's rules, read from the code's own imports (docs/architecture.md): each room imports only
downward, no module imports itself back through others, and the product never imports its test doubles."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"proxy": "lgt.proxy", "store": "lgt.store", "trainer": "lgt.trainer", "testing": "lgt.testing"}

# A room may import the rooms listed after it (and itself). Rooms are the top folders, and inside the
# trainer its subpackages; a module directly in trainer/ (cli, recipe, config, model_dir ...) is its own room.
ORDER = [
    "lgt.testing",
    "lgt.trainer.cli", "lgt.trainer.distill.record", "lgt.trainer.distill.sft",
    "lgt.trainer.run.evaluate", "lgt.trainer.apo.command", "lgt.trainer.recipe", "lgt.trainer.policy",
    "lgt.trainer.preflight", "lgt.trainer.config",
    "lgt.trainer.distill", "lgt.trainer.run", "lgt.trainer.apo", "lgt.trainer.make_model",
    "lgt.trainer.rollout", "lgt.trainer.backends", "lgt.trainer.serving", "lgt.trainer.report",
    "lgt.trainer.rl", "lgt.trainer.gguf", "lgt.trainer.model_dir", "lgt.trainer.demo",
    "lgt.proxy", "lgt.store",
]


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The lgt modules ``name`` imports anywhere in it (functions included: a lazy import is an arrow
    too), resolved to modules of the tree."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t not in FOLDERS.values():  # a top package's __init__ is empty
                found.add(t)
    return found


def room(module: str) -> str:
    return max((r for r in ORDER if module == r or module.startswith(r + ".")), key=len)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_room_imports_only_downward() -> None:
    wrong = []
    for name, targets in graph().items():
        if name in FOLDERS.values():
            continue
        here = ORDER.index(room(name))
        for t in targets:
            there = room(t)
            if there != room(name) and ORDER.index(there) < here:
                wrong.append(f"{name} imports {t} ({there} is above {room(name)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_module_imports_itself_back() -> None:
    g = graph()
    cycles = []
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for t in sorted(g.get(n, ())):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n, [n])
    assert not cycles, "\n".join(cycles)


def test_the_product_never_imports_its_test_doubles() -> None:
    leaks = [f"{n} imports {t}" for n, ts in graph().items() if not n.startswith("lgt.testing")
             for t in ts if t.startswith("lgt.testing")]
    assert not leaks, "\n".join(leaks)


def test_the_rules_see_the_imports() -> None:
    """The checks above read real arrows: a few known ones are found."""
    g = graph()
    assert any(t.startswith("lgt.store.") for t in g["lgt.proxy.server"] | g["lgt.proxy.cli"])
    assert "lgt.trainer.rl.loss" in g["lgt.trainer.backends.torch_backend"]
    assert room("lgt.trainer.rollout.controller") == "lgt.trainer.rollout"
