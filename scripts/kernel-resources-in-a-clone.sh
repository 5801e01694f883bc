#!/usr/bin/env bash
# Runs scripts/kernel-resources.sh in a fresh clone of this checkout's HEAD
# in a folder named `kvtier`, the default name of a clone, where cargo
# writes package ids in another form (`path+file:///.../kvtier#0.1.0`
# instead of `...#kvtier@0.1.0`). The clone builds into
# target/named-clone/, seeded with a copy of target/release/ so that only
# kvtier itself compiles (about 20 s), and borrows this checkout's .tools/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git clone -q "$root" "$tmp/kvtier"
ln -s "$root/.tools" "$tmp/kvtier/.tools"
target="$root/target/named-clone"
if [ ! -d "$target/release" ] && [ -d "$root/target/release" ]; then
  mkdir -p "$target"
  cp -a "$root/target/release" "$target/release"
fi
cd "$tmp/kvtier"
CARGO_TARGET_DIR="$target" scripts/kernel-resources.sh >/dev/null
echo "kernel-resources: the report builds in a clone named kvtier too"
