"""The README and the pages under docs/: their Python examples run as written,
every path they name exists, every link lands, every kvtier config they show
loads."""

import json
import re

import pytest

from conftest import REPOSITORY, needs_repository
from kvtier.sglang._config import load_config as sglang_config
from kvtier.vllm import load_config as vllm_config

README = REPOSITORY / "README.md"
pytestmark = needs_repository


def test_the_readme_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has a Python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})


def test_every_path_the_readme_names_exists():
    """Repository paths in backticks (`src/pool/mod.rs`, `docs/registration.md`,
    `bench/results/...`) exist; globs match something."""
    root = README.parent
    text = README.read_text()
    tops = ("src/", "tests/", "kernels/", "bindings/", "scripts/", "benches/", "docs/", "bench/", ".ci/")
    names = set()
    for tok in re.findall(r"`([^`\s]+)`", text):
        tok = tok.rstrip(".,:;)")
        if tok.startswith(tops):
            names.add(tok.split("::")[0])
    names.update(re.findall(r"\b(docs/[\w./-]+\.md)", text))
    # and the targets of relative links, figures included: ](bench/results/.../headline.png)
    names.update(n for n in re.findall(r"\]\(([^)#\s:]+)\)", text) if n.startswith(tops))
    assert len(names) > 10, names
    missing = [n for n in sorted(names) if not (list(root.glob(n.replace("{jsonl,png}", "*"))) if "*" in n or "{" in n
                                                else (root / n).exists())]
    # paths the tests write (target/...) are not in the repository
    missing = [n for n in missing if not n.startswith("target/")]
    assert not missing, f"the README names paths that do not exist: {missing}"


def test_every_link_of_the_readme_lands():
    """`[text](#anchor)` and `[text](docs/page.md#anchor)` links land on a
    heading of the page they name (GitHub's slugs: lower case, punctuation
    dropped, spaces to hyphens), and every page they name exists."""
    text = README.read_text()
    links = re.findall(r"\]\(((?:docs/[\w.-]+\.md)?)(?:#([^)]+))?\)", text)
    links = [(page, anchor) for page, anchor in links if page or anchor]
    assert len(links) > 10, links
    wrong = [(page, anchor) for page, anchor in links
             if not (REPOSITORY / (page or "README.md")).exists()
             or (anchor and anchor not in slugs_of(REPOSITORY / (page or "README.md")))]
    assert not wrong, f"links to no page or heading: {wrong}"


# The pages under docs/ are held to the same rules: every repository path a
# page names exists, every relative link (resolved from the page's folder)
# reaches a file, and every anchor lands on a heading of the page it names.
DOCS = sorted((REPOSITORY / "docs").glob("*.md"))


def slugs_of(page) -> set:
    """GitHub's heading slugs of a Markdown page: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", page.read_text(), re.M)}


def test_there_are_docs_pages():
    assert len(DOCS) >= 6, DOCS


@pytest.mark.parametrize("page", [p for p in DOCS if "```python" in p.read_text()], ids=lambda p: p.name)
def test_a_docs_pages_python_examples_run(page):
    """As the README's: each Python block of the page runs as written (on
    numpy and the CPU executor)."""
    for code in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
        exec(compile(code, str(page), "exec"), {})


# Other projects' source paths the pages cite, which start like this
# repository's folders: every other path under one of its top folders must
# exist, so that a renamed or removed folder fails.
OTHER_PROJECTS = (
    "src/nvidia/",  # NVIDIA's open GPU kernel modules (registration.md)
    "src/plugins/ucx/",  # NIXL (registration.md)
    "src/uct/",  # UCX (registration.md)
    "tests/v1/",  # vLLM (vllm-hisparse-ops.md)
)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_path_and_link_of_a_docs_page_resolves(page):
    text = page.read_text()
    tops = ("src/", "tests/", "kernels/", "bindings/", "scripts/", "benches/", "docs/", "bench/", ".ci/", "cli/")
    missing = []
    for tok in re.findall(r"`([^`\s]+)`", text):
        tok = tok.rstrip(".,:;)").split("::")[0]
        ours = tok.startswith(tops) and not tok.startswith(OTHER_PROJECTS)
        if ours and not any(c in tok for c in "*{<") and not (REPOSITORY / tok).exists():
            missing.append(tok)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            missing.append(target)
        elif anchor and file.suffix == ".md" and anchor not in slugs_of(file):
            missing.append(target)
    assert not missing, f"{page.name} names what does not exist: {missing}"


def test_the_readme_links_every_docs_page():
    text = README.read_text()
    unlinked = [p.name for p in DOCS if f"docs/{p.name}" not in text]
    assert not unlinked, f"docs pages the README does not name: {unlinked}"


def test_the_configs_the_pages_show_load():
    """The kvtier configs the README, docs/tables.md and docs/vllm.md show
    are accepted by the loaders that read them (the SGLang shim's and the
    vLLM plugin's): no unknown key, no value refused."""
    readme, tables, vllm = README.read_text(), (REPOSITORY / "docs/tables.md").read_text(), \
        (REPOSITORY / "docs/vllm.md").read_text()
    sglang = re.findall(r"echo '(\{.*?\})' > kvtier\.json", readme) + re.findall(r"```json\n(.*?)```", tables, re.S)
    vllm_texts = re.findall(r"KVTIER_VLLM_CONFIG='(\{.*?\})'", readme + vllm)
    assert len(sglang) >= 2 and len(vllm_texts) >= 2, (sglang, vllm_texts)
    for text in sglang:
        sglang_config(json.loads(text))
    for text in vllm_texts:
        vllm_config(text)
