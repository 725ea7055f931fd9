"""TACO's convergence comparison: ``scripts/convergence.py --family taco`` (kept for the commands recorded
in results/*/summary.md).

    python scripts/taco_convergence.py --preset cpu-tiny --out-dir taco_convergence_cpu
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from convergence import main  # noqa: E402

if __name__ == "__main__":
    main(family="taco")
