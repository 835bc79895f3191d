#!/usr/bin/env bash
# Download, on a machine with the package registry, the wheels the lent GPU machine lacks (it has no
# network): nbmake/nbclient/ipykernel and their dependencies, nvtx, ijson, jsonschema. They go into the
# git-ignored .whl/ that scripts/gpu_session.sh's callers carry and install with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d .whl nbmake nbconvert nvtx ijson jsonschema
# the device image already has these (KINDS.md's package list); a second copy on PYTHONPATH could
# shadow versions that torch or pandas were built against
cd .whl && rm -f python_dateutil-* tzdata-* typing_extensions-* packaging-* psutil-* pytest-* pluggy-* \
  iniconfig-* jinja2-* markupsafe-* attrs-* pygments-*
echo "wheels in .whl/: $(ls | wc -l) files, $(du -sh . | cut -f1)"
