"""The package layout keeps its promises: the stages meet only at the cache contract, nothing imports
in a circle, no module grows past a page a reader can hold, and the code is lint-clean.

Imports are read from the source (ast), inside functions too: a lazy import still ties two modules.

Imports inside functions are for start-up time only. A module imports at its top what it uses,
except the heavy packages (HEAVY: torch, transformers and their kit, pyarrow, numpy, zarr and
numcodecs, fsspec, tqdm, pandas, matplotlib), and the package's own modules that import one of
them at their top (directly or through another module): those wait in the function that needs
them, so `status`, `inspect`, `--help` and the launchers' preflight start fast, and every process
opens its log (faulthandler armed) before torch can fail to import. The only other lazy imports
carry the reason on their line: `# start-up:` (cli.py imports a command's own stage only) or
`# cycle:` (the import would close a circle at import time)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "dflash_offline"
MAX_LINES = 500

# package -> packages it must never import. Stage one (extract) and stage two (train) meet only at
# the cache contract (cache/); the shared plumbing (runtime/) and the cache protocol (cache/) import
# no stage at all, so either stage can run, and be tested, without the other's code.
STAGES = ("extract", "generate", "train", "drafter", "evaluate", "prepare")
FORBIDDEN = {
    # chat/ (conversation files, chat templates) serves prepare and generate; it imports no stage.
    "chat": {"cache", *STAGES},
    "prepare": {"extract", "train", "drafter", "evaluate"},
    "extract": {"train", "drafter", "evaluate"},
    "generate": {"train", "drafter", "evaluate", "prepare"},
    "train": {"extract", "generate", "evaluate"},
    # evaluate reads what train leaves (runs/: checkpoints, run folders) and shares its rows and
    # losses (blocks/), never train's own modules.
    "evaluate": {"extract", "generate", "train", "prepare"},
    # blocks/ (block rows, losses, the held-out estimate) and runs/ (the run folder's format) are
    # where train and evaluate meet: they import neither.
    "blocks": {"extract", "generate", "train", "evaluate", "prepare"},
    "runs": {"extract", "generate", "train", "evaluate", "prepare"},
    "drafter": {"extract", "generate", "train", "evaluate"},
    "cache": {"targets", *STAGES},
    "targets": set(STAGES),
    "runtime": {"cache", "targets", *STAGES},
    # rows/ (the input contract's rows and part folders) serves extract, generate, prepare, eval and plan.
    "rows": {"targets", *STAGES},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every dflash_offline module this file imports, at the top or inside a function."""
    tree = ast.parse(path.read_text())
    me = module_name(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("dflash_offline")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if not mod.startswith("dflash_offline"):
                continue
            for a in node.names:  # `from pkg import module` imports the module
                sub = f"{mod}.{a.name}"
                out.add(sub if resolve(sub) else mod)
    return {m for m in out if resolve(m)}


def resolve(mod: str) -> Path | None:
    p = ROOT.joinpath(*mod.split("."))
    if p.with_suffix(".py").is_file():
        return p.with_suffix(".py")
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    return None


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) - {module_name(p)} for p in sorted(PKG.rglob("*.py"))}


# Top-level modules held to the same rule: config.py (extract's, generate's and prepare's configs)
# draws in no stage, so a stage importing its config does not stand on train or eval.
TOP_FORBIDDEN = {"config": {"extract", "generate", "train", "evaluate", "prepare", "blocks", "runs"}}


def boundary_crossings(g: dict[str, set[str]]) -> list[str]:
    """`module imports module` for each import the FORBIDDEN and TOP_FORBIDDEN rules refuse."""
    bad = []
    for mod, deps in g.items():
        parts = mod.split(".")
        if len(parts) == 2 and parts[1] in TOP_FORBIDDEN:
            bad += [f"{mod} imports {d}" for d in deps if len(d.split(".")) > 1 and d.split(".")[1] in TOP_FORBIDDEN[parts[1]]]
    for mod, deps in g.items():
        parts = mod.split(".")
        if len(parts) < 3 or parts[1] not in FORBIDDEN:
            continue
        for dep in deps:
            dparts = dep.split(".")
            if len(dparts) > 1 and dparts[1] in FORBIDDEN[parts[1]]:
                bad.append(f"{mod} imports {dep}")
    return sorted(bad)


def test_stages_meet_only_at_the_cache():
    bad = boundary_crossings(graph())
    assert not bad, "stage boundary crossed:\n" + "\n".join(bad)


def test_the_boundary_rule_refuses_evaluate_standing_on_train():
    """The rule itself, on a made-up module of evaluate/: its import of train is refused, those of
    what train and evaluate share (blocks/, runs/) are not."""
    g = graph()
    g["dflash_offline.evaluate.probe"] = {"dflash_offline.blocks.walk", "dflash_offline.runs.checkpoint",
                                          "dflash_offline.train.plan"}
    assert boundary_crossings(g) == ["dflash_offline.evaluate.probe imports dflash_offline.train.plan"]


def test_no_import_circle():
    g = graph()
    # Tarjan's strongly connected components: any component of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


# Pairs of packages (or top-level modules) that may import each other, in either form (at the top
# or inside a function): none. Two stages that share something meet through a third place
# (rows/, runtime/, target/, cache/).
KNOWN_TIES: set[tuple[str, str]] = set()


def test_no_new_two_way_package_tie():
    def unit(mod: str) -> str:
        return mod.split(".")[1] if "." in mod else mod

    uses: dict[str, set[str]] = {}
    for mod, deps in graph().items():
        uses.setdefault(unit(mod), set()).update(unit(d) for d in deps if unit(d) != unit(mod))
    ties = {tuple(sorted((a, b))) for a, used in uses.items() for b in used if a in uses.get(b, set())}
    assert ties <= KNOWN_TIES, f"packages that import each other: {sorted(ties - KNOWN_TIES)}"
    assert ties == KNOWN_TIES, f"ties gone, remove them from KNOWN_TIES: {sorted(KNOWN_TIES - ties)}"


def test_modules_stay_small():
    big = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by what they hold): {big}"


# Fields typed `object` on purpose: a caller's opaque handle, given back untouched.
OPAQUE_FIELDS = {"dflash_offline/generate/continuous.py:Request.tag", "dflash_offline/generate/continuous.py:Part.handle"}


def test_class_fields_have_real_types():
    """A dataclass or NamedTuple field says what it holds (a tensor, an array, the drafter), under
    `if TYPE_CHECKING:` imports where the type's package is heavy, not `object` and a comment."""
    loose = []
    for path in PKG.rglob("*.py"):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            for f in cls.body:
                if isinstance(f, ast.AnnAssign) and ast.unparse(f.annotation) in ("object", "object | None"):
                    loose.append(f"{path.relative_to(ROOT)}:{cls.name}.{ast.unparse(f.target)}")
    assert set(loose) == OPAQUE_FIELDS, f"fields typed object: {sorted(set(loose) - OPAQUE_FIELDS)}"


def test_every_module_says_what_it_holds():
    bare = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
            if p.name != "__main__.py" and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not bare, f"modules without a docstring: {bare}"


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or (Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    r = subprocess.run([str(ruff), "check", "--no-cache", "dflash_offline", "tests", "benchmarks"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_private_name_crosses_a_module():
    """A name with a leading underscore is its module's own: another module that needs it needs a
    public name (and the owner knows it has a user)."""
    crossing = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_offline"):
                crossing += [f"{module_name(path)} imports {node.module}.{a.name}" for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]
    assert not crossing, "private names used across modules:\n" + "\n".join(crossing)


def test_each_command_logs_before_torch_is_imported():
    """cli.py imports a command's stage, which opens the process log (faulthandler armed) before
    its heavy imports: so importing the stage's module must not import torch or transformers (a
    process that dies while importing them has its traceback in the log)."""
    stages = ["prepare.launcher", "extract.launcher", "generate.launcher", "train.launcher", "evaluate.run"]
    code = ("import sys\n" + "".join(f"import dflash_offline.{m}\n" for m in stages)
            + "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_no_function_is_over_80_lines():
    """A long function is split into named steps, each a function that says what it does (80 lines,
    docstring included: the longest, train's validate, reads in one screen)."""
    long = {f"{p.relative_to(ROOT)}:{name}": n for p in sorted(PKG.rglob("*.py")) for name, n in long_functions(p.read_text())}
    assert not long, f"functions over 80 lines (split them into named steps): {long}"


def long_functions(source: str, limit: int = 80) -> list[tuple[str, int]]:
    """(name, lines) of each function or method in `source` over `limit` lines, docstring included."""
    return [(node.name, n) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (n := node.end_lineno - node.lineno + 1) > limit]


def test_the_length_rule_counts_methods_and_nested_functions():
    body = "".join(f"    x{i} = {i}\n" for i in range(99))
    src = f"def top():\n{body}\n\nclass C:\n    def short(self):\n        pass\n\n    def m(self):\n" + body.replace("    ", "        ")
    assert long_functions(src) == [("top", 100), ("m", 100)]
    assert long_functions(src, limit=100) == []
    assert long_functions("def f():\n    def g():\n" + body.replace("    ", "        ")) == [("f", 101), ("g", 100)]


# Packages whose import costs start-up time (seconds for torch and transformers, a tenth of a second
# for pyarrow, numpy or zarr): imported inside the function that needs them unless the module needs
# them anyway (see the module docstring). Everything else, stdlib and the package's own light
# modules, is imported at the top of the module.
HEAVY = frozenset({
    "torch", "transformers", "safetensors", "tokenizers", "datasets", "jinja2", "fla", "triton",  # models
    "pyarrow", "numpy", "zarr", "numcodecs", "fsspec",  # data
    "tqdm", "pandas", "matplotlib",  # progress bars, notebook tables and plots
})
# (module, imported module) -> why a light import stays inside a function. Empty: none has to.
LAZY_ALLOWED: dict[tuple[str, str], str] = {}
LAZY_MARKS = ("# start-up:", "# cycle:")


def _absolute(mod: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The modules an import statement names, absolute (`from pkg import module` names the module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        me = mod.split(".")
        package = me if resolve(mod) and resolve(mod).name == "__init__.py" else me[:-1]
        base = ".".join(package[: len(package) - node.level + 1])
        src = f"{base}.{node.module}" if node.module else base
    else:
        src = node.module or ""
    subs = [f"{src}.{a.name}" for a in node.names if src.startswith("dflash_offline") and resolve(f"{src}.{a.name}")]
    return subs if len(subs) == len(node.names) else [src, *subs]


def _split_imports(tree: ast.Module) -> tuple[list, list]:
    """(imports run when the module is imported, imports inside functions); `if TYPE_CHECKING:`
    blocks are neither."""
    top, lazy = [], []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (lazy if in_function else top).append(child)
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(tree, False)
    return top, lazy


def heavy_at_import() -> dict[str, set[str]]:
    """Module -> the heavy packages importing it imports (its top-level imports, its packages'
    __init__ and theirs, transitively)."""
    tops = {}
    for path in sorted(PKG.rglob("*.py")):
        mod = module_name(path)
        parts = mod.split(".")
        tops[mod] = {m for n in _split_imports(ast.parse(path.read_text()))[0] for m in _absolute(mod, n)}
        tops[mod] |= {".".join(parts[:i]) for i in range(1, len(parts))}
    memo: dict[str, set[str]] = {}

    def heavy(mod: str) -> set[str]:
        if mod not in memo:
            memo[mod] = set()  # a circle adds nothing more
            memo[mod] = {m.split(".")[0] for m in tops[mod] if m.split(".")[0] in HEAVY}.union(
                *(heavy(m) for m in tops[mod] if m in tops and m != mod))
        return memo[mod]

    return {mod: heavy(mod) for mod in tops}


def test_imports_inside_functions_are_for_start_up_only():
    heavy = heavy_at_import()
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        mod, lines = module_name(path), path.read_text().splitlines()
        for node in _split_imports(ast.parse(path.read_text()))[1]:
            if any(mark in line for line in lines[node.lineno - 1:node.end_lineno] for mark in LAZY_MARKS):
                continue
            for name in _absolute(mod, node):
                if name.split(".")[0] in HEAVY or (mod, name) in LAZY_ALLOWED:
                    continue
                if name.startswith("dflash_offline") and name in heavy and heavy[name]:
                    continue
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name} inside a function")
    assert not bad, ("imports of light modules belong at the top of the module (a heavy package, or a module that "
                     "imports one, may wait; else say why on the line: # start-up: or # cycle:):\n" + "\n".join(bad))


def test_light_modules_import_nothing_heavy():
    """The reading above agrees with Python: importing every module that ast finds light loads no
    heavy package (an import that ast cannot see, importlib or __import__, would show here)."""
    light = sorted(m for m, h in heavy_at_import().items() if not h)
    code = ("import sys\n" + "".join(f"import {m}\n" for m in light)
            + f"print(sorted(m for m in {sorted(HEAVY)!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"light modules ({len(light)}) imported {out.stdout.strip()}"
