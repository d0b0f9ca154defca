"""`python -m core.controller STATE_DIR`: the detached controller process that `ggml-cluster up` starts."""

import sys

from core.controller.daemon import main

sys.exit(main())
