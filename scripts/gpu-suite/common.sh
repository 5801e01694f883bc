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
# Swap-in builds no GPU had run before that hung in a bench of this
# bundle's commit (kvtier bench --hung-builds): the later benches skip them.
# Kept beside the carried bundle, one file a commit (a machine kept warm
# keeps it between device commands; a new commit starts afresh), so every
# stage shares it, and packed into each stage's archive.
hung_builds=${GPU_SUITE_HUNG_BUILDS:-$bundle/hung-builds-$KVTIER_COMMIT.txt}
stage=$(basename "$0" .sh)
logs=$(mktemp -d)
dry=${GPU_SUITE_DRY_RUN:-0}
# GPU_SUITE_QUICK=1: each stage's quick grid (scripts/gpu-suite/quick-pass.sh)
quick=${GPU_SUITE_QUICK:-0}
# the quick pass's second part of a stage (and a follow-up's third) packs an
# archive of its own
case $quick in 2 | 3) stage=$stage-part$quick ;; esac
log() { echo "$*" | tee -a "$logs/$stage.log"; }
# run NAME SECONDS CMD...: runs CMD with a time limit, its output in NAME.log;
# a failure is recorded, and the stage goes on.
# With GPU_SUITE_DEADLINE (seconds since the epoch, set by quick-pass.sh) a
# command's limit is cut to end 15 s before it, and one with under 20 s left
# is skipped (its exit code 124 and "skipped" in the log), so the stages of
# one device command pack their archives before the command's own limit.
run() {
  local name=$1 secs=$2; shift 2
  if [ -n "${GPU_SUITE_DEADLINE:-}" ] && [ "$dry" != 1 ]; then
    local left=$((GPU_SUITE_DEADLINE - $(date +%s) - 15))
    if [ "$left" -lt 20 ]; then
      log "== $name: skipped, ${left}s before the quick pass's deadline"
      echo "$name 124 skipped" >>"$logs/exit-codes.txt"
      return 0
    fi
    [ "$left" -lt "$secs" ] && secs=$left
  fi
  log "== $name ($(date -u +%H:%M:%S), at most ${secs}s): $*"
  local rc=0
  timeout "$secs" "$@" >"$logs/$name.log" 2>&1 || rc=$?
  log "   exit $rc at $(date -u +%H:%M:%S) ($(tail -n 1 "$logs/$name.log" | cut -c1-200))"
  echo "$name $rc" >>"$logs/exit-codes.txt"
}
pack() {
  cp "$bundle/COMMIT" "$logs/COMMIT"
  [ -s "$hung_builds" ] && cp "$hung_builds" "$logs/hung-builds.txt"
  (nvidia-smi -L 2>/dev/null || echo "no nvidia-smi") >"$logs/gpu.txt"
  tar czf "$out_dir/$stage.tar.gz" -C "$logs" .
  echo "$stage: packed $(ls "$logs" | wc -l) files into $out_dir/$stage.tar.gz"
}
trap pack EXIT
