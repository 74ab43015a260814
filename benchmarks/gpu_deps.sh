#!/usr/bin/env bash
# Fill .gpu/ (git-ignored) with the Python packages a lent GPU machine's image lacks, for benchmarks/gpu_checks.sh:
# that machine has Python 3.12, its own torch and no package registry. Pure-Python packages are copied from this
# project's virtualenv (.gpu/site); the compiled ones are downloaded as wheels for CPython 3.12 (.gpu/whl).
#
#   benchmarks/gpu_deps.sh            then: run benchmarks/gpu_checks.sh there with .gpu carried along
#
# The lists were found by running a lone node and the tests marked gpu under a Python that saw only the image's
# packages (its list: the device library's KINDS.md) plus .gpu/site. Keep one version of each package.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu
mkdir -p .gpu/site/google .gpu/whl
# hivemind (with its p2pd binary) and what it imports that the image does not hold: pure Python, or built for
# CPython's stable ABI (cryptography), so a copy from this Python runs under 3.12.
pure=(hivemind base58 cid morphys.py multihash multibase multicodec baseconv.py netaddr prefetch_generator varint.py
    pydantic annotated_types typing_inspection typing_extensions.py cryptography configargparse.py)
for name in "${pure[@]}"; do
    cp -r "$site/$name" .gpu/site/
done
# hivemind's generated protobuf modules need the protobuf they were generated with (abi3 too).
cp -r "$site/google/protobuf" "$site/google/_upb" .gpu/site/google/
# Their metadata, for importlib.metadata.
shopt -s nullglob
for info in "$site"/{hivemind,base58,py_cid,py_multihash,py_multibase,py_multicodec,python_baseconv,morphys}-*.dist-info \
    "$site"/{netaddr,prefetch_generator,varint,annotated_types,typing_inspection,typing_extensions}-*.dist-info \
    "$site"/{pydantic-[0-9],cryptography-,protobuf-,configargparse-,ConfigArgParse-}*.dist-info; do
    cp -r "$info" .gpu/site/
done
shopt -u nullglob
find .gpu -name __pycache__ -prune -exec rm -rf {} +
# Compiled, for the machine's CPython 3.12, at the versions this virtualenv has.
compiled=()
for dist in pydantic_core cffi blake3 mmh3; do
    compiled+=("$dist==$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$dist'))")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .gpu/whl "${compiled[@]}"
# iproute2's ip and tc (and sysctl), which the gpu-swarm stage's namespace WAN needs and the GPU image lacks: this
# machine's binaries with the libraries they link beyond glibc (they need glibc 2.34 at most); gpu_checks.sh puts
# them on the PATH through wrappers that point the loader at those libraries alone.
if command -v ip >/dev/null && command -v tc >/dev/null && command -v sysctl >/dev/null; then
    mkdir -p .gpu/iproute/lib
    for tool in ip tc sysctl; do
        cp "$(command -v "$tool")" ".gpu/iproute/$tool"
    done
    ldd .gpu/iproute/ip .gpu/iproute/tc .gpu/iproute/sysctl | awk '$3 ~ /^\// {print $3}' | sort -u |
        grep -Ev '/(libc|libm|libz|ld-linux[^/]*)\.so' | xargs -r cp -L -t .gpu/iproute/lib
fi
du -sh .gpu
