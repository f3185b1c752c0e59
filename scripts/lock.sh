#!/usr/bin/env bash
# Write requirements.lock: every package of .venv at its installed version (the circuitbook package itself
# left out), torch without its local build tag so that the same lock takes a CUDA build where one belongs.
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "# The environment the book is built and tested with: \`make setup\` installs exactly this (pip --no-deps),"
  echo "# after torch==2.13.0. Regenerate with \`make lock\` after changing pyproject.toml; its hash is in every"
  echo "# notebook's inputs (results of another environment read 'stale: the environment changed')."
  .venv/bin/python -m pip freeze --exclude-editable --disable-pip-version-check | grep -v '^circuitbook' \
    | sed -E 's/^(torch==[0-9.]+)\+[a-z0-9]+$/\1/' | LC_ALL=C sort -f
} > requirements.lock
echo "lock: $(grep -vc '^#' requirements.lock) packages in requirements.lock"
