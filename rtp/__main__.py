"""``python -m rtp serve|generate ...``: the same as the ``rtp`` console script."""

import sys

from rtp.launcher import main

sys.exit(main())
