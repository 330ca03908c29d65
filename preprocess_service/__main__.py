"""``python -m preprocess_service [flags]``: the same as ``pf-trl serve``."""

import sys

from preprocess_service.serve import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
