"""``python -m mps_fused_adam.bench``: the benchmark's command (its code lives in ``tools.bench``)."""
import sys

from .tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
