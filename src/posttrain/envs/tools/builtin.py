"""The built-in tools: calculator, python, files (read_file, write_file, list_files) and search.

- calculator: arithmetic on numbers (+ - * / // % **, unary signs, parentheses), evaluated from the parsed syntax
  tree: no name, call, attribute or any other Python is evaluated, and operands and powers are bounded so that
  "9**9**9" is an error, not a frozen process.
- python: the model's program run by `posttrain.envs.sandbox` (the code environment's sandbox: namespaces, resource
  limits, an audit hook), never in the training process. Like the code environment it refuses to start where the
  sandbox has no namespace isolation, unless allow_unisolated_fallback is set.
- files: read, write and list files in the episode's own work directory. A path is resolved (symbolic links
  followed) and refused unless it stays below that directory.
- search: BM25 (the `rank-bm25` library) over a corpus of {"title", "text"} JSON lines: the small bundled one
  (search_corpus.jsonl, a few paragraphs about arithmetic, units and this library's tools) or the user's own file.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from importlib import resources
from pathlib import Path
from typing import Any

from posttrain.envs import sandbox
from posttrain.envs.tools.schema import Tool, ToolContext, ToolFailure, ToolInfrastructureError, ToolTimeout

BUILTIN_TOOL_NAMES = ("calculator", "python", "files", "search")
"""What `tools:` entries name the built-ins by (files gives three tools: read_file, write_file, list_files)."""

MAX_CALCULATOR_BITS = 4096
"""The largest integer operand or result (in bits) the calculator handles; beyond it the expression is refused."""
MAX_FILE_BYTES = 1_000_000
"""The largest file write_file writes."""


# ---- calculator -----------------------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression of numbers, + - * / // % **, unary signs and parentheses.
    Raises ToolFailure for anything else, for division by zero and for numbers past MAX_CALCULATOR_BITS."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ToolFailure(f"not an arithmetic expression: {error.msg}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * max(1, abs(left)).bit_length() > MAX_CALCULATOR_BITS:
            raise ToolFailure(f"{left} ** {right} is too large for the calculator")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolFailure("division by zero") from None
        except OverflowError:
            raise ToolFailure("the result is too large for a floating-point number") from None
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise ToolFailure(f"the calculator takes numbers, + - * / // % ** and parentheses only (found {what})")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ToolFailure("the result is a complex number")
    if isinstance(value, int) and value.bit_length() > MAX_CALCULATOR_BITS:
        raise ToolFailure("a number in the expression is too large for the calculator")
    return value


def _format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def calculator_tool(timeout_s: float) -> Tool:
    return Tool(
        name="calculator",
        description="Evaluate an arithmetic expression: numbers, + - * / // % **, and parentheses.",
        parameters={"type": "object", "properties": {"expression": {
            "type": "string", "description": "The expression, for example \"(1234 + 5678) * 3\"."}},
            "required": ["expression"], "additionalProperties": False},
        run=lambda arguments, context: _format_number(calculate(arguments["expression"])),
        timeout_s=timeout_s)


# ---- python --------------------------------------------------------------------------------------------------


def python_tool(timeout_s: float, memory_limit_mb: int, output_limit_bytes: int,
                allow_unisolated_fallback: bool) -> Tool:
    """The python tool; refuses (ValueError) where the sandbox has no namespace isolation unless allowed."""
    info = sandbox.sandbox_info()
    if not info.namespaces and not allow_unisolated_fallback:
        why = (info.namespace_error or "the probe failed").strip().splitlines()[-1]
        raise ValueError("the python tool will not run model-written programs on this machine: the sandbox's "
                         f"namespace isolation does not work here ({why}); see docs/rl.md on the code environment's "
                         "sandbox, or set environment.options.allow_unisolated_fallback=true for trusted programs")

    def run(arguments: dict[str, Any], context: ToolContext) -> str:
        result = sandbox.run_sandboxed(arguments["code"], time_limit_s=timeout_s, memory_limit_mb=memory_limit_mb,
                                       output_limit_bytes=output_limit_bytes)
        if not result.started:
            raise ToolInfrastructureError(f"the sandbox could not start the program: {result.stderr.strip()[-300:]}")
        if result.timed_out:
            raise ToolTimeout(f"the program ran past {timeout_s:g} s and was stopped")
        if result.memory_exceeded:
            raise ToolFailure(f"the program ran past {memory_limit_mb} MiB of memory and was stopped")
        if result.exit_code != 0:
            raise ToolFailure(f"exit status {result.exit_code}\n{result.stdout}{result.stderr}".strip())
        return result.stdout

    return Tool(
        name="python",
        description="Run a Python program in a sandbox and return what it prints (stdout).",
        parameters={"type": "object", "properties": {"code": {
            "type": "string", "description": "The program; print what you want to see."}},
            "required": ["code"], "additionalProperties": False},
        run=run, timeout_s=timeout_s + 5.0)  # the sandbox stops the program itself; this catches a stuck launch


# ---- files ---------------------------------------------------------------------------------------------------


def resolve_in_workdir(workdir: Path, path: str) -> Path:
    """`path` (relative to `workdir`) resolved, symbolic links followed; ToolFailure when it is absolute or leads
    outside `workdir`."""
    if Path(path).is_absolute():
        raise ToolFailure(f"{path!r} is an absolute path; give a path relative to the work directory")
    root = workdir.resolve()
    resolved = (root / path).resolve()
    if resolved != root and root not in resolved.parents:
        raise ToolFailure(f"{path!r} leads outside the work directory")
    return resolved


def _read_file(arguments: dict[str, Any], context: ToolContext) -> str:
    path = resolve_in_workdir(context.workdir, arguments["path"])
    if not path.is_file():
        raise ToolFailure(f"no file {arguments['path']!r} in the work directory")
    return path.read_text(encoding="utf-8", errors="replace")


def _write_file(arguments: dict[str, Any], context: ToolContext) -> str:
    path = resolve_in_workdir(context.workdir, arguments["path"])
    data = arguments["content"].encode("utf-8")
    if len(data) > MAX_FILE_BYTES:
        raise ToolFailure(f"the content has {len(data)} bytes, more than the {MAX_FILE_BYTES} a file may have")
    if path == context.workdir.resolve() or path.is_dir():
        raise ToolFailure(f"{arguments['path']!r} is a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return f"wrote {len(data)} bytes to {arguments['path']}"


def _list_files(arguments: dict[str, Any], context: ToolContext) -> str:
    path = resolve_in_workdir(context.workdir, arguments.get("path", "."))
    if not path.is_dir():
        raise ToolFailure(f"no directory {arguments.get('path', '.')!r} in the work directory")
    root = context.workdir.resolve()
    entries = sorted(str(p.relative_to(root)) + ("/" if p.is_dir() else "") for p in path.rglob("*"))
    return "\n".join(entries) if entries else "(empty)"


def _path_property(what: str) -> dict[str, Any]:
    return {"type": "string", "description": f"{what}, relative to the work directory."}


def file_tools(timeout_s: float) -> list[Tool]:
    return [
        Tool("read_file", "Read a text file from the work directory.",
             {"type": "object", "properties": {"path": _path_property("The file")}, "required": ["path"],
              "additionalProperties": False}, _read_file, timeout_s, uses_workdir=True),
        Tool("write_file", "Write a text file in the work directory (created or replaced).",
             {"type": "object", "properties": {"path": _path_property("The file"),
                                               "content": {"type": "string", "description": "The file's text."}},
              "required": ["path", "content"], "additionalProperties": False}, _write_file, timeout_s,
             uses_workdir=True),
        Tool("list_files", "List the files below a directory of the work directory.",
             {"type": "object", "properties": {"path": _path_property("The directory (default: the whole work "
                                                                      "directory)")},
              "additionalProperties": False}, _list_files, timeout_s, uses_workdir=True),
    ]


# ---- search --------------------------------------------------------------------------------------------------

_WORD = re.compile(r"\w+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def load_corpus(path: str | None) -> list[dict[str, str]]:
    """The {"title", "text"} documents of a JSON-lines file (None: the bundled corpus); ValueError naming the line
    of a malformed one."""
    if path is None:
        lines = resources.files("posttrain.envs.tools").joinpath("search_corpus.jsonl").read_text("utf-8")
        where = "the bundled search corpus"
    else:
        lines = Path(path).read_text(encoding="utf-8")
        where = path
    documents = []
    for number, line in enumerate(lines.splitlines(), 1):
        if not line.strip():
            continue
        try:
            document = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}, line {number}: not JSON ({error.msg})") from None
        if not isinstance(document, dict) or not isinstance(document.get("text"), str):
            raise ValueError(f"{where}, line {number}: a document is an object with a string 'text' (and a 'title')")
        documents.append({"title": str(document.get("title", f"document {number}")), "text": document["text"]})
    if not documents:
        raise ValueError(f"{where} holds no documents")
    return documents


def search_tool(timeout_s: float, corpus_path: str | None, num_results: int = 3) -> Tool:
    """BM25 search (rank-bm25's BM25Okapi) over the corpus; the index is built once, here."""
    try:
        from rank_bm25 import BM25Okapi  # optional extra: only the search tool needs it
    except ImportError:
        raise ValueError("the search tool needs the rank-bm25 package: pip install 'posttrain[agents]'") from None
    documents = load_corpus(corpus_path)
    tokenized = [_words(d["title"] + " " + d["text"]) for d in documents]
    index = BM25Okapi(tokenized)
    vocabularies = [set(words) for words in tokenized]

    def run(arguments: dict[str, Any], context: ToolContext) -> str:
        words = _words(arguments["query"])
        if not words:
            raise ToolFailure("the query has no words")
        scores = index.get_scores(words)
        # Documents sharing a word with the query, best first (BM25's idf is 0 for a word in half of a tiny corpus,
        # so a score of 0 does not mean "no match").
        matching = [i for i in range(len(documents)) if vocabularies[i].intersection(words)]
        ranked = sorted(matching, key=lambda i: (-scores[i], i))[:num_results]
        hits = [f"[{documents[i]['title']}] {documents[i]['text']}" for i in ranked]
        return "\n\n".join(hits) if hits else "no document matches the query"

    return Tool("search", f"Search a small document collection; returns the {num_results} best matches.",
                {"type": "object", "properties": {"query": {"type": "string", "description": "Words to look for."}},
                 "required": ["query"], "additionalProperties": False}, run, timeout_s)


