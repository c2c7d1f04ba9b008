"""``launch``: the one command operators type."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    # NOTE: the serving pipeline is not wired yet; failing loudly beats pretending.
    print(
        "launch: the serving pipeline is not implemented yet (see the open issues)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
