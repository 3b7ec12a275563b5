#!/usr/bin/env bash
# Run a plan of bench/quality_scale.py stages (bench/plans/*.plan) against deadlines, so one call on a
# lent machine returns what it measured even when a stage is cut. A plan line is
#   DEADLINE_S STAGE ARGS...
# DEADLINE_S: seconds since STARTED (epoch seconds, default now) by which the line must end; STAGE:
# regenerate, train, evaluate or ngram; ARGS: that stage's own flags, split on whitespace (no quoting). Blank
# lines and lines starting with # are skipped. Lines run in order, each under `timeout` until its
# deadline; a line with 5 s or less left is skipped. Every line gets `--out RUN --prompts PROMPTS`,
# regenerate, evaluate and ngram also `--target TARGET`; after each line `report` rewrites JSON. Every line is
# checked before any runs (exit 2 on a bad one); exit 1 if a line failed, was cut or was skipped.
# A line ending in `&` runs in the background, beside the lines after it up to the next line without `&`;
# when that one ends, the plan waits for the background lines (each still under its own deadline) before
# `report`: two drafters train at once on one GPU whose steps leave it idle between kernels.
# SCALE_TRAIN_FLAGS in the environment (e.g. --no-compile-drafter) is appended to every train line.
# A line still running PLAN_KILL_AFTER seconds (default 10) after the SIGTERM of its deadline is killed with
# its processes (a stage stuck where it does not act on SIGTERM would otherwise take the rest of the call).
#   bash bench/scale_plan.sh PLAN RUN PROMPTS TARGET JSON [STARTED]
set -u
[ $# -ge 5 ] || { echo "usage: bash bench/scale_plan.sh PLAN RUN PROMPTS TARGET JSON [STARTED]"; exit 2; }
plan=$1 run=$2 prompts=$3 target=$4 json=$5 started=${6:-$(date +%s)}
[ -f "$plan" ] || { echo "$plan: no such plan file"; exit 2; }
qs=(python3 -m bench.quality_scale)
kill_after=${PLAN_KILL_AFTER:-10}

lines=()  # "NUMBER DEADLINE STAGE ARGS..." of each line to run
n=0
while IFS= read -r line || [ -n "$line" ]; do
  n=$((n + 1))
  read -r deadline stage _ <<< "$line"
  [[ -z ${deadline:-} || $deadline == \#* ]] && continue
  [[ $deadline =~ ^[0-9]+$ ]] || { echo "$plan:$n: deadline '$deadline' is not whole seconds"; exit 2; }
  [[ ${stage:-} =~ ^(regenerate|train|evaluate|ngram)$ ]] || { echo "$plan:$n: stage '${stage:-}' is not regenerate, train, evaluate or ngram"; exit 2; }
  lines+=("$n $line")
done < "$plan"

# one line under its deadline: its exit status, and what became of it said on stdout
run_line() {
  local n=$1 left=$2 stage=$3 args=$4 rc
  # shellcheck disable=SC2086 # ARGS split on whitespace, as documented
  timeout -k "$kill_after" "$left" "${qs[@]}" "$stage" "${where[@]}" $args
  rc=$?
  case $rc in
    124) printf '\n--- plan line %s: cut at its deadline\n' "$n" ;;
    137) printf '\n--- plan line %s: killed %s s after its deadline: it did not stop on SIGTERM\n' "$n" "$kill_after" ;;
    *) echo "--- plan line $n: rc=$rc" ;;
  esac
  return $rc
}

status=0
background=()  # pids of the lines running beside the current one
# the background lines waited for, then the report rewritten
wait_and_report() {
  for pid in "${background[@]}"; do wait "$pid" || status=1; done
  background=()
  "${qs[@]}" report --out "$run" --prompts "$prompts" --json "$json" > /dev/null || status=1
}
for entry in "${lines[@]}"; do
  read -r n deadline stage args <<< "$entry"
  beside=false
  if [[ " $args" == *" &" ]]; then beside=true args=${args%&} args=${args% }; fi
  left=$((deadline - ($(date +%s) - started)))
  where=(--out "$run" --prompts "$prompts")
  [ "$stage" = train ] && args="$args${SCALE_TRAIN_FLAGS:+ $SCALE_TRAIN_FLAGS}" || where+=(--target "$target")
  if [ $left -le 5 ]; then
    echo "--- plan line $n: $stage $args: skipped, its deadline ($deadline s) has passed"
    status=1
    $beside && continue
  elif $beside; then
    echo "--- plan line $n: $stage $args (until $deadline s: $left s left), in the background"
    run_line "$n" "$left" "$stage" "$args" &
    background+=($!)
    continue
  else
    echo "--- plan line $n: $stage $args (until $deadline s: $left s left)"
    run_line "$n" "$left" "$stage" "$args" || status=1
  fi
  wait_and_report
done
[ ${#background[@]} -eq 0 ] || wait_and_report  # the plan ended on background lines
exit $status
