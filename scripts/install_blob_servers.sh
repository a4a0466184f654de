#!/usr/bin/env bash
# Install the loopback blob servers and client libraries used by tests/blob (idempotent).
#
#   - Azurite 3.35.0 (Azure Blob emulator, npm) into <repo>/.node
#     (pinned: 3.36+ need Node >= 21/22)
#   - adlfs, azure-storage-blob, moto[server], s3fs, zstandard into the venv ($PY)
#
# Usage: scripts/install_blob_servers.sh          (PY defaults to <repo>/.venv/bin/python)
#        PY=/path/to/python scripts/install_blob_servers.sh
#
# If npm is missing this prints a loud warning and exits 0; the Azure tests then skip with a
# reason that names this script. A failed pip install exits 1 (after still trying npm).
set -u

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 1
PY="${PY:-$REPO/.venv/bin/python}"
AZURITE_VERSION="3.35.0"
status=0

warn() {
    echo "" >&2
    echo "######################################################################" >&2
    echo "# WARNING: $*" >&2
    echo "######################################################################" >&2
    echo "" >&2
}

# --- Python client libraries (and moto_server) -------------------------------------------
if [ -x "$PY" ] || command -v "$PY" >/dev/null 2>&1; then
    echo "[install_blob_servers] pip installing adlfs azure-storage-blob moto[server] s3fs zstandard into $PY"
    if ! "$PY" -m pip install -q adlfs azure-storage-blob 'moto[server]' s3fs zstandard; then
        warn "pip install failed: the blob tests will skip (re-run $0 when the registry is reachable)"
        status=1
    fi
else
    warn "python '$PY' not found: set PY=/path/to/python and re-run $0"
fi

# --- Azurite (npm) -----------------------------------------------------------------------
if [ -x "$REPO/.node/node_modules/.bin/azurite-blob" ]; then
    echo "[install_blob_servers] azurite already installed at .node/node_modules/.bin/azurite-blob"
elif ! command -v npm >/dev/null 2>&1; then
    warn "npm not found: Azurite (Azure Blob emulator) NOT installed; the Azure blob tests will SKIP. Install Node.js >= 18 + npm and re-run $0"
else
    echo "[install_blob_servers] npm installing azurite@$AZURITE_VERSION into .node"
    if ! npm install --no-fund --no-audit --prefix "$REPO/.node" "azurite@$AZURITE_VERSION"; then
        warn "npm install azurite@$AZURITE_VERSION failed: the Azure blob tests will SKIP (re-run $0)"
    fi
fi
exit "$status"
