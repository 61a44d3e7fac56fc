"""``python -m hop``: the demo (hop/_demo.py); ``python -m hop --check``: a minute's
check that this install works (hop/_quick_check.py)."""

import sys

if "--check" in sys.argv[1:]:
    from hop._quick_check import main as check

    raise SystemExit(check(sys.argv[1:]))
from hop._demo import main

main()
