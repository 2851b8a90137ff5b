"""The ``sluicegate`` command: a thin dispatcher.

Each subcommand lives beside the code it drives and is imported only when chosen, so
``sluicegate gateway`` never loads torch and ``sluicegate capacity`` never loads Litestar.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "up": (
        "sluicegate.gateway.up",
        "start everything on this machine (embedded Postgres/Redis, gateway, engine)",
    ),
    "gateway": ("sluicegate.gateway.serve", "serve the HTTP gateway"),
    "migrate": ("sluicegate.gateway.db.migrate", "upgrade the database schema to head"),
    "keys": ("sluicegate.gateway.keys.cli", "create, list and revoke API keys"),
    "engine": ("sluicegate.engine.worker", "run an engine worker fed over Redis Streams"),
    "capacity": ("sluicegate.engine.capacity", "plan KV-cache capacity for a model on a GPU"),
}


def _usage() -> str:
    lines = ["usage: sluicegate COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"sluicegate: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    entry: Callable[[list[str]], int | None] = module.main
    return int(entry(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
