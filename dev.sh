#!/usr/bin/env bash
# kvgate developer entry point; installs itself into ./.venv on first use.
#   ./dev.sh demo    kvgate on 127.0.0.1:8000 in front of a 4-replica simulated fleet (Ctrl-C stops both)
#   ./dev.sh test    the whole test suite
#   ./dev.sh test-engines   the real-engine suite (tests/engines): real vLLM replicas from their own environment
#   ./dev.sh kvgate ARGS...   any kvgate command from the virtual environment
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
PY=${PYTHON:-python3}
stamp="$VENV/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >/dev/null
  "$VENV/bin/python" -m pip install --quiet -e '.[test]'
  rm -f "$VENV"/.installed-* && touch "$stamp"
fi
cmd=${1:-help}; shift || true
case "$cmd" in
  demo) exec "$VENV/bin/kvgate" demo "$@" ;;
  test) exec "$VENV/bin/python" -m pytest "$@" ;;
  test-engines) scripts/engines_env.sh >/dev/null && exec "$VENV/bin/python" -m pytest tests/engines "$@" ;;
  kvgate) exec "$VENV/bin/kvgate" "$@" ;;
  *) sed -n '2,6p' "$0"; exit 2 ;;
esac
