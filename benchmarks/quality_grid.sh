#!/usr/bin/env bash
# Every quality mode on every question set, in parallel processes on one GPU; one merged report per
# set (docs/quality.md). Usage: bash benchmarks/quality_grid.sh OUT_DIR [PARALLEL]
# (env QUESTIONS=200, DEVICE=cuda, MODES / SETS to override the lists below, e.g. for a CPU check;
#  PARTS=/tmp/quality_parts: per-job results, merged with any earlier jobs' results found there)
# Each job: python benchmarks/quality.py --questions 200 --set SET --filler-sentences F
#   --max-tokens 32 --device cuda --kv-cache-tokens 65536 --modes M1 M2 --out PART.json
set -uo pipefail
out="${1:?OUT_DIR}"; par="${2:-10}"; parts="${PARTS:-/tmp/quality_parts}"; mkdir -p "$out" "$parts"
here="$(cd "$(dirname "$0")" && pwd)"
modes=(none lazy lazy+tail10% lazy+question10% lazy+deviation5% lazy+deviation10%
       lazy/ape0.5,1 lazy/ape0.7,1 lazy/ape0.85,1 lazy/ape1,0.5 lazy/ape1,2 lazy/ape0.7,0.5 lazy/ape0.7,2
       lazy+deviation10%/ape0.7,1)
exact=(block+deviation10% block/ape0.7,1)  # lazy = block on every greedy token, with the new options
sets=("single 0" "single 24" "multihop 0" "distractor 0" "multihop 24")
[ -n "${MODES:-}" ] && read -r -a modes <<<"$MODES" && exact=()
[ -n "${SETS:-}" ] && IFS=, read -r -a sets <<<"$SETS"
jobs=()
for s in "${sets[@]}"; do
  read -r name filler <<<"$s"
  ms=("${modes[@]}"); [ "$filler" = 0 ] && ms+=("${exact[@]}")
  for ((i = 0; i < ${#ms[@]}; i += 2)); do
    jobs+=("$name $filler $i ${ms[*]:i:2}")
  done
done
printf '%s\n' "${jobs[@]}" | xargs -P "$par" -I{} bash -c '
  read -r name filler i m1 m2 <<<"{}"
  python3 '"$here"'/quality.py --questions '"${QUESTIONS:-200}"' --set "$name" --filler-sentences "$filler" \
    --max-tokens 32 --device '"${DEVICE:-cuda}"' --kv-cache-tokens 65536 --ttft-questions 10 --modes $m1 $m2 \
    --out '"$parts"'/q_${name}_${filler}_$i.json > '"$parts"'/q_${name}_${filler}_$i.log 2>&1 \
    || echo "FAILED $name $filler $m1 $m2: $(tail -3 '"$parts"'/q_${name}_${filler}_$i.log)"'
for s in "${sets[@]}"; do
  read -r name filler <<<"$s"
  echo "### $name, filler $filler"
  python3 "$here/quality.py" --merge $(ls "$parts"/q_${name}_${filler}_*.json | sort -V) \
    --out "$out/quality_${name}_${filler}.json" | head -40
done
