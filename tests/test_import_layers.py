"""The package's import structure, read from the source with `ast` (nothing is imported): no import circles, no
import pointing up the layer table of ARCHITECTURE.md ("Package layout", its "may import" column), and no import
inside a function except of an optional heavy dependency or the CLI's dispatch to a recipe.

Importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` first, so an import counts as a dependency on every
package above its target too (except the importer's own packages, already running). A control test runs the same
checks on a small package written to a temporary folder, with one violation of each kind, and sees them reported.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "posttrain"

RANKS: dict[str, int] = {
    "version": 0,         # the package version; imports nothing
    "errors": 0,          # RunError, the base of the errors a user can fix; imports nothing
    "metrics": 0,         # pass@k and other plain-number metrics; imports nothing
    "config": 1,          # pydantic schemas, YAML, overrides: the bottom layer (pydantic, omegaconf, yaml)
    "losses": 2,          # pure functions: torch and their config sections only
    "advantages": 2,      # pure functions: torch and config only
    "process_group": 2,   # rank, world size, barrier, broadcast of a data-parallel run: torch.distributed only
    "preemption": 2,      # SIGTERM/SIGUSR1: finish the step, save, stop (the ranks agree through process_group)
    "envs": 2,            # environments and reward functions (math-verify, subprocess); their options are config's
    "optim": 2,           # AdamW and the schedule from the trainer section
    "logging": 2,         # metrics.jsonl, console, loggers, plots, reports (rich, matplotlib)
    "data": 3,            # formats, loading, tokenization, collation (datasets, transformers); the embedded
                          # arithmetic data comes from envs/arithmetic
    "rundir": 3,          # the run directory: its lock, staging folders, manifests, the guard on final/
    "checkpoint": 4,      # atomic save and resume (safetensors), in the run directory's formats
    "hub": 4,             # model cards of the exports and Hub uploads (huggingface_hub), from the run's files
    "models": 5,          # HF loading, tiny models, LoRA, value heads (transformers, peft); writes adapters
    "generation": 6,      # the Generator protocol and its transformers and vLLM backends
    "workers": 7,         # the seam between models and loops: models, losses, data types, checkpoint, optim
    "distributed": 8,     # FSDP2 workers and their builders: the same protocols across processes
    "algorithms": 9,      # one loop per recipe: workers, generation, envs, data, config, logging, checkpoint
    "cli": 10,            # posttrain RECIPE --config FILE key=value ...: config, algorithms
    "api": 10,            # posttrain.train(RECIPE, config, ...): the command line's recipes as functions
    "__main__": 11,       # python -m posttrain
    "posttrain": 12,      # the package's __init__: its version, and the API's names when first used (lazily)
}
"""The rank of each top-level module or package of src/posttrain: an import may point only to its own rank or
below. config is the bottom; ARCHITECTURE.md's table, read bottom up."""

HEAVY_OPTIONAL: dict[str, str] = {
    "vllm": "the vllm extra, GPU only",
    "posttrain.generation.vllm_backend": "the vLLM backend, chosen with rollout.backend=vllm (vllm extra)",
    "ray": "Ray worker groups, an optional dependency",
    "posttrain.distributed.ray_groups": "Ray worker groups, chosen with cluster.backend=ray (ray extra)",
    "wandb": "the loggers extra",
    "mlflow": "the loggers extra",
    "torch.utils.tensorboard": "the loggers extra (tensorboard)",
    "trl": "the bench extra, for comparisons only",
    "lm_eval": "the lm-eval extra, for `posttrain eval --lm-eval-tasks` only",
    "peft": "LoRA runs only; importing peft costs about 2 s, which every other command would pay",
    "torch.distributed.checkpoint": "sharded (FSDP2) checkpoints only; importing it costs about 1.3 s",
    "datasets": "hub datasets only (local files are read without it); importing it costs about 0.7 s",
    "pyarrow": "parquet files only",
    "math_verify": "the math environment's scorer processes only; importing it costs about 0.4 s",
    "rank_bm25": "the agents extra: the tools environment's search tool only",
}
"""Modules that may be imported inside a function, and why: optional extras, or costly imports that only some
runs need."""

CLI_DISPATCH = ("posttrain.algorithms.", "posttrain.logging.report")
"""`posttrain RECIPE` imports that recipe's loop (or the report writer) only when it runs it."""

LAZY_API = ("posttrain", "posttrain.api")
"""The package's __init__ imports the Python API when one of its names (posttrain.train, ...) is first used: the API
imports torch and every recipe, which `import posttrain` must not pay (PEP 562 module __getattr__)."""

KNOWN_VIOLATIONS: set[tuple[str, str, str]] = set()
"""(importer, imported, "local" or "upward") pairs tolerated for now, each with its reason; none today."""


@dataclass(frozen=True)
class Import:
    importer: str
    """The importing module, e.g. posttrain.checkpoint."""
    imported: str
    """The imported module as written (for `from a import b`, a.b when b is a module of the package, else a)."""
    line: int
    in_function: bool


def package_modules(source: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} of every module of `package` under `source`."""
    modules = {}
    for path in sorted((source / package).rglob("*.py")):
        parts = list(path.relative_to(source).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def read_imports(source: Path, package: str) -> tuple[dict[str, Path], list[Import]]:
    """Every import statement of the package's modules, resolved to absolute module names."""
    modules = package_modules(source, package)
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        in_functions = {id(node) for function in ast.walk(tree)
                        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                        for node in ast.walk(function)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, module, path.name == "__init__.py")
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            found += [Import(module, name, node.lineno, id(node) in in_functions) for name in dict.fromkeys(names)]
    return modules, found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _in_package(name: str, modules: dict[str, Path]) -> str | None:
    """The package module `name` lands in (its longest prefix that is a module), or None for another library."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def module_graph(modules: dict[str, Path], imports: list[Import]) -> dict[str, set[str]]:
    """{module: the package modules importing it runs}: the target and every package above it, except the
    importer's own packages (already being imported when it runs)."""
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for item in imports:
        target = _in_package(item.imported, modules)
        if target is None:
            continue
        parts = target.split(".")
        own = {".".join(item.importer.split(".")[:n]) for n in range(1, item.importer.count(".") + 2)}
        for n in range(1, len(parts) + 1):
            ancestor = ".".join(parts[:n])
            if ancestor in modules and ancestor != item.importer and (ancestor not in own or ancestor == target):
                graph[item.importer].add(ancestor)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def unit(module: str) -> str:
    """The top-level module or package of the layer table a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(modules: dict[str, Path], imports: list[Import], ranks: dict[str, int]) -> list[tuple[str, str]]:
    """(importer, imported) for each import of a package module ranked above the importer's."""
    graph = module_graph(modules, imports)
    return sorted((importer, target) for importer, targets in graph.items() for target in targets
                  if ranks[unit(target)] > ranks[unit(importer)])


def function_imports(imports: list[Import], allowed: dict[str, str], dispatch: tuple[str, ...],
                     cli: str) -> list[tuple[str, str, int]]:
    """(importer, imported, line) for each import inside a function that is neither an allowed heavy optional
    module nor the CLI's dispatch to a recipe."""
    def allowed_module(name: str) -> bool:
        return any(name == key or name.startswith(key + ".") for key in allowed)

    return sorted((i.importer, i.imported, i.line) for i in imports if i.in_function
                  and not allowed_module(i.imported)
                  and not (i.importer == cli and i.imported.startswith(dispatch)))


# ---- the package --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def package() -> tuple[dict[str, Path], list[Import]]:
    return read_imports(SOURCE, PACKAGE)


def test_every_top_level_module_has_a_rank(package):
    modules, _ = package
    assert sorted({unit(m) for m in modules} - set(RANKS)) == [], "place each new module in RANKS"
    assert sorted(set(RANKS) - {unit(m) for m in modules}) == [], "RANKS names a module that no longer exists"


def test_no_import_circles(package):
    modules, imports = package
    assert circles(module_graph(modules, imports)) == []


def test_no_import_points_up_the_layer_table(package):
    modules, imports = package
    found = {(importer, imported, "upward") for importer, imported in upward_imports(modules, imports, RANKS)}
    assert sorted(found - KNOWN_VIOLATIONS) == []


def test_no_imports_inside_functions_but_optional_heavy_ones(package):
    _, imports = package
    found = {(importer, imported, "local") for importer, imported, _ in
             function_imports(imports, HEAVY_OPTIONAL, CLI_DISPATCH, f"{PACKAGE}.cli")}
    assert sorted(found - KNOWN_VIOLATIONS - {(*LAZY_API, "local")}) == []


def test_known_violations_are_still_there(package):
    # Once a listed import is gone (fixed on the branch that rewrites the worker seam), its entry must go too.
    modules, imports = package
    upward = {(a, b, "upward") for a, b in upward_imports(modules, imports, RANKS)}
    local = {(a, b, "local") for a, b, _ in function_imports(imports, HEAVY_OPTIONAL, CLI_DISPATCH, "posttrain.cli")}
    assert sorted(KNOWN_VIOLATIONS - upward - local) == []


def test_config_and_the_pure_layers_import_only_their_own(package):
    # config: pydantic, omegaconf, yaml and the standard library, nothing of the package but config and leaves;
    # losses and advantages: torch and config.
    _, imports = package
    allowed = {"config": {"pydantic", "pydantic_core", "omegaconf", "yaml"}, "losses": {"torch"},
               "advantages": {"torch"}}
    leaves = {"posttrain", "version", "errors", "metrics"}
    problems = []
    for item in imports:
        layer = unit(item.importer)
        if layer not in allowed:
            continue
        root = item.imported.split(".")[0]
        if root == PACKAGE:
            ok = unit(item.imported) in ({"config", layer} | leaves)
        else:
            ok = root in allowed[layer] or root in sys.stdlib_module_names
        if not ok:
            problems.append(f"{item.importer}:{item.line} imports {item.imported}")
    assert problems == []


# ---- the checks can fail ------------------------------------------------------------------------------------


def test_the_checks_report_a_circle_an_upward_import_and_an_import_in_a_function(tmp_path):
    root = tmp_path / "pkg"
    (root / "low").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "from pkg.low import b\n",
        "low/b.py": "import pkg.low.a\nfrom pkg import high\n",  # a circle with a.py, and an upward import
        "high.py": "",
        "mid.py": "def f():\n    import json\n    from pkg.low import a\n    import vllm\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    modules, imports = read_imports(tmp_path, "pkg")
    ranks = {"pkg": 0, "low": 0, "mid": 1, "high": 1}
    assert circles(module_graph(modules, imports)) == [["pkg.low.a", "pkg.low.b"]]
    assert upward_imports(modules, imports, ranks) == [("pkg.low.b", "pkg.high")]
    assert function_imports(imports, {"vllm": "optional"}, (), "pkg.cli") == [
        ("pkg.mid", "json", 2), ("pkg.mid", "pkg.low.a", 3)]
    # Importing a module runs the packages above it: pkg.mid depends on pkg.low (its __init__) too.
    assert module_graph(modules, imports)["pkg.mid"] == {"pkg.low", "pkg.low.a"}
