"""The contract with SGLang, checked against SGLang's real modules: the
pinned releases installed with `pip install --no-deps` into
$KVTIER_SGLANG_TREES/<version> (scripts/python-env.sh does it; CI sets
KVTIER_REQUIRE_SGLANG_SOURCE=1, so a missing tree fails the run). Nothing of
SGLang is imported (it needs torch and a GPU stack): kvtier's install-time
report reads each tree's source in a fresh interpreter, exactly as it does
inside a real SGLang environment.

- The supported releases (the newest three) install kvtier for every
  non-speculative entry point and every HiSparse host pool; the newest one's
  signatures equal kvtier's exactly.
- The coordinator's calls are followed (aliases, `**` splats) and every
  keyword it passes is one kvtier takes.
- What kvtier's host-pool hook assumes of each pool class holds in the
  source: the allocator is set in the constructor and the layer-first
  buffers are allocated through it, in the shapes kvtier places.
- SGLang's host-memory check runs through the budget scope kvtier uses to
  book a kvtier-backed pool against the pool's capacity instead of DRAM.
- An older release (0.5.15) gets the entry points it has.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import textwrap
import sys
from pathlib import Path

import pytest

import kvtier
from kvtier.sglang import compat

PACKAGE_ROOT = Path(kvtier.__file__).resolve().parents[1]
TREES = Path(os.environ.get("KVTIER_SGLANG_TREES", "/nonexistent"))
FOUND = sorted(p.name for p in TREES.glob("*") if (p / "sglang").is_dir()) if TREES.is_dir() else []
if os.environ.get("KVTIER_REQUIRE_SGLANG_SOURCE") == "1":
    missing = sorted(set(compat.CHECKED_VERSIONS) - set(FOUND))
    if missing:
        raise RuntimeError(f"SGLang trees {missing} not found in {TREES}: run scripts/python-env.sh")

needs = pytest.mark.skipif(not FOUND, reason="no SGLang trees (set KVTIER_SGLANG_TREES; scripts/python-env.sh)")

REPORT = """
import json, kvtier.sglang as k
from kvtier.sglang import compat
r = k.report()
root = compat.sglang_root()
kw = compat.coordinator_keywords((root / compat.COORDINATOR_FILE).read_text())
print(json.dumps({"installs": r.installs, "refusal": r.refusal, "version": r.sglang_version, "root": str(root),
                  "routes": {x.name: [x.served_by, x.why] for x in r.routes},
                  "keywords": {n: sorted(v) for n, v in kw.items()}, "lines": r.lines()}))
"""


def report_of(version: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TREES / version), str(PACKAGE_ROOT)]))
    run = subprocess.run([sys.executable, "-c", REPORT], env=env, capture_output=True, text=True, timeout=120,
                         cwd=TREES)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@needs
@pytest.mark.parametrize("version", [v for v in FOUND if v in compat.CHECKED_VERSIONS])
def test_supported_releases_get_every_non_speculative_path(version):
    r = report_of(version)
    assert r["root"] == str(TREES / version), "the report read this tree"
    assert r["installs"] and r["version"] == version, r["refusal"]
    routes = r["routes"]
    for name in compat.ENTRY_POINTS + compat.HOST_POOLS:
        assert routes[name][0] == "kvtier", (name, routes[name])
    if compat.SPEC in routes:
        # kvtier's takes every argument SGLang's coordinator passes (its
        # `**plan` splat included), yet SGLang's kernel keeps the path until
        # kvtier's is measured against it on a GPU
        assert routes[compat.SPEC] == ["SGLang", compat.SPEC_LEFT], routes[compat.SPEC]
    assert len(r["lines"]) == 1 + len(routes) and r["lines"][0].startswith(f"kvtier: would install into SGLang {version}")


ENGRAM_REPORT = """
import json, sys, kvtier.sglang as k
r = k.report({"engram_tables": {"store": "/dev/shm/kvtier-tables", "gather": True}} if sys.argv[1] == "on" else None)
print(json.dumps({x.name: [x.served_by, x.why] for x in r.routes}))
"""


def engram_routes_of(version: str, config: str, host_table: str = "1") -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TREES / version), str(PACKAGE_ROOT)]),
               SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=host_table)
    run = subprocess.run([sys.executable, "-c", ENGRAM_REPORT, config], env=env, capture_output=True, text=True,
                         timeout=120, cwd=TREES)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@needs
@pytest.mark.parametrize("version", [v for v in FOUND if v in compat.CHECKED_VERSIONS])
def test_the_engram_host_table_and_gather_are_served_by_choice(version):
    """Every supported release's engram module has what kvtier's table
    replaces (the three methods, the names it reads) and an engram_gather
    kvtier's takes every call of (0.5.23 adds sort_ids; the older ones do
    not have it, and kvtier's default is theirs): served when the config
    asks, SGLang's own otherwise."""
    on = engram_routes_of(version, "on")
    assert on["_HostTable"][0] == "kvtier", on["_HostTable"]
    assert on["engram_gather"][0] == "kvtier", on["engram_gather"]
    off = engram_routes_of(version, "off")
    assert off["_HostTable"] == ["SGLang", "engram_tables is off in the kvtier config"]
    assert off["engram_gather"] == ["SGLang", compat.ENGRAM_GATHER_LEFT]
    # the config asks, but SGLang keeps the tables in HBM: said, not claimed
    hbm = engram_routes_of(version, "on", host_table="0")
    assert hbm["_HostTable"][0] == "SGLang" and "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE" in hbm["_HostTable"][1]


@needs
def test_an_engram_module_kvtier_does_not_know_is_left_to_sglang(tmp_path):
    """A renamed parameter of a method the table replaces, and an
    engram_gather with a parameter kvtier lacks: each route says why, and
    the rest of the install is unaffected."""
    newest = max(FOUND, key=lambda v: tuple(map(int, v.split("."))))
    tree = tmp_path / "tree"
    import shutil

    shutil.copytree(TREES / newest, tree, symlinks=True)
    engram = tree / compat.ENGRAM_FILE
    engram.write_text(engram.read_text().replace("def _load_rows(self, param", "def _load_rows(self, p"))
    gather = tree / compat.ENGRAM_GATHER_FILE
    gather.write_text(gather.read_text().replace("sort_ids: bool = False,", "sort_ids: bool = False, fused=None,"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(PACKAGE_ROOT)]),
               SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE="1")
    run = subprocess.run([sys.executable, "-c", ENGRAM_REPORT, "on"], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    routes = json.loads(run.stdout)
    assert routes["_HostTable"][0] == "SGLang" and "_load_rows" in routes["_HostTable"][1], routes["_HostTable"]
    assert routes["engram_gather"][0] == "SGLang" and "fused" in routes["engram_gather"][1], routes["engram_gather"]
    assert routes["load_cache_to_device_buffer_mla"][0] == "kvtier"


@needs
def test_the_newest_release_has_kvtiers_signatures_exactly():
    newest = max(compat.CHECKED_VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
    if newest not in FOUND:
        pytest.skip(f"no tree for {newest}")
    r = report_of(newest)
    for name in compat.ENTRY_POINTS:
        assert r["routes"][name] == ["kvtier", "same signature as SGLang's"], name


@needs
@pytest.mark.parametrize("version", FOUND)
def test_the_coordinators_keywords_are_followed_and_taken(version):
    r = report_of(version)
    kw = r["keywords"]
    ours = {n: {p.name for p in compat.params_of_function(f)} for n, f in compat.served_functions().items()}
    assert kw.get("load_cache_to_device_buffer_mla"), "the swap-in call is found"
    for name, keywords in kw.items():
        if name in ours:
            assert set(keywords) <= ours[name], (name, sorted(set(keywords) - ours[name]))
    if tuple(map(int, version.split("."))) >= (0, 5, 20):
        # passed through `**skip_io_kwargs` and `**plan` dict literals
        assert {"skip_io", "miss_src", "miss_dst", "miss_count"} <= set(kw["load_cache_to_device_buffer_mla"])
        assert {"is_dsv4_layout", "num_blocks"} <= set(kw["copy_cache_planned_mla"])


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _method(cls: ast.ClassDef, name: str):
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _assigns_self(fn, attr: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.ctx, ast.Store) and
               isinstance(n.value, ast.Name) and n.value.id == "self" for n in ast.walk(fn))


def _passes_self_allocator(fn) -> bool:
    return any(isinstance(n, ast.keyword) and n.arg == "allocator" and ast.unparse(n.value) == "self.allocator"
               for n in ast.walk(fn))


@needs
@pytest.mark.parametrize("version", [v for v in FOUND if v in compat.CHECKED_VERSIONS])
def test_the_host_pool_hook_holds_in_sglangs_source(version):
    root = TREES / version / "sglang/srt/mem_cache"
    host = ast.parse((root / "memory_pool_host.py").read_text())
    dsv4 = _method(_class(host, "DeepSeekV4PagedHostPool"), "__init__")
    # the constructor sets the allocator and the layer count, then allocates
    # one [pages, item_bytes] buffer per layer through self.allocator
    assert _assigns_self(dsv4, "allocator") and _assigns_self(dsv4, "layer_num") and _passes_self_allocator(dsv4)
    assert "(num_host_pages, self.item_bytes)" in ast.unparse(dsv4)
    base = ast.parse((root / "pool_host/base.py").read_text())
    assert _assigns_self(_method(_class(base, "HostKVCache"), "__init__"), "allocator")
    mla = _method(_class(ast.parse((root / "pool_host/mla.py").read_text()), "MLATokenToKVPoolHost"), "init_kv_buffer")
    assert _passes_self_allocator(mla) and "(self.layer_num, self.size, 1, self.kv_cache_dim)" in ast.unparse(mla)
    mha_tree = ast.parse((root / "pool_host/mha.py").read_text())
    mha = _method(_class(mha_tree, "MHATokenToKVPoolHost"), "init_kv_buffer")
    assert _passes_self_allocator(mha) and "(2, self.layer_num, self.size, self.head_num, self.head_dim)" in \
        ast.unparse(mha)
    hisparse_mha = _class(mha_tree, "HiSparseMHATokenToKVPoolHost")
    assert any(getattr(b, "id", "") == "MHATokenToKVPoolHost" for b in hisparse_mha.bases)
    assert _method(hisparse_mha, "init_kv_buffer") is None, "it allocates with its base's init_kv_buffer"
    assert "layout='layer_first'" in ast.unparse(_method(hisparse_mha, "__init__"))


def _function(tree: ast.Module, name: str):
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _calls(fn, name: str) -> bool:
    return any(isinstance(n, ast.Call) and ast.unparse(n.func) == name for n in ast.walk(fn))


@needs
@pytest.mark.parametrize("version", [v for v in FOUND if v in compat.CHECKED_VERSIONS])
def test_the_host_memory_check_books_against_sglangs_scope(version):
    """kvtier books a kvtier-backed host pool against the kvtier pool's
    capacity by running its constructor inside SGLang's
    host_memory_budget_scope: the scope sets the context variable the check
    reads first, and every HiSparse host pool's check goes through it."""
    root = TREES / version / "sglang/srt/mem_cache"
    base = ast.parse((root / "pool_host/base.py").read_text())
    scope = _function(base, "host_memory_budget_scope")
    budget = _function(base, "host_memory_budget_bytes")
    assert any(ast.unparse(d).endswith("contextmanager") for d in scope.decorator_list)
    var = next(ast.unparse(n.func.value) for n in ast.walk(scope)
               if isinstance(n, ast.Call) and ast.unparse(n.func).endswith(".set"))
    first = next(n for n in budget.body if not isinstance(n, ast.Expr))  # after the docstring
    assert ast.unparse(first).startswith(f"available = {var}.get()"), ast.unparse(first)
    cache = _class(base, "HostKVCache")
    init = _method(cache, "__init__")
    if _calls(init, "self._allocate_host_buffer"):  # 0.5.22 on
        assert _calls(_method(cache, "_allocate_host_buffer"), "host_memory_budget_bytes")
    else:
        assert _calls(init, "host_memory_budget_bytes")
    mla = _class(ast.parse((root / "pool_host/mla.py").read_text()), "MLATokenToKVPoolHost")
    mha_tree = ast.parse((root / "pool_host/mha.py").read_text())
    for cls in [mla, _class(mha_tree, "MHATokenToKVPoolHost"), _class(mha_tree, "HiSparseMHATokenToKVPoolHost")]:
        assert _method(cls, "_allocate_host_buffer") is None, f"{cls.name} checks as HostKVCache does"
    host_src = (root / "memory_pool_host.py").read_text()
    dsv4 = _method(_class(ast.parse(host_src), "DeepSeekV4PagedHostPool"), "__init__")
    assert _calls(dsv4, "host_memory_budget_bytes")
    assert "from sglang.srt.mem_cache.pool_host.base import" in host_src and "host_memory_budget_bytes," in host_src


@needs
@pytest.mark.parametrize("version", [v for v in FOUND if v in compat.CHECKED_VERSIONS])
def test_each_decode_step_backs_up_through_a_method_kvtier_polls_in(version):
    """The per-step poll for bad indices rides on the host pool's backup,
    which the coordinator calls on the host every decode step."""
    from kvtier.sglang.host_pool import PER_STEP_METHODS

    tree = ast.parse((TREES / version / compat.COORDINATOR_FILE).read_text())
    step = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_eager_backup_previous_token")
    called = {n.func.attr for n in ast.walk(step) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and ast.unparse(n.func.value) == "self.mem_pool_host"}
    backups = {name for name in called if "backup" in name}
    assert backups and backups <= set(PER_STEP_METHODS), called


@needs
@pytest.mark.parametrize("version", [v for v in FOUND if v in compat.CHECKED_VERSIONS])
def test_sglang_serve_is_the_cli_main_the_launcher_calls(version):
    root = TREES / version
    scripts = (next(root.glob("sglang-*.dist-info")) / "entry_points.txt").read_text()
    assert "sglang = sglang.cli.main:main" in scripts
    main = _function(ast.parse((root / "sglang/cli/main.py").read_text()), "main")
    assert "'serve'" in ast.unparse(main) and "parse_known_args()" in ast.unparse(main)  # reads sys.argv
    sparse = (root / "sglang/srt/mem_cache/sparsity/factory.py").read_text()
    assert 'extra_config.pop("device_buffer_size", 2 * top_k)' in sparse, "the hot buffer's default kvtier assumes"
    assert 'extra_config.pop("top_k", 2048)' in sparse


@needs
def test_an_older_release_gets_the_paths_it_has():
    if "0.5.15" not in FOUND:
        pytest.skip("no 0.5.15 tree")
    r = report_of("0.5.15")
    assert r["installs"], r["refusal"]
    routes = r["routes"]
    assert routes["load_cache_to_device_buffer_mla"][0] == "kvtier"
    assert routes["load_cache_to_device_buffer_dsv4_mla"][0] == "kvtier"
    assert routes["copy_cache_planned_mla"][0] == "absent" and routes["load_blocks_to_device_buffer_mha"][0] == "absent"
    assert "not one of the versions kvtier is checked against" in r["lines"][0]


def test_signature_comparison():
    """incompatibility() on hand-made signatures (what the trees exercise less)."""
    P = compat.Param
    ours = [P("a", "positional", None), P("b", "positional", "1"), P("c", "positional", "None")]
    assert compat.incompatibility(ours, ours) is None
    assert compat.incompatibility(ours[:2], ours) is None, "kvtier may add parameters with defaults"
    assert "`d`" in compat.incompatibility(ours + [P("d", "positional", "None")], ours)
    assert "defaults to 2" in compat.incompatibility([ours[0], P("b", "positional", "2")], ours)
    assert "keyword" in compat.incompatibility([P("a", "keyword", None)], ours)
    assert "**kw" in compat.incompatibility([P("**kw", "var", None)], ours)
    assert "positional parameter 0" in compat.incompatibility([P("b", "positional", "1")], ours)


def test_a_forwarded_splat_is_followed_only_into_the_speculative_entry_point():
    """A function passing on its own `**kw`: into the speculative entry point
    its keywords are taken from dicts of that name built elsewhere in the
    module (SGLang 0.5.22+'s manager); into a served entry point the splat
    stays unknown, so install() refuses it rather than trust a name match."""
    source = textwrap.dedent(
        f"""
        def caller(x):
            plan = dict(miss_src=1, miss_dst=2, miss_count=3)
            forward(x, **plan)

        def forward(x, **plan):
            {compat.SPEC}(top_k_tokens=x, **plan)
            load_cache_to_device_buffer_mla(top_k_tokens=x, **plan)
        """
    )
    kw = compat.coordinator_keywords(source)
    assert kw[compat.SPEC] == {"top_k_tokens", "miss_src", "miss_dst", "miss_count"}
    assert kw["load_cache_to_device_buffer_mla"] == {"top_k_tokens", "**plan"}


def test_the_report_prints_the_measured_speed_under_the_route_it_concerns():
    """Where kvtier serves the DSA swap-in, the report says how it measured
    against SGLang's kernel, the regime where it is slower included; where
    SGLang serves it, the figures are not kvtier's to print."""
    served = compat.Route("load_cache_to_device_buffer_mla", "kvtier", "same signature as SGLang's").line()
    assert served.splitlines()[1].strip() == compat.MEASURED["load_cache_to_device_buffer_mla"]
    assert "slower at 4 of them, by the most at batch 256" in served
    left = compat.Route("load_cache_to_device_buffer_mla", "SGLang", "platform is ROCm").line()
    assert "\n" not in left
    assert "\n" not in compat.Route("copy_cache_planned_mla", "kvtier", "same signature as SGLang's").line()
