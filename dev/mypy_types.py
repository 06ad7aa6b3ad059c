"""What the type checker sees of the package, as text: the type of every expression mypy inferred
in the files it checks (pyproject.toml's [tool.mypy] files), every declared signature and
variable type there, each class's bases (and whether one fell back to Any), and the errors.
Two configurations that check the package the same way print the same text; this is how a
change to [tool.mypy] that skips third-party modules (follow_imports) is checked to leave the
package's checking as it was (docs/TESTS.md, "What was cut").

    python dev/mypy_types.py > before.txt      # one configuration
    python dev/mypy_types.py > after.txt       # the other; then diff the two

Run from the repository root (mypy reads pyproject.toml there). Owns nothing of the package; a
development tool only.
"""

from __future__ import annotations

import sys
import types

from mypy import build
from mypy.main import process_options
from mypy.nodes import (
    Argument,
    Block,
    Expression,
    FuncBase,
    MypyFile,
    Statement,
    SymbolTable,
    TypeInfo,
    Var,
)
from mypy.types import Type


# fields that refer to a definition elsewhere (maybe in another module), not to a child
_REFERENCES = frozenset({"node", "info", "def_var", "var", "type_info"})


def _fields(cls: type) -> list[str]:
    return [a for a in dir(cls) if not a.startswith("_") and a not in _REFERENCES
            and isinstance(getattr(cls, a, None), types.GetSetDescriptorType)]


def _expressions(tree: MypyFile) -> list[Expression]:
    """Every expression node of one module's syntax, in order (a walk over the nodes' fields:
    mypy's compiled visitors take no interpreted subclass)."""
    found: list[Expression] = []
    seen: set[int] = set()
    todo: list[object] = list(reversed(tree.defs))
    while todo:
        o = todo.pop()
        if isinstance(o, (list, tuple)):
            todo.extend(reversed(o))
            continue
        if not isinstance(o, (Statement, Expression, Block, Argument)) or id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, Expression):
            found.append(o)
        todo.extend(reversed([getattr(o, f, None) for f in _fields(type(o))]))
    return found


def _symbols(prefix: str, table: SymbolTable, out: list[str], seen: set[int]) -> None:
    for name, sym in sorted(table.items()):
        node = sym.node
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        where = f"{prefix}.{name}"
        if isinstance(node, TypeInfo) and node.fullname == where:
            bases = ", ".join(str(b) for b in node.bases)
            out.append(f"class {where}({bases}) any_base={node.fallback_to_any} "
                       f"mro={[c.fullname for c in node.mro]}")
            _symbols(where, node.names, out, seen)
        elif isinstance(node, (FuncBase, Var)) and node.fullname in (where, name):
            out.append(f"sym {where}: {node.type}")


def main() -> int:
    files, options = process_options(["--no-incremental", "--cache-dir", "/dev/null",
                                      *sys.argv[1:]])
    options.export_types = True
    options.preserve_asts = True  # else mypy frees each tree once checked
    result = build.build(files, options)
    checked = {f.module for f in files}
    lines: list[str] = []
    for module in sorted(checked):
        tree = result.files.get(module)
        if not isinstance(tree, MypyFile):
            lines.append(f"{module}: not built")
            continue
        for expr in _expressions(tree):
            typ: Type | None = result.types.get(expr)
            lines.append(f"{module}:{expr.line}:{expr.column}: {type(expr).__name__} "
                         f"{'-' if typ is None else str(typ)}")
        _symbols(module, tree.names, lines, set())
    lines.extend(f"error: {e}" for e in result.errors)
    print("\n".join(lines))
    print(f"# {len(checked)} modules, {len(lines)} lines, {len(result.errors)} errors, "
          f"{len(result.graph)} modules built", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
