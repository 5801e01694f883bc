#!/usr/bin/env bash
# The second Python test environment: real torch (CPU-usable; its nvidia-*
# wheels install on a machine without a GPU) and the packages SGLang's
# HiSparse modules import, pinned in scripts/sglang-env.lock, so that
# SGLang's own modules (the trees scripts/python-env.sh installs under
# .tools/sglang/<version>, put on PYTHONPATH one release at a time) import
# and run against kvtier on the CPU.
#
# The environment is large (about 6 GB, 1.5-2 minutes cold on 2 cores), so it
# lives outside the clone, under $KVTIER_CACHE_DIR (default
# ~/.cache/kvtier), in a folder named by a hash of the lock file and the
# interpreter, and is built once per pin set; a warm run costs a second.
# .tools/torch-venv is the clone's own small venv layered on it (a .pth file
# adds the cached site-packages), into which the test command installs the
# kvtier package it just built, so the cache is never written by a test run.
#
# Prints nothing on a warm run. Idempotent.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
lock="$root/scripts/sglang-env.lock"
python=${PYTHON:-python3}
cache=${KVTIER_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtier}
key=$( { cat "$lock"; "$python" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
env_dir="$cache/torch-env-$key"
local_venv="$root/.tools/torch-venv"

mkdir -p "$cache"
exec 9>"$cache/.torch-env.lock"
flock 9  # one builder at a time; a second waits and then finds it built
if [ ! -f "$env_dir/.kvtier-complete" ]; then
  echo "sglang-env: building the real-torch environment in $env_dir (about 6 GB, once per pin set)"
  rm -rf "$env_dir" "$env_dir.partial"
  "$python" -m venv "$env_dir.partial"
  "$env_dir.partial/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    -r <(grep -v '^#' "$lock")
  # a venv's scripts name their interpreter by path: move it whole, then fix
  # the shebangs and activation paths to the final folder
  mv "$env_dir.partial" "$env_dir"
  grep -rlI --null "$env_dir.partial" "$env_dir/bin" | xargs -0 -r sed -i "s#$env_dir.partial#$env_dir#g"
  sed -i "s#$env_dir.partial#$env_dir#g" "$env_dir/pyvenv.cfg"
  touch "$env_dir/.kvtier-complete"
fi

site=$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! { [ -x "$local_venv/bin/python" ] && [ "$(cat "$local_venv/.kvtier-env" 2>/dev/null)" = "$env_dir" ]; }; then
  rm -rf "$local_venv"
  "$python" -m venv --without-pip "$local_venv"
  local_site=$("$local_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$site" > "$local_site/kvtier-torch-env.pth"
  echo "$env_dir" > "$local_venv/.kvtier-env"
fi
