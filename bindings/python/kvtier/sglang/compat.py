"""What kvtier serves in the SGLang it finds, and why.

SGLang's HiSparse coordinator (``sglang.srt.managers.hisparse_coordinator``)
calls five kernel entry points and builds one of three host pools, all looked
up as module globals. kvtier replaces an entry point only where its own
function accepts every call SGLang's accepts, with the same meaning: each of
SGLang's parameters at the same place, of the same kind, with the same
default, and every keyword the coordinator passes. If any entry point SGLang
has differs from what kvtier knows (a newer SGLang passing arguments kvtier
does not understand), or the platform is not CUDA, nothing is installed and
SGLang runs unchanged: a refusal at start-up, never a ``TypeError`` at the
first decode step.

The checks read SGLang's source (no SGLang module is imported, so they run
anywhere, GPU or not), and are repeated on the live functions when the
coordinator module is patched.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .._lib import library
from .._packages import package_root, package_version
from .._swap_in import swap_in_limits
from ._config import load_config
from .capacity import device_problem, device_warnings
from .engram import engram_gather
from .entry_points import SERVED

COORDINATOR = "sglang.srt.managers.hisparse_coordinator"
COORDINATOR_FILE = "sglang/srt/managers/hisparse_coordinator.py"
KERNEL_FILES = ("sglang/kernels/ops/kvcache/hisparse.py", "sglang/jit_kernel/hisparse.py")
# The SGLang releases kvtier is checked against (CI reads each one's source).
CHECKED_VERSIONS = ("0.5.21", "0.5.22", "0.5.23")
SPEC = "load_cache_to_device_buffer_spec_mla"
# Why install() leaves the speculative swap-in to SGLang even where the
# signatures match: kvtier replaces a kernel only where it is measured not
# slower than SGLang's, and its speculative kernel is slower at almost every
# point measured (an H100 on 2026-11-25; an H200 and an H100 on 2026-11-26).
SPEC_LEFT = (
    "same signature as SGLang's, but kvtier's speculative kernel, exact on an H100 and an H200, is slower than "
    "SGLang's at 15 of the 16 points of its grid on an H200 (0.19-0.93x, 1.00x at the 16th, 2026-11-26), so "
    "SGLang's kernel serves it"
)
# What the single-step swap-in measured against SGLang 0.5.23's own kernel
# (H200, 2026-11-28, bench/results/h200-2026-11-28c: the default, composed
# from its split-planner and fixed-shape line-aligned rows), printed under
# the route it concerns so that a user sees where kvtier is slower.
MEASURED = {
    "load_cache_to_device_buffer_mla": (
        "with the default strategy (on sm_90 the split planner up to batch 10, the one-launch few-miss planner's "
        "fixed-shape build with line-aligned copies above), measured on an H200 against SGLang 0.5.23's kernel "
        "(2026-11-28): 1.10x its speed at the median of 54 single calls (0.77-2.49x; 1.8-2.5x at batch 1 with "
        "hundreds of misses), slower at 4 of them, by the most at batch 256 with 2 misses per request (0.77x at "
        "HOT 4096, 0.94x at 8192); a whole DeepSeek-V3.2 decode step at 128K context, every layer's swap-in in a "
        "CUDA graph at 13.4 % misses: 1.13x at batch 8, 0.97x at batch 64 (there with the fixed-shape build's "
        "warp-vector copies, the default of the commit that ran it)"
    ),
}
HOST_POOLS = ("MLATokenToKVPoolHost", "DeepSeekV4PagedHostPool", "HiSparseMHATokenToKVPoolHost")
# HiCache builds its KV host pools (L2) in this module, from two of its
# globals: the MLA pool class, and the function that picks the MHA one.
ASSEMBLER = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
ASSEMBLER_FILE = "sglang/srt/mem_cache/hybrid_cache/hybrid_pool_assembler.py"
# {route: (SGLang's pool class, the assembler's global that gives it, the
# --hicache-mem-layout values the class builds)}
HICACHE_POOLS = {
    "HiCache MHATokenToKVPoolHost": (
        "MHATokenToKVPoolHost", "get_mha_host_pool_cls", ("layer_first", "page_first", "page_first_direct",
                                                          "page_head")),
    "HiCache MLATokenToKVPoolHost": (
        "MLATokenToKVPoolHost", "MLATokenToKVPoolHost", ("layer_first", "page_first", "page_first_direct",
                                                         "page_first_kv_split")),
}
ENTRY_POINTS = (
    "load_cache_to_device_buffer_mla",
    "load_cache_to_device_buffer_dsv4_mla",
    "copy_cache_planned_mla",
    "load_blocks_to_device_buffer_mha",
)
USED_FOR = {
    "load_cache_to_device_buffer_mla": "DSA decode (DeepSeek-V3.2, GLM)",
    "load_cache_to_device_buffer_dsv4_mla": "DeepSeek-V4 decode",
    "copy_cache_planned_mla": "shared-index layers",
    "load_blocks_to_device_buffer_mha": "MiniMax-M3 decode",
    SPEC: "MTP/EAGLE verify",
    "MLATokenToKVPoolHost": "DSA host KV",
    "DeepSeekV4PagedHostPool": "DeepSeek-V4 host KV",
    "HiSparseMHATokenToKVPoolHost": "MiniMax-M3 host KV",
    "HiCache MHATokenToKVPoolHost": "HiCache's L2, MHA",
    "HiCache MLATokenToKVPoolHost": "HiCache's L2, MLA",
    "_HostTable": "DeepSeek-V4.1 Engram host tables",
    "engram_gather": "DeepSeek-V4.1 Engram lookups",
}
ENGRAM_FILE = "sglang/srt/layers/engram.py"
ENGRAM_GATHER_FILE = "sglang/kernels/ops/embeddings/engram_gather.py"
# What kvtier's engram table relies on in SGLang's engram module: the
# methods it replaces (with their parameters) and the names it reads.
ENGRAM_METHODS = {
    "_init_host_table": ["self", "num_embeddings", "dim", "layer_id"],
    "_load_rows": ["self", "param", "loaded_weight"],
    "finish_load": ["self", "label"],
}
ENGRAM_NAMES = ("_HostTable", "engram_gather", "envs", "get_parallel", "get_model", "FP8_BLOCK_SIZE")
ENGRAM_GATHER_LEFT = (
    "SGLang's Triton kernel serves it; kvtier's has the same signature and is installed only by choice "
    "(engram_tables.gather): on an H200 it was 1.3-1.6x SGLang's speed on a table in GPU memory (read in "
    "the ids' order, as SGLang reads it), but 0.87-0.95x at 3 of 5 points reading a host table in address "
    "order, SGLang's way on a GPU without ATS (2026-11-26)"
)


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "positional" (positional-or-keyword) or "keyword" (keyword-only)
    default: str | None  # the default's source text, None when required


@dataclass
class Route:
    """Who serves one of SGLang's names, and why."""

    name: str
    served_by: str  # "kvtier", "SGLang" or "absent"
    why: str

    def line(self) -> str:
        use = USED_FOR.get(self.name, "")
        who = {"kvtier": "kvtier", "SGLang": "SGLang", "absent": "-"}[self.served_by]
        line = f"  {self.name:<38} {who:<7} {use + ': ' if use else ''}{self.why}"
        measured = MEASURED.get(self.name) if self.served_by == "kvtier" else None
        return line + (f"\n  {'':<38} {'':<7} {measured}" if measured else "")


@dataclass
class Report:
    """What :func:`kvtier.sglang.install` does in this environment."""

    sglang_version: str | None = None
    platform: str = "unknown"
    installs: bool = False
    refusal: str | None = None
    routes: list = field(default_factory=list)
    config: object = None  # the KvtierConfig install() used
    warnings: list = field(default_factory=list)  # served, but not as the user may expect
    dry_run: bool = True  # report(): what install would do; install() sets False

    def served(self, name: str) -> bool:
        return any(r.name == name and r.served_by == "kvtier" for r in self.routes)

    def lines(self) -> list:
        if not self.installs:
            did = "would not install" if self.dry_run else "not installed"
            return [f"kvtier: {did} into SGLang ({self.refusal}); SGLang runs unchanged"]
        checked = (
            "" if self.sglang_version in CHECKED_VERSIONS
            else f"; not one of the versions kvtier is checked against ({', '.join(CHECKED_VERSIONS)}), "
                 "served because its entry points match"
        )
        did = "would install" if self.dry_run else "installed"
        head = f"kvtier: {did} into SGLang {self.sglang_version or '(version unknown)'} on {self.platform}{checked}"
        return [head] + [r.line() for r in self.routes] + [f"  warning: {w}" for w in self.warnings]

    def __str__(self) -> str:
        return "\n".join(self.lines())


# ---- signatures ---------------------------------------------------------------


def params_of_function(fn) -> list:
    """kvtier's (or a live SGLang function's) parameters."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            out.append(Param(("*" if p.kind == p.VAR_POSITIONAL else "**") + p.name, "var", None))
            continue
        kind = "keyword" if p.kind == p.KEYWORD_ONLY else "positional"
        out.append(Param(p.name, kind, None if p.default is p.empty else repr(p.default)))
    return out


def params_of_source(node: ast.FunctionDef) -> list:
    """The parameters of a function definition in SGLang's source."""
    a = node.args
    out = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + [_literal(d) for d in a.defaults]
    out += [Param(p.arg, "positional", d) for p, d in zip(positional, defaults)]
    if a.vararg:
        out.append(Param("*" + a.vararg.arg, "var", None))
    out += [Param(p.arg, "keyword", None if d is None else _literal(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append(Param("**" + a.kwarg.arg, "var", None))
    return out


_ARITH = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
          ast.FloorDiv: lambda a, b: a // b, ast.Pow: lambda a, b: a**b, ast.LShift: lambda a, b: a << b}


def _int_arith(node: ast.AST) -> int:
    """The value of integer arithmetic on literals (``2**62``, ``1 << 20``);
    ValueError for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_int_arith(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        a, b = _int_arith(node.left), _int_arith(node.right)
        if isinstance(node.op, (ast.Pow, ast.LShift)) and not 0 <= b <= 256:
            raise ValueError("exponent out of range")
        return _ARITH[type(node.op)](a, b)
    raise ValueError("not integer arithmetic")


def _literal(node: ast.AST) -> str:
    """A default's value as repr() writes it: literals and integer arithmetic
    on them evaluated (source text for anything else)."""
    try:
        return repr(ast.literal_eval(node))
    except ValueError:
        pass
    try:
        return repr(_int_arith(node))
    except (ValueError, ZeroDivisionError):
        return ast.unparse(node)


def incompatibility(theirs: list, ours: list) -> str | None:
    """Why kvtier's function cannot stand in for SGLang's (None: it can).
    Every one of SGLang's parameters must be kvtier's at the same position,
    of the same kind and default; kvtier may add parameters with defaults."""
    for p in theirs:
        if p.kind == "var":
            return f"SGLang's takes {p.name}, arguments kvtier cannot check"
    by_name = {p.name: p for p in ours}
    for i, p in enumerate(theirs):
        mine = by_name.get(p.name)
        if mine is None:
            return f"SGLang's takes `{p.name}`, which kvtier does not know"
        if p.kind == "positional" and (i >= len(ours) or ours[i].name != p.name):
            return f"SGLang's `{p.name}` is positional parameter {i}, kvtier's is not"
        if mine.kind != p.kind:
            return f"SGLang's `{p.name}` is {p.kind}, kvtier's is {mine.kind}"
        if mine.default != p.default:
            return f"SGLang's `{p.name}` defaults to {p.default}, kvtier's to {mine.default}"
    extra = [p.name for p in ours if p.name not in {q.name for q in theirs} and p.default is None]
    if extra:
        return f"kvtier's needs {extra}, which SGLang's does not take"
    return None


def coordinator_keywords(source: str) -> dict:
    """{entry point: keywords the coordinator passes it} from the
    coordinator's source, following `fn = a if c else b` aliases and `**kw`
    splats of dict literals built in the same function, or, for a splat of a
    function's own `**kw` parameter into the speculative entry point (0.5.22+'s
    speculative manager passes on its caller's miss plan that way), of dict
    literals of that name built in the module's other functions; a splat it
    cannot follow is recorded as the keyword `**name` (which refuses a served
    entry point: a name match across functions is too loose to serve by)."""
    tree = ast.parse(source)
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    per_function: list = []
    module_dicts: dict = {}
    for func in functions:
        aliases: dict = {}
        dict_keys: dict = {}
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                target, value = node.targets[0].id, node.value
                names = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
                known = names & set(ENTRY_POINTS + (SPEC,))
                if known and not isinstance(value, ast.Call):
                    aliases[target] = known
                keys = set()
                for sub in ast.walk(value):
                    if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "dict":
                        keys |= {k.arg for k in sub.keywords if k.arg}
                    elif isinstance(sub, ast.Dict):
                        keys |= {k.value for k in sub.keys if isinstance(k, ast.Constant)}
                if isinstance(value, (ast.Dict, ast.IfExp, ast.Call)) and (keys or _is_dictish(value)):
                    dict_keys[target] = keys
                    module_dicts.setdefault(target, set()).update(keys)
        per_function.append((func, aliases, dict_keys))
    calls: dict = {}
    for func, aliases, dict_keys in per_function:
        own_kwargs = func.args.kwarg.arg if func.args.kwarg else None
        for node in ast.walk(func):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            targets = aliases.get(name, {name} if name in ENTRY_POINTS + (SPEC,) else set())
            if not targets:
                continue
            keywords = {k.arg for k in node.keywords if k.arg}
            for k in node.keywords:
                if k.arg is None:
                    splat = k.value.id if isinstance(k.value, ast.Name) else None
                    if splat in dict_keys:
                        keywords |= dict_keys[splat]
                    elif splat is not None and splat == own_kwargs and splat in module_dicts and targets == {SPEC}:
                        keywords |= module_dicts[splat]
                    else:
                        keywords.add(f"**{splat or ast.unparse(k.value)}")
            for t in targets:
                calls.setdefault(t, set()).update(keywords)
    return calls


def _is_dictish(value: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Dict) or (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "dict")
        for n in ast.walk(value)
    )


def module_names(source: str) -> set:
    """Names the coordinator binds at module level (imports, also inside
    `if is_xpu(): ... else: ...`, and definitions)."""
    names = set()
    for node in ast.parse(source).body:
        for sub in ast.walk(node) if isinstance(node, ast.If) else [node]:
            if isinstance(sub, ast.ImportFrom):
                names |= {a.asname or a.name for a in sub.names}
            elif isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                names.add(sub.name)
    return names


# ---- finding SGLang -----------------------------------------------------------


def sglang_root() -> Path | None:
    """The directory holding the importable `sglang` package, found without
    importing it (None when SGLang is not installed)."""
    return package_root("sglang")


def sglang_version(root: Path) -> str | None:
    """The version of the SGLang package under `root`."""
    return package_version(root, "sglang")


def platform() -> tuple:
    """(name, refusal or None): kvtier's kernels are CUDA; ROCm and XPU
    builds of torch are left to SGLang's own kernels."""
    try:
        import torch
    except Exception:
        return "CPU only (no torch)", None
    if getattr(torch.version, "hip", None):
        return f"ROCm {torch.version.hip}", "ROCm: kvtier's kernels are CUDA"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and getattr(xpu, "is_available", lambda: False)():
        return "XPU", "XPU: kvtier's kernels are CUDA"
    cuda = getattr(torch.version, "cuda", None)
    if not cuda:
        return "CPU only (torch without CUDA)", None
    # a CUDA build of torch on a machine without a GPU (or with none visible)
    # is not a CUDA platform: only CPU tensors, served by the CPU executor.
    # is_available() counts devices without creating a context, so a process
    # that forks later is unharmed.
    if not torch.cuda.is_available():
        return f"CPU only (torch built for CUDA {cuda}, no GPU visible)", None
    return f"CUDA {cuda}", None


# ---- the report ---------------------------------------------------------------


def served_functions() -> dict:
    return SERVED


def check_entry_points(theirs: dict, coordinator_source: str | None) -> tuple:
    """(routes, refusal) for SGLang's entry points: `theirs` maps each name
    SGLang has to its parameter list."""
    ours = served_functions()
    keywords = coordinator_keywords(coordinator_source) if coordinator_source else {}

    def mismatch(name: str) -> tuple:
        """(kvtier's parameters, why SGLang's `name` cannot take kvtier's, or None)."""
        mine = params_of_function(ours[name])
        why = incompatibility(theirs[name], mine)
        unknown = sorted(keywords.get(name, set()) - {p.name for p in mine})
        if why is None and unknown:
            why = f"the coordinator passes {unknown}, which kvtier does not know"
        return mine, why

    routes, problems = [], []
    for name in ENTRY_POINTS:
        if name not in theirs:
            routes.append(Route(name, "absent", "not in this SGLang"))
            continue
        mine, why = mismatch(name)
        if why:
            problems.append(f"{name}: {why}")
            routes.append(Route(name, "SGLang", why))
        elif theirs[name] == mine:
            routes.append(Route(name, "kvtier", "same signature as SGLang's"))
        else:
            routes.append(Route(name, "kvtier", "takes every argument SGLang's takes, alike"))
    if SPEC in theirs:
        # Not served yet, so never a reason to refuse the rest.
        _, why = mismatch(SPEC)
        routes.append(Route(SPEC, "SGLang", f"kvtier's speculative swap-in differs: {why}" if why else SPEC_LEFT))
    return routes, ("; ".join(problems) or None)


def host_pool_routes(names: set, config) -> list:
    problem = device_problem(config.devices) if config is not None and config.host_pool else None
    routes = []
    for pool in HOST_POOLS:
        if pool not in names:
            routes.append(Route(pool, "absent", "not in this SGLang"))
        elif config is not None and not config.host_pool:
            routes.append(Route(pool, "SGLang", "host_pool is off in the kvtier config"))
        elif config is not None and problem:
            routes.append(Route(pool, "SGLang", problem))
        else:
            where = ", ".join(config.devices) if config is not None else "anon"
            routes.append(Route(pool, "kvtier", f"layer-first buffers in a kvtier pool on {where}"))
    return routes


def hicache_pool_routes(root: Path, config) -> list:
    """Who serves HiCache's host KV pools, from the assembler's source."""
    path = root / ASSEMBLER_FILE
    names = module_names(path.read_text()) if path.exists() else set()
    problem = device_problem(config.devices) if config is not None and config.hicache_host_pool else None
    routes = []
    for route, (_, name, layouts) in HICACHE_POOLS.items():
        if name not in names:
            routes.append(Route(route, "absent", f"no {name} in SGLang's host-pool assembler"))
        elif config is not None and not config.hicache_host_pool:
            routes.append(Route(route, "SGLang", "hicache_host_pool is off in the kvtier config"))
        elif problem:
            routes.append(Route(route, "SGLang", problem))
        else:
            where = ", ".join(config.devices) if config is not None else "anon"
            routes.append(Route(route, "kvtier", f"under --enable-hierarchical-cache, in a kvtier pool on {where}, "
                                f"--hicache-mem-layout {', '.join(layouts[:-1])} or {layouts[-1]} (not under a "
                                "storage backend that brings its own allocator)"))
    return routes


def engram_routes(root: Path, config) -> list:
    """Who serves SGLang's Engram host table and gather, from its source."""
    path = root / ENGRAM_FILE
    if not path.exists():
        return [Route(n, "absent", "not in this SGLang") for n in ("_HostTable", "engram_gather")]
    tree = ast.parse(path.read_text())
    names = module_names(path.read_text()) | {
        t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    embed = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngramEmbedding"), None)
    problems = [f"no {n}" for n in ENGRAM_NAMES if n not in names]
    if embed is None:
        problems.append("no EngramEmbedding")
    else:
        methods = {n.name: [a.arg for a in n.args.args] for n in embed.body if isinstance(n, ast.FunctionDef)}
        for name, params in ENGRAM_METHODS.items():
            if methods.get(name) != params:
                problems.append(f"EngramEmbedding.{name} is {methods.get(name)}, kvtier knows {params}")
    tables = (config.engram_tables or {}) if config is not None else {}
    host_table_on = _env_true("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE")
    if problems:
        table = Route("_HostTable", "SGLang", "SGLang's engram module differs from what kvtier knows: "
                      + "; ".join(problems))
    elif not tables.get("store"):
        table = Route("_HostTable", "SGLang", "engram_tables is off in the kvtier config")
    elif not host_table_on:
        table = Route("_HostTable", "SGLang", "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE is not set, so SGLang keeps "
                      "the Engram tables in HBM; set it to 1 for kvtier's tables")
    else:
        peer = (" (but SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS is set: at TP > 1 it takes precedence and the tables stay "
                "in HBM shards)" if _env_true("SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS") else "")
        table = Route("_HostTable", "kvtier", f"each table a file in kvtier's table store {tables['store']}, "
                      "loaded once per key, attached by every start and instance (with "
                      f"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE){peer}")
    gather_src = root / ENGRAM_GATHER_FILE
    theirs = None
    if gather_src.exists():
        fn = next((n for n in ast.parse(gather_src.read_text()).body
                   if isinstance(n, ast.FunctionDef) and n.name == "engram_gather"), None)
        theirs = params_of_source(fn) if fn is not None else None
    why = "not found in SGLang's kernels" if theirs is None else incompatibility(
        theirs, params_of_function(engram_gather))
    if why:
        gather = Route("engram_gather", "SGLang", f"kvtier's differs: {why}")
    elif not tables.get("gather"):
        gather = Route("engram_gather", "SGLang", ENGRAM_GATHER_LEFT)
    elif problems:
        gather = Route("engram_gather", "SGLang", "SGLang's engram module differs from what kvtier knows")
    elif not kernels_built():
        gather = Route("engram_gather", "SGLang", "this libkvtier.so has no CUDA kernels")
    else:
        gather = Route("engram_gather", "kvtier", "same signature as SGLang's (engram_tables.gather)")
    return [table, gather]


def _env_true(name: str) -> bool:
    """An SGLang boolean environment variable as SGLang reads it."""
    return os.environ.get(name, "").lower() in ("true", "1", "yes", "y")


def kernels_built() -> bool:
    """Whether the loaded library carries its CUDA kernels."""
    return bool(library().kvt_kernels_built())


def hisparse_limit_refusal(hisparse_config) -> str | None:
    """Why kvtier's swap-in cannot serve SGLang's `--hisparse-config` (a JSON
    string), or None. SGLang's hot buffer is ``device_buffer_size`` slots per
    request (default twice ``top_k``, itself 2048 by default); its own kernels
    take up to 32767 (``lru_slots`` is int16), kvtier's up to its limit. A
    config that does not parse is left to SGLang to refuse."""
    if hisparse_config is None:
        return None
    try:
        cfg = json.loads(hisparse_config)
    except (TypeError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    top_k = cfg.get("top_k", 2048)
    hot = cfg.get("device_buffer_size", 2 * top_k if isinstance(top_k, int) else None)
    max_hot, _ = swap_in_limits()
    if isinstance(hot, int) and not isinstance(hot, bool) and hot > max_hot:
        return (
            f"--hisparse-config asks for device_buffer_size {hot}; kvtier's swap-in keeps at most {max_hot} slots "
            f"per request (SGLang's own kernels take up to 32767)"
        )
    return None


def report(config=None, hisparse_config=None) -> Report:
    """What installing kvtier with `config` does here, from SGLang's source;
    `hisparse_config` is SGLang's ``--hisparse-config`` when known (the
    launcher reads it from the command line). `config` is anything
    :func:`kvtier.sglang.load_config` takes (checked as install checks it)."""
    if config is not None:
        config = load_config(config)
    plat, refusal = platform()
    r = Report(platform=plat)
    if refusal:
        r.refusal = refusal
        return r
    root = sglang_root()
    if root is None:
        r.refusal = "SGLang is not installed in this Python environment"
        return r
    r.sglang_version = sglang_version(root)
    coord = root / COORDINATOR_FILE
    kernel = next((root / f for f in KERNEL_FILES if (root / f).exists()), None)
    if not coord.exists() or kernel is None:
        r.refusal = f"SGLang {r.sglang_version} has no HiSparse coordinator and kernel module kvtier knows"
        return r
    coord_source = coord.read_text()
    names = module_names(coord_source)
    theirs = {}
    for node in ast.parse(kernel.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name in ENTRY_POINTS + (SPEC,) and node.name in names:
            theirs[node.name] = params_of_source(node)
    routes, problem = check_entry_points(theirs, coord_source)
    if problem:
        r.refusal = f"SGLang {r.sglang_version}'s entry points differ from what kvtier knows: {problem}"
        return r
    too_big = hisparse_limit_refusal(hisparse_config) if config is None or config.swap_in else None
    if too_big:
        r.refusal = too_big
        return r
    if config is not None and not config.swap_in:
        for route in routes:
            if route.served_by == "kvtier":
                route.served_by, route.why = "SGLang", "swap_in is off in the kvtier config"
    elif not kernels_built():
        # SGLang runs on CUDA: kvtier's entry points would refuse its tensors
        for route in routes:
            if route.served_by == "kvtier":
                route.served_by, route.why = "SGLang", (
                    "this libkvtier.so has no CUDA kernels (it was built without a CUDA compiler); "
                    "reinstall the package with `pip install ./bindings/python`, whose build brings one, "
                    "to serve the swap-in"
                )
    r.routes = routes + host_pool_routes(names, config) + hicache_pool_routes(root, config) + engram_routes(root, config)
    if any(route.served_by == "kvtier" and (route.name in HOST_POOLS or route.name in HICACHE_POOLS)
           for route in r.routes):
        r.warnings = device_warnings(config.devices if config is not None else [])
    r.installs = True
    return r


def live_incompatibility(module) -> str | None:
    """The same check on the coordinator module's live functions (SGLang's,
    before kvtier replaces them)."""
    theirs = {}
    for name in ENTRY_POINTS + (SPEC,):
        fn = getattr(module, name, None)
        if callable(fn):
            try:
                theirs[name] = params_of_function(fn)
            except (TypeError, ValueError):
                return f"{name} has no signature kvtier can read"
    source = None
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        pass
    return check_entry_points(theirs, source)[1]


__all__ = ["Report", "Route", "report", "CHECKED_VERSIONS", "ENTRY_POINTS", "HICACHE_POOLS", "HOST_POOLS", "SPEC"]
