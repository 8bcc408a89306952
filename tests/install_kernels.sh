#!/usr/bin/env bash
# The real flash-attn Python package (its wrappers, custom ops and fake registrations), without its CUDA build,
# into tests/.kernels: only tests/cpu_kernels.py puts that folder on sys.path, so a working flash-attn in the
# environment's site-packages is never touched. Seconds with torch installed; nothing to do the second time.
set -euo pipefail
cd "$(dirname "$0")"
VERSION=2.8.3
if [ -f ".kernels/flash_attn-$VERSION.dist-info/METADATA" ]; then
    exit 0
fi
rm -rf .kernels
FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
    python -m pip install -q "flash-attn==$VERSION" --no-build-isolation --no-deps --target .kernels
