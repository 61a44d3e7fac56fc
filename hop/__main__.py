"""``python -m hop``: the demo. See hop/_demo.py."""

from hop._demo import main

main()
