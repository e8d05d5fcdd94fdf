"""``python -m torch_stage.info``: print the build and runtime description as
JSON (see :func:`torch_stage.build_info`)."""

import json
import sys

from torch_stage import build_info


def main() -> int:
    json.dump(build_info(), sys.stdout, indent=2, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
