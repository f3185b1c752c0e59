#!/usr/bin/env bash
# Headless Chromium + ChromeDriver for the built-site tests (Debian packages).
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
if ! command -v apt-get >/dev/null; then
  echo "setup-browser: install chromium and chromedriver with your package manager" >&2
  exit 1
fi
echo "setup-browser: installing chromium and chromium-driver (apt-get)"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
