#!/usr/bin/env bash
# Remove namespaces and veths left by testbeds whose process is gone.
#   sudo infra/wan/down.sh                 # every dead aur<pid> testbed
#   sudo infra/wan/down.sh --prefix NAME   # a testbed started with --prefix NAME
# See infra/wan/README.md.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
cd "$root"
exec "$python" -m aurora_tools.wan.netns down "$@"
