# Sourced by the Nsight Compute scripts (scripts/gpu/ncu_*.sh) after setup_device.sh: `profile` runs a command
# under ncu (full section set) for the launches of one kernel regex and writes the report, its log and its details
# page as CSV to $RES. NCU_BIN (default: the lent machine's /usr/local/cuda/bin/ncu), NCU_TIMEOUT (s, default 150).
NCU_BIN=${NCU_BIN:-/usr/local/cuda/bin/ncu}
NCU="$NCU_BIN --set full --print-summary none -f"
profile() {  # name, kernel regex, launches to skip, launches to profile, command...
  local name=$1 regex=$2 skip=$3 count=$4; shift 4
  timeout ${NCU_TIMEOUT:-150} $NCU --kernel-name "regex:$regex" --launch-skip $skip --launch-count $count \
    -o $RES/ncu_$name "$@" > $RES/ncu_$name.log 2>&1 || { echo "ncu $name failed:"; tail -5 $RES/ncu_$name.log; }
  $NCU_BIN --import $RES/ncu_$name.ncu-rep --page details --csv > $RES/ncu_${name}_details.csv 2>&1
  echo "$name: $(grep -c . $RES/ncu_${name}_details.csv) lines"
}
