#!/usr/bin/env bash
# One visit to a GPU machine that cannot download anything, run from the repository root there:
#
#   scripts/device-run.sh [--budget-s S] [--dry-run] [--out DIR] [--chapter SLUG ...]
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
set -uo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
budget=480 dry=0 out="${OUT:-}" chapters=()
while [ $# -gt 0 ]; do
  case "$1" in
    --budget-s) budget="${2:?--budget-s needs a number of seconds}"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --out) out="${2:?--out needs a folder}"; shift 2 ;;
    --chapter) chapters+=(--chapter "${2:?--chapter needs a slug}"); shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "device-run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$budget" in ''|*[!0-9.]*) echo "device-run.sh: --budget-s $budget is not a number of seconds" >&2; exit 2 ;; esac
if [ -z "$out" ]; then
  if [ "$dry" = 1 ]; then out=_build/device-dry-run; else
    echo "device-run.sh: no output folder: set \$OUT or pass --out DIR" >&2; exit 2; fi
fi
mkdir -p "$out"
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
  $( [ "$dry" = 1 ] && echo --dry-run ) "${chapters[@]}"
