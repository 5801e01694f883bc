#!/usr/bin/env bash
# Creates .tools/venv, a Python environment for the Python package's tests
# (pinned numpy, pytest and setuptools; no torch, no GPU), and downloads the
# pinned SGLang wheels whose published source the contract test reads
# (.tools/sglang-wheels; never installed, never imported). Idempotent.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.tools/venv"
wheels="$root/.tools/sglang-wheels"
pins=(numpy==2.3.5 pytest==8.4.2 setuptools==80.9.0)
# 0.5.15: the sixteen-parameter signature DESIGN.md gives; 0.5.23: the newest,
# with miss_src/miss_dst/miss_count/skip_io and a coordinator that passes them.
sglang_pins=(0.5.15 0.5.23)
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
done
