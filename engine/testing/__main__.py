"""``python -m engine.testing MODULE:FUNCTION RUN_DIR [ARGS...]``: one training attempt of the
fault-tolerance harness (see :func:`engine.testing.harness.main`)."""

import sys

from engine.testing.harness import main

sys.exit(main(sys.argv[1:]))
