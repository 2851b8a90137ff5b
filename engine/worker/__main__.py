from engine.worker.cli import main

raise SystemExit(main())
