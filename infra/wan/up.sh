#!/usr/bin/env bash
# Bring a WAN testbed up in the foreground; Ctrl-C (or SIGTERM) tears it down.
#   sudo infra/wan/up.sh --regions eu:1000mbit:60ms us:250mbit:120ms:stall=0.01/300ms \
#                        --expose 127.0.0.1:9000 127.0.0.1:6379
# See infra/wan/README.md.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
cd "$root"
exec "$python" -m aurora_tools.wan.netns up "$@"
