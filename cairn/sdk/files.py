"""Workflows from a Python file: what ``cairn dag apply FILE.py`` submits."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

from cairn.sdk.definition import DefinitionError, Workflow, collecting


def load_file(path: Path) -> list[Workflow]:
    """Run the file as a module (its folder first on ``sys.path``, so it may import its
    neighbours) and return every ``Workflow`` it made, in order. Its
    ``if __name__ == "__main__":`` block does not run."""
    path = path.resolve()
    if not path.is_file():
        raise DefinitionError(f"{path} is not a file")
    name = "cairn_workflows_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise DefinitionError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        with collecting() as made:
            spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
        sys.modules.pop(name, None)
    if not made:
        raise DefinitionError(f"{path} makes no Workflow")
    return made
