"""Pins for pip in the GPU image: the base image's own torch, Transformer Engine, apex and flash-attn, as installed.

NGC images install these from local files, so ``pip freeze`` prints them as ``name @ file://...`` and a
``grep '^torch=='`` finds nothing; the installed versions come from the package metadata instead. Printed
as ``name==version`` lines (a pip constraints file); exits 1 when torch itself is missing (not a PyTorch image).

    python containers/ngc_constraints.py > /tmp/ngc-constraints.txt
"""

from __future__ import annotations

import importlib.metadata
import re
import sys

KEEP = ("torch", "transformer-engine", "transformer-engine-torch", "apex", "flash-attn")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def constraints(installed) -> list[str]:
    """``name==version`` for each kept distribution among ``installed`` ((name, version) pairs), sorted."""
    found = {_normal(name): (name, version) for name, version in installed if _normal(name) in KEEP}
    return [f"{name}=={version}" for _, (name, version) in sorted(found.items())]


def main() -> int:
    lines = constraints((d.metadata["Name"], d.version) for d in importlib.metadata.distributions())
    if not any(line.lower().startswith("torch==") for line in lines):
        print("error: no torch installed here: build on an NGC PyTorch image (BASE_IMAGE)", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
