from sluicegate.engine.worker.cli import main

# Guarded: a spawned engine core process imports this module again as ``__mp_main__``.
if __name__ == "__main__":
    raise SystemExit(main())
