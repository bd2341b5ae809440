"""The package's layers (docs/design.md "Layers"): every module of ``hvd_ray/`` imports only
from its own layer or lower ones, and no two modules import each other, directly or round a loop.

Read with ``ast``, so every import counts: inside functions and under ``if TYPE_CHECKING`` too
(a lazy import is still a dependency, only a hidden one). The graph holds the imports written in
the files; a package's ``__init__`` that Python runs on the way to a submodule is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# lowest first; a module may import from its own layer or below
LAYERS = {
    "kernels": 0,
    "workloads": 0,
    "model": 1,  # model/kv_cache.py calls kernels' compact_kv on CUDA
    "drafters": 2,
    "verification": 3,
    "engine": 4,
    "selection": 5,
    "traces": 6,
    "dimr": 6,
    "training": 6,  # offline training: the EAGLE-3 head (features, TTT loss), the yield predictor (on labels)
    # HVD inside vLLM (over drafters, engine, selection; nothing of layer 7); from outside only vllm/generate.py is
    # imported (vLLM as a plain batch generator: the traces' vLLM backend, the bench peers' env; test_vllm.py)
    "vllm": 6,
    "build": 7,  # the one builder of an Engine with drafters / a policy / a slim tier (selection, dimr, traces)
    "serving": 7,
    "cli": 7,
    "__main__": 7,
    "hvd_ray": 7,
    "bench": 8,  # measurement: builds methods' engines (build) and serves the app (serving) to time them
    "kernels.check_gpu": 7,  # a script: it checks the kernels against the engine's functions
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(mod: str) -> tuple[str, int]:
    """(layer key, layer) of a module: its own name below ``hvd_ray`` if that has a layer (a script
    such as ``kernels.check_gpu``), else its ``hvd_ray`` subpackage (``hvd_ray`` itself for the top)."""
    rel = mod.partition(".")[2] or mod
    key = rel if rel in LAYERS else rel.split(".")[0]
    if key not in LAYERS:
        raise KeyError(f"module {mod} is in no layer: add it to LAYERS (and docs/design.md's Layers)")
    return key, LAYERS[key]


def imports(path: Path, modules: set[str]) -> list[tuple[int, str]]:
    """``(line, module)`` for every import of one of ``modules`` in the file, relative ones resolved;
    ``from pkg import sub`` counts ``pkg.sub`` when that is a module (``pkg`` only for other names)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            if len(subs) < len(node.names):  # names from the package itself, not only its submodules
                out.append((node.lineno, target))
            out += [(node.lineno, m) for m in subs]
    return sorted((line, m) for line, m in out if m in modules)


def graph() -> tuple[dict[str, list[tuple[int, str]]], dict[str, Path]]:
    """The module graph ``{module: [(line, imported module)]}`` and each module's file."""
    files = {module_name(p): p for p in sorted((ROOT / "hvd_ray").rglob("*.py"))}
    return {mod: [(line, m) for line, m in imports(p, set(files)) if m != mod] for mod, p in files.items()}, files


def test_no_import_reaches_up_a_layer():
    edges, files = graph()
    bad = []
    for mod, deps in edges.items():
        key, lo = layer_of(mod)
        for line, dep in deps:
            dkey, hi = layer_of(dep)
            if hi > lo:
                bad.append(
                    f"{files[mod].relative_to(ROOT)}:{line}: {mod} ({key}, layer {lo}) imports {dep} "
                    f"({dkey}, layer {hi})"
                )
    assert not bad, "imports from a lower layer into a higher one:\n" + "\n".join(bad)


def test_no_import_cycles():
    edges, files = graph()
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[tuple[str, int]] = []  # (module, line of the import that led to the next one)
    cycles = []

    def visit(mod: str) -> None:
        state[mod] = 1
        for line, dep in edges[mod]:
            stack.append((mod, line))
            if state.get(dep) == 1:
                loop = stack[[m for m, _ in stack].index(dep) :]
                cycles.append(" -> ".join(f"{files[m].relative_to(ROOT)}:{ln} ({m})" for m, ln in loop) + f" -> {dep}")
            elif dep not in state:
                visit(dep)
            stack.pop()
        state[mod] = 2

    for mod in edges:
        if mod not in state:
            visit(mod)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_graph_sees_hidden_imports():
    """The walk finds what a regex over top-level lines would miss: relative, lazy and guarded imports."""
    edges, _ = graph()
    deps = {m for _, m in edges["hvd_ray.engine.engine"]}
    assert {"hvd_ray.verification", "hvd_ray.drafters.base", "hvd_ray.engine.request"} <= deps
    assert "hvd_ray.kernels" in {m for _, m in edges["hvd_ray.model.kv_cache"]}  # imported inside a method
    assert all(layer_of(m) for m in edges)  # every module has a layer


def test_the_engine_asks_a_policy_only_what_its_interface_declares():
    """The engine (layer 4) reaches a policy (layer 5) only through ``engine.policy.DraftPolicy``:
    calling it, its ``costs``, ``cache`` and ``cache_choice``; never by probing (``getattr``)."""
    from hvd_ray.engine.policy import DraftPolicy

    declared = {n for n in vars(DraftPolicy) if not n.startswith("__")}
    for path in (ROOT / "hvd_ray" / "engine").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                if node.value.attr == "policy" and isinstance(node.value.value, ast.Name):
                    assert node.attr in declared, f"{path.name}:{node.lineno} reads policy.{node.attr}"
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr"):
                probed = ast.unparse(node.args[0])
                assert "policy" not in probed, f"{path.name}:{node.lineno} probes {probed}"
