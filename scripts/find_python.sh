#!/bin/sh
# Print the path of a Python >= 3.12 interpreter, for the README's install commands:
#   PY=$(sh scripts/find_python.sh) && "$PY" -m venv .venv && ...
# Tries python3.12, python3.13, python3 and python on PATH (a pyenv shim counts only when it
# runs), then the newest 3.12 (else newer) version pyenv has installed. Exit 1 with a hint
# when there is none; any interpreter's path can replace $(sh scripts/find_python.sh).
set -u
ok='import sys; print(sys.executable if sys.version_info >= (3, 12) else "")'
for cand in python3.12 python3.13 python3 python; do
  command -v "$cand" >/dev/null 2>&1 || continue
  found=$("$cand" -c "$ok" 2>/dev/null) || continue
  if [ -n "$found" ]; then
    echo "$found"
    exit 0
  fi
done
if command -v pyenv >/dev/null 2>&1; then
  best=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12\.[0-9]+$' | sort -t. -k3,3n | tail -n 1)
  if [ -z "$best" ]; then
    best=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[3-9])\.[0-9]+$' | sort -t. -k2,2n -k3,3n | tail -n 1)
  fi
  if [ -n "$best" ]; then
    prefix=$(pyenv prefix "$best") && found=$("$prefix/bin/python3" -c "$ok" 2>/dev/null)
    if [ -n "${found:-}" ]; then
      echo "$found"
      exit 0
    fi
  fi
fi
echo "no Python >= 3.12 found: install one (python.org, your package manager, or" \
  "'pyenv install 3.12'), or set PY=/path/to/python3.12" >&2
exit 1
