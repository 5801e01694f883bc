"""Finding an engine's installed package (SGLang, vLLM) and its version
without importing it: the install reports read its source, anywhere."""

from __future__ import annotations

import ast
import importlib.util
from importlib.metadata import distributions
from pathlib import Path


def package_root(name: str) -> Path | None:
    """The directory holding the importable package `name`, found without
    importing it (None when it is not installed)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def package_version(root: Path, name: str) -> str | None:
    """The version of the package `name` under `root`: its distribution's
    metadata there (not the first distribution of that name anywhere on
    the path, which may belong to another copy), else its ``_version.py``."""
    try:
        for dist in distributions(name=name, path=[str(root)]):
            return dist.version
    except Exception:  # noqa: BLE001 - no metadata: the version file
        pass
    path = root / name / "_version.py"
    text = path.read_text() if path.exists() else ""
    for node in ast.walk(ast.parse(text)) if text else []:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") in ("__version__", "version")
                                                for t in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                pass
    return None
