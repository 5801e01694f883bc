"""The README's Python example runs as written."""

import re

from conftest import REPOSITORY, needs_repository

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


def test_every_link_within_the_readme_has_its_heading():
    """`[text](#anchor)` links land on a heading (GitHub's slugs: lower case,
    punctuation dropped, spaces to hyphens)."""
    text = README.read_text()
    slugs = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        slugs.add(slug)
    anchors = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert len(anchors) > 10, anchors
    assert not anchors - slugs, f"links to no heading: {sorted(anchors - slugs)}"
