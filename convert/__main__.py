"""`python -m loopjax.convert HF_DIR OUT_DIR [--dtype ...]`."""

import sys

from loopjax.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
