#!/usr/bin/env bash
# Headless Chromium for the HTML report test: bash scripts/chromium.sh
# Installs Debian's `chromium` with apt when no browser is on PATH (as root, non-interactive)
# and prints the path of the binary, so CI and a developer get the same browser.
set -euo pipefail

find_browser() { command -v chromium || command -v chromium-browser; }

if ! find_browser >/dev/null; then
  [[ $(id -u) == 0 ]] || { echo "chromium.sh: run as root to install chromium" >&2; exit 1; }
  echo "chromium.sh: installing chromium" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends chromium >/dev/null ||
    { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium >/dev/null; }
fi
find_browser
