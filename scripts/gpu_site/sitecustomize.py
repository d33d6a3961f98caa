"""With RCGRPO_GPU_MACHINE_ONLY=1 (and this folder on PYTHONPATH), only the lent GPU machine's packages import.

scripts/gpu_check.py puts this folder on every step's PYTHONPATH for ``--dry-run`` and ``--rehearse``, so each
process a step starts (torchrun's workers too) sees the package set of scripts/gpu_machine.txt plus the
carried wheels of scripts/gpu_wheels.txt, and nothing else installed here."""

import os
import sys

if os.environ.get("RCGRPO_GPU_MACHINE_ONLY") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        import gpu_machine

        gpu_machine.install_blocker()
    finally:
        sys.path.pop(0)
