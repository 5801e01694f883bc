# Sourced by the stages: where the bundle is, the output archive, the log.
# A stage runs in the repository root of the device's copy of the tree, with
# gpu-bundle/ carried (see scripts/gpu-bundle.sh), and packs everything it
# writes into one archive in $1 (the device's $OUT: at most 8 files come back).
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=$PWD/gpu-bundle
[ -f "$bundle/COMMIT" ] || { echo "no gpu-bundle/: run scripts/gpu-bundle.sh where cargo is, and carry it" >&2; exit 1; }
out_dir=${1:?usage: $0 OUT_DIR}
# The bench records it in every JSON line (the binary cannot know it).
KVTIER_COMMIT=$(cat "$bundle/COMMIT")
export KVTIER_COMMIT
stage=$(basename "$0" .sh)
logs=$(mktemp -d)
dry=${GPU_SUITE_DRY_RUN:-0}
log() { echo "$*" | tee -a "$logs/$stage.log"; }
# run NAME SECONDS CMD...: runs CMD with a time limit, its output in NAME.log;
# a failure is recorded, and the stage goes on.
run() {
  local name=$1 secs=$2; shift 2
  log "== $name: $*"
  local rc=0
  timeout "$secs" "$@" >"$logs/$name.log" 2>&1 || rc=$?
  log "   exit $rc ($(tail -n 1 "$logs/$name.log" | cut -c1-200))"
  echo "$name $rc" >>"$logs/exit-codes.txt"
}
pack() {
  cp "$bundle/COMMIT" "$logs/COMMIT"
  (nvidia-smi -L 2>/dev/null || echo "no nvidia-smi") >"$logs/gpu.txt"
  tar czf "$out_dir/$stage.tar.gz" -C "$logs" .
  echo "$stage: packed $(ls "$logs" | wc -l) files into $out_dir/$stage.tar.gz"
}
trap pack EXIT
