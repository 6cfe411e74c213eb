import sys

from evalkit.config import ConfigError
from evalkit.overrides import check_overrides
from evalkit.run import main

try:
    check_overrides(sys.argv[1:])  # before Hydra, whose answer to an unknown key is a `+key` hint
except ConfigError as e:
    print(f"evalkit: error: {e}", file=sys.stderr)
    sys.exit(2)
main()
