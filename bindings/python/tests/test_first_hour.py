"""What a newcomer's first hour on a fresh machine turned up (the test
command failing in a clone named `kvtier`, changes outside the checkout,
promises the README did not keep), each checked so that it stays fixed."""

import json
import re
import subprocess
import sys

from conftest import REPOSITORY, needs_repository

pytestmark = needs_repository
README = (REPOSITORY / "README.md").read_text()


def test_both_forms_of_a_cargo_package_id_name_the_package():
    """cargo writes `path+file:///.../kvtier#0.1.0` when the folder is named
    as the package (a clone's default), else `...#kvtier@0.1.0`;
    scripts/kernel-resources.sh read only the second and failed in a clone
    named kvtier. (The test command also runs it in such a clone:
    scripts/kernel-resources-in-a-clone.sh.)"""
    lines = [
        {"reason": "build-script-executed", "package_id": "path+file:///home/u/kvtier#0.1.0", "out_dir": "/a"},
        {"reason": "build-script-executed", "package_id": "path+file:///home/u/src#kvtier@0.1.0", "out_dir": "/b"},
        {"reason": "build-script-executed", "package_id": "registry+https://x#cudarc@0.17.0", "out_dir": "/c"},
        {"reason": "build-script-executed", "package_id": "path+file:///home/u/kvtier/bindings/python/native#"
                                                          "kvtier-python@0.1.0", "out_dir": "/d"},
        {"reason": "compiler-artifact", "package_id": "path+file:///home/u/kvtier#0.1.0"},
    ]
    out = subprocess.run([sys.executable, str(REPOSITORY / "scripts/cargo-out-dir.py"), "kvtier"],
                         input="\n".join(json.dumps(x) for x in lines), capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["/a", "/b"]
    assert "kernel-resources-in-a-clone.sh" in (REPOSITORY / "scripts/test.sh").read_text()


def test_the_test_command_changes_nothing_outside_the_checkout_unless_asked():
    """As root, the test command installed Debian packages and a rustup
    target for the aarch64 wheel: now only with KVTIER_TEST_AARCH64=1 (CI's
    .ci/run sets it)."""
    test_sh = (REPOSITORY / "scripts/test.sh").read_text()
    calls = [line.strip() for line in test_sh.splitlines() if "build-wheel.sh" in line and "--aarch64" in line
             and not line.strip().startswith("#")]
    assert calls == ["scripts/build-wheel.sh --sdist --aarch64"], calls
    guarded = test_sh.split('if [ "${KVTIER_TEST_AARCH64:-0}" = 1 ]; then', 1)
    assert len(guarded) == 2 and calls[0] in guarded[1].split("else", 1)[0]
    for forbidden in ("apt-get", "rustup target add", "cross-aarch64.sh"):
        assert forbidden not in test_sh, forbidden
    assert "KVTIER_TEST_AARCH64=1" in (REPOSITORY / ".ci/run").read_text()


def test_the_quick_start_gives_time_and_disk_next_to_the_two_commands():
    """Measured on a fresh machine (the closing note of the run says which),
    not pieced together: minutes and gigabytes for each command."""
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = quick.split("```bash", 1)[1].split("```", 1)[0]
    for command in ("scripts/bench.sh", "scripts/test.sh"):
        line = next(x for x in block.splitlines() if x.startswith(command))
        assert re.search(r"\d+ min", line) and re.search(r"\d+(\.\d+)? GB", line), line


def test_bench_sh_says_what_it_does_while_cargo_builds():
    bench = (REPOSITORY / "scripts/bench.sh").read_text()
    build = bench.index("cargo build")
    assert 'echo "bench: building' in bench[:build], "a line before the silent minutes"
    assert "--quiet" not in bench, "cargo's own progress shows"


def test_the_python_examples_say_what_they_need():
    """The README's Python examples pass numpy arrays, which the package does
    not install: the install page says so, and an extra brings it."""
    install = (REPOSITORY / "docs" / "install.md").read_text()
    assert "numpy" in install and "[numpy]" in install
    assert 'numpy = ["numpy"]' in (REPOSITORY / "bindings/python/pyproject.toml").read_text()
    if "import numpy" in README or "np." in README:
        assert "./bindings/python[numpy]" in README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
