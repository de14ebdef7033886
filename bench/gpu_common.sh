# Sourced by a device session's script: `source bench/gpu_common.sh TAG DEFAULT_PART "$@"`.
# Sets `part` (the script's first argument, else DEFAULT_PART), the log folder `L`, whose
# contents go to "$OUT/logs_TAG_PART.tgz" when the script exits, and `stamp MESSAGE` (the
# seconds since the start, then the message).
set -u
export PYTHONUNBUFFERED=1
tag=$1
part=${3:-$2}
L=/tmp/lanekv_logs; mkdir -p "$L"
trap 'tar -C "$L" -czf "$OUT/logs_${tag}_$part.tgz" .' EXIT
t0=$SECONDS
stamp() { echo "[$((SECONDS - t0)) s] $*"; }
