"""`ndif`: the admin commands (controlplane/cli.py) plus the data-plane ones as they land."""

from __future__ import annotations

import sys

from controlplane.cli import main as admin_main


def main(argv: list[str] | None = None) -> int:
    return admin_main(argv)


if __name__ == "__main__":
    sys.exit(main())
