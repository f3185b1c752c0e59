#!/usr/bin/env bash
# One visit to a GPU machine that cannot download anything, run from the repository root there:
#
#   scripts/device-run.sh [--budget-s S] [--dry-run] [--redo-all] [--out DIR] [--chapter SLUG ...]
#
# A visit continues the last one: the results published at its profile (published/full/) are placed in its
# store first, and the groups whose notebooks are all current there are not executed again (--redo-all:
# execute every group).
#
# Installs the wheels of .whl/ (`make device-pack` here) into a temporary folder with
# `pip install --no-index --no-deps --target`, checks them against the image's packages, prints the GPU,
# driver and torch, runs the CUDA tests, the GPU benchmarks, then the full profile of as many groups of
# notebooks as the budget allows (largest value first; stopping between runs), and packs the executed
# notebooks, results, run metrics, benchmark results and logs into at most 7 archives in --out (default
# $OUT), beside this log: 8 files, each under 16 MiB. The budget (default 480 s) counts from this
# script's start. Back here: `circuitbook import-results OUT/circuitbook-results-full-*.tar.gz`.
#
# --dry-run does the same at the smoke profile on any machine (a CPU one too), installing nothing and
# using the Python of .venv (or $PYTHON): that is how CI tests this script.
#
# The visit seals its results with $CIRCUITBOOK_SEAL_KEY (64 hex digits), which `circuitbook visit-key` prints
# on the machine that will import them: without it a real visit is refused, since nothing it returned could be
# imported. Every argument is checked before anything is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
budget=480 dry=0 redo=0 out="${OUT:-}" chapters=() slugs=()
min_budget=40  # the visit keeps 20 s for packing and needs as much again to do anything (circuitbook.visit)
fail() { echo "device-run.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --budget-s) budget="${2:?--budget-s needs a number of seconds}"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --out) out="${2:?--out needs a folder}"; shift 2 ;;
    --redo-all) redo=1; shift ;;
    --chapter) slugs+=("${2:?--chapter needs a slug}"); chapters+=(--chapter "$2"); shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) fail "unknown argument $1 (see --help)" ;;
  esac
done
case "$budget" in ''|*[!0-9.]*|*.*.*|.) fail "--budget-s $budget is not a number of seconds" ;; esac
awk -v b="$budget" -v m="$min_budget" 'BEGIN { exit !(b + 0 < m) }' \
  && fail "--budget-s $budget: a visit needs at least $min_budget s (packing keeps 20 s of it)"
known=$(for f in chapters/*/profiles.yml; do [ -f "$f" ] && basename "$(dirname "$f")"; done; \
        [ -f book/profiles.yml ] && echo book)
for slug in ${slugs[@]+"${slugs[@]}"}; do
  printf '%s\n' $known | grep -qx -- "$slug" || fail "--chapter $slug is not a chapter; chapters: $(echo $known | tr ' ' ',' | sed 's/,/, /g')"
done
if [ "$dry" = 0 ] && [ -z "${CIRCUITBOOK_SEAL_KEY:-}" ]; then
  fail "CIRCUITBOOK_SEAL_KEY is not set: run 'circuitbook visit-key' where the results will be imported, and start the visit with the CIRCUITBOOK_SEAL_KEY=... it prints (results sealed by no key that store knows are refused)"
fi
if [ -n "${CIRCUITBOOK_SEAL_KEY:-}" ] && ! [[ "$CIRCUITBOOK_SEAL_KEY" =~ ^[0-9a-fA-F]{64}$ ]]; then
  fail "CIRCUITBOOK_SEAL_KEY must be 64 hexadecimal digits, as 'circuitbook visit-key' prints it"
fi
if [ -z "$out" ]; then
  if [ "$dry" = 1 ]; then out=_build/device-dry-run; else
    fail "no output folder: set \$OUT or pass --out DIR"; fi
fi
[ -e "$out" ] && [ ! -d "$out" ] && fail "--out $out is a file, not a folder"
mkdir -p "$out" 2>/dev/null || fail "--out $out: cannot make that folder"
[ -w "$out" ] || fail "--out $out: cannot write there"
exec > >(tee "$out/device-run.log") 2>&1

if [ "$dry" = 1 ]; then
  PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
  echo "device-run: dry run (profile smoke) with $PY; nothing is installed"
else
  PY="${PYTHON:-python3}"
  site="$(mktemp -d /tmp/cb-site.XXXXXX)"
  shopt -s nullglob
  wheels=(.whl/*.whl)
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "device-run: no wheels in .whl/ (run 'make device-pack' where PyPI is reachable, and carry .whl)" >&2
    exit 2
  fi
  echo "device-run: installing ${#wheels[@]} wheels into $site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}" \
    || { echo "device-run: pip could not install the wheels" >&2; exit 1; }
  export PYTHONPATH="$site:$PWD/lib${PYTHONPATH:+:$PYTHONPATH}"
  # a mismatch with the image is reported, and the visit goes on: what it breaks shows in the tests
  "$PY" scripts/device_pack.py --installed "$site" || echo "device-run: WARNING: the installed set does not meet every requirement (above)"
fi
echo "device-run: $("$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__,
  "| CUDA", torch.version.cuda, "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
exec "$PY" -m circuitbook.visit visit --budget-s "$budget" --started "$started" --out "$out" \
  $( [ "$dry" = 1 ] && echo --dry-run ) $( [ "$redo" = 1 ] && echo --redo-all ) "${chapters[@]}"
