from orchestrator.interfaces.start import main

raise SystemExit(main())
