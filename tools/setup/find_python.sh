#!/usr/bin/env bash
# Prints the path of a Python interpreter for a virtual environment.
#   find_python.sh            Python >= 3.12 for .venv (python3.13, python3.12, pyenv's versions, python3)
#   find_python.sh --oracle   Python 3.11 for .venv-oracle (the local CPU torch wheel is cp311)
#   find_python.sh --jax011   Python 3.12 for .venv-jax011 (the GPU image's), else any >= 3.12
set -u
case "${1:-}" in
  --oracle) want_min=11; want_max=11 ;;
  --jax011) want_min=12; want_max=12 ;;
  *) want_min=12; want_max=99 ;;
esac

ok() {  # ok PATH -> true when PATH runs and its minor version is in range
  local v
  v=$("$1" -c 'import sys; print(sys.version_info[0], sys.version_info[1])' 2>/dev/null) || return 1
  set -- $v
  [ "$1" = 3 ] && [ "$2" -ge "$want_min" ] && [ "$2" -le "$want_max" ]
}

candidates=(python3.13 python3.12 python3.11)
pyroot="${PYENV_ROOT:-$HOME/.pyenv}"
for d in $(ls -d "$pyroot"/versions/3.* 2>/dev/null | sort -t. -k2,2nr -k3,3nr); do
  candidates+=("$d/bin/python3")
done
candidates+=(python3)
find() {
  for c in "${candidates[@]}"; do
    p=$(command -v "$c" 2>/dev/null) || continue
    if ok "$p"; then echo "$p"; exit 0; fi
  done
}
find
if [ "${1:-}" = "--jax011" ]; then want_max=99; find; fi
if [ "$want_max" = 11 ]; then
  echo "error: no Python 3.11 found (needed for the transformers/torch oracle, .venv-oracle); install one (e.g. 'pyenv install 3.11')" >&2
else
  echo "error: no Python >= 3.12 found (tried python3.13, python3.12, $pyroot/versions/*, python3); install one (e.g. 'pyenv install 3.12')" >&2
fi
exit 1
