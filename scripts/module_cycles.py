"""Fail on any import cycle between modules of `harness` (type-checking imports excluded)."""

from __future__ import annotations

import sys

import grimp


def main() -> int:
    graph = grimp.build_graph("harness", exclude_type_checking_imports=True)
    cycles = set()
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            path = graph.find_shortest_chain(importer=imported, imported=module)
            if path:
                cycles.add(tuple(sorted({module, *path})))
    for cycle in sorted(cycles):
        print("cycle:", " -> ".join(cycle))
    print(f"{len(graph.modules)} modules, {len(cycles)} import cycles")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
