"""The contract with SGLang, read from SGLang's published source (the
sglang wheels on PyPI, or an installed sglang), parsed with `ast`: nothing
of SGLang is imported, so neither torch nor a GPU is needed.

- SGLang's `load_cache_to_device_buffer_mla` parameters (names, order,
  defaults) are a prefix of ours, and ours adds only parameters with
  defaults; for the newest pinned release they are equal.
- Every keyword SGLang's HiSparse coordinator passes is one we accept.
- The coordinator binds the two names `install()` replaces at module level.

Where the source comes from: the wheels in $KVTIER_SGLANG_WHEELS (what
scripts/python-env.sh downloads), else an installed sglang package. With
KVTIER_REQUIRE_SGLANG_SOURCE=1 (CI) a missing source fails the test.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import zipfile
from pathlib import Path

import pytest

from kvtier.sglang import load_cache_to_device_buffer_mla

# DESIGN.md section 5: the sixteen parameters the shim must take.
DESIGN = [
    "top_k_tokens", "device_buffer_tokens", "host_cache_locs", "device_buffer_locs", "host_cache",
    "device_buffer", "top_k_device_locs", "req_pool_indices", "seq_lens", "lru_slots", "item_size_bytes",
    "num_top_k", "hot_buffer_size", "page_size", "block_size", "num_real_reqs",
]
KERNEL_FILES = ["sglang/kernels/ops/kvcache/hisparse.py", "sglang/jit_kernel/hisparse.py"]
COORDINATOR = "sglang/srt/managers/hisparse_coordinator.py"


def sources():
    """[(label, {relative path: source text})] for every SGLang source found."""
    found = []
    wheels = os.environ.get("KVTIER_SGLANG_WHEELS")
    if wheels:
        for whl in sorted(Path(wheels).glob("sglang-*.whl")):
            with zipfile.ZipFile(whl) as z:
                names = set(z.namelist())
                files = {n: z.read(n).decode() for n in KERNEL_FILES + [COORDINATOR] if n in names}
            found.append((whl.name.split("-")[1], files))
    if not found:
        spec = importlib.util.find_spec("sglang")  # locates the package without running it
        if spec is not None and spec.submodule_search_locations:
            root = Path(list(spec.submodule_search_locations)[0]).parent
            files = {n: (root / n).read_text() for n in KERNEL_FILES + [COORDINATOR] if (root / n).exists()}
            found.append(("installed", files))
    return found


SOURCES = sources()
if not SOURCES and os.environ.get("KVTIER_REQUIRE_SGLANG_SOURCE") == "1":
    raise RuntimeError("no SGLang source found: set KVTIER_SGLANG_WHEELS (scripts/python-env.sh downloads them)")

needs_source = pytest.mark.skipif(not SOURCES, reason="no SGLang source (set KVTIER_SGLANG_WHEELS or install sglang)")


def sglang_signature(files) -> list:
    """[(name, default source or None)] of SGLang's function."""
    for path in KERNEL_FILES:
        if path in files:
            for node in ast.walk(ast.parse(files[path])):
                if isinstance(node, ast.FunctionDef) and node.name == "load_cache_to_device_buffer_mla":
                    a = node.args
                    assert not a.kwonlyargs and not a.vararg and not a.kwarg, "a signature shape we do not model"
                    names = [p.arg for p in a.posonlyargs + a.args]
                    defaults = [None] * (len(names) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
                    return list(zip(names, defaults))
    raise AssertionError(f"no load_cache_to_device_buffer_mla in {sorted(files)}")


def ours() -> list:
    out = []
    for p in inspect.signature(load_cache_to_device_buffer_mla).parameters.values():
        assert p.kind == p.POSITIONAL_OR_KEYWORD, p
        out.append((p.name, None if p.default is p.empty else repr(p.default)))
    return out


def test_our_first_sixteen_parameters_are_designs():
    assert [n for n, _ in ours()[:16]] == DESIGN
    assert dict(ours())["page_size"] == "1" and dict(ours())["block_size"] == "256"
    assert dict(ours())["num_real_reqs"] == "None"


@needs_source
@pytest.mark.parametrize("label,files", SOURCES, ids=[s[0] for s in SOURCES])
def test_sglangs_signature_is_a_prefix_of_ours(label, files):
    theirs = sglang_signature(files)
    mine = ours()
    assert mine[: len(theirs)] == theirs, f"sglang {label}: {theirs} vs ours {mine}"
    assert all(default is not None for _, default in mine[len(theirs):]), "extra parameters need defaults"
    assert [n for n, _ in theirs[:16]] == DESIGN, f"sglang {label} no longer starts with DESIGN's parameters"


@needs_source
def test_the_newest_pinned_release_matches_exactly():
    label, files = max(SOURCES, key=lambda s: tuple(int(x) for x in s[0].split(".")) if s[0][0].isdigit() else ())
    assert sglang_signature(files) == ours(), f"sglang {label}"


@needs_source
@pytest.mark.parametrize("label,files", SOURCES, ids=[s[0] for s in SOURCES])
def test_the_coordinator_calls_us_with_keywords_we_take(label, files):
    tree = ast.parse(files[COORDINATOR])
    accepted = {n for n, _ in ours()}
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            keywords = {k.arg for k in node.keywords if k.arg}
            # the swap-in call: by name, or through a variable (swap_in_fn) with its keywords
            if name == "load_cache_to_device_buffer_mla" or {"top_k_tokens", "lru_slots"} <= keywords:
                calls.append((name, keywords, [k for k in node.keywords if k.arg is None]))
    assert calls, f"sglang {label}: no swap-in call found in the coordinator"
    for name, keywords, splats in calls:
        assert keywords <= accepted, f"sglang {label} passes {sorted(keywords - accepted)} to {name}"
    # module-level bindings install() replaces
    bound = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.If):  # `if is_xpu(): from sgl_kernel import ... else: from ... import ...`
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom):
                    bound |= {a.asname or a.name for a in sub.names}
    assert {"load_cache_to_device_buffer_mla", "MLATokenToKVPoolHost"} <= bound, f"sglang {label}"


@needs_source
@pytest.mark.parametrize("label,files", SOURCES, ids=[s[0] for s in SOURCES])
def test_splatted_keywords_are_ones_we_take(label, files):
    """0.5.23 passes **skip_io_kwargs and **plan: dicts built from literal keys."""
    tree = ast.parse(files[COORDINATOR])
    accepted = {n for n, _ in ours()}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            keys = {k.arg for k in node.keywords if k.arg}
            if keys & {"skip_io", "miss_src", "miss_dst", "miss_count"}:
                assert keys <= accepted, f"sglang {label} builds {sorted(keys - accepted)}"
