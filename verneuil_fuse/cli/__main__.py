"""`python -m verneuil_fuse.cli ARGS`: verneuilctl ARGS."""
import sys

from verneuil_fuse.cli import main

if __name__ == "__main__":
    sys.exit(main())
